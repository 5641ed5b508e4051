"""FA3-style FlashAttention backward for Hopper (sm_90), written in Gluon (``triton.experimental.gluon``).

Why: the Triton backward runs two kernels that each recompute S and P (7 GEMMs per block pair instead of 5) and waits
for every wgmma before the next. Here one CTA owns a 128-key block of one (batch, kv head): a TMA producer warp
streams Q, dO, lse and delta of every query block of the GQA group through a shared-memory ring, two consumer
warpgroups (64 keys each) compute S^T, dP^T, dV, dK in registers and dS^T into shared memory, and dQ is reduced into
an fp32 buffer that a last launch converts. Three launches: ``_bwd_preprocess`` (delta = rowsum(dO * O)), the main
kernel, ``_bwd_dq_convert``.

Builds the op routes to (``attention._gluon_bwd_build``): "variant 6" at d = 64 / 128 (dK early, dQ through shared
memory and a reducer warp whose global reductions are TMA ``cp.reduce.async.bulk.tensor``; the kernel of
``attention_gluon_bwd_dqw``) and the d = 256 kernel ``_fa3_bwd_kernel_d256`` with the same TMA dQ reductions, from
S = 512 (d = 128 / 256) and 1024 (d = 64). Variants 0-5 and the timing-only ``ABLATE`` masks are kept as opt-in builds
for comparison; ``docs/kernels.md`` has their design, the barrier protocol, resource tables, the issue-slot model and
the measurements. ``python -m fxopt.kernels.attention_gluon_bwd`` prints resource usage offline.

Semantics: lse is fp32 natural log (+inf on rows with no visible key: exact zero gradients), causal bottom-right
aligned, GQA; ``gluon_bwd_supported`` names what it refuses.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

try:  # keep the module importable without Gluon (CPU-only installs, old Triton)
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language._core import builtin as gluon_builtin
    from triton._C.libtriton import ir as _ir

    _GLUON_IMPORT_ERROR: Optional[str] = None
except Exception as _e:  # pragma: no cover - depends on the installed Triton
    _GLUON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

    class _Stub:  # lets the decorated definitions below evaluate; the kernels are never launched
        @staticmethod
        def jit(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def constexpr_function(fn):
            return fn

    gluon = _Stub()
    triton = _Stub()
    gl = None
    tl = None

from .attention_gluon import (  # noqa: E402
    _as_tma_box, _fa_pp_pass, _fa_pp_wait, _gl_dtype, _tma_stride_reason, device_capability, host_layout)

LOG2E = 1.4426950408889634

BLOCK_M = 64          # query rows per step (ring slot)
WG_KEYS = 64          # keys per consumer warpgroup
NUM_CONSUMERS = 2
BLOCK_N = WG_KEYS * NUM_CONSUMERS  # keys per CTA
_STAGES = {64: 3, 128: 2, 256: 2}  # d = 256: its own kernel, _fa3_bwd_kernel_d256
_MAXNREG = 168        # 12 warps x 32 threads x 168 = 64512 <= 65536 registers
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24
_PRE_BLOCK = 64       # rows per preprocess / convert program (== BLOCK_M: the padding unit)
VARIANTS = (0, 1, 2, 3, 4, 5, 6)  # gluon_attention_bwd(variant=...): 0 default, 1 split-dQ, 2 split-dQ + dK in
    # flight, 3 split-dQ + dK issued before the dS^T publication, 4 = 3 + named-barrier turns between the consumer
    # warpgroups (opt-in; measured 1-2% slower), 5 = 3 + dQ through shared memory and a reducer warp (``DQW``;
    # d = 64 / 128; the op's route at d = 128, through attention_gluon_bwd_dqw), 6 = 5 with the reducer's global
    # reductions done by TMA (``DQ_TMA``: one cp.reduce.async.bulk.tensor per dQ half-tile, FA3's dQ path)
DQW_VARIANT = 5
DQ_TMA_VARIANT = 6
DQW_VARIANTS = (DQW_VARIANT, DQ_TMA_VARIANT)  # the variants with dQ tiles in shared memory and a reducer partition
DQW_HEAD_DIM = 128      # the routed head dim: the dQ tile is [64, 64] fp32 per warpgroup (HEAD_DIM // 2 columns)
DQW_HEAD_DIMS = (64, 128)  # head dims of variant 5 (d = 64: [64, 32] fp32 tiles; GPU-checked)
DQ_BUFFERS = 2          # NB: dQ tiles in shared memory per warpgroup (double buffer)
REDUCER_WARPS = 1
_VARIANT_DIMS = (64, 128)  # head dims with a split-dQ kernel (variants 1-4); d = 64 (GPU-checked, not routed)
_SPLIT_STAGES = {64: 4, 128: 2}  # ring stages of the split-dQ kernel (d = 64: 4 x 64 query rows, FA3's 2 x 128)
# Timing-only ablations of the split-dQ kernel (``ABLATE`` constexpr of ``_fa3_bwd_kernel_v1``). Every
# bit leaves the results WRONG: ``gluon_attention_bwd(..., ablate=mask)`` needs the env var below and the op never
# passes it. bit -> what the build leaves out (per step and consumer warpgroup).
ABLATE_BITS = {
    1: "dQ global reductions (16 REDG.F32x2; the dQ wgmma and its wait stay)",
    2: "proxy fence after the dS^T store (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)",
    4: "dQ wgmma, its wait and its reductions",
    8: "exp2 (32 MUFU.EX2; P^T = the exponent, same FFMA)",
    16: "wait on ds_bar (the other warpgroup's dS^T publication; the arrives stay)",
}
# The same bits at d = 256 (``ABLATE`` constexpr of ``_fa3_bwd_kernel_d256``), per step and warpgroup:
ABLATE_BITS_D256 = {
    1: "dQ global reductions (32 REDG.F32x2; the dQ wgmma and its wait stay)",
    2: "proxy fence after the P^T / dS^T stores (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)",
    4: "dQ wgmma, its wait and its reductions",
    8: "exp2 (16 MUFU.EX2; P^T = the exponent, same FFMA)",
    16: "wait on x_bar (the other warpgroup's P^T / dS^T publication; the arrives stay)",
}
ABLATE_ENV = "FXOPT_ATTN_GLUON_BWD_ABLATE_OK"



# ----------------------------------------------------------------------------------------------------------------
# Triton-language helpers: preprocess (delta, lse2, zero dQ workspace) and dQ convert
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2, DQ_ACC,
                    stride_oz, stride_oh, stride_om, stride_doz, stride_doh, stride_dom,
                    stride_lz, stride_lh, H, SEQ_Q, SQ_PAD,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < SEQ_Q
    o = tl.load(O + b.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh + rows[:, None] * stride_om
                + cols[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_doz + h.to(tl.int64) * stride_doh + rows[:, None] * stride_dom
                 + cols[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + b.to(tl.int64) * stride_lz + h.to(tl.int64) * stride_lh + rows, mask=ok,
                  other=float("inf"))
    # +inf (row with no visible key, or padding) stays +inf: exp2(s - inf) = 0 -> zero gradient
    lse2 = tl.where(ok, lse * 1.4426950408889634, float("inf"))
    delta = tl.where(ok, delta, 0.0)
    base = bh.to(tl.int64) * SQ_PAD
    tl.store(DELTA + base + rows, delta)
    tl.store(LSE2 + base + rows, lse2)
    # zero this tile of the fp32 dQ workspace (rows < SQ_PAD always: SQ_PAD is a multiple of BLOCK)
    tl.store(DQ_ACC + (base + rows[:, None]) * HEAD_DIM + cols[None, :],
             tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32))


@triton.jit
def _bwd_dq_convert(DQ_ACC, DQ, stride_dqz, stride_dqh, stride_dqm, H, SEQ_Q, SQ_PAD, scale,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < SEQ_Q
    acc = tl.load(DQ_ACC + (bh.to(tl.int64) * SQ_PAD + rows[:, None]) * HEAD_DIM + cols[None, :], mask=ok,
                  other=0.0)
    tl.store(DQ + b.to(tl.int64) * stride_dqz + h.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqm
             + cols[None, :], (acc * scale).to(DQ.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------------------
# Gluon main kernel
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty,
                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                  dk_desc, dv_desc,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    # K and V of this CTA, once: two 64-row boxes each (one per consumer warpgroup), one barrier.
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + w * 64, 0], kv_bar, _as_tma_box(k_smem.index(w), k_desc))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + w * 64, 0], kv_bar, _as_tma_box(v_smem.index(w), v_desc))
    # Query blocks m_lo .. n_m - 1 of every query head of the group, in the consumers' order.
    it = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        row_base = (b * H + h) * SQ_PAD
        for mb in range(m_lo, n_m):
            s = it % STAGES
            empty_phase = ((it // STAGES) & 1) ^ 1  # fill u of slot s waits for release of use u - 1
            m0 = mb * 64
            mbarrier.wait(q_empty.index(s), empty_phase)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(s),
                                            _as_tma_box(q_smem.index(s), q_desc))
            tma.async_copy_global_to_shared(lse_desc, [row_base + m0], q_ready.index(s), lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), empty_phase)
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_ready.index(s),
                                            _as_tma_box(do_smem.index(s), do_desc))
            tma.async_copy_global_to_shared(delta_desc, [row_base + m0], do_ready.index(s), delta_smem.index(s))
            it += 1


@gluon.jit
def _bwd_step(it, mb, k_buf, v_buf, ds_buf, q_smem, do_smem, lse_smem, delta_smem,
              q_ready, q_empty, do_ready, do_empty, dk, dv, keys, dq_row_ptr, qk_scale, diag_off,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
              s_layout: gl.constexpr, acc_layout: gl.constexpr, op_layout: gl.constexpr):
    """One query block (64 rows) against this warpgroup's 64 keys. See the design notes in docs/kernels.md for the sequence."""
    dtype: gl.constexpr = q_smem.dtype
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    s = it % STAGES
    ready_phase = (it // STAGES) & 1
    m0 = mb * 64
    q_buf = q_smem.index(s)
    do_buf = do_smem.index(s)

    # ---- S^T = K_w Q^T and dP^T = V_w dO^T, two async groups
    mbarrier.wait(q_ready.index(s), ready_phase)
    st = warpgroup_mma(k_buf, q_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ready_phase)
    dpt = warpgroup_mma(v_buf, do_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    # ---- P^T as soon as S^T is back (dP^T may still run); lse2 read from smem only now (16 registers per
    # thread in the column layout: short live ranges matter at 240 registers)
    st = warpgroup_mma_wait(num_outstanding=1, deps=[st])
    if MASKED:  # causal diagonal: key j visible to query i iff j <= i + (Sk - Sq)
        qpos = m0 + gl.arange(0, 64, layout=col_layout)
        keep = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos + diag_off, 0)
        st = gl.where(keep, st, float("-inf"))
    lse2 = lse_smem.index(s).load(col_layout)      # lse * log2(e); +inf on empty / padded rows
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    # ---- dV += P^T dO right away (register A operand), in flight together with dP^T
    p16 = gl.convert_layout(pt.to(dtype), op_layout)
    dv = warpgroup_mma(p16, do_buf, dv, is_async=True)
    # groups in flight: dP^T, dV; <= 1 outstanding -> dP^T is done
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
    delta = delta_smem.index(s).load(col_layout)   # rowsum(dO * O); 0 on padded rows
    dst = pt * (dpt - gl.expand_dims(delta, 0))

    # ---- dK += dS^T Q (register A operand); dS^T also to smem for dQ
    ds16 = dst.to(dtype)
    ds_buf.store(ds16)  # the previous step's dQ wgmma was waited for: the buffer is free
    d16 = gl.convert_layout(ds16, op_layout)
    dk = warpgroup_mma(d16, q_buf, dk, is_async=True)
    # Retire dV / dK before dQ_part is allocated: dK + dV + dQ_part (192 fp32) plus the two 16-bit register
    # operands do not fit the 240 registers (with all three in flight ptxas spilled and serialised every wgmma).
    dv, dk, p16, d16 = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p16, d16])
    # Q (read by S^T and dK) and dO (read by dP^T and dV) are no longer needed by this warpgroup.
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)
    # ---- dQ_part = dS K_w: A = (dS^T)^T, the transposed smem view (wgmma reads MN-major 16-bit A natively)
    fence_async_shared()  # generic-proxy stores of dS^T -> visible to the wgmma (async proxy)
    dq = warpgroup_mma(ds_buf.permute((1, 0)), k_buf, gl.zeros([64, HEAD_DIM], gl.float32, acc_layout),
                       use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])

    # ---- dQ_part -> fp32 workspace (padded rows: no mask). Relaxed: no fences around the reductions.
    rows = m0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    ptrs = dq_row_ptr + gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    gl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@gluon.jit
