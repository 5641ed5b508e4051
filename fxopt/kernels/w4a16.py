"""W4A16 linear kernels: int4 weights (fxopt's packed format), fp16/bf16 activations, fused dequantization.

Ops (registered on import):

* ``torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, group_size) -> W [N, K]`` in ``scales.dtype``.
* ``torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, bias, group_size) -> y`` = ``x @ dequant(W)^T + bias``.

Format (``fxopt/quant/format.py``): ``qweight`` int32 [K/8, N], nibble j of row i = code of W[n, 8i+j];
``scales``/``zeros`` [K/G, N]; ``W = (q - zero) * scale``.

Kernels (the tuner picks one per (M bucket, K, N, group size, dtype) by timing a short candidate list the first
time a shape is seen, cached in the process and optionally in a file):

* Triton ``_w4a16_swap_kernel`` ("swapx" / "swapd"): codes as the dot's first operand (y^T = codes @ x^T), so a
  64-row weight tile fills the MMA at small M; two weights unpacked per 32-bit op into bf16 bits of 128 + q;
  with integer zeros the dot runs on raw codes and scale / zero are applied once per group to the accumulator.
* "gemv1" (M <= 4, one launch, CUDA-core FMAs) and "mma" (M <= 16, ``w4a16_mma``: mma.sync with both operands in
  registers).
* The Gluon kernel of ``w4a16_gluon`` (sm_90, bf16: warp-specialized TMA ring + wgmma) in every bucket.
* "dequant_matmul" (dequantize to a temporary 16-bit W of one linear, then cuBLAS): listed first above M = 256 (a
  prefill), where it won every shape measured; ``FXOPT_W4A16_DEQUANT_MATMUL=0`` unlists it, ``=1`` lists it from M = 33.

Picks are kept in the tuner's file (``FXOPT_W4A16_TUNE_CACHE``, keyed by GPU model, software versions, shape and
candidate list); the package ships picks for the benchmarked models' shapes on the H200 (``w4a16_picks.json``, no
versions in the key), so a first compile there times nothing for them.

Small grids split K; partials go to an fp32 workspace and the last program of a tile reduces them (one launch).
Candidates and measurements: ``docs/kernels.md``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from fxopt import env
from fxopt.kernels import cdiv, has_pdl, next_pow2, outside_graph_pools
from fxopt.kernels.launch_plan import plan_cached
from fxopt.quant.format import PACK, dequantize as _dequantize_reference

log = logging.getLogger(__name__)

__all__ = ["W4A16Config", "w4a16_matmul", "dequantize_w4_triton", "w4a16_reference", "choose_config",
           "candidate_configs"]

_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
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
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, SPLIT_K, TILES_PER_SPLIT, MAGIC2,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr, CODE_DOT: tl.constexpr, USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # -- which output tile (grouped ordering along M for L2 reuse of the weight) and which K slice
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m, offs_n, mask_m, mask_n, offs_n_safe = _tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    # Tile position r of the unpacked weight holds k = 8 (r // 8) + PERM[r % 8], PERM = 0 4 1 5 2 6 3 7: one 32-bit
    # shift-and-mask then yields the 16-bit floats of nibbles j and j + 4 side by side (see _unpack_pairs); x is
    # loaded in natural order (16-byte loads) and permuted in registers.
    x_ptrs, q_ptrs, s_ptrs, z_ptrs = _operand_ptrs(x_ptr, qw_ptr, s_ptr, z_ptr, offs_m, offs_n_safe, stride_xm,
                                                   stride_xk, stride_qk, stride_qn, stride_sn, BLOCK_K)
    k_tiles, t_start, t_end = _k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        packed = tl.load(q_ptrs + (k0 // 8) * stride_qk)
        x = tl.load(x_ptrs + k0 * stride_xk, mask=mask_m[:, None], other=0.0)
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 4)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptrs + g * stride_sg).to(tl.float32)
        z = tl.load(z_ptrs + g * stride_sg).to(tl.float32)
        wq_t = _unpack_pairs(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        if CODE_DOT:
            d = tl.dot(x, tl.trans(wq_t))
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += (d - xsum[:, None] * (z + OFFSET)[None, :]) * s[None, :]
        else:
            c = (z + OFFSET) * s
            w_t = tl.fma(wq_t.to(tl.float32), s[:, None], -c[:, None]).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w_t), acc)

    mask_y = mask_m[:, None] & mask_n[None, :]
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    _store_split_k(acc, y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
                   ws_ptr + offs_m[:, None] * N + offs_n[None, :], mask_y, bias, cnt_ptr, pid_m * num_pid_n + pid_n,
                   pid_k, SPLIT_K, M * N, USE_SPLIT, HAS_BIAS)


@triton.jit
def _w4a16_swap_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, xs_ptr,
    M, N, K, SPLIT_K, TILES_PER_SPLIT, MAGIC2,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn, stride_xsm,
    GROUP_SIZE: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_PREP: tl.constexpr = False, FRAG: tl.constexpr = False, USE_GDC: tl.constexpr = False,
    DEQ: tl.constexpr = False, ASM: tl.constexpr = True,
):
    """Swapped operands: ``y^T[BLOCK_N, BLOCK_M] += codes[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, BLOCK_M]``.

    The unpacked weight tile is the dot's first operand, which Hopper's wgmma can read from registers, so the codes
    never pass through shared memory; x (tiny) is the second. The tensor-core M dimension is the weight's N, so a
    tile needs only BLOCK_M >= 16 activation rows (M = 1..16 cost one tile). Codes are exact (OFFSET + q); scale and
    zero are applied once per K tile on the [BLOCK_N, BLOCK_M] product, as in CODE_DOT. BLOCK_K divides the group.
    """
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
    # Scale, zero and x (or, with X_PREP, x's tile sums) go through registers, which the compiler does not
    # pipeline: tile t + 1's are loaded while tile t computes, so their latency is not paid once per K tile.
    k_pre = min(t_start, k_tiles - 1) * BLOCK_K
    s_n = tl.load(s_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    z_n = tl.load(z_ptrs + (k_pre // GROUP_SIZE) * stride_sg)
    if USE_GDC:
        # launched with programmatic dependent launch after ``_prep_x_kernel``: the programs become resident and
        # load their first scales while the prep kernel runs; x and its sums are read only after this wait
        tl.extra.cuda.gdc_wait()
    if X_PREP:
        xs_ptrs = xs_ptr + offs_m * stride_xsm
        xs_n = tl.load(xs_ptrs + k_pre // BLOCK_K, mask=mask_m, other=0.0)
    else:
        x_n = tl.load(x_ptrs + k_pre * stride_xk, mask=mask_m[:, None], other=0.0)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        k1 = min(t + 1, k_tiles - 1) * BLOCK_K
        s, z = s_n.to(tl.float32), z_n.to(tl.float32)
        s_n = tl.load(s_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        z_n = tl.load(z_ptrs + (k1 // GROUP_SIZE) * stride_sg)
        if X_PREP:
            # x already in the codes' K order with its tile sums (``_prep_x_kernel``): the tile feeds the dot
            # straight from a pipelined load, and no cross-thread reduction runs per tile
            xsum = xs_n
            xs_n = tl.load(xs_ptrs + k1 // BLOCK_K, mask=mask_m, other=0.0)
            x = tl.load(x_ptrs + k0 * stride_xk, mask=mask_m[:, None], other=0.0)
            packed = tl.load(q_ptrs + (k0 // 8) * stride_qk)
            if FRAG:
                wq_t = _unpack_frag(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)
            else:
                wq_t = _unpack_pairs(packed, MAGIC2, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty)
        else:
            x = x_n
            x_n = tl.load(x_ptrs + k1 * stride_xk, mask=mask_m[:, None], other=0.0)
            packed = tl.load(q_ptrs + (k0 // 8) * stride_qk)
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 4)), (0, 1, 3, 2)),
                           (BLOCK_M, BLOCK_K))
            xsum = tl.sum(x.to(tl.float32), axis=1)
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


@triton.jit
def _w4a16_gemv2_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, SPLIT_K, TILES_PER_SPLIT, MAGIC2,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn,
    GROUP_SIZE: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, USE_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One x row per program on CUDA cores, no shared memory ("gemv", and "gemv2" whose K tiles span groups).

    Per packed word and pair j: ``t = (p >> 4 j) & 0x000F000F | MAGIC2``; ``t << 16`` and ``t & 0xFFFF0000`` read
    as fp32 are exactly OFFSET + q_j and OFFSET + q_(j+4) (MAGIC2 = 0x43004300 and OFFSET = 128 for both activation
    dtypes: the bf16 bits of 128 + q shifted into the top half are the fp32 bits).

    At M = 1 the kernel is bound by how many weight bytes are in flight, not by arithmetic: a tile of
    BLOCK_K / 8 packed rows x BLOCK_N columns is one load per thread of several 16-byte vectors. Each packed row
    reads its own (scale, zero) (a gather that hits L1: 8 weights share one), and the zero term uses the sum of the
    row's 8 activations, so nothing per weight depends on the group layout.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n_safe = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K // 8)
    q_ptrs = qw_ptr + offs_r[:, None] * stride_qk + offs_n_safe[None, :] * stride_qn
    x_row = x_ptr + pid_m * stride_xm
    k_tiles, t_start, t_end = _k_slice(pid_k, K, TILES_PER_SPLIT, BLOCK_K)
    acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        packed = tl.load(q_ptrs + (k0 // 8) * stride_qk)
        g_r = (k0 + offs_r * 8) // GROUP_SIZE
        sz_off = g_r[:, None] * stride_sg + offs_n_safe[None, :] * stride_sn
        s = tl.load(s_ptr + sz_off).to(tl.float32)
        z = tl.load(z_ptr + sz_off).to(tl.float32)
        x_r = x_row + (k0 + offs_r * 8) * stride_xk
        part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        for jj in tl.static_range(4):
            tw = ((packed >> (4 * jj)) & 0x000F000F) | MAGIC2
            lo = (tw << 16).to(tl.float32, bitcast=True)
            hi = (tw & -65536).to(tl.float32, bitcast=True)
            xl = tl.load(x_r + jj * stride_xk).to(tl.float32)
            xh = tl.load(x_r + (jj + 4) * stride_xk).to(tl.float32)
            part += lo * xl[:, None] + hi * xh[:, None]
            xs += xl + xh
        acc2 += (part - (z + OFFSET) * xs[:, None]) * s
    acc = tl.sum(acc2, axis=0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _store_split_k(acc, y_ptr + pid_m * stride_ym + offs_n * stride_yn, ws_ptr + pid_m * N + offs_n, mask_n, bias,
                   cnt_ptr, pid_m * num_pid_n + pid_n, pid_k, SPLIT_K, M * N, USE_SPLIT, HAS_BIAS)


# ---------------------------------------------------------------------------------------------------------------- gemv1
# fp32 bit patterns for the nibble conversion of ``_w4a16_gemv1_kernel`` (run-time arguments, so that the and/or is a
# single LOP3 with the mask as its immediate and the exponent in a register): a code in bits 16..19 under exponent
# 2^7 reads as 128 + q, a code in bits 12..15 under exponent 2^11 as 2048 + q.
_GEMV1_MAGIC_A, _GEMV1_MASK_A, _GEMV1_OFF_A = 0x43000000, 0x000F0000, 128.0
_GEMV1_MAGIC_B, _GEMV1_MASK_B, _GEMV1_OFF_B = 0x45000000, 0x0000F000, 2048.0


@triton.jit
def _gemv1_nibbles(P, MA, MB, MKA, MKB):
    """int32 words -> 8 fp32 tensors, nibble j of each word as OFF_j + q_j with OFF = 128 (even j) / 2048 (odd j).

    Each nibble is moved into bits 16..19 (even j) or 12..15 (odd j) of one of four copies of the word and masked
    into an fp32 whose exponent is fixed: ``(copy & MASK) | MAGIC``. Copies: the word (nibbles 3, 4), ``<< 8``
    (1, 2), ``>> 8`` (5, 6) and the half-word rotation (7, 0): 3 shifts and 8 LOP3 per 8 weights, no int->float
    conversion. Exact: the codes are integers below the fp32 unit of those bits."""
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
    PREFETCH: tl.constexpr = 1,
):
    """Method "gemv1": y[M <= 4, N] on CUDA cores in one launch, x read directly (no prep kernel).

    Program (pid_n, pid_k): columns [pid_n * 128 NCH, + 128 NCH) as NCH chunks of 128 (a [BLOCK_M, W, 128] tensor
    each: 32 lanes x 4 columns, one 16-byte load per packed row; every thread holds 4 NCH columns, so each
    activation it converts serves 4 NCH weights), K tiles [pid_k * TILES_PER_SPLIT, ...) of BLOCK_K (one group:
    BLOCK_K divides GROUP_SIZE). Warp w owns packed rows w R .. w R + R - 1 of a tile (R = BLOCK_K / 8 / W), all
    BLOCK_M rows of x. Per tile and column a thread runs one FFMA chain over its 8 R codes, started at the zero and
    offset correction -(sum_k x_k OFF_k + z sum_k x_k) of its rows, then folds it with the scale: acc += s * part.
    The warps' partial sums are added once at the end (shared memory), then either written (no split) or added to
    an fp32 workspace kept at zero between calls (``tl.atomic_add``, relaxed); the CTA that bumps the column tile's
    counter last reads the total, zeroes the workspace, adds the bias and writes y. No second launch, no memset.
    Loads are buffered in registers PREFETCH K tiles ahead (PREFETCH = 1: tile t + 1's loads are issued before tile
    t is computed; 2 / 3: a ring of register buffers, tile t + 2 / t + 3), so a warp waits for memory at most once per
    K tile and keeps PREFETCH tiles of loads in flight; no shared memory and no barrier in the K loop. The arithmetic
    does not depend on PREFETCH (same order, bit-identical results for the same split).
    """
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
    # sink each packed row's load to just before its use: one memory latency per row instead of one per tile)
    # PREFETCH > 1: a ring of register buffers, n* = tile t + 1, m* = t + 2, o* = t + 3 (indices clamped to the
    # split's last tile, whose loads are then repeated: cache hits, results unused)
    t_first = min(t_start, t_end - 1)
    nq, ns, nz = _gemv1_w_loads(t_first, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg, GROUP_SIZE,
                                BLOCK_K, NCH, R, MASK_N, MASK_K)
    if PREFETCH > 1:
        mq, ms, mz = _gemv1_w_loads(min(t_start + 1, t_end - 1), q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk,
                                    stride_sg, GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
    if PREFETCH > 2:
        oq, o_s, o_z = _gemv1_w_loads(min(t_start + 2, t_end - 1), q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk,
                                    stride_sg, GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
    if USE_GDC:
        # only the weights (never written by the previous kernel) are read before this wait; x, the workspace and
        # the counters may belong to the previous grid
        tl.extra.cuda.gdc_wait()
    nx = _gemv1_x_loads(t_first, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
    if PREFETCH > 1:
        mx = _gemv1_x_loads(min(t_start + 1, t_end - 1), x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
    if PREFETCH > 2:
        ox = _gemv1_x_loads(min(t_start + 2, t_end - 1), x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
    for t in range(t_start, t_end):
        qs, xw, ss, zs = nq, nx, ns, nz
        if PREFETCH == 1:
            t_next = min(t + 1, t_end - 1)
            nq, ns, nz = _gemv1_w_loads(t_next, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
            nx = _gemv1_x_loads(t_next, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
        else:
            nq, nx, ns, nz = mq, mx, ms, mz
            if PREFETCH == 2:
                t_far = min(t + 2, t_end - 1)
                mq, ms, mz = _gemv1_w_loads(t_far, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg,
                                            GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
                mx = _gemv1_x_loads(t_far, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
            else:
                mq, mx, ms, mz = oq, ox, o_s, o_z
                t_far = min(t + 3, t_end - 1)
                oq, o_s, o_z = _gemv1_w_loads(t_far, q0, s_ptr, z_ptr, sz0, col0, ww, N, KP, stride_qk, stride_sg,
                                            GROUP_SIZE, BLOCK_K, NCH, R, MASK_N, MASK_K)
                ox = _gemv1_x_loads(t_far, x_rows, ww, mask_m, KP, BLOCK_K, R, MASK_M, MASK_K)
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


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_wn, stride_wk,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[n, k] = (q - z) * s for one [BLOCK_K, BLOCK_N] tile (BLOCK_K divides GROUP_SIZE), stored as W [N, K]."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kp = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_n[None, :],
                     other=0)
    g = (pid_k * BLOCK_K) // GROUP_SIZE
    s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    shifts = tl.arange(0, 8) * 4
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    wq = (codes | MAGIC).to(tl.int16).to(w_ptr.dtype.element_ty, bitcast=True)
    wq = tl.reshape(wq, (BLOCK_K, BLOCK_N))
    w = tl.fma(wq.to(tl.float32), s[None, :], -((z + OFFSET) * s)[None, :]).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, w, mask=mask_n[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Configs and tuning
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class W4A16Config:
    """One launch configuration. ``method``: "swap" / "swapx" (``_w4a16_swap_kernel``; "swapx" prepares x first;
    "swapd" also dequantizes in the activation dtype before the dot, for integer zero points only),
    "fused" (``_w4a16_kernel``), "gemv" / "gemv2" (``_w4a16_gemv2_kernel``, one row per program; "gemv2" lets a K
    tile span groups), "gemv1" (``_w4a16_gemv1_kernel``, M <= 4 in one launch: block_n = 128 / 256 / 512 columns,
    block_k = K tile (capped at the group), num_warps = warps splitting the tile's packed rows, split_k, ``pdl``),
    "dequant_matmul" (Triton dequant to a 16-bit W, then cuBLAS), or "gluon"
    (``w4a16_gluon.gluon_w4a16_mm``: block_m, block_n, num_stages = its stages, ``kc``; split_k 0 = its own choice,
    about one CTA per SM). ``pdl`` (swapx/swapd on CUDA): the main kernel is launched with programmatic dependent
    launch, so it starts while x is being prepared."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    code_dot: bool = True
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    method: str = "fused"
    pdl: bool = False
    kc: int = 0  # "gluon" only: K columns per dequantized wgmma chunk
    regs: str = ""  # "gluon" only: "async" = the register split that keeps wgmma asynchronous (w4a16_gluon.py)
    deq: str = ""  # "gluon" only: "xsum" / "group" = the small-M consumer (scale and zero once per K tile)
    prefetch: int = 1  # "gemv1" / "mma": K tiles of loads kept in flight ahead of the one computed (1, 2 or 3)
    l2_ahead: int = 0  # "mma" only: K-tile distance of the prefetch.global.L2 of the weights (0: none)
    ws: str = ""  # "gluon" only: "regmajor" = the register-major split-K workspace (opt-in)

    def label(self) -> str:
        """Short printable name (the "config" column of benchmarks/w4a16.py)."""
        if self.method == "dequant_matmul":
            return self.method
        if self.method == "mma":  # block_n = warps x 16 R columns
            return (f"mma bn{self.block_n} bk{self.block_k} sk{self.split_k} w{self.num_warps}"
                    + (" pdl" if self.pdl else "") + (f" p{self.prefetch}" if self.prefetch != 1 else "")
                    + (f" l2a{self.l2_ahead}" if self.l2_ahead else ""))
        if self.method == "gemv1":
            return (f"gemv1 bn{self.block_n} bk{self.block_k} sk{self.split_k} w{self.num_warps}"
                    + (" pdl" if self.pdl else "") + (f" p{self.prefetch}" if self.prefetch != 1 else ""))
        if self.method == "gluon":
            return (f"gluon bm{self.block_m} bn{self.block_n} s{self.num_stages} kc{self.kc}"
                    + (f" {self.regs}" if self.regs else "") + (f" deq={self.deq}" if self.deq else "")
                    + (f" sk{self.split_k}" if self.split_k else "") + (f" ws={self.ws}" if self.ws else "")
                    + (" pdl" if self.pdl else ""))
        return (f"{self.method} bm{self.block_m} bn{self.block_n} bk{self.block_k} sk{self.split_k} "
                f"{'code' if self.code_dot else 'deq'} w{self.num_warps} s{self.num_stages}")


_NUM_SMS_DEFAULT = 132


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS_DEFAULT


def _m_bucket(M: int) -> int:
    return min(next_pow2(max(M, 1)), 4096)


def _fit_block_k(block_k: int, K: int, group_size: int) -> int:
    """Largest power-of-two block_k' <= block_k dividing the group size (hence K)."""
    bk = block_k
    while bk > 8 and (group_size % bk or K % bk):
        bk //= 2
    return bk


def _fit_block_k_spanning(block_k: int, K: int, group_size: int) -> int:
    """Largest power-of-two block_k' <= block_k dividing K that divides, or is a multiple of, the group size."""
    bk = block_k
    while bk > 8 and (K % bk or (group_size % bk and bk % group_size)):
        bk //= 2
    return bk


def _split_for(n_tiles_mn: int, k_tiles: int, target_ctas: int) -> int:
    split = max(1, round(target_ctas / max(n_tiles_mn, 1)))
    split = min(split, k_tiles)
    # balance: every split gets the same number of K tiles
    tiles_per = cdiv(k_tiles, split)
    return cdiv(k_tiles, tiles_per)


_GLUON = None  # the w4a16_gluon module once imported, False if it cannot be


def _gluon_module():
    """fxopt.kernels.w4a16_gluon if Triton's Gluon imports, else None (never raises: CPU use must not break)."""
    global _GLUON
    if _GLUON is None:
        try:
            from fxopt.kernels import w4a16_gluon

            _GLUON = w4a16_gluon if w4a16_gluon.HAS_GLUON else False
        except Exception as e:  # noqa: BLE001
            log.debug("w4a16: Gluon kernel unavailable (%s)", e)
            _GLUON = False
    return _GLUON or None


def _gluon_configs(M, N, K, group_size, integer_zeros, dtype, device) -> list[W4A16Config]:
    """The Gluon kernel's candidates, or [] where it does not apply or was not measured faster. It runs only on
    sm_90 (wgmma, setmaxnreg) and with swapd's exact bf16x2 dequantization (integer zeros). It beat swapd at
    M = 64-256; with the async-wgmma builds it also ties swapx at M = 1-16 on 8192 x 8192 and beats it on
    8192 x 28672 (M = 16: 48.8 against 54.6 us, gluon_w4a16_async_check.py --time-only), so every
    bucket up to 256 lists it and the tuner decides. Above 256 it is the fastest fused kernel (picked on
    every benchmark shape at M = 1024 / 4096; ``FXOPT_W4A16_GLUON_LARGE_M=0`` unlists it there). Gated on the
    bucket, not M: the tuner caches one pick per bucket. bf16 only: fp16 was never timed on a GPU.

    Buckets up to 16 also list the small-M consumer at BN 256 with ``deq="xsum"`` and no PDL (an H200 check: correct on every case; 45.7 / 47.5 us against 48.0 / 49.3 us for the
    best per-weight build at 8192 x 28672, M = 1 / 16, but 18.7 against 17.6 us at 8192 x 8192, M = 1; PDL and
    stream-K were slower)."""
    bucket = _m_bucket(M)
    if (os.environ.get("FXOPT_W4A16_GLUON") == "0" or dtype != torch.bfloat16 or device is None
            or torch.device(device).type != "cuda" or not integer_zeros or group_size != 128
            or K % 128 or N % 128
            or (bucket > 256 and os.environ.get("FXOPT_W4A16_GLUON_LARGE_M", "1") == "0")):
        return []
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    kg = _gluon_module()
    if kg is None:
        return []
    cands = kg.gluon_w4a16_configs(bucket, K, N)
    if os.environ.get("FXOPT_W4A16_GLUON_LARGEM", "0") == "1":  # opt-in until test_gpu_gluon_largem_chunked_split
        cands += kg.gluon_w4a16_largem_configs(bucket, K, N)  # split-K tiles of the 256 bucket (offline)
    cands += [c for c in kg.gluon_w4a16_small_configs(bucket, K, N)
              if c["deq"] == "xsum" and c["block_n"] == 256 and not c["pdl"]]
    # the
    # register-major split-K workspace is the main kernel's default wherever the standard split epilogue does not
    # spill (e.g. 11008 x 4096, M = 64: 27.1 -> 23.7 us; BN 256 at 8192^2, M = 64: 44.4 -> 31.8 us; at most 2% slower
    # on any probed tile), so those tiles are listed with it in place of the standard one
    # (FXOPT_W4A16_GLUON_REGMAJOR=0: the standard one). PDL after the x prep was 1-15% slower on every probed tile:
    # listed only with FXOPT_W4A16_GLUON_PDL=1.
    extra = []
    regmajor = os.environ.get("FXOPT_W4A16_GLUON_REGMAJOR", "1") == "1"
    pdl = os.environ.get("FXOPT_W4A16_GLUON_PDL", "0") == "1"
    for i, c in enumerate(cands):
        if c.get("deq") or c.get("split_k"):
            continue
        regs = kg._REGS[c["regs"]] if c.get("regs") else kg._REGS["default"]
        ws = "regmajor" if regmajor and not kg._split_epilogue_spills(c["block_m"], c["block_n"], *regs) else ""
        cands[i] = dict(c, ws=ws)
        if pdl:
            extra.append(dict(c, ws=ws, pdl=True))
    cands += extra
    return [W4A16Config(c["block_m"], c["block_n"], 128, c["split_k"] or 0, True, 8, 4, c["stages"], "gluon",
                        pdl=bool(c.get("pdl")) and not c.get("deq"), kc=c["kc"], regs=c.get("regs") or "",
                        deq=c.get("deq") or "", ws=c.get("ws") or "") for c in cands]


# "gemv1" tiles per M bucket: (block_n, warps, resident CTAs per SM, pdl, prefetch). The residency comes from the
# offline sm_90 builds (``gemv1_offline_report``, bf16, K tile 128: registers 127 / 80 / 102 at M = 1 for BN 256 w4 /
# BN 128 w4 / BN 256 w8, 168 / 128 at M = 2 for BN 256 w4 / w8, 255 / 168 at M = 4 for BN 256 / 128, no spill),
# so that the split-K grid is one full wave (``_gemv1_split_for``). ptxas issues the next
# tile's packed loads of a prefetch-1 build only 71% of the way through the current tile (SASS positions 560-567 of
# 788), a lead of about a third of a tile; prefetch 2 (a register ring, loads two tiles ahead) issues them at 85%
# of the tile before, a lead of 1.15 tiles, at 168 / 128 / 124 registers for BN 256 w4 / BN 128 w4 / BN 256 w8
# (3 / 4 / 2 CTAs per SM) and 12-14% more instructions per weight (the ring's register copies).
_GEMV1_TILES = {
    1: ((256, 4, 4, False, 1), (128, 4, 6, False, 1), (256, 8, 2, False, 1), (256, 4, 4, True, 1),
        (256, 4, 3, False, 2), (256, 4, 3, True, 2), (128, 4, 4, False, 2), (256, 8, 2, False, 2)),
    2: ((256, 8, 2, False, 1), (256, 4, 3, False, 1), (128, 4, 4, False, 1)),
    4: ((256, 4, 2, False, 1), (128, 4, 3, False, 1)),
}


def _gemv1_split_for(n_tiles: int, k_tiles: int, slots: int, cta_cost: float = 1.5) -> int:
    """K split of a "gemv1" grid (n_tiles x split CTAs, ``slots`` resident at once over the GPU): the split whose
    critical path, waves x (K tiles per CTA + ``cta_cost``), is shortest (ties: the smaller split, fewer partial
    sums). ``cta_cost`` is a CTA's fixed cost in K tiles (first loads' latency, warp reduction, REDs, fence, counter;
    a tile is about 1.7 us of a CTA's time when 16 warps share an SM). E.g. 8192 x 28672 (112 column tiles of 256,
    64 K tiles, 528 slots): split 4 (448 CTAs, one wave of 16 tiles), not 5 (560 CTAs: a second wave) nor 32 (seven
    waves of 2 tiles, each paying the fixed cost)."""
    best_cost, best = None, 1
    for s in range(1, k_tiles + 1):
        tps = cdiv(k_tiles, s)
        s_eff = cdiv(k_tiles, tps)
        cost = cdiv(n_tiles * s_eff, slots) * (tps + cta_cost)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, s_eff
    return best


# Listed for the tuner by default: test_gpu_gemv1 passed on the H200 (bf16 / fp16, group 128 and
# per-channel, M = 1..4, PDL builds included) and at M = 1 it is the fastest candidate on 3 of the 4 benchmark
# shapes (14.2 / 11.8 / 11.6 us against 15.8-17.7 us at 8192^2 / 4096x11008 / 11008x4096;
# benchmarks/results/w4a16_subset_gemv1.md); at M = 2 / 4 it loses and the tuner leaves it. FXOPT_W4A16_GEMV1=0
# takes it off the list.
_GEMV1_DEFAULT = "1"


# The prefetch-2 / 3 builds are listed only with FXOPT_W4A16_GEMV1_PREFETCH=1 until test_gpu_gemv1 has
# passed with them on a GPU (interpreter-checked and built offline only).
_GEMV1_PREFETCH_DEFAULT = "0"


def _gemv1_configs(M: int, N: int, K: int, group_size: int, num_sms: int, device) -> list[W4A16Config]:
    """The "gemv1" candidates: M buckets up to 4, CUDA devices only, listed after every other candidate so that the
    heuristic default does not change; the tuner decides (and drops one whose output disagrees with the default
    candidate's). ``FXOPT_W4A16_GEMV1=0`` takes them off the list."""
    bucket = _m_bucket(M)
    if (bucket > 4 or device is None or torch.device(device).type != "cuda"
            or os.environ.get("FXOPT_W4A16_GEMV1", _GEMV1_DEFAULT) != "1"):
        return []
    out = []
    deep = os.environ.get("FXOPT_W4A16_GEMV1_PREFETCH", _GEMV1_PREFETCH_DEFAULT) == "1"
    for bn, warps, ctas, pdl, prefetch in _GEMV1_TILES[bucket]:
        if prefetch != 1 and not deep:
            continue
        cfg = W4A16Config(block_m=bucket, block_n=bn, block_k=128, split_k=1, num_warps=warps, num_stages=1,
                          method="gemv1", pdl=pdl, prefetch=prefetch)
        _, bk, warps = _gemv1_geometry(M, K, group_size, cfg)
        split = _gemv1_split_for(cdiv(N, bn), cdiv(K, bk), ctas * num_sms)
        out.append(replace(cfg, block_k=bk, num_warps=warps, split_k=split))
    return out


# ---- tuner hook of the "mma" kernel (fxopt/kernels/w4a16_mma.py: mma.sync with the int4 codes and x as register
# operands, Gluon, sm_80+). Listed by default: its GPU test passed on the H200 (9 cases) and the tuner
# picked it on 12 of the 16 rows at M = 1-8 (benchmarks/results/w4a16_subset_gemv1_mma.md: M = 2 / 4 at 8192^2 from
# 1.81x to 2.34x / 2.1x bf16). FXOPT_W4A16_MMA=0 takes it off the list; the tuner checks its output against the
# default config's before timing it.
_MMA_DEFAULT = "1"


def _mma_configs(M: int, N: int, K: int, group_size: int, num_sms: int, device) -> list[W4A16Config]:
    """The "mma" candidates: M buckets up to 16, CUDA devices of compute capability >= 8.0 with Gluon, unless
    ``FXOPT_W4A16_MMA=0``; listed last (the heuristic default does not change)."""
    if (_m_bucket(M) > 16 or device is None or torch.device(device).type != "cuda"
            or os.environ.get("FXOPT_W4A16_MMA", _MMA_DEFAULT) != "1"):
        return []
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 0):
        return []
    try:
        from fxopt.kernels import w4a16_mma
    except Exception as e:  # noqa: BLE001
        log.debug("w4a16: mma kernel unavailable (%s)", e)
        return []
    if not w4a16_mma.HAS_GLUON:
        return []
    return w4a16_mma.candidate_configs(M, N, K, group_size, num_sms)
