"""FA3-style attention forward for Hopper (sm_90) in Gluon: the builds the routing table picks.

``gl.warp_specialize`` splits a CTA into a TMA producer warp (a ring of K / V slots) and two (``"persistent3"``:
three) consumer warpgroups of 64 query rows, each software-pipelining its key loop (issue S_j, issue PV_{j-1} with P
in registers, wait until one group is in flight) so one warpgroup's softmax runs under the others' GEMMs.

Builds: ``"default"`` (d = 256, one CTA per 128-row tile); ``"persistent"`` (d = 64 / 128, at most one CTA per SM
looping over work items, FA3's step order, packed P cast); ``"persistent3"`` (d = 64, three consumers). Masking is a
compile-time variant of the step (a runtime branch with a wgmma in flight makes ptxas wait for all of them).
``gluon_supported`` names what a build refuses. Layouts, barriers, measurements: ``docs/kernels.md``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fxopt.kernels._common import num_sms as _device_sms

from .gluon_common import (
    LOG2E,
    as_tma_box,
    common_reason,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    qkv_reason,
    tma,
    tma_desc,
    tma_stride_reason,
    unmasked_blocks,
    warpgroup_mma,
    warpgroup_mma_wait,
)

WG_ROWS = 64  # query rows of one consumer warpgroup
# head dim -> (BLOCK_N, STAGES): fits 227 KB of shared memory and 240 registers per consumer thread without spills
_CONFIGS = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
_MAXNREG = 168  # 12 warps x 32 threads x 168 = 64512 <= 65536 registers
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24
# "persistent3": 13 warps round up to 16 (4 warpgroups), so the launch's maxnreg is 65536 / 512 = 128;
# setmaxnreg then gives the consumer warpgroups 160 (168 for the default partition) and the producer 24.
_WG3_STAGES = 3
_WG3_MAXNREG = 128
_WG3_CONSUMER_REGS = 160
# The persistent builds need two Q buffers per warpgroup next to the ring: d = 256 does not fit in shared memory.
_PERSISTENT_HEAD_DIMS = (64, 128)
_WG3_HEAD_DIMS = (64,)
VARIANTS = ("default", "persistent", "persistent3")


# Device code shared by the builds


@gluon.jit
def _fa_mask(s, n0, rows, SEQ_K, diag_off, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    # key columns >= Sk and (causal) columns right of the bottom-right aligned diagonal -> -inf
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        # the Sk bound folded into each row's last visible column: one compare and one select per element
        last = gl.minimum(rows + diag_off, SEQ_K - 1)
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(last, 1)
    else:
        keep = gl.expand_dims(cols < SEQ_K, 0)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _fa_softmax(s, m_i, l_i, qk_scale):
    """One online-softmax step on (masked) raw scores s [ROWS, BLOCK_N] -> (p fp32, new running max in raw units,
    new row sum, alpha = rescale factor of the old O)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # A row with no visible key so far keeps m = -inf: use 0 as the offset so exp2 sees -inf (-> 0), not NaN.
    m_off = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    alpha = gl.exp2(m_i * qk_scale - m_off)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_off, 1))  # one FFMA + MUFU.EX2 per score
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _fa_p16(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """fp32 P -> 16-bit wgmma A operand with one packed ``cvt.rn.{bf16x2,f16x2}.f32`` per element pair (inline PTX:
    the same rounding as ``p.to(dtype)``, but LLVM cannot split it into scalar casts, which ptxas then re-paired
    with 32 PRMT half-swaps per step)."""
    if dtype == gl.bfloat16:
        p16 = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                        is_pure=True, pack=2)
    else:
        p16 = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                        is_pure=True, pack=2)
    return gl.convert_layout(p16, p_layout)


# "default" (d = 256): one CTA per query tile


