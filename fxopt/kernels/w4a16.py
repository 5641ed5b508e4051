"""W4A16 linear kernels: int4 weights (fxopt's packed format), fp16/bf16 activations, fused dequantization.

Ops (registered on import):

* ``torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, group_size) -> W [N, K]`` in ``scales.dtype`` (contiguous).
  CUDA: a Triton kernel; elsewhere: :func:`fxopt.quant.format.dequantize`.
* ``torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, group_size, bias=None) -> y [..., N]`` (contiguous,
  ``x.dtype``). CUDA: the Triton kernels below; CPU: the reference (dequantize + matmul in float32, cast). Autograd
  with respect to ``x`` (and ``bias``): ``grad_x = grad_y @ W``; the packed tensors get no gradient.

Format (``fxopt/quant/format.py``): ``qweight`` int32 [K/8, N], nibble j of row i = code of W[n, 8i+j];
``scales``/``zeros`` [K/G, N]; ``W = (q - zero) * scale``.

Design
------
One Triton kernel, ``_w4a16_kernel``, computes ``y[BLOCK_M, BLOCK_N]`` tiles over a slice of K. The packed tile
[BLOCK_K/8, BLOCK_N] int32 is one coalesced load along N; it is unpacked in registers as a [BLOCK_K/8, 8, BLOCK_N]
broadcast shift-and-mask that reshapes to [BLOCK_K, BLOCK_N] in natural K order. No 16-bit weight is written to
memory. Codes become floats without an int->float conversion: ``code | 0x4300`` read as bf16 is exactly ``128 + q``
(``code | 0x6400`` read as fp16 is ``1024 + q``), so the unpack is a shift, an and/or, and a 16-bit truncation.
BLOCK_K always divides the group size, so one tile has a single (scale, zero) row. Two modes (constexpr CODE_DOT):

* CODE_DOT (small M, memory-bound): the tensor cores multiply x by the raw offset codes, and scale and zero are
  applied once per group to the [BLOCK_M, BLOCK_N] result: ``acc += (x @ (OFF + q) - (OFF + z) * sum_k x) * s``.
  With BLOCK_M = 16 this costs a few ALU ops per weight, which is what the memory-bound regime can afford.
* dequant (large M, compute-bound): ``w = (OFF + q) * s - (OFF + z) * s`` (one FMA in fp32, exact codes), cast to
  the activation dtype, then ``tl.dot`` accumulates; the per-tile dequant is shared by BLOCK_M rows.

``_w4a16_swap_kernel`` (methods "swap" and "swapx", the tuner's choice for M up to 128) swaps the operands:
``y^T[BLOCK_N, BLOCK_M] = codes[BLOCK_N, BLOCK_K] @ x^T``. The unpacked codes are then the dot's first operand,
which Hopper's wgmma reads from registers, so they never go through shared memory, and the tensor-core M dimension
is the weight's N: 1 to 16 activation rows cost one BLOCK_M = 16 tile. The packed tile is pipelined into shared
memory by the compiler (cp.async); x, scale and zero are prefetched one K tile ahead in registers. In "swapx" a small
kernel (``_prep_x_kernel``) first writes x in the codes' K order together with its sums per K tile, once per call,
so no program permutes or reduces x in its inner loop (about 40% fewer instructions per tile in the sm_90 SASS),
and the codes are unpacked in FRAG order (``_unpack_frag``): the K order of wgmma's register fragment, so a thread
reads each packed word once and uses all 8 of its nibbles (4x fewer shared-memory loads, fewer registers).
The main kernel is launched with programmatic dependent launch (``pdl``): its programs become resident and load
their first scales while the prep kernel runs, and wait (``gdc_wait``) only before reading x. "swapd"
dequantizes the codes in the activation dtype before the dot, two per PTX instruction, so the dot accumulates over
K with no per-tile correction and the wgmma stays asynchronous (integer zeros only; otherwise it runs as "swapx").
It is the tuner's main candidate from M = 17 to 256 (12-35% faster than swapx at M = 64-256 on the H200).
"gluon" (``fxopt/kernels/w4a16_gluon.py``, sm_90 only) is a warp-specialized Gluon kernel with the swapd
arithmetic: a TMA producer warp and two consumer warpgroups, one dequantizing while the other's wgmma runs. It is
listed up to M = 256 for bf16, integer zeros, group 128, K and N multiples of 128, when Gluon imports;
``FXOPT_W4A16_GLUON=0`` removes it. With its async-wgmma builds (session 7) it is the tuner's pick at M = 64-256 and
ties or beats swapx at M = 1-16 (``benchmarks/results/w4a16.md``).
``_w4a16_gemv2_kernel`` ("gemv"/"gemv2") is a CUDA-core GEMV, one x row per program; its K tiles may span several
groups ("gemv2"). It stays a candidate at M = 1.

Small M needs more CTAs than ``N / BLOCK_N`` to fill 132 SMs and keep enough bytes in flight, so K is split
(SPLIT_K programs per output tile). Partials go to an fp32 workspace; each program bumps a per-tile counter
(acq_rel atomic after a CTA barrier) and the last one to arrive sums the partials, adds the bias, writes y and resets
the counter. One launch, no memset, no extra reduction kernel.

Configs are picked per (M bucket, K, N, group size, dtype) by timing a short candidate list on the device the first
time a shape is seen (L2 emptied by reading a large buffer between runs, each candidate replayed from a CUDA graph),
then cached. Under CUDA-graph capture or in the Triton interpreter no tuning happens (a heuristic config;
``FXOPT_W4A16_NO_TUNE=1`` forces that too). From M = 64 the candidate list also contains "dequantize to a 16-bit W
with the Triton dequant kernel, then cuBLAS", and from M = 256 it comes first: there the GEMM is compute-bound,
cuBLAS beats Triton, and the extra dequant pass (the packed bytes read, a 16-bit W written) costs less than the
per-tile unpacking; the tuner keeps it only where it measures faster. This is the one path that writes a 16-bit W to
memory (a temporary, freed after the call); the fused paths never do.
Measurements and predictions: ``docs/notes_w4a16.md``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv, has_pdl, next_pow2
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
    tile span groups), "dequant_matmul" (Triton dequant to a 16-bit W, then cuBLAS), or "gluon"
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

    def label(self) -> str:
        """Short printable name (the "config" column of benchmarks/w4a16.py)."""
        if self.method == "dequant_matmul":
            return self.method
        if self.method == "gluon":
            return (f"gluon bm{self.block_m} bn{self.block_n} s{self.num_stages} kc{self.kc}"
                    + (f" {self.regs}" if self.regs else "") + (f" deq={self.deq}" if self.deq else ""))
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
    8192 x 28672 (M = 16: 48.8 against 54.6 us, session 7, gluon_w4a16_async_check.py --time-only), so every
    bucket up to 256 lists it and the tuner decides. Gated on the bucket, not M: the tuner caches one pick per
    bucket. bf16 only: fp16 was never timed on a GPU.

    Buckets up to 16 also list the small-M consumer at BN 256 with ``deq="xsum"`` and no PDL (session 8,
    benchmarks/gluon_w4a16_small_check.py: correct on every case; 45.7 / 47.5 us against 48.0 / 49.3 us for the
    best per-weight build at 8192 x 28672, M = 1 / 16, but 18.7 against 17.6 us at 8192 x 8192, M = 1; PDL and
    stream-K were slower)."""
    bucket = _m_bucket(M)
    if (os.environ.get("FXOPT_W4A16_GLUON") == "0" or dtype != torch.bfloat16 or device is None
            or torch.device(device).type != "cuda" or not integer_zeros or group_size != 128
            or K % 128 or N % 128 or bucket > 256):
        return []
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    kg = _gluon_module()
    if kg is None:
        return []
    cands = kg.gluon_w4a16_configs(bucket, K, N)
    cands += [c for c in kg.gluon_w4a16_small_configs(bucket, K, N)
              if c["deq"] == "xsum" and c["block_n"] == 256 and not c["pdl"]]
    return [W4A16Config(c["block_m"], c["block_n"], 128, c["split_k"] or 0, True, 8, 4, c["stages"], "gluon",
                        kc=c["kc"], regs=c.get("regs") or "", deq=c.get("deq") or "") for c in cands]


