"""GPU check of the Gluon FA3-style forward (``fxopt/kernels/attention_gluon.py``): correctness, then TFLOP/s.

(a) Correctness on random inputs (randn, never zeros) against a float64 reference (fp32 for S > 2048): max abs
    error of O and of the natural-log LSE per case, PASS / FAIL with the tolerance of
    tests/test_attention_kernels.py (bf16 2.5e-2, fp16 3e-3, times max(1, max |ref|)). Extra cases: ragged S,
    causal with Sq < Sk (bottom-right) and Sq > Sk (rows with no key: O = 0, LSE = +inf), GQA, a transposed
    [B, S, H, D] view, a custom scale, and inputs the wrapper must refuse with ValueError.
(b) Forward TFLOP/s, 16k tokens per batch (B * S = 16384), H = 16 at d = 128 and H = 32 at d = 64, S in
    {1024, 4096, 8192, 16384}, causal and not: the Gluon kernel, the Triton kernel (``flash_attention_triton``),
    SDPA with the cuDNN backend and with the flash (FA2) backend. FLOPs = 4 B H S^2 d, halved for causal.

Writes ``gluon_attention_check.json`` / ``.md`` into ``--out`` (default benchmarks/results) after every case, so a
crash or a hang keeps what was measured. A wrong mbarrier phase deadlocks the GPU: every case re-arms a
``faulthandler`` watchdog that prints the Python stacks and ``os._exit``s the process (``--case-timeout``).

    python benchmarks/gluon_attention_check.py --quick --out $OUT     # about 1-2 minutes
    python benchmarks/gluon_attention_check.py --out $OUT             # full grid
    python benchmarks/gluon_attention_check.py --skip-bench           # correctness only
"""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (arm_watchdog, env_info, markdown_table, parse_args, save_state,  # noqa: E402
                    try_bench_ms)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

NAME = "gluon_attention_check"
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}
STATE = {"env": None, "args": None, "correctness": [], "bench": [], "notes": []}


def _extra(p):
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds one case (compile included) may take before the watchdog kills the process")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")


# ----------------------------------------------------------------------------------------------------------------
# bookkeeping
# ----------------------------------------------------------------------------------------------------------------


def _arm(seconds: float) -> None:
    arm_watchdog(seconds)


def _save(out_dir: str) -> None:
    save_state(out_dir, NAME, STATE, "Gluon FA3-style forward: correctness and speed",
               [("Correctness", "correctness"),
                ("Forward TFLOP/s (ratios: gluon / cuDNN, gluon / FA2, triton / cuDNN)", "bench")])


# ----------------------------------------------------------------------------------------------------------------
# (a) correctness
# ----------------------------------------------------------------------------------------------------------------


def reference(q, k, v, causal, scale, dtype):
    """out, lse (natural log, +inf for rows with no visible key) in `dtype` (float64 / float32)."""
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)
    Sq, Sk = q.shape[2], k.shape[2]
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    p = torch.where(empty[..., None], torch.zeros_like(p), p)
    out = torch.matmul(p, vf)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out, lse, empty


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(H, S):
        if layout == "bshd":  # [B, S, H, D] storage viewed as [B, H, S, D]
            return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)

    return mk(Hq, Sq), mk(Hkv, Sk), mk(Hkv, Sk)