def _bwd_consumer(WG: gl.constexpr, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty,
                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                  dk_desc, dv_desc,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    # wgmma accumulator layouts of one warpgroup (4 warps along M = keys)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    k_buf = k_smem.index(WG)
    v_buf = v_smem.index(WG)
    ds_buf = ds_smem.index(WG)
    keys = n0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    diag_off = SEQ_K - SEQ_Q
    dk = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)

    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        dq_row_ptr = dq_ptr + (b * H + h).to(gl.int64) * SQ_PAD * HEAD_DIM
        # diagonal (masked) query blocks first, then the fully visible ones: the producer's order m_lo .. n_m-1
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step(it, mb, k_buf, v_buf, ds_buf, q_smem, do_smem, lse_smem, delta_smem,
                               q_ready, q_empty, do_ready, do_empty, dk, dv, keys, dq_row_ptr, qk_scale,
                               diag_off, HEAD_DIM, STAGES, True, s_layout, acc_layout, op_layout)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step(it, mb, k_buf, v_buf, ds_buf, q_smem, do_smem, lse_smem, delta_smem,
                               q_ready, q_empty, do_ready, do_empty, dk, dv, keys, dq_row_ptr, qk_scale,
                               diag_off, HEAD_DIM, STAGES, False, s_layout, acc_layout, op_layout)
            it += 1

    # ---- epilogue: dK * scale, dV; K_w / V_w are dead (every wgmma waited for): stage through them, TMA store
    # (rows >= Sk clipped by the descriptor). qk_scale = scale * log2(e).
    dk = dk * (qk_scale * 0.6931471805599453)
    k_buf.store(dk.to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + WG * 64, 0], _as_tma_box(k_buf, dk_desc))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + WG * 64, 0], _as_tma_box(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _bwd_consumer_wg0(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                      q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                      kv_bar, q_ready, q_empty, do_ready, do_empty,
                      b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                      dk_desc, dv_desc,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    _bwd_consumer(0, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty,
                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                  dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)


@gluon.jit
def _bwd_consumer_wg1(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                      q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                      kv_bar, q_ready, q_empty, do_ready, do_empty,
                      b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                      dk_desc, dv_desc,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    _bwd_consumer(1, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty,
                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                  dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)


@gluon.jit
def _fa3_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_ptr,
                    qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0)  # causal: low key blocks see the most query blocks and run first
    bhk = gl.program_id(1)
    HKV = H // GROUP
    b = bhk // HKV
    hk = bhk % HKV
    n0 = pid_n * 128

    # Query blocks this key block needs (the same for every head of the group and both warpgroups):
    #   m_lo:   first block with a query that sees key n0 (causal: i >= n0 - (Sk - Sq))
    #   m_full: first block whose first query sees key n0 + 127 (no mask needed from there on)
    n_m = gl.cdiv(SEQ_Q, 64)
    m_lo = 0
    m_full = 0
    if CAUSAL:
        diag_off = SEQ_K - SEQ_Q
        m_lo = gl.minimum(gl.maximum(n0 - diag_off, 0) // 64, n_m)
        m_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + 127 - diag_off, 0), 64), m_lo), n_m)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], tile_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)
    fence_async_shared()  # initialised barriers visible to the async proxy (TMA) before first use

    # Argument tuples inline (a variable would turn the constexprs into tensors, see attention_gluon.py).
    gl.warp_specialize([
        (_bwd_consumer_wg0, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                             q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                             kv_bar, q_ready, q_empty, do_ready, do_empty,
                             b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                             dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)),
        (_bwd_consumer_wg1, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                             q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                             kv_bar, q_ready, q_empty, do_ready, do_empty,
                             b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                             dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                         q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         kv_bar, q_ready, q_empty, do_ready, do_empty,
                         b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                         dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Variant 1 ("splitdq", opt-in: gluon_attention_bwd(..., variant=1)), d = 128 only. See the design notes in docs/kernels.md.
# The default kernel above is untouched; this one reuses the producer and changes only the consumers' dQ part.
# ----------------------------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _split_k_layout(head_dim, dtype, rank):
    """Shared layout of K (and of the dK TMA store staged in it) in the split-dQ kernel, rank 2 (the tile) or 4 (the
    [1, 1, 64, d] TMA box). d = 128: the default [64, 128] layout (128-byte swizzle = two [64, 64] blocks, so warpgroup
    w's dQ column half K[:, 64 w..] is a whole block). d = 64: a 64-byte swizzle, i.e. two [64, 32] column blocks, so
    the dQ column half K[:, 32 w..] is again a whole block (with the default 128-byte swizzle it would start 64 bytes
    into each swizzled row); TMA moves the [64, 64] box as two [64, 32] messages (Triton splits boxes wider than the
    swizzle, as for the d = 256 kernel's [rows, 128] boxes). S^T reads K as a K-major A operand either way."""
    if head_dim == 64:
        return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=dtype.primitive_bitwidth, rank=rank)
    return gl.NVMMASharedLayout.get_default_for([1] * (rank - 2) + [64, head_dim], dtype)


@gluon.jit
def _red_add_v2(ptrs, vals):
    # Vectorised fp32 reduction: one ``red.global.add.v2.f32`` (sm_90, PTX >= 8.1; SASS REDG.E.ADD.F32x2) per
    # pair of adjacent elements of this thread. pack=2 hands the asm two consecutive register elements of ``vals``
    # (and of ``ptrs``); in the wgmma accumulator layout those are the columns (c, c + 1) of one row (register
    # base 0 of the layout is [0, 1]; SASS: REDG.E.ADD.F32x2 [R.64 + 32 j], R(4 j)), so ``ptrs[0] + 4 == ptrs[1]`` and
    # only the first address is used ($2). 8-byte alignment: the workspace is 256-byte aligned and c is even.
    # The two int32 outputs are dummies (inline_asm_elementwise must return something); is_pure=False keeps it.
    gl.inline_asm_elementwise(
        "red.global.add.v2.f32 [$2], {$4, $5};\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;",
        "=r,=r,l,l,f,f", [ptrs.to(gl.int64), vals], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _red_add_v2_off(ptrs, vals, off):
    # ABLATE bit 1 (timing only): ``_red_add_v2`` predicated on ``off != 0``, with ``off`` = 0 at run time but opaque
    # to the compiler (``it >> 30``): the dQ wgmma, its wait and the issue slots of the 16 reductions stay, no
    # reduction reaches memory. (A sink that ignores the values lets ptxas delete the dQ wgmma: tried.)
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred %pabl;\n\tsetp.ne.s32 %pabl, $6, 0;\n\t@%pabl red.global.add.v2.f32 [$2], {$4, $5};\n\t}"
        "\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;",
        "=r,=r,l,l,f,f,r,r", [ptrs.to(gl.int64), vals, off], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _bwd_step_v1(WG: gl.constexpr, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                 q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, dq_row_ptr, qk_scale, diag_off,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                 s_layout: gl.constexpr, acc_layout: gl.constexpr, op_layout: gl.constexpr,
                 dq_layout: gl.constexpr, DK_IN_FLIGHT: gl.constexpr, EARLY_DK: gl.constexpr = False,
                 TURNS: gl.constexpr = False, ABLATE: gl.constexpr = 0, DQW: gl.constexpr = False,
                 dq_smem=None, dq_full=None, dq_empty=None, NB: gl.constexpr = 2, DQ_TMA: gl.constexpr = False):
    """One query block against this warpgroup's 64 keys; dQ columns WG * d/2 .. over all 128 keys of the CTA.
    ``EARLY_DK`` (variant 3): dK is issued before dS^T is published, so the publication runs under dV and dK.
    ``TURNS`` (variant 4, with EARLY_DK): the two issue points of the step (S^T + dP^T, dQ) are turns of the
    named-barrier protocol of the design notes in docs/kernels.md: wait for the own turn after the data waits, issue, pass.
    ``DQW`` (variant 5, with EARLY_DK, d = 64 / 128): the step ends with dQ_w into ``dq_smem`` (guarded by
    ``dq_empty`` / ``dq_full``, NB buffers) instead of the REDG.F32x2 (16 at d = 128, 8 at d = 64); ``dq_row_ptr`` is
    unused (None). See
    ``attention_gluon_bwd_dqw``.
    ``ABLATE`` (timing only, results WRONG; 0 = the real kernel): a bit mask of stages to leave out, see
    ``ABLATE_BITS`` and "Timing ablations" in the design notes in docs/kernels.md."""
    dtype: gl.constexpr = q_smem.dtype
    HALF: gl.constexpr = HEAD_DIM // 2
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s = it % STAGES
    ready_phase = (it // STAGES) & 1
    p = it % 2                  # dS double buffer of this step
    ds_phase = (it // 2) & 1    # use number of ds_bar[p] = it // 2
    q_buf = q_smem.index(s)
    do_buf = do_smem.index(s)
    # ``zero`` is 0 (it < 2^30) but opaque to the compiler: the K / V buffer views below depend on it, so their
    # per-k-step wgmma descriptors (eight 64-bit values per operand) are recomputed each step instead of being
    # hoisted out of the loop and kept live across it (they were the d = 128 spills: LDL.64 before every HGMMA
    # group in the causal build).
    zero = it >> 30
    k_mine = k_smem.index(WG + zero)
    v_mine = v_smem.index(WG + zero)

    # ---- S^T, dP^T, P^T, dV, dS^T: as the default step
    if TURNS:  # issue point 1 of the step: both operands landed, then the turn, then S^T and dP^T back to back
        mbarrier.wait(q_ready.index(s), ready_phase)
        mbarrier.wait(do_ready.index(s), ready_phase)
        _fa_pp_wait(WG)
        st = warpgroup_mma(k_mine, q_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_mine, do_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        _fa_pp_pass(WG)
    else:
        mbarrier.wait(q_ready.index(s), ready_phase)
        st = warpgroup_mma(k_mine, q_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(s), ready_phase)
        dpt = warpgroup_mma(v_mine, do_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                            use_acc=False, is_async=True)
    st = warpgroup_mma_wait(num_outstanding=1, deps=[st])
    if MASKED:
        qpos = mb * 64 + gl.arange(0, 64, layout=col_layout)
        keep = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos + diag_off, 0)
        st = gl.where(keep, st, float("-inf"))
    lse2 = lse_smem.index(s).load(col_layout)
    if (ABLATE & 8) != 0:  # timing only: no exp2 (no MUFU), P^T = the exponent (same FFMA, same data flow)
        pt = st * qk_scale - gl.expand_dims(lse2, 0)
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    p16 = gl.convert_layout(pt.to(dtype), op_layout)
    dv = warpgroup_mma(p16, do_buf, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
    delta = delta_smem.index(s).load(col_layout)
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    ds16 = dst.to(dtype)
    if EARLY_DK:
        d16 = gl.convert_layout(ds16, op_layout)
        dk = warpgroup_mma(d16, q_buf, dk, is_async=True)

    # ---- publish dS^T_w to the other warpgroup: ds_smem[2 p + WG] is free (see the docstring: the ds_bar wait
    # of the previous step implies the other warpgroup finished reading it two steps ago, and this warpgroup
    # waited for its own dQ wgmma). store -> proxy fence (each thread) -> barrier of this warpgroup's 128 threads
    # (all stores done) -> one arrive (release) on ds_bar[p] (count 2: one per warpgroup).
    ds_smem.index(2 * p + WG).store(ds16)
    if (ABLATE & 2) == 0:  # bit 2 (timing only): no proxy fence (SASS MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_bar.index(p), count=1)

    if not EARLY_DK:
        d16 = gl.convert_layout(ds16, op_layout)
        dk = warpgroup_mma(d16, q_buf, dk, is_async=True)
    if DK_IN_FLIGHT:
        # groups in flight: dV, dK; <= 1 outstanding -> dV done (dO free). dK (64 fp32 + its 16-bit A operand)
        # keeps running through the ds_bar wait and the dQ wgmma: dK 64 + dV 64 + dQ 32 + d16 16 registers.
        dv, p16 = warpgroup_mma_wait(num_outstanding=1, deps=[dv, p16])
        mbarrier.arrive(do_empty.index(s), count=1)
    else:
        # Retire dV / dK before dQ (as the default step).
        dv, dk, p16, d16 = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p16, d16])
        mbarrier.arrive(q_empty.index(s), count=1)
        mbarrier.arrive(do_empty.index(s), count=1)

    # ---- dQ[:, WG half] = dS (all 128 keys) K[:, WG half]: both warpgroups' dS^T tiles must be in smem
    if (ABLATE & 16) == 0:  # bit 16 (timing only): no wait for the other warpgroup's dS^T (arrives stay)
        mbarrier.wait(ds_bar.index(p), ds_phase)
    if TURNS:  # issue point 2 of the step (after the ds_bar wait: both dS^T halves are in smem)
        _fa_pp_wait(WG)
    if (ABLATE & 4) == 0:  # bit 4 (timing only): no dQ wgmma and no reductions
        dq = warpgroup_mma(ds_smem.index(2 * p).permute((1, 0)), k_smem.index(zero).slice(WG * HALF, HALF, dim=1),
                           gl.zeros([64, HALF], gl.float32, dq_layout), use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(2 * p + 1).permute((1, 0)),
                           k_smem.index(1 + zero).slice(WG * HALF, HALF, dim=1), dq, is_async=True)
    if TURNS:
        _fa_pp_pass(WG)
    if DK_IN_FLIGHT:
        if (ABLATE & 4) == 0:
            dk, d16, dq = warpgroup_mma_wait(num_outstanding=0, deps=[dk, d16, dq])
        else:
            dk, d16 = warpgroup_mma_wait(num_outstanding=0, deps=[dk, d16])
        mbarrier.arrive(q_empty.index(s), count=1)  # dK (last reader of Q) is done
    elif (ABLATE & 4) == 0:
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])

    if DQW:  # ---- dQ_w -> dq_smem tile 2 b + WG (the reducer partition issues the global reductions)
        b = it % NB
        mbarrier.wait(dq_empty.index(b), ((it // NB) & 1) ^ 1)  # the first use of a buffer passes (parity 1)
        # [64 rows, HALF cols] -> (row // 8, col // 8, row % 8, col % 8): "Bank conflicts" in attention_gluon_bwd_dqw
        dq4 = gl.permute(gl.reshape(dq, [8, 8, HALF // 8, 8]), (0, 2, 1, 3))
        dq_smem.index(2 * b + WG).store(dq4)
        if DQ_TMA:  # variant 6: the TMA unit (async proxy) reads the tile
            fence_async_shared()
        gl.thread_barrier()   # the warpgroup's 128 threads' stores are done
        mbarrier.arrive(dq_full.index(b), count=1)
    # ---- 64 x d/2 fp32 -> workspace, 2 floats per red (16 REDG.F32x2 per thread at d = 128)
    elif (ABLATE & 4) == 0:
        rows = mb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, dq_layout))
        cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, dq_layout))
        if (ABLATE & 1) == 0:
            _red_add_v2(dq_row_ptr + gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0), dq)
        else:  # bit 1 (timing only): the dQ wgmma and its wait stay, the reductions are predicated off
            _red_add_v2_off(dq_row_ptr + gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0), dq,
                            gl.zeros([64, HALF], gl.int32, dq_layout) + zero)
    return dk, dv


