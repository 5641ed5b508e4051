"""A/B of the wgmma queue depth of the Gluon W4A16 kernel at M = 16-128 (session 18): ``inflight`` = 1 / 2 / 3.

Session 10's census (docs/notes_w4a16_gluon_census_session10.md) found the M = 64 tiles latency-bound: tensor pipe,
issue and DRAM each at 0.26-0.54 of the measured K-tile time, and each consumer keeps only one wgmma group in
flight while it dequantizes the next 32-K chunk. ``inflight`` = 2 / 3 keeps two / three groups queued
(``warpgroup_mma_wait(num_outstanding=inflight)``; offline sm_90 SASS: ``DEPBAR.LE gsb0, 0x2`` / ``0x3``, no C7512,
no spill, no register hazard for BN 128, KC 32). Each row: one shape and M, the BN 128 KC 32 ``regs="async"`` tile
of the M bucket with each depth, plus the BN 256 tile (the 8192 x 28672 pick) with depth 1; output checked against
the float64 dequantized reference; per-call time of 48 calls back to back in one CUDA graph over weight copies that
together exceed 3x L2; bf16 ``F.linear`` the anchor; ``--rounds`` interleaved rounds (``common.round_order``).

    python benchmarks/w4a16_gluon_inflight_ab.py [--ms 16,32,64,128] [--rounds 2] [--out DIR]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, round_order, streamed_us, write_results  # noqa: E402
from w4a16_mma_regcap_ab import SHAPES, G, m_inputs, shape_inputs  # noqa: E402

from fxopt.kernels import w4a16_gluon as kg  # noqa: E402


def candidates(M: int) -> dict:
    bm = kg._block_m_for(M)
    out = {}
    for depth in (1, 2, 3):
        if depth == 3 and bm > 64:
            continue
        out[f"i{depth}"] = dict(block_m=bm, block_n=128, stages=kg._max_stages(bm, 128), kc=32, regs="async",
                                inflight=depth)
    if bm <= 64:
        out["bn256_i1"] = dict(block_m=bm, block_n=256, stages=kg._max_stages(bm, 256), kc=32, regs="async")
    return out


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: (p.add_argument("--ms", default="16,32,64,128"),
                                                                 p.add_argument("--rounds", type=int, default=2)))
    rows = []
    for K, N in SHAPES:
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            cands = candidates(M)
            row = {"K": K, "N": N, "M": M, "bf16_us": t_bf}
            times = {n: [] for n in cands}
            for name, cfg in cands.items():
                y = kg.gluon_w4a16_mm(x, *copies[0], G, **cfg)
                row[f"{name}_rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
            for r in range(args.rounds):
                for name in round_order(list(cands), r):
                    cfg = cands[name]
                    times[name].append(streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, **cfg), copies, 48))
            for name, ts in times.items():
                row[f"{name}_us"] = min(ts)
                row[f"{name}_rounds_us"] = "/".join(f"{t:.1f}" for t in ts)
                row[f"{name}_x_vs_bf16"] = t_bf / min(ts)
            print(row, flush=True)
            rows.append(row)
    write_results("w4a16_gluon_inflight_ab", rows, out_dir=args.out,
                  title="W4A16 Gluon kernel, M = 16-128: wgmma groups in flight per consumer (bf16, group 128)",
                  notes=("i1 / i2 / i3: BN 128 KC 32 regs='async' tile of the M bucket (BM = next power of 2, "
                         "16..128) with 1 / 2 / 3 wgmma groups in flight; bn256_i1: BN 256, depth 1. *_us: best "
                         "of the rounds (per round in *_rounds_us), per-call time of 48 calls in one CUDA graph "
                         "over weight copies > 3x L2; rel_err: max |y - ref| / max |ref| against the float64 "
                         "dequantized reference."))


if __name__ == "__main__":
    main()
