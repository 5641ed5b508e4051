"""GPU check of MMA_ROWSUM (row sum of P on the tensor cores) and LAZY_RESCALE (FA4's conditional O rescale) in the
Gluon fp8 attention forward (``fxopt/kernels/fp8_attention_gluon.py``, ``mma_rowsum=`` / ``lazy_rescale=``; module
docstring and docs/notes_fp8_rowsum_session10.md).

(a) Accuracy (B=1 H=4 S=2048 d=128, causal and not, N(0, 1) and FA3's outlier inputs; d=64 ragged causal with lse;
    Sq > Sk causal with fully masked rows; GQA): RMSE against float64 (``fp8_attention.attention_float64``) of the
    default build and of rowsum / lazy / both, max |diff| against the default. PASS: no NaN, RMSE <= 1.05 x the
    default's + 1e-4, fully masked rows exactly 0 with lse +inf, lse within 2e-2 of the default's.
(b) TFLOP/s, d = 128, H = 16, B * S = 16384, S in {4096, 16384}, causal and not, kernel alone: the four builds in
    rotated order for ``--rounds`` rounds, median per build; ``gain_*`` = TFLOP/s / default's. The issue-bound model
    (docs/notes_fp8_gluon_session7.md) predicts 817 x 489 / n (n = main-loop instructions per step): rowsum ~920.

Writes ``fp8_rowsum_check.json`` / ``.md`` into ``--out`` after every case (watchdog per case: a hang dumps the stacks
and exits). Without CUDA it prints that and exits with status 2.

    PYTHONUNBUFFERED=1 python benchmarks/fp8_rowsum_check.py --out $OUT          # ~2 minutes on an H200
"""
from __future__ import annotations

import math
import os

os.environ.setdefault("FXOPT_FP8_GLUON_UNCHECKED", "1")  # mma_rowsum failed this check once (session 11); it re-checks it
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, env_info, markdown_table, parse_args, round_order, save_state, try_bench_ms  # noqa: E402

import torch  # noqa: E402

NAME = "fp8_rowsum_check"
STATE = {"env": {}, "notes": [], "accuracy": [], "bench": []}
BUILDS = {"default": (False, False), "rowsum": (True, False), "lazy": (False, True), "both": (True, True)}


def _extra(p):
    p.add_argument("--builds", default="rowsum,lazy,both", help="builds besides the default")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (builds rotated each round)")
    p.add_argument("--case-timeout", type=float, default=90.0)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")


def _save(out_dir):
    save_state(out_dir, NAME, STATE, "Gluon fp8 attention: MMA_ROWSUM / LAZY_RESCALE",
               [("(a) accuracy vs float64 and vs the default build", "accuracy"),
                ("(b) TFLOP/s (kernel alone, median of rotated rounds)", "bench")])


def _rms(a, b):
    return math.sqrt(((a.double() - b.double()) ** 2).mean().item())


def accuracy_case(G, FA, builds, tag, B, Hq, Hkv, Sq, Sk, D, causal, kind, lse):
    row = dict(case=tag, Sq=Sq, Sk=Sk, D=D, causal=causal, inputs=kind)
    try:
        g = torch.Generator(device="cuda").manual_seed(len(tag))

        def make(H, S):
            x = torch.randn(B, H, S, D, device="cuda", generator=g)
            if kind == "outliers":
                x = x + torch.randn(B, H, S, D, device="cuda", generator=g) * 10.0 * (
                    torch.rand(B, H, S, D, device="cuda", generator=g) < 1e-3)
            return x.to(torch.bfloat16)

        q, k, v = make(Hq, Sq), make(Hkv, Sk), make(Hkv, Sk)
        grp = Hq // Hkv
        ref = FA.attention_float64(q, k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1), causal)
        qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
        kw = dict(shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv, out_dtype=q.dtype, is_causal=causal,
                  return_lse=lse)
        res0 = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, mma_rowsum=False, lazy_rescale=False, **kw)
        base = res0[0] if lse else res0
        row["rmse64_default"] = e0 = _rms(base, ref)
        ok = not bool(torch.isnan(base).any())
        for name in builds:
            mr, lz = BUILDS[name]
            res = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, mma_rowsum=mr, lazy_rescale=lz, **kw)
            out = res[0] if lse else res
            torch.cuda.synchronize()
            row[f"rmse64_{name}"] = e = _rms(out, ref)
            row[f"maxdiff_{name}"] = (out.float() - base.float()).abs().max().item()
            ok = ok and not bool(torch.isnan(out).any()) and e <= 1.05 * e0 + 1e-4
            if lse:
                empty = torch.isinf(res0[1])
                er = bool(torch.equal(torch.isinf(res[1]), empty)) and bool(
                    (out[empty.unsqueeze(-1).expand_as(out)] == 0).all())
                d = (res[1][~empty] - res0[1][~empty]).abs().max().item() if (~empty).any() else 0.0
                row[f"lse_maxdiff_{name}"] = d
                ok = ok and er and d < 2e-2
        row["status"] = "PASS" if ok else "FAIL"
    except Exception as e:
        row["status"] = "ERROR"
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    return row


