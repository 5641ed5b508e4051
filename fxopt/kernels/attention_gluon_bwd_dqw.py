"""Gluon attention backward at d = 128 (and 64) with FA3's dQ path: dQ through shared memory, global reductions by a
reducer warp.

Since session 14 the op runs variant 6 (``gluon_attention_bwd_dqw(..., tma=True)``): the same kernel, with the reducer
warp's global reductions done by the TMA unit (one ``cp.reduce.async.bulk.tensor`` per dQ half-tile instead of
64 LDS.128 + 64 ``red.global.add.v4`` per step); 1.13-1.20x variant 5 at d = 128 on the H200. See "Variant 6" in
``attention_gluon_bwd``. What follows describes variant 5, whose shared-memory tile order variant 6 keeps.

The op's backward at d = 128 since session 11 and at d = 64 from S = 4096 since session 12
(``attention._GLUON_BWD_DQW_DIMS``; ``FXOPT_ATTN_GLUON_BWD_DQW=0`` turns it off): correct on the H200 (24 GPU tests at
d = 64 / 128, dK / dV bit-identical to variant 3; 16 op-level route tests) and 1.05-1.07x variant 3 at d = 128, after
the ablations put the dQ global reductions at 30-34% of the step. At d = 64 through the op: 1.03-1.09x the Triton
backward at S = 4k-16k (benchmarks/results/attention_d64dqw.md). Session 12 found the folded kernel (below) failing to
compile at run time: the launcher makes the constexpr 1 of GROUP = 1, and a partition list built with "+" unwrapped it;
the op had silently used the Triton backward. The fix writes one literal partition list per build, and
``compile_offline(..., ones=("H", "GROUP"))`` builds as the launcher does (tests/test_attention_gluon_bwd_dqw.py).

Where the kernel lives (session 12): this module holds no Gluon code. The kernel is variant 5 of
``attention_gluon_bwd``: ``_fa3_bwd_kernel_v1`` with ``EARLY_DK`` and the constexpr switch ``DQW`` (plus ``NB``,
``REDUCER_WARPS``); the step's dQ end is the ``if DQW`` branch of ``_bwd_step_v1``, the reducer partition is
``attention_gluon_bwd._bwd_dq_reducer`` (``_red_add_v4``). In session 11 it was a separate kernel
(``_fa3_bwd_kernel_dqw`` with its own step / consumers) duplicating variant 3; the fold was accepted because the offline
sm_90a SASS of the folded build is byte-identical to that kernel's (modulo the kernel name; bf16 / fp16, causal or
not) and every other build of ``attention_gluon_bwd`` kept its SASS (see "Variant 5" in its docstring). This module
keeps the public entry ``gluon_attention_bwd_dqw`` (= ``gluon_attention_bwd(..., variant=5)`` after the d = 128
check), ``gluon_dqw_supported``, ``compile_offline``, the barrier-protocol model and the step census. Everything not
listed below is variant 3: same producer, preprocess, convert, tiles, ring, dS^T exchange (``ds_bar``), end_bar and
epilogue; the consumer's order of wgmma, waits and arrives is unchanged up to the dQ wgmma's ``wait(0)``.

Why
---
Session 10/11 (docs/notes_attention_bwd_issue_session10.md): variant 3 is neither issue- nor throughput-bound (tensor
cores ~45%, shared-memory port ~45%, issue ~15% of the measured step). One suspect for the unexplained half of the
step is the ``MEMBAR.ALL.CTA`` of the proxy fence after the dS^T store, which may wait until the warp's previous
step's 16 ``REDG.F32x2`` dQ reductions are acknowledged by L2 (1.4 TB/s of fp32 reductions over the chip). FA3 keeps
global reductions off the MMA warps: the consumers write dQ to shared memory and a separate warp reduces it into the
fp32 workspace. This kernel does the same with per-thread ``red.global.add.v4.f32`` (Gluon 3.6 exposes no TMA
reduce for Hopper; a ``cp.reduce.async.bulk.tensor`` by inline PTX would be the next step).

What ``DQW`` changes against variant 3
--------------------------------------
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
(Measured on the separate kernel; the folded build has the same SASS.)
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

Head dim 64 (session 12; built and censused offline, NOT GPU-checked yet, not routed)
------------------------------------------------------------------------------------
The same code, written HEAD_DIM-generically (at d = 128 every expression evaluates as before: SASS byte-identical):
* dQ columns per warpgroup: d / 2 = 32 (the split kernel's dQ half at d = 64, ``dq`` [64, 32] fp32 = 16 registers
  per consumer thread, was 32 at d = 128).
* tile: [64, 32] fp32 = 8 KB in the chunk-transposed order [row // 8, col // 8, row % 8, col % 8] = [8, 4, 8, 8]
  (``dq_smem`` [2 NB, 8, d / 16, 8, 8]); the consumer's 8 STS.64 per thread and step (one 8-column chunk of 8 rows
  per warp instruction) are conflict-free as at d = 128 (each (row // 8, chunk) block is 256 contiguous bytes; the
  row-group stride is 1 KB instead of 2 KB). NB = 2 (double buffer, same barriers, counts and parities: the
  protocol model applies unchanged; ``check_dqw_protocol`` also runs the d = 64 ring depth of 4 stages).
* shared memory: variant 3's d = 64 build (K 16 KB + V 16 KB + dS^T 32 KB + 4 stages x 16.5 KB = 133,648 B) + 2 x 2
  x 8 KB of dQ tiles + 4 mbarriers = 166,512 B of 232,448 (NB = 4 would also fit: ~199.3 KB; not needed while the
  reducer keeps up, see the census).
* reducer: reads the head dim off ``dq_smem``'s shape (d / 16 chunks); per 8-row group and column half one [1, 4, 8,
  8] slice = 2 LDS.128 + 2 ``red.global.add.v4.f32`` per thread (lanes 0-7: 4 rows x 32 B contiguous in smem; in
  global memory each warp instruction covers 4 rows x the 128-byte column half); per step 32 LDS.128 + 32 REDG.F32x4
  (d = 128: 64 + 64), the same 16 KB of fp32 reductions as variant 3's 2 x 4 warps x 8 REDG.F32x2.
Offline (Triton 3.6, ptxas 12.8, sm_90a; bf16 = fp16; test_dqw_offline_build_census[64]):
      build       STACK  spill st/ld  smem (B)  C75xx  hazards  consumer step loops, 0 LDL/STL   reducer
      d64 full      16     12 / 12    166,512    -       0      375 / 371                        146 (1 LDL)
      d64 causal    16     12 / 12    166,512    -       0      539 / 376 / 533 / 370            147 (1 LDL)
  (variant 3 at d = 64: step loops 374 / 363 full, 553 / 390 / 546 / 383 causal: the REDG address math is gone.)
  (variant 3 d = 64: 0 B stack, 133,648 / 133,664 B.) The 12 B of spills are outside the consumer step loops: 2 values
  of consumer warpgroup 0 stored before its loop and reloaded in its epilogue, and 1 loop-invariant reducer value (1
  LDL per reducer step, as the d = 128 reducer's). Per consumer step loop against variant 3 at d = 64: the same 24
  HGMMA (16 m64n64k16 + 8 m64n32k16), 32 MUFU.EX2, 16 LDS, MEMBAR / fence; no REDG (variant 3: 8 REDG.F32x2), 8
  STS.64 more, 1 BAR.SYNC and 2 SYNCS more; setmaxnreg 240 / 24 as variant 3. Cycle model (``dqw_step_model``) per
  CTA step: tensor 1,280, shared-memory port 1,924 (variant 3's + 128 STS.64 + 128 LDS.128 cycles), reducer loop 146
  instructions against ~375 per consumer warp. On the H200 (session 12, fwd+bwd through the op against the Triton
  backward): 399 / 363 / 428 / 417 against 385 / 351 / 402 / 382 TFLOP/s at S = 4k / 4k causal / 16k / 16k causal;
  at 2048 382 / 255 against 372 / 282, in eager timing. Routed by GPU time (CUDA-graph
  replays, session 13): d = 64 from 2048, d = 128 from 512 (``attention._GLUON_BWD_MIN_SEQ_BY_DIM``).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import attention_gluon_bwd as GB
from .attention_gluon_bwd import (  # noqa: F401 - re-exported (the kernel and its helpers live there)
    BLOCK_M, BLOCK_N, DQ_BUFFERS, DQW_VARIANT, LOG2E, REDUCER_WARPS, WG_KEYS, _GLUON_IMPORT_ERROR, _bwd_dq_convert,
    _bwd_dq_reducer, _bwd_preprocess, _bwd_producer, _fa3_bwd_kernel_v1, _red_add_v4, gluon_bwd_supported)

logger = logging.getLogger(__name__)

HEAD_DIM = GB.DQW_HEAD_DIM      # 128: the routed head dim (the default of config_dqw / compile_offline)
HEAD_DIMS = GB.DQW_HEAD_DIMS    # (64, 128): head dims the kernel builds for (d = 64: session 12, GPU-checked)
REDUCER_REGS = GB._PRODUCER_REGS  # 24: setmaxnreg of warpgroup 2 (producer + reducer), as variant 3's producer
SMEM_LIMIT = 232_448    # bytes per CTA on sm_90


def config_dqw(head_dim: int = HEAD_DIM) -> dict:
    """``attention_gluon_bwd.config_for(head_dim, 5)``: variant 3's meta-parameters plus NB / REDUCER_WARPS."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"config_dqw: head dim {head_dim} not supported (only {HEAD_DIMS})")
    return GB.config_for(head_dim, DQW_VARIANT)