@gluon.jit
def _bwd_consumer_v1(WG: gl.constexpr, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                     ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                     dq_empty, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                     dk_desc, dv_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     DK_IN_FLIGHT: gl.constexpr, EARLY_DK: gl.constexpr, TURNS: gl.constexpr = False,
                     ABLATE: gl.constexpr = 0, DQW: gl.constexpr = False, NB: gl.constexpr = 2,
                     DQ_TMA: gl.constexpr = False):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    v_buf = v_smem.index(WG)
    keys = n0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    diag_off = SEQ_K - SEQ_Q
    dk = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)

    mbarrier.wait(kv_bar, 0)
    if TURNS:  # variant 4: warpgroup 1 hands warpgroup 0 the first turn (so every turn point of both syncs)
        if WG == 1:
            _fa_pp_pass(WG)
    it = 0
    for g in range(GROUP):
        if DQW:  # SQ_PAD and dq_ptr are None (not even captured): the reducer owns the workspace
            dq_row_ptr = dq_ptr
        else:
            dq_row_ptr = dq_ptr + (b * H + hk * GROUP + g).to(gl.int64) * SQ_PAD * HEAD_DIM
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step_v1(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                                  q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, dq_row_ptr,
                                  qk_scale, diag_off, HEAD_DIM, STAGES, True, s_layout, acc_layout, op_layout,
                                  dq_layout, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE, DQW, dq_smem, dq_full,
                                  dq_empty, NB, DQ_TMA)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step_v1(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                                  q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, dq_row_ptr,
                                  qk_scale, diag_off, HEAD_DIM, STAGES, False, s_layout, acc_layout, op_layout,
                                  dq_layout, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE, DQW, dq_smem, dq_full,
                                  dq_empty, NB, DQ_TMA)
            it += 1

    if TURNS:  # variant 4: warpgroup 0 takes back the turn warpgroup 1 passed after its last issue point (or,
        # with no query block, the first turn): both named barriers end with no pending arrival
        if WG == 0:
            _fa_pp_wait(WG)
    # ---- epilogue. The OTHER warpgroup's dQ wgmma reads this warpgroup's K_w until its last step: before K_w is
    # overwritten with dK, both warpgroups meet on end_bar (count 2, used once: parity 0). Every wgmma of this
    # warpgroup was waited for, so one arrive after the loop says "done reading K_0 and K_1".
    mbarrier.arrive(end_bar, count=1)
    mbarrier.wait(end_bar, 0)
    k_buf = k_smem.index(WG)
    dk = dk * (qk_scale * 0.6931471805599453)
    k_buf.store(dk.to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + WG * 64, 0], _as_tma_box(k_buf, dk_desc))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + WG * 64, 0], _as_tma_box(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _bwd_consumer_v1_wg0(k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                         ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                         dq_empty, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                         dk_desc, dv_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                         DK_IN_FLIGHT: gl.constexpr, EARLY_DK: gl.constexpr, TURNS: gl.constexpr = False,
                         ABLATE: gl.constexpr = 0, DQW: gl.constexpr = False, NB: gl.constexpr = 2,
                         DQ_TMA: gl.constexpr = False):
    _bwd_consumer_v1(0, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                     ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                     dq_empty, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                     dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE, DQW, NB, DQ_TMA)


@gluon.jit
def _bwd_consumer_v1_wg1(k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                         ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                         dq_empty, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                         dk_desc, dv_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                         DK_IN_FLIGHT: gl.constexpr, EARLY_DK: gl.constexpr, TURNS: gl.constexpr = False,
                         ABLATE: gl.constexpr = 0, DQW: gl.constexpr = False, NB: gl.constexpr = 2,
                         DQ_TMA: gl.constexpr = False):
    _bwd_consumer_v1(1, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                     ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                     dq_empty, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                     dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE, DQW, NB, DQ_TMA)


@gluon.jit
def _red_add_v4(ptrs, vals):
    # ``red.global.add.v4.f32`` (sm_90, PTX >= 8.1; SASS REDG.E.ADD.F32x4): one per 4 consecutive register elements
    # of this thread; in the reducer's BlockedLayout (size_per_thread [1, 4]) those are 4 consecutive columns of one
    # row, so only the first address ($4) is used. 16-byte alignment: the workspace is 256-byte aligned, rows are
    # 512 B (d = 128) / 256 B (d = 64), columns 4-aligned.
    gl.inline_asm_elementwise(
        "red.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;"
        "\n\tmov.u32 $2, 0;\n\tmov.u32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,f,f,f,f", [ptrs.to(gl.int64), vals], dtype=gl.int32, is_pure=False, pack=4)


if _GLUON_IMPORT_ERROR is None:
    @gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """``cp.reduce.async.bulk.tensor.<rank>d.global.shared::cta.add.bulk_group``: add the shared tile ``src``
        into the global box of ``tensor_desc`` at ``coord`` (element-wise atomic adds done by the TMA unit in L2),
        then commit a bulk group; ``tma.store_wait(n)`` waits for its reads of ``src``. Gluon 3.6 has TMA loads and
        stores for Hopper but exposes no reduce; its builder does (``create_async_tma_reduce``: the op Triton's
        ``desc.atomic_add`` lowers to)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.jit
def _bwd_dq_reducer(dq_smem, dq_full, dq_empty, dq_ptr, dq_desc, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                    DQ_TMA: gl.constexpr = False):
    """Variants 5 / 6 (DQW), d = 64 / 128. Per step: wait dq_full[b]; [64, d] fp32 (two [64, d / 2] column halves)
    from dq_smem -> red.global.add.v4.f32 into the workspace rows of the step's query block; thread_barrier; release
    dq_empty[b]. One flat loop over the (g, m) steps (few loop-carried registers: the partition runs with 24).
    NB, the head dim and the warp count come from ``dq_smem`` ([2 NB, 8, d / 16, 8, 8]) and the partition.
    ``DQ_TMA`` (variant 6): two TMA reduce-adds per step instead (one per column half, each a [64, d / 2] tile = one
    [8, d / 16, 8, 8] box of ``dq_desc``, the workspace viewed as [rows / 8, d / 8, 8, 8] with strides [8 d, 8, d, 1]:
    the box order IS the tile's chunk-transposed smem order, so the TMA unit reads the tile as it lies), then a wait
    for the TMA unit's reads of both tiles (``store_wait(0)``) before the release. The consumers' proxy fence
    (generic stores -> async-proxy reads) precedes their dq_full arrive."""
    NB: gl.constexpr = dq_smem.shape[0] // 2
    CHUNKS: gl.constexpr = dq_smem.shape[2]      # 8-column chunks per column half: 8 at d = 128, 4 at d = 64
    HALF: gl.constexpr = 8 * CHUNKS
    HEAD_DIM: gl.constexpr = 2 * HALF
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # a slice [1, CHUNKS (col // 8), 8 (row % 8), 8 (col % 8)] of one 8-row group: lanes 0-7 read 4 rows x 32 B =
    # 128 B contiguous (conflict-free LDS.128); one warp covers 4 chunks x 4 rows, so CHUNKS / 2 LDS.128 per thread
    # and slice (4 at d = 128, 2 at d = 64)
    red_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 4, 4, 2],
                                                warps_per_cta=[1, NUM_WARPS, 1, 1], order=[3, 2, 1, 0])
    l3: gl.constexpr = gl.SliceLayout(0, red_layout)
    j = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    rl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    offs = gl.expand_dims(gl.expand_dims(gl.expand_dims(j * 8, 1), 2)
                          + gl.expand_dims(gl.expand_dims(rl * HEAD_DIM, 0), 2)
                          + gl.expand_dims(gl.expand_dims(cl, 0), 1), 0)
    n_steps = n_m - m_lo
    for it in range(GROUP * n_steps):
        g = it // n_steps
        mb = m_lo + (it - g * n_steps)
        buf = it % NB
        mbarrier.wait(dq_full.index(buf), (it // NB) & 1)
        if DQ_TMA:
            row8 = (b * H + hk * GROUP + g) * (SQ_PAD // 8) + mb * 8   # SQ_PAD is a multiple of 64
            _tma_reduce_add(dq_desc, [row8, 0, 0, 0], dq_smem.index(2 * buf))
            _tma_reduce_add(dq_desc, [row8, CHUNKS, 0, 0], dq_smem.index(2 * buf + 1))
            tma.store_wait(0)     # the TMA unit has read both tiles
        else:
            base = dq_ptr + ((b * H + hk * GROUP + g).to(gl.int64) * SQ_PAD + mb * 64) * HEAD_DIM
            for w in gl.static_range(2):
                tile = dq_smem.index(2 * buf + w)
                for rh in gl.static_range(8):
                    vals = tile.slice(rh, 1, dim=0).load(red_layout)
                    _red_add_v4(base + (rh * 8 * HEAD_DIM + HALF * w) + offs, vals)
            gl.thread_barrier()   # its loads have returned (their values fed the reductions)
        mbarrier.arrive(dq_empty.index(buf), count=1)

@gluon.jit
def _fa3_bwd_kernel_v1(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_ptr,
                       qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DK_IN_FLIGHT: gl.constexpr,
                       EARLY_DK: gl.constexpr, TURNS: gl.constexpr = False, ABLATE: gl.constexpr = 0,
                       DQW: gl.constexpr = False, NB: gl.constexpr = 2, REDUCER_WARPS: gl.constexpr = 1,
                       DQ_TMA: gl.constexpr = False, dq_desc=None):
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    HKV = H // GROUP
    b = bhk // HKV
    hk = bhk % HKV
    n0 = pid_n * 128
    n_m = gl.cdiv(SEQ_Q, 64)
    m_lo = 0
    m_full = 0
    if CAUSAL:  # same query-block range as the default kernel
        diag_off = SEQ_K - SEQ_Q
        m_lo = gl.minimum(gl.maximum(n0 - diag_off, 0) // 64, n_m)
        m_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + 127 - diag_off, 0), 64), m_lo), n_m)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    # K: the d = 128 tile family, except at d = 64 (64-byte swizzle: dQ's B operand is a whole [64, 32] block)
    k_layout: gl.constexpr = _split_k_layout(HEAD_DIM, dtype, 2)
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], tile_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, 64, 64], ds_layout)  # [2 p + WG]: 2 buffers x 2 warpgroups
    if DQW:  # fp32 dQ tiles [2 b + WG], unswizzled "chunk-transposed" [row // 8, col // 8, row % 8, col % 8]
        if DQ_TMA:  # the same bytes, typed as a TMA box (no swizzle) of dq_desc
            dq_layout_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
        else:
            dq_layout_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[3, 2, 1, 0])
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * NB, 8, HEAD_DIM // 16, 8, 8], dq_layout_s)
    else:  # None: no partition argument (the capture lists stay variant 1-4's)
        dq_smem: gl.constexpr = None
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if DQW:
        dq_full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    else:
        dq_full: gl.constexpr = None
        dq_empty: gl.constexpr = None
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)  # one arrive per consumer warpgroup and use
    if DQW:
        for i in gl.static_range(NB):
            mbarrier.init(dq_full.index(i), count=2)   # one arrive per consumer warpgroup
            mbarrier.init(dq_empty.index(i), count=1)  # the reducer
    mbarrier.init(end_bar, count=2)
    fence_async_shared()

    # Two literal partition lists, one per build: a list built with "+" unwraps constexprs to Python ints, which
    # warp_specialize cannot capture (at run time GROUP == 1 or H == 1 arrive as constexprs: an earlier H200 run of
    # variant 5 failed to compile there). The argument tuples are literals too: a tuple assigned to a name turns its
    # constexprs into tensors. DQW passes None (no capture) for the consumers' SQ_PAD / dq_ptr and adds the reducer
    # warp(s) to warpgroup 2 at the producer's register budget; variants 1-4 pass None for the dQ tiles and barriers.
    if DQW:
        gl.warp_specialize([
            (_bwd_consumer_v1_wg0, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                                    dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                                    dq_empty, b, hk, n0, H, GROUP, None, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                    None, dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE,
                                    DQW, NB, DQ_TMA)),
            (_bwd_consumer_v1_wg1, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                                    dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                                    dq_empty, b, hk, n0, H, GROUP, None, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                    None, dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE,
                                    DQW, NB, DQ_TMA)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                             q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                             kv_bar, q_ready, q_empty, do_ready, do_empty,
                             b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                             dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)),
            (_bwd_dq_reducer, (dq_smem, dq_full, dq_empty, dq_ptr, dq_desc, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                              DQ_TMA)),
        ], [4, 1, REDUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])  # default partition = consumer 0
    else:
        gl.warp_specialize([
            (_bwd_consumer_v1_wg0, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                                    None, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, None,
                                    None, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                    dq_ptr, dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE,
                                    DQW, NB)),
            (_bwd_consumer_v1_wg1, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                                    None, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, None,
                                    None, b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                    dq_ptr, dk_desc, dv_desc, HEAD_DIM, STAGES, DK_IN_FLIGHT, EARLY_DK, TURNS, ABLATE,
                                    DQW, NB)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                             q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                             kv_bar, q_ready, q_empty, do_ready, do_empty,
                             b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                             dk_desc, dv_desc, HEAD_DIM, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # default partition = consumer 0


# ----------------------------------------------------------------------------------------------------------------
# Head dim 256 (routed): ``_fa3_bwd_kernel_d256``. See "Head dim 256" in the design notes in docs/kernels.md.
# One CTA = 64 keys; the two consumer warpgroups split the QUERIES of S^T / dP^T (32 each) and the HEAD DIM of
# dK / dV / dQ (128 columns each). Every shared tile is [rows, 128] (two 128-byte-swizzle [rows, 64] blocks, the
# d = 128 kernels' tile family); P^T and dS^T are exchanged through [64, 64] tiles with a 64-byte swizzle, i.e.
# two [64, 32] column blocks, one written by each warpgroup.
# ----------------------------------------------------------------------------------------------------------------

D256_BLOCK_N = 64     # keys per CTA at d = 256
D256_HALF = 128       # head-dim columns of dK / dV / dQ per consumer warpgroup
D256_QROWS = 32       # query rows of S^T / dP^T per consumer warpgroup (BLOCK_M / 2)


@gluon.jit
def _d256_reduce_slot(dq_desc, q_smem, do_smem, j, b, hk, H, GROUP, SQ_PAD, m_lo, n_m, STAGES: gl.constexpr):
    """DQ_TMA: TMA reduce-add of step j's two dQ tiles (warpgroup 0's in ring slot j % STAGES's Q bytes,
    warpgroup 1's in its dO bytes) into the workspace; the caller waits for the reads (``tma.store_wait``)."""
    n_steps = n_m - m_lo
    g = j // n_steps
    row8 = (b * H + hk * GROUP + g) * (SQ_PAD // 8) + (m_lo + j - g * n_steps) * 8
    sj = j % STAGES
    _tma_reduce_add(dq_desc, [row8, 0, 0, 0],
                    q_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(sj))
    _tma_reduce_add(dq_desc, [row8, 16, 0, 0],
                    do_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(sj))


@gluon.jit
def _bwd_producer_d256(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                       q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                       kv_bar, q_ready, q_empty, do_ready, do_empty,
                       b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES: gl.constexpr,
                       DQ_TMA: gl.constexpr = False, dq_desc=None):
    # K and V of this CTA, once: two [64, 128] column halves each, one barrier.
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, c * 128], kv_bar, _as_tma_box(k_smem.index(c), k_desc))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, c * 128], kv_bar, _as_tma_box(v_smem.index(c), v_desc))
    # Query block it: Q / dO as four [32, 128] boxes each, tile 4 s + 2 r + c = rows 32 r.., columns 128 c..
    it = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        row_base = (b * H + h) * SQ_PAD
        for mb in range(m_lo, n_m):
            s = it % STAGES
            empty_phase = ((it // STAGES) & 1) ^ 1
            m0 = mb * 64
            mbarrier.wait(q_empty.index(s), empty_phase)
            if DQ_TMA:  # slot s holds step it - STAGES's dQ tiles: reduce them, wait for the reads, refill
                if it >= STAGES:
                    _d256_reduce_slot(dq_desc, q_smem, do_smem, it - STAGES, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                                      STAGES)
                    tma.store_wait(0)
            mbarrier.expect(q_ready.index(s), 4 * q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            for r in gl.static_range(2):
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(q_desc, [b, h, m0 + r * 32, c * 128], q_ready.index(s),
                                                    _as_tma_box(q_smem.index(4 * s + 2 * r + c), q_desc))
            tma.async_copy_global_to_shared(lse_desc, [row_base + m0], q_ready.index(s), lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), empty_phase)
            mbarrier.expect(do_ready.index(s), 4 * do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            for r in gl.static_range(2):
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(do_desc, [b, h, m0 + r * 32, c * 128], do_ready.index(s),
                                                    _as_tma_box(do_smem.index(4 * s + 2 * r + c), do_desc))
            tma.async_copy_global_to_shared(delta_desc, [row_base + m0], do_ready.index(s), delta_smem.index(s))
            it += 1
    if DQ_TMA:  # the last STAGES steps' tiles (no refill follows them)
        for j in range(gl.maximum(it - STAGES, 0), it):
            mbarrier.wait(q_empty.index(j % STAGES), (j // STAGES) & 1)
            _d256_reduce_slot(dq_desc, q_smem, do_smem, j, b, hk, H, GROUP, SQ_PAD, m_lo, n_m, STAGES)
        tma.store_wait(0)


@gluon.jit
def _bwd_step_d256(WG: gl.constexpr, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                   ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, dk, dv, n0, dq_row_ptr, qk_scale,
                   diag_off, STAGES: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr,
                   acc_layout: gl.constexpr, op_layout: gl.constexpr, ABLATE: gl.constexpr = 0,
                   DQ_TMA: gl.constexpr = False, x_free=None, dq_desc=None):
    """One 64-query block at d = 256 for consumer warpgroup WG: S^T / dP^T for queries 32 WG .. 32 WG + 31 (all 64
    keys, full d), dK / dV / dQ for columns 128 WG .. 128 WG + 127. See the design notes in docs/kernels.md for the order.
    ``ABLATE`` (timing only, results WRONG; 0 = the real kernel): a bit mask of stages to leave out, see
    ``ABLATE_BITS_D256`` and "Timing ablations at d = 256" in the design notes in docs/kernels.md."""
    dtype: gl.constexpr = q_smem.dtype
    OTHER: gl.constexpr = 1 - WG
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    # ``zero`` is 0 (it < 2^30) but opaque to the compiler, as in variant 1: K / V views indexed with it are
    # recomputed per step instead of their wgmma descriptors being hoisted and kept live (spills); adding it to the
    # ring slot and the P^T / dS^T buffer index as well took the causal build from 16 / 8 B of stack to 0.
    zero = it >> 30
    s = it % STAGES + zero
    ready_phase = (it // STAGES) & 1
    p = it % 2 + zero           # P^T / dS^T double buffer of this step
    x_phase = (it // 2) & 1     # use number of x_bar[p] = it // 2
    qt = 4 * s                  # Q / dO tile 4 s + 2 r + c: query rows 32 r.., columns 128 c..

    # ---- S^T_w = K Q_w^T and dP^T_w = V dO_w^T: [64 keys, 32 queries], reduction over d = 256 as two column
    # halves (two wgmma groups each)
    mbarrier.wait(q_ready.index(s), ready_phase)
    st = warpgroup_mma(k_smem.index(zero), q_smem.index(qt + 2 * WG).permute((1, 0)),
                       gl.zeros([64, 32], gl.float32, s_layout), use_acc=False, is_async=True)
    st = warpgroup_mma(k_smem.index(1 + zero), q_smem.index(qt + 2 * WG + 1).permute((1, 0)), st, is_async=True)
    mbarrier.wait(do_ready.index(s), ready_phase)
    dpt = warpgroup_mma(v_smem.index(zero), do_smem.index(qt + 2 * WG).permute((1, 0)),
                        gl.zeros([64, 32], gl.float32, s_layout), use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem.index(1 + zero), do_smem.index(qt + 2 * WG + 1).permute((1, 0)), dpt, is_async=True)
    # groups in flight: S^T (2), dP^T (2); <= 2 outstanding -> S^T done
    st = warpgroup_mma_wait(num_outstanding=2, deps=[st])
    if MASKED:  # causal diagonal: key j visible to query i iff j <= i + (Sk - Sq)
        qpos = mb * 64 + WG * 32 + gl.arange(0, 32, layout=col_layout)
        keys = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        keep = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos + diag_off, 0)
        st = gl.where(keep, st, float("-inf"))
    lse2 = lse_smem.index(s).slice(WG * 32, 32).load(col_layout)
    if (ABLATE & 8) != 0:  # bit 8 (timing only): no exp2 (no MUFU), P^T = the exponent (same FFMA, same data flow)
        pt = st * qk_scale - gl.expand_dims(lse2, 0)
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    p16 = pt.to(dtype)
    pt_smem.index(p).slice(WG * 32, 32, dim=1).store(p16)   # publish P^T_w (made visible below)
    # ---- dV_w += P^T_w dO[own queries, own columns]: register A operand, K = 32
    pa = gl.convert_layout(p16, op_layout)
    dv = warpgroup_mma(pa, do_smem.index(qt + 3 * WG), dv, is_async=True)
    # groups in flight: dP^T (2), dV; <= 1 outstanding -> dP^T done
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
    delta = delta_smem.index(s).slice(WG * 32, 32).load(col_layout)
    ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    # ---- dK_w += dS^T_w Q[own queries, own columns] (register A), issued before the dS^T publication
    da = gl.convert_layout(ds16, op_layout)
    dk = warpgroup_mma(da, q_smem.index(qt + 3 * WG), dk, is_async=True)
    # ---- publish dS^T_w: buffers of step it - 2 are free (x_bar argument as variant 1); store -> proxy fence ->
    # barrier of this warpgroup's 128 threads -> one arrive on x_bar[p] (count 2: one per warpgroup)
    ds_smem.index(p).slice(WG * 32, 32, dim=1).store(ds16)
    if (ABLATE & 2) == 0:  # bit 2 (timing only): no proxy fence (SASS MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(x_bar.index(p), count=1)
    # ---- the other warpgroup's P^T / dS^T halves: dV_w, dK_w over the other 32 queries (A from shared memory)
    if (ABLATE & 16) == 0:  # bit 16 (timing only): no wait for the other warpgroup's halves (the arrives stay)
        mbarrier.wait(x_bar.index(p), x_phase)
    dv = warpgroup_mma(pt_smem.index(p).slice(OTHER * 32, 32, dim=1), do_smem.index(qt + 2 * OTHER + WG), dv,
                       is_async=True)
    dk = warpgroup_mma(ds_smem.index(p).slice(OTHER * 32, 32, dim=1), q_smem.index(qt + 2 * OTHER + WG), dk,
                       is_async=True)
    # Retire dV / dK (and their register operands) before the dQ accumulator: dK 64 + dV 64 + dQ 64 fp32 per thread.
    dv, dk, pa, da = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, pa, da])
    if DQ_TMA:  # Q and dO of slot s: last read by this warpgroup; they hold the dQ tiles next (below)
        mbarrier.arrive(x_free.index(s), count=1)
    else:
        mbarrier.arrive(q_empty.index(s), count=1)    # Q and dO of slot s: last read by this warpgroup
        mbarrier.arrive(do_empty.index(s), count=1)
    # ---- dQ[:, own columns] = dS K[:, own columns]: A = (dS^T)^T (transposed view of both halves), K = 64 keys
    if (ABLATE & 4) == 0:  # bit 4 (timing only): no dQ wgmma, no wait, no reductions
        dq = warpgroup_mma(ds_smem.index(p).permute((1, 0)), k_smem.index(WG + zero),
                           gl.zeros([64, 128], gl.float32, acc_layout), use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    if DQ_TMA:  # ---- dQ_w -> the dead Q (w = 0) / dO (w = 1) tiles of slot s -> TMA reduce-add -> release the slot
        mbarrier.wait(x_free.index(s), ready_phase)   # both warpgroups are done reading Q / dO of slot s
        if WG == 0:
            dq_tile = q_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(s)
        else:
            dq_tile = do_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(s)
        # [64 rows, 128 cols] -> (row // 8, col // 8, row % 8, col % 8), as variant 6 at d = 128
        dq_tile.store(gl.permute(gl.reshape(dq, [8, 8, 16, 8]), (0, 2, 1, 3)))
        fence_async_shared()     # generic-proxy stores -> the TMA unit's (async proxy) reads
        gl.thread_barrier()
        # the producer issues both tiles' reduces once q_empty[s] completes, before it refills slot s (
        # each warpgroup issuing its own and waiting for the TMA unit's read gained 2-8% over the REDG build, this
        # 7.5-13%; benchmarks/results/gluon/gluon_attention_bwd_check_d256_s14*.md)
        mbarrier.arrive(q_empty.index(s), count=1)
        mbarrier.arrive(do_empty.index(s), count=1)
    elif (ABLATE & 4) == 0:
        # ---- 64 x 128 fp32 -> workspace [.., SQ_PAD, 256], 2 floats per red (32 REDG.F32x2 per thread)
        rows = mb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols = WG * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, acc_layout))
        if (ABLATE & 1) == 0:
            _red_add_v2(dq_row_ptr + gl.expand_dims(rows * 256, 1) + gl.expand_dims(cols, 0), dq)
        else:  # bit 1 (timing only): the dQ wgmma and its wait stay, the reductions are predicated off (opaque 0)
            _red_add_v2_off(dq_row_ptr + gl.expand_dims(rows * 256, 1) + gl.expand_dims(cols, 0), dq,
                            gl.zeros([64, 128], gl.int32, acc_layout) + zero)
    return dk, dv


@gluon.jit
def _bwd_consumer_d256(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                       kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                       b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                       dk_desc, dv_desc, STAGES: gl.constexpr, ABLATE: gl.constexpr = 0,
                       DQ_TMA: gl.constexpr = False, x_free=None, dq_desc=None):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 32, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    diag_off = SEQ_K - SEQ_Q
    dk = gl.zeros([64, 128], gl.float32, acc_layout)
    dv = gl.zeros([64, 128], gl.float32, acc_layout)

    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(GROUP):
        if DQ_TMA:  # the producer reduces the dQ tiles (through dq_desc)
            dq_row_ptr = dq_ptr
        else:
            dq_row_ptr = dq_ptr + (b * H + hk * GROUP + g).to(gl.int64) * SQ_PAD * 256
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step_d256(WG, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                    ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, dk, dv, n0, dq_row_ptr,
                                    qk_scale, diag_off, STAGES, True, s_layout, acc_layout, op_layout, ABLATE,
                                    DQ_TMA, x_free, dq_desc)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step_d256(WG, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                    ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, dk, dv, n0, dq_row_ptr,
                                    qk_scale, diag_off, STAGES, False, s_layout, acc_layout, op_layout, ABLATE,
                                    DQ_TMA, x_free, dq_desc)
            it += 1

    # ---- epilogue: both warpgroups read all of K / V (S^T, dP^T) until their last step; meet on end_bar (count 2,
    # parity 0) before column half WG of K / V is overwritten with dK_w / dV_w and TMA-stored (rows >= Sk clipped).
    mbarrier.arrive(end_bar, count=1)
    mbarrier.wait(end_bar, 0)
    k_buf = k_smem.index(WG)
    v_buf = v_smem.index(WG)
    dk = dk * (qk_scale * 0.6931471805599453)
    k_buf.store(dk.to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, WG * 128], _as_tma_box(k_buf, dk_desc))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, WG * 128], _as_tma_box(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _bwd_consumer_d256_wg0(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                           kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                           b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                           dk_desc, dv_desc, STAGES: gl.constexpr, ABLATE: gl.constexpr = 0,
                           DQ_TMA: gl.constexpr = False, x_free=None, dq_desc=None):
    _bwd_consumer_d256(0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                       kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                       b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                       dk_desc, dv_desc, STAGES, ABLATE, DQ_TMA, x_free, dq_desc)


@gluon.jit
def _bwd_consumer_d256_wg1(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                           kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                           b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                           dk_desc, dv_desc, STAGES: gl.constexpr, ABLATE: gl.constexpr = 0,
                           DQ_TMA: gl.constexpr = False, x_free=None, dq_desc=None):
    _bwd_consumer_d256(1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                       kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                       b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                       dk_desc, dv_desc, STAGES, ABLATE, DQ_TMA, x_free, dq_desc)


@gluon.jit
def _fa3_bwd_kernel_d256(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_ptr,
                         qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ABLATE: gl.constexpr = 0,
                         DQ_TMA: gl.constexpr = False, dq_desc=None):
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0)  # causal: low key blocks see the most query blocks and run first
    bhk = gl.program_id(1)
    HKV = H // GROUP
    b = bhk // HKV
    hk = bhk % HKV
    n0 = pid_n * 64
    # Query blocks of this key block: m_lo = first with a query that sees key n0, m_full = first whose first query
    # sees key n0 + 63 (no mask from there on); non-causal: all.
    n_m = gl.cdiv(SEQ_Q, 64)
    m_lo = 0
    m_full = 0
    if CAUSAL:
        diag_off = SEQ_K - SEQ_Q
        m_lo = gl.minimum(gl.maximum(n0 - diag_off, 0) // 64, n_m)
        m_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + 63 - diag_off, 0), 64), m_lo), n_m)

    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 128], dtype)
    # [64 keys, 64 queries] with a 64-byte swizzle = two [64, 32] column blocks: block w is warpgroup w's half
    x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, 128], kv_layout)              # 32 KB
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, 128], kv_layout)              # 32 KB
    q_smem = gl.allocate_shared_memory(dtype, [4 * STAGES, 32, 128], q_layout)   # 32 KB / stage
    do_smem = gl.allocate_shared_memory(dtype, [4 * STAGES, 32, 128], q_layout)  # 32 KB / stage
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    pt_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], x_layout)                     # 16 KB
    ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], x_layout)                     # 16 KB
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if DQ_TMA:  # per ring slot: both warpgroups done reading its Q / dO (their bytes then hold the dQ tiles)
        x_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        x_free: gl.constexpr = None
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)
        if DQ_TMA:
            mbarrier.init(x_free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(x_bar.index(i), count=2)    # one arrive per consumer warpgroup and use
    mbarrier.init(end_bar, count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer_d256_wg0, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                                  kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                                  dk_desc, dv_desc, STAGES, ABLATE, DQ_TMA, x_free, dq_desc)),
        (_bwd_consumer_d256_wg1, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                                  kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, end_bar,
                                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                                  dk_desc, dv_desc, STAGES, ABLATE, DQ_TMA, x_free, dq_desc)),
        (_bwd_producer_d256, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                              q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                              kv_bar, q_ready, q_empty, do_ready, do_empty,
                              b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES, DQ_TMA, dq_desc)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # default partition = consumer 0 (num_warps = 4)