# ---- end of the "mma" hook


def candidate_configs(M: int, N: int, K: int, group_size: int, num_sms: int = _NUM_SMS_DEFAULT,
                      integer_zeros: bool = True, dtype: Optional[torch.dtype] = None,
                      device=None) -> list[W4A16Config]:
    """The short list of configs the tuner times for this shape (first = heuristic default). ``integer_zeros``:
    whether the layer's zero points are integers; "swapd" configs are listed only then (it is exact only for them).
    ``dtype`` / ``device``: the activation dtype and the device; "gluon" configs are listed only when both are
    given and qualify (``_gluon_configs``), after the others so the heuristic default does not change; "gemv1"
    configs (``_gemv1_configs``: M <= 4 on a CUDA device) come last."""
    bucket = _m_bucket(M)
    out: list[W4A16Config] = []

    def add(bm, bn, bk, waves, code_dot, warps, stages, method="fused"):
        if method == "swapd" and not integer_zeros:
            return
        bk = _fit_block_k(bk, K, group_size)
        if bk < 16 or (method == "swapd" and bk % 32):
            return
        n_mn = cdiv(M, bm) * cdiv(N, bn)
        split = _split_for(n_mn, K // bk, int(waves * num_sms)) if waves else 1
        # the main kernel of swapx / swapd launches with programmatic dependent launch: 0.5-1.5 us less per call at
        # M <= 16 (an H200 check)
        cfg = W4A16Config(bm, bn, bk, split, code_dot, 8, warps, stages, method, pdl=method in ("swapx", "swapd"))
        if cfg not in out:
            out.append(cfg)

    # Lists from the H200 sweeps (an H200 check, docs/kernels.md). "swapx" (weight as the register
    # operand of wgmma, x permuted and summed once per call) wins up to M = 32; "swapd" (weights dequantized before
    # the dot) from M = 64 to 256, by 12-35% over swapx (H200 sweep).
    if bucket <= 16:
        # waves = programs per SM: ~5 of 4 warps fit at BLOCK_N = 64 (registers), ~3 at 128 (Nsight Compute: at
        # M = 1 the kernel is short of eligible warps, so grids that fill those slots are in the list)
        for bn, waves, stages in ((64, 4, 3), (64, 5, 3), (128, 2, 3), (128, 3, 3), (128, 8, 3), (64, 8, 3),
                                  (128, 4, 4)):
            add(16, bn, 128, waves, True, 4, stages, "swapx")
        add(16, 64, 128, 4, True, 4, 3, "swap")
        if bucket == 16:  # within 2% of swapx at M = 16 on both shapes swept
            add(16, 64, 128, 2, True, 4, 3, "swapd")
        if bucket == 1:
            bk = _fit_block_k_spanning(256, K, group_size)
            split = _split_for(cdiv(N, 128), K // bk, 4 * num_sms)
            out.append(W4A16Config(1, 128, bk, split, False, 8, 4, 2, "gemv2"))
    elif bucket <= 32:
        for bm, bn, waves, stages in ((32, 128, 2, 3), (32, 128, 1, 3), (32, 64, 2, 3), (32, 128, 4, 4),
                                      (32, 64, 3, 3)):
            add(bm, bn, 128, waves, True, 4, stages, "swapx")
        for bn, waves in ((64, 4), (64, 2)):
            add(32, bn, 128, waves, True, 4, 3, "swapd")
    elif bucket <= 64:
        for bn, waves in ((64, 4), (64, 2), (128, 2), (128, 1)):
            add(64, bn, 128, waves, True, 4, 3, "swapd")
        add(64, 128, 128, 1, True, 8, 3, "swapd")
        for bm, bn, waves, stages in ((64, 64, 2, 4), (32, 128, 1, 3), (32, 128, 2, 3)):
            add(bm, bn, 128, waves, True, 4, stages, "swapx")
        out.append(W4A16Config(method="dequant_matmul"))
    elif bucket <= 128:
        for bm, bn, waves in ((128, 64, 2), (128, 128, 1), (128, 64, 1), (64, 128, 2)):
            add(bm, bn, 128, waves, True, 4, 3, "swapd")
        # two warpgroups split BLOCK_N: 170 registers at 128 x 128 against 255 (and a spill) with one
        for bn, waves, stages in ((128, 1, 3), (128, 2, 3), (256, 1, 3), (128, 1, 4)):
            add(128, bn, 128, waves, True, 8, stages, "swapd")
        for bm, bn, waves, stages in ((128, 64, 2, 3), (128, 64, 1, 3)):
            add(bm, bn, 128, waves, True, 4, stages, "swapx")
        out.append(W4A16Config(method="dequant_matmul"))
    elif bucket <= 256:
        for bn, waves in ((64, 1), (128, 1), (128, 2)):
            add(128, bn, 128, waves, True, 4, 3, "swapd")
        for bm, bn, stages in ((128, 128, 3), (128, 256, 3), (256, 128, 3), (128, 128, 4)):
            add(bm, bn, 128, 1, True, 8, stages, "swapd")
        out.append(W4A16Config(method="dequant_matmul"))
        add(128, 64, 128, 1, True, 4, 3, "swapx")
    else:  # compute-bound: cuBLAS on a dequantized copy (opt-in) won every shape measured, then the Gluon tiles
        out.append(W4A16Config(method="dequant_matmul"))
        for bm, bn in ((128, 256), (256, 128), (128, 128)):
            add(bm, bn, 128, 0, True, 8, 3, "swapd")
        for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4)):
            add(bm, bn, bk, 0, False, warps, stages)
    dequant = os.environ.get("FXOPT_W4A16_DEQUANT_MATMUL", "auto")
    if dequant == "0" or (dequant != "1" and bucket <= 256):
        # fused kernels only: no call writes a 16-bit copy of the weight. The default keeps dequant + cuBLAS for the
        # compute-bound buckets above M = 256 only, where it won every shape measured (a prefill): its temporary
        # 16-bit W is one linear's, freed after the call
        out = [c for c in out if c.method != "dequant_matmul"]  # every bucket also lists a fused kernel
    if not out:  # every listed config was dropped (not seen for any K that is a multiple of 16): a correct last resort
        log.warning("w4a16: no fused config fits K=%d N=%d group %d; dequantizing to a 16-bit weight", K, N,
                    group_size)
        out.append(W4A16Config(method="dequant_matmul"))
    return (out + _gluon_configs(M, N, K, group_size, integer_zeros, dtype, device)
            + _gemv1_configs(M, N, K, group_size, num_sms, device)
            + _mma_configs(M, N, K, group_size, num_sms, device))  # "mma": opt-in, 