def gluon_dqw_supported(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_bwd_dqw`` can run these inputs, else a one-line reason."""
    reason = gluon_bwd_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is None and q.shape[-1] not in HEAD_DIMS:
        reason = f"head dim {q.shape[-1]} not supported by the dQ-through-smem kernel (only {HEAD_DIMS})"
    return reason


def gluon_attention_bwd_dqw(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, *, causal: bool = False, scale: Optional[float] = None,
                            checked: bool = False, grads_like_inputs: bool = False, tma: bool = False):
    """Variant 3 of ``gluon_attention_bwd`` with FA3's dQ path (dQ -> shared memory -> reducer warp -> vector
    reductions) -> (dq, dk, dv), contiguous, dtypes of q / k / v. d = 64 or 128. Raises ValueError when unsupported
    (``gluon_dqw_supported`` gives the reason). The op's backward at d = 64 / 128 (``_GLUON_BWD_DQW_DIMS``).
    Same launches as ``gluon_attention_bwd(..., variant=5)``, which it calls; ``tma=True``: variant 6, the same
    kernel with the reducer's global reductions done by the TMA unit (``cp.reduce.async.bulk.tensor``)."""
    reason = None if checked else gluon_dqw_supported(dout, q, k, v, out, lse, causal, scale)
    if reason is not None:
        raise ValueError(f"gluon_attention_bwd_dqw: {reason}")
    return GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, scale=scale, checked=True,
                                  variant=GB.DQ_TMA_VARIANT if tma else DQW_VARIANT,
                                  grads_like_inputs=grads_like_inputs)


