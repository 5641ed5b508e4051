"""FA3-style attention backward for Hopper (sm_90) in Gluon: the builds the routing table picks.

One CTA owns a block of keys of one (batch, kv head); a TMA producer warp streams Q, dO, lse and delta of every
query block of the GQA group through a ring, and two consumer warpgroups compute S^T = K Q^T and dP^T = V dO^T,
then dV += P^T dO and dK += dS^T Q in registers (5 GEMMs per block pair; the Triton backward's two kernels need 7).
Three launches: ``_bwd_preprocess`` (delta, lse in base 2, the fp32 dQ workspace zeroed), the main kernel,
``_bwd_dq_convert``. ``"dq-reducer"`` (d = 64 / 128, ``_fa3_bwd_kernel``): dQ handed to a reducer warp that adds it
to the workspace by TMA reductions. ``"d256"`` (``_fa3_bwd_kernel_d256``): the warpgroups split queries and head
dim; the producer reduces the dQ tiles written into the slot's dead Q / dO bytes. Partition lists and argument
tuples are literals so that constexprs stay constexprs. ``gluon_bwd_supported`` names what it refuses; layouts and
measurements: ``docs/kernels.md``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .gluon_common import (
    GLUON_IMPORT_ERROR,
    LOG2E,
    TensorDescriptor,
    as_tma_box,
    common_reason,
    fence_async_shared,
    gl,
    gl_dtype,
    gluon,
    host_layout,
    mbarrier,
    qkv_reason,
    tma,
    tma_desc,
    tma_stride_reason,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M = 64          # query rows per step (ring slot)
WG_KEYS = 64          # keys per consumer warpgroup (d = 64 / 128)
BLOCK_N = 2 * WG_KEYS  # keys per CTA (d = 64 / 128)
_STAGES = {64: 4, 128: 2, 256: 2}  # ring depth per head dim
_MAXNREG = 168        # 12 warps x 32 threads x 168 = 64512 <= 65536 registers
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24   # the producer and the reducer warp share warpgroup 2's budget
_PRE_BLOCK = 64       # rows per preprocess / convert program (== BLOCK_M: the padding unit)
DQ_BUFFERS = 2        # dQ tiles in shared memory per warpgroup (d = 64 / 128)
D256_BLOCK_N = 64     # keys per CTA at d = 256
D256_HALF = 128       # head-dim columns of dK / dV / dQ per consumer warpgroup at d = 256
D256_QROWS = 32       # query rows of S^T / dP^T per consumer warpgroup at d = 256

if GLUON_IMPORT_ERROR is None:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as gluon_builtin

    @gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """``cp.reduce.async.bulk.tensor.<rank>d.global.shared::cta.add.bulk_group``: add the shared tile ``src``
        into the global box of ``tensor_desc`` at ``coord`` (element-wise adds done by the TMA unit in L2), then
        commit a bulk group; ``tma.store_wait(n)`` waits for its reads of ``src``. Gluon 3.6 exposes TMA loads and
        stores for Hopper but no reduce; its builder has the op (``create_async_tma_reduce``)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


# Triton-language helpers: preprocess (delta, lse2, zero dQ workspace) and dQ convert


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


# "dq-reducer" (d = 64 / 128)


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                  q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty,
                  b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES: gl.constexpr):
    # K and V of this CTA, once: two 64-row boxes each (one per consumer warpgroup), one barrier.
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + w * 64, 0], kv_bar, as_tma_box(k_smem.index(w), k_desc))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + w * 64, 0], kv_bar, as_tma_box(v_smem.index(w), v_desc))
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
                                            as_tma_box(q_smem.index(s), q_desc))
            tma.async_copy_global_to_shared(lse_desc, [row_base + m0], q_ready.index(s), lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), empty_phase)
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], do_ready.index(s),
                                            as_tma_box(do_smem.index(s), do_desc))
            tma.async_copy_global_to_shared(delta_desc, [row_base + m0], do_ready.index(s), delta_smem.index(s))
            it += 1


