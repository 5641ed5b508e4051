"""W4A16 kernel design sweep (H200): every kernel variant x a grid of launch configs, per shape and M.

Not the committed speed table (that is ``benchmarks/w4a16.py``): this script answers "which kernel and which
config" so that ``candidate_configs`` can be cut down to the few that win. Methods: ``gemv`` (one row per program,
one group per K tile), ``gemv2`` (one row per program, K tiles spanning groups), ``fused`` (x @ codes^T on tensor
cores, the weight as the dot's second operand), ``swap`` (codes @ x^T: the weight as the first operand, read from
registers by wgmma), ``swapx`` (``swap`` on x permuted and summed once per call by a small kernel first), ``swapd``
(``swapx`` with the weights dequantized in bf16x2 before the dot, so the dot accumulates over K; experimental). Every config is first checked against a dequantized float reference (rows that fail are
reported, not timed). Times: medians of CUDA-graph replays with L2 flushed and weights rotated, as in w4a16.py.

``python benchmarks/w4a16_sweep.py --out DIR [--shapes 8192x8192,8192x28672] [--ms 1,16,64] [--only swapd]``
"""
from __future__ import annotations

import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, parse_args, write_results  # noqa: E402
from w4a16 import G, graphed, make_sets  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fxopt.kernels import w4a16 as K4  # noqa: E402
from fxopt.quant.format import dequantize  # noqa: E402


def configs_for(M: int, K: int, N: int, num_sms: int):
    out = []

    def split(bm, bn, bk, waves):
        n_mn = -(-M // bm) * -(-N // bn) if bm > 1 else M * -(-N // bn)
        return K4._split_for(n_mn, K // bk, int(waves * num_sms)) if waves else 1

    if M == 1:
        out += [c for c in K4.candidate_configs(M, N, K, G, num_sms) if c.method == "gemv"][:2]
        for bn, warps, waves in itertools.product((128, 256), (4, 8), (2, 4)):
            out.append(K4.W4A16Config(1, bn, 256, split(1, bn, 256, waves), False, 8, warps, 2, "gemv2"))
    if M > 256:
        for (bm, bn), stages in itertools.product(((128, 128), (128, 256), (64, 256)), (3, 4)):
            out.append(K4.W4A16Config(bm, bn, 128, 1, True, 8, 8, stages, "swapx"))
        out.append(K4.W4A16Config(method="dequant_matmul"))
        return out
    if M >= 64:
        out.append(K4.W4A16Config(method="dequant_matmul"))
    bms = sorted(b for b in (16, 32, 64, 128) if b <= max(16, M))[-2:]
    for bm in bms:
        shapes = ((64, 4), (128, 4), (128, 8), (256, 8)) if bm <= 32 else ((64, 4), (128, 8), (256, 8))
        for (bn, warps), waves, stages in itertools.product(shapes, (0, 1, 2, 4, 8) if M > 32 else (1, 2, 4, 8),
                                                            (3, 4)):
            out.append(K4.W4A16Config(bm, bn, 128, split(bm, bn, 128, waves), True, 8, warps, stages, "swapx"))
        for bn, waves in itertools.product((64, 128), (2, 4)):
            out.append(K4.W4A16Config(bm, bn, 128, split(bm, bn, 128, waves), True, 8, 4, 3, "swap"))
        # "swapd" (experimental: dequantized in bf16x2 before the dot, which then accumulates over K)
        for (bn, warps), waves in itertools.product(((64, 4), (128, 4)), (0, 1, 2, 4) if M > 32 else (2, 4, 8)):
            out.append(K4.W4A16Config(bm, bn, 128, split(bm, bn, 128, waves), True, 8, warps, 3, "swapd",
                                      pdl=True))
    return list(dict.fromkeys(out))  # first occurrence of each config, in order


def name(c) -> str:
    return f"{c.method} bm{c.block_m} bn{c.block_n} bk{c.block_k} sk{c.split_k} w{c.num_warps} s{c.num_stages}"


def main():
    def extra(p):
        p.add_argument("--shapes", default="8192x8192,8192x28672,11008x4096")
        p.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,1024")
        p.add_argument("--only", default="", help="time only the tuner's candidates plus the sweep's configs of "
                                                  "these methods (comma list, e.g. swapd)")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, best_rows = [], []
    t0 = time.time()
    for K, N in shapes:
        ours, bf, _ = make_sets(K, N)
        q, s, z = ours[0]
        w_ref = dequantize(q, s, z, G, dtype=torch.float32)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ w_ref.T)
            t_bf = bench_ms(graphed(lambda w: F.linear(x, w), bf), warmup=5, rep=30) * 1e3
            best = {}
            cfgs = configs_for(M, K, N, num_sms)
            if args.only:
                keep = set(args.only.split(","))
                cfgs = K4.candidate_configs(M, N, K, G, num_sms) + [c for c in cfgs if c.method in keep]
            for c in cfgs:
                try:
                    y = K4._launch(x, q, s, z, G, None, c)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        rows.append({"K": K, "N": N, "M": M, "config": name(c), "us": None, "err": err})
                        print(f"  WRONG {name(c)} M={M}: rel err {err:.3g}", flush=True)
                        continue
                    t = bench_ms(graphed(lambda it: K4._launch(x, *it, G, None, c), ours), warmup=5, rep=30) * 1e3
                except Exception as e:  # out of shared memory / registers: skipped, reported
                    print(f"  FAIL {name(c)} M={M}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append({"K": K, "N": N, "M": M, "config": name(c), "us": t, "err": err,
                             "x_vs_bf16": t_bf / t})
                if c.method not in best or t < best[c.method][0]:
                    best[c.method] = (t, name(c))
            for meth, (t, nm) in sorted(best.items(), key=lambda kv: kv[1][0]):
                best_rows.append({"K": K, "N": N, "M": M, "method": meth, "us": t, "bf16_us": t_bf,
                                  "x_vs_bf16": t_bf / t, "config": nm})
            top = min(best.values()) if best else (float("nan"), "-")
            print(f"[{time.time() - t0:6.1f}s] K={K} N={N} M={M}: bf16 {t_bf:.1f} us; best {top[0]:.1f} us "
                  f"({t_bf / top[0]:.2f}x) {top[1]}; " + ", ".join(f"{k} {v[0]:.1f}" for k, v in best.items()),
                  flush=True)
            # after every M, so that a run cut short keeps what it measured
            write_results("w4a16_sweep_best", best_rows, title="W4A16 sweep: best config per kernel variant",
                          out_dir=args.out, notes=__doc__.split("\n\n", 1)[1], echo=False)
            write_results("w4a16_sweep_all", rows, title="W4A16 sweep: every config", out_dir=args.out,
                          echo=False)
        del ours, bf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
