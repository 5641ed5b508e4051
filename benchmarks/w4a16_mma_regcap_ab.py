"""A/B of a register cap on the M <= 8 mma.sync W4A16 kernel (session 16): more resident CTAs for a latency-bound loop.

Nsight Compute (``benchmarks/results/ncu_s16/ncu_w4_*``) found the M = 1 kernel stalled on memory (long scoreboard
3.5-4.5 cycles per issued instruction) with 47-61% of DRAM bandwidth, at 128 registers: 4 CTAs of 4 warps per SM.
``MmaConfig(maxnreg=96)`` gives 5 CTAs for 48 B of stack and +5.6% loop instructions (offline sm_90 SASS). Each row:
the tuner's M <= 8 tile (32 columns per warp, 4 warps, prefetch 1, PDL) with and without the cap, the split-K chosen
for the resident CTAs of each, output checked against the float64 dequantized reference; per-call time of 48 calls
back to back in one CUDA graph, rotating weight copies that together exceed 3x L2, bf16 ``F.linear`` the anchor.

    python benchmarks/w4a16_mma_regcap_ab.py [--caps 96,88] [--ms 1,4,8] [--out DIR]
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, streamed_us, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fxopt.kernels import w4a16_mma as W  # noqa: E402
from fxopt.quant.format import dequantize  # noqa: E402

SHAPES = ((8192, 8192), (4096, 11008), (11008, 4096), (8192, 28672))
G = 128


def packed(K, N, gen):
    q = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda", generator=gen)
    s = (torch.rand(K // G, N, device="cuda", generator=gen) * 0.02 + 0.005).bfloat16()
    z = torch.randint(4, 12, (K // G, N), device="cuda", generator=gen).bfloat16()
    return q, s, z


def shape_inputs(K, N):
    """(generator, packed weight copies > 3x L2, bf16 weight copies > 3x L2, the float64 dequantized weight [K, N]:
    exact, (q - z) s fits fp32) for one shape."""
    gen = torch.Generator(device="cuda").manual_seed(K + N)
    nbytes = K * N // 2 + 2 * (K // G) * N * 2
    copies = [packed(K, N, gen) for _ in range(max(2, math.ceil(3 * 60e6 / nbytes)))]
    wbf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen)
           for _ in range(max(2, math.ceil(3 * 60e6 / (K * N * 2))))]
    return gen, copies, wbf, dequantize(*copies[0], G, dtype=torch.float64).T


def m_inputs(K, M, gen, wbf, ref_w):
    """(x [M, K], the float64 reference product, the bf16 ``F.linear`` time in us) for one M."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, x.double() @ ref_w, streamed_us(lambda w: F.linear(x, w), wbf, 48)


def run_config(x, copies, ref, cfg):
    """(us per call, max |y - ref| / max |ref|) of one ``MmaConfig``."""
    y = W.w4a16_mma(x, *copies[0], G, config=cfg)
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    return streamed_us(lambda it: W.w4a16_mma(x, *it, G, config=cfg), copies, 48), err


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: (p.add_argument("--caps", default="96,88"),
                                                                 p.add_argument("--ms", default="1,4,8")))
    caps = [0] + [int(c) for c in args.caps.split(",") if c]
    rows = []
    for K, N in SHAPES:
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            row = {"K": K, "N": N, "M": M, "bf16_us": t_bf}
            for cap in caps:
                cfg = W.MmaConfig(warps=4, cols_per_warp=32, prefetch=1, pdl=True, maxnreg=cap)
                t, err = run_config(x, copies, ref, cfg)
                tag = f"r{cap}" if cap else "default"
                row.update({f"{tag}_us": t, f"{tag}_x_vs_bf16": t_bf / t, f"{tag}_rel_err": err})
            print(row, flush=True)
            rows.append(row)
    write_results("w4a16_mma_regcap_ab", rows, out_dir=args.out,
                  title="W4A16 mma.sync kernel, M <= 8: register cap A/B (bf16, group 128)",
                  notes="default = MmaConfig(warps=4, cols_per_warp=32, prefetch=1, pdl=True), the tuner's M <= 8 "
                        "tile; rN = the same with maxnreg=N (more resident CTAs; split-K for them). us: 48 calls back "
                        "to back in one CUDA graph, rotating weight copies > 3x L2, median of 20 replays; rel_err: "
                        "max |y - ref| / max |ref| against the float64 dequantized product.")


if __name__ == "__main__":
    main()