@gluon.constexpr_function
def _k_layout(head_dim, dtype, rank):
    """Shared layout of K (and of the dK TMA store staged in it), rank 2 (the tile) or 4 (the [1, 1, 64, d] TMA
    box). d = 128: the default [64, 128] layout (128-byte swizzle = two [64, 64] blocks, so warpgroup w's dQ column
    half K[:, 64 w..] is a whole block). d = 64: a 64-byte swizzle, two [64, 32] column blocks, for the same
    reason. S^T reads K as a K-major A operand either way."""
    if head_dim == 64:
        return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=dtype.primitive_bitwidth, rank=rank)
    return gl.NVMMASharedLayout.get_default_for([1] * (rank - 2) + [64, head_dim], dtype)


@gluon.jit
def _bwd_step(WG: gl.constexpr, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
              q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, qk_scale, diag_off,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
              s_layout: gl.constexpr, acc_layout: gl.constexpr, op_layout: gl.constexpr,
              dq_layout: gl.constexpr, dq_smem, dq_full, dq_empty, NB: gl.constexpr):
    """One query block against this warpgroup's 64 keys; dQ for columns WG * d/2 .. over all 128 keys of the CTA,
    handed to the reducer through ``dq_smem`` (guarded by ``dq_empty`` / ``dq_full``, NB buffers)."""
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
    # per-k-step wgmma descriptors are recomputed each step instead of being hoisted and kept live (spills).
    zero = it >> 30
    k_mine = k_smem.index(WG + zero)
    v_mine = v_smem.index(WG + zero)

    # ---- S^T = K_w Q^T and dP^T = V_w dO^T, two async groups
    mbarrier.wait(q_ready.index(s), ready_phase)
    st = warpgroup_mma(k_mine, q_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ready_phase)
    dpt = warpgroup_mma(v_mine, do_buf.permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    # ---- P^T as soon as S^T is back (dP^T may still run)
    st = warpgroup_mma_wait(num_outstanding=1, deps=[st])
    if MASKED:  # causal diagonal: key j visible to query i iff j <= i + (Sk - Sq)
        qpos = mb * 64 + gl.arange(0, 64, layout=col_layout)
        keep = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos + diag_off, 0)
        st = gl.where(keep, st, float("-inf"))
    lse2 = lse_smem.index(s).load(col_layout)      # lse * log2(e); +inf on empty / padded rows
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    # ---- dV += P^T dO right away (register A operand), in flight together with dP^T
    p16 = gl.convert_layout(pt.to(dtype), op_layout)
    dv = warpgroup_mma(p16, do_buf, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
    delta = delta_smem.index(s).load(col_layout)   # rowsum(dO * O); 0 on padded rows
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    ds16 = dst.to(dtype)
    # ---- dK += dS^T Q issued before the dS^T publication, so the publication runs under dV and dK
    d16 = gl.convert_layout(ds16, op_layout)
    dk = warpgroup_mma(d16, q_buf, dk, is_async=True)

    # ---- publish dS^T_w to the other warpgroup: ds_smem[2 p + WG] is free (the ds_bar wait of the previous step
    # implies the other warpgroup finished reading it two steps ago). store -> proxy fence -> barrier of this
    # warpgroup's 128 threads -> one arrive (release) on ds_bar[p] (count 2: one per warpgroup).
    ds_smem.index(2 * p + WG).store(ds16)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_bar.index(p), count=1)
    # Retire dV / dK before dQ: dK + dV + dQ_part and the register operands do not all fit in 240 registers.
    dv, dk, p16, d16 = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p16, d16])
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)

    # ---- dQ[:, WG half] = dS (all 128 keys) K[:, WG half]: both warpgroups' dS^T tiles must be in smem
    mbarrier.wait(ds_bar.index(p), ds_phase)
    dq = warpgroup_mma(ds_smem.index(2 * p).permute((1, 0)), k_smem.index(zero).slice(WG * HALF, HALF, dim=1),
                       gl.zeros([64, HALF], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 * p + 1).permute((1, 0)),
                       k_smem.index(1 + zero).slice(WG * HALF, HALF, dim=1), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])

    # ---- dQ_w -> dq_smem tile 2 b + WG (the reducer partition issues the global reductions)
    b = it % NB
    mbarrier.wait(dq_empty.index(b), ((it // NB) & 1) ^ 1)  # the first use of a buffer passes (parity 1)
    # [64 rows, HALF cols] -> (row // 8, col // 8, row % 8, col % 8): the order of the reducer's TMA box
    dq4 = gl.permute(gl.reshape(dq, [8, 8, HALF // 8, 8]), (0, 2, 1, 3))
    dq_smem.index(2 * b + WG).store(dq4)
    fence_async_shared()  # the TMA unit (async proxy) reads the tile
    gl.thread_barrier()   # the warpgroup's 128 threads' stores are done
    mbarrier.arrive(dq_full.index(b), count=1)
    return dk, dv


@gluon.jit
def _bwd_consumer(WG: gl.constexpr, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                  ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                  dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                  dk_desc, dv_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NB: gl.constexpr):
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
    it = 0
    for g in range(GROUP):
        # diagonal (masked) query blocks first, then the fully visible ones: the producer's order m_lo .. n_m-1
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                               q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, qk_scale, diag_off,
                               HEAD_DIM, STAGES, True, s_layout, acc_layout, op_layout, dq_layout, dq_smem,
                               dq_full, dq_empty, NB)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                               q_ready, q_empty, do_ready, do_empty, ds_bar, dk, dv, keys, qk_scale, diag_off,
                               HEAD_DIM, STAGES, False, s_layout, acc_layout, op_layout, dq_layout, dq_smem,
                               dq_full, dq_empty, NB)
            it += 1

    # ---- epilogue. The OTHER warpgroup's dQ wgmma reads this warpgroup's K_w until its last step: before K_w is
    # overwritten with dK, both warpgroups meet on end_bar (count 2, used once: parity 0).
    mbarrier.arrive(end_bar, count=1)
    mbarrier.wait(end_bar, 0)
    k_buf = k_smem.index(WG)
    dk = dk * (qk_scale * 0.6931471805599453)  # qk_scale = scale * log2(e)
    k_buf.store(dk.to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + WG * 64, 0], as_tma_box(k_buf, dk_desc))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + WG * 64, 0], as_tma_box(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _bwd_dq_reducer(dq_smem, dq_full, dq_empty, dq_desc, b, hk, H, GROUP, SQ_PAD, m_lo, n_m):
    """Per step: wait dq_full[buf]; one TMA reduce-add per column half (a [64, d / 2] tile = one box of
    ``dq_desc``, see ``_dq_tma_desc``); wait for the TMA unit's reads; release dq_empty[buf]. One flat loop over the
    (g, m) steps (the partition runs with 24 registers)."""
    NB: gl.constexpr = dq_smem.shape[0] // 2
    CHUNKS: gl.constexpr = dq_smem.shape[2]      # 8-column chunks per column half: 8 at d = 128, 4 at d = 64
    n_steps = n_m - m_lo
    for it in range(GROUP * n_steps):
        g = it // n_steps
        mb = m_lo + (it - g * n_steps)
        buf = it % NB
        mbarrier.wait(dq_full.index(buf), (it // NB) & 1)
        row8 = (b * H + hk * GROUP + g) * (SQ_PAD // 8) + mb * 8   # SQ_PAD is a multiple of 64
        _tma_reduce_add(dq_desc, [row8, 0, 0, 0], dq_smem.index(2 * buf))
        _tma_reduce_add(dq_desc, [row8, CHUNKS, 0, 0], dq_smem.index(2 * buf + 1))
        tma.store_wait(0)     # the TMA unit has read both tiles
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _fa3_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
                    qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, NB: gl.constexpr,
                    REDUCER_WARPS: gl.constexpr):
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
    k_layout: gl.constexpr = _k_layout(HEAD_DIM, dtype, 2)
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], tile_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], tile_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, 64, 64], ds_layout)  # [2 p + WG]: 2 buffers x 2 warpgroups
    # fp32 dQ tiles [2 b + WG], unswizzled "chunk-transposed" [row // 8, col // 8, row % 8, col % 8] = a TMA box
    dq_layout_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * NB, 8, HEAD_DIM // 16, 8, 8], dq_layout_s)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)  # one arrive per consumer warpgroup and use
    for i in gl.static_range(NB):
        mbarrier.init(dq_full.index(i), count=2)   # one arrive per consumer warpgroup
        mbarrier.init(dq_empty.index(i), count=1)  # the reducer
    mbarrier.init(end_bar, count=2)
    fence_async_shared()

    # A literal partition list and literal argument tuples (see the module docstring). The reducer warp(s) join
    # warpgroup 2 at the producer's register budget.
    gl.warp_specialize([
        (_bwd_consumer, (0, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                         dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                         dk_desc, dv_desc, HEAD_DIM, STAGES, NB)),
        (_bwd_consumer, (1, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                         dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                         dk_desc, dv_desc, HEAD_DIM, STAGES, NB)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                         q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                         kv_bar, q_ready, q_empty, do_ready, do_empty,
                         b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES)),
        (_bwd_dq_reducer, (dq_smem, dq_full, dq_empty, dq_desc, b, hk, H, GROUP, SQ_PAD, m_lo, n_m)),
    ], [4, 1, REDUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])  # default partition = consumer 0