def candidate_configs(M: int, N: int, K: int, group_size: int, num_sms: int = _NUM_SMS_DEFAULT,
                      integer_zeros: bool = True, dtype: Optional[torch.dtype] = None,
                      device=None) -> list[W4A16Config]:
    """The short list of configs the tuner times for this shape (first = heuristic default). ``integer_zeros``:
    whether the layer's zero points are integers; "swapd" configs are listed only then (it is exact only for them).
    ``dtype`` / ``device``: the activation dtype and the device; "gluon" configs are listed only when both are
    given and qualify (``_gluon_configs``), after the others so the heuristic default does not change."""
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
        # M <= 16 (benchmarks/w4a16_breakdown.py)
        cfg = W4A16Config(bm, bn, bk, split, code_dot, 8, warps, stages, method, pdl=method in ("swapx", "swapd"))
        if cfg not in out:
            out.append(cfg)

    # Lists from the H200 sweeps (benchmarks/w4a16_sweep.py, docs/notes_w4a16.md). "swapx" (weight as the register
    # operand of wgmma, x permuted and summed once per call) wins up to M = 32; "swapd" (weights dequantized before
    # the dot) from M = 64 to 256, by 12-35% over swapx (sweep of 2026-11-29, session 5).
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
    else:  # compute-bound: cuBLAS on a dequantized copy won every shape measured; the fused GEMMs stay as options
        out.append(W4A16Config(method="dequant_matmul"))
        for bm, bn in ((128, 256), (256, 128), (128, 128)):
            add(bm, bn, 128, 0, True, 8, 3, "swapd")
        for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4)):
            add(bm, bn, bk, 0, False, warps, stages)
    if not out:  # every listed config was dropped (e.g. swapd without integer zeros): the safe default
        out.append(W4A16Config(method="dequant_matmul"))
    return out + _gluon_configs(M, N, K, group_size, integer_zeros, dtype, device)


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


