"""Triton W4A16 tiles "swapx" and "swapd": the weight as the dot's first operand, x prepared once per call.

``_w4a16_swap_kernel`` computes ``y^T[BLOCK_N, BLOCK_M] = codes @ x^T`` over a K slice (the codes are wgmma's register
operand and the tensor-core M side is the weight's N, so 1-16 activation rows cost one BLOCK_M = 16 tile);
``_prep_x_kernel`` first writes x in the codes' FRAG K order with its sums per K tile. "swapx" runs the dot on the
offset codes and applies scale and zero once per K tile, ``acc += (codes @ x^T - (OFFSET + z) * sum_k x) * s``;
"swapd" dequantizes before the dot with packed PTX (exact only for integer zeros). The main kernel is launched with
programmatic dependent launch; small grids split K through an fp32 workspace and a per-tile counter (the last
program sums). Design and measurements: ``docs/kernels.md`` ("W4A16").
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv, has_pdl
from fxopt.kernels.w4a16.common import INTERPRET, MAGIC, W4A16Config, balanced_split, counters, integer_zeros

log = logging.getLogger(__name__)


@triton.jit
def _pair_words(packed, MAGIC2):
    """packed int32 [BLOCK_K/8, BLOCK_N] -> [BLOCK_N, BLOCK_K/8, 4] words: ``(p >> 4 j) & 0x000F000F | MAGIC2``
    holds the 16-bit float bits of OFFSET + nibble j (low half) and OFFSET + nibble j + 4 (high half). MAGIC2 =
    MAGIC * 0x10001 is a run-time argument so that it sits in a register and the and/or is a single LOP3: one shift
    and one and/or for two weights, and the pair is already adjacent."""
    sh = tl.arange(0, 4) * 4
    pt = tl.trans(packed)  # [BLOCK_N, BLOCK_K/8]; K contiguous per thread
    return ((pt[:, :, None] >> sh[None, None, :]) & 0x000F000F) | MAGIC2


@triton.jit
def _unpack_pairs(packed, MAGIC2, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """packed int32 [BLOCK_K/8, BLOCK_N] -> OFFSET + q as DTYPE [BLOCK_N, BLOCK_K], K in PERM order per 8-group
    (the pair words of ``_pair_words`` split into their halves, side by side)."""
    t = _pair_words(packed, MAGIC2)
    w = tl.reshape(tl.join(t.to(tl.int16), (t >> 16).to(tl.int16)), (BLOCK_N, BLOCK_K))
    return w.to(DTYPE, bitcast=True)


@triton.jit
def _store_split_k(acc, y_ptrs, ws_ptrs, mask_y, bias, cnt_ptr, tile_id, pid_k, SPLIT_K, slice_elems,
                   USE_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store a tile (+ bias, broadcast by the caller). With split-K the partial goes to slice ``pid_k`` of the fp32
    workspace; each program bumps the tile's counter (acq_rel, after a CTA barrier) and the last one to arrive sums
    the slices, adds the bias, writes y and resets the counter for the next launch."""
    if USE_SPLIT:
        tl.store(ws_ptrs + pid_k * slice_elems, acc, mask=mask_y)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros_like(acc)
            for sk in range(0, SPLIT_K):
                acc += tl.load(ws_ptrs + sk * slice_elems, mask=mask_y, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += bias
            tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask_y)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask_y)


