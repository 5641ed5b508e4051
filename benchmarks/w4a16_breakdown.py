"""Where a small-M W4A16 call spends its time (H200): the "swapx" call split into its two kernels, with and without
programmatic dependent launch, against a read-only kernel that streams the same packed tiles (the ceiling of the
access pattern) and bf16 ``F.linear``.

Not the committed speed table (``benchmarks/w4a16.py``): an experiment that says which part to work on. Every
time is ``streamed_us`` of ``w4a16.py`` (48 calls back to back in one CUDA graph, weights rotated over > 3x L2).
Columns: ``full`` (prep + main, as the op runs), ``full_pdl`` (main launched with programmatic dependent launch),
``main`` (the main kernel alone on an x prepared once), ``prep`` (the prep kernel alone), ``read`` (a kernel that
only loads the packed tiles of the same grid and XORs them), each config checked against a float reference first.

``python benchmarks/w4a16_breakdown.py --out DIR [--shapes 8192x8192] [--ms 1,16] [--sweep]``
"""
from __future__ import annotations

import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_args, write_results  # noqa: E402
from w4a16 import G, make_sets, streamed_us  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fxopt.kernels import w4a16 as K4  # noqa: E402
from fxopt.quant.format import dequantize  # noqa: E402


@triton.jit
def _read_kernel(qw_ptr, out_ptr, N, K, TILES_PER_SPLIT, stride_qk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_K // 8)
    q_ptrs = qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :]
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.int32)
    k_tiles = K // BLOCK_K
    t_start = pid_k * TILES_PER_SPLIT
    t_end = min(t_start + TILES_PER_SPLIT, k_tiles)
    for t in range(t_start, t_end):
        acc ^= tl.load(q_ptrs + t * (BLOCK_K // 8) * stride_qk)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, 0))


def read_call(q, cfg):
    K, N = q.shape[0] * 8, q.shape[1]
    k_tiles = K // cfg.block_k
    per = triton.cdiv(k_tiles, cfg.split_k)
    split = triton.cdiv(k_tiles, per)
    out = torch.empty((split, N), dtype=torch.int32, device=q.device)
    _read_kernel[(triton.cdiv(N, cfg.block_n), split)](q, out, N, K, per, q.stride(0), BLOCK_N=cfg.block_n,
                                                        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                                                        num_stages=cfg.num_stages)
    return out


def name(c) -> str:
    return f"bn{c.block_n} sk{c.split_k} w{c.num_warps} s{c.num_stages}"


def configs(M, K, N, num_sms, sweep):
    cands = [c for c in K4.candidate_configs(M, N, K, G, num_sms) if c.method == "swapx"]
    if sweep:
        for bn, waves, stages in itertools.product((64, 128, 256), (2, 4), (4, 6)):
            bk = 128
            split = K4._split_for(-(-M // 16) * -(-N // bn), K // bk, waves * num_sms)
            cands.append(K4.W4A16Config(16, bn, bk, split, True, 8, 8 if bn == 256 else 4, stages, "swapx"))
    seen, out = set(), []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def main():
    def extra(p):
        p.add_argument("--shapes", default="8192x8192,8192x28672,4096x11008")
        p.add_argument("--ms", default="1,16")
        p.add_argument("--sweep", action="store_true", help="also a grid of BLOCK_N x waves x stages")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    t0 = time.time()
    for K, N in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        ours, bf, _ = make_sets(K, N)
        q0, s0, z0 = ours[0]
        w_ref = dequantize(q0, s0, z0, G, dtype=torch.float32)
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w_ref.T
            t_bf = streamed_us(lambda w: F.linear(x, w), bf)
            for c in configs(M, K, N, num_sms, args.sweep):
                row = {"K": K, "N": N, "M": M, "config": name(c), "bf16_us": t_bf}
                try:
                    for pdl in (False, True):
                        cc = K4.W4A16Config(**{**c.__dict__, "pdl": pdl})
                        y = K4._launch(x, q0, s0, z0, G, None, cc)
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        if not err < 2e-2:
                            raise RuntimeError(f"wrong result (pdl={pdl}): rel err {err:.3g}")
                        row["full_pdl_us" if pdl else "full_us"] = streamed_us(
                            lambda it: K4._launch(x, *it, G, None, cc), ours)
                    frag = c.block_k % 32 == 0
                    row["prep_us"] = streamed_us(lambda it: K4._prep_x(x, c.block_k, frag), ours)
                    prepped = K4._prep_x(x, c.block_k, frag)
                    real_prep = K4._prep_x
                    K4._prep_x = lambda *a, **k: prepped  # the main kernel alone on x prepared once
                    try:
                        row["main_us"] = streamed_us(lambda it: K4._launch(x, *it, G, None, c), ours)
                    finally:
                        K4._prep_x = real_prep
                    row["read_us"] = streamed_us(lambda it: read_call(it[0], c), ours)
                except Exception as e:  # out of resources or wrong: reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                best = min(row.get("full_us", 1e9), row.get("full_pdl_us", 1e9))
                row["x_vs_bf16"] = t_bf / best if best < 1e9 else None
                row["read_TBps"] = (K * N / 2) / row["read_us"] / 1e6 if "read_us" in row else None
                rows.append(row)
                print(f"[{time.time() - t0:5.0f}s] {K}x{N} M={M} {name(c)}: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                    if k.endswith("_us") or k == "error"), flush=True)
            write_results("w4a16_breakdown", rows, title="W4A16 small-M breakdown (swapx)", out_dir=args.out,
                          notes=__doc__.split("\n\n", 1)[1], echo=False)
        del ours, bf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
