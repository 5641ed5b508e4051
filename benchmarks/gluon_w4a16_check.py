"""Gluon W4A16 kernel (fxopt/kernels/w4a16_gluon.py): correctness of every candidate config, then timing against
fxopt's current op (tuned Triton kernels) and bf16 F.linear (cuBLAS). H200 / sm_90 only.

(a) correctness: K x N in {1024 x 1024, 4096 x 11008}, M in {16, 64, 128, 256}, bf16, random codes / scales / integer
    zeros packed with fxopt's own helpers; max error relative to max |ref| against the float64 dequantized reference
    (PASS if <= 1.6e-2, the bf16 tolerance of tests/test_w4a16_kernels.py).
(b) timing: CUDA-graph replays of 48 back-to-back calls, each on the next of several weight copies (> 3x L2), as in
    benchmarks/w4a16.py (``streamed_us``). x is prepared (FRAG order) inside the timed call, as the op would.
A watchdog kills the process (after dumping stacks) if anything hangs: a wrong mbarrier phase deadlocks the GPU.

    python benchmarks/gluon_w4a16_check.py --quick --out $OUT
"""
from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arm_watchdog, parse_args, write_results  # noqa: E402
from w4a16 import rotations, streamed_us as _streamed_us  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fxopt.kernels import w4a16 as K4  # noqa: E402
from fxopt.kernels import w4a16_gluon as KG  # noqa: E402
from fxopt.quant.format import dequantize, pack_int4  # noqa: E402

G = 128
CHECK_SHAPES = [(1024, 1024), (4096, 11008)]
CHECK_MS = [16, 64, 128, 256]
TIME_SHAPES = [(8192, 8192), (4096, 11008), (11008, 4096), (8192, 28672)]
TIME_MS = [16, 32, 64, 128, 256]
QUICK_TIME = [((8192, 8192), [16, 64, 256]), ((8192, 28672), [64])]