def check_case(G, tag, B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale=None, layout="bhsd"):
    row = dict(case=tag, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, d=D, dtype=str(dtype).replace("torch.", ""),
               causal=causal, layout=layout)
    t0 = time.time()
    try:
        q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout)
        sc = scale if scale is not None else 1.0 / math.sqrt(D)
        out, lse = G.gluon_attention_fwd(q, k, v, causal=causal, scale=scale)
        torch.cuda.synchronize()
        ref_dtype = torch.float64 if max(Sq, Sk) <= 2048 else torch.float32
        ro, rl, empty = reference(q, k, v, causal, sc, ref_dtype)
        nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
        err_o = (out.to(ref_dtype) - ro).abs().max().item()
        fin = ~empty
        err_l = (lse.to(ref_dtype)[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
        lim_o = TOL[dtype] * max(1.0, ro.abs().max().item())
        lim_l = TOL[dtype] * max(1.0, rl[fin].abs().max().item() if fin.any() else 1.0)
        empty_ok = True
        if empty.any():  # rows with no visible key: exactly 0 output and +inf lse
            empty_ok = bool((out[empty.unsqueeze(-1).expand_as(out)] == 0).all() and torch.isposinf(lse[empty]).all())
        ok = (not nan) and err_o <= lim_o and err_l <= lim_l and empty_ok
        row.update(err_o=err_o, lim_o=lim_o, err_lse=err_l, lim_lse=lim_l, empty_rows=int(empty.sum().item()),
                   empty_ok=empty_ok, nan=nan, status="PASS" if ok else "FAIL")
    except Exception as e:  # one failure must not stop the rest
        row.update(status="ERROR", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        traceback.print_exc()
    row["sec"] = round(time.time() - t0, 2)
    print(f"[check] {tag:28s} {row['status']:5s} err_o={row.get('err_o', float('nan')):.3e} "
          f"(lim {row.get('lim_o', float('nan')):.1e}) err_lse={row.get('err_lse', float('nan')):.3e} "
          f"{row.get('error', '')}", flush=True)
    return row


def refuse_case(G, tag, make):
    """Inputs the wrapper must refuse with ValueError (so the caller can fall back)."""
    row = dict(case=tag)
    try:
        q, k, v = make()
        reason = G.gluon_supported(q, k, v, False)
        try:
            G.gluon_attention_fwd(q, k, v)
            row.update(status="FAIL", error=f"no ValueError (gluon_supported said {reason!r})")
        except ValueError as e:
            row.update(status="PASS" if reason else "FAIL", error=str(e)[:200])
    except Exception as e:
        row.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:300])
    print(f"[check] {tag:28s} {row['status']:5s} {row.get('error', '')}", flush=True)
    return row


def run_checks(G, args):
    cases = []
    seqs = [128, 200, 1024] if args.quick else [128, 200, 1024, 4096]
    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            if args.quick and dtype == torch.float16 and D == 64:
                continue
            for S in seqs:
                if args.quick and dtype == torch.float16 and S == 128:
                    continue
                for causal in (False, True):
                    B, H = (1, 2) if S >= 4096 else (2, 2)
                    tag = f"S{S}_d{D}_{'c' if causal else 'nc'}_{str(dtype)[6:]}"
                    cases.append((tag, dict(B=B, Hq=H, Hkv=H, Sq=S, Sk=S, D=D, dtype=dtype, causal=causal)))
    bf = torch.bfloat16
    cases += [
        ("causal_Sq100_Sk300_d128", dict(B=1, Hq=2, Hkv=2, Sq=100, Sk=300, D=128, dtype=bf, causal=True)),
        ("causal_Sq300_Sk100_empty", dict(B=1, Hq=2, Hkv=2, Sq=300, Sk=100, D=128, dtype=bf, causal=True)),
        ("noncausal_Sq77_Sk333_d64", dict(B=1, Hq=2, Hkv=2, Sq=77, Sk=333, D=64, dtype=bf, causal=False)),
        ("gqa_Hq4_Hkv2_d64", dict(B=2, Hq=4, Hkv=2, Sq=256, Sk=256, D=64, dtype=bf, causal=True)),
        ("bshd_view_d128", dict(B=2, Hq=3, Hkv=3, Sq=384, Sk=384, D=128, dtype=bf, causal=False, layout="bshd")),
        ("scale0.3_d128", dict(B=1, Hq=2, Hkv=2, Sq=256, Sk=256, D=128, dtype=bf, causal=False, scale=0.3)),
        ("Sq1_Sk50", dict(B=2, Hq=2, Hkv=2, Sq=1, Sk=50, D=128, dtype=bf, causal=False)),
    ]
    if not args.quick:
        cases += [("d256_S1024_nc", dict(B=1, Hq=2, Hkv=2, Sq=1024, Sk=1024, D=256, dtype=bf, causal=False)),
                  ("d256_S333_c", dict(B=1, Hq=2, Hkv=2, Sq=333, Sk=333, D=256, dtype=bf, causal=True))]
    for tag, kw in cases:
        _arm(args.case_timeout)
        STATE["correctness"].append(check_case(G, tag, **kw))
        _save(args.out)

    def noncontig():
        x = torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16)
        return x.transpose(2, 3), x, x

    refusals = [
        ("refuse_last_dim_stride", noncontig),
        ("refuse_fp32", lambda: tuple(torch.randn(1, 1, 64, 64, device="cuda") for _ in range(3))),
        ("refuse_d96", lambda: tuple(torch.randn(1, 1, 64, 96, device="cuda", dtype=torch.bfloat16)
                                     for _ in range(3))),
        ("refuse_cpu", lambda: tuple(torch.randn(1, 1, 64, 64, dtype=torch.bfloat16) for _ in range(3))),
    ]
    for tag, make in refusals:
        _arm(args.case_timeout)
        STATE["correctness"].append(refuse_case(G, tag, make))
        _save(args.out)
    n_bad = sum(r["status"] != "PASS" for r in STATE["correctness"])
    print(f"[check] {len(STATE['correctness']) - n_bad} / {len(STATE['correctness'])} PASS", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# (b) speed
# ----------------------------------------------------------------------------------------------------------------


def _bench(fn, quick):
    return try_bench_ms(fn, quick)


def _sdpa(backend, causal):
    from torch.nn.attention import sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return f


def run_bench(G, args):
    from torch.nn.attention import SDPBackend

    from fxopt.kernels.attention import flash_attention_triton

    if args.quick:
        rows = [(128, 4096, False), (128, 4096, True), (128, 16384, False), (128, 16384, True), (64, 4096, False)]
    else:
        rows = [(d, S, c) for d in (128, 64) for S in (1024, 4096, 8192, 16384) for c in (False, True)]
    for D, S, causal in rows:
        _arm(args.case_timeout + 60)
        B, H = 16384 // S, (16 if D == 128 else 32)
        q, k, v = _inputs(B, H, H, S, S, D, torch.bfloat16)
        flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        impls = {
            "gluon": lambda: G.gluon_attention_fwd(q, k, v, causal=causal),
            "triton": lambda: flash_attention_triton(q, k, v, is_causal=causal, return_lse=True),
            "cudnn": lambda f=_sdpa(SDPBackend.CUDNN_ATTENTION, causal): f(q, k, v),
            "fa2": lambda f=_sdpa(SDPBackend.FLASH_ATTENTION, causal): f(q, k, v),
        }
        row = dict(d=D, S=S, B=B, H=H, causal=causal)
        for name, fn in impls.items():
            ms = _bench(fn, args.quick)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = (flops / (ms * 1e-3) / 1e12) if ms else None
        tf = {n: row[f"{n}_tflops"] for n in impls}
        row["gluon/cudnn"] = tf["gluon"] / tf["cudnn"] if tf["gluon"] and tf["cudnn"] else None
        row["gluon/fa2"] = tf["gluon"] / tf["fa2"] if tf["gluon"] and tf["fa2"] else None
        row["triton/cudnn"] = tf["triton"] / tf["cudnn"] if tf["triton"] and tf["cudnn"] else None
        STATE["bench"].append(row)
        print(f"[bench] d={D} S={S} causal={causal}: " + "  ".join(
            f"{n} {tf[n]:.0f}" if tf[n] else f"{n} -" for n in impls) + " TFLOP/s", flush=True)
        _save(args.out)
        del q, k, v
        torch.cuda.empty_cache()


def main():
    args = parse_args("Gluon FA3-style attention forward: correctness and TFLOP/s", _extra)
    STATE["args"] = vars(args)
    t_start = time.time()
    _arm(args.case_timeout)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)")
        return 2
    STATE["env"] = env_info()
    import fxopt.kernels.attention_gluon as G

    if G._GLUON_IMPORT_ERROR:
        STATE["notes"].append(f"gluon unavailable: {G._GLUON_IMPORT_ERROR}")
        _save(args.out)
        print(STATE["notes"][-1])
        return 1
    STATE["notes"].append(f"configs: { {d: G.config_for(d) for d in (64, 128, 256)} }")
    if not args.skip_check:
        run_checks(G, args)
    if not args.skip_bench:
        run_bench(G, args)
    faulthandler.cancel_dump_traceback_later()
    STATE["notes"].append(f"total {time.time() - t_start:.0f} s")
    _save(args.out)
    print("\n## Correctness\n" + markdown_table(
        [{k: r.get(k) for k in ("case", "status", "err_o", "lim_o", "err_lse", "empty_rows", "error")}
         for r in STATE["correctness"]]))
    cols = ("d", "S", "causal", "gluon_tflops", "triton_tflops", "cudnn_tflops", "fa2_tflops", "gluon/cudnn",
            "gluon/fa2", "triton/cudnn")
    print("## Forward TFLOP/s (bf16, 16k tokens per batch)\n" + markdown_table(
        [{k: r.get(k) for k in cols} for r in STATE["bench"]]))
    print(f"wrote {args.out}/{NAME}.json and .md ({time.time() - t_start:.0f} s)")
    return 0 if all(r["status"] == "PASS" for r in STATE["correctness"]) else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on a GPU that may still be stuck in a kernel
