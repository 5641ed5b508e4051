"""Where a small-M W4A16 call spends its time (H200): the "swapx" call split into its two kernels, with and without
programmatic dependent launch, against a read-only kernel that streams the same packed tiles (the ceiling of the
access pattern) and bf16 ``F.linear``.

Not the committed speed table (``benchmarks/w4a16.py``): an experiment that says which part to work on. Every
time is ``streamed_us`` of ``w4a16.py`` (48 calls back to back in one CUDA graph, weights rotated over > 3x L2).
Columns: ``full`` (prep + main, as the op runs), ``full_pdl`` (main launched with programmatic dependent launch),
``main`` (the main kernel alone on an x prepared once), ``prep`` (the prep kernel alone), ``read`` (a kernel that
only loads the packed tiles of the same grid and XORs them), each config checked against a float reference first.
``--fm`` adds the fragment-major experiment (``_swap_fm_kernel``, weights stored in the threads' register-fragment
order and loaded straight into registers) at several split counts.

``python benchmarks/w4a16_breakdown.py --out DIR [--shapes 8192x8192] [--ms 1,16] [--sweep] [--fm] [--no-swapx]``
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
    k_tiles, t_start, t_end = K4._k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K)
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


# ---------------------------------------------------------------------------------------------------------------
# Experiment: "fragment-major" weight storage. Each (64-row N block, 128-deep K tile) is 1024 contiguous words in
# the order a 4-warp program's threads hold them as wgmma register fragments (FRAG order), so a tile is loaded
# with plain vector loads straight into registers: no cp.async ring, no shared memory, no barrier.
# ---------------------------------------------------------------------------------------------------------------
FM_BN, FM_BK = 64, 128


def to_fragment_major(q: torch.Tensor) -> torch.Tensor:
    """qweight [K/8, N] -> [N/64, K/128, 1024]: word (h, w, r, t, c) = qweight[16 kt + 4 c + t, 64 nb + 16 w + 8 h + r]
    (a 4-warp program's thread 32 w + 4 r + t holds words (h, c); Triton's 1-D layout gives it 4 contiguous words
    per 512-word half)."""
    Kp, N = q.shape
    KT, NB = Kp // (FM_BK // 8), N // FM_BN
    v = q.reshape(KT, 4, 4, NB, 4, 2, 8)  # (kt, c, t, nb, w, h, r)
    v = v.permute(3, 0, 5, 4, 6, 2, 1)  # (nb, kt, h, w, r, t, c)
    return v.reshape(NB, KT, 1024).contiguous()


@triton.jit
def _swap_fm_kernel(x_ptr, qf_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, xs_ptr,
                    M, N, K, SPLIT_K, TILES_PER_SPLIT, MAGIC2,
                    stride_xm, stride_sg, stride_ym, stride_xsm,
                    GROUP_SIZE: tl.constexpr, OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m, offs_n, mask_m, mask_n, _ = K4._tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    k_tiles, t_start, t_end = K4._k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    xs_ptrs = xs_ptr + offs_m * stride_xsm
    qf_base = qf_ptr + pid_n.to(tl.int64) * k_tiles * 1024
    offs_w = tl.arange(0, 1024)
    s_ptrs = s_ptr + offs_n
    z_ptrs = z_ptr + offs_n
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # two tiles of words in flight in registers; scale, zero, x and its sums one tile ahead
    w_n = tl.load(qf_base + t_start * 1024 + offs_w)
    w_nn = tl.load(qf_base + min(t_start + 1, k_tiles - 1) * 1024 + offs_w)
    k_pre = min(t_start, k_tiles - 1) * BLOCK_K
    s_n = tl.load(s_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    z_n = tl.load(z_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    xs_n = tl.load(xs_ptrs + k_pre // BLOCK_K, mask=mask_m, other=0.0)
    x_n = tl.load(x_ptrs + k_pre, mask=mask_m[:, None], other=0.0)
    for t in range(t_start, t_end):
        k1 = min(t + 1, k_tiles - 1) * BLOCK_K
        words = w_n
        w_n = w_nn
        w_nn = tl.load(qf_base + min(t + 2, k_tiles - 1) * 1024 + offs_w)
        s, z, xsum, x = s_n.to(tl.float32), z_n.to(tl.float32), xs_n, x_n
        s_n = tl.load(s_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        z_n = tl.load(z_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        xs_n = tl.load(xs_ptrs + k1 // BLOCK_K, mask=mask_m, other=0.0)
        x_n = tl.load(x_ptrs + k1, mask=mask_m[:, None], other=0.0)
        v = tl.reshape(words, (2, 4, 8, 4, 4))  # (h, w, r, t, c)
        packed = tl.reshape(tl.permute(v, (4, 3, 1, 0, 2)), (BLOCK_K // 8, BLOCK_N))  # (c, t) x (w, h, r)
        wq_t = K4._unpack_frag(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)
        d = tl.dot(wq_t, tl.trans(x))
        acc += (d - (z + OFFSET)[:, None] * xsum[None, :]) * s[:, None]
    mask_y = mask_n[:, None] & mask_m[None, :]
    K4._store_split_k(acc, y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                      ws_ptr + offs_m[None, :] * N + offs_n[:, None], mask_y, 0.0, cnt_ptr,
                      pid_m * num_pid_n + pid_n, pid_k, SPLIT_K, M * N, True, False)


def fm_call(x, qf, s, z, split_k, num_stages=1, pdl=False, prepped=None):
    M, K = x.shape
    N = s.shape[1]
    k_tiles = K // FM_BK
    per = triton.cdiv(k_tiles, split_k)
    split = triton.cdiv(k_tiles, per)
    xp, xs = prepped if prepped is not None else K4._prep_x(x, FM_BK, True, pdl)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    n_mn = triton.cdiv(M, 16) * (N // FM_BN)
    cnt = K4._counters(x.device, n_mn)
    magic, offset = K4._MAGIC[x.dtype]
    _swap_fm_kernel[(n_mn, split)](xp, qf, s, z, y, ws, cnt, xs, M, N, K, split, per, magic * 0x10001,
                                    xp.stride(0), s.stride(0), y.stride(0), xs.stride(0),
                                    GROUP_SIZE=G, OFFSET=offset, BLOCK_M=16, BLOCK_N=FM_BN, BLOCK_K=FM_BK,
                                    USE_GDC=pdl, num_warps=4, num_stages=num_stages,
                                    **({"launch_pdl": True} if pdl else {}))
    return y


def name(c) -> str:
    return f"bn{c.block_n} sk{c.split_k} w{c.num_warps} s{c.num_stages}"


def configs(M, K, N, num_sms, sweep):
    cands = [c for c in K4.candidate_configs(M, N, K, G, num_sms) if c.method == "swapx"]
    if sweep:
        for bn, waves, stages in itertools.product((64, 128, 256), (2, 4), (4, 6)):
            bk = 128
            split = K4._split_for(-(-M // 16) * -(-N // bn), K // bk, waves * num_sms)
            cands.append(K4.W4A16Config(16, bn, bk, split, True, 8, 8 if bn == 256 else 4, stages, "swapx"))
    return list(dict.fromkeys(cands))  # first occurrence of each config, in order


def main():
    def extra(p):
        p.add_argument("--shapes", default="8192x8192,8192x28672,4096x11008")
        p.add_argument("--ms", default="1,16")
        p.add_argument("--sweep", action="store_true", help="also a grid of BLOCK_N x waves x stages")
        p.add_argument("--fm", action="store_true", help="also the fragment-major weight layout experiment")
        p.add_argument("--no-swapx", action="store_true", help="skip the swapx rows")

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
            for c in ([] if args.no_swapx else configs(M, K, N, num_sms, args.sweep)):
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
            if args.fm and N % FM_BN == 0 and K % FM_BK == 0:
                fms = [(to_fragment_major(q), sc, zc) for q, sc, zc in ours]
                for split in (2, 3, 4, 5, 6, 8):
                    row = {"K": K, "N": N, "M": M, "config": f"fragment-major bn64 sk{split} w4", "bf16_us": t_bf}
                    try:
                        for pdl in (False, True):
                            y = fm_call(x, fms[0][0], s0, z0, split, pdl=pdl)
                            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                            if not err < 2e-2:
                                raise RuntimeError(f"wrong result (pdl={pdl}): rel err {err:.3g}")
                            row["full_pdl_us" if pdl else "full_us"] = streamed_us(
                                lambda it: fm_call(x, *it, split, pdl=pdl), fms)
                        prepped = K4._prep_x(x, FM_BK, True)
                        row["main_us"] = streamed_us(lambda it: fm_call(x, *it, split, prepped=prepped), fms)
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                    best = min(row.get("full_us", 1e9), row.get("full_pdl_us", 1e9))
                    row["x_vs_bf16"] = t_bf / best if best < 1e9 else None
                    rows.append(row)
                    print(f"[{time.time() - t0:5.0f}s] {K}x{N} M={M} {row['config']}: " + ", ".join(
                        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                        if k.endswith("_us") or k == "error"), flush=True)
                del fms
            write_results("w4a16_breakdown", rows, title="W4A16 small-M breakdown (swapx)", out_dir=args.out,
                          notes=__doc__.split("\n\n", 1)[1], echo=False)
        del ours, bf
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
