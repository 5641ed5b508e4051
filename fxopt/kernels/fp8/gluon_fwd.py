"""The Gluon FP8 (e4m3) attention forward for Hopper (sm_90): the op's kernel at d = 64 / 128.

The structure of the bf16 ``attention.gluon_fwd`` "default" build (128 query rows per CTA, a TMA producer warp, two
consumer warpgroups pipelining S_i = Q K_i^T against O += P8_{i-1} V_{i-1}) on ``quant.quantize_qkv``'s inputs, with
the block scales folded as the Triton kernel folds them. V is transposed (fp8 wgmma reads shared operands K-major
only); P, scaled by 2^8, is cast to e4m3 in registers as the A operand. ``permute_k``: K is read through a 5-D TMA
view that permutes keys inside every 16, so P needs no cross-lane exchange; ``cast_late``: P_{i-1} is carried in
fp32 and cast right before the PV wgmma. Layouts and measurements: ``docs/kernels.md`` ("FP8 attention").
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fxopt.kernels.attention.gluon_common import (
    GLUON_IMPORT_ERROR,
    LOG2E,
    TensorDescriptor,
    as_tma_box,
    common_reason,
    fence_async_shared,
    gl,
    gluon,
    host_layout,
    mbarrier,
    qkv_reason,
    tma,
    tma_desc,
    tma_stride_reason,
    unmasked_blocks,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .quant import QUANT_BLOCK as QBLOCK
from .quant import check_attn_inputs, quantize_qkv

WG_ROWS = 64
# head dim -> (BLOCK_N, STAGES). BLOCK_N must divide QBLOCK (one K / V scale per key block).
_CONFIGS = {64: (128, 4), 128: (128, 3)}
_MAXNREG = 168
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24


@gluon.jit
def _f8_producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 b, h, hk, bhk, m0, n_blocks, SK_PAD, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_bars.index(w),
                                        as_tma_box(q_smem.index(w), q_desc))
    for j in range(n_blocks):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        # 5-D view [rows / 16, jl, q, e, d] of the flat K: smem row 8 jl + 2 q + e = key 4 q + 2 jl + e
        tma.async_copy_global_to_shared(k_desc, [(bhk * SK_PAD + j * BLOCK_N) // 16, 0, 0, 0, 0],
                                        k_ready.index(s), as_tma_box(k_smem.index(s), k_desc))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), vt_desc.block_type.nbytes)
        # V^T [d, Sk_pad]: the box is all d rows x BLOCK_N key columns
        tma.async_copy_global_to_shared(vt_desc, [b, hk, 0, j * BLOCK_N], v_ready.index(s),
                                        as_tma_box(v_smem.index(s), vt_desc))


@gluon.jit
def _f8_mask(s, n0, rows, SEQ_K, diag_off, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # score column c = 16 g + 8 jl + 2 q + e holds key 16 g + 4 q + 2 jl + e (permute_k)
    c = (c & ~15) + ((c >> 1) & 3) * 4 + ((c >> 3) & 1) * 2 + (c & 1)
    cols = n0 + c
    if CAUSAL:  # the Sk bound folded into each row's last visible key: one compare per element
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(gl.minimum(rows + diag_off, SEQ_K - 1), 1)
    else:
        keep = gl.expand_dims(cols < SEQ_K, 0)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _f8_p_operand(p, fp8: gl.constexpr, p_layout: gl.constexpr):
    """fp32 P (wgmma accumulator layout) -> e4m3 A operand of the PV wgmma (k_width 4): relabel the columns by their
    key in fp32 (swap the jl and q axes: pure register renaming), then cast in the operand layout."""
    R0: gl.constexpr = p.shape[0]
    N0: gl.constexpr = p.shape[1]
    p = gl.reshape(p, [R0, N0 // 16, 2, 4, 2])
    p = gl.permute(p, (0, 1, 3, 2, 4))
    p = gl.reshape(p, [R0, N0])
    return gl.convert_layout(p, p_layout).to(fp8)


@gluon.jit
def _f8_softmax(s, m_i, l_i, c):
    """Online-softmax step on raw fp8-dot scores s; c = qs * ks_j * scale * log2(e) > 0. m_i / m_new are in log2
    units (scaled). Returns (p = exp2(s c - m + 8) fp32, m_new, l_new, alpha)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * c)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * c - gl.expand_dims(m_use - 8.0, 1))  # one FFMA + MUFU.EX2 per score; 8.0 = P_SHIFT
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, m_i, l_i, vs_prev,
             ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
             QB: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr):
    """Key block i >= 1, straight-line from the first wgmma issue to the last wait. ``p8`` is the fp32 P_{i-1}; it
    is cast to the e4m3 A operand between the QK_i issue and the PV_{i-1} issue (while QK_i runs), and the fp32 P_i
    is returned in its place."""
    fp8: gl.constexpr = q_buf.dtype
    # block scales of key block i (issued before the waits so their latency hides behind them)
    c = qk_scale * gl.load(ks_base + (i * BLOCK_N) // QB)
    vs_i = gl.load(vs_base + (i * BLOCK_N) // QB)
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    a8 = _f8_p_operand(p8, fp8, p_layout)
    jv = i - 1
    vslot = jv % STAGES
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    o = warpgroup_mma(a8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _f8_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c)
    # deps=[o] only: Triton 3.6 cannot lower an 8-bit tensor as a wait dependency; ptxas itself keeps P8's
    # registers untouched while the wgmma that reads them runs.
    o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)
    # O was in units of vs_{i-1}; after this it is in units of vs_i (the PV_i about to be added)
    o = o * gl.expand_dims(gl.convert_layout(alpha * (vs_prev / vs_i), orow_layout), 1)
    return s, o, p, m_i, l_i, vs_i


@gluon.jit
def _f8_consumer(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready,
                 v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                 sm_scale_log2, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    out_dtype: gl.constexpr = o_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    row_first = m0 + WG * ROWS
    rows = row_first + gl.arange(0, ROWS, layout=row_layout)
    diag_off = SEQ_K - SEQ_Q
    n_full = unmasked_blocks(row_first, diag_off, SEQ_K, n_blocks, BLOCK_N, CAUSAL)

    # 128 query rows per CTA = one quantization block of Q: one scale for both warpgroups
    qk_scale = gl.load(qs_ptr + bh * NQB + m0 // QB) * sm_scale_log2
    ks_base = ks_ptr + bhk * NKB
    vs_base = vs_ptr + bhk * NKB

    q_buf = q_smem.index(WG)
    mbarrier.wait(q_bars.index(WG), 0)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # ---- block 0
    c0 = qk_scale * gl.load(ks_base)
    vs_prev = gl.load(vs_base)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        s = _f8_mask(s, 0, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p8, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c0)

    for i in range(1, n_full):
        s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                               o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows, SEQ_K,
                                               diag_off, BLOCK_N, STAGES, CAUSAL, False, QB, s_layout, p_layout,
                                               orow_layout)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                               o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows, SEQ_K,
                                               diag_off, BLOCK_N, STAGES, CAUSAL, True, QB, s_layout, p_layout,
                                               orow_layout)

    # ---- tail: O += P8_{n-1} V_{n-1}
    jv = n_blocks - 1
    vslot = jv % STAGES
    p8 = _f8_p_operand(p8, q_buf.dtype, p_layout)
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    o = warpgroup_mma(p8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)

    # ---- epilogue: O * vs_{n-1} / l (0 for rows without a visible key)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o * gl.expand_dims(gl.convert_layout(vs_prev / l_safe, orow_layout), 1)
    if WRITE_LSE:
        # l sums p * 2^8: lse2 = m + log2(l) - 8
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe) - 8.0) * 0.6931471805599453)
        gl.store(lse_ptr + bh.to(gl.int64) * SEQ_Q + rows, lse, mask=rows < SEQ_Q)
    o_buf = o_smem.index(WG)
    o_buf.store(o.to(out_dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], as_tma_box(o_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _fp8_fa3_fwd_kernel(q_desc, k_desc, vt_desc, o_desc, qs_ptr, ks_ptr, vs_ptr, lse_ptr, sm_scale_log2,
                        H, GROUP, H_KV, SEQ_Q, SEQ_K, NQB, NKB, NUM_M_BLOCKS,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        WRITE_LSE: gl.constexpr, QB: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    fp8: gl.constexpr = q_desc.dtype
    out_dtype: gl.constexpr = o_desc.dtype
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m
    b = bh // H
    h = bh % H
    hk = h // GROUP
    bhk = b * H_KV + hk
    m0 = pid_m * (2 * ROWS)

    hi = SEQ_K
    if CAUSAL:
        hi = gl.minimum(SEQ_K, m0 + 2 * ROWS + (SEQ_K - SEQ_Q))
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], fp8)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], fp8)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], fp8)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], out_dtype)
    q_smem = gl.allocate_shared_memory(fp8, [2, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_N], v_layout)
    o_smem = gl.allocate_shared_memory(out_dtype, [2, ROWS, HEAD_DIM], o_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_f8_consumer, (0, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                        qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                        sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB)),
        (_f8_consumer, (1, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                        qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                        sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB)),
        (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                        v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Host side


def fp8_gluon_supported(q, k, v, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``fp8_gluon_attention`` can run these (bf16 / fp16) inputs, else a one-line reason."""
    reason = common_reason((("q", q), ("k", k), ("v", v)), (torch.bfloat16, torch.float16), 9)
    if reason is not None:
        return reason
    reason = qkv_reason(q, k, v, _CONFIGS, scale)
    if reason is not None:
        return reason
    B, Hq = q.shape[:2]
    if B * Hq > 65535:
        return f"B * Hq = {B * Hq} exceeds the grid's y limit (65535)"
    return None


def _quantized_reason(qq, qs, kq, ks, vt, vs, shape_q, seq_k, n_kv_heads, out) -> Optional[str]:
    if GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})"
    B, Hq, Sq, D = shape_q
    if D not in _CONFIGS:
        return f"head dim {D} not supported by the Gluon fp8 kernel (only {sorted(_CONFIGS)})"
    for name, t in (("qq", qq), ("kq", kq), ("vt", vt)):
        if t.dtype != torch.float8_e4m3fn:
            return f"{name}: dtype {t.dtype}, expected torch.float8_e4m3fn"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
        r = tma_stride_reason(name, t)
        if r:
            return r
    sq_pad, sk_pad = qq.shape[2], kq.shape[2]
    if sq_pad % QBLOCK or sk_pad % QBLOCK:
        return f"padded lengths {sq_pad} / {sk_pad} are not multiples of QBLOCK={QBLOCK}"
    if tuple(qq.shape) != (B, Hq, sq_pad, D) or tuple(kq.shape) != (B, n_kv_heads, sk_pad, D):
        return f"qq {tuple(qq.shape)} / kq {tuple(kq.shape)} do not match shape_q {shape_q}, Hkv {n_kv_heads}"
    if tuple(vt.shape) != (B, n_kv_heads, D, sk_pad):
        return f"vt {tuple(vt.shape)} is not V transposed [B, Hkv, D, Sk_pad]"
    if sq_pad < Sq or sk_pad < seq_k:
        return "quantized tensors shorter than the sequence"
    if tuple(qs.shape) != (B * Hq, sq_pad // QBLOCK) or tuple(ks.shape) != (B * n_kv_heads, sk_pad // QBLOCK) \
            or tuple(vs.shape) != tuple(ks.shape):
        return f"scale shapes qs {tuple(qs.shape)} ks {tuple(ks.shape)} vs {tuple(vs.shape)} do not match"
    for name, t in (("qs", qs), ("ks", ks), ("vs", vs)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            return f"{name} must be contiguous fp32"
    if out is not None:
        r = tma_stride_reason("out", out)
        if r:
            return r
    return None


def _k_desc(kq: torch.Tensor, block_n: int):
    """K's TMA descriptor: a 5-D view [rows / 16, jl, q, e, d] of the contiguous [B, Hkv, Sk_pad, d] tensor with
    strides [16 d, 2 d, 4 d, d, 1], so a box lands in shared memory with row 8 jl + 2 q + e holding key
    4 q + 2 jl + e of each 16 (jl and q swapped; the TMA unit accepts the non-monotonic strides)."""
    D = kq.shape[-1]
    rows = kq.shape[0] * kq.shape[1] * kq.shape[2]
    block = [block_n // 16, 2, 4, 2, D]
    return TensorDescriptor(kq, [rows // 16, 2, 4, 2, D], [16 * D, 2 * D, 4 * D, D, 1], block,
                            host_layout(tuple(block), kq.dtype))


def fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, *, shape_q, seq_k, n_kv_heads, out_dtype,
                                  is_causal=False, scale=None, out=None):
    """The Gluon kernel alone, on ``quant.quantize_qkv`` outputs (the arguments of
    ``triton_fwd.fp8_attention_quantized``) -> out."""
    B, Hq, Sq, D = shape_q
    reason = _quantized_reason(qq, qs, kq, ks, vt, vs, shape_q, seq_k, n_kv_heads, out)
    if reason is None and scale is not None and not (float(scale) > 0.0):
        reason = f"scale must be > 0 (got {scale})"
    if reason is not None:
        raise ValueError(f"fp8_gluon_attention: {reason}")
    Hkv = n_kv_heads
    if out is None:
        out = torch.empty((B, Hq, Sq, D), device=qq.device, dtype=out_dtype)
    if B * Hq * Sq == 0:
        return out
    if seq_k == 0:
        return out.zero_()
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    block_n, stages = _CONFIGS[D]
    num_m = (Sq + 2 * WG_ROWS - 1) // (2 * WG_ROWS)
    _fp8_fa3_fwd_kernel[(num_m, B * Hq)](
        tma_desc(qq, WG_ROWS), _k_desc(kq, block_n), tma_desc(vt, D, block_n), tma_desc(out, WG_ROWS), qs, ks, vs,
        qs, sm_scale * LOG2E,
        Hq, Hq // Hkv, Hkv, Sq, seq_k, qq.shape[2] // QBLOCK, kq.shape[2] // QBLOCK, num_m,
        HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(is_causal), WRITE_LSE=False,
        QB=QBLOCK, CONSUMER_REGS=_CONSUMER_REGS, PRODUCER_REGS=_PRODUCER_REGS, num_warps=4, maxnreg=_MAXNREG)
    return out


def fp8_gluon_attention(q, k, v, is_causal: bool = False, scale: Optional[float] = None, hadamard: bool = True,
                        seed: int = 0, *, out=None):
    """Same options as ``torch.ops.fxopt.fp8_attention``: quantize (``quant.quantize_qkv``), then run the Gluon
    kernel. Raises ValueError (with the reason) for inputs it cannot run."""
    reason = fp8_gluon_supported(q, k, v, is_causal, scale)
    if reason is not None:
        raise ValueError(f"fp8_gluon_attention: {reason}")
    check_attn_inputs(q, k, v, scale)
    B, Hq, Sq, D = q.shape
    qq, qs, kq, ks, vt, vs = quantize_qkv(q, k, v, hadamard=hadamard, seed=seed)
    return fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(B, Hq, Sq, D), seq_k=k.shape[2],
                                         n_kv_heads=k.shape[1], out_dtype=q.dtype, is_causal=is_causal,
                                         scale=scale, out=out)