# ----------------------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

def config_for(head_dim: int, variant: int = 0) -> dict:
    """Kernel meta-parameters for a head dim and ``gluon_attention_bwd`` variant (also used by the offline compile
    check): the split-dQ kernel (variants 1-4 at a head dim of ``_VARIANT_DIMS``) has its own ring depth."""
    split = variant != 0 and head_dim in _VARIANT_DIMS
    cfg = dict(STAGES=_SPLIT_STAGES[head_dim] if split else _STAGES[head_dim], num_warps=4, maxnreg=_MAXNREG,
               CONSUMER_REGS=_CONSUMER_REGS, PRODUCER_REGS=_PRODUCER_REGS)
    if variant in DQW_VARIANTS and head_dim in DQW_HEAD_DIMS:  # the reducer shares warpgroup 2's budget (24)
        cfg.update(NB=DQ_BUFFERS, REDUCER_WARPS=REDUCER_WARPS)
    return cfg


def _check_variant(variant, head_dim) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"gluon_attention_bwd: variant must be one of {VARIANTS}, got {variant!r}")
    if variant in DQW_VARIANTS and head_dim is not None and head_dim not in DQW_HEAD_DIMS + (256,):
        raise ValueError(f"gluon_attention_bwd: variant {variant} (dQ through shared memory) needs head dim "
                         f"64 or 128, got {head_dim}")


