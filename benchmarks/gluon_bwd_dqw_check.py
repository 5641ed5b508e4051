"""Gluon attention backward at d = 128 (and d = 64): variant 3 against the dQ-through-smem kernels
(``attention_gluon_bwd_dqw.gluon_attention_bwd_dqw``: dQ -> shared memory -> a reducer warp's v4 reductions; since
session 12 that is ``gluon_attention_bwd(..., variant=5)``, the constexpr ``DQW`` of variant 3's kernel, with the
same offline SASS as the session-11 separate kernel). d = 128: the op routes dqw; d = 64: the op routes the Triton
backward (variant 3 lost to it by 1-7%), dqw at d = 64 is new in session 12 and not GPU-checked before this script.
Session 14 adds "dqtma" (variant 6: the reducer warp's global reductions done by TMA, ``cp.reduce.async.bulk.tensor``;
``--kernels`` picks the set).

1. correctness of both against the float64 backward (``fxopt.testing.attention_bwd_reference64``) on 4 cases (bf16 /
   fp16, causal or not, GQA, ragged) per head dim of ``--dims``; dK / dV of dqw must be bit-identical to variant 3
   (same per-warpgroup arithmetic and order);
2. timing per head dim d of ``--dims``: H = 2048 / d (16 at d = 128, 32 at d = 64), 16k tokens (B = 16384 / S), S in
   ``--seqs``, causal and not, bf16; per (d, shape, kernel) the median of ``triton.testing.do_bench`` medians over
   ``--rounds`` rounds, kernels in rotated order; TFLOP/s on 10 B H S^2 d (halved causal); cycles per CTA step at the
   SM clock sampled by nvidia-smi under load.

Every launch re-arms a ``faulthandler`` watchdog (a protocol hang must not eat the device call); results (json + md)
are written after every measurement.

    python benchmarks/gluon_bwd_dqw_check.py --out $OUT                 # d = 128 and 64, < 5 minutes on an H200
    python benchmarks/gluon_bwd_dqw_check.py --dims 64 --out $OUT       # d = 64 only
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

os.environ.setdefault("FXOPT_ATTN_AUTOTUNE", "0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, env_info, markdown_table, round_order, save_state  # noqa: E402
from gluon_bwd_ablation import cta_steps, measure_clock  # noqa: E402

import torch  # noqa: E402

NAME = "gluon_bwd_dqw_check"
STATE = {"env": None, "args": None, "clock": None, "correctness": [], "rows": [], "summary": [], "notes": []}
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}   # tests/test_attention_gluon_bwd_v4.py
CASES = {  # (B, Hq, Hkv, Sq, Sk, causal, dtype)
    "S2048_nc_bf16": (1, 4, 4, 2048, 2048, False, torch.bfloat16),
    "S200_c_fp16": (2, 2, 2, 200, 200, True, torch.float16),
    "ragged_S2100_c_gqa4:2": (1, 4, 2, 2100, 2100, True, torch.bfloat16),
    "gqa8:1_S333_nc_fp16": (1, 8, 1, 333, 333, False, torch.float16),
}


def _args():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--dims", default="128,64", help="head dims (64 and / or 128); H = 2048 / d")
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--kernels", default="v3,dqw,dqtma",
                   help="comma list of v3 (variant 3), dqw (variant 5), dqtma (variant 6: dQ by TMA reduce-add)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--launch-timeout", type=float, default=90.0)
    return p.parse_args()


def _save(out):
    save_state(out, NAME, STATE, "Gluon attention backward d = 128 / 64: variant 3 vs dQ through shared memory (dqw)",
               [("Correctness vs float64", "correctness"), ("Timing (median over rounds)", "summary"),
                ("Every measurement", "rows")])


def main():
    args = _args()
    STATE["args"] = vars(args)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)")
        return 2
    t_start = time.time()
    arm_watchdog(args.launch_timeout + 60)
    STATE["env"] = env_info()
    import triton.testing

    import fxopt.kernels.attention_gluon_bwd as GB
    import fxopt.kernels.attention_gluon_bwd_dqw as DQW
    from fxopt.kernels.attention import flash_attention_triton
    from fxopt.testing import attention_bwd_reference64

    if GB._GLUON_IMPORT_ERROR:
        print(f"gluon unavailable: {GB._GLUON_IMPORT_ERROR}")
        return 1
    known = {"v3": lambda *a, **kw: GB.gluon_attention_bwd(*a, variant=3, **kw),
             "dqw": DQW.gluon_attention_bwd_dqw,
             "dqtma": lambda *a, **kw: GB.gluon_attention_bwd(*a, variant=GB.DQ_TMA_VARIANT, **kw)}
    wanted = ["v3"] + [x for x in args.kernels.split(",") if x and x != "v3"]
    if any(x not in known for x in wanted):
        print(f"--kernels: unknown {[x for x in wanted if x not in known]} (known: {sorted(known)})")
        return 2
    kernels = {x: known[x] for x in wanted}
    dims = [int(x) for x in args.dims.split(",")]
    bad = [d for d in dims if d not in DQW.HEAD_DIMS]
    if bad:
        print(f"--dims: head dims {bad} not supported by dqw (only {DQW.HEAD_DIMS})")
        return 2
    ok_all = True
    for D in dims:
        for name, (B, Hq, Hkv, Sq, Sk, causal, dtype) in CASES.items():
            arm_watchdog(args.launch_timeout)
            gen = torch.Generator(device="cuda").manual_seed(4321)
            q, dout = (torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
            k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
            out, lse, rdq, rdk, rdv, empty = attention_bwd_reference64(q, k, v, dout, causal, 1 / math.sqrt(D))
            out, lse = out.to(dtype), lse.float()
            res = {kn: fn(dout, q, k, v, out, lse, causal=causal) for kn, fn in kernels.items()}
            torch.cuda.synchronize()
            ok_all &= _check_case(D, name, dtype, res, rdq, rdk, rdv, args.out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(D, int(S), c) for D in dims for S in args.seqs.split(",") for c in (False, True)]
    inputs = {}
    for D, S, causal in shapes:
        B, H = 16384 // S, 2048 // D
        gen = torch.Generator(device="cuda").manual_seed(S + causal)
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        arm_watchdog(args.launch_timeout + 60)
        out, lse = flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        inputs[(D, S, causal)] = (q, k, v, dout, out, lse)

    def call(D, S, causal, kn):
        q, k, v, dout, out, lse = inputs[(D, S, causal)]
        return kernels[kn](dout, q, k, v, out, lse, causal=causal)

    D_clk, S_big = dims[0], max(S for _, S, _ in shapes)
    arm_watchdog(args.launch_timeout + 30)
    STATE["clock"] = measure_clock(lambda: call(D_clk, S_big, False, "v3"))
    ghz = STATE["clock"]["ghz"]
    names = list(kernels)
    times = {}
    for r in range(args.rounds):
        order = round_order(names, r)
        for D, S, causal in shapes:
            for kn in order:
                arm_watchdog(args.launch_timeout)
                fn = lambda: call(D, S, causal, kn)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                ms = float(triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median"))
                times.setdefault((D, S, causal, kn), []).append(ms)
                STATE["rows"].append(dict(round=r, D=D, S=S, causal=causal, kernel=kn, ms=ms))
                _save(args.out)
        print(f"round {r} done ({time.time() - t_start:.0f} s)", flush=True)
    arm_watchdog(120)
    for D, S, causal in shapes:
        B, H = 16384 // S, 2048 // D
        flops = 10.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        steps = cta_steps(S, B, H, 1, causal)
        base = statistics.median(times[(D, S, causal, "v3")])
        for kn in names:
            ms = statistics.median(times[(D, S, causal, kn)])
            STATE["summary"].append(dict(
                D=D, S=S, causal=causal, kernel=kn, ms=ms,
                spread_pct=100 * (max(times[(D, S, causal, kn)]) - min(times[(D, S, causal, kn)])) / ms,
                tflops=flops / (ms * 1e-3) / 1e12, cycles_per_step=ms * 1e-3 * ghz * 1e9 * sms / steps,
                speedup_vs_v3=base / ms))
    STATE["notes"].append(f"correctness: {'all ok' if ok_all else 'FAILURES (see table)'}")
    STATE["notes"].append(f"clock {ghz:.3f} GHz ({STATE['clock']['source']}), {sms} SMs; total "
                          f"{time.time() - t_start:.0f} s")
    _save(args.out)
    print(markdown_table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
                          for row in STATE["summary"]]))
    print(f"wrote {args.out}/{NAME}.json and .md ({time.time() - t_start:.0f} s)", flush=True)
    return 0 if ok_all else 1


def _check_case(D, name, dtype, res, rdq, rdk, rdv, out_dir) -> bool:
    """One correctness row (errors against float64 for each kernel, dK / dV bitwise v3 == dqw); True if all ok."""
    row = dict(D=D, case=name)
    ok_all = True
    for kn, (dq, dk, dv) in res.items():
        errs = []
        for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
            lim = TOL[dtype] * 2 * max(1.0, want.abs().max().item())
            errs.append(((got.double() - want).abs().max().item(), lim))
        row[f"{kn}_err_dq/dk/dv"] = " / ".join(f"{e:.2e}" for e, _ in errs)
        row[f"{kn}_ok"] = all(e <= lim for e, lim in errs) and not any(torch.isnan(t).any().item()
                                                                       for t in (dq, dk, dv))
        ok_all &= row[f"{kn}_ok"]
    for kn in res:
        if kn != "v3":  # same per-warpgroup dK / dV arithmetic and order as variant 3
            row[f"{kn}_dk_dv_bitwise_equal_v3"] = bool(torch.equal(res[kn][1], res["v3"][1])
                                                      and torch.equal(res[kn][2], res["v3"][2]))
            ok_all &= row[f"{kn}_dk_dv_bitwise_equal_v3"]
    STATE["correctness"].append(row)
    print(row, flush=True)
    _save(out_dir)
    return ok_all


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