def compile_offline(causal: bool, dtype_str: str = "bf16", arch: int = 90, head_dim: int = HEAD_DIM):
    """Offline sm_<arch> build of the dQ-through-smem kernel (``_fa3_bwd_kernel_v1`` with DQW; no GPU) -> triton
    CompiledKernel. = ``attention_gluon_bwd.compile_offline(head_dim, causal, dtype_str, arch, variant=5)``."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"compile_offline: head dim {head_dim} not supported (only {HEAD_DIMS})")
    return GB.compile_offline(head_dim, causal, dtype_str, arch, variant=DQW_VARIANT)


# ----------------------------------------------------------------------------------------------------------------
# CPU model of the barrier protocol (no GPU): python -c "import fxopt.kernels.attention_gluon_bwd_dqw as D;
# print(D.check_dqw_protocol())"
# ----------------------------------------------------------------------------------------------------------------

DQW_BUGS = ("reducer_no_wait", "consumer_no_empty_wait", "parity_nb1", "full_count_1", "reducer_early_release",
            "reducer_stops_early")


def dqw_protocol_model(n_steps: int, stages: int = 2, nb: int = 2, seed: int = 0, tma_delay: int = 3,
                       max_ticks: int = 10 ** 6, bug: str = "") -> int:
    """One CTA of variant 5 (``_fa3_bwd_kernel_v1`` with DQW) at the level of barriers and buffer accesses: the
    producer (K / V once, then Q / dO of ``n_steps`` query blocks into ring slot it % stages after the release of the
    slot's previous use), the two consumer warpgroups (``_bwd_step_v1`` with DQW: q_ready / do_ready waits, S^T /
    dP^T / dV / dK reading Q, dO, K_w, V_w; dS^T into ds[p][w], arrive ds_bar[p]; wait(0), Q / dO released; ds_bar
    wait; dQ reading both dS^T tiles and K_0, K_1; then wait dq_empty[b] (parity (u & 1) ^ 1), write dQ tile (b, w),
    arrive dq_full[b]), the end_bar meeting and the dK / dV staging into K_w / V_w, and the reducer (wait dq_full[b]
    with parity u & 1, read both tiles of buffer b over several ticks, reduce, arrive dq_empty[b]).

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
    st = GB.ProtocolState(rng)
    init, arrive, passed, read, unread, write = st.init, st.arrive, st.passed, st.read, st.unread, st.write
    done = st.done
    tile_ver = {}          # (b, w) -> step whose dQ the tile holds
    reduced = []           # (step, w) reduced by the reducer

    def parity_wait_ok(bar, parity, use):
        """hardware parity wait: passes iff the phase with this parity, most recent, has completed, i.e. the
        number of completed phases has parity (parity + 1) & 1 (a fresh barrier: parity 1 passes). The protocol
        intends it to pass exactly when ``use + 1`` phases (for a 'full' wait) have completed: check that."""
        ok = done[bar] % 2 == (parity + 1) % 2
        if ok:
            assert done[bar] == use + 1, (f"parity wait on {bar} passed with {done[bar]} phases completed, "
                                          f"intended use {use} (phase skipped or passed early)")
        return ok

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

    agents = {"producer": GB.ring_producer(st, n_steps, stages, tma_delay), "wg0": consumer(0), "wg1": consumer(1),
              "reducer": reducer()}
    speed = {name: rng.choice((1, 2, 6, 20)) for name in agents}   # skewed agent speeds: slow reducers etc.
    tick = st.run(agents, max_ticks, progress=lambda: (len(reduced), dict(tile_ver)), speed=speed)
    assert sorted(reduced) == [(it, w) for it in range(n_steps) for w in (0, 1)], \
        f"dQ contributions lost or doubled: reduced {len(reduced)} tiles of {2 * n_steps}"
    assert done["end"] == 1
    return tick


def check_dqw_protocol(trials: int = 300, seed: int = 0) -> str:
    """``dqw_protocol_model`` over random interleavings: 0-9 query blocks, 1-4 ring stages (d = 128 runs 2, d = 64
    runs 4), 1-2 dQ buffers, TMA delays 0-6."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        dqw_protocol_model(rng.randint(0, 9), 1 + k % 4, nb=1 + (k // 4) % 2, seed=k, tma_delay=rng.randint(0, 6))
    return (f"dQ-through-smem protocol: {trials} random interleavings without deadlock, parity mismatch, buffer "
            f"hazard or lost dQ contribution")


# ----------------------------------------------------------------------------------------------------------------
# Step census and cycle model from offline SASS (``attention_gluon_bwd.sass_step_loops`` / ``bwd_step_model``)
# ----------------------------------------------------------------------------------------------------------------


def dqw_step_model(sass: str, tflops: Optional[float] = None) -> dict:
    """Census of the step loops of a variant-5 (DQW) build (``sass``: cuobjdump text) and the cycles per CTA
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
