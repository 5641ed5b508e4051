"""W4A16 "gemv1": y[M <= 4, N] on CUDA cores in one launch, x read as it is (no prep kernel).

Each program owns 128-column chunks of N and a K slice. A code becomes an fp32 with one LOP3 (``(copy & MASK) |
MAGIC`` = OFF + q, from four shifted copies of the packed word: 3 shifts + 8 LOP3 + 8 FFMA per 8 weights at M = 1);
one FFMA chain per K tile and column, started at the zero / offset correction, folded with the scale. Split-K
partials go by relaxed atomics to an fp32 workspace kept at zero; the last CTA of a column tile writes y. The grid is
one wave of resident CTAs (``common.one_wave_split``). Design and measurements: ``docs/kernels.md`` ("gemv1.py").
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv, has_pdl, next_pow2
from fxopt.kernels.w4a16.common import (INTERPRET, W4A16Config, balanced_split, counters, m_bucket,
                                        one_wave_split, zeroed_workspace)
from fxopt.quant.format import PACK


# fp32 bit patterns for the nibble conversion of ``_w4a16_gemv1_kernel`` (run-time arguments, so that the and/or is a
# single LOP3 with the mask as its immediate and the exponent in a register): a code in bits 16..19 under exponent
# 2^7 reads as 128 + q, a code in bits 12..15 under exponent 2^11 as 2048 + q.
_GEMV1_MAGIC_A, _GEMV1_MASK_A, _GEMV1_OFF_A = 0x43000000, 0x000F0000, 128.0
_GEMV1_MAGIC_B, _GEMV1_MASK_B, _GEMV1_OFF_B = 0x45000000, 0x0000F000, 2048.0


@triton.jit
def _gemv1_nibbles(P, MA, MB, MKA, MKB):
    """int32 words -> 8 fp32 tensors, nibble j as OFF_j + q_j (OFF = 128 for even j, 2048 for odd j): ``(copy & MASK)
    | MAGIC`` on the word (nibbles 3, 4), ``<< 8`` (1, 2), ``>> 8`` (5, 6) and its half-word rotation (7, 0)."""
    b = P << 8
    c = P >> 8
    d = (P << 16) | ((P >> 16) & 0xFFFF)
    w0 = ((d & MKA) | MA).to(tl.float32, bitcast=True)
    w1 = ((b & MKB) | MB).to(tl.float32, bitcast=True)
    w2 = ((b & MKA) | MA).to(tl.float32, bitcast=True)
    w3 = ((P & MKB) | MB).to(tl.float32, bitcast=True)
    w4 = ((P & MKA) | MA).to(tl.float32, bitcast=True)
    w5 = ((c & MKB) | MB).to(tl.float32, bitcast=True)
    w6 = ((c & MKA) | MA).to(tl.float32, bitcast=True)
    w7 = ((d & MKB) | MB).to(tl.float32, bitcast=True)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _gemv1_load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    return tl.load(ptrs)


@triton.jit
def _gemv1_fma8(part, P, x0, x1, x2, x3, x4, x5, x6, x7, MA, MB, MKA, MKB):
    """part += sum_j x_j * (OFF_j + q_j) over the 8 nibbles of the words P: one FFMA chain per column."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _gemv1_nibbles(P, MA, MB, MKA, MKB)
    part += x0 * w0
    part += x1 * w1
    part += x2 * w2
    part += x3 * w3
    part += x4 * w4
    part += x5 * w5
    part += x6 * w6
    part += x7 * w7
    return part