_TUNED: dict = {}


def _bench_us(fn, reps: int = 10) -> float:
    # L2 is emptied by *reading* 256 MB: a zero-fill would leave ~50 MB of dirty lines whose write-back the timed
    # call then pays (about 12 us on an H200, more than a small-M call's own time).
    # The call is replayed from a CUDA graph: timed eagerly, a config that launches two kernels ("swapx": x is
    # prepared first) would also be charged the host's launch gap between them, which a compiled model's graph
    # does not have.
    flush = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # not capturable: eager timing (host gaps included)
        log.debug("w4a16 tuner: graph capture failed (%s), timing eagerly", e)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.max()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
    return times[len(times) // 2]


_STREAMED_MAX_BUCKET = 16  # M buckets timed back to back over weight copies (see _weight_copies)
_STREAMED_CALLS = 24


def _streamed_timing(bucket: int) -> bool:
    """Whether the tuner times this M bucket's candidates back to back (``_bench_streamed_us``)."""
    return bucket <= _STREAMED_MAX_BUCKET and os.environ.get("FXOPT_W4A16_TUNE_STREAMED", "1") != "0"


def _weight_copies(qweight, scales, zeros, budget_bytes: int) -> list:
    """The layer's packed weight and enough copies that together they exceed three times the L2 cache (at most 8
    copies, at most ``budget_bytes``), for timing calls back to back with every call reading its weight from HBM.
    [] when one extra copy does not fit the budget or the allocation fails (the tuner then times one call after an
    L2 flush)."""
    one = qweight.numel() * 4 + (scales.numel() + zeros.numel()) * scales.element_size()
    try:
        l2 = torch.cuda.get_device_properties(qweight.device).L2_cache_size
    except Exception:
        l2 = 50 * 1024 * 1024
    n = min(8, max(2, -(-3 * l2 // one)))
    if (n - 1) * one > budget_bytes:
        return []
    try:
        return [(qweight, scales, zeros)] + [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(n - 1)]
    except torch.OutOfMemoryError:
        return []


def _bench_streamed_us(fn_on, copies, reps: int, calls: int = _STREAMED_CALLS) -> float:
    """Per-call time (median over ``reps`` replays) of ``calls`` calls back to back in one CUDA graph, each on the
    next weight copy, as a model's layers run: a PDL launch then overlaps the previous call's tail, which a single
    call timed after an L2 flush never shows (at M <= 4 the tuner's pick flipped between otherwise equal PDL and
    non-PDL builds from run to run, docs/kernels.md). ``benchmarks/common.streamed_us`` is this."""
    for c in copies:
        fn_on(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn_on(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return sorted(times)[len(times) // 2]


def _agrees_with_default(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config,
                         default: W4A16Config) -> bool:
    """Safety net of the tuner for a method not yet checked on a GPU ("gemv1"): its output on the tuning
    inputs must match the heuristic default's (within the output dtype's rounding: 2e-2 of max |y| for bf16, 4e-3
    for fp16) before it is timed; otherwise it is dropped with a warning, never picked for being fast."""
    ref = _launch(x2d, qweight, scales, zeros, group_size, bias, default).float()
    y = _launch(x2d, qweight, scales, zeros, group_size, bias, cfg).float()
    tol = (2e-2 if x2d.dtype == torch.bfloat16 else 4e-3) * float(ref.abs().max()) + 1e-3
    err = float((y - ref).abs().max())
    if not err <= tol:  # NaN included
        log.warning("w4a16: %s disagrees with %s (max error %.3g > %.3g): not a candidate", cfg.label(),
                    default.label(), err, tol)
        return False
    return True


def _tune_cache_path() -> Optional[str]:
    """The tuner's file (``FXOPT_W4A16_TUNE_CACHE``; default ``~/.cache/fxopt/w4a16_tuned.json``; "0" or "": none)."""
    return env.w4a16_tune_cache()


def _tune_disk_key(device_name: str, key: tuple, cands: list) -> str:
    """One entry per device model, software versions, shape key and candidate list (a digest of the labels: an
    opt-in variable that adds or removes candidates gets its own timing): a pick timed on another GPU, Triton or
    fxopt build, or against other candidates, is never reused."""
    import fxopt  # not at module level: fxopt imports this module

    _, dtype, bucket, K, N, G, has_bias, intz = key
    # the timing method is part of the digest: picks made with the other timing method (back-to-back
    # timing of the small-M buckets on or off) are timed again
    timing = "streamed" if _streamed_timing(bucket) else "flushed"
    digest = hashlib.sha1("\n".join([f"timing {timing} rounds 2"] + [c.label() for c in cands]).encode()
                          ).hexdigest()[:12]
    return (f"{device_name}|torch {torch.__version__}|triton {triton.__version__}|fxopt {fxopt.__version__}|"
            f"{str(dtype).replace('torch.', '')} M{bucket} K{K} N{N} G{G} bias{int(has_bias)} intz{int(bool(intz))}|"
            f"cands {digest}")


def _tune_disk_load(path: Optional[str], dkey: str, cands: list) -> Optional[W4A16Config]:
    """The pick stored for ``dkey``, if it is one of ``cands``. Unreadable files are ignored: the tuner then just
    times."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(dkey)
        cfg = W4A16Config(**entry["config"]) if entry else None
    except Exception as e:  # noqa: BLE001 - a stale or hand-edited file must not break a model
        log.debug("w4a16: tuner file %s not used (%s)", path, e)
        return None
    return cfg if cfg in cands else None


def _tune_disk_store(path: Optional[str], dkey: str, cfg: W4A16Config, us: float) -> None:
    """Add one pick to the file (read-merge-replace, so concurrent processes lose at most their own entry)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        table = {}
        if os.path.exists(path):
            try:
                with open(path) as f:
                    table = json.load(f)
            except Exception:  # noqa: BLE001 - rewrite a corrupt file
                table = {}
        table[dkey] = {"config": asdict(cfg), "label": cfg.label(), "us": round(us, 2)}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("w4a16: tuner file %s not written (%s)", path, e)


_FIRST_ROUND_REPS = 10
_FINAL_ROUND_REPS = 30


def _pick_fastest(cands: list, time_us) -> tuple:
    """(config, us) of the fastest candidate; (first candidate, inf) when none could be timed.

    ``time_us(config, reps)`` gives a median time in us; a config that raises (e.g. out of shared memory) is
    skipped. Two rounds: every candidate with ``_FIRST_ROUND_REPS``, then the ones within 8% of the best (at most
    four) again with ``_FINAL_ROUND_REPS``, since near-equal builds are within one round's run-to-run noise (2-5%).
    The second round alone did not stop the M <= 4 pick flipping between PDL and non-PDL builds from one H200 run to
    the next; timing those buckets back to back did (``_bench_streamed_us``, docs/kernels.md)."""
    timed = []
    for c in cands:
        try:
            t = time_us(c, _FIRST_ROUND_REPS)
        except Exception as e:
            log.debug("w4a16 config %s failed: %s", c, e)
            continue
        timed.append((t, len(timed), c))
    if not timed:
        return (cands[0] if cands else None), float("inf")
    timed.sort(key=lambda e: (e[0], e[1]))
    close = [e for e in timed if e[0] <= 1.08 * timed[0][0]][:4]
    if len(close) == 1:
        return close[0][2], close[0][0]
    final = []
    for _, i, c in close:
        try:
            t = time_us(c, _FINAL_ROUND_REPS)
        except Exception as e:  # it ran in the first round; be safe anyway
            log.debug("w4a16 config %s failed: %s", c, e)
            continue
        final.append((t, i, c))
    if not final:
        return close[0][2], close[0][0]
    t, _, c = min(final, key=lambda e: (e[0], e[1]))
    return c, t


def choose_config(x2d, qweight, scales, zeros, group_size, bias=None) -> W4A16Config:
    """Tuned config for this shape (timed once per key on CUDA, then cached in the process and in the tuner's file,
    ``_tune_cache_path``, so a new process on the same GPU model and software reuses it); heuristic when tuning is
    impossible."""
    M, K = x2d.shape
    N = qweight.shape[1]
    interp = _interpreting() or x2d.device.type != "cuda"
    if interp:
        return _interpreter_config(M, K, group_size)
    intz = _integer_zeros(zeros)
    key = (x2d.device.index, x2d.dtype, _m_bucket(M), K, N, group_size, bias is not None, intz)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    cands = candidate_configs(M, N, K, group_size, _num_sms(x2d.device), integer_zeros=intz, dtype=x2d.dtype,
                              device=x2d.device)
    if len(cands) == 1 or env.w4a16_no_tune():
        return cands[0]
    path = _tune_cache_path()
    dkey = _tune_disk_key(torch.cuda.get_device_name(x2d.device), key, cands)
    cfg = _tune_disk_load(path, dkey, cands)
    if cfg is not None:  # timed by an earlier process on this GPU model and software (also read under capture)
        log.info("w4a16 M-bucket %d K=%d N=%d G=%d -> %s (from %s)", key[2], K, N, group_size, cfg, path)
        _TUNED[key] = cfg
        return cfg
    capturing = torch.cuda.is_current_stream_capturing()

    def agrees(c):  # "gemv1" / "mma": must match the heuristic default's output before being timed
        try:
            return _agrees_with_default(x2d, qweight, scales, zeros, group_size, bias, c, cands[0])
        except Exception as e:  # a config that fails to compile is not a candidate
            log.debug("w4a16 config %s failed: %s", c, e)
            return False

    skey = _shipped_key(dkey)
    cfg = _tune_disk_load(_SHIPPED_PICKS, skey, cands)
    if cfg is not None and (cfg.method not in ("gemv1", "mma") or (not capturing and agrees(cfg))):
        log.info("w4a16 M-bucket %d K=%d N=%d G=%d -> %s (shipped pick)", key[2], K, N, group_size, cfg)
        _TUNED[key] = cfg
        return cfg
    if capturing:  # no timing inside a CUDA-graph capture: the heuristic default
        return cands[0]

    def tune():
        copies = _weight_copies(qweight, scales, zeros, 512 * 1024 * 1024) if _streamed_timing(key[2]) else []

        def time_us(c, reps):
            if copies:  # small M: calls back to back over weight copies (PDL overlap counted, weights from HBM)
                t = _bench_streamed_us(lambda w: _launch(x2d, *w, group_size, bias, c), copies, reps)
            else:
                t = _bench_us(lambda: _launch(x2d, qweight, scales, zeros, group_size, bias, c), reps=reps)
            log.debug("w4a16 M=%d K=%d N=%d %s: %.1f us (%d reps)", M, K, N, c, t, reps)
            return t

        return _pick_fastest([c for c in cands if c.method not in ("gemv1", "mma") or agrees(c)], time_us)

    # Timed in a thread of its own: during a CUDA-graph-tree warm-up the caller's allocations go to the graph's pool,
    # which must not receive the weight copies, timing graphs and workspaces of the tuner.
    best, best_t = outside_graph_pools(tune)
    if best_t == float("inf"):
        best = cands[0]
    log.info("w4a16 tuned M-bucket %d K=%d N=%d G=%d -> %s (%.1f us)", key[2], K, N, group_size, best, best_t)
    _TUNED[key] = best
    if best_t < float("inf"):
        _tune_disk_store(path, dkey, best, best_t)
        _TIMED_HERE[skey] = (best, best_t)
    return best


# Picks timed on the GPU models the project benchmarks on, keyed like the tuner's file without the software versions
# (every candidate is correct on any version; only its speed was measured on one): the first compile on such a GPU
# times nothing for these shapes. gemv1 / mma picks are still checked against the default build before use.
# Written by ``export_picks`` (``benchmarks/generate.py --export-w4a16-picks``).
_SHIPPED_PICKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "w4a16_picks.json")
_TIMED_HERE: dict = {}  # shipped key -> (config, us) for every shape this process timed


def _shipped_key(dkey: str) -> str:
    """The tuner file's key without its torch / triton / fxopt version fields."""
    parts = dkey.split("|")
    return "|".join([parts[0]] + [p for p in parts[1:] if not p.startswith(("torch ", "triton ", "fxopt "))])


def export_picks(path: str = _SHIPPED_PICKS) -> int:
    """Merge every pick this process timed into ``path`` (default: the package's shipped table); returns how many."""
    for skey, (cfg, us) in _TIMED_HERE.items():
        _tune_disk_store(path, skey, cfg, us)
    return len(_TIMED_HERE)


def _interpreter_config(M: int, K: int, group_size: int) -> W4A16Config:
    bk = _fit_block_k(32, K, group_size)
    if M <= 16:
        return W4A16Config(block_m=16, block_n=32, block_k=bk, split_k=min(2, K // bk), code_dot=True)
    return W4A16Config(block_m=32, block_n=32, block_k=bk, split_k=1, code_dot=False)


# ----------------------------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------------------------
def _check_inputs(x, qweight, scales, zeros, group_size, bias):
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"w4a16: qweight must be int32 [K // 8, N], got "
                         f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}")
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w4a16: x must be float16 or bfloat16, got {x.dtype}")
    if scales.dtype != x.dtype or zeros.dtype != x.dtype:
        raise ValueError(f"w4a16: x dtype {x.dtype} must equal scales/zeros dtype ({scales.dtype}, {zeros.dtype})")
    if x.dim() not in (2, 3):
        raise ValueError(f"w4a16: x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"w4a16: x has {x.shape[-1]} input features but qweight packs K = {K}")
    if group_size == -1:
        group_size = K
    if group_size not in (32, 64, 128, K) or K % group_size:
        raise ValueError(f"w4a16: group size {group_size} not supported for K = {K} (32, 64, 128 or K)")
    G = K // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (G, N):
            raise ValueError(f"w4a16: {name} must be [{G}, {N}] (K={K}, group {group_size}), got {tuple(t.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"w4a16: bias must be [{N}], got {tuple(bias.shape)}")
    devs = {t.device for t in (x, qweight, scales, zeros) + ((bias,) if bias is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"w4a16: all tensors must be on one device, got {sorted(map(str, devs))}")
    return K, N, group_size


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:  # kept across calls: never from a CUDA-graph pool
        buf = outside_graph_pools(lambda: torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        _COUNTERS[device] = buf
    return buf


# Answers of ``_integer_zeros`` by storage place, for views made afresh on every call (the sibling spans of
# ``w4a16_linear_cat``): (weak ref to the storage, version, answer).
_INTEGER_ZEROS: dict = {}


def _integer_zeros(zeros: torch.Tensor) -> bool:
    """Whether every zero point is an integer (GPTQ/AWQ/RTN zeros are). Checked once per storage place and in-place
    version (a device sync; the answer is kept on the tensor and by storage, so a new view of the same numbers is not
    checked again); under CUDA-graph capture an unchecked tensor counts as not integer."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = getattr(zeros, "_fxopt_integer_zeros", None)
    if seen is not None and seen[0] == zeros._version:
        return seen[1]
    storage = StorageWeakRef(zeros.untyped_storage())
    place = (zeros.untyped_storage().data_ptr(), zeros.storage_offset(), tuple(zeros.shape), tuple(zeros.stride()))
    known = _INTEGER_ZEROS.get(place)
    if known is not None and not known[0].expired() and known[0] == storage and known[1] == zeros._version:
        return known[2]
    if zeros.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool(torch.equal(zeros, zeros.round()))
    try:
        zeros._fxopt_integer_zeros = (zeros._version, ok)
    except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes
        pass
    if len(_INTEGER_ZEROS) > 4096:
        for k in [k for k, v in _INTEGER_ZEROS.items() if v[0].expired()]:
            del _INTEGER_ZEROS[k]
    _INTEGER_ZEROS[place] = (storage, zeros._version, ok)
    return ok


def _prep_x(x2d, block_k: int, frag: bool, pdl: bool = False):
    """(x in the kernel's K order, fp32 sums of x over every block_k columns) for the X_PREP kernels."""
    M, K = x2d.shape
    xp = torch.empty((M, K), dtype=x2d.dtype, device=x2d.device)
    xs = torch.empty((M, K // block_k), dtype=torch.float32, device=x2d.device)
    chunk = min(block_k, 1024)
    _prep_x_kernel[(M, K // block_k)](x2d, xp, xs, K, x2d.stride(0), x2d.stride(1), xs.stride(0),
                                      SUM_K=block_k, CHUNK=chunk, FRAG=frag, USE_GDC=pdl, num_warps=4)
    return xp, xs


_GEMV1_WS: dict = {}


def _gemv1_workspace(device, n: int) -> torch.Tensor:
    """The fp32 split-K workspace of "gemv1", per device. Invariant: all zeros between calls (every call's last CTA
    per column tile zeroes what it read), so no memset runs per call. Like the tile counters it is shared by the
    calls on a device, which the stream serializes (with PDL a call touches it only after ``griddepcontrol.wait``)."""
    buf = _GEMV1_WS.get(device)
    if buf is None or buf.numel() < n:
        # 4 MB at least: a buffer that grows would leave captured CUDA graphs pointing at a freed one
        buf = outside_graph_pools(lambda: torch.zeros(max(n, 1 << 20), dtype=torch.float32, device=device))
        _GEMV1_WS[device] = buf
    return buf


def _gemv1_geometry(M: int, K: int, group_size: int, cfg: W4A16Config) -> tuple[int, int, int]:
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
    if cfg.prefetch not in (1, 2, 3):
        raise ValueError(f"w4a16: gemv1 prefetch must be 1, 2 or 3 K tiles, got {cfg.prefetch}")
    warps = max(1, min(cfg.num_warps, bk // 8))
    return next_pow2(M), bk, warps


def _gemv1_meta(M: int, K: int, N: int, group_size: int, cfg: W4A16Config, dtype: torch.dtype, has_bias: bool,
                split: int, gpu: bool, pdl: bool) -> dict:
    """The constexpr arguments and launch options of ``_w4a16_gemv1_kernel`` (shared by the launcher and
    ``gemv1_offline_report``)."""
    bm, bk, warps = _gemv1_geometry(M, K, group_size, cfg)
    meta = dict(GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_K=bk, NCH=cfg.block_n // 128, W=warps,
                IS_BF16=dtype == torch.bfloat16, HAS_BIAS=has_bias, USE_SPLIT=split > 1, MASK_M=M != bm,
                MASK_N=N % cfg.block_n != 0, MASK_K=K % bk != 0, USE_GDC=pdl, FENCE=gpu, PREFETCH=cfg.prefetch)
    opts = dict(num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return dict(meta=meta, opts=opts)


def _gemv1_split(K: int, bk: int, split_k: int) -> tuple[int, int]:
    """(splits, K tiles per split), balanced as everywhere else."""
    k_tiles = cdiv(K, bk)
    split = max(1, min(split_k, k_tiles))
    tiles_per_split = cdiv(k_tiles, split)
    return cdiv(k_tiles, tiles_per_split), tiles_per_split


def _launch_gemv1(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Method "gemv1" (``_w4a16_gemv1_kernel``): one launch, x read as it is, split-K reduced in the kernel."""
    M, K = x2d.shape
    N = qweight.shape[1]
    _, bk, _ = _gemv1_geometry(M, K, group_size, cfg)
    if x2d.stride(0) % 2 or x2d.data_ptr() % 4:
        x2d = x2d.contiguous()
    xw = x2d.view(torch.int32)  # 16-bit pairs: one 4-byte load per two activations
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    split, tiles_per_split = _gemv1_split(K, bk, cfg.split_k)
    n_tiles = cdiv(N, cfg.block_n)
    if split > 1:
        ws, cnt = _gemv1_workspace(x2d.device, M * N), _counters(x2d.device, n_tiles)
    else:
        ws, cnt = y, y  # unused
    gpu = x2d.is_cuda and not _interpreting()
    pdl = cfg.pdl and gpu and has_pdl(x2d.device)
    m = _gemv1_meta(M, K, N, group_size, cfg, x2d.dtype, bias is not None, split, gpu, pdl)
    _w4a16_gemv1_kernel[(n_tiles, split)](
        xw, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt,
        M, N, K // PACK, split, tiles_per_split, _GEMV1_MAGIC_A, _GEMV1_MAGIC_B, _GEMV1_MASK_A, _GEMV1_MASK_B,
        xw.stride(0), qweight.stride(0), scales.stride(0), y.stride(0), **m["meta"], **m["opts"],
    )
    return y


def sass_loops(compiled, loop_needs: str = ""):
    """Offline SASS of a compiled kernel (Triton's bundled cuobjdump; no GPU): (sass text, resource usage {reg,
    stack, shared, local}, instruction list, innermost backward-branch loops as (first, last) instruction indices).
    ``loop_needs``: keep only loops whose body contains that opcode text (e.g. "HMMA")."""
    import re
    import subprocess
    import tempfile

    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        use = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
    res = dict(zip(("reg", "stack", "shared", "local"), (int(v) for v in m.groups())))
    found = list(re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass))
    ins = [f_.group(2).strip() for f_ in found]
    addrs = [int(f_.group(1), 16) for f_ in found]
    index = {a: i for i, a in enumerate(addrs)}
    loops = []
    for i, op in enumerate(ins):
        b = re.search(r"BRA (0x[0-9a-f]+)", op)
        if b and int(b.group(1), 16) < addrs[i] and int(b.group(1), 16) in index:
            t = index[int(b.group(1), 16)]
            if not loop_needs or any(loop_needs in x for x in ins[t:i + 1]):
                loops.append((t, i))
    loops = [lp for lp in loops if not any(lp[0] <= o[0] and o[1] < lp[1] for o in loops if o != lp)]
    return sass, res, ins, loops


def gemv1_offline_report(M: int, K: int, N: int, cfg: W4A16Config, dtype: torch.dtype = torch.bfloat16,
                         group_size: int = 128, bias: bool = False, keep_sass: bool = False) -> dict:
    """Compile one "gemv1" config for sm_90 on the CPU (no GPU: ``triton.compile`` with ``GPUTarget("cuda", 90,
    32)``, the ptxas / cuobjdump shipped with Triton) and summarize the SASS: registers, stack / local bytes (spills),
    the main loop's instructions per K tile and per weight (a loop iteration is one K tile: BLOCK_K x block_n
    weights over ``32 * warps`` threads), its opcode counts, and the ALU-pipe share (LOP3 / SHF / PRMT / IADD3 /
    ISETP / SEL / LEA run at half rate on sm_90). Arguments are specialized as the JIT would (pointers 16-byte
    aligned, ints divisible by 16 marked so)."""
    import collections

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, bk, warps = _gemv1_geometry(M, K, group_size, cfg)
    split, tps = _gemv1_split(K, bk, cfg.split_k)
    m = _gemv1_meta(M, K, N, group_size, cfg, dtype, bias, split, True, cfg.pdl)
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    ints = dict(M=M, N=N, KP=K // PACK, SPLIT_K=split, TILES_PER_SPLIT=tps, MA=_GEMV1_MAGIC_A, MB=_GEMV1_MAGIC_B,
                MKA=_GEMV1_MASK_A, MKB=_GEMV1_MASK_B, stride_xm=K // 2, stride_qk=N, stride_sg=N, stride_ym=N)
    ptrs = dict(xw_ptr="*i32", qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr=f"*{dt}", bias_ptr=f"*{dt}", y_ptr=f"*{dt}",
                ws_ptr="*fp32", cnt_ptr="*i32")
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(_w4a16_gemv1_kernel.params):
        if p.name in ptrs:
            sig[p.name] = ptrs[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in ints:
            v = ints[p.name]
            if v == 1:  # the JIT specializes ints equal to 1 as constants
                sig[p.name], consts[(i,)] = "constexpr", 1
            else:
                sig[p.name] = "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name], consts[(i,)] = "constexpr", m["meta"][p.name]
    compiled = triton.compile(ASTSource(_w4a16_gemv1_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=m["opts"])
    sass, res, ins, loops = sass_loops(compiled)
    w_per_iter = bk * cfg.block_n / (32 * warps)
    alu = {"LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "SGXT", "PLOP3", "IABS", "FLO", "POPC", "VIADD"}
    out = dict(reg=res["reg"], stack=res["stack"], local=res["local"], split=split, block_k=bk,
               warps=warps, total_instr=len(ins), loops=[], **({"sass": sass} if keep_sass else {}))
    for t, e in loops:
        ops = collections.Counter((op.split(None, 1)[1] if op.startswith("@") else op).split()[0].split(".")[0]
                                  for op in ins[t:e + 1])
        n = e - t + 1
        out["loops"].append(dict(instr=n, per_weight=round(n / w_per_iter, 3),
                                 alu_per_weight=round(sum(v for k, v in ops.items() if k in alu) / w_per_iter, 3),
                                 ops=dict(ops.most_common())))
    return out


def _launch(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    M, K = x2d.shape
    N = qweight.shape[1]
    if cfg.method == "dequant_matmul":
        w = dequantize_w4_triton(qweight, scales, zeros, group_size)
        return torch.nn.functional.linear(x2d, w, bias)
    if cfg.method == "gluon":
        # as an H200 check: the wrapper prepares x in FRAG order (_prep_x), fuses the bias, and
        # raises ValueError on what it does not support (non-integer zeros included; the tuner skips such configs)
        kg = _gluon_module()
        if kg is None:
            raise ValueError("w4a16: the gluon method needs triton.experimental.gluon")
        return kg.gluon_w4a16_mm(x2d, qweight, scales, zeros, group_size, bias, block_m=cfg.block_m,
                                 block_n=cfg.block_n, stages=cfg.num_stages, kc=cfg.kc, split_k=cfg.split_k or None,
                                 **({"regs": cfg.regs} if cfg.regs else {}), **({"deq": cfg.deq} if cfg.deq else {}),
                                 **({"ws_layout": cfg.ws} if cfg.ws else {}), **({"pdl": True} if cfg.pdl else {}))
    if cfg.method == "gemv1":
        return _launch_gemv1(x2d, qweight, scales, zeros, group_size, bias, cfg)
    if cfg.method == "mma":  # listed by default (FXOPT_W4A16_MMA=0 unlists it): fxopt/kernels/w4a16_mma.py
        from fxopt.kernels import w4a16_mma

        return w4a16_mma.launch_config(x2d, qweight, scales, zeros, group_size, bias, cfg)
    spans_groups = cfg.method == "gemv2" and cfg.block_k % group_size == 0
    if K % cfg.block_k or (group_size % cfg.block_k and not spans_groups) or cfg.block_k % 16:
        raise ValueError(f"w4a16: block_k {cfg.block_k} must be a multiple of 16 dividing group size {group_size}")
    magic, offset = _MAGIC[x2d.dtype]
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    k_tiles = K // cfg.block_k
    split = max(1, min(cfg.split_k, k_tiles))
    tiles_per_split = cdiv(k_tiles, split)
    split = cdiv(k_tiles, tiles_per_split)
    n_mn = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    if cfg.method in ("gemv", "gemv2"):
        n_mn = M * cdiv(N, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2d.device)
        cnt = _counters(x2d.device, n_mn)
    else:
        ws, cnt = y, y  # unused
    if cfg.method in ("gemv", "gemv2"):
        _w4a16_gemv2_kernel[(cdiv(N, cfg.block_n), split, M)](
            x2d, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt,
            M, N, K, split, tiles_per_split, 0x43004300,
            x2d.stride(0), x2d.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0),
            scales.stride(1), y.stride(0), y.stride(1),
            GROUP_SIZE=group_size, OFFSET=128.0, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return y
    if cfg.method == "swapd" and (cfg.block_k % 32 or not _integer_zeros(zeros)):
        # swapd dequantizes with (OFFSET + z) in the activation dtype, exact only for integer zeros
        log.debug("w4a16: swapd needs integer zeros and block_k %% 32 == 0; running swapx")
        cfg = replace(cfg, method="swapx")
    if cfg.method in ("swap", "swapx", "swapd"):
        xin, xs = x2d, y  # xs unused unless prepped
        prep = cfg.method in ("swapx", "swapd")
        frag = prep and cfg.block_k % 32 == 0
        interp = _interpreting()
        pdl = cfg.pdl and prep and x2d.is_cuda and not interp and has_pdl(x2d.device)
        if prep:
            xin, xs = _prep_x(x2d, cfg.block_k, frag, pdl)
        _w4a16_swap_kernel[(n_mn, split)](
            xin, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt, xs,
            M, N, K, split, tiles_per_split, magic * 0x10001,
            xin.stride(0), xin.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0),
            scales.stride(1), y.stride(0), y.stride(1), xs.stride(0),
            GROUP_SIZE=group_size, OFFSET=offset, HAS_BIAS=bias is not None, USE_SPLIT=split > 1,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, X_PREP=prep, FRAG=frag,
            DEQ=cfg.method == "swapd", ASM=not interp, USE_GDC=pdl, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
        )
        return y
    grid = (n_mn, split)
    _w4a16_kernel[grid](
        x2d, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt,
        M, N, K, split, tiles_per_split, magic * 0x10001,
        x2d.stride(0), x2d.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        GROUP_SIZE=group_size, MAGIC=magic, OFFSET=offset, HAS_BIAS=bias is not None, CODE_DOT=cfg.code_dot,
        USE_SPLIT=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


# Launch plans (fxopt/kernels/launch_plan.py) for the eager path: on, when
# tests/test_w4a16_launch_plan_gpu.py passed on the H200 (whole one-GPU suite 433 / 433,
# an H200 run). FXOPT_LAUNCH_PLANS=0 turns them off.
_LAUNCH_PLANS = env.launch_plans()


def _plan_state(x, qweight, scales, zeros, *args, **kwargs) -> tuple:
    """What the launch path routes on beyond the arguments' metadata: whether the zero points are integers (a fact
    about their values, kept on the tensor: "swapd" is chosen only then), the tuner's table (a new entry may change
    the config of a shape) and the listed-method defaults."""
    return (_integer_zeros(zeros) if zeros.is_cuda else None, len(_TUNED), _MMA_DEFAULT)


@plan_cached(state=_plan_state, enabled=lambda: _LAUNCH_PLANS)
def w4a16_matmul(x, qweight, scales, zeros, group_size: int, bias=None,
                 config: Optional[W4A16Config] = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias) with the Triton kernel; x [..., K] (2-D or 3-D). Works on CPU tensors under
    ``TRITON_INTERPRET=1`` (fp16, tiny shapes). ``config`` forces a launch config (else tuned / heuristic)."""
    K, N, group_size = _check_inputs(x, qweight, scales, zeros, group_size, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, K)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    if x2d.shape[0] == 0:
        return x.new_empty(*lead, N)
    if config is None:
        config = choose_config(x2d, qweight, scales, zeros, group_size, bias)
    elif config.method in ("fused", "gemv", "swap", "swapx", "swapd"):
        config = replace(config, block_k=_fit_block_k(config.block_k, K, group_size))
    elif config.method == "gemv2":
        config = replace(config, block_k=_fit_block_k_spanning(config.block_k, K, group_size))
    y = _launch(x2d, qweight, scales, zeros, group_size, bias, config)
    return y.reshape(*lead, N)


def dequantize_w4_triton(qweight, scales, zeros, group_size: int, block_n: int = 64,
                         block_k: int = 128) -> torch.Tensor:
    """W [N, K] (contiguous, scales.dtype) with the Triton dequant kernel (CUDA, or CPU under the interpreter)."""
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size == -1:
        group_size = K
    if scales.dtype not in _MAGIC:
        raise ValueError(f"dequantize_w4: scales must be fp16/bf16 for the Triton kernel, got {scales.dtype}")
    bk = _fit_block_k(block_k, K, group_size)
    if bk < 8:
        raise ValueError(f"dequantize_w4: group size {group_size} / K {K} not a multiple of 8")
    magic, offset = _MAGIC[scales.dtype]
    w = torch.empty((N, K), dtype=scales.dtype, device=qweight.device)
    grid = (K // bk, cdiv(N, block_n))
    _dequant_kernel[grid](
        qweight, scales, zeros, w, N, K,
        qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), w.stride(0), w.stride(1),
        GROUP_SIZE=group_size, MAGIC=magic, OFFSET=offset, BLOCK_N=block_n, BLOCK_K=bk, num_warps=4,
    )
    return w


def w4a16_reference(x, qweight, scales, zeros, group_size: int, bias=None) -> torch.Tensor:
    """Reference: dequantize and matmul in float32, add bias, cast to x.dtype (the op's CPU path)."""
    K = qweight.shape[0] * PACK
    w = _dequantize_reference(qweight, scales, zeros, K if group_size == -1 else group_size, dtype=torch.float32)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("fxopt::dequantize_w4", mutates_args=())
def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] = (q - zeros) * scales in scales.dtype, contiguous."""
    from fxopt.quant.format import check_packed

    K = qweight.shape[0] * PACK
    gs = K if group_size == -1 else group_size
    check_packed(qweight, scales, zeros, gs)
    if qweight.device.type == "cuda" and scales.dtype in _MAGIC:
        return dequantize_w4_triton(qweight, scales.contiguous(), zeros.contiguous(), gs)
    return _dequantize_reference(qweight, scales, zeros, gs).contiguous()


@dequantize_w4.register_fake
def _(qweight, scales, zeros, group_size):
    return scales.new_empty((qweight.shape[1], qweight.shape[0] * PACK))


@torch.library.custom_op("fxopt::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ ((q - zeros) * scales).T (+ bias); x [..., K] 2-D or 3-D fp16/bf16; y [..., N] contiguous."""
    _check_inputs(x, qweight, scales, zeros, group_size, bias)
    if x.device.type == "cuda":
        if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
            # a sibling's column slice (share_sibling_storage) that the pass did not group: the kernels take rows
            # whole. The copy of the zeros inherits the slice's integer check (kept on the slice: no sync per call).
            intz = _integer_zeros(zeros)
            qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
            zeros._fxopt_integer_zeros = (zeros._version, intz)
        return w4a16_matmul(x, qweight, scales, zeros, group_size, bias)
    return w4a16_reference(x, qweight, scales, zeros, group_size, bias)


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, group_size, bias=None):
    _check_inputs(x, qweight, scales, zeros, group_size, bias)
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, group_size, bias = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.group_size = group_size
    ctx.has_bias = bias is not None


def _backward(ctx, grad_y):
    qweight, scales, zeros = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, ctx.group_size)  # [N, K]
        grad_x = torch.matmul(grad_y, w.to(grad_y.dtype))
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
    return grad_x, None, None, None, None, grad_bias


w4a16_linear.register_autograd(_backward, setup_context=_setup_context)


def column_span(parts) -> Optional[torch.Tensor]:
    """The contiguous tensor whose blocks along the last dim are ``parts``, in order, when they are adjacent slices of
    one storage (as :func:`fxopt.quant.linear.share_sibling_storage` lays siblings out); else None.

    Parts are all 2-D ``[R, N_i]`` or all 1-D ``[N_i]``. Reads only sizes, strides, offsets and storage identity, so it
    works on the pass's fake tensors (the proof) and on the op's real ones (the check on every call)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        return first if first.is_contiguous() else None
    lead = tuple(first.shape[:-1])
    if first.dim() not in (1, 2) or any(p.dim() != first.dim() or tuple(p.shape[:-1]) != lead or p.dtype != first.dtype
                                        or p.device != first.device for p in parts):
        return None
    total = sum(int(p.shape[-1]) for p in parts)
    storage = StorageWeakRef(first.untyped_storage())
    offset = first.storage_offset()
    for p in parts:
        if StorageWeakRef(p.untyped_storage()) != storage or p.storage_offset() != offset:
            return None
        if p.shape[-1] > 1 and p.stride(-1) != 1:
            return None
        if p.dim() == 2 and p.shape[0] > 1 and p.stride(0) != total:
            return None
        offset += int(p.shape[-1])
    if first.dim() == 1:
        return first.as_strided((total,), (1,), first.storage_offset())
    return first.as_strided((lead[0], total), (total, 1), first.storage_offset())


def _check_cat_inputs(x, qweights, scales, zeros, group_size, biases):
    n = len(qweights)
    if n == 0 or len(scales) != n or len(zeros) != n or (biases and len(biases) != n):
        raise ValueError(f"w4a16_linear_cat: {n} qweight(s), {len(scales)} scales, {len(zeros)} zeros and "
                         f"{len(biases)} bias(es): one of each per linear")
    for i in range(n):
        _check_inputs(x, qweights[i], scales[i], zeros[i], group_size, biases[i] if biases else None)
    return sum(q.shape[1] for q in qweights)


@torch.library.custom_op("fxopt::w4a16_linear_cat", mutates_args=())
def w4a16_linear_cat(x: torch.Tensor, qweights: list[torch.Tensor], scales: list[torch.Tensor],
                     zeros: list[torch.Tensor], group_size: int, biases: list[torch.Tensor]) -> torch.Tensor:
    """``cat([w4a16_linear(x, qweights[i], scales[i], zeros[i], group_size, biases[i]) for i], -1)``, contiguous
    (``biases``: one per linear, or empty for none).

    One kernel call over ``[K // 8, sum N]`` when each list is adjacent slices of one storage (checked on every call,
    :func:`column_span`), else one call per linear: never a different result, only slower."""
    _check_cat_inputs(x, qweights, scales, zeros, group_size, biases)
    spans = [column_span(t) for t in (qweights, scales, zeros)]
    bias = column_span(biases) if biases else None
    if all(s is not None for s in spans) and (not biases or bias is not None):
        if x.device.type == "cuda":
            return w4a16_matmul(x, *spans, group_size, bias)
        return w4a16_reference(x, *spans, group_size, bias)
    log.debug("w4a16_linear_cat: packed tensors are not adjacent slices of one storage; one call per linear")
    parts = [torch.ops.fxopt.w4a16_linear(x, qweights[i], scales[i], zeros[i], group_size,
                                          biases[i] if biases else None) for i in range(len(qweights))]
    return torch.cat(parts, dim=-1)


@w4a16_linear_cat.register_fake
def _(x, qweights, scales, zeros, group_size, biases):
    N = _check_cat_inputs(x, qweights, scales, zeros, group_size, biases)
    return x.new_empty((*x.shape[:-1], N))


def _setup_context_cat(ctx, inputs, output):
    x, qweights, scales, zeros, group_size, biases = inputs
    ctx.save_for_backward(*qweights, *scales, *zeros)
    ctx.n, ctx.group_size, ctx.has_bias = len(qweights), group_size, bool(biases)


def _backward_cat(ctx, grad_y):
    saved, n = ctx.saved_tensors, ctx.n
    grad_x, grad_biases = None, [None] * n
    if ctx.needs_input_grad[0]:
        col = 0
        for i in range(n):
            w = torch.ops.fxopt.dequantize_w4(saved[i], saved[n + i], saved[2 * n + i], ctx.group_size)  # [N_i, K]
            g = torch.matmul(grad_y[..., col:col + w.shape[0]], w.to(grad_y.dtype))
            grad_x = g if grad_x is None else grad_x + g
            col += w.shape[0]
    if ctx.has_bias and ctx.needs_input_grad[5]:
        g = grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
        grad_biases, col = [], 0
        for i in range(n):
            grad_biases.append(g[col:col + saved[i].shape[1]])
            col += saved[i].shape[1]
    none = [None] * n  # list inputs take a list of gradients
    return grad_x, none, none, none, None, grad_biases if ctx.has_bias else []


w4a16_linear_cat.register_autograd(_backward_cat, setup_context=_setup_context_cat)


if __name__ == "__main__":  # pragma: no cover - offline tooling (no GPU needed)
    import argparse

    ap = argparse.ArgumentParser(description="offline sm_90 SASS report of the gemv1 candidates (no GPU)")
    ap.add_argument("--shapes", default="8192x8192,4096x11008,11008x4096,8192x28672", help="KxN list")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for shape in args.shapes.split(","):
        K_, N_ = (int(v) for v in shape.split("x"))
        for M_ in (int(v) for v in args.ms.split(",")):
            for c in _gemv1_configs(M_, N_, K_, 128, _NUM_SMS_DEFAULT, "cuda"):
                r = gemv1_offline_report(M_, K_, N_, c, dt)
                lp = r["loops"][0]
                rows.append(dict(K=K_, N=N_, M=M_, config=c.label(), reg=r["reg"], stack=r["stack"],
                                 local=r["local"], loop_instr=lp["instr"], per_weight=lp["per_weight"],
                                 alu_per_weight=lp["alu_per_weight"], ctas=cdiv(N_, c.block_n) * r["split"]))
                print(f"{K_}x{N_} M={M_} {c.label()}: {r['reg']} registers, stack {r['stack']}, local {r['local']}, "
                      f"CTAs {rows[-1]['ctas']}, loop {lp['instr']} instructions = {lp['per_weight']} / weight "
                      f"(ALU pipe {lp['alu_per_weight']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
