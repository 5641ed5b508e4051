"""Where the Gluon W4A16 kernel's time goes at M = 16-128 (session 18): the full kernel against three timing probes.

``gluon_w4a16_mm(..., probe=P)`` (results wrong, timing only): P = 1 loads only (the ring's TMA traffic, the
consumers release every slot unread), P = 2 compute only (the ring is loaded once; later K tiles dequantize and
multiply stale slots: the consumers' own rate), P = 3 without the x loads (the weight / scale / zero traffic and
all the compute). Same grid and split-K as the full kernel. Session 18's ``inflight`` A/B found no gain from a
deeper wgmma queue, so the consumers do not wait on wgmma latency; these rows tell whether the loads, the consumer
work or neither bounds the K-tile time. Tiles: BN 128 and BN 256 with two consumer warpgroups (``regs="async"``), BN 256 with four
(``consumers=4``; BN 128 with four = two column halves x two K parities), KC 32, BM = the M bucket. P = 4
(mma only, added later in session 18): as P = 2 with a constant A operand instead of the dequantization; P = 5
(BN 128): as P = 4 with wgmma reading A from shared memory (the packed slot reinterpreted).
Per-call time of 48 calls back to back in one CUDA graph over weight copies > 3x L2.

    python benchmarks/w4a16_gluon_probe.py [--ms 16,32,64,128] [--out DIR]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, streamed_us, write_results  # noqa: E402
from w4a16_mma_regcap_ab import SHAPES, G, m_inputs, shape_inputs  # noqa: E402

from fxopt.kernels import w4a16_gluon as kg  # noqa: E402

PROBES = {0: "full", 1: "loads", 2: "compute", 3: "no_x", 4: "mma_only", 5: "mma_smem_a"}


def main():
    args = parse_args(__doc__.splitlines()[0], extra=lambda p: (
        p.add_argument("--ms", default="16,32,64,128"),
        p.add_argument("--tiles", default="128x2,128x4,256x2,256x4", help="BNxCONSUMERS list"),
        p.add_argument("--probes", default="0,1,2,3,4,5"),
        p.add_argument("--fixed", action="store_true", help="also K = 256 rows: the per-call fixed cost"),
        p.add_argument("--pdl", action="store_true", help="also the full call with pdl=True (two consumers)"),
        p.add_argument("--regmajor", action="store_true",
                       help="also the full call with ws_layout='regmajor' (two consumers)"),
        p.add_argument("--large", default="",
                       help="BM/REGS/KC list (e.g. 256/default/32,128/async/64): probe these tiles (BN 128, two "
                            "consumers, no split-K) at the --ms rows instead of the small-M tiles (session 20)")))
    probes_wanted = {int(v) for v in args.probes.split(",")}
    tiles_wanted = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    rows = []
    if args.large:
        _large_rows(args, probes_wanted, rows)
        tiles_wanted = []
    for K, N in SHAPES:
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            bm = kg._block_m_for(M)
            for bn, cons in tiles_wanted:
                if bm > 64 and (bn == 256 or cons == 4):
                    continue
                cfg = dict(block_m=bm, block_n=bn, stages=kg._max_stages(bm, bn), kc=32,
                           **({"regs": "async"} if cons == 2 else {"consumers": 4}))
                tiles = -(-M // bm) * (N // bn)
                row = {"K": K, "N": N, "M": M, "tile": f"bm{bm} bn{bn} c{cons}", "ctas": tiles * kg._split_for(
                    tiles, K // G, 132), "bf16_us": t_bf}
                y = kg.gluon_w4a16_mm(x, *copies[0], G, **cfg)
                row["rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
                for p, name in PROBES.items():
                    if p not in probes_wanted or (p == 5 and bn != 128):
                        continue
                    row[f"{name}_us"] = streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, probe=p, **cfg),
                                                    copies, 48)
                if args.regmajor and cons == 2:
                    row["full_regmajor_us"] = streamed_us(
                        lambda it: kg.gluon_w4a16_mm(x, *it, G, ws_layout="regmajor", **cfg), copies, 48)
                if args.pdl and cons == 2:
                    row["full_pdl_us"] = streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, pdl=True, **cfg),
                                                     copies, 48)
                # the kernel alone: x already in FRAG order (the op's x-prep launch skipped)
                from fxopt.kernels.w4a16 import _prep_x

                xp = _prep_x(x.contiguous(), G, True)[0]
                row["full_prepped_us"] = streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, xp=xp, **cfg), copies, 48)
                x_bytes = (N // bn) * M * K * 2  # every N tile reads all of x (rows past M are TMA zero-fill)
                w_bytes = K * N // 2 + 2 * (K // G) * N * 2
                row["l2_to_sm_MB"] = (x_bytes + w_bytes) / 1e6
                if "loads_us" in row:
                    row["loads_TBps"] = (x_bytes + w_bytes) / row["loads_us"] / 1e6
                print(row, flush=True)
                rows.append(row)
    if args.fixed and not args.large:
        # the per-call fixed cost: K = 256 (two K tiles per output tile, one per CTA after the split), N = 8192
        from fxopt.kernels.w4a16 import _prep_x

        K, N = 256, 8192
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            bm = kg._block_m_for(M)
            cfg = dict(block_m=bm, block_n=128, stages=kg._max_stages(bm, 128), kc=32, regs="async")
            xp = _prep_x(x.contiguous(), G, True)[0]
            row = {"K": K, "N": N, "M": M, "tile": f"bm{bm} bn128 c2", "bf16_us": t_bf,
                   "full_us": streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, **cfg), copies, 48),
                   "full_prepped_us": streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, xp=xp, **cfg), copies,
                                                  48),
                   "prepped_regmajor_us": streamed_us(
                       lambda it: kg.gluon_w4a16_mm(x, *it, G, xp=xp, ws_layout="regmajor", **cfg), copies, 48),
                   "prepped_no_split_us": streamed_us(
                       lambda it: kg.gluon_w4a16_mm(x, *it, G, xp=xp, split_k=1, **cfg), copies, 48),
                   "prep_only_us": streamed_us(lambda xx: _prep_x(xx, G, True), [x.contiguous()] * 2, 48)}
            print(row, flush=True)
            rows.append(row)
    write_results("w4a16_gluon_probe", rows, out_dir=args.out,
                  title=(f"W4A16 Gluon kernel, M = {args.ms}: full kernel against loads-only / compute-only / "
                         "no-x / mma-only probes" + (", large-M tiles (BN 128, no split-K)" if args.large else "")),
                  notes=("full_us: the kernel; loads_us: probe 1 (TMA ring traffic only); compute_us: probe 2 "
                         "(dequantize + wgmma on stale slots, no loads after the first ring fill); no_x_us: probe "
                         "3 (everything but the x tiles); mma_only_us: probe 4 (probe 2 without the "
                         "dequantization: constant A operand); mma_smem_a_us: probe 5 (probe 4 with A read from "
                         "shared memory); full_prepped_us: the kernel with x already in FRAG order (no x-prep launch); full_pdl_us: the call with pdl=True (the kernel launched during the x prep); *regmajor_us: the split-K partials in the register-major workspace (ws_layout='regmajor'). l2_to_sm_MB: x tile bytes (every N tile re-reads x) + "
                         "packed weight, scales and zeros; loads_TBps: that / loads_us. Same grid and split-K "
                         "(ctas) in every column. Per-call time of 48 calls in one CUDA graph over weight copies "
                         "> 3x L2."))


def _large_rows(args, probes_wanted, rows):
    """Session 20: M >= 1024 (the tuner's Gluon pick there is BM 256 x BN 128 with the default register split, every
    wgmma serialized by ptxas; BM 128 "async" keeps one wgmma in flight but dequantizes twice per activation row)."""
    for K, N in SHAPES:
        gen, copies, wbf, ref_w = shape_inputs(K, N)
        for M in (int(m) for m in args.ms.split(",")):
            x, ref, t_bf = m_inputs(K, M, gen, wbf, ref_w)
            for spec in args.large.split(","):
                bm, regs, kc = spec.split("/")
                bm, kc = int(bm), int(kc)
                cfg = dict(block_m=bm, block_n=128, stages=kg._max_stages(bm, 128), kc=kc, split_k=1,
                           **({} if regs == "default" else {"regs": regs}))
                row = {"K": K, "N": N, "M": M, "tile": f"bm{bm} bn128 kc{kc} {regs}", "bf16_us": t_bf}
                y = kg.gluon_w4a16_mm(x, *copies[0], G, **cfg)
                row["rel_err"] = float((y.double() - ref).abs().max() / ref.abs().max())
                for p, name in PROBES.items():
                    if p in probes_wanted and p != 5:
                        row[f"{name}_us"] = streamed_us(lambda it: kg.gluon_w4a16_mm(x, *it, G, probe=p, **cfg),
                                                        copies, 8)
                flop = 2.0 * M * K * N
                row["bf16_TFLOPs"] = flop / t_bf / 1e6
                for name in ("full", "mma_only"):
                    if f"{name}_us" in row:
                        row[f"{name}_TFLOPs"] = flop / row[f"{name}_us"] / 1e6
                print(row, flush=True)
                rows.append(row)


if __name__ == "__main__":
    main()
