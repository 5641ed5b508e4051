"""Gluon attention backward at d = 128 with FA3's dQ path: dQ through shared memory, global reductions by a reducer.

The op's backward at d = 128 since session 11 (``attention._GLUON_BWD_DQW_DIMS``; ``FXOPT_ATTN_GLUON_BWD_DQW=0`` turns it
off): correct on the H200 (12 GPU tests, dK / dV bit-identical to variant 3) and 1.05-1.07x variant 3, after the
ablations put the dQ global reductions at 30-34% of the step. Everything not listed here is variant 3 of
``attention_gluon_bwd`` (``_fa3_bwd_kernel_v1`` with ``EARLY_DK``): same producer, preprocess, convert, tiles, ring,
dS^T exchange (``ds_bar``), end_bar and epilogue; the consumer's order of wgmma, waits and arrives is unchanged up to
the dQ wgmma's ``wait(0)``.

Why
---
Session 10/11 (docs/notes_attention_bwd_issue_session10.md): variant 3 is neither issue- nor throughput-bound (tensor
cores ~45%, shared-memory port ~45%, issue ~15% of the measured step). One suspect for the unexplained half of the
step is the ``MEMBAR.ALL.CTA`` of the proxy fence after the dS^T store, which may wait until the warp's previous
step's 16 ``REDG.F32x2`` dQ reductions are acknowledged by L2 (1.4 TB/s of fp32 reductions over the chip). FA3 keeps
global reductions off the MMA warps: the consumers write dQ to shared memory and a separate warp reduces it into the
fp32 workspace. This kernel does the same with per-thread ``red.global.add.v4.f32`` (Gluon 3.6 exposes no TMA
reduce for Hopper; a ``cp.reduce.async.bulk.tensor`` by inline PTX would be the next step).

What changes against variant 3 (``_fa3_bwd_kernel_dqw``)
------------------------------------------------------
* shared memory: ``dq_smem`` fp32 [NB * 2, 8, 8, 8, 8]: buffer b, column half w (written by consumer warpgroup w)
  is tile 2 b + w (a [64, 64] fp32 tile, 16 KB, in the "chunk-transposed" order below); NB = ``DQ_BUFFERS`` = 2
  (double buffer): 165,328 + 65,536 + barriers = 230,960 B of 232,448.
* barriers ``dq_full[b]`` (count 2: one arrive per consumer warpgroup) and ``dq_empty[b]`` (count 1: the reducer).
* consumer warpgroup w, step ``it``, after the dQ wgmma's ``wait(0)`` (where variant 3 issues its 16 REDG):
  b = it % NB, u = it // NB; wait ``dq_empty[b]`` with parity (u & 1) ^ 1 (the first use passes on a fresh
  barrier); store dQ_w (64 x 64 fp32 in the wgmma accumulator layout: 16 STS.64 per thread, one address register
  plus immediates) into tile 2 b + w; ``thread_barrier`` (the 128 threads' stores are done); one arrive on
  ``dq_full[b]``. No proxy fence: the reducer reads with ordinary loads (generic proxy; the mbarrier arrive / wait
  pair is a release / acquire). Everything before is variant 3's step, statement for statement.
* reducer partition (``_bwd_dq_reducer``: ``REDUCER_WARPS`` = 1 warp, ``REDUCER_REGS`` = 24 registers, the
  producer's budget; both sit in warpgroup 2: 4 + 4 + 1 + 1 = 10 warps, 12 with the pad, as variant 3's 9 + 3 idle,
  so the consumers keep 240 registers each). One flat loop over the same (g, m) steps; per step: wait
  ``dq_full[b]`` with parity u & 1; for each column half w and each 8-row group: load the group's 8 x 64 fp32 (one
  LDS.128 per 4 columns) and issue one ``red.global.add.v4.f32`` per 4 columns (``_red_add_v4``, SASS
  REDG.E.ADD.F32x4) into the workspace rows m0 .. m0 + 63; then ``thread_barrier`` (its loads have returned: their
  values were consumed by the reductions) and one arrive on ``dq_empty[b]``. Per step 64 LDS.128 + 64 RED.v4 warp
  instructions (2048 16-byte reductions) against variant 3's 16 REDG.F32x2 per consumer warp (128 warp
  instructions, 4096 8-byte reductions): the same 32 KB per step, half the reduction instructions.
  Offline, 2 reducer warps with 32 registers each made Triton give consumer warpgroup 0 only 232 registers
  (setmaxnreg 0xe8) and left 2 spill slots in the reducer loop; 1 warp at 24 registers keeps variant 3's split.

Bank conflicts of the fp32 tile (the "chunk-transposed" order)
--------------------------------------------------------------
A [64, 64] fp32 tile row-major has 256-byte rows, so every row starts at bank 0. The consumer's STS.64 from the
wgmma accumulator layout writes, per warp instruction, 8 rows x 4 column pairs (8 consecutive columns = 32 B of each
row), served as two half-warp wavefronts of 4 rows x 32 B: row-major, those 4 rows hit the same 8 banks (4-way
conflict). Padding (8 floats per row) fixes it but costs 2 KB per tile: two buffers would no longer fit. An XOR
swizzle of the 32-byte chunks by row % 8 (``SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8)``) is
conflict-free but makes each of the 8 chunk addresses a separate register (j ^ x, x per thread): ptxas hoisted the
8 address registers out of the step loop and the consumer loop of warpgroup 1 spilled (6 LDL / STL per step, STACK
56 B in the full build; tried first). Used instead: the tile is stored as [row // 8, col // 8, row % 8, col % 8]
(register side: ``gl.permute(gl.reshape(dq, [8, 8, 8, 8]), (0, 2, 1, 3))``, a relabelling, no data movement; smem
side an unswizzled row-major 4-D layout). A wavefront's 4 consecutive rows of one 8-column chunk are then 4
consecutive 32-byte blocks = 128 B = all 32 banks once (conflict-free), and every store address is one register
plus an immediate (chunk j: + 256 j B, rows + 8: + 2048 B). The reducer reads [1, 8, 8, 8] slices (one 8-row group):
lanes 0-7 read rows r .. r + 3 of one chunk, 2 x 16 B each = 128 B contiguous (conflict-free LDS.128), and each
thread's 4 values are 4 consecutive columns of one row (one v4 reduction, 16-byte aligned).

Protocol (``dqw_protocol_model`` / ``check_dqw_protocol``; planted bugs ``DQW_BUGS``)
--------------------------------------------------------------------------------
Deadlock freedom: the consumer's dq_empty wait for use u of buffer b needs the reducer's release of use u - 1, which
needs dq_full of use u - 1 (both consumers' arrives of step it - NB, issued before this wait in program order) and
nothing else. No phase is skipped: dq_full[b] use u + 1 needs an arrive that follows (in each consumer's program
order) its dq_empty wait for use u + 1, which needs the reducer's release of use u, which follows its dq_full wait
for use u. Likewise dq_empty use u + 1 follows the reducer's dq_full wait for use u + 1, which needs the consumers'
arrives after their dq_empty wait of use u + 1 (the wait for the release of use u). The reducer never blocks the
consumers' other barriers, so variant 3's argument for the ring, ds_bar and end_bar is unchanged.

Offline build (Triton 3.6, ptxas 12.8, sm_90a; bf16 = fp16; ``compile_offline``; census ``dqw_step_model``)
------------------------------------------------------------------------------------------------------------
      build    STACK  spill st/ld  smem (B)  C75xx  hazards  consumer step loops        reducer  producer
      full       8      8 / 8      230,960    -       0      402 / 399, 0 LDL/STL       244 (1 LDL)   76
      causal    40     76 / 56     230,960    -       0      570 / 402 / 567 / 398, 0   252 (1 LDL)   76
      (variant 3: full 8 B stack, 8 / 8; causal 56 B, 84 B spill stores; step loops 405 / 391 and 580-595 / 408-423)

  Per consumer step loop: 24 SS + 8 RS HGMMA, 32 MUFU.EX2, no REDG (variant 3: 16 REDG.F32x2), 16 STS.64 + 4 STSM,
  1 MEMBAR.ALL.CTA + 1 FENCE.VIEW.ASYNC.S (the dS^T publication's, unchanged), 6 BAR.SYNC (+1: the barrier before
  the dq_full arrive), 8 SYNCS (+2: dq_empty wait, dq_full arrive). Reducer loop: 64 LDS.128 + 64 REDG.E.ADD.F32x4,
  two to three LDS in flight at a time. setmaxnreg: consumers 240, warpgroup 2 24 (as variant 3).
  ``bwd_step_model`` (corrected for STS.64 / the reducer's LDS) at variant 3's 447 TFLOP/s: tensor 2,560 cycles per
  CTA step (45%), shared-memory port 3,076 (54%: +256 STS + 256 LDS), issue 1,045 on the reducer's sub-partition
  (18%); the same 32 KB of fp32 reductions per step in half the instructions.

Kernel end: the reducer finishes its last step's reductions and exits; the kernel boundary orders them before the
``_bwd_dq_convert`` launch.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from . import attention_gluon_bwd as GB
from .attention_gluon_bwd import (  # noqa: F401 - re-exported helpers
    BLOCK_M, BLOCK_N, LOG2E, WG_KEYS, _GLUON_IMPORT_ERROR, _bwd_dq_convert, _bwd_preprocess, _bwd_producer,
    _desc, _split_k_layout, _vec_desc, gluon_bwd_supported)

logger = logging.getLogger(__name__)

if _GLUON_IMPORT_ERROR is None:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
else:  # pragma: no cover - keep the module importable without Gluon
    gluon = GB.gluon
    triton = GB.triton
    gl = None

from .attention_gluon import _as_tma_box, _gl_dtype  # noqa: E402

HEAD_DIM = 128
DQ_BUFFERS = 2          # dQ tiles in shared memory (double buffer)
REDUCER_WARPS = 1
REDUCER_REGS = 24       # setmaxnreg of warpgroup 2 (producer + reducer), as variant 3's producer
SMEM_LIMIT = 232_448    # bytes per CTA on sm_90


@gluon.jit
def _red_add_v4(ptrs, vals):
    # ``red.global.add.v4.f32`` (sm_90, PTX >= 8.1): one per 4 consecutive register elements of this thread; in the
    # reducer's BlockedLayout (size_per_thread [1, 4]) those are 4 consecutive columns of one row, so only the first
    # address ($4) is used. 16-byte alignment: the workspace is 256-byte aligned, rows are 512 B, columns 4-aligned.
    gl.inline_asm_elementwise(
        "red.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;"
        "\n\tmov.u32 $2, 0;\n\tmov.u32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,f,f,f,f", [ptrs.to(gl.int64), vals], dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _bwd_step_dqw(WG: gl.constexpr, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                  q_ready, q_empty, do_ready, do_empty, ds_bar, dq_smem, dq_full, dq_empty, dk, dv, keys,
                  qk_scale, diag_off, STAGES: gl.constexpr, MASKED: gl.constexpr, NB: gl.constexpr,
                  s_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr):
    """``attention_gluon_bwd._bwd_step_v1`` with EARLY_DK (variant 3), statement for statement, except the end:
    dQ_w goes to ``dq_smem`` (guarded by dq_empty / dq_full) instead of 16 REDG.F32x2."""
    dtype: gl.constexpr = q_smem.dtype
    HALF: gl.constexpr = 64
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s = it % STAGES
    ready_phase = (it // STAGES) & 1
    p = it % 2
    ds_phase = (it // 2) & 1
    q_buf = q_smem.index(s)
    do_buf = do_smem.index(s)
    zero = it >> 30   # opaque 0: K / V descriptors recomputed per step (variant 3's spill fix)
    k_mine = k_smem.index(WG + zero)
    v_mine = v_smem.index(WG + zero)

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
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    p16 = gl.convert_layout(pt.to(dtype), op_layout)
    dv = warpgroup_mma(p16, do_buf, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
    delta = delta_smem.index(s).load(col_layout)
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    ds16 = dst.to(dtype)
    d16 = gl.convert_layout(ds16, op_layout)
    dk = warpgroup_mma(d16, q_buf, dk, is_async=True)

    ds_smem.index(2 * p + WG).store(ds16)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_bar.index(p), count=1)

    dv, dk, p16, d16 = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p16, d16])
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)

    mbarrier.wait(ds_bar.index(p), ds_phase)
    dq = warpgroup_mma(ds_smem.index(2 * p).permute((1, 0)), k_smem.index(zero).slice(WG * HALF, HALF, dim=1),
                       gl.zeros([64, HALF], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 * p + 1).permute((1, 0)),
                       k_smem.index(1 + zero).slice(WG * HALF, HALF, dim=1), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])

    # ---- dQ_w -> dq_smem tile 2 b + WG (the reducer issues the global reductions)
    b = it % NB
    mbarrier.wait(dq_empty.index(b), ((it // NB) & 1) ^ 1)
    # [64 rows, 64 cols] -> (row // 8, col // 8, row % 8, col % 8): see "Bank conflicts" in the module docstring
    dq4 = gl.permute(gl.reshape(dq, [8, 8, 8, 8]), (0, 2, 1, 3))
    dq_smem.index(2 * b + WG).store(dq4)
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(b), count=1)
    return dk, dv


@gluon.jit
def _bwd_consumer_dqw(WG: gl.constexpr, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                      ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                      dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                      dk_desc, dv_desc, STAGES: gl.constexpr, NB: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    v_buf = v_smem.index(WG)
    keys = n0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    diag_off = SEQ_K - SEQ_Q
    dk = gl.zeros([64, 128], gl.float32, acc_layout)
    dv = gl.zeros([64, 128], gl.float32, acc_layout)

    mbarrier.wait(kv_bar, 0)
    it = 0
    for g in range(GROUP):
        for mb in range(m_lo, m_full):
            dk, dv = _bwd_step_dqw(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                                   q_ready, q_empty, do_ready, do_empty, ds_bar, dq_smem, dq_full, dq_empty, dk, dv,
                                   keys, qk_scale, diag_off, STAGES, True, NB, s_layout, op_layout, dq_layout)
            it += 1
        for mb in range(m_full, n_m):
            dk, dv = _bwd_step_dqw(WG, it, mb, k_smem, v_smem, ds_smem, q_smem, do_smem, lse_smem, delta_smem,
                                   q_ready, q_empty, do_ready, do_empty, ds_bar, dq_smem, dq_full, dq_empty, dk, dv,
                                   keys, qk_scale, diag_off, STAGES, False, NB, s_layout, op_layout, dq_layout)
            it += 1

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
def _bwd_consumer_dqw_wg0(k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                          ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                          dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                          dk_desc, dv_desc, STAGES: gl.constexpr, NB: gl.constexpr):
    _bwd_consumer_dqw(0, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                      ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                      dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                      dk_desc, dv_desc, STAGES, NB)


@gluon.jit
def _bwd_consumer_dqw_wg1(k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                          ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                          dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                          dk_desc, dv_desc, STAGES: gl.constexpr, NB: gl.constexpr):
    _bwd_consumer_dqw(1, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                      ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar, dq_full,
                      dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                      dk_desc, dv_desc, STAGES, NB)


@gluon.jit
def _bwd_dq_reducer(dq_smem, dq_full, dq_empty, dq_ptr, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                    NB: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Per step: wait dq_full[b]; [64, 128] fp32 (two [64, 64] column halves) from dq_smem -> red.global.add.v4.f32
    into the workspace rows of the step's query block; thread_barrier; release dq_empty[b]. One flat loop over the
    (g, m) steps (few loop-carried registers: the partition runs with 32)."""
    # a slice [1, 8 (col // 8), 8 (row % 8), 8 (col % 8)] of one 8-row group: lanes 0-7 read 4 rows x 32 B = 128 B
    # contiguous (conflict-free LDS.128); one warp covers 4 chunks x 4 rows, so 4 LDS.128 per thread and slice
    red_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 4, 4, 2],
                                                warps_per_cta=[1, NUM_WARPS, 1, 1], order=[3, 2, 1, 0])
    l3: gl.constexpr = gl.SliceLayout(0, red_layout)
    j = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    rl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    cl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    offs = gl.expand_dims(gl.expand_dims(gl.expand_dims(j * 8, 1), 2) + gl.expand_dims(gl.expand_dims(rl * 128, 0), 2)
                          + gl.expand_dims(gl.expand_dims(cl, 0), 1), 0)
    n_steps = n_m - m_lo
    for it in range(GROUP * n_steps):
        g = it // n_steps
        mb = m_lo + (it - g * n_steps)
        buf = it % NB
        mbarrier.wait(dq_full.index(buf), (it // NB) & 1)
        base = dq_ptr + ((b * H + hk * GROUP + g).to(gl.int64) * SQ_PAD + mb * 64) * 128
        for w in gl.static_range(2):
            tile = dq_smem.index(2 * buf + w)
            for rh in gl.static_range(8):
                vals = tile.slice(rh, 1, dim=0).load(red_layout)
                _red_add_v4(base + (rh * 8 * 128 + 64 * w) + offs, vals)
        gl.thread_barrier()
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _fa3_bwd_kernel_dqw(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_ptr,
                        qk_scale, H, GROUP, SEQ_Q, SEQ_K, SQ_PAD,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, NB: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, REDUCER_WARPS: gl.constexpr):
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
    if CAUSAL:
        diag_off = SEQ_K - SEQ_Q
        m_lo = gl.minimum(gl.maximum(n0 - diag_off, 0) // 64, n_m)
        m_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + 127 - diag_off, 0), 64), m_lo), n_m)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    k_layout: gl.constexpr = _split_k_layout(128, dtype, 2)
    # fp32 dQ tiles: XOR swizzle of 32-byte chunks by row % 8 (module docstring: conflict-free STS.64 / LDS.128)
    dq_layout_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[3, 2, 1, 0])
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, 128], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, 128], tile_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, 128], tile_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, 128], tile_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 64], vec_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, 64, 64], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * NB, 8, 8, 8, 8], dq_layout_s)  # [2 b + WG]
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
        mbarrier.init(ds_bar.index(i), count=2)
    for i in gl.static_range(NB):
        mbarrier.init(dq_full.index(i), count=2)   # one arrive per consumer warpgroup
        mbarrier.init(dq_empty.index(i), count=1)  # the reducer
    mbarrier.init(end_bar, count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer_dqw_wg0, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                 ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar,
                                 dq_full, dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                 dk_desc, dv_desc, STAGES, NB)),
        (_bwd_consumer_dqw_wg1, (k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                                 ds_smem, dq_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, ds_bar, end_bar,
                                 dq_full, dq_empty, b, hk, n0, H, GROUP, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K,
                                 dk_desc, dv_desc, STAGES, NB)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc,
                         q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                         kv_bar, q_ready, q_empty, do_ready, do_empty,
                         b, hk, n0, H, GROUP, SQ_PAD, m_lo, m_full, n_m, qk_scale, SEQ_Q, SEQ_K, dq_ptr,
                         dk_desc, dv_desc, 128, STAGES, CAUSAL)),
        (_bwd_dq_reducer, (dq_smem, dq_full, dq_empty, dq_ptr, b, hk, H, GROUP, SQ_PAD, m_lo, n_m,
                           NB, REDUCER_WARPS)),
    ], [4, 1, REDUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


def config_dqw() -> dict:
    cfg = GB.config_for(HEAD_DIM, 3)
    cfg.update(NB=DQ_BUFFERS, REDUCER_WARPS=REDUCER_WARPS, PRODUCER_REGS=REDUCER_REGS)
    return cfg


def gluon_dqw_supported(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_bwd_dqw`` can run these inputs, else a one-line reason."""
    reason = gluon_bwd_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is None and q.shape[-1] != HEAD_DIM:
        reason = f"head dim {q.shape[-1]} not supported by the dQ-through-smem kernel (only {HEAD_DIM})"
    return reason


def gluon_attention_bwd_dqw(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
                            checked: bool = False):
    """Variant 3 of ``gluon_attention_bwd`` with FA3's dQ path (dQ -> shared memory -> reducer warps -> vector
    reductions) -> (dq, dk, dv), contiguous, dtypes of q / k / v. d = 128 only. Raises ValueError when unsupported
    (``gluon_dqw_supported`` gives the reason). The op's backward at d = 128 (``_GLUON_BWD_DQW_DIMS``)."""
    reason = None if checked else gluon_dqw_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is not None:
        raise ValueError(f"gluon_attention_bwd_dqw: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
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
    _bwd_preprocess[(n_m, B * Hq)](out, dout, lse, delta, lse2, dq_acc, *out.stride()[:3], *dout.stride()[:3],
                                   lse.stride(0), lse.stride(1), Hq, Sq, sq_pad, HEAD_DIM=D, BLOCK=GB._PRE_BLOCK)
    cfg = config_dqw()
    k_layout = _split_k_layout(D, _gl_dtype(k.dtype), 4)
    grid = ((Sk + BLOCK_N - 1) // BLOCK_N, B * Hkv)
    _fa3_bwd_kernel_dqw[grid](_desc(q, BLOCK_M), _desc(k, WG_KEYS, layout=k_layout), _desc(v, WG_KEYS),
                              _desc(dout, BLOCK_M), _desc(dk, WG_KEYS, layout=k_layout), _desc(dv, WG_KEYS),
                              _vec_desc(lse2), _vec_desc(delta), dq_acc,
                              sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, sq_pad,
                              STAGES=cfg["STAGES"], CAUSAL=bool(causal), NB=cfg["NB"],
                              CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                              REDUCER_WARPS=cfg["REDUCER_WARPS"], num_warps=cfg["num_warps"],
                              maxnreg=cfg["maxnreg"])
    _bwd_dq_convert[(n_m, B * Hq)](dq_acc, dq, *dq.stride()[:3], Hq, Sq, sq_pad, sm_scale,
                                   HEAD_DIM=D, BLOCK=GB._PRE_BLOCK)
    return dq, dk, dv


def compile_offline(causal: bool, dtype_str: str = "bf16", arch: int = 90):
    """Offline sm_<arch> build of ``_fa3_bwd_kernel_dqw`` (no GPU) -> triton CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config_dqw()
    sig = GB._signature(dtype_str, HEAD_DIM)
    sig.pop("HEAD_DIM")
    for name in ("NB", "REDUCER_WARPS"):
        sig[name] = "constexpr"
    constexprs = {"STAGES": cfg["STAGES"], "CAUSAL": bool(causal), "NB": cfg["NB"],
                  "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"],
                  "REDUCER_WARPS": cfg["REDUCER_WARPS"]}
    src = GluonASTSource(_fa3_bwd_kernel_dqw, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})


# ----------------------------------------------------------------------------------------------------------------
# CPU model of the barrier protocol (no GPU): python -c "import fxopt.kernels.attention_gluon_bwd_dqw as D;
# print(D.check_dqw_protocol())"
# ----------------------------------------------------------------------------------------------------------------

DQW_BUGS = ("reducer_no_wait", "consumer_no_empty_wait", "parity_nb1", "full_count_1", "reducer_early_release",
            "reducer_stops_early")


def dqw_protocol_model(n_steps: int, stages: int = 2, nb: int = 2, seed: int = 0, tma_delay: int = 3,
                       max_ticks: int = 10 ** 6, bug: str = "") -> int:
    """One CTA of ``_fa3_bwd_kernel_dqw`` at the level of barriers and buffer accesses: the producer (K / V once, then
    Q / dO of ``n_steps`` query blocks into ring slot it % stages after the release of the slot's previous use), the
    two consumer warpgroups (``_bwd_step_dqw``: q_ready / do_ready waits, S^T / dP^T / dV / dK reading Q, dO, K_w,
    V_w; dS^T into ds[p][w], arrive ds_bar[p]; wait(0), Q / dO released; ds_bar wait; dQ reading both dS^T tiles and
    K_0, K_1; then wait dq_empty[b] (parity (u & 1) ^ 1), write dQ tile (b, w), arrive dq_full[b]), the end_bar
    meeting and the dK / dV staging into K_w / V_w, and the reducer (wait dq_full[b] with parity u & 1, read both
    tiles of buffer b over several ticks, reduce, arrive dq_empty[b]).

    mbarriers are modelled with completed-phase counts. The ring, ds_bar and end_bar waits are checked by use
    number (as in ``attention_gluon_bwd.v4_protocol_model``). The dq_full / dq_empty waits are modelled as the
    hardware does them, by PARITY (``try_wait.parity P`` passes once a phase of parity P has completed: completed
    count % 2 == (P + 1) % 2; on a fresh barrier P = 1 passes), and when such a wait passes, the number of completed
    phases must be the one the protocol intends (use + 1): otherwise a phase was skipped or the wait passed early
    (AssertionError). A random scheduler with skewed per-agent speeds runs one runnable agent per tick; TMA loads
    land 0..tma_delay ticks after issue. Raises AssertionError on deadlock, such a parity mismatch, a skipped phase,
    a write into a buffer another agent reads, a reducer read of a dQ tile that does not hold this step's values, a
    tile overwritten while it is reduced, and a lost or
    doubled dQ contribution (every step's two tiles must be reduced exactly once). ``bug``: one of ``DQW_BUGS``."""
    import random

    assert bug in ("",) + DQW_BUGS, bug
    rng = random.Random(seed)
    count, arrived, done = {}, {}, {}
    readers = {}
    tile_ver = {}          # (b, w) -> step whose dQ the tile holds
    reduced = []           # (step, w) reduced by the reducer

    def init(bar, n):
        count[bar], arrived[bar], done[bar] = n, 0, 0

    def arrive(bar):
        arrived[bar] += 1
        if arrived[bar] == count[bar]:
            arrived[bar] = 0
            done[bar] += 1

    def passed(bar, use):
        """count-based wait for use ``use`` (the protocol's intent); raises on a skipped phase."""
        assert done[bar] <= use + 1, f"phase skipped on {bar}: use {use}, {done[bar]} phases completed"
        return done[bar] == use + 1

    def parity_wait_ok(bar, parity, use):
        """hardware parity wait: passes iff the phase with this parity, most recent, has completed, i.e. the
        number of completed phases has parity (parity + 1) & 1 (a fresh barrier: parity 1 passes). The protocol
        intends it to pass exactly when ``use + 1`` phases (for a 'full' wait) have completed: check that."""
        ok = done[bar] % 2 == (parity + 1) % 2
        if ok:
            assert done[bar] == use + 1, (f"parity wait on {bar} passed with {done[bar]} phases completed, "
                                          f"intended use {use} (phase skipped or passed early)")
        return ok

    def read(buf, who):
        readers.setdefault(buf, set()).add(who)

    def unread(buf, who):
        readers[buf].discard(who)

    def write(buf, who):
        others = readers.get(buf, set()) - {who}
        assert not others, f"{who} writes {buf} while {sorted(others)} read it"

    init("kv", 1)
    init("end", 2)
    for i in range(stages):
        for kind in ("q_ready", "do_ready"):
            init((kind, i), 1)
        for kind in ("q_empty", "do_empty"):
            init((kind, i), 2)
    for i in range(2):
        init(("ds", i), 2)
    for i in range(nb):
        init(("dq_full", i), 1 if bug == "full_count_1" else 2)
        init(("dq_empty", i), 1)
    inflight = []
    tick = 0

    def producer():
        inflight.append((tick + rng.randint(0, tma_delay), ["K0", "K1", "V0", "V1"], "kv"))
        for it in range(n_steps):
            s, u = it % stages, it // stages
            for kind in ("q", "do"):
                while u > 0 and not passed((kind + "_empty", s), u - 1):
                    yield
                write((kind, s), "tma")
                inflight.append((tick + rng.randint(0, tma_delay), [(kind, s)], (kind + "_ready", s)))
                yield

    def consumer(w):
        me = f"wg{w}"
        while not passed("kv", 0):
            yield
        for it in range(n_steps):
            s, u = it % stages, it // stages
            p, du = it % 2, it // 2
            for kind in ("q", "do"):
                while not passed((kind + "_ready", s), u):
                    yield
            for buf in (("q", s), ("do", s), f"K{w}", f"V{w}"):
                read(buf, me)
            yield
            unread(f"K{w}", me)
            unread(f"V{w}", me)
            write(("dst", p, w), me)
            arrive(("ds", p))
            yield
            unread(("q", s), me)
            unread(("do", s), me)
            arrive(("q_empty", s))
            arrive(("do_empty", s))
            while not passed(("ds", p), du):
                yield
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):
                read(buf, me)
            yield
            for buf in (("dst", p, 0), ("dst", p, 1), "K0", "K1"):
                unread(buf, me)
            # ---- dQ_w -> smem tile (b, w)
            b, bu = it % nb, it // nb
            if bug != "consumer_no_empty_wait":
                if bug == "parity_nb1":   # the NB = 1 parity formula with NB = 2 buffers
                    par, use = (it & 1) ^ 1, bu - 1
                else:
                    par, use = (bu & 1) ^ 1, bu - 1
                # use -1 (the first use of the buffer) passes at once on a fresh barrier: parity 1
                while not (use < 0 and par == 1 and done[("dq_empty", b)] == 0) and \
                        not (done[("dq_empty", b)] > 0 and parity_wait_ok(("dq_empty", b), par, use)):
                    yield
            write(("dqt", b, w), me)
            tile_ver[(b, w)] = it
            yield
            arrive(("dq_full", b))
            yield
        arrive("end")
        while not passed("end", 0):
            yield
        write(f"K{w}", me)
        write(f"V{w}", me)

    def reducer():
        last = n_steps - 1 if bug == "reducer_stops_early" else n_steps
        for it in range(last):
            b, bu = it % nb, it // nb
            if bug != "reducer_no_wait":
                while not (done[("dq_full", b)] > 0 and parity_wait_ok(("dq_full", b), bu & 1, bu)):
                    yield
            if bug == "reducer_early_release":
                arrive(("dq_empty", b))
            for w in (0, 1):
                read(("dqt", b, w), "reducer")
                assert tile_ver.get((b, w)) == it, \
                    f"reducer reads dQ tile {(b, w)} for step {it}, it holds step {tile_ver.get((b, w))}"
                yield                               # LDS slices + reductions over several ticks
                assert tile_ver.get((b, w)) == it, f"dQ tile {(b, w)} overwritten while reduced (step {it})"
                reduced.append((it, w))
                unread(("dqt", b, w), "reducer")
            if bug != "reducer_early_release":
                arrive(("dq_empty", b))
            yield

    agents = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1), "reducer": reducer()}
    speed = {name: rng.choice((1, 2, 6, 20)) for name in agents}   # skewed agent speeds: slow reducers etc.
    blocked_for = 0
    while agents or inflight:
        tick += 1
        assert tick < max_ticks, "model did not finish"
        for item in [x for x in inflight if x[0] <= tick]:
            inflight.remove(item)
            arrive(item[2])
        if not agents:
            continue
        names = sorted(agents)
        name = rng.choices(names, weights=[speed[n] for n in names])[0]
        before = (dict(done), dict(arrived), len(inflight), len(reduced), dict(tile_ver))
        try:
            next(agents[name])
        except StopIteration:
            del agents[name]
            continue
        if not inflight and (dict(done), dict(arrived), len(inflight), len(reduced), dict(tile_ver)) == before:
            blocked_for += 1
            assert blocked_for < 10000, f"deadlock at tick {tick}: {sorted(agents)} waiting; phases {done}"
        else:
            blocked_for = 0
    assert sorted(reduced) == [(it, w) for it in range(n_steps) for w in (0, 1)], \
        f"dQ contributions lost or doubled: reduced {len(reduced)} tiles of {2 * n_steps}"
    assert done["end"] == 1
    return tick


def check_dqw_protocol(trials: int = 300, seed: int = 0) -> str:
    """``dqw_protocol_model`` over random interleavings: 0-9 query blocks, 1-3 ring stages, 1-2 dQ buffers, TMA
    delays 0-6."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        dqw_protocol_model(rng.randint(0, 9), 1 + k % 3, nb=1 + k % 2, seed=k, tma_delay=rng.randint(0, 6))
    return (f"dQ-through-smem protocol: {trials} random interleavings without deadlock, parity mismatch, buffer "
            f"hazard or lost dQ contribution")


# ----------------------------------------------------------------------------------------------------------------
# Step census and cycle model from offline SASS (``attention_gluon_bwd.sass_step_loops`` / ``bwd_step_model``)
# ----------------------------------------------------------------------------------------------------------------


def dqw_step_model(sass: str, tflops: Optional[float] = None) -> dict:
    """Census of the step loops of a ``_fa3_bwd_kernel_dqw`` build (``sass``: cuobjdump text) and the cycles per CTA
    step of ``attention_gluon_bwd.bwd_step_model`` on the two unmasked consumer loops, corrected for this kernel:

    * the consumer's 16 STS.64 per warp (the dQ tile) move 256 B per warp instruction, not the 512 B of an STSM
      that ``bwd_step_model`` charges per "sts";
    * the reducer's LDS.128 (512 B per warp instruction) are added to the shared-memory port;
    * the reducer warp's loop shares an SM sub-partition with one consumer warp of each warpgroup: ``issue`` is the
      larger of (consumers + producer) and (consumers + reducer).

    Returns dict(consumer=[loops], reducer=loop, producer=loop, model=bwd_step_model result with the corrected
    ``smem`` / ``issue`` and the extra keys ``reducer_lds`` / ``reducer_red``)."""
    loops = GB.sass_step_loops(sass)
    cons = [lp for lp in loops if lp["hgmma"]]
    rest = [lp for lp in loops if not lp["hgmma"]]
    red = [lp for lp in rest if lp["classes"].get("redg")]
    prod = [lp for lp in rest if not lp["classes"].get("redg")]
    assert len(red) == 1 and len(prod) == 1, [lp["n"] for lp in loops]
    unmasked = [lp for lp in cons if not lp["classes"].get("fsel_fsetp")]
    assert len(unmasked) == 2, [lp["n"] for lp in cons]
    model = GB.bwd_step_model(unmasked, prod[0]["n"], tflops=tflops)
    warps = 4
    sts_all = sum(lp["classes"].get("sts", 0) for lp in unmasked)
    sts64 = sts_all - 4 * len(unmasked)          # minus the 4 STSM (dS^T) per consumer warp and step
    rc = red[0]["classes"]
    smem = model["smem"] - sts64 * warps * (512 - 256) / 128 + rc.get("lds", 0) * 512 / 128
    issue = max(model["issue"], model["issue_consumers"] + red[0]["n"])
    model.update(smem=smem, issue=issue, reducer_lds=rc.get("lds", 0), reducer_red=rc.get("redg", 0),
                 red_bytes=rc.get("redg", 0) * 32 * 16)
    if tflops:
        for key in ("smem", "issue"):
            model[f"{key}_share"] = model[key] / model["measured"]
        model["red_tb_per_s"] = model["red_bytes"] * 132 / (model["measured"] / 1.83e9) / 1e12
    return dict(consumer=cons, reducer=red[0], producer=prod[0], model=model)
