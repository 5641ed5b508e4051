"""W4A16 linear (group 128, bf16): fxopt's Triton kernels vs bf16 F.linear (cuBLAS) vs tinygemm.

tinygemm = ``torch.ops.aten._weight_int4pack_mm`` with weights from ``_convert_weight_to_int4pack`` (uint8 [N, K/2],
inner_k_tiles=8) and scales_and_zeros [K/G, N, 2]. Every weight set (ours, bf16, tinygemm) is rotated over enough
copies to exceed 3x the 60 MB L2, and do_bench also flushes L2 between runs, so small shapes read from HBM.
Every timed call is a CUDA-graph replay (host overhead of the Python op path excluded, for all three; inside
torch.compile with CUDA graphs that is what a model sees): 48 calls back to back per graph, rotating the copies
(``streamed_us``). The ``flushed_*`` columns time one call after an L2 flush instead, for comparison. Each row: times in us, speedups of fxopt over both, achieved GB/s of fxopt for M <= 64 (packed weight + scales +
zeros + x + y bytes / time), and the config the tuner chose. Run from the repo root:
``python benchmarks/w4a16.py [--quick] [--out DIR] [--ms 1,2,4] [--gemv1] [--mma] [--dequant-matmul auto|on|off]``
(``--gemv1`` / ``--mma``: also the best "gemv1" / "mma" candidate per row with M <= 4 / 16, in gemv1_* / mma_*
columns; ``--dequant-matmul``: the route of "dequantize, then cuBLAS", ``fxopt.Config.kernels.w4a16_dequant_matmul``).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, parse_args, streamed_us, write_results  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fxopt.kernels import w4a16 as K4  # noqa: E402

SHAPES = [(8192, 8192), (4096, 11008), (11008, 4096), (8192, 28672)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
QUICK = [((8192, 8192), [1, 16, 64, 256, 4096]), ((8192, 28672), [1])]
G = 128
L2_BYTES = 60 * 2**20


def rotations(bytes_per_copy: int) -> int:
    return max(1, min(8, -(-3 * L2_BYTES // bytes_per_copy)))


def make_sets(K, N, device="cuda"):
    n_rot = rotations(K * N // 2)
    ours = []
    for _ in range(n_rot):
        q = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device)
        s = (torch.rand(K // G, N, device=device) * 0.02 + 0.005).bfloat16()
        z = torch.randint(4, 12, (K // G, N), device=device).bfloat16()
        ours.append((q, s, z))
    bf = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(rotations(K * N * 2))]
    tg = []
    for _ in range(n_rot):
        w_u8 = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
        packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
        sz = torch.rand(K // G, N, 2, device=device).bfloat16()
        tg.append((packed, sz))
    return ours, bf, tg


def graphed(fn, items):
    """CUDA graphs of fn(item), one per rotated item; replaying them times GPU work only (no host overhead)."""
    for it in items:
        fn(it)
    torch.cuda.synchronize()
    graphs = []
    for it in items:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(it)
        graphs.append(g)
    rot = Rot(graphs)
    return lambda: rot.next().replay()


class Rot:
    def __init__(self, items):
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def time_method(x, ours, calls: int, t_bf: float, method: str = "gemv1") -> dict:
    """Best streamed time of one method's candidates ("gemv1": ``K4.candidate_configs`` lists them for M <= 4 on
    CUDA; "mma": for M <= 16), each first compared with the op's own output on the same weights (a wrong config is
    reported, not timed). Columns ``<method>_us`` / ``_x_vs_bf16`` / ``_config`` / ``_rel_err``."""
    M, K = x.shape
    q, s, z = ours[0]
    N = q.shape[1]
    y_op = torch.ops.fxopt.w4a16_linear(x, q, s, z, G).float()
    best, out = None, {}
    for c in K4.candidate_configs(M, N, K, G, integer_zeros=True, dtype=x.dtype, device=x.device):
        if c.method != method:
            continue
        err = float((K4.w4a16_matmul(x, q, s, z, G, config=c).float() - y_op).abs().max() / y_op.abs().max())
        if not err <= 2e-2:
            print(f"    {method} {c.label()}: WRONG (max error {err:.3g} of max |y|), not timed", flush=True)
            out[f"{method}_wrong"] = out.get(f"{method}_wrong", "") + c.label() + "; "
            continue
        t = streamed_us(lambda it, c=c: K4.w4a16_matmul(x, *it, G, config=c), ours, calls)
        print(f"    {c.label()}: {t:.1f} us (max error vs the op {err:.2g})", flush=True)
        if best is None or t < best[0]:
            best = (t, c.label(), err)
    if best is not None:
        out.update({f"{method}_us": best[0], f"{method}_x_vs_bf16": t_bf / best[0], f"{method}_config": best[1],
                    f"{method}_rel_err": best[2]})
    return out


def main():
    def extra(p):
        p.add_argument("--no-tinygemm-large", type=int, default=1 << 30,
                       help="skip tinygemm above this M (default: time it at every M; at M = 4096 a call takes "
                       "19-65 ms on the H200)")
        p.add_argument("--verbose", action="store_true", help="log every tuning candidate's time")
        p.add_argument("--ms", default=None, help="comma-separated M values (default: the full list); a subset "
                       "writes w4a16_subset.* instead of the main table")
        p.add_argument("--gemv1", action="store_true", help="for M <= 4 also time every \"gemv1\" candidate (checked "
                       "against the op's output first) and add gemv1_* columns; writes *_gemv1.*")
        p.add_argument("--mma", action="store_true", help="for M <= 16 also time every \"mma\" candidate "
                       "(fxopt/kernels/w4a16/mma.py) and add mma_* columns")
        p.add_argument("--dequant-matmul", default="auto", choices=("auto", "on", "off"),
                       help="the tuner's route of dequantize + cuBLAS (default auto: above M = 256)")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    with K4.routes(dequant_matmul=args.dequant_matmul):
        run(args)


def run(args):
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger(K4.__name__).setLevel(logging.DEBUG)
    plan = QUICK if args.quick else [(s, [int(m) for m in args.ms.split(",")] if args.ms else MS) for s in SHAPES]
    rows = []
    t0 = time.time()
    for (K, N), ms in plan:
        ours, bf, tg = make_sets(K, N)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            q, s, z = ours[0]
            cfg = K4.choose_config(x, q, s, z, G)  # tune once, outside the timed region

            f_ours = lambda it: torch.ops.fxopt.w4a16_linear(x, *it, G)  # noqa: E731
            f_bf = lambda w: F.linear(x, w)  # noqa: E731
            f_tg = lambda it: torch.ops.aten._weight_int4pack_mm(x, it[0], G, it[1])  # noqa: E731
            calls = 48 if M <= 256 else 8
            t_ours = streamed_us(f_ours, ours, calls)
            t_bf = streamed_us(f_bf, bf, calls)
            t_tg = float("nan")
            if M <= args.no_tinygemm_large:
                t_tg = streamed_us(f_tg, tg, calls)
            # one call after a 256 MB zero-fill of L2 (do_bench), for comparison
            t_ours_fl = bench_ms(graphed(f_ours, ours), warmup=5, rep=30) * 1e3
            t_bf_fl = bench_ms(graphed(f_bf, bf), warmup=5, rep=30) * 1e3
            row = {"K": K, "N": N, "M": M, "fxopt_us": t_ours, "bf16_us": t_bf, "tinygemm_us": t_tg,
                   "x_vs_bf16": t_bf / t_ours, "x_vs_tinygemm": t_tg / t_ours,
                   "flushed_fxopt_us": t_ours_fl, "flushed_bf16_us": t_bf_fl, "flushed_x_vs_bf16": t_bf_fl / t_ours_fl}
            if M <= 64:
                nbytes = K * N // 2 + 2 * 2 * (K // G) * N + 2 * M * (K + N)
                row["fxopt_GBps"] = nbytes / (t_ours * 1e-6) / 1e9
            row["config"] = cfg.label()
            if args.gemv1 and M <= 4:
                row.update(time_method(x, ours, calls, t_bf, "gemv1"))
            if args.mma and M <= 16:
                row.update(time_method(x, ours, calls, t_bf, "mma"))
            rows.append(row)
            print(f"[{time.time() - t0:6.1f}s] K={K} N={N} M={M}: fxopt {t_ours:.1f} us, bf16 {t_bf:.1f}, "
                  f"tinygemm {t_tg:.1f} ({row['config']})", flush=True)
        del ours, bf, tg
        torch.cuda.empty_cache()
    name = "w4a16"
    write_results(name, rows, title="W4A16 linear, group 128, bf16 (fxopt vs cuBLAS bf16 vs tinygemm)",
                  out_dir=args.out,
                  notes="fxopt_us / bf16_us / tinygemm_us: per-call time of calls run back to back in one CUDA graph, "
                        "each on the next of several weight copies (together > 3x L2, so every call reads its "
                        "weights from HBM), median of 20 replays. flushed_*: a second method, one call per "
                        "do_bench iteration after do_bench zero-fills 256 MB to flush L2; the write-back of those "
                        "dirty lines (~12 us on the H200) lands in the timed call. x_vs_*: speedup of fxopt. "
                        "GB/s: packed weight + scales + zeros + activations moved per fxopt call / time. "
                        "config: the tuner's pick (dequant_matmul = Triton dequant to bf16 then cuBLAS; route "
                        f"--dequant-matmul {args.dequant_matmul}).")


if __name__ == "__main__":
    main()