# "d256": 64 keys per CTA; the warpgroups split the queries of S^T / dP^T and the head dim of dK / dV / dQ. Every
# shared tile is [rows, 128] (two 128-byte-swizzle [rows, 64] blocks); P^T and dS^T are exchanged through [64, 64]
# tiles with a 64-byte swizzle, two [64, 32] column blocks, one written by each warpgroup.


@gluon.jit
def _d256_reduce_slot(dq_desc, q_smem, do_smem, j, b, hk, H, GROUP, SQ_PAD, m_lo, n_m, STAGES: gl.constexpr):
    """TMA reduce-add of step j's two dQ tiles (warpgroup 0's in ring slot j % STAGES's Q bytes, warpgroup 1's in
    its dO bytes) into the workspace; the caller waits for the reads (``tma.store_wait``)."""
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
                       b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES: gl.constexpr, dq_desc):
    # K and V of this CTA, once: two [64, 128] column halves each, one barrier.
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0, c * 128], kv_bar, as_tma_box(k_smem.index(c), k_desc))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0, c * 128], kv_bar, as_tma_box(v_smem.index(c), v_desc))
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
            if it >= STAGES:  # slot s holds step it - STAGES's dQ tiles: reduce them, wait for the reads, refill
                _d256_reduce_slot(dq_desc, q_smem, do_smem, it - STAGES, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                                  STAGES)
                tma.store_wait(0)
            mbarrier.expect(q_ready.index(s), 4 * q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            for r in gl.static_range(2):
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(q_desc, [b, h, m0 + r * 32, c * 128], q_ready.index(s),
                                                    as_tma_box(q_smem.index(4 * s + 2 * r + c), q_desc))
            tma.async_copy_global_to_shared(lse_desc, [row_base + m0], q_ready.index(s), lse_smem.index(s))
            mbarrier.wait(do_empty.index(s), empty_phase)
            mbarrier.expect(do_ready.index(s), 4 * do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            for r in gl.static_range(2):
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(do_desc, [b, h, m0 + r * 32, c * 128], do_ready.index(s),
                                                    as_tma_box(do_smem.index(4 * s + 2 * r + c), do_desc))
            tma.async_copy_global_to_shared(delta_desc, [row_base + m0], do_ready.index(s), delta_smem.index(s))
            it += 1
    # the last STAGES steps' tiles (no refill follows them)
    for j in range(gl.maximum(it - STAGES, 0), it):
        mbarrier.wait(q_empty.index(j % STAGES), (j // STAGES) & 1)
        _d256_reduce_slot(dq_desc, q_smem, do_smem, j, b, hk, H, GROUP, SQ_PAD, m_lo, n_m, STAGES)
    tma.store_wait(0)


@gluon.jit
def _bwd_step_d256(WG: gl.constexpr, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                   ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, dk, dv, n0, qk_scale, diag_off,
                   STAGES: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr, acc_layout: gl.constexpr,
                   op_layout: gl.constexpr, dq_desc):
    """One 64-query block at d = 256 for consumer warpgroup WG: S^T / dP^T for queries 32 WG .. 32 WG + 31 (all 64
    keys, full d), dK / dV / dQ for columns 128 WG .. 128 WG + 127."""
    dtype: gl.constexpr = q_smem.dtype
    OTHER: gl.constexpr = 1 - WG
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)   # one value per query (column of S^T)
    # ``zero``: 0 but opaque to the compiler (see _bwd_step); added to the ring slot and the P^T / dS^T buffer
    # index as well, which took the causal build from 16 / 8 B of stack to 0.
    zero = it >> 30
    s = it % STAGES + zero
    ready_phase = (it // STAGES) & 1
    p = it % 2 + zero           # P^T / dS^T double buffer of this step
    x_phase = (it // 2) & 1     # use number of x_bar[p] = it // 2
    qt = 4 * s                  # Q / dO tile 4 s + 2 r + c: query rows 32 r.., columns 128 c..

    # ---- S^T_w = K Q_w^T and dP^T_w = V dO_w^T: [64 keys, 32 queries], d = 256 as two column halves
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
    # ---- publish dS^T_w: store -> proxy fence -> barrier of the warpgroup -> one arrive on x_bar[p] (count 2)
    ds_smem.index(p).slice(WG * 32, 32, dim=1).store(ds16)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(x_bar.index(p), count=1)
    # ---- the other warpgroup's P^T / dS^T halves: dV_w, dK_w over the other 32 queries (A from shared memory)
    mbarrier.wait(x_bar.index(p), x_phase)
    dv = warpgroup_mma(pt_smem.index(p).slice(OTHER * 32, 32, dim=1), do_smem.index(qt + 2 * OTHER + WG), dv,
                       is_async=True)
    dk = warpgroup_mma(ds_smem.index(p).slice(OTHER * 32, 32, dim=1), q_smem.index(qt + 2 * OTHER + WG), dk,
                       is_async=True)
    # Retire dV / dK (and their register operands) before the dQ accumulator: dK 64 + dV 64 + dQ 64 fp32 per thread.
    dv, dk, pa, da = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, pa, da])
    mbarrier.arrive(x_free.index(s), count=1)  # Q and dO of slot s: last read; they hold the dQ tiles next
    # ---- dQ[:, own columns] = dS K[:, own columns]: A = (dS^T)^T (transposed view of both halves), K = 64 keys
    dq = warpgroup_mma(ds_smem.index(p).permute((1, 0)), k_smem.index(WG + zero),
                       gl.zeros([64, 128], gl.float32, acc_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    # ---- dQ_w -> the dead Q (w = 0) / dO (w = 1) tiles of slot s; the producer reduce-adds them by TMA
    mbarrier.wait(x_free.index(s), ready_phase)   # both warpgroups are done reading Q / dO of slot s
    if WG == 0:
        dq_tile = q_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(s)
    else:
        dq_tile = do_smem._reinterpret(gl.float32, [STAGES, 8, 16, 8, 8], dq_desc.layout).index(s)
    # [64 rows, 128 cols] -> (row // 8, col // 8, row % 8, col % 8), as the d = 64 / 128 tiles
    dq_tile.store(gl.permute(gl.reshape(dq, [8, 8, 16, 8]), (0, 2, 1, 3)))
    fence_async_shared()     # generic-proxy stores -> the TMA unit's (async proxy) reads
    gl.thread_barrier()
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _bwd_consumer_d256(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                       kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, end_bar,
                       b, hk, n0, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                       dk_desc, dv_desc, dq_desc, STAGES: gl.constexpr):
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
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step_d256(WG, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                    ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, dk, dv, n0,
                                    qk_scale, diag_off, STAGES, True, s_layout, acc_layout, op_layout, dq_desc)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step_d256(WG, it, mb, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                    ds_smem, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, dk, dv, n0,
                                    qk_scale, diag_off, STAGES, False, s_layout, acc_layout, op_layout, dq_desc)
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
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0, WG * 128], as_tma_box(k_buf, dk_desc))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0, WG * 128], as_tma_box(v_buf, dv_desc))
    tma.store_wait(0)


@gluon.jit
def _fa3_bwd_kernel_d256(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
                         qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
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
    # per ring slot: both warpgroups done reading its Q / dO (their bytes then hold the dQ tiles)
    x_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)
        mbarrier.init(x_free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(x_bar.index(i), count=2)    # one arrive per consumer warpgroup and use
    mbarrier.init(end_bar, count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer_d256, (0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                              kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, end_bar,
                              b, hk, n0, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                              dk_desc, dv_desc, dq_desc, STAGES)),
        (_bwd_consumer_d256, (1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, pt_smem, ds_smem,
                              kv_bar, q_ready, q_empty, do_ready, do_empty, x_bar, x_free, end_bar,
                              b, hk, n0, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                              dk_desc, dv_desc, dq_desc, STAGES)),
        (_bwd_producer_d256, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                              q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                              kv_bar, q_ready, q_empty, do_ready, do_empty,
                              b, hk, n0, H, GROUP, SQ_PAD, m_lo, n_m, STAGES, dq_desc)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # default partition = consumer 0 (num_warps = 4)


# Host side


def gluon_bwd_supported(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_bwd`` can run these inputs, else a one-line reason (for a fallback decision)."""
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
    reason = common_reason(named, (torch.bfloat16, torch.float16), 9)
    if reason is not None:
        return reason
    if not isinstance(lse, torch.Tensor) or lse.device != q.device:
        return "lse is not a tensor on q's device"
    reason = qkv_reason(q, k, v, _STAGES, scale)
    if reason is not None:
        return reason
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    if out.shape != q.shape or dout.shape != q.shape:
        return f"out {tuple(out.shape)} / dout {tuple(dout.shape)} must match q {tuple(q.shape)}"
    if lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hq, Sq):
        return f"lse must be fp32 [B, Hq, Sq] = {(B, Hq, Sq)}, got {lse.dtype} {tuple(lse.shape)}"
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        r = tma_stride_reason(name, t)
        if r is not None:
            return r
    if B * Hq * (Sq + _PRE_BLOCK) >= 2 ** 31:
        return "B * Hq * Sq too large for the int32 lse / delta TMA coordinate"
    if B * Hkv > 65535 or B * Hq > 65535:
        return "B * H exceeds the grid's y limit (65535)"
    return None


def grad_strides_ok(*ts: torch.Tensor) -> bool:
    """Whether ``torch.empty_like(t)`` (the layout the op's fake implementation gives t's gradient) suits TMA for
    every t: last dim contiguous, the other strides multiples of 16 bytes. Strides read from a meta tensor (free)."""
    for t in ts:
        st = torch.empty_like(t, device="meta").stride()
        if st[-1] != 1 or any((x * t.element_size()) % 16 for x in st[:-1]):
            return False
    return True


def _vec_desc(t: torch.Tensor):
    return TensorDescriptor(t, [t.numel()], [1], [BLOCK_M], host_layout((BLOCK_M,), torch.float32))


@functools.lru_cache(maxsize=None)
def _dq_tma_layout():
    """Built once, as ``host_layout`` does for the other descriptors."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)


def _dq_tma_desc(dq_acc: torch.Tensor, D: int):
    """The flat fp32 dQ workspace ([rows, D] row-major, rows = B * Hq * SQ_PAD) viewed as [rows / 8, D / 8, 8, 8]
    with strides [8 D, 8, D, 1] (row // 8, col // 8, row % 8, col % 8), box [8, D / 16, 8, 8]: one box is one
    warpgroup's [64, D / 2] dQ tile in its chunk-transposed shared-memory order."""
    rows = dq_acc.numel() // D
    return TensorDescriptor(dq_acc, [rows // 8, D // 8, 8, 8], [8 * D, 8, D, 1], [8, D // 16, 8, 8],
                            _dq_tma_layout())


def gluon_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
                        checked: bool = False, grads_like_inputs: bool = False):
    """FA3-style backward -> (dq, dk, dv); ValueError when unsupported (``checked=True`` skips
    ``gluon_bwd_supported``). ``grads_like_inputs=True``: the gradients laid out like ``torch.empty_like`` of q / k /
    v (as the op's fake implementation promises), ValueError where those strides do not suit TMA."""
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
    # d = 256: 8 warps for the [64, 256] tiles of the preprocess / convert (4 spill)
    pre_warps = 8 if D == 256 else 4
    _bwd_preprocess[(n_m, B * Hq)](out, dout, lse, delta, lse2, dq_acc, *out.stride()[:3], *dout.stride()[:3],
                                   lse.stride(0), lse.stride(1), Hq, Sq, sq_pad, HEAD_DIM=D, BLOCK=_PRE_BLOCK,
                                   num_warps=pre_warps)
    regs = dict(CONSUMER_REGS=_CONSUMER_REGS, PRODUCER_REGS=_PRODUCER_REGS, num_warps=4, maxnreg=_MAXNREG)
    if D == 256:
        _fa3_bwd_kernel_d256[((Sk + D256_BLOCK_N - 1) // D256_BLOCK_N, B * Hkv)](
            tma_desc(q, D256_QROWS, D256_HALF), tma_desc(k, D256_BLOCK_N, D256_HALF),
            tma_desc(v, D256_BLOCK_N, D256_HALF), tma_desc(dout, D256_QROWS, D256_HALF),
            tma_desc(dk, D256_BLOCK_N, D256_HALF), tma_desc(dv, D256_BLOCK_N, D256_HALF),
            _vec_desc(lse2), _vec_desc(delta), _dq_tma_desc(dq_acc, D), sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk,
            sq_pad, STAGES=_STAGES[D], CAUSAL=bool(causal), **regs)
    else:
        k_layout = _k_layout(D, gl_dtype(k.dtype), 4)  # d = 64: 64-byte swizzle (K tile and dK staging)
        _fa3_bwd_kernel[((Sk + BLOCK_N - 1) // BLOCK_N, B * Hkv)](
            tma_desc(q, BLOCK_M), tma_desc(k, WG_KEYS, layout=k_layout), tma_desc(v, WG_KEYS), tma_desc(dout, BLOCK_M),
            tma_desc(dk, WG_KEYS, layout=k_layout), tma_desc(dv, WG_KEYS), _vec_desc(lse2), _vec_desc(delta),
            _dq_tma_desc(dq_acc, D), sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, sq_pad,
            HEAD_DIM=D, STAGES=_STAGES[D], CAUSAL=bool(causal), NB=DQ_BUFFERS, REDUCER_WARPS=1, **regs)
    _bwd_dq_convert[(n_m, B * Hq)](dq_acc, dq, *dq.stride()[:3], Hq, Sq, sq_pad, sm_scale,
                                   HEAD_DIM=D, BLOCK=_PRE_BLOCK, num_warps=pre_warps)
    return dq, dk, dv