def make_packed(K, N, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (K, N), generator=g)
    qweight = pack_int4(codes)
    scales = (torch.rand(K // G, N, generator=g) * 0.02 + 0.005).bfloat16()
    zeros = torch.randint(4, 12, (K // G, N), generator=g).bfloat16()
    return qweight.to(device), scales.to(device), zeros.to(device)


def check(args, deadline):
    rows = []
    for K, N in CHECK_SHAPES:
        q, s, z = make_packed(K, N)
        w64 = dequantize(q.cpu(), s.cpu(), z.cpu(), G, dtype=torch.float64)
        for M in CHECK_MS:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
            ref = x.double() @ w64.T
            bias = torch.randn(N).bfloat16()
            for cfg in KG.gluon_w4a16_configs(M, K, N):
                for use_bias in (False, True):
                    if time.time() > deadline:
                        print("check: time budget spent, skipping the rest", flush=True)
                        return rows
                    row = {"K": K, "N": N, "M": M, "bias": use_bias, **{k: v for k, v in cfg.items()}}
                    try:
                        b = bias.cuda() if use_bias else None
                        y = KG.gluon_w4a16_mm(x.cuda(), q, s, z, G, b, **cfg)
                        torch.cuda.synchronize()
                        r = ref + (bias.double() if use_bias else 0)
                        err = ((y.cpu().double() - r).abs().max() / r.abs().max()).item()
                        row.update(rel_err=err, result="PASS" if err <= 1.6e-2 else "FAIL")
                    except Exception as e:  # noqa: BLE001
                        row.update(rel_err=float("nan"), result=f"ERROR {type(e).__name__}: {str(e)[:160]}")
                        traceback.print_exc()
                    rows.append(row)
                    print(f"check K={K} N={N} M={M} bias={use_bias} {cfg}: {row['result']} "
                          f"(max rel err {row['rel_err']:.3g})", flush=True)
                    if args.quick:
                        break  # one bias variant per config in quick mode
    return rows


def streamed_us(fn, items):
    return _streamed_us(fn, items, reps=10)  # benchmarks/w4a16.py's method, fewer replays


def bench(args, deadline):
    plan = QUICK_TIME if args.quick else [(s, TIME_MS) for s in TIME_SHAPES]
    rows = []
    for (K, N), ms in plan:
        sets = []
        for i in range(rotations(K * N // 2)):
            q = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
            s = (torch.rand(K // G, N, device="cuda") * 0.02 + 0.005).bfloat16()
            z = torch.randint(4, 12, (K // G, N), device="cuda").bfloat16()
            sets.append((q, s, z))
        bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotations(K * N * 2))]
        for M in ms:
            if time.time() > deadline:
                print("bench: time budget spent, skipping the rest", flush=True)
                return rows
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            q0, s0, z0 = sets[0]
            cfg_ours = K4.choose_config(x, q0, s0, z0, G)  # tune outside the timed region
            t_bf = streamed_us(lambda w: F.linear(x, w), bf)
            t_ours = streamed_us(lambda it: torch.ops.fxopt.w4a16_linear(x, *it, G), sets)
            best, best_t = None, float("inf")
            for cfg in KG.gluon_w4a16_configs(M, K, N):
                try:
                    t = streamed_us(lambda it: KG.gluon_w4a16_mm(x, *it, G, check_zeros=False, **cfg), sets)
                except Exception as e:  # noqa: BLE001
                    print(f"  gluon {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"  K={K} N={N} M={M} gluon {cfg}: {t:.1f} us", flush=True)
                if t < best_t:
                    best, best_t = cfg, t
            row = {"K": K, "N": N, "M": M, "gluon_us": best_t, "fxopt_us": t_ours, "bf16_us": t_bf,
                   "gluon_vs_bf16": t_bf / best_t, "fxopt_vs_bf16": t_bf / t_ours, "gluon_vs_fxopt": t_ours / best_t,
                   "gluon_cfg": "" if best is None else
                   f"bm{best['block_m']} bn{best['block_n']} s{best['stages']} kc{best['kc']}",
                   "fxopt_cfg": f"{cfg_ours.method} bm{cfg_ours.block_m} bn{cfg_ours.block_n} sk{cfg_ours.split_k}"}
            rows.append(row)
            print(f"K={K} N={N} M={M}: gluon {best_t:.1f} us, fxopt {t_ours:.1f}, bf16 {t_bf:.1f}", flush=True)
        del sets, bf
        torch.cuda.empty_cache()
    return rows


def main():
    def extra(p):
        p.add_argument("--watchdog", type=float, default=0, help="hard-exit after this many seconds (0: auto)")
        p.add_argument("--skip-bench", action="store_true")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    total = args.watchdog or (170 if args.quick else 1500)
    arm_watchdog(total)
    t0 = time.time()
    if not KG.HAS_GLUON or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs Triton Gluon and an sm_90 GPU", flush=True)
        return
    check_rows = check(args, t0 + total * 0.4)
    write_results("gluon_w4a16_check", check_rows, title="Gluon W4A16: correctness vs float64 reference",
                  out_dir=args.out)
    n_fail = sum(r["result"] != "PASS" for r in check_rows)
    print(f"correctness: {len(check_rows) - n_fail} PASS, {n_fail} FAIL/ERROR", flush=True)
    if not args.skip_bench:
        bench_rows = bench(args, t0 + total * 0.92)
        write_results("gluon_w4a16_bench", bench_rows, out_dir=args.out,
                      title="Gluon W4A16 vs fxopt op vs bf16 F.linear (us per call, streamed CUDA graphs)",
                      notes="streamed: 48 calls per graph on rotated weight copies (> 3x L2). gluon_us: best "
                            "gluon config; x FRAG-prep kernel included in gluon and fxopt times.")
    faulthandler.cancel_dump_traceback_later()
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not wait on a possibly wedged context at interpreter exit


if __name__ == "__main__":
    main()