@triton.jit
def _gemv1_store(acc, offs_m, col, mask_y, bias_ptr, y_ptr, N, stride_ym, HAS_BIAS: tl.constexpr):
    """y[offs_m, col] = acc (+ bias), in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=col < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask_y)


@triton.jit
def _gemv1_finish(offs_m, col, mask_y, bias_ptr, y_ptr, ws_ptr, N, stride_ym, HAS_BIAS: tl.constexpr):
    """Last CTA of a column tile: the workspace total (read past L1), the workspace zeroed for the next call, y."""
    ws_ptrs = ws_ptr + offs_m * N + col
    acc = tl.load(ws_ptrs, mask=mask_y, other=0.0, cache_modifier=".cg")
    tl.store(ws_ptrs, tl.zeros_like(acc), mask=mask_y)
    _gemv1_store(acc, offs_m, col, mask_y, bias_ptr, y_ptr, N, stride_ym, HAS_BIAS)


@triton.jit
def _gemv1_fence(x):
    """fence.acq_rel.gpu in every thread: its REDs into the workspace are performed at GPU scope before the CTA
    barrier that precedes the tile counter's acq_rel atomic (the reading CTA then sees every contribution)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _gemv1_w_loads(t, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg, GROUP_SIZE: tl.constexpr,
                   BLOCK_K: tl.constexpr, NCH: tl.constexpr, R: tl.constexpr, MASK_N: tl.constexpr,
                   MASK_K: tl.constexpr):
    """The weight loads of K tile t as raw words: packed rows (R x NCH tensors), scales and zeros (NCH each)."""
    BKP: tl.constexpr = BLOCK_K // 8
    g = (t * BLOCK_K) // GROUP_SIZE
    qt = q0 + t * BKP * stride_qk
    sz = g * stride_sg + sz0
    qs = ()
    for r in tl.static_range(R):
        qm = col0 < N
        if MASK_K:
            qm = qm & (t * BKP + ww * R + r < KP)
        for ch in tl.static_range(NCH):
            qs = qs + (_gemv1_load(qt + r * stride_qk + ch * 128, qm & (col0 + ch * 128 < N), MASK_N or MASK_K),)
    ss = ()
    zs = ()
    for ch in tl.static_range(NCH):
        ss = ss + (_gemv1_load(s_ptr + sz + ch * 128, col0 + ch * 128 < N, MASK_N),)
        zs = zs + (_gemv1_load(z_ptr + sz + ch * 128, col0 + ch * 128 < N, MASK_N),)
    return qs, ss, zs