def choose_config(x2d, qweight, scales, zeros, group_size, bias=None) -> W4A16Config:
    """Tuned config for this shape (timed once per key on CUDA, then cached); heuristic when tuning is impossible."""
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
    if torch.cuda.is_current_stream_capturing() or len(cands) == 1 or os.environ.get("FXOPT_W4A16_NO_TUNE") == "1":
        return cands[0]
    best, best_t = cands[0], float("inf")
    for c in cands:
        try:
            t = _bench_us(lambda: _launch(x2d, qweight, scales, zeros, group_size, bias, c))
        except Exception as e:  # a config that fails to compile (e.g. out of shared memory) is skipped
            log.debug("w4a16 config %s failed: %s", c, e)
            continue
        log.debug("w4a16 M=%d K=%d N=%d %s: %.1f us", M, K, N, c, t)
        if t < best_t:
            best, best_t = c, t
    log.info("w4a16 tuned M-bucket %d K=%d N=%d G=%d -> %s (%.1f us)", key[2], K, N, group_size, best, best_t)
    _TUNED[key] = best
    return best


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
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _integer_zeros(zeros: torch.Tensor) -> bool:
    """Whether every zero point is an integer (GPTQ/AWQ/RTN zeros are). Checked once per tensor and in-place version
    (the answer is kept on the tensor); under CUDA-graph capture an unchecked tensor counts as not integer."""
    seen = getattr(zeros, "_fxopt_integer_zeros", None)
    if seen is not None and seen[0] == zeros._version:
        return seen[1]
    if zeros.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool(torch.equal(zeros, zeros.round()))
    try:
        zeros._fxopt_integer_zeros = (zeros._version, ok)
    except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes: checked every call
        pass
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


def _launch(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    M, K = x2d.shape
    N = qweight.shape[1]
    if cfg.method == "dequant_matmul":
        w = dequantize_w4_triton(qweight, scales, zeros, group_size)
        return torch.nn.functional.linear(x2d, w, bias)
    if cfg.method == "gluon":
        # as benchmarks/gluon_w4a16_check.py: the wrapper prepares x in FRAG order (_prep_x), fuses the bias, and
        # raises ValueError on what it does not support (non-integer zeros included; the tuner skips such configs)
        kg = _gluon_module()
        if kg is None:
            raise ValueError("w4a16: the gluon method needs triton.experimental.gluon")
        return kg.gluon_w4a16_mm(x2d, qweight, scales, zeros, group_size, bias, block_m=cfg.block_m,
                                 block_n=cfg.block_n, stages=cfg.num_stages, kc=cfg.kc, split_k=cfg.split_k or None,
                                 **({"regs": cfg.regs} if cfg.regs else {}), **({"deq": cfg.deq} if cfg.deq else {}))
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