def run_accuracy(G, FA, builds, args):
    cases = [("plain", 1, 4, 4, 2048, 2048, 128, False, "normal", False),
             ("causal", 1, 4, 4, 2048, 2048, 128, True, "normal", False),
             ("outliers", 1, 4, 4, 2048, 2048, 128, False, "outliers", False),
             ("outliers_causal", 1, 4, 4, 2048, 2048, 128, True, "outliers", True),
             ("d64_causal_ragged", 2, 3, 3, 1000, 1000, 64, True, "normal", True),
             ("empty_rows_sq_gt_sk", 1, 2, 2, 700, 300, 128, True, "normal", True),
             ("gqa_ragged", 2, 8, 2, 333, 1000, 128, False, "normal", True)]
    for tag, B, Hq, Hkv, Sq, Sk, D, causal, kind, lse in cases:
        arm_watchdog(args.case_timeout)
        t0 = time.time()
        row = accuracy_case(G, FA, builds, tag, B, Hq, Hkv, Sq, Sk, D, causal, kind, lse)
        row["sec"] = round(time.time() - t0, 1)
        STATE["accuracy"].append(row)
        print(f"[acc] {tag}: {row['status']} " + " ".join(
            f"{k}={v:.3g}" for k, v in row.items() if k.startswith(("rmse64", "maxdiff")) and v is not None),
            flush=True)
        _save(args.out)


def run_bench(G, builds, args):
    D, H = 128, 16
    names = ["default", *builds]
    for S in (4096, 16384):
        for causal in (False, True):
            arm_watchdog(args.case_timeout + 30 * args.rounds)
            B = 16384 // S
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
            kw = dict(shape_q=(B, H, S, D), seq_k=S, n_kv_heads=H, out_dtype=q.dtype, is_causal=causal)
            out = torch.empty_like(q)
            flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
            times = {n: [] for n in names}
            for r in range(args.rounds):
                order = round_order(names, r)
                for n in order:
                    mr, lz = BUILDS[n]
                    ms = try_bench_ms(lambda: G.fp8_gluon_attention_quantized(
                        qq, qs, kq, ks, vt, vs, out=out, mma_rowsum=mr, lazy_rescale=lz, **kw), False)
                    if ms:
                        times[n].append(ms)
            row = dict(S=S, B=B, causal=causal)
            for n in names:
                row[f"{n}_tflops"] = flops / (statistics.median(times[n]) * 1e-3) / 1e12 if times[n] else None
            t0 = row["default_tflops"]
            for n in builds:
                t = row[f"{n}_tflops"]
                row[f"gain_{n}"] = t / t0 if t and t0 else None
            STATE["bench"].append(row)
            print(f"[bench] S={S} causal={causal}: " + "  ".join(
                f"{n} {row[f'{n}_tflops']:.0f}" if row[f"{n}_tflops"] else f"{n} -" for n in names) + " TFLOP/s",
                flush=True)
            _save(args.out)
            del q, k, v, qq, kq, vt, out
            torch.cuda.empty_cache()


def main():
    args = parse_args("Gluon fp8 attention: MMA_ROWSUM / LAZY_RESCALE accuracy and TFLOP/s", _extra)
    if not torch.cuda.is_available():
        print("fp8_rowsum_check: needs a CUDA GPU (sm_90); nothing to do on this machine")
        return 2
    import fxopt.kernels.fp8_attention as FA
    import fxopt.kernels.fp8_attention_gluon as G

    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    bad = [b for b in builds if b not in BUILDS or b == "default"]
    if bad:
        raise SystemExit(f"unknown builds {bad}; choose from {list(BUILDS)[1:]}")
    STATE["env"] = env_info()
    STATE["args"] = vars(args)
    if G._GLUON_IMPORT_ERROR or G.device_capability(torch.device("cuda"))[0] != 9:
        STATE["notes"].append(f"not runnable: gluon {G._GLUON_IMPORT_ERROR}, capability "
                              f"{G.device_capability(torch.device('cuda'))}")
        _save(args.out)
        return 1
    STATE["notes"].append(f"default build: permute_k={G.PERMUTE_K_DEFAULT} cast_late={G.CAST_LATE_DEFAULT}; "
                          f"lazy TAU={G.LAZY_TAU} shift={G.LAZY_SHIFT}; rowsum wgmma N={G.RS_N}")
    if not args.skip_check:
        run_accuracy(G, FA, builds, args)
    if not args.skip_bench:
        run_bench(G, builds, args)
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    _save(args.out)
    print(markdown_table(STATE["accuracy"]))
    print(markdown_table(STATE["bench"]))
    return 0 if all(r["status"] == "PASS" for r in STATE["accuracy"]) else 1


if __name__ == "__main__":
    sys.exit(main())
