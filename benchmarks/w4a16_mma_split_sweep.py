"""K-split sweep of the M <= 8 mma.sync W4A16 tiles (session 17): is the one-wave split the best one?

``candidate_configs`` lists each tile of ``w4a16_mma._TILES`` with one split, ``choose_split``'s (the critical path
of one wave of resident CTAs). The read-rate probe (``benchmarks/w4a16_layout_probe.py``) moved by up to 10% with the
number of CTAs per column tile. Each row: one (shape, M, tile) and the time at splits s0 / 2, s0, 2 s0 and 3 s0
(s0 = the listed split), output checked against the float64 dequantized reference at every split; per-call time of
48 calls back to back in one CUDA graph over rotating weight copies (> 3x L2), bf16 ``F.linear`` in the same run.

    python benchmarks/w4a16_mma_split_sweep.py [--ms 1,4,8] [--out DIR]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, write_results  # noqa: E402

from fxopt.kernels import w4a16_mma as W  # noqa: E402
from w4a16_mma_regcap_ab import G, SHAPES, m_inputs, run_config, shape_inputs  # noqa: E402

FACTORS = (0.5, 1, 2, 3)


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: p.add_argument("--ms", default="1,4,8"))
    rows = []
    for K, N in SHAPES:
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            for c in W.candidate_configs(M, N, K, G):
                base = W.to_mma_config(c)
                row = {"K": K, "N": N, "M": M, "tile": base.label(), "bf16_us": t_bf, "s0": c.split_k}
                best = None
                for f in FACTORS:
                    sk = max(1, round(c.split_k * f))
                    cfg = W.MmaConfig(warps=base.warps, cols_per_warp=base.cols_per_warp, prefetch=base.prefetch,
                                      pdl=base.pdl, split_k=sk)
                    t, err = run_config(x, copies, ref, cfg)
                    assert err < 2e-2, (K, N, M, cfg, err)
                    row[f"x{f}_split"] = sk
                    row[f"x{f}_us"] = t
                    if best is None or t < best[1]:
                        best = (sk, t)
                row["best_split"], row["best_us"] = best
                row["best_vs_s0"] = row["x1_us"] / best[1]
                print(row, flush=True)
                rows.append(row)
    write_results("w4a16_mma_split_sweep", rows, out_dir=args.out,
                  title="W4A16 mma.sync kernel, M <= 8: K-split sweep per listed tile (bf16, group 128)",
                  notes="s0: the split candidate_configs lists (one wave of resident CTAs); xF: split round(F s0). us: "
                        "48 calls back to back in one CUDA graph, rotating weight copies > 3x L2, median of 20 "
                        "replays. best_vs_s0: time at s0 / best time.")


if __name__ == "__main__":
    main()