def gluon_bwd_supported(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_bwd`` can run these inputs, else a one-line reason (for a fallback decision)."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
    for name, t in named + (("lse", lse),):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
    for name, t in named:
        if t.dim() != 4:
            return f"{name} must be 4-D [B, H, S, D], got {tuple(t.shape)}"
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"{name}: dtype {t.dtype} not supported (bf16 / fp16 only)"
    if len({t.dtype for _, t in named}) != 1:
        return "dtype mismatch between dout, q, k, v, out"
    if len({t.device for _, t in named + (("lse", lse),)}) != 1:
        return "inputs on different devices"
    cap = device_capability(q.device)
    if cap[0] != 9:
        return f"needs sm_90 (TMA / wgmma, Hopper only), device is sm_{cap[0]}{cap[1]}"
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    if k.shape[0] != B or k.shape[3] != D:
        return f"k / v shape {tuple(k.shape)} does not match q {tuple(q.shape)}"
    if out.shape != q.shape or dout.shape != q.shape:
        return f"out {tuple(out.shape)} / dout {tuple(dout.shape)} must match q {tuple(q.shape)}"
    if D not in _STAGES:
        return f"head dim {D} not supported (only {sorted(_STAGES)})"
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"query heads {Hq} not a multiple of kv heads {Hkv}"
    if lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hq, Sq):
        return f"lse must be fp32 [B, Hq, Sq] = {(B, Hq, Sq)}, got {lse.dtype} {tuple(lse.shape)}"
    if scale is not None and not (float(scale) > 0.0):
        return f"scale must be > 0 (got {scale})"
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        r = _tma_stride_reason(name, t)
        if r is not None:
            return r
    if max(Sq, k.shape[2]) >= 2 ** 30:
        return "sequence too long for int32 TMA coordinates"
    if B * Hq * (Sq + _PRE_BLOCK) >= 2 ** 31:
        return "B * Hq * Sq too large for the int32 lse / delta TMA coordinate"
    if B * Hkv > 65535 or B * Hq > 65535:
        return "B * H exceeds the grid's y limit (65535)"
    return None


def _check_ablate(ablate, variant: int, head_dim) -> int:
    """``ablate`` of ``gluon_attention_bwd`` / ``compile_offline`` as an int; 0 passes always. Anything else is a
    timing-only build with wrong results: only with ``FXOPT_ATTN_GLUON_BWD_ABLATE_OK=1``, only bits of
    ``ABLATE_BITS`` (``ABLATE_BITS_D256``: the same bits), only for a kernel with a REDG dQ path: the split-dQ kernel
    (variants 1-4 at d in ``_VARIANT_DIMS``) or the d = 256 kernel (any variant: every variant runs it)."""
    import os

    if ablate is None or ablate == 0:
        return 0
    if os.environ.get(ABLATE_ENV) != "1":
        raise ValueError(f"gluon_attention_bwd: ablate={ablate!r} is a timing-only ablation, results are wrong "
                         f"(set {ABLATE_ENV}=1 to run it anyway)")
    if not isinstance(ablate, int) or ablate < 0 or ablate & ~sum(ABLATE_BITS):
        raise ValueError(f"gluon_attention_bwd: ablate must be a bit mask of {sorted(ABLATE_BITS)}, got {ablate!r}")
    if head_dim == 256:  # _fa3_bwd_kernel_d256 whatever the variant (but its dQ-by-TMA build has no REDG to ablate)
        if variant == DQ_TMA_VARIANT:
            raise ValueError("gluon_attention_bwd: ablate needs the REDG dQ path; variant 6 at d = 256 has none")
        return int(ablate)
    if variant in (0,) + DQW_VARIANTS or (head_dim is not None and head_dim not in _VARIANT_DIMS):
        raise ValueError(f"gluon_attention_bwd: ablate needs the split-dQ kernel (variant 1-4, d in {_VARIANT_DIMS}) "
                         f"or the d = 256 kernel, got variant {variant}, d = {head_dim}")
    return int(ablate)


def grad_strides_ok(*ts: torch.Tensor) -> bool:
    """Whether ``torch.empty_like(t)`` (the layout the op's fake implementation gives t's gradient) suits TMA for
    every t: last dim contiguous, the other strides multiples of 16 bytes. Strides read from a meta tensor (free)."""
    for t in ts:
        st = torch.empty_like(t, device="meta").stride()
        if st[-1] != 1 or any((x * t.element_size()) % 16 for x in st[:-1]):
            return False
    return True


def _desc(t: torch.Tensor, rows: int, cols: Optional[int] = None, layout=None):
    D = t.shape[-1]
    block = [1, 1, rows, D if cols is None else cols]
    if layout is None:
        layout = host_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _vec_desc(t: torch.Tensor):
    return TensorDescriptor(t, [t.numel()], [1], [BLOCK_M], host_layout((BLOCK_M,), torch.float32))


