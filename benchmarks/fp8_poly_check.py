"""GPU check of POLY_EXP (exp2 partly on the FMA pipe) in the Gluon fp8 attention forward
(``fxopt/kernels/fp8_attention_gluon.py``, ``poly_exp=``; module docstring "POLY_EXP").

(a) Accuracy, B=1 H=4 S=2048 d=128 (causal and not, N(0, 1) and FA3's outlier inputs): RMSE of the default build
    (POLY_EXP 0) and of every POLY_EXP build against float64 attention (``fp8_attention.attention_float64``), and
    max |diff| / RMS diff against the default build on the same quantized tensors. PASS: no NaN, RMSE vs float64
    <= 1.05 x the default's + 1e-4, max diff vs default <= 2e-2 x max(1, max|o|) (P differs by <= 2^-13.7
    relative before its e4m3 rounding, so a few P round the other way), and a fully-masked-row case (Sq > Sk,
    causal: rows with no visible key) stays exactly 0 with lse +inf.
(b) TFLOP/s, d = 128, H = 16, 16k tokens per batch (B * S = 16384), S in {4096, 16384}, causal and not: the
    kernel alone (quantization excluded), default build vs POLY_EXP in ``--poly`` (default 1,2,3,4,8). Reports
    ``gain_p<K>`` = TFLOP/s(POLY_EXP K) / TFLOP/s(default).

Writes ``fp8_poly_check.json`` / ``.md`` into ``--out`` after every case (watchdog per case as in
fp8_gluon_check.py: a hang dumps the stacks and exits). Without CUDA it prints that and exits with status 2.

    PYTHONUNBUFFERED=1 python benchmarks/fp8_poly_check.py --out $OUT          # ~2 minutes on an H200
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, env_info, markdown_table, parse_args, save_state, try_bench_ms  # noqa: E402

import torch  # noqa: E402

NAME = "fp8_poly_check"
STATE = {"env": {}, "notes": [], "accuracy": [], "bench": []}


def _extra(p):
    p.add_argument("--poly", default="1,2,3,4,8", help="POLY_EXP values to check and time besides 0")
    p.add_argument("--case-timeout", type=float, default=120.0)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")


def _save(out_dir):
    save_state(out_dir, NAME, STATE, "Gluon fp8 attention: POLY_EXP (exp2 on the FMA pipe)",
               [("(a) accuracy vs float64 and vs the default build", "accuracy"), ("(b) TFLOP/s (kernel alone)",
                                                                                   "bench")])


def _rms(a, b):
    return math.sqrt(((a.double() - b.double()) ** 2).mean().item())


def accuracy_case(G, FA, polys, tag, B, H, Sq, Sk, D, causal, kind, lse=False):
    row = dict(case=tag, Sq=Sq, Sk=Sk, causal=causal, inputs=kind)
    try:
        g = torch.Generator(device="cuda").manual_seed(len(tag))

        def make(S):
            x = torch.randn(B, H, S, D, device="cuda", generator=g)
            if kind == "outliers":
                x = x + torch.randn(B, H, S, D, device="cuda", generator=g) * 10.0 * (
                    torch.rand(B, H, S, D, device="cuda", generator=g) < 1e-3)
            return x.to(torch.bfloat16)

        q, k, v = make(Sq), make(Sk), make(Sk)
        ref = FA.attention_float64(q, k, v, causal)
        qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
        kw = dict(shape_q=(B, H, Sq, D), seq_k=Sk, n_kv_heads=H, out_dtype=q.dtype, is_causal=causal,
                  return_lse=lse)
        res0 = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, poly_exp=0, **kw)
        base = res0[0] if lse else res0
        row["rmse64_p0"] = e0 = _rms(base, ref)
        lim = 2e-2 * max(1.0, base.abs().max().item())
        ok = not bool(torch.isnan(base).any())
        for pe in polys:
            res = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, poly_exp=pe, **kw)
            out = res[0] if lse else res
            torch.cuda.synchronize()
            row[f"rmse64_p{pe}"] = e = _rms(out, ref)
            row[f"maxdiff_p{pe}"] = d = (out.float() - base.float()).abs().max().item()
            row[f"rmsdiff_p{pe}"] = _rms(out, base)
            ok = ok and not bool(torch.isnan(out).any()) and e <= 1.05 * e0 + 1e-4 and d <= lim
            if lse:
                empty = torch.isinf(res0[1])  # rows with no visible key in the default build
                row[f"empty_rows_ok_p{pe}"] = er = bool(torch.equal(torch.isinf(res[1]), empty)) and bool(
                    (out[..., :, :][empty.unsqueeze(-1).expand_as(out)] == 0).all())
                row[f"lse_maxdiff_p{pe}"] = (res[1][~empty] - res0[1][~empty]).abs().max().item() if (
                    ~empty).any() else 0.0
                ok = ok and er
        row["status"] = "PASS" if ok else "FAIL"
    except Exception as e:
        row["status"] = "ERROR"
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    return row


def run_accuracy(G, FA, polys, args):
    cases = [("plain", 1, 4, 2048, 2048, 128, False, "normal", False),
             ("causal", 1, 4, 2048, 2048, 128, True, "normal", False),
             ("outliers", 1, 4, 2048, 2048, 128, False, "outliers", False),
             ("outliers_causal", 1, 4, 2048, 2048, 128, True, "outliers", False),
             ("d64_causal_ragged", 2, 3, 1000, 1000, 64, True, "normal", True),
             ("empty_rows_sq_gt_sk", 1, 2, 700, 300, 128, True, "normal", True)]
    for tag, B, H, Sq, Sk, D, causal, kind, lse in cases:
        arm_watchdog(args.case_timeout)
        t0 = time.time()
        row = accuracy_case(G, FA, polys, tag, B, H, Sq, Sk, D, causal, kind, lse)
        row["sec"] = round(time.time() - t0, 1)
        STATE["accuracy"].append(row)
        print(f"[acc] {tag}: {row['status']} " + " ".join(
            f"{k}={v:.3g}" for k, v in row.items() if k.startswith(("rmse64", "maxdiff")) and v is not None),
            flush=True)
        _save(args.out)


def run_bench(G, polys, args):
    D, H = 128, 16
    for S in (4096, 16384):
        for causal in (False, True):
            arm_watchdog(args.case_timeout + 60)
            B = 16384 // S
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v)
            kw = dict(shape_q=(B, H, S, D), seq_k=S, n_kv_heads=H, out_dtype=q.dtype, is_causal=causal)
            out = torch.empty_like(q)
            flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
            row = dict(S=S, B=B, causal=causal)
            for pe in (0, *polys):
                ms = try_bench_ms(lambda: G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, out=out,
                                                                          poly_exp=pe, **kw), False)
                row[f"p{pe}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
            t0 = row["p0_tflops"]
            for pe in polys:
                t = row[f"p{pe}_tflops"]
                row[f"gain_p{pe}"] = t / t0 if t and t0 else None
            STATE["bench"].append(row)
            print(f"[bench] S={S} causal={causal}: " + "  ".join(
                f"p{pe} {row[f'p{pe}_tflops']:.0f}" if row[f"p{pe}_tflops"] else f"p{pe} -" for pe in (0, *polys))
                + " TFLOP/s", flush=True)
            _save(args.out)
            del q, k, v, qq, kq, vt, out
            torch.cuda.empty_cache()


def main():
    args = parse_args("Gluon fp8 attention: POLY_EXP accuracy and TFLOP/s", _extra)
    if not torch.cuda.is_available():
        print("fp8_poly_check: needs a CUDA GPU (sm_90); nothing to do on this machine")
        return 2
    import fxopt.kernels.fp8_attention as FA
    import fxopt.kernels.fp8_attention_gluon as G

    polys = tuple(G.resolve_poly_exp(int(x)) for x in args.poly.split(",") if x.strip())
    polys = tuple(p for p in polys if p)
    STATE["env"] = env_info()
    STATE["args"] = vars(args)
    if G._GLUON_IMPORT_ERROR or G.device_capability(torch.device("cuda"))[0] != 9:
        STATE["notes"].append(f"not runnable: gluon {G._GLUON_IMPORT_ERROR}, capability "
                              f"{G.device_capability(torch.device('cuda'))}")
        _save(args.out)
        return 1
    STATE["notes"].append(f"default build: permute_k={G.PERMUTE_K_DEFAULT} cast_late={G.CAST_LATE_DEFAULT}; "
                          f"POLY_EXP values {polys} (of every {G.POLY_EXP_PACK} per-thread exp2s)")
    if not args.skip_check:
        run_accuracy(G, FA, polys, args)
    if not args.skip_bench:
        run_bench(G, polys, args)
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    _save(args.out)
    print(markdown_table(STATE["accuracy"]))
    print(markdown_table(STATE["bench"]))
    return 0 if all(r["status"] == "PASS" for r in STATE["accuracy"]) else 1


if __name__ == "__main__":
    sys.exit(main())