@triton.jit
def _gemv1_x_loads(t, x_rows, ww, mask_m, KP, BLOCK_K: tl.constexpr, R: tl.constexpr, MASK_M: tl.constexpr,
                   MASK_K: tl.constexpr):
    """The activation loads of K tile t: R packed rows x 4 words of two 16-bit values."""
    BKP: tl.constexpr = BLOCK_K // 8
    xt = x_rows + t * (BLOCK_K // 2)
    xs = ()
    for r in tl.static_range(R):
        xm = mask_m
        if MASK_K:
            xm = xm & (t * BKP + ww * R + r < KP)
        for i in tl.static_range(4):
            xs = xs + (_gemv1_load(xt + r * 4 + i, xm, MASK_M or MASK_K),)
    return xs


@triton.jit
def _gemv1_pair(w, IS_BF16: tl.constexpr):
    """An int32 word of two 16-bit activations -> (low, high) as fp32."""
    if IS_BF16:
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    return (w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _w4a16_gemv1_kernel(
    xw_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, KP, SPLIT_K, TILES_PER_SPLIT, MA, MB, MKA, MKB,
    stride_xm, stride_qk, stride_sg, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NCH: tl.constexpr, W: tl.constexpr,
    IS_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr, MASK_M: tl.constexpr,
    MASK_N: tl.constexpr, MASK_K: tl.constexpr, USE_GDC: tl.constexpr, FENCE: tl.constexpr,
):
    """Program (pid_n, pid_k): NCH chunks of 128 columns ([BLOCK_M, W, 128]: 32 lanes x 4 columns), K tiles
    [pid_k * TILES_PER_SPLIT, ...) of BLOCK_K (one group); warp w owns packed rows w R .. w R + R - 1 of a tile
    (R = BLOCK_K / 8 / W). The warps' sums are added once at the end, then written or added to the zeroed workspace
    (the column tile's last CTA writes y). Tile t + 1's loads are issued before tile t is computed."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if USE_GDC:  # the next kernel may launch now; it waits (griddepcontrol.wait) for this grid before its reads
        tl.extra.cuda.gdc_launch_dependents()
    BKP: tl.constexpr = BLOCK_K // 8
    R: tl.constexpr = BKP // W
    BLOCK_N: tl.constexpr = NCH * 128
    mm = tl.arange(0, BLOCK_M)[:, None, None]
    ww = tl.arange(0, W)[None, :, None]
    cc = tl.arange(0, 128)[None, None, :]
    col0 = pid_n * BLOCK_N + cc
    mask_m = mm < M
    # scales / zeros [1, W, 128]: the same (broadcast) row for every warp; the offsets are written with contiguity 4
    # so that their layout is the packed tile's (4 columns per thread), no layout conversion in the loop
    sz0 = pid_n * BLOCK_N + (cc // 4) * 4 + cc % 4 + ww * 0
    q0 = qw_ptr + (ww * R) * stride_qk + col0
    x_rows = xw_ptr + mm * stride_xm + ww * (R * 4)
    acc0 = tl.zeros((BLOCK_M, W, 128), dtype=tl.float32)
    if NCH > 1:
        acc1 = tl.zeros((BLOCK_M, W, 128), dtype=tl.float32)
    if NCH > 2:
        acc2 = tl.zeros((BLOCK_M, W, 128), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, W, 128), dtype=tl.float32)
    t_start = pid_k * TILES_PER_SPLIT
    t_end = min(t_start + TILES_PER_SPLIT, tl.cdiv(KP, BKP))
    # register double buffer: the loads of tile t + 1 are issued before tile t is computed (ptxas would otherwise
    # sink each packed row's load to just before its use: one memory latency per row instead of one per tile);
    # indices are clamped to the split's last tile, whose loads are then repeated (cache hits, results unused)
    t_first = min(t_start, t_end - 1)
    nq, ns, nz = _gemv1_w_loads(t_first, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg, GROUP_SIZE,
                                BLOCK_K, NCH, R, MASK_N, MASK_K)
    if USE_GDC:
        # only the weights (never written by the previous kernel) are read before this wait; x, the workspace and
        # the counters may belong to the previous grid
        tl.extra.cuda.gdc_wait()
    nx = _gemv1_x_loads(t_first, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
    for t in range(t_start, t_end):
        qs, xw, ss, zs = nq, nx, ns, nz
        t_next = min(t + 1, t_end - 1)
        nq, ns, nz = _gemv1_w_loads(t_next, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg,
                                    GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
        nx = _gemv1_x_loads(t_next, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
        xs = ()
        for r in tl.static_range(R):
            x0, x1 = _gemv1_pair(xw[4 * r], IS_BF16)
            x2, x3 = _gemv1_pair(xw[4 * r + 1], IS_BF16)
            x4, x5 = _gemv1_pair(xw[4 * r + 2], IS_BF16)
            x6, x7 = _gemv1_pair(xw[4 * r + 3], IS_BF16)
            xs = xs + ((x0, x1, x2, x3, x4, x5, x6, x7),)
        # per thread: sums of its x rows (even / odd positions: the two offsets), then the chains' start values
        xe = (xs[0][0] + xs[0][2]) + (xs[0][4] + xs[0][6])
        xo = (xs[0][1] + xs[0][3]) + (xs[0][5] + xs[0][7])
        for r in tl.static_range(1, R):
            xe += (xs[r][0] + xs[r][2]) + (xs[r][4] + xs[r][6])
            xo += (xs[r][1] + xs[r][3]) + (xs[r][5] + xs[r][7])
        nxs = -xe - xo
        nxw = xo * -2048.0 - xe * 128.0
        part0 = zs[0].to(tl.float32) * nxs + nxw
        if NCH > 1:
            part1 = zs[1].to(tl.float32) * nxs + nxw
        if NCH > 2:
            part2 = zs[2].to(tl.float32) * nxs + nxw
            part3 = zs[3].to(tl.float32) * nxs + nxw
        for r in tl.static_range(R):
            x0, x1, x2, x3, x4, x5, x6, x7 = xs[r]
            part0 = _gemv1_fma8(part0, qs[r * NCH], x0, x1, x2, x3, x4, x5, x6, x7, MA, MB, MKA, MKB)
            if NCH > 1:
                part1 = _gemv1_fma8(part1, qs[r * NCH + 1], x0, x1, x2, x3, x4, x5, x6, x7, MA, MB, MKA, MKB)
            if NCH > 2:
                part2 = _gemv1_fma8(part2, qs[r * NCH + 2], x0, x1, x2, x3, x4, x5, x6, x7, MA, MB, MKA, MKB)
                part3 = _gemv1_fma8(part3, qs[r * NCH + 3], x0, x1, x2, x3, x4, x5, x6, x7, MA, MB, MKA, MKB)
        acc0 += part0 * ss[0].to(tl.float32)
        if NCH > 1:
            acc1 += part1 * ss[1].to(tl.float32)
        if NCH > 2:
            acc2 += part2 * ss[2].to(tl.float32)
            acc3 += part3 * ss[3].to(tl.float32)

    # the warps' partial sums (shared memory, once), then the split-K reduction
    offs_m = tl.arange(0, BLOCK_M)[:, None]
    col = pid_n * BLOCK_N + tl.arange(0, 128)[None, :]
    mask_y = (offs_m < M) & (col < N)
    ws_ptrs = ws_ptr + offs_m * N + col
    y0 = tl.sum(acc0, axis=1)
    if NCH > 1:
        y1 = tl.sum(acc1, axis=1)
    if NCH > 2:
        y2 = tl.sum(acc2, axis=1)
        y3 = tl.sum(acc3, axis=1)
    if USE_SPLIT:
        tl.atomic_add(ws_ptrs, y0, mask=mask_y, sem="relaxed")
        if NCH > 1:
            tl.atomic_add(ws_ptrs + 128, y1, mask=mask_y & (col + 128 < N), sem="relaxed")
        if NCH > 2:
            tl.atomic_add(ws_ptrs + 256, y2, mask=mask_y & (col + 256 < N), sem="relaxed")
            tl.atomic_add(ws_ptrs + 384, y3, mask=mask_y & (col + 384 < N), sem="relaxed")
        if FENCE:
            _gemv1_fence(pid_n)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            _gemv1_finish(offs_m, col, mask_y, bias_ptr, y_ptr, ws_ptr, N, stride_ym, HAS_BIAS)
            if NCH > 1:
                _gemv1_finish(offs_m, col + 128, mask_y & (col + 128 < N), bias_ptr, y_ptr, ws_ptr, N, stride_ym,
                              HAS_BIAS)
            if NCH > 2:
                _gemv1_finish(offs_m, col + 256, mask_y & (col + 256 < N), bias_ptr, y_ptr, ws_ptr, N, stride_ym,
                              HAS_BIAS)
                _gemv1_finish(offs_m, col + 384, mask_y & (col + 384 < N), bias_ptr, y_ptr, ws_ptr, N, stride_ym,
                              HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        _gemv1_store(y0, offs_m, col, mask_y, bias_ptr, y_ptr, N, stride_ym, HAS_BIAS)
        if NCH > 1:
            _gemv1_store(y1, offs_m, col + 128, mask_y & (col + 128 < N), bias_ptr, y_ptr, N, stride_ym, HAS_BIAS)
        if NCH > 2:
            _gemv1_store(y2, offs_m, col + 256, mask_y & (col + 256 < N), bias_ptr, y_ptr, N, stride_ym, HAS_BIAS)
            _gemv1_store(y3, offs_m, col + 384, mask_y & (col + 384 < N), bias_ptr, y_ptr, N, stride_ym, HAS_BIAS)


# Tiles per M bucket: (block_n, warps, resident CTAs per SM, pdl). The residency comes from offline sm_90 builds
# (bf16, K tile 128: 127 / 80 / 102 registers at M = 1 for BN 256 w4 / BN 128 w4 / BN 256 w8, 168 / 128 at M = 2
# for BN 256 w4 / w8, 255 / 168 at M = 4 for BN 256 / 128, no spill), so that the split-K grid is one full wave.
GEMV1_TILES = {
    1: ((256, 4, 4, False), (128, 4, 6, False), (256, 8, 2, False), (256, 4, 4, True)),
    2: ((256, 8, 2, False), (256, 4, 3, False), (128, 4, 4, False)),
    4: ((256, 4, 2, False), (128, 4, 3, False)),
}


def gemv1_geometry(M: int, K: int, group_size: int, cfg: W4A16Config) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, warps) of a "gemv1" launch. One group per K tile: BLOCK_K = min(cfg.block_k, group) (the
    group sizes are powers of two), except per-channel scales (group = K), where the last tile may be partial
    (masked). Each warp needs at least one packed row of the tile: warps <= BLOCK_K / 8."""
    if M > 4:
        raise ValueError(f"w4a16: method gemv1 handles M <= 4 rows, got M = {M}")
    if cfg.block_n not in (128, 256, 512):
        raise ValueError(f"w4a16: gemv1 block_n must be 128, 256 or 512, got {cfg.block_n}")
    bk = cfg.block_k if group_size == K else min(cfg.block_k, group_size)
    if bk < 8 or bk & (bk - 1):
        raise ValueError(f"w4a16: gemv1 block_k must be a power of two >= 8, got {bk}")
    warps = max(1, min(cfg.num_warps, bk // 8))
    return next_pow2(M), bk, warps


def launch_gemv1(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Method "gemv1" (``_w4a16_gemv1_kernel``): one launch, x read as it is, split-K reduced in the kernel."""
    M, K = x2d.shape
    N = qweight.shape[1]
    bm, bk, warps = gemv1_geometry(M, K, group_size, cfg)
    if x2d.stride(0) % 2 or x2d.data_ptr() % 4:
        x2d = x2d.contiguous()
    xw = x2d.view(torch.int32)  # 16-bit pairs: one 4-byte load per two activations
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    split, tiles_per_split = balanced_split(cdiv(K, bk), cfg.split_k)
    n_tiles = cdiv(N, cfg.block_n)
    if split > 1:
        ws, cnt = zeroed_workspace(x2d.device, M * N), counters(x2d.device, n_tiles)
    else:
        ws, cnt = y, y  # unused
    gpu = x2d.is_cuda and not INTERPRET
    pdl = cfg.pdl and gpu and has_pdl(x2d.device)
    _w4a16_gemv1_kernel[(n_tiles, split)](
        xw, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt,
        M, N, K // PACK, split, tiles_per_split, _GEMV1_MAGIC_A, _GEMV1_MAGIC_B, _GEMV1_MASK_A, _GEMV1_MASK_B,
        xw.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_K=bk, NCH=cfg.block_n // 128, W=warps,
        IS_BF16=x2d.dtype == torch.bfloat16, HAS_BIAS=bias is not None, USE_SPLIT=split > 1, MASK_M=M != bm,
        MASK_N=N % cfg.block_n != 0, MASK_K=K % bk != 0, USE_GDC=pdl, FENCE=gpu,
        num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return y


def gemv1_configs(M: int, N: int, K: int, group_size: int, num_sms: int) -> list[W4A16Config]:
    """The "gemv1" candidates of an M bucket up to 4 (CUDA devices; the tuner lists them after the others)."""
    bucket = m_bucket(M)
    if bucket > 4:
        return []
    out = []
    for bn, warps, ctas, pdl in GEMV1_TILES[bucket]:
        cfg = W4A16Config(block_m=bucket, block_n=bn, block_k=128, split_k=1, num_warps=warps, num_stages=1,
                          method="gemv1", pdl=pdl)
        _, bk, warps = gemv1_geometry(M, K, group_size, cfg)
        split = one_wave_split(cdiv(N, bn), cdiv(K, bk), ctas * num_sms)
        out.append(replace(cfg, block_k=bk, num_warps=warps, split_k=split))
    return out