@functools.lru_cache(maxsize=None)
def _dq_tma_layout():
    """Built once, as ``host_layout`` does for the other descriptors: a layout per launch cost microseconds of host."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)


def _dq_tma_desc(dq_acc: torch.Tensor, D: int):
    """Variant 6: the flat fp32 dQ workspace ([rows, D] row-major, rows = B * Hq * SQ_PAD) viewed as
    [rows / 8, D / 8, 8, 8] with strides [8 D, 8, D, 1] (row // 8, col // 8, row % 8, col % 8), box [8, D / 16, 8, 8]:
    one box is one warpgroup's [64, D / 2] dQ tile in its chunk-transposed shared-memory order."""
    rows = dq_acc.numel() // D
    return TensorDescriptor(dq_acc, [rows // 8, D // 8, 8, 8], [8 * D, 8, D, 1], [8, D // 16, 8, 8],
                            _dq_tma_layout())


def _dq_tma_signature(D: int) -> str:
    return f"tensordesc<fp32[8, {D // 16}, 8, 8],{_dq_tma_layout()!r}>"


def gluon_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
                        checked: bool = False, variant: int = 0, ablate: int = 0, grads_like_inputs: bool = False):
    """FA3-style backward -> (dq, dk, dv), contiguous, dtypes of q / k / v. Raises ValueError when unsupported
    (``gluon_bwd_supported`` gives the reason; ``checked=True`` skips that check). ``grads_like_inputs=True``:
    dq / dk / dv laid out like ``torch.empty_like`` of q / k / v (e.g. [B, S, H, D] transposed views, as the op's
    fake implementation promises) when those strides suit TMA (``grad_strides_ok``), else ValueError; the kernels
    address dq through its strides and dk / dv through TMA descriptors built on them (GPU-checked
     at d = 64 / 128 / 256, and the op routes strided inputs here by default).

    ``variant``: 0 = the default kernel (measured correct); 1 = split-dQ kernel (``_fa3_bwd_kernel_v1``: dQ
    columns split between the warpgroups, vectorised reductions); 2 = variant 1 with dK kept in flight over the
    dQ wgmma; 3 = variant 1 with dK issued before the dS^T publication (``EARLY_DK``); 4 = variant 3 with
    named-barrier turns between the consumer warpgroups (``TURNS``; correct, 1-2% slower); 5 = variant 3 with dQ
    through shared memory and a reducer warp (``DQW``, d = 64 / 128; the op's route at d = 128 and, from S = 4096,
    at d = 64, through ``attention_gluon_bwd_dqw.gluon_attention_bwd_dqw``). Variants 1-4 exist for d = 64 and 128
    (d = 64: GPU-checked, not routed; 64-byte-swizzle K tile, ``_SPLIT_STAGES``).
    d = 256 always runs ``_fa3_bwd_kernel_d256`` (GPU-checked; the op routes d = 256 here:
    ``_GLUON_BWD_HEAD_DIMS``). Variants 0-2 passed the 59 GPU cases of an H200 check; ``flash_attention_triton_bwd`` routes d = 128 to variant 3.

    ``ablate`` (TIMING ONLY, the results are wrong): a bit mask of ``ABLATE_BITS`` for the split-dQ kernel
    (variants 1-4, d = 64 / 128) or the d = 256 kernel (any variant; ``ABLATE_BITS_D256``); refused unless the
    environment has ``FXOPT_ATTN_GLUON_BWD_ABLATE_OK=1``."""
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else None
    _check_variant(variant, head_dim)
    ablate = _check_ablate(ablate, variant, head_dim)
    reason = None if checked else gluon_bwd_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is not None:
        raise ValueError(f"gluon_attention_bwd: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    if grads_like_inputs and not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        if not grad_strides_ok(q, k, v):
            raise ValueError("gluon_attention_bwd: grads_like_inputs: torch.empty_like(q / k / v) strides do not "
                             "suit TMA (last dim contiguous, other strides 16-byte multiples)")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq = torch.empty((B, Hq, Sq, D), device=q.device, dtype=q.dtype)
        dk = torch.empty((B, Hkv, Sk, D), device=q.device, dtype=k.dtype)
        dv = torch.empty((B, Hkv, Sk, D), device=q.device, dtype=v.dtype)
    if B * Hq * Sq == 0 or Sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    n_m = (Sq + BLOCK_M - 1) // BLOCK_M
    sq_pad = n_m * BLOCK_M
    lse2 = torch.empty((B * Hq * sq_pad,), device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse2)
    dq_acc = torch.empty((B * Hq * sq_pad * D,), device=q.device, dtype=torch.float32)
    # d = 256: 8 warps for the [64, 256] tiles of the preprocess / convert (4 spill: 80 / 224 B of stack offline)
    pre_warps = 8 if D == 256 else 4
    _bwd_preprocess[(n_m, B * Hq)](out, dout, lse, delta, lse2, dq_acc, *out.stride()[:3], *dout.stride()[:3],
                                   lse.stride(0), lse.stride(1), Hq, Sq, sq_pad, HEAD_DIM=D, BLOCK=_PRE_BLOCK,
                                   num_warps=pre_warps)
    cfg = config_for(D, variant)
    if D == 256:  # any variant: the d = 256 kernel (64 keys per CTA, head dim split between the warpgroups)
        _fa3_bwd_kernel_d256[((Sk + D256_BLOCK_N - 1) // D256_BLOCK_N, B * Hkv)](
            _desc(q, D256_QROWS, D256_HALF), _desc(k, D256_BLOCK_N, D256_HALF), _desc(v, D256_BLOCK_N, D256_HALF),
            _desc(dout, D256_QROWS, D256_HALF), _desc(dk, D256_BLOCK_N, D256_HALF), _desc(dv, D256_BLOCK_N, D256_HALF),
            _vec_desc(lse2), _vec_desc(delta), dq_acc, sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, sq_pad,
            STAGES=cfg["STAGES"], CAUSAL=bool(causal), CONSUMER_REGS=cfg["CONSUMER_REGS"],
            PRODUCER_REGS=cfg["PRODUCER_REGS"], num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
            **({"ABLATE": ablate} if ablate else {}),
            **(dict(DQ_TMA=True, dq_desc=_dq_tma_desc(dq_acc, D)) if variant == DQ_TMA_VARIANT else {}))
        _bwd_dq_convert[(n_m, B * Hq)](dq_acc, dq, *dq.stride()[:3], Hq, Sq, sq_pad, sm_scale,
                                       HEAD_DIM=D, BLOCK=_PRE_BLOCK, num_warps=pre_warps)
        return dq, dk, dv
    grid = ((Sk + BLOCK_N - 1) // BLOCK_N, B * Hkv)
    if variant != 0 and D in _VARIANT_DIMS:
        k_layout = _split_k_layout(D, _gl_dtype(k.dtype), 4)  # d = 64: 64-byte swizzle (K tile and dK staging)
        _fa3_bwd_kernel_v1[grid](_desc(q, BLOCK_M), _desc(k, WG_KEYS, layout=k_layout), _desc(v, WG_KEYS),
                                 _desc(dout, BLOCK_M), _desc(dk, WG_KEYS, layout=k_layout), _desc(dv, WG_KEYS),
                                 _vec_desc(lse2), _vec_desc(delta), dq_acc,
                                 sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, sq_pad,
                                 HEAD_DIM=D, STAGES=cfg["STAGES"], CAUSAL=bool(causal),
                                 CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                                 DK_IN_FLIGHT=(variant == 2), EARLY_DK=(variant in (3, 4) + DQW_VARIANTS),
                                 TURNS=(variant == 4), num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
                                 **({"ABLATE": ablate} if ablate else {}),
                                 **(dict(DQW=True, NB=cfg["NB"], REDUCER_WARPS=cfg["REDUCER_WARPS"])
                                    if variant in DQW_VARIANTS else {}),
                                 **(dict(DQ_TMA=True, dq_desc=_dq_tma_desc(dq_acc, D))
                                    if variant == DQ_TMA_VARIANT else {}))
        _bwd_dq_convert[(n_m, B * Hq)](dq_acc, dq, *dq.stride()[:3], Hq, Sq, sq_pad, sm_scale,
                                       HEAD_DIM=D, BLOCK=_PRE_BLOCK)
        return dq, dk, dv
    _fa3_bwd_kernel[grid](_desc(q, BLOCK_M), _desc(k, WG_KEYS), _desc(v, WG_KEYS), _desc(dout, BLOCK_M),
                          _desc(dk, WG_KEYS), _desc(dv, WG_KEYS), _vec_desc(lse2), _vec_desc(delta), dq_acc,
                          sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, sq_pad,
                          HEAD_DIM=D, STAGES=cfg["STAGES"], CAUSAL=bool(causal),
                          CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                          num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    _bwd_dq_convert[(n_m, B * Hq)](dq_acc, dq, *dq.stride()[:3], Hq, Sq, sq_pad, sm_scale,
                                   HEAD_DIM=D, BLOCK=_PRE_BLOCK)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# Offline compile check (no GPU needed): python -m fxopt.kernels.attention_gluon_bwd [--dump DIR]
# ----------------------------------------------------------------------------------------------------------------


def _signature(dtype_str: str, D: int):
    gdt = gl.bfloat16 if dtype_str == "bf16" else gl.float16

    def td(rows, cols=D):
        lay = gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gdt)
        return f"tensordesc<{dtype_str}[1, 1, {rows}, {cols}],{lay!r}>"

    vlay = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    vd = f"tensordesc<fp32[{BLOCK_M}],{vlay!r}>"
    if D == 256:  # _fa3_bwd_kernel_d256: [rows, 128] boxes, no HEAD_DIM constexpr
        return {"q_desc": td(D256_QROWS, D256_HALF), "k_desc": td(D256_BLOCK_N, D256_HALF),
                "v_desc": td(D256_BLOCK_N, D256_HALF), "do_desc": td(D256_QROWS, D256_HALF),
                "dk_desc": td(D256_BLOCK_N, D256_HALF), "dv_desc": td(D256_BLOCK_N, D256_HALF), "lse_desc": vd,
                "delta_desc": vd, "dq_ptr": "*fp32", "qk_scale": "fp32", "H": "i32", "GROUP": "i32",
                "SEQ_Q": "i32", "SEQ_K": "i32", "SQ_PAD": "i32", "STAGES": "constexpr", "CAUSAL": "constexpr",
                "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr", "ABLATE": "constexpr"}
    return {"q_desc": td(BLOCK_M), "k_desc": td(WG_KEYS), "v_desc": td(WG_KEYS), "do_desc": td(BLOCK_M),
            "dk_desc": td(WG_KEYS), "dv_desc": td(WG_KEYS), "lse_desc": vd, "delta_desc": vd, "dq_ptr": "*fp32",
            "qk_scale": "fp32", "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "SQ_PAD": "i32",
            "HEAD_DIM": "constexpr", "STAGES": "constexpr", "CAUSAL": "constexpr", "CONSUMER_REGS": "constexpr",
            "PRODUCER_REGS": "constexpr"}


def compile_offline(D: int, causal: bool, dtype_str: str = "bf16", arch: int = 90, variant: int = 0,
                    ablate: int = 0, ones: tuple = ()):
    """Compile the main kernel (``variant`` 0: default, 1 / 2: split-dQ, 3: split-dQ + dK first, 4: 3 + warpgroup
    turns, 5: 3 + dQ through shared memory (DQW, D = 64 / 128); D = 256: the d = 256
    kernel whatever the variant) for sm_<arch> without a GPU; returns triton's CompiledKernel. ``ablate``: the
    ``ABLATE`` constexpr of the split-dQ kernel (0 = the real kernel; other masks are timing-only builds, gated
    like ``gluon_attention_bwd``'s; at D = 256 the d = 256 kernel's ``ABLATE``). The split-dQ kernel always gets
    TURNS, ABLATE, DQW, NB and REDUCER_WARPS explicitly here, the d = 256 kernel ABLATE: an offline compile does not
    apply a constexpr's default (it would be None). ``ones``: i32 arguments (e.g. ``("H", "GROUP")``) built as the
    constexpr 1 that Triton's launcher makes of an int argument equal to 1 (variant 5 built offline with
    i32 arguments but failed to compile at run time with GROUP = 1)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    _check_variant(variant, D)
    cfg = config_for(D, variant)
    constexprs = {"HEAD_DIM": D, "STAGES": cfg["STAGES"], "CAUSAL": bool(causal),
                  "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"]}
    sig = _signature(dtype_str, D)
    for name in ones:
        if sig.get(name) != "i32":
            raise ValueError(f"compile_offline: ones={ones!r}: {name!r} is not an i32 argument")
        sig[name] = "constexpr"
        constexprs[name] = 1
    if D == 256:  # one kernel for every variant; ABLATE explicit (an offline compile binds no defaults)
        constexprs.pop("HEAD_DIM")
        constexprs["ABLATE"] = _check_ablate(ablate, variant, D)
        sig["DQ_TMA"] = "constexpr"
        constexprs["DQ_TMA"] = variant == DQ_TMA_VARIANT
        if constexprs["DQ_TMA"]:
            sig["dq_desc"] = _dq_tma_signature(D)
        else:
            sig["dq_desc"] = "constexpr"
            constexprs["dq_desc"] = None
        src = GluonASTSource(_fa3_bwd_kernel_d256, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})
    if variant != 0:
        if D == 64:  # the split-dQ kernel's K / dK tiles at d = 64 (``_split_k_layout``)
            gdt = gl.bfloat16 if dtype_str == "bf16" else gl.float16
            klay = _split_k_layout(D, gdt, 4)
            sig["k_desc"] = sig["dk_desc"] = f"tensordesc<{dtype_str}[1, 1, {WG_KEYS}, {D}],{klay!r}>"
        sig["DK_IN_FLIGHT"] = "constexpr"
        sig["EARLY_DK"] = "constexpr"
        constexprs["DK_IN_FLIGHT"] = variant == 2
        constexprs["EARLY_DK"] = variant in (3, 4) + DQW_VARIANTS
        sig["TURNS"] = "constexpr"
        constexprs["TURNS"] = variant == 4
        sig["ABLATE"] = "constexpr"
        constexprs["ABLATE"] = _check_ablate(ablate, variant, D)
        for name in ("DQW", "NB", "REDUCER_WARPS"):
            sig[name] = "constexpr"
        constexprs.update(DQW=variant in DQW_VARIANTS, NB=cfg.get("NB", DQ_BUFFERS),
                          REDUCER_WARPS=cfg.get("REDUCER_WARPS", REDUCER_WARPS))
        sig["DQ_TMA"] = "constexpr"
        constexprs["DQ_TMA"] = variant == DQ_TMA_VARIANT
        if variant == DQ_TMA_VARIANT:
            sig["dq_desc"] = _dq_tma_signature(D)
        else:  # None (no capture), as the launcher leaves it
            sig["dq_desc"] = "constexpr"
            constexprs["dq_desc"] = None
        kern = _fa3_bwd_kernel_v1
    else:
        kern = _fa3_bwd_kernel
    src = GluonASTSource(kern, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})


def sass_summary(c) -> dict:
    """Counts in the sm_90 SASS: HGMMA, wgmma waits, barriers, reductions, ptxas serialisation warnings."""
    import re

    from fxopt.kernels.attention_gluon import _tool

    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    return {"hgmma": len(re.findall(r"HGMMA", sass)),
            "depbar_le0": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)),
            "depbar_le1": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)),
            "redg_f32": len(re.findall(r"\bREDG\.E\.ADD\.F32", sass)),
            "atomg": len(re.findall(r"\bATOMG", sass)),
            "bar_sync": len(re.findall(r"\bBAR\.SYNC", sass)),
            "setmaxnreg": sorted(set(re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))),
            "max_reg_index": max(regs) if regs else None,
            "wgmma_serialized": "C7512" in ptxas or "serialized" in ptxas}



# ----------------------------------------------------------------------------------------------------------------
# Issue-slot / resource model of one CTA step from offline SASS (docs/kernels.md)
# ----------------------------------------------------------------------------------------------------------------

# instruction classes of the step-loop census, first match wins (predicate guards are stripped first)
_SASS_CLASSES = (
    ("hgmma", r"HGMMA"), ("mufu_ex2", r"MUFU\.EX2"), ("mufu_other", r"MUFU"), ("ffma", r"FFMA\b"),
    ("fmul", r"FMUL\b"), ("fadd", r"FADD\b"), ("fsel_fsetp", r"F(?:SEL|SETP|MNMX)\b"), ("f2fp", r"F2FP"),
    ("f2f", r"F2F\b|F2F\."), ("redg", r"REDG|RED\b"), ("atom", r"ATOM"), ("bar", r"BAR\.(?:SYNC|ARV|RED)"),
    ("warpgroup", r"WARPGROUP"), ("syncs", r"SYNCS"), ("fence_membar", r"FENCE|MEMBAR"), ("lds", r"LDS|LDSM"),
    ("sts", r"STS|STSM"), ("local", r"LDL|STL"), ("shfl", r"SHFL"), ("tma", r"UTMA|UBLKCP"),
    ("move", r"U?MOV\b|U?MOV\.|R2UR|S2UR|UR2R|S2R|CS2R"), ("control", r"BRA|WARPSYNC|BSSY|BSYNC|ELECT|NOP|EXIT"),
    ("uniform_int", r"U[A-Z]"), ("int_addr", r"IMAD|IADD|LEA|LOP|SHF|ISETP|SEL|IABS|I2F|F2I|VIADD|IMNMX|PLOP|P2R|"
                                             r"R2P|FLO|POPC|VOTE|PRMT"))


def sass_step_loops(sass: str, min_len: int = 30) -> list:
    """Innermost loops of sm_90 SASS text (``cuobjdump -sass``): a conditional backward ``BRA`` whose body (target ..
    branch, address order) holds ``min_len`` instructions or more and no other such loop. The out-of-line mbarrier
    retry blocks end in an unconditional ``BRA`` back into the loop and are not loops here. Per loop: ``start`` /
    ``end`` addresses, ``n`` instructions (per warp and iteration: one issue slot each), ``classes`` (counts per
    ``_SASS_CLASSES`` name, ``other:OPCODE`` for the rest), ``hgmma`` (count per shape, e.g. ``64x64x16``) and
    ``hgmma_ss`` / ``hgmma_rs`` (A operand from shared memory / registers)."""
    import collections
    import re

    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    cand = []
    for addr, text in ins:
        m = re.match(r"@!?U?P\w+\s+BRA\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) >= min_len:
                cand.append((int(m.group(1), 16), addr, body))
    out = []
    for lo, hi, body in cand:
        if any((o_lo, o_hi) != (lo, hi) and lo <= o_lo and o_hi <= hi for o_lo, o_hi, _ in cand):
            continue  # not innermost
        classes, shapes = collections.Counter(), collections.Counter()
        ss = rs = 0
        for t in body:
            t2 = re.sub(r"^@!?U?P\w+\s+", "", t)
            name = next((n for n, r in _SASS_CLASSES if re.match(r, t2)), "other:" + t2.split()[0])
            classes[name] += 1
            m = re.match(r"HGMMA\.(\d+x\d+x\d+)\S*\s+R\d+,\s*(\S+)", t2)
            if m:
                shapes[m.group(1)] += 1
                if m.group(2).startswith("gdesc"):
                    ss += 1
                else:
                    rs += 1
        out.append(dict(start=lo, end=hi, n=len(body), classes=dict(classes), hgmma=dict(shapes), hgmma_ss=ss,
                        hgmma_rs=rs))
    return out


def bwd_step_model(consumer_loops, producer_n: int = 0, tflops: Optional[float] = None, clock_ghz: float = 1.83,
                   sms: int = 132, flop_per_clk_sm: int = 4096, mufu_per_clk_sm: int = 16, smem_b_per_clk: int = 128,
                   tma_bytes_per_step: int = 2 * 64 * 128 * 2 + 2 * 64 * 4, warps_per_wg: int = 4,
                   dtype_bytes: int = 2) -> dict:
    """Cycles per CTA step on one SM (1 CTA per SM: two consumer warpgroups of 4 warps, one warp of each per SM
    sub-partition, plus the producer warp on sub-partition 0) for each resource, from the step-loop census
    (``sass_step_loops``) of the two consumer warpgroups' copies of one loop kind (``consumer_loops``: 2 dicts)
    and the producer loop length. Resources:

    * ``tensor``: sum over the HGMMA of both warpgroups of 64 N K 2 FLOP / ``flop_per_clk_sm`` (H200 dense bf16:
      989 TFLOP/s / 132 SMs / 1.83 GHz = 4096);
    * ``smem``: bytes through the 128 B/clk shared-memory port: wgmma operands (A = 64 x K from smem for SS, B = N x
      K, read once per warpgroup instruction), the TMA writes of the step's Q / dO / lse2 / delta, STSM (512 B per
      warp instruction), one wavefront per LDS;
    * ``mufu``: MUFU.EX2 lanes / 16 per clk per SM;
    * ``issue``: instructions per sub-partition (both consumer warps' loops + the producer's on sub-partition 0),
      one per clk;
    * ``fp32``: FFMA / FADD / FMUL / FSEL-class warp instructions per sub-partition (32 lanes per clk);
    * ``red_bytes``: fp32 reduction payload per step (REDG.F32x2: 8 B per lane).

    With ``tflops`` (measured, FLOPs as the benchmark counts them = the HGMMA FLOPs of a full step) also
    ``measured`` cycles per step = step FLOPs / (tflops / sms) * clock, each resource's share of it and the L2
    reduction rate over the chip."""
    assert len(consumer_loops) == 2, "one step-loop census per consumer warpgroup"
    flop = smem = mufu = redg_lanes = 0.0
    issue = fp32 = 0
    for lp in consumer_loops:
        c = lp["classes"]
        for shape, cnt in lp["hgmma"].items():
            m, n, k = (int(x) for x in shape.split("x"))
            flop += cnt * m * n * k * 2
            smem += cnt * n * k * dtype_bytes  # B operand, every HGMMA
        ks = {int(s.split("x")[2]) for s in lp["hgmma"]} or {16}
        smem += lp["hgmma_ss"] * 64 * max(ks) * dtype_bytes  # A operand of the SS ones
        smem += c.get("sts", 0) * warps_per_wg * 512 + c.get("lds", 0) * warps_per_wg * smem_b_per_clk
        mufu += c.get("mufu_ex2", 0) * warps_per_wg * 32
        redg_lanes += c.get("redg", 0) * warps_per_wg * 32
        issue += lp["n"]
        fp32 += sum(c.get(x, 0) for x in ("ffma", "fmul", "fadd", "fsel_fsetp"))
    smem += tma_bytes_per_step
    res = dict(step_flop=flop, tensor=flop / flop_per_clk_sm, smem=smem / smem_b_per_clk,
               mufu=mufu / mufu_per_clk_sm, issue=issue + producer_n, issue_consumers=issue, fp32=fp32,
               red_bytes=redg_lanes * 8)
    if tflops:
        cyc = flop / (tflops * 1e12 / sms) * clock_ghz * 1e9
        res["measured"] = cyc
        for key in ("tensor", "smem", "mufu", "issue", "fp32"):
            res[f"{key}_share"] = res[key] / cyc
        res["red_tb_per_s"] = res["red_bytes"] * sms / (cyc / (clock_ghz * 1e9)) / 1e12
    return res


# ----------------------------------------------------------------------------------------------------------------
# The CPU protocol models' shared mechanics (``d256_protocol_model``, ``v4_protocol_model``,
# ``attention_gluon_bwd_dqw.dqw_protocol_model``)
# ----------------------------------------------------------------------------------------------------------------


class ProtocolState:
    """One CTA's barriers and buffers for a CPU protocol model. mbarriers are completed-phase counts: ``passed(bar,
    u)`` (the wait for use u) holds once u + 1 phases completed and raises if more have (a parity wait would then be
    ambiguous: a skipped phase). ``read`` / ``unread`` track the agents reading a buffer; ``write`` raises if another
    agent reads it. ``load`` issues a TMA load that lands 0..delay ticks later and arrives on its barrier; ``run``
    is the random scheduler."""

    def __init__(self, rng):
        self.rng = rng
        self.count, self.arrived, self.done, self.readers = {}, {}, {}, {}
        self.inflight = []   # (land tick, buffers, barrier)
        self.tick = 0

    def init(self, bar, n):
        self.count[bar], self.arrived[bar], self.done[bar] = n, 0, 0

    def arrive(self, bar):
        self.arrived[bar] += 1
        if self.arrived[bar] == self.count[bar]:
            self.arrived[bar] = 0
            self.done[bar] += 1

    def passed(self, bar, use):
        assert self.done[bar] <= use + 1, f"phase skipped on {bar}: use {use}, {self.done[bar]} phases completed"
        return self.done[bar] == use + 1

    def read(self, buf, who):
        self.readers.setdefault(buf, set()).add(who)

    def unread(self, buf, who):
        self.readers[buf].discard(who)

    def write(self, buf, who):
        others = self.readers.get(buf, set()) - {who}
        assert not others, f"{who} writes {buf} while {sorted(others)} read it"

    def load(self, delay, bufs, bar):
        self.inflight.append((self.tick + self.rng.randint(0, delay), bufs, bar))

    def run(self, agents: dict, max_ticks: int, progress=tuple, speed=None, land_writes=False, stuck=str) -> int:
        """Run the agents (generators; a ``yield`` is one step) until all finished and every load landed: per tick
        the loads due land (with ``land_writes`` each writes its buffers as "tma"), then one runnable agent, drawn
        uniformly or by ``speed`` weights, takes a step. Deadlock = nothing in flight and no change of the phases,
        arrivals or ``progress()`` for 10,000 steps (``stuck()`` is added to the message). Returns the ticks."""
        blocked_for = 0
        while agents or self.inflight:
            self.tick += 1
            assert self.tick < max_ticks, "model did not finish"
            for item in [x for x in self.inflight if x[0] <= self.tick]:
                self.inflight.remove(item)
                if land_writes:
                    for buf in item[1]:
                        self.write(buf, "tma")
                self.arrive(item[2])
            if not agents:
                continue
            names = sorted(agents)
            name = (self.rng.choices(names, weights=[speed[n] for n in names])[0] if speed
                    else self.rng.choice(names))
            before = (dict(self.done), dict(self.arrived), len(self.inflight), progress())
            try:
                next(agents[name])
            except StopIteration:
                del agents[name]
                continue
            if not self.inflight and (dict(self.done), dict(self.arrived), len(self.inflight), progress()) == before:
                blocked_for += 1
                assert blocked_for < 10000, (f"deadlock at tick {self.tick}: {sorted(agents)} waiting; phases "
                                             f"{self.done}{stuck()}")
            else:
                blocked_for = 0
        return self.tick


def ring_producer(st: ProtocolState, n_steps: int, stages: int, tma_delay: int):
    """The producer partition of ``_fa3_bwd_kernel_v1`` (variants 1-5) as a protocol-model agent: K / V (both column
    halves) once on "kv", then Q / dO of ``n_steps`` query blocks into ring slot it % stages, each TMA issued after
    the release of the slot's previous use (q_empty / do_empty) and writing the slot at issue."""
    st.load(tma_delay, ["K0", "K1", "V0", "V1"], "kv")
    for it in range(n_steps):
        s, u = it % stages, it // stages
        for kind in ("q", "do"):
            while u > 0 and not st.passed((kind + "_empty", s), u - 1):
                yield
            st.write((kind, s), "tma")
            st.load(tma_delay, [(kind, s)], (kind + "_ready", s))
            yield


# ----------------------------------------------------------------------------------------------------------------
# CPU model of the d = 256 kernel's barrier protocol (no GPU): python -c "import fxopt.kernels.attention_gluon_bwd as
# G; print(G.check_d256_protocol())"
# ----------------------------------------------------------------------------------------------------------------


def d256_protocol_model(n_steps: int, stages: int = 2, seed: int = 0, tma_delay: int = 3, max_ticks: int = 10 ** 6,
                        bug: str = ""):
    """One CTA of ``_fa3_bwd_kernel_d256``, statement for statement at the level of barriers and buffer accesses:
    the producer (K / V once, then Q / lse and dO / delta of ``n_steps`` query blocks into ring slot it % stages),
    and the two consumer warpgroups (``_bwd_step_d256`` per step, then the end_bar meeting and the dK / dV staging
    into their column half of K / V). A random scheduler runs one runnable agent per tick; TMA loads land a random
    0..tma_delay ticks after issue. mbarriers are modelled with their completed-phase count: a wait for use u of a
    barrier passes when u + 1 phases have completed and raises if more have (a parity wait would then be ambiguous:
    a skipped phase). Raises AssertionError on deadlock, skipped phase, or a write to a buffer another agent may still
    read (TMA into a ring slot being read, P^T / dS^T rewritten before the other warpgroup's wgmmas on it are
    waited for, K / V overwritten while read). Returns the number of ticks. ``bug`` (for the tests: the model must
    catch it) = "single_x" (one P^T / dS^T buffer instead of two), "early_release" (Q / dO slots released before
    the dV / dK wgmmas that read them are waited for), "no_end_bar" (epilogue without the end_bar meeting)."""
    import random

    st = ProtocolState(random.Random(seed))
    init, arrive, passed, read, unread, write = st.init, st.arrive, st.passed, st.read, st.unread, st.write

    init("kv", 1)
    init("end", 2)
    for i in range(stages):
        init(("q_ready", i), 1)
        init(("do_ready", i), 1)
        init(("q_empty", i), 2)
        init(("do_empty", i), 2)
    for i in range(2):
        init(("x", i), 2)

    def producer():
        st.load(tma_delay, ["K", "V"], "kv")
        for it in range(n_steps):
            s, u = it % stages, it // stages
            for kind in ("q", "do"):
                while u > 0 and not passed((kind + "_empty", s), u - 1):
                    yield
                st.load(tma_delay, [(kind, s)], (kind + "_ready", s))
                yield

    def consumer(w):
        me = f"wg{w}"
        while not passed("kv", 0):
            yield
        read("K", me)
        read("V", me)
        for it in range(n_steps):
            s, u, p = it % stages, it // stages, it % 2
            xp, xu = (0, it) if bug == "single_x" else (p, it // 2)
            p = xp
            for kind in ("q", "do"):           # S^T after q_ready, dP^T after do_ready
                while not passed((kind + "_ready", s), u):
                    yield
                read((kind, s), me)
                yield
            write(("pt", p, w), me)            # P^T_w -> block w of buffer p
            yield
            write(("ds", p, w), me)            # dS^T_w
            arrive(("x", p))                   # after fence + thread barrier
            yield
            if bug == "early_release":  # released while the dV / dK wgmmas below still read the slot
                arrive(("q_empty", s))
                arrive(("do_empty", s))
            while not passed(("x", p), xu):
                yield
            for blk in (("pt", p, 1 - w), ("ds", p, 1 - w), ("pt", p, w), ("ds", p, w)):
                read(blk, me)                            # dV / dK (other half) and dQ (both halves) read buffer p
            yield
            unread(("pt", p, 1 - w), me)                 # wait(0) of dV / dK
            unread(("pt", p, w), me)
            unread(("q", s), me)
            unread(("do", s), me)
            if bug != "early_release":
                arrive(("q_empty", s))
                arrive(("do_empty", s))
            yield
            unread(("ds", p, 1 - w), me)                 # wait(0) of dQ
            unread(("ds", p, w), me)
            yield
        unread("K", me)
        unread("V", me)
        arrive("end")
        while bug != "no_end_bar" and not passed("end", 0):
            yield
        write("K", me)                                   # dK_w / dV_w staged in column half w of K / V
        write("V", me)

    tick = st.run({"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}, max_ticks, land_writes=True)
    done = st.done
    assert done["end"] == 1 and all(done[("q_ready", i)] == len(range(i, n_steps, stages)) for i in range(stages))
    return tick


def check_d256_protocol(trials: int = 300, seed: int = 0) -> str:
    """``d256_protocol_model`` over random interleavings: 0-9 query blocks per CTA, 1-3 ring stages."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        d256_protocol_model(rng.randint(0, 9), 1 + k % 3, seed=k, tma_delay=rng.randint(0, 6))
    return f"d = 256 protocol: {trials} random interleavings without deadlock, skipped phase or buffer hazard"


# ----------------------------------------------------------------------------------------------------------------
# CPU model of variant 4's protocol (the variant-1 / 3 mbarrier protocol plus the warpgroup turns; no GPU):
# python -c "import fxopt.kernels.attention_gluon_bwd as G; print(G.check_v4_protocol())"
# ----------------------------------------------------------------------------------------------------------------

V4_BUGS = ("no_prearrive", "no_final_sync", "hold_turn", "pass_twice", "single_ds", "early_release", "no_end_bar")


def v4_protocol_model(n_steps: int, stages: int = 2, seed: int = 0, tma_delay: int = 3, max_ticks: int = 10 ** 6,
                      bug: str = "") -> int:
    """One CTA of ``_fa3_bwd_kernel_v1`` with ``EARLY_DK`` and ``TURNS`` (variant 4), statement for statement at the
    level of barriers, buffer accesses and wgmma issue points: the producer (K / V once, then Q / lse and dO / delta of
    ``n_steps`` query blocks into ring slot it % stages, each fill after the release of the slot's previous use), and
    the two consumer warpgroups (``_bwd_step_v1``: q_ready / do_ready waits, turn, S^T + dP^T issue, pass; P^T / dS^T
    math; dS^T into ``ds_smem[2 p + w]`` and one arrive on ``ds_bar[p]``; wait(0) of dV / dK, Q / dO released; ds_bar
    wait; turn, dQ issue (reads both dS^T tiles and K_0, K_1), pass; wait(0); reductions), warpgroup 1's first pass
    before its loop, warpgroup 0's last turn wait after it, the end_bar meeting and the dK / dV staging into K_w / V_w.

    mbarriers as in ``d256_protocol_model`` (completed-phase counts; a wait for use u raises if more than u + 1 phases
    completed: a skipped phase). The named barriers 14 / 15 as on sm_90 with 256 threads: one contribution of 128
    threads from each warpgroup completes a generation; ``bar.sync`` blocks until its generation completes,
    ``bar.arrive`` does not. A random scheduler runs one runnable agent per tick; TMA loads land 0..tma_delay ticks
    after issue. Raises AssertionError on: deadlock; skipped mbarrier phase; a warpgroup contributing twice to one
    named-barrier generation; a named barrier with pending arrivals at exit; wgmma issue points out of the strict
    alternation (WG0 point k, WG1 point k, WG0 point k + 1, ...; points 2 it = S^T / dP^T, 2 it + 1 = dQ); a write
    into a buffer another agent may still read (TMA into a ring slot, dS^T tile, K / V in the epilogue). Returns the
    number of ticks. ``bug`` (one of ``V4_BUGS``; the tests check the model catches each): "no_prearrive" (warpgroup 1
    does not hand over the first turn), "no_final_sync" (warpgroup 0 does not take back the last turn),
    "hold_turn" (one turn per step held from the S^T issue to the dQ issue: deadlocks against the ds_bar exchange),
    "pass_twice" (warpgroup 0 passes twice after the dQ issue), "single_ds" (one dS^T buffer per warpgroup instead of
    two), "early_release" (Q / dO released before dV / dK are waited for), "no_end_bar" (epilogue without end_bar)."""
    import random

    assert bug in ("",) + V4_BUGS, bug
    st = ProtocolState(random.Random(seed))
    init, arrive, passed, read, unread, write = st.init, st.arrive, st.passed, st.read, st.unread, st.write

    members = [set(), set()]   # named barrier 14 + w: warpgroups that contributed to the current generation
    gen = [0, 0]

    def join(w_bar, who):
        assert who not in members[w_bar], f"warpgroup {who} contributed twice to one generation of barrier {14 + w_bar}"
        members[w_bar].add(who)
        g = gen[w_bar]
        if len(members[w_bar]) == 2:
            members[w_bar], gen[w_bar] = set(), gen[w_bar] + 1
        return g

    def turn_wait(w):            # bar.sync 14 + w, 256
        g = join(w, w)
        while gen[w] == g:
            yield

    def turn_pass(w):            # bar.arrive 14 + (1 - w), 256
        join(1 - w, w)

    init("kv", 1)
    init("end", 2)
    for i in range(stages):
        for kind in ("q_ready", "do_ready"):
            init((kind, i), 1)
        for kind in ("q_empty", "do_empty"):
            init((kind, i), 2)
    n_ds = 1 if bug == "single_ds" else 2
    for i in range(n_ds):
        init(("ds", i), 2)
    issues = []

    def consumer(w):
        me = f"wg{w}"
        while not passed("kv", 0):
            yield
        if w == 1 and bug != "no_prearrive":
            turn_pass(w)
        for it in range(n_steps):
            s, u = it % stages, it // stages
            p, du = it % n_ds, it // n_ds
            for kind in ("q", "do"):
                while not passed((kind + "_ready", s), u):
                    yield
            yield from turn_wait(w)
            issues.append((w, 2 * it))                  # S^T, dP^T: read Q, dO, K_w, V_w
            for buf in (("q", s), ("do", s), f"K{w}", f"V{w}"):
                read(buf, me)
            if bug != "hold_turn":
                turn_pass(w)
            yield                                       # S^T / dP^T waited, P^T, dV issued, dS^T, dK issued
            unread(f"K{w}", me)
            unread(f"V{w}", me)
            write(("dst", p, w), me)                    # dS^T_w -> ds_smem[2 p + w]; fence; thread barrier
            arrive(("ds", p))
            yield
            if bug == "early_release":
                arrive(("q_empty", s))
                arrive(("do_empty", s))
                yield
            unread(("q", s), me)                        # wait(0) of dV, dK
            unread(("do", s), me)
            if bug != "early_release":
                arrive(("q_empty", s))
                arrive(("do_empty", s))
            while not passed(("ds", p), du):
                yield
            if bug != "hold_turn":
                yield from turn_wait(w)
            issues.append((w, 2 * it + 1))              # dQ: both dS^T tiles, both K halves
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):
                read(buf, me)
            turn_pass(w)
            if bug == "pass_twice" and w == 0:
                turn_pass(w)
            yield
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):   # wait(0) of dQ, then the reductions
                unread(buf, me)
            yield
        if w == 0 and bug != "no_final_sync":
            yield from turn_wait(w)
        arrive("end")
        while bug != "no_end_bar" and not passed("end", 0):
            yield
        write(f"K{w}", me)                              # dK_w / dV_w staged in K_w / V_w, TMA store
        write(f"V{w}", me)

    tick = st.run({"producer": ring_producer(st, n_steps, stages, tma_delay), "wg0": consumer(0),
                   "wg1": consumer(1)}, max_ticks, progress=lambda: (list(gen), [set(m) for m in members]),
                  stuck=lambda: f"; named barriers 14 / 15: {members}")
    done = st.done
    assert not members[0] and not members[1], \
        f"named barrier left with pending arrivals: 14 {members[0]}, 15 {members[1]}"
    want = [(w, k) for k in range(2 * n_steps) for w in (0, 1)]
    assert issues == want, f"issue order {issues[:12]} ..., want strict alternation"
    assert done["end"] == 1 and all(done[("q_ready", i)] == len(range(i, n_steps, stages)) for i in range(stages))
    return tick


def check_v4_protocol(trials: int = 300, seed: int = 0) -> str:
    """``v4_protocol_model`` over random interleavings: 0-9 query blocks per CTA, 1-3 ring stages, TMA delays 0-6."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        v4_protocol_model(rng.randint(0, 9), 1 + k % 3, seed=k, tma_delay=rng.randint(0, 6))
    return (f"variant 4 protocol: {trials} random interleavings without deadlock, skipped phase, named-barrier misuse, "
            f"out-of-turn issue or buffer hazard")


if __name__ == "__main__":  # pragma: no cover - tooling
    import argparse
    import os
    import re

    from fxopt.kernels.attention_gluon import _tool

    ap = argparse.ArgumentParser(description="offline sm_90 compile of every Gluon attention backward config")
    ap.add_argument("--dump", default=None, help="directory for ttgir / ptx / cubin / sass of each config")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    args = ap.parse_args()
    for D in [int(x) for x in args.dims.split(",")]:
        for causal in (False, True):
            for dt in args.dtypes.split(","):
                tag = f"d{D}_{'causal' if causal else 'full'}_{dt}"
                try:
                    c = compile_offline(D, causal, dt)
                except Exception as e:  # report and go on
                    print(f"{tag}: COMPILE FAILED: {type(e).__name__}: {str(e)[:3000]}")
                    continue
                use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
                m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
                print(f"{tag}: {m.group(0) if m else use.strip()}  smem={c.metadata.shared} B  "
                      f"warps={c.metadata.num_warps}  {sass_summary(c)}", flush=True)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    for ext in ("ttgir", "ptx"):
                        with open(os.path.join(args.dump, f"{tag}.{ext}"), "w") as f:
                            f.write(c.asm[ext])
                    with open(os.path.join(args.dump, f"{tag}.cubin"), "wb") as f:
                        f.write(c.asm["cubin"])
                    with open(os.path.join(args.dump, f"{tag}.sass"), "w") as f:
                        f.write(_tool("nvdisasm", c.asm["cubin"], ".cubin"))