@gluon.jit
def _fa_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 b, h, hk, m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    # Q: one 64-row box per consumer warpgroup, each on its own barrier.
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_bars.index(w),
                                        as_tma_box(q_smem.index(w), q_desc))
    # K_j, V_j into slot j % STAGES. Fill number u = j // STAGES of a slot waits until both consumers released
    # use u - 1 (parity (u & 1) ^ 1; u = 0 passes at once on a fresh barrier).
    for j in range(n_blocks):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s),
                                        as_tma_box(k_smem.index(s), k_desc))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s),
                                        as_tma_box(v_smem.index(s), v_desc))


@gluon.jit
def _fa_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, m_i, l_i,
             rows, SEQ_K, diag_off, qk_scale,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
             s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr):
    """Key block i >= 1: S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued back to back; wait for S_i only; softmax_i
    runs while PV_{i-1} is on the tensor cores; then wait for PV_{i-1}, rescale O, P_i becomes the next A operand.
    Straight-line from the first issue to the last wait (see the module docstring)."""
    dtype: gl.constexpr = q_buf.dtype
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    jv = i - 1
    vs = jv % STAGES
    mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
    o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
    # wgmma groups retire in order: <= 1 outstanding means S_i is done (PV_{i-1} may still run)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _fa_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale)
    # PV_{i-1} must finish before O is rescaled and before P_{i-1}'s registers are reused (p16 in deps keeps
    # them alive in the LLVM IR until here).
    o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
    mbarrier.arrive(v_empty.index(vs), count=1)
    o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    p16 = gl.convert_layout(p.to(dtype), p_layout)
    return s, o, p16, m_i, l_i