@triton.jit
def _frag_order(t, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """Pair words [BLOCK_N, BLOCK_K/8, 4] -> DTYPE [BLOCK_N, BLOCK_K] in FRAG order: tile column c of every
    32-column chunk holds k = 8 t + 2 kb + h + 4 e with (kb, h, t, e) = (c // 16, c // 8 % 2, c // 2 % 4, c % 2).
    That is the register fragment of wgmma's first operand (thread t of a quad holds columns 2t, 2t+1, 2t+8, 2t+9 of
    each 16-column block), so the 8 codes a thread needs from a chunk are the 8 nibbles of one packed word: one
    shared-memory load per word instead of one per pair."""
    v = tl.join(t.to(tl.int16), (t >> 16).to(tl.int16))  # [BLOCK_N, BLOCK_K/8, 4, 2]: (word, pair, e)
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 4, 2, 2, 2))  # (chunk, t, kb, h, e)
    v = tl.permute(v, (0, 1, 3, 4, 2, 5))  # (chunk, kb, h, t, e)
    return tl.reshape(v, (BLOCK_N, BLOCK_K)).to(DTYPE, bitcast=True)


@triton.jit
def _unpack_frag(packed, MAGIC2, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """Like ``_unpack_pairs`` but in FRAG order (``_frag_order``)."""
    return _frag_order(_pair_words(packed, MAGIC2), BLOCK_K, BLOCK_N, DTYPE)


@triton.jit
def _unpack_frag_deq(packed, MAGIC2, zo, sc, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """``_unpack_frag`` with the dequantization ``((OFFSET + q) - (OFFSET + z)) * s`` done on the pair words by packed
    PTX ``sub``/``mul`` (sm_90), two weights per instruction: the subtraction is exact for integer zeros and the
    product is rounded once, as the float reference rounds ``(q - z) * s``. ``zo`` = OFFSET + z and ``sc`` = s are
    [BLOCK_N] in DTYPE."""
    t = _pair_words(packed, MAGIC2)
    zb = zo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    sb = sc.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    zz = tl.broadcast_to((zb | (zb << 16))[:, None, None], (BLOCK_N, BLOCK_K // 8, 4))
    ss = tl.broadcast_to((sb | (sb << 16))[:, None, None], (BLOCK_N, BLOCK_K // 8, 4))
    if DTYPE == tl.bfloat16:
        t = tl.inline_asm_elementwise("{ .reg .b32 d; sub.rn.bf16x2 d, $1, $2; mul.rn.bf16x2 $0, d, $3; }",
                                      "=r,r,r,r", [t, zz, ss], dtype=tl.int32, is_pure=True, pack=1)
    else:
        t = tl.inline_asm_elementwise("{ .reg .b32 d; sub.rn.f16x2 d, $1, $2; mul.rn.f16x2 $0, d, $3; }",
                                      "=r,r,r,r", [t, zz, ss], dtype=tl.int32, is_pure=True, pack=1)
    return _frag_order(t, BLOCK_K, BLOCK_N, DTYPE)


@triton.jit
def _k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K: tl.constexpr):
    """(number of K tiles, first and end tile) of split ``pid_k``."""
    k_tiles = K // BLOCK_K
    t_start = pid_k * TILES_PER_SPLIT
    return k_tiles, t_start, min(t_start + TILES_PER_SPLIT, k_tiles)


@triton.jit
def _tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows and columns of output tile (pid_m, pid_n), their masks, and the columns wrapped in bounds (so weight
    loads need no mask and stay 16-byte vectorized)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_safe = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N, offs_n_safe


@triton.jit
def _operand_ptrs(x_ptr, qw_ptr, s_ptr, z_ptr, offs_m, offs_n_safe, stride_xm, stride_xk, stride_qk, stride_qn,
                  stride_sn, BLOCK_K: tl.constexpr):
    """Pointers of K tile 0: x [len(offs_m), BLOCK_K] (natural K order), packed codes [BLOCK_K/8, BLOCK_N], and the
    scale and zero rows [BLOCK_N] of group 0."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_kp = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    q_ptrs = qw_ptr + offs_kp[:, None] * stride_qk + offs_n_safe[None, :] * stride_qn
    return x_ptrs, q_ptrs, s_ptr + offs_n_safe * stride_sn, z_ptr + offs_n_safe * stride_sn


@triton.jit
def _w4a16_swap_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, xs_ptr,
    M, N, K, SPLIT_K, TILES_PER_SPLIT, MAGIC2,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn, stride_xsm,
    GROUP_SIZE: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FRAG: tl.constexpr = False, USE_GDC: tl.constexpr = False, DEQ: tl.constexpr = False, ASM: tl.constexpr = True,
):
    """``y^T[BLOCK_N, BLOCK_M] += codes[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M]`` over one K slice, x prepared by
    ``_prep_x_kernel`` (PERM or FRAG order, sums per K tile); BLOCK_K divides the group (see the module docstring)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # neighbouring programs share a weight tile (pid_n) across M tiles, so the second read hits L2
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m, offs_n, mask_m, mask_n, offs_n_safe = _tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    x_ptrs, q_ptrs, s_ptrs, z_ptrs = _operand_ptrs(x_ptr, qw_ptr, s_ptr, z_ptr, offs_m, offs_n_safe, stride_xm,
                                                   stride_xk, stride_qk, stride_qn, stride_sn, BLOCK_K)
    k_tiles, t_start, t_end = _k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # Scale, zero and x's tile sums go through registers, which the compiler does not pipeline: tile t + 1's are
    # loaded while tile t computes, so their latency is not paid once per K tile.
    k_pre = min(t_start, k_tiles - 1) * BLOCK_K
    s_n = tl.load(s_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    z_n = tl.load(z_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    if USE_GDC:
        # launched with programmatic dependent launch after ``_prep_x_kernel``: the programs become resident and
        # load their first scales while the prep kernel runs; x and its sums are read only after this wait
        tl.extra.cuda.gdc_wait()
    xs_ptrs = xs_ptr + offs_m * stride_xsm
    xs_n = tl.load(xs_ptrs + k_pre // BLOCK_K, mask=mask_m, other=0.0)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        k1 = min(t + 1, k_tiles - 1) * BLOCK_K
        s, z = s_n.to(tl.float32), z_n.to(tl.float32)
        s_n = tl.load(s_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        z_n = tl.load(z_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        # x already in the codes' K order with its tile sums (``_prep_x_kernel``): the tile feeds the dot straight
        # from a pipelined load, and no cross-thread reduction runs per tile
        xsum = xs_n
        xs_n = tl.load(xs_ptrs + k1 // BLOCK_K, mask=mask_m, other=0.0)
        x = tl.load(x_ptrs + k0 * stride_xk, mask=mask_m[:, None], other=0.0)
        packed = tl.load(q_ptrs + (k0 // 8) * stride_qk)
        if FRAG:
            wq_t = _unpack_frag(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)
        else:
            wq_t = _unpack_pairs(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)
        if DEQ:
            # "swapd": the weights are dequantized before the dot (two per instruction, rounded as the reference
            # rounds), so the dot accumulates over K tiles with no per-tile correction of the [BLOCK_N, BLOCK_M]
            # product, and its wgmma can run while the next tile is unpacked (needs integer zeros: host check)
            dt = x_ptr.dtype.element_ty
            if ASM:
                w = _unpack_frag_deq(packed, MAGIC2, (z + OFFSET).to(dt), s.to(dt), BLOCK_K, BLOCK_N, dt)
            else:  # the interpreter runs no PTX: the same arithmetic on the unpacked tile (fp16 there)
                w = (wq_t - (z + OFFSET).to(dt)[:, None]) * s.to(dt)[:, None]
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            d = tl.dot(wq_t, tl.trans(x))  # [BLOCK_N, BLOCK_M]
            acc += (d - (z + OFFSET)[:, None] * xsum[None, :]) * s[:, None]

    mask_y = mask_n[:, None] & mask_m[None, :]
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    _store_split_k(acc, y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn,
                   ws_ptr + offs_m[None, :] * N + offs_n[:, None], mask_y, bias, cnt_ptr, pid_m * num_pid_n + pid_n,
                   pid_k, SPLIT_K, M * N, USE_SPLIT, HAS_BIAS)


@triton.jit
def _prep_x_kernel(x_ptr, xp_ptr, xs_ptr, K, stride_xm, stride_xk, stride_xsm,
                   SUM_K: tl.constexpr, CHUNK: tl.constexpr, FRAG: tl.constexpr, USE_GDC: tl.constexpr = False):
    """x [M, K] -> xp [M, K] with every 8-group in PERM order (the unpacked weight's K order) and the sums of x
    over each K tile, xs [M, K / SUM_K] in fp32: done once per call instead of once per weight tile in every
    program."""
    if USE_GDC:  # let the dependent W4A16 kernel launch now (it waits for this grid before reading x)
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, CHUNK)
    if FRAG:  # ``_unpack_frag``'s order within every 32 columns
        c = r % 32
        src = 32 * (r // 32) + 8 * ((c % 8) // 2) + 2 * (c // 16) + (c % 16) // 8 + 4 * (c % 2)
    else:
        src = 8 * (r // 8) + (r % 8) // 2 + 4 * (r % 2)  # position r holds k = 8 (r // 8) + PERM[r % 8]
    total = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, SUM_K, CHUNK):
        k = g * SUM_K + c0
        v = tl.load(x_ptr + m * stride_xm + (k + src) * stride_xk)
        tl.store(xp_ptr + m * K + k + r, v)
        total += v.to(tl.float32)
    tl.store(xs_ptr + m * stride_xsm + g, tl.sum(total, 0))


def prep_x(x2d, block_k: int, frag: bool, pdl: bool = False):
    """(x in the kernel's K order, fp32 sums of x over every block_k columns)."""
    M, K = x2d.shape
    xp = torch.empty((M, K), dtype=x2d.dtype, device=x2d.device)
    xs = torch.empty((M, K // block_k), dtype=torch.float32, device=x2d.device)
    chunk = min(block_k, 1024)
    _prep_x_kernel[(M, K // block_k)](x2d, xp, xs, K, x2d.stride(0), x2d.stride(1), xs.stride(0),
                                      SUM_K=block_k, CHUNK=chunk, FRAG=frag, USE_GDC=pdl, num_warps=4)
    return xp, xs


def launch_swap(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Methods "swapx" / "swapd" (``_w4a16_swap_kernel`` after ``_prep_x_kernel``)."""
    M, K = x2d.shape
    N = qweight.shape[1]
    if K % cfg.block_k or group_size % cfg.block_k or cfg.block_k % 16:
        raise ValueError(f"w4a16: block_k {cfg.block_k} must be a multiple of 16 dividing group size {group_size}")
    if cfg.method == "swapd" and (cfg.block_k % 32 or not integer_zeros(zeros)):
        # swapd dequantizes with (OFFSET + z) in the activation dtype, exact only for integer zeros
        log.debug("w4a16: swapd needs integer zeros and block_k %% 32 == 0; running swapx")
        cfg = replace(cfg, method="swapx")
    magic, offset = MAGIC[x2d.dtype]
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    split, tiles_per_split = balanced_split(K // cfg.block_k, cfg.split_k)
    n_mn = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2d.device)
        cnt = counters(x2d.device, n_mn)
    else:
        ws, cnt = y, y  # unused
    frag = cfg.block_k % 32 == 0
    pdl = cfg.pdl and x2d.is_cuda and not INTERPRET and has_pdl(x2d.device)
    xin, xs = prep_x(x2d, cfg.block_k, frag, pdl)
    _w4a16_swap_kernel[(n_mn, split)](
        xin, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt, xs,
        M, N, K, split, tiles_per_split, magic * 0x10001,
        xin.stride(0), xin.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0),
        scales.stride(1), y.stride(0), y.stride(1), xs.stride(0),
        GROUP_SIZE=group_size, OFFSET=offset, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FRAG=frag,
        DEQ=cfg.method == "swapd", ASM=not INTERPRET, USE_GDC=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return y