@gluon.jit
def _fa_consumer(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    # wgmma accumulator layouts of one warpgroup (4 warps along M, m64nNk16 instructions).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    row_first = m0 + WG * ROWS
    rows = row_first + gl.arange(0, ROWS, layout=row_layout)
    diag_off = SEQ_K - SEQ_Q
    n_full = unmasked_blocks(row_first, diag_off, SEQ_K, n_blocks, BLOCK_N, CAUSAL)

    q_buf = q_smem.index(WG)
    mbarrier.wait(q_bars.index(WG), 0)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # ---- block 0: S_0 = Q K_0^T, softmax -> P_0 (no PV in flight yet, so a runtime branch is harmless here)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        s = _fa_mask(s, 0, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale)
    p16 = gl.convert_layout(p.to(dtype), p_layout)

    # ---- steady state: unmasked blocks 1 .. n_full-1, then masked blocks up to n_blocks-1
    for i in range(1, n_full):
        s, o, p16, m_i, l_i = _fa_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16,
                                       m_i, l_i, rows, SEQ_K, diag_off, qk_scale, BLOCK_N, STAGES, CAUSAL, False,
                                       s_layout, p_layout, orow_layout)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        s, o, p16, m_i, l_i = _fa_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16,
                                       m_i, l_i, rows, SEQ_K, diag_off, qk_scale, BLOCK_N, STAGES, CAUSAL, True,
                                       s_layout, p_layout, orow_layout)

    # ---- tail: O += P_{n-1} V_{n-1}
    jv = n_blocks - 1
    vs = jv % STAGES
    mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
    o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
    o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
    mbarrier.arrive(v_empty.index(vs), count=1)

    # ---- epilogue: O / l (0 for empty rows), natural-log lse (+inf for empty rows)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, orow_layout), 1)
    lse = gl.where(empty, float("inf"), (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(lse_ptr + bh.to(gl.int64) * SEQ_Q + rows, lse, mask=rows < SEQ_Q)
    # Q is dead (every QK^T wgmma was waited for): stage O in the same buffer, TMA-store it (rows >= Sq clipped).
    q_buf.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], as_tma_box(q_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _fa3_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:  # the longest rows (most key blocks) first
        pid_m = NUM_M_BLOCKS - 1 - pid_m
    b = bh // H
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * (2 * ROWS)

    # Key blocks this CTA visits (both consumers walk all of them).
    hi = SEQ_K
    if CAUSAL:
        hi = gl.minimum(SEQ_K, m0 + 2 * ROWS + (SEQ_K - SEQ_Q))
    # At least one block, so the pipeline is never empty; rows that see no key there are masked to l = 0.
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
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
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # make the initialised barriers visible to the async proxy (TMA) before first use

    # Argument tuples are written inline: assigning them to a variable first would turn the constexprs into
    # int32 tensors (Triton's assignment rule), and the layouts inside the partitions need them constant.
    gl.warp_specialize([
        (_fa_consumer, (0, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                        lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
        (_fa_consumer, (1, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                        lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
        (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                        v_empty, b, h, hk, m0, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# "persistent" / "persistent3": one CTA per SM looping over work items


@gluon.jit
def _fa_step_overlap(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                     pin_buf, rows, SEQ_K, diag_off, qk_scale,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                     s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr,
                     PIN_PV: gl.constexpr):
    """Key block i >= 1 in FA3's order: issue S_i = Q K_i^T; O *= alpha_{i-1} (the rescale owed by the previous
    softmax, while S_i runs); issue O += P_{i-1} V_{i-1}; wait for S_i; softmax_i; (``PIN_PV``) store the new row sum
    to the warpgroup's ``pin_buf`` (never read); wait for PV_{i-1}; P_i = packed 16-bit copy of p. Returns alpha_i.

    The store keeps PV_{i-1} in flight across the exp2s: ptxas otherwise hoists ``WARPGROUP.DEPBAR.LE gsb0, 0x0``
    right behind the row max, but not above a shared-memory store that depends on every exp2 of the step."""
    dtype: gl.constexpr = q_buf.dtype
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    jv = i - 1
    vs = jv % STAGES
    mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
    o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _fa_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale)
    if PIN_PV:
        pin_buf.store(l_i)
    o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
    mbarrier.arrive(v_empty.index(vs), count=1)
    p16 = _fa_p16(p, dtype, p_layout)
    return s, o, p16, alpha, m_i, l_i


@gluon.jit
def _fa_sched_count(pid, P, T, SCHED: gl.constexpr):
    """Work items of CTA ``pid`` (of P) out of T = NUM_M_BLOCKS * NUM_BH under schedule SCHED (_fa_sched_item)."""
    if SCHED == 1:  # pairs: CTA pid owns units c = pid + k P (items 2c, 2c + 1); the odd last item is unit T // 2
        half = T // 2
        n = 2 * ((gl.maximum(half - pid, 0) + P - 1) // P)
        n += ((T % 2 == 1) & (half % P == pid)).to(gl.int32)
    else:  # stride: items pid, pid + P, ...
        n = (gl.maximum(T - pid, 0) + P - 1) // P
    return n


@gluon.jit
def _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch * head, query block) of CTA pid's t-th work item; every partition calls this with the same values.

    SCHED 0: items heads-major (consecutive CTAs share a head's K / V in L2), CTA pid takes pid, pid + P, ...;
    causal: the query blocks of a head longest first. SCHED 1 (causal): the blocks of a head in zigzag order
    num_m - 1, 0, num_m - 2, 1, ... and a CTA takes two consecutive items at a time, so every unit (a long and the
    matching short block) has about the same number of key blocks."""
    if SCHED == 1:
        x = 2 * (pid + (t // 2) * P) + t % 2
        bh = x // NUM_M_BLOCKS
        j = x % NUM_M_BLOCKS
        pid_m = j // 2
        if j % 2 == 0:
            pid_m = NUM_M_BLOCKS - 1 - j // 2
    else:
        x = pid + t * P
        bh = x // NUM_M_BLOCKS
        pid_m = x % NUM_M_BLOCKS
        if CAUSAL:
            pid_m = NUM_M_BLOCKS - 1 - pid_m
    return bh, pid_m


@gluon.jit
def _fa_tile_blocks(m0, SEQ_Q, SEQ_K, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    # key blocks of the query tile at row m0 (as in _fa3_fwd_kernel): at least one, so the pipeline never empties
    hi = SEQ_K
    if CAUSAL:
        hi = gl.minimum(SEQ_K, m0 + TILE_M + (SEQ_K - SEQ_Q))
    return gl.maximum(gl.cdiv(hi, BLOCK_N), 1)


@gluon.jit
def _fa_producer_persistent(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, pid, P, n_local, H, GROUP, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            SCHED: gl.constexpr, NUM_WG: gl.constexpr = 2):
    """One warp. Item t: Q of every consumer warpgroup into Q buffer t % 2 (use t // 2 of that buffer), then
    K_j / V_j of the item through the ring with the CTA-wide block counter g (slot g % STAGES, use g // STAGES). It
    runs ahead into item t + 1 as soon as buffers / slots are released, i.e. while the consumers finish item t."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    g0 = 0
    for t in range(n_local):
        bh, pid_m = _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED, CAUSAL)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        m0 = pid_m * (NUM_WG * ROWS)
        n_blocks = _fa_tile_blocks(m0, SEQ_Q, SEQ_K, NUM_WG * ROWS, BLOCK_N, CAUSAL)
        qb = t % 2
        # use u = t // 2 of Q buffer qb waits until consumer w released use u - 1 (item t - 2)
        q_phase = ((t // 2) & 1) ^ 1
        for w in gl.static_range(NUM_WG):
            mbarrier.wait(q_empty.index(NUM_WG * qb + w), q_phase)
            mbarrier.expect(q_ready.index(NUM_WG * qb + w), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_ready.index(NUM_WG * qb + w),
                                            as_tma_box(q_smem.index(NUM_WG * qb + w), q_desc))
        for g in range(g0, g0 + n_blocks):
            s = g % STAGES
            empty_phase = ((g // STAGES) & 1) ^ 1
            n0 = (g - g0) * BLOCK_N
            mbarrier.wait(k_empty.index(s), empty_phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], k_ready.index(s),
                                            as_tma_box(k_smem.index(s), k_desc))
            mbarrier.wait(v_empty.index(s), empty_phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], v_ready.index(s),
                                            as_tma_box(v_smem.index(s), v_desc))
        g0 += n_blocks


@gluon.jit
def _fa_consumer_persistent(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                            qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                            NUM_WG: gl.constexpr = 2):
    """Consumer warpgroup WG (of NUM_WG) of the persistent kernel: per item block 0, the unmasked and masked loops
    of ``_fa_step_overlap``, the tail and the epilogue, with the ring position offset by the CTA-wide block counter
    g0. Q comes from buffer t % 2; the O tile is staged in that buffer and its TMA store is not waited for in the
    epilogue: item t + 1 waits for it and then hands the buffer back to the producer (``q_empty``)."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    diag_off = SEQ_K - SEQ_Q
    pin_buf = pin.index(WG)
    PIN_PV: gl.constexpr = NUM_WG == 2
    g0 = 0  # ring position (CTA-wide key-block counter) of the item's block 0
    for t in range(n_local):
        bh, pid_m = _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED, CAUSAL)
        b = bh // H
        h = bh % H
        m0 = pid_m * (NUM_WG * ROWS)
        n_blocks = _fa_tile_blocks(m0, SEQ_Q, SEQ_K, NUM_WG * ROWS, BLOCK_N, CAUSAL)
        row_first = m0 + WG * ROWS
        rows = row_first + gl.arange(0, ROWS, layout=row_layout)
        n_full = unmasked_blocks(row_first, diag_off, SEQ_K, n_blocks, BLOCK_N, CAUSAL)

        qb = t % 2
        q_buf = q_smem.index(NUM_WG * qb + WG)
        mbarrier.wait(q_ready.index(NUM_WG * qb + WG), (t // 2) & 1)

        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

        # ---- block 0 (ring position g0)
        ks0 = g0 % STAGES
        mbarrier.wait(k_ready.index(ks0), (g0 // STAGES) & 1)
        s = warpgroup_mma(q_buf, k_smem.index(ks0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        mbarrier.arrive(k_empty.index(ks0), count=1)
        # Every mask of the item sees its key columns shifted by g0 * BLOCK_N (the steps take the ring position as
        # their block index), Sk and the diagonal offset shifted by the same amount: the same comparisons. For
        # block 0 the shift also keeps LLVM from hoisting its item-invariant predicates out of the item loop.
        seq_k_sh = SEQ_K + g0 * BLOCK_N
        diag_sh = diag_off + g0 * BLOCK_N
        if n_full == 0:
            s = _fa_mask(s, g0 * BLOCK_N, rows, seq_k_sh, diag_sh, BLOCK_N, CAUSAL, s_layout)
        p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale)
        p16 = _fa_p16(p, dtype, p_layout)

        # ---- item t - 1's O store (from the other Q buffer) has read its shared memory: give that buffer back to
        # the producer (item t + 1's Q). Nothing is outstanding for t = 0 and the arrive is skipped then.
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(NUM_WG * (1 - qb) + WG), count=1, pred=t > 0)

        # ---- key blocks 1 .. n_blocks - 1 at ring positions g0 + 1 .. g0 + n_blocks - 1
        for i in range(g0 + 1, g0 + n_full):
            s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                pin_buf, rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout, p_layout,
                orow_layout, PIN_PV)
        for i in range(g0 + gl.maximum(n_full, 1), g0 + n_blocks):
            s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i, pin_buf,
                rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, True, s_layout, p_layout, orow_layout,
                PIN_PV)
        # ---- tail: O = O * alpha_{n-1} + P_{n-1} V_{n-1}
        jv = g0 + n_blocks - 1
        vs = jv % STAGES
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
        o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
        o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
        mbarrier.arrive(v_empty.index(vs), count=1)
        g0 += n_blocks

        # ---- epilogue (as _fa_consumer's), the TMA store left in flight
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, orow_layout), 1)
        if WRITE_LSE:
            lse = gl.where(empty, float("inf"), (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453)
            # row offset bh * Sq in 64 bits, zero-extended (both >= 0): a sign-extended Sq's high word is
            # item-invariant, LLVM hoists it and ptxas spilled it
            lse_row = bh.to(gl.uint32).to(gl.int64) * SEQ_Q.to(gl.uint32).to(gl.int64)
            gl.store(lse_ptr + lse_row + rows, lse, mask=rows < SEQ_Q)
        q_buf.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], as_tma_box(q_buf, o_desc))
    tma.store_wait(0)


# No value specialization of the runtime ints (Triton would make a 1 a constant and mark multiples of 16) or of
# lse_ptr's alignment: one build per constexpr set.
@gluon.jit(do_not_specialize=["lse_ptr", "H", "GROUP", "SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "NUM_BH"])
def _fa3_fwd_persistent_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, SEQ_Q, SEQ_K,
                               NUM_M_BLOCKS, NUM_BH, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                               NUM_WG: gl.constexpr = 2):
    """Grid (P,), P <= number of SMs; CTA pid runs the work items ``_fa_sched_item(t, pid, ...)`` for
    t < ``_fa_sched_count(...)``. Shared memory: two Q buffers per consumer warpgroup, the K / V ring, the pin
    slots. NUM_WG = 3: three consumer warpgroups (a 192-row query tile per item)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    n_local = _fa_sched_count(pid, P, NUM_M_BLOCKS * NUM_BH, SCHED)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    # index NUM_WG * buffer + warpgroup
    q_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG, ROWS, HEAD_DIM], tile_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)  # the producer's expect-arrive + TMA bytes
        mbarrier.init(q_empty.index(i), count=1)  # the one consumer warpgroup that reads this buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    fence_async_shared()
    pin = gl.allocate_shared_memory(gl.float32, [NUM_WG, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if NUM_WG == 3:
        # consumer warpgroups 0 (default partition), 1, 2 and the producer warp: 13 warps, 16 after rounding
        gl.warp_specialize([
            (_fa_consumer_persistent, (0, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                       WRITE_LSE, NUM_WG)),
            (_fa_consumer_persistent, (1, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                       WRITE_LSE, NUM_WG)),
            (_fa_consumer_persistent, (2, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                       WRITE_LSE, NUM_WG)),
            (_fa_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                       k_empty, v_ready, v_empty, pid, P, n_local, H, GROUP, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, BLOCK_N, STAGES, CAUSAL, SCHED, NUM_WG)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_fa_consumer_persistent, (0, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                       WRITE_LSE, 2)),
            (_fa_consumer_persistent, (1, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                       WRITE_LSE, 2)),
            (_fa_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                       k_empty, v_ready, v_empty, pid, P, n_local, H, GROUP, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, BLOCK_N, STAGES, CAUSAL, SCHED)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Host side


def config_for(head_dim: int, variant: str = "default") -> dict:
    """Kernel meta-parameters of a build at a head dim; ValueError for an unknown variant or head dim."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (one of {VARIANTS})")
    if head_dim not in _CONFIGS:
        raise ValueError(f"head dim {head_dim} not supported (only {sorted(_CONFIGS)})")
    reason = _variant_dim_reason(variant, head_dim)
    if reason is not None:
        raise ValueError(reason)
    block_n, stages = _CONFIGS[head_dim]
    cfg = dict(BLOCK_N=block_n, STAGES=stages, num_warps=4, maxnreg=_MAXNREG, CONSUMER_REGS=_CONSUMER_REGS,
               PRODUCER_REGS=_PRODUCER_REGS, NUM_WG=2)
    if variant == "persistent3":
        cfg.update(STAGES=_WG3_STAGES, NUM_WG=3, maxnreg=_WG3_MAXNREG, CONSUMER_REGS=_WG3_CONSUMER_REGS)
    return cfg


def _variant_dim_reason(variant: str, head_dim: int) -> Optional[str]:
    if variant == "persistent3" and head_dim not in _WG3_HEAD_DIMS:
        return (f"variant 'persistent3' supports head dim 64 only, not {head_dim}: at {_WG3_CONSUMER_REGS} "
                f"registers per consumer thread the O accumulator, S tile and P of a larger head dim do not fit")
    if variant != "default" and head_dim not in _PERSISTENT_HEAD_DIMS:
        return (f"variant {variant!r} supports head dims {_PERSISTENT_HEAD_DIMS}, not {head_dim}: its two Q buffers "
                f"per consumer warpgroup and the K / V ring do not fit in 227 KB of shared memory")
    return None


def rows_per_item(variant: str = "default") -> int:
    """Query rows per CTA tile / work item: 3 x 64 for "persistent3", else 2 x 64."""
    return (3 if variant == "persistent3" else 2) * WG_ROWS


def persistent_schedule(num_m: int, num_bh: int, causal: bool, sms: int):
    """(SCHED, grid size P) of a persistent launch over num_m query tiles x num_bh heads on ``sms`` SMs:
    causal with more items than SMs: zigzag pairs (SCHED 1, P = min(sms, ceil(T / 2))); otherwise stride (0)."""
    T = num_m * num_bh
    sched = 1 if causal and T > sms else 0
    units = (T + 1) // 2 if sched == 1 else T
    return sched, max(1, min(sms, units))


def gluon_supported(q, k, v, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_fwd`` can run these inputs, else a one-line reason (for a fallback decision)."""
    reason = common_reason((("q", q), ("k", k), ("v", v)), (torch.bfloat16, torch.float16), 9) or \
        qkv_reason(q, k, v, _CONFIGS, scale)
    if reason is not None:
        return reason
    for name, t in (("q", q), ("k", k), ("v", v)):
        r = tma_stride_reason(name, t)
        if r is not None:
            return r
    B, Hq = q.shape[:2]
    if B * Hq > 65535:
        return f"B * Hq = {B * Hq} exceeds the grid's y limit (65535)"
    return None


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None, checked: bool = False, variant: str = "default",
                        num_sms: Optional[int] = None):
    """FA3-style forward. q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] -> (out like q, lse fp32 [B, Hq, Sq], natural
    log, +inf for rows with no visible key); ValueError when unsupported. ``out`` / ``lse``: buffers to write.
    ``checked=True`` skips ``gluon_supported``. ``num_sms``: the persistent grid's bound (small values force many
    items per CTA)."""
    if variant not in VARIANTS:
        raise ValueError(f"gluon_attention_fwd: unknown variant {variant!r} (one of {VARIANTS})")
    persistent = variant != "default"
    if num_sms is not None and (not persistent or int(num_sms) < 1):
        raise ValueError(f"gluon_attention_fwd: num_sms={num_sms} needs a persistent variant and a value >= 1")
    reason = None if checked else gluon_supported(q, k, v, causal, scale)
    if reason is None and out is not None:
        reason = tma_stride_reason("out", out) if out.shape == q.shape and out.dtype == q.dtype else \
            f"out {tuple(out.shape)} {out.dtype} does not match q {tuple(q.shape)} {q.dtype}"
    if reason is None:
        reason = _variant_dim_reason(variant, q.shape[-1])
    if reason is not None:
        raise ValueError(f"gluon_attention_fwd: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty((B, Hq, Sq, D), device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if B * Hq * Sq == 0:
        return out, lse
    if Sk == 0:
        out.zero_()
        lse.fill_(float("inf"))
        return out, lse
    cfg = config_for(D, variant)
    num_m = (Sq + rows_per_item(variant) - 1) // rows_per_item(variant)  # not triton.cdiv: slow on the host
    q_desc, o_desc = tma_desc(q, WG_ROWS), tma_desc(out, WG_ROWS)
    k_desc, v_desc = tma_desc(k, cfg["BLOCK_N"]), tma_desc(v, cfg["BLOCK_N"])
    if persistent:
        sched, n_cta = persistent_schedule(num_m, B * Hq, bool(causal), int(num_sms or _device_sms(q.device)))
        # the ring counter g (and the masks' column shift g * BLOCK_N) grows over a CTA's items: keep it in int32
        max_items = (num_m * B * Hq) // n_cta + 3
        if (num_m * B * Hq >= 2 ** 30
                or max_items * ((Sk + cfg["BLOCK_N"] - 1) // cfg["BLOCK_N"] + 1) * cfg["BLOCK_N"] + Sk >= 2 ** 31):
            raise ValueError(f"gluon_attention_fwd: variant {variant!r}: {num_m * B * Hq} work items, up to "
                             f"{max_items} of Sk = {Sk} per CTA, overflow its int32 item index / key-block counter")
        _fa3_fwd_persistent_kernel[(n_cta,)](
            q_desc, k_desc, v_desc, o_desc, lse, sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, num_m, B * Hq,
            HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], CAUSAL=bool(causal),
            CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"], SCHED=sched,
            WRITE_LSE=True, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
            **({"NUM_WG": cfg["NUM_WG"]} if cfg["NUM_WG"] != 2 else {}))
        return out, lse
    _fa3_fwd_kernel[(num_m, B * Hq)](q_desc, k_desc, v_desc, o_desc, lse, sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk,
                                     num_m, HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"],
                                     CAUSAL=bool(causal), CONSUMER_REGS=cfg["CONSUMER_REGS"],
                                     PRODUCER_REGS=cfg["PRODUCER_REGS"], num_warps=cfg["num_warps"],
                                     maxnreg=cfg["maxnreg"])
    return out, lse
