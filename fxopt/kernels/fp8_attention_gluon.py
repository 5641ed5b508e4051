"""FP8 (e4m3) FA3-style attention forward for Hopper (sm_90), written in Gluon.

Same structure as ``attention_gluon``: one CTA = 128 query rows of one (batch, head), a TMA producer warp, two
consumer warpgroups that pipeline S_i = Q K_i^T against O += P8_{i-1} V_{i-1} (QGMMA, fp32 accumulation). Inputs are
exactly those of ``fp8_attention.fp8_attention_quantized`` (e4m3 Q, K after the Hadamard transform, V transposed, fp32
block scales). FP8 specifics: sm_90 fp8 wgmma reads shared-memory operands K-major only, hence V transposed; P is
scaled, packed to e4m3 in registers and fed as the register A operand; the block scales are folded exactly as the
Triton kernel folds them, so the two agree. d in {64, 128}.

The op routes to the default build (``permute_k`` + ``cast_late``). Opt-in builds kept for comparison
(``overlap``, ``pingpong``, ``persistent``, ``poly_exp``, ``mma_rowsum``, ``lazy_rescale``, timing-only ``ablate``)
were measured slower or not checked; ``docs/kernels.md`` has their results, the layouts and the SASS counts.
``python -m fxopt.kernels.fp8_attention_gluon`` compiles every config offline and prints its resources.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from . import fp8_attention as _fp8

try:  # Gluon ships with Triton >= 3.5; keep the module importable without it
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_IMPORT_ERROR: Optional[str] = None
except Exception as _e:  # pragma: no cover - depends on the installed Triton
    _GLUON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

    class _Stub:
        @staticmethod
        def jit(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def constexpr_function(fn):
            return fn

    gluon = _Stub()
    triton = _Stub()
    gl = tl = None

from .attention_gluon import _as_tma_box, _gl_dtype, _tma_stride_reason, device_capability, host_layout  # noqa: E402
from .attention_gluon import (  # noqa: E402,F401 (schedule and CPU models, shared with the bf16 forward)
    _fa_sched_count, _fa_sched_item, _fa_tile_blocks, _interleave, _model_persistent_producer, _model_wait, _ModelBar,
    _num_sms, persistent_items, persistent_schedule)
from .attention_gluon import (  # noqa: E402,F401 (the FMA-pipe exp2, shared with the bf16 forward)
    _EXP2_SHIFTER, EXP2_POLY_COEFFS, POLY_EXP_CHOICES, POLY_EXP_PACK, _exp2_mixed, _exp2_poly, fit_exp2_poly)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
P_SHIFT = _fp8.P_SHIFT  # P stored as p * 2^8 in e4m3 (fp8_attention.py's convention)
QBLOCK = _fp8.QUANT_BLOCK  # 128 rows per quantization block

WG_ROWS = 64
NUM_CONSUMERS = 2
# head dim -> (BLOCK_N, STAGES). BLOCK_N must divide QBLOCK (one K / V scale per key block).
_CONFIGS = {64: (128, 4), 128: (128, 3)}
_MAXNREG = 168
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24
# K rows loaded permuted within every 16 keys so that P needs no cross-lane exchange before the PV wgmma (see
# _f8_p_operand / _k_desc). False = plain K load + Triton's convert_layout (shuffles). On by default:
# the 5-D TMA view works on the H200 (agreement with the Triton fp8 kernel as close as the plain load's on 12 cases).
PERMUTE_K_DEFAULT = True
# On by default (with permute_k: 705-873 against 561-651 TFLOP/s for the plain build and 665-790 for
# the Triton fp8 kernel, d = 128, benchmarks/results/gluon/fp8_gluon_check.md): carry P_{i-1} across the loop back edge in fp32 and cast it to e4m3 right before
# the PV wgmma that reads it, instead of carrying the e4m3 operand. Triton 3.6 lowers a loop-carried 8-bit register
# tensor as one byte per 32-bit register, so the default build unpacks P8 at the end of every step (PRMT 0x777x /
# 0x7610) and repacks it at the top of the next (LOP3 & 0xffff, PRMT 0x3340 / 0x5410): ~180 instructions per step.
CAST_LATE_DEFAULT = True
# Opt-in (on the H200 bit-identical but 5-10% SLOWER than cast_late + permute_k alone:
# 753-801 against 812-873 TFLOP/s): FA3's intra-warpgroup order (attention_gluon.py's variant="overlap"): issue S_i,
# rescale O by the factor owed by the previous softmax while S_i runs, issue PV_{i-1}, softmax_i, store l_i to an
# unread shared slot (pins ptxas's PV wait below every exp2 of the step), wait for PV_{i-1}. See _f8_step_overlap.
OVERLAP_DEFAULT = False
# Opt-in (offline only): explicit warpgroup ping-pong (FA3's inter-warpgroup schedule). Two mbarriers
# ``turn`` order the GEMM issues of the two consumer warpgroups: warpgroup 1 issues its k-th GEMM group (block 0: QK_0;
# step i: QK_i + PV_{i-1}; tail: PV_{n-1}) only after warpgroup 0 issued its k-th, warpgroup 0 its (k+1)-th only after
# warpgroup 1 issued its k-th, so one warpgroup's softmax runs under the other's GEMMs. See _pp_wait / the docstring.
PINGPONG_DEFAULT = False
# Opt-in (measured slower on the H200): compute POLY_EXP of every 16 consecutive per-thread scores' exp2 with a degree-3
# polynomial on the FMA / ALU pipes (_exp2_poly) instead of MUFU.EX2, i.e. a fraction POLY_EXP / 16 of the S tile.
# 0 = off (every build byte-identical to before). Allowed: POLY_EXP_CHOICES. Env override: FXOPT_FP8_GLUON_POLY_EXP.
POLY_EXP_DEFAULT = 0
# Opt-in (bit-identical, mixed on the H200: +5.8% / -2.5%): one CTA per SM looping over (head, 128-row query block) work items with two Q
# buffers per consumer warpgroup, a never-drained K / V ring and the O store left in flight (attention_gluon.py's
# variant="persistent", which made the bf16 forward 3-5% faster). A separate kernel, _fp8_fa3_fwd_persistent_kernel.
PERSISTENT_DEFAULT = False
# persistent: head dim -> STAGES of the K / V^T ring. Shared memory = 4 Q (64 x d fp8) + STAGES x (K + V^T, 128 x d
# fp8 each) + 2 O staging tiles (64 x d, 16-bit) + barriers: d 128 / 4 stages 196,608 B; 5 stages would be 229,376 B
# (fits 227 KB = 232,448 B, ``stages=5``); d 64 / 4 stages 98,304 B.
_PERSISTENT_STAGES = {64: 4, 128: 4}
# Opt-in (offline only): the row sum l of P on the tensor cores (docs/kernels.md "mma_rowsum"): one extra
# async wgmma per step, P8 (the PV A operand, registers) x an all-ones [BLOCK_N, RS_N] e4m3 tile in shared memory,
# instead of ~64 FADD per thread. l then sums the QUANTIZED P, the weights the numerator P8 V uses. Env override
# FXOPT_FP8_GLUON_MMA_ROWSUM (0 / 1).
MMA_ROWSUM_DEFAULT = False
# The H200 check failed (benchmarks/results/fp8_rowsum_check.md): RMSE 0.035 against 0.0019 without it
# on N(0, 1) inputs, lse off by up to 3.8, out of range on the outlier inputs; lazy_rescale alone was accurate. So a
# launch with mma_rowsum=True is refused unless $FXOPT_FP8_GLUON_UNCHECKED=1 (the ablation timing sets it).
MMA_ROWSUM_FAILED = ("failed its H200 accuracy check (RMSE 18x the default build's, a ptxas miscompile "
                     "of the ones-tile fill, fixed: RMSE 1.08-1.12x the default build's, one GPU test's "
                     "1.05x bound failed, for 1.00-1.05x the speed, so it is not used)")
UNCHECKED_ENV = "FXOPT_FP8_GLUON_UNCHECKED"
RS_N = 8  # N of the row-sum wgmma (the smallest N of an sm_90 wgmma): a 64 x 8 fp32 accumulator = 4 regs / thread
# Opt-in (offline only): FA4's conditional rescaling (docs/kernels.md "lazy_rescale"): the running max
# moves only when a row of the warpgroup would grow by more than LAZY_TAU (log2 units); the O rescale (64 FMUL per
# thread) runs in a warpgroup-uniform branch. P = exp2(s c + lv - m + LAZY_SHIFT) <= 2^(LAZY_SHIFT + LAZY_TAU) = 256.
# Env override FXOPT_FP8_GLUON_LAZY_RESCALE (0 / 1).
LAZY_RESCALE_DEFAULT = False
LAZY_TAU = 2.0
LAZY_SHIFT = P_SHIFT - LAZY_TAU
if _GLUON_IMPORT_ERROR is None:  # module-level constexprs read by the device code
    LAZY_TAU_C = gl.constexpr(LAZY_TAU)
    RS_N_C = gl.constexpr(RS_N)
_SMEM_LIMIT = 232448  # sm_90: 227 KB of dynamic shared memory per block
# TIMING-ONLY ablation builds (docs/kernels.md "ablate"): constexpr ABLATE, a bit mask of parts of the
# main-loop step to leave out. The results are WRONG; the launch needs $FXOPT_FP8_GLUON_ABLATE_OK=1. 0 = every build
# byte-identical to before.
ABLATE_BITS = {1: "exp2", 2: "rowmax", 4: "rescale", 8: "pv", 16: "qk", 32: "cast", 64: "rowsum"}
ABLATE_ALL = sum(ABLATE_BITS)
ABLATE_ENV = "FXOPT_FP8_GLUON_ABLATE_OK"
if _GLUON_IMPORT_ERROR is None:
    ABLATE_ALL_C = gl.constexpr(ABLATE_ALL)


# ----------------------------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _f8_producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 b, h, hk, bhk, m0, n_blocks, SK_PAD, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 PERMUTE_K: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_bars.index(w),
                                        _as_tma_box(q_smem.index(w), q_desc))
    for j in range(n_blocks):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        if PERMUTE_K:  # 5-D view [rows / 16, jl, q, e, d] of the flat K: smem row 8 jl + 2 q + e = key 4 q + 2 jl + e
            tma.async_copy_global_to_shared(k_desc, [(bhk * SK_PAD + j * BLOCK_N) // 16, 0, 0, 0, 0],
                                            k_ready.index(s), _as_tma_box(k_smem.index(s), k_desc))
        else:
            tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s),
                                            _as_tma_box(k_smem.index(s), k_desc))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), vt_desc.block_type.nbytes)
        # V^T [d, Sk_pad]: the box is all d rows x BLOCK_N key columns
        tma.async_copy_global_to_shared(vt_desc, [b, hk, 0, j * BLOCK_N], v_ready.index(s),
                                        _as_tma_box(v_smem.index(s), vt_desc))


@gluon.jit
def _f8_mask(s, n0, rows, SEQ_K, diag_off, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
             PERMUTE_K: gl.constexpr):
    c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if PERMUTE_K:  # score column c = 16 g + 8 jl + 2 q + e holds key 16 g + 4 q + 2 jl + e
        c = (c & ~15) + ((c >> 1) & 3) * 4 + ((c >> 3) & 1) * 2 + (c & 1)
    cols = n0 + c
    if CAUSAL:  # the Sk bound folded into each row's last visible key: one compare per element (as _fa_mask)
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(gl.minimum(rows + diag_off, SEQ_K - 1), 1)
    else:
        keep = gl.expand_dims(cols < SEQ_K, 0)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _f8_p_operand(p, fp8: gl.constexpr, p_layout: gl.constexpr, PERMUTE_K: gl.constexpr):
    """fp32 P (wgmma accumulator layout) -> e4m3 A operand of the PV wgmma (k_width 4)."""
    if PERMUTE_K:
        # relabel in fp32 (pure register renaming), cast in the operand layout: F2FP pairs + one PRMT per 4 keys
        R0: gl.constexpr = p.shape[0]
        N0: gl.constexpr = p.shape[1]
        p = gl.reshape(p, [R0, N0 // 16, 2, 4, 2])
        p = gl.permute(p, (0, 1, 3, 2, 4))
        p = gl.reshape(p, [R0, N0])
        return gl.convert_layout(p, p_layout).to(fp8)
    p8 = p.to(fp8)
    if PERMUTE_K:
        # Column 16 g + 8 jl + 2 q + e holds key 16 g + 4 q + 2 jl + e (K rows were loaded permuted): relabel the
        # columns by their key (swap the jl and q axes). In the accumulator layout lane q of a quad owns columns
        # 2 q + e + 8 jl, so after the relabelling it owns keys 4 q .. 4 q + 3 of each 16: the fp8 A-fragment
        # layout, and the convert_layout below should need no data movement between threads.
        R: gl.constexpr = p8.shape[0]
        N: gl.constexpr = p8.shape[1]
        p8 = gl.reshape(p8, [R, N // 16, 2, 4, 2])
        p8 = gl.permute(p8, (0, 1, 3, 2, 4))
        p8 = gl.reshape(p8, [R, N])
    return gl.convert_layout(p8, p_layout)


@gluon.constexpr_function
def _ablates(ablate, bit):
    """ABLATE (timing-only builds): is ``bit`` of the mask set? ``ablate`` is None when the kernel's ABLATE
    constexpr is not passed (offline builds without it), 0 when a launch leaves it at its default."""
    return bool(ablate) and (int(ablate) & int(bit)) != 0


@gluon.jit
def _f8_softmax(s, m_i, l_i, c, POLY_EXP: gl.constexpr = 0, ABLATE: gl.constexpr = 0):
    """Online-softmax step on raw fp8-dot scores s; c = qs * ks_j * scale * log2(e) > 0.

    m_i / m_new are in log2 units (scaled). Returns (p = exp2(s c - m + 8) fp32, m_new, l_new, alpha).
    POLY_EXP > 0: that many of every 16 per-thread exp2s by the FMA-pipe polynomial (masked -inf scores still give
    exactly 0; alpha stays on MUFU).
    ABLATE (timing only, WRONG results; docs/kernels.md "ablate"): bit 2 replaces the row max by a per-block scalar
    (no FMNMX / SHFL), bit 1 drops both exp2s (P = s c - m + 8 and alpha = 1 + max(m_i - m, -1/2): no MUFU), bit 64
    drops the row sum (l = l alpha)."""
    if _ablates(ABLATE, 2):
        m_new = gl.zeros_like(m_i) + c * 8.0
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * c)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    if _ablates(ABLATE, 1):
        alpha = 1.0 + gl.maximum(m_i - m_use, -0.5)
        p = s * c - gl.expand_dims(m_use - 8.0, 1)
    else:
        alpha = gl.exp2(m_i - m_use)
        if POLY_EXP:  # (None when the kernel's POLY_EXP is not passed, as for every build without it)
            p = _exp2_mixed(s * c - gl.expand_dims(m_use - 8.0, 1), POLY_EXP)
        else:
            p = gl.exp2(s * c - gl.expand_dims(m_use - 8.0, 1))  # one FFMA + MUFU.EX2 per score; 8.0 = P_SHIFT
    if _ablates(ABLATE, 64):
        l_new = l_i * alpha
    else:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _pp_wait(turn, WG: gl.constexpr, k):
    """PINGPONG: block until warpgroup WG may issue its k-th GEMM group (k = 0: block 0, k = i: step i, k = n: tail).

    ``turn.index(w)`` (count 1) is arrived on by the OTHER warpgroup once per issued group. Warpgroup 0 waits for
    phase k - 1 of turn[0] (k = 0: parity 1 = the phase before the first, complete at init: no wait), warpgroup 1 for
    phase k of turn[1]. Each warpgroup's arrivals can run at most one ahead of the other's waits, so a count-1
    barrier's parity never aliases (docs/kernels.md, "pingpong")."""
    mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _pp_arrive(turn, WG: gl.constexpr):
    """PINGPONG: warpgroup WG issued its GEMM group: the other warpgroup may issue its next one."""
    mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, m_i, l_i, vs_prev,
             ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
             QB: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr,
             PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr, turn=None, WG: gl.constexpr = 0,
             PINGPONG: gl.constexpr = False, POLY_EXP: gl.constexpr = 0, ABLATE: gl.constexpr = 0,
             sink=None):
    """Key block i >= 1 (see the design notes in docs/kernels.md). Straight-line from the first wgmma issue to the last wait (a
    branch in between makes ptxas wait for everything at the join; attention_gluon.py's _fa_step).

    CAST_LATE: ``p8`` is the fp32 P_{i-1} (accumulator layout); it is cast to the e4m3 A operand between the QK_i
    issue and the PV_{i-1} issue (while QK_i runs), and the fp32 P_i is returned in its place.

    PINGPONG: the QK_i + PV_{i-1} issue group is the warpgroup's i-th turn (``_pp_wait`` before the QK_i issue,
    ``_pp_arrive`` right after the PV_{i-1} issue); nothing else changes.

    ABLATE (timing only, WRONG results, CAST_LATE builds; docs/kernels.md "ablate"): bit 16: no QK_i wgmma, S_i :=
    the fp32 P_{i-1} (loop state, so nothing downstream is loop-invariant); bit 32: no e4m3 cast, the PV A operand is
    a constant e4m3 tile; bit 8: no PV wgmma, the e4m3 A operand is stored to the warpgroup's ``sink`` tile in
    shared memory instead (keeps the cast alive), S waited for with nothing else in flight; bit 4: no O rescale;
    bits 1 / 2 / 64 in ``_f8_softmax``. The mbarrier waits / releases of K and V stay, so the producer runs as
    before."""
    fp8: gl.constexpr = q_buf.dtype
    NO_QK: gl.constexpr = _ablates(ABLATE, 16)
    NO_PV: gl.constexpr = _ablates(ABLATE, 8)
    # block scales of key block i (issued before the waits so their latency hides behind them)
    c = qk_scale * gl.load(ks_base + (i * BLOCK_N) // QB)
    vs_i = gl.load(vs_base + (i * BLOCK_N) // QB)
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    if PINGPONG:
        _pp_wait(turn, WG, i)
    if NO_QK:
        s = p8
    else:
        s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    if CAST_LATE:
        if _ablates(ABLATE, 32):
            # e4m3 1.0 (0x38) everywhere (gl.full has no fp8 constants: int8 bit pattern, bitcast)
            a8 = gl.full([p8.shape[0], p8.shape[1]], 0x38, gl.int8, layout=p_layout).to(fp8, bitcast=True)
        else:
            a8 = _f8_p_operand(p8, fp8, p_layout, PERMUTE_K)
    else:
        a8 = p8
    jv = i - 1
    vslot = jv % STAGES
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    if NO_PV:
        sink.store(a8)
    else:
        o = warpgroup_mma(a8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    if PINGPONG:
        _pp_arrive(turn, WG)
    if NO_QK:
        pass
    elif NO_PV:
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _f8_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
    p, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c, POLY_EXP, ABLATE)
    # deps=[o] only: Triton 3.6 cannot lower an 8-bit tensor as a wait dependency ("Unexpected bitwidth in
    # WGMMAWaitGroupOp: 8"); ptxas itself keeps P8's registers untouched while the wgmma that reads them runs.
    if not NO_PV:
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)
    # O was in units of vs_{i-1}; after this it is in units of vs_i (the PV_i about to be added)
    if not _ablates(ABLATE, 4):
        o = o * gl.expand_dims(gl.convert_layout(alpha * (vs_prev / vs_i), orow_layout), 1)
    if CAST_LATE:
        p8 = p
    else:
        p8 = _f8_p_operand(p, fp8, p_layout, PERMUTE_K)
    return s, o, p8, m_i, l_i, vs_i


@gluon.jit
def _f8_step_overlap(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, f, m_i, l_i, vs_prev,
                     pin_buf, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                     QB: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr,
                     PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr, POLY_EXP: gl.constexpr = 0):
    """OVERLAP step (key block i >= 1), FA3's order as in attention_gluon.py's ``_fa_step_overlap``: issue
    S_i = Q K_i^T; O *= f_{i-1} (the factor alpha_{i-1} * vs_{i-2} / vs_{i-1} owed by the previous softmax, while
    S_i runs; with CAST_LATE the e4m3 cast of P_{i-1} is in the same window); issue O += P8_{i-1} V_{i-1}; wait for
    S_i; softmax_i; store l_i to the warpgroup's ``pin_buf`` (never read); wait for PV_{i-1}. Returns f_i instead of
    applying it.

    Same arithmetic as ``_f8_step``: the operations on O are the same sequence (+PV_0, *f_1, +PV_1, *f_2, ...,
    *f_{n-1}, +PV_{n-1}); only the point where each multiply is issued moves (after the wait -> before the next PV
    issue, with nothing in between that touches O), and f_i = alpha_i * (vs_{i-1} / vs_i) is the same fp32
    expression. The pin store depends on l_i = l * alpha + rowsum(exp2(...)), i.e. on every exp2 of the step, and
    ptxas 12.8 does not hoist ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` above a shared-memory store."""
    fp8: gl.constexpr = q_buf.dtype
    c = qk_scale * gl.load(ks_base + (i * BLOCK_N) // QB)
    vs_i = gl.load(vs_base + (i * BLOCK_N) // QB)
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    jv = i - 1
    vslot = jv % STAGES
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    o = o * gl.expand_dims(gl.convert_layout(f, orow_layout), 1)
    if CAST_LATE:
        a8 = _f8_p_operand(p8, fp8, p_layout, PERMUTE_K)
    else:
        a8 = p8
    o = warpgroup_mma(a8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _f8_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
    p, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c, POLY_EXP)
    f = alpha * (vs_prev / vs_i)
    pin_buf.store(l_i)
    o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)
    if CAST_LATE:
        p8 = p
    else:
        p8 = _f8_p_operand(p, fp8, p_layout, PERMUTE_K)
    return s, o, p8, f, m_i, l_i, vs_i


@gluon.jit
def _f8_consumer(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready,
                 v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                 sm_scale_log2, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr, PERMUTE_K: gl.constexpr,
                 CAST_LATE: gl.constexpr, OVERLAP: gl.constexpr = False, pin=None, PINGPONG: gl.constexpr = False,
                 turn=None, POLY_EXP: gl.constexpr = 0, ABLATE: gl.constexpr = 0, sink=None):
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
    n_full = SEQ_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
    n_full = gl.minimum(n_full, n_blocks)

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
    if PINGPONG:
        _pp_wait(turn, WG, 0)
    s = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        _pp_arrive(turn, WG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        s = _f8_mask(s, 0, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
    p, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c0, POLY_EXP)
    if CAST_LATE:
        p8 = p
    else:
        p8 = _f8_p_operand(p, q_buf.dtype, p_layout, PERMUTE_K)

    if OVERLAP:
        # FA3 order (_f8_step_overlap): the O rescale f is applied before the next PV issue. Block 0 owes
        # f_0 = alpha_0 = 0 (m was -inf), which multiplies the zero O.
        pin_buf = pin.index(WG)
        f = alpha
        for i in range(1, n_full):
            s, o, p8, f, m_i, l_i, vs_prev = _f8_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, f, m_i, l_i, vs_prev,
                pin_buf, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off, BLOCK_N, STAGES, CAUSAL, False, QB,
                s_layout, p_layout, orow_layout, PERMUTE_K, CAST_LATE, POLY_EXP)
        for i in range(gl.maximum(n_full, 1), n_blocks):
            s, o, p8, f, m_i, l_i, vs_prev = _f8_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, f, m_i, l_i, vs_prev,
                pin_buf, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off, BLOCK_N, STAGES, CAUSAL, True, QB,
                s_layout, p_layout, orow_layout, PERMUTE_K, CAST_LATE, POLY_EXP)
        # ---- tail: O = O * f_{n-1} + P8_{n-1} V_{n-1}
        jv = n_blocks - 1
        vslot = jv % STAGES
        o = o * gl.expand_dims(gl.convert_layout(f, orow_layout), 1)
        if CAST_LATE:
            p8 = _f8_p_operand(p8, q_buf.dtype, p_layout, PERMUTE_K)
        mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
        o = warpgroup_mma(p8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        mbarrier.arrive(v_empty.index(vslot), count=1)
    else:
        if _ablates(ABLATE, 8):
            sink_buf = sink.index(WG)  # ABLATE bit 8: the e4m3 P tile goes here instead of into the PV wgmma
        else:
            sink_buf = None
        for i in range(1, n_full):
            s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                                   o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows, SEQ_K,
                                                   diag_off, BLOCK_N, STAGES, CAUSAL, False, QB, s_layout, p_layout,
                                                   orow_layout, PERMUTE_K, CAST_LATE, turn, WG, PINGPONG,
                                                   POLY_EXP, ABLATE, sink_buf)
        for i in range(gl.maximum(n_full, 1), n_blocks):
            s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                                   o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows, SEQ_K,
                                                   diag_off, BLOCK_N, STAGES, CAUSAL, True, QB, s_layout, p_layout,
                                                   orow_layout, PERMUTE_K, CAST_LATE, turn, WG, PINGPONG,
                                                   POLY_EXP, ABLATE, sink_buf)

        # ---- tail: O += P8_{n-1} V_{n-1}
        jv = n_blocks - 1
        vslot = jv % STAGES
        if CAST_LATE:
            p8 = _f8_p_operand(p8, q_buf.dtype, p_layout, PERMUTE_K)
        mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
        if PINGPONG:
            # the n-th turn; WG 1's last arrive (on turn[0]) is never waited for: harmless, the kernel ends
            _pp_wait(turn, WG, n_blocks)
        o = warpgroup_mma(p8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
        if PINGPONG:
            _pp_arrive(turn, WG)
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
    tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], _as_tma_box(o_buf, o_desc))
    tma.store_wait(0)


# ---- MMA_ROWSUM / LAZY_RESCALE (opt-in; docs/kernels.md "mma_rowsum" / "lazy_rescale")


@gluon.jit
def _f8_softmax_x(s, m_i, l_i, c, lv, inv_w, MMA_ROWSUM: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr,
                  SHIFT: gl.constexpr):
    """``_f8_softmax`` for the MMA_ROWSUM / LAZY_RESCALE builds. Returns (p, m_new, l_new, alpha, need).

    MMA_ROWSUM: no row sum here (the PV step's extra wgmma P8 x ones computes it); l_i is passed through.
    LAZY (TAU in log2 units): the candidate max includes lv = log2(vs_i / vs_0) (O is kept in units of vs_0, so P
    carries the V-scale ratio: p = exp2(s c + lv - m + SHIFT)). The running max moves only when some row of the
    warpgroup would grow by more than TAU (``need``, a warpgroup-uniform scalar); otherwise the stale max stays and
    alpha is exactly 1, so p <= 2^(SHIFT + TAU). The l update weights the row sum by inv_w = 2^-lv (l sums p
    without the V-scale ratio). Without LAZY: ``_f8_softmax`` with the shift SHIFT and need = False."""
    if LAZY:
        m_cand = gl.maximum(m_i, gl.max(s, axis=1) * c + lv)
        need = gl.max((m_cand > m_i + TAU).to(gl.int32), axis=0) > 0
        m_new = gl.where(need, m_cand, m_i)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * c - gl.expand_dims(m_use - (SHIFT + lv), 1))
        if MMA_ROWSUM:
            l_new = l_i
        else:
            l_new = l_i * alpha + gl.sum(p, axis=1) * inv_w
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * c)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * c - gl.expand_dims(m_use - SHIFT, 1))
        need = True
        if MMA_ROWSUM:
            l_new = l_i
        else:
            l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha, need


@gluon.jit
def _f8_rowsum_update(rs, r, alpha, inv_w, rs_row: gl.constexpr, LAZY: gl.constexpr):
    """MMA_ROWSUM accumulator after the step's waits. Without LAZY the rowsum wgmma accumulated into rs (use_acc):
    rs *= alpha, the same sequence as O. With LAZY it wrote the block's sums alone (r): rs = (rs + r inv_w) alpha."""
    a2 = gl.expand_dims(gl.convert_layout(alpha, rs_row), 1)
    if LAZY:
        rs = (rs + r * inv_w) * a2
    else:
        rs = r * a2
    return rs


@gluon.jit
def _f8_step_x(i, q_buf, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, rs, m_i, l_i,
               vs_prev, w_prev, vs_ref_log2, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
               QB: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr,
               rs_layout: gl.constexpr, rp_layout: gl.constexpr, PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr,
               MMA_ROWSUM: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr, SHIFT: gl.constexpr):
    """``_f8_step`` (key block i >= 1) of the MMA_ROWSUM / LAZY_RESCALE builds.

    MMA_ROWSUM: right after the PV_{i-1} issue, RS_{i-1} = P8_{i-1} x ones [BLOCK_N, 8] (e4m3 in shared memory,
    filled once by the kernel prologue), a third async wgmma on the same A registers, so the S_i wait allows two
    groups in flight and the final wait covers both PV and RS. Every column of RS is the row sum of the quantized
    P8_{i-1}: exactly the weights the numerator P8 V uses.
    LAZY: O is in units of vs_0 (block 0's V scale) for the whole loop; its 64 FMULs per thread run only in a
    branch taken when ``need`` (a warpgroup-uniform scalar, after the last wait: nothing in flight at the join).
    ``w_prev`` = the inv_w (vs_0 / vs_{i-1}) of the P carried in ``p8``."""
    fp8: gl.constexpr = q_buf.dtype
    c = qk_scale * gl.load(ks_base + (i * BLOCK_N) // QB)
    vs_i = gl.load(vs_base + (i * BLOCK_N) // QB)
    if LAZY:
        lv = gl.log2(vs_i) - vs_ref_log2
        w_i = gl.exp2(-lv)
    else:
        lv = 0.0
        w_i = w_prev  # unused (a loop-invariant carried value)
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    if CAST_LATE:
        a8 = _f8_p_operand(p8, fp8, p_layout, PERMUTE_K)
    else:
        a8 = p8
    jv = i - 1
    vslot = jv % STAGES
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    o = warpgroup_mma(a8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    if MMA_ROWSUM:
        r = warpgroup_mma(gl.convert_layout(a8, rp_layout), ones_smem.permute((1, 0)), rs, use_acc=not LAZY,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=2, deps=[s])
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _f8_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
    p, m_i, l_i, alpha, need = _f8_softmax_x(s, m_i, l_i, c, lv, w_i, MMA_ROWSUM, LAZY, TAU, SHIFT)
    if MMA_ROWSUM:
        o, r = warpgroup_mma_wait(num_outstanding=0, deps=[o, r])
    else:
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)
    if MMA_ROWSUM:
        rs = _f8_rowsum_update(rs, r, alpha, w_prev, gl.SliceLayout(1, rs_layout), LAZY)
    if LAZY:
        if need:
            o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        vs_i = vs_prev  # O stays in units of vs_0
    else:
        o = o * gl.expand_dims(gl.convert_layout(alpha * (vs_prev / vs_i), orow_layout), 1)
    if CAST_LATE:
        p8 = p
    else:
        p8 = _f8_p_operand(p, fp8, p_layout, PERMUTE_K)
    return s, o, p8, rs, m_i, l_i, vs_i, w_i


@gluon.jit
def _f8_consumer_x(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, o_smem, ones_smem, q_bars, k_ready, k_empty,
                   v_ready, v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB,
                   NKB, sm_scale_log2, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr, PERMUTE_K: gl.constexpr,
                   CAST_LATE: gl.constexpr, MMA_ROWSUM: gl.constexpr, LAZY: gl.constexpr):
    """``_f8_consumer`` of the MMA_ROWSUM / LAZY_RESCALE builds (block 0, loops of ``_f8_step_x``, tail, epilogue).
    l is either the row vector l_i (FADD row sums) or, with MMA_ROWSUM, the [64, RS_N] accumulator rs whose columns
    are all equal (reduced once in the epilogue)."""
    TAU: gl.constexpr = LAZY_TAU_C
    SHIFT: gl.constexpr = 8.0 - TAU if LAZY else 8.0
    ROWS: gl.constexpr = q_smem.type.shape[1]
    RS_N: gl.constexpr = RS_N_C
    out_dtype: gl.constexpr = o_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    rs_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, RS_N, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    rp_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=rs_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    row_first = m0 + WG * ROWS
    rows = row_first + gl.arange(0, ROWS, layout=row_layout)
    diag_off = SEQ_K - SEQ_Q
    n_full = SEQ_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
    n_full = gl.minimum(n_full, n_blocks)

    qk_scale = gl.load(qs_ptr + bh * NQB + m0 // QB) * sm_scale_log2
    ks_base = ks_ptr + bhk * NKB
    vs_base = vs_ptr + bhk * NKB

    q_buf = q_smem.index(WG)
    mbarrier.wait(q_bars.index(WG), 0)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    rs = gl.zeros([ROWS, RS_N], gl.float32, layout=rs_layout)

    # ---- block 0 (vs_0 = the reference V scale of LAZY: lv_0 = 0, inv_w_0 = 1)
    c0 = qk_scale * gl.load(ks_base)
    vs_prev = gl.load(vs_base)
    vs_ref_log2 = gl.log2(vs_prev)
    w_prev = gl.to_tensor(1.0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        s = _f8_mask(s, 0, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
    p, m_i, l_i, alpha, need = _f8_softmax_x(s, m_i, l_i, c0, 0.0, 1.0, MMA_ROWSUM, LAZY, TAU, SHIFT)
    if CAST_LATE:
        p8 = p
    else:
        p8 = _f8_p_operand(p, q_buf.dtype, p_layout, PERMUTE_K)

    for i in range(1, n_full):
        s, o, p8, rs, m_i, l_i, vs_prev, w_prev = _f8_step_x(
            i, q_buf, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, rs, m_i, l_i,
            vs_prev, w_prev, vs_ref_log2, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off, BLOCK_N, STAGES,
            CAUSAL, False, QB, s_layout, p_layout, orow_layout, rs_layout, rp_layout, PERMUTE_K, CAST_LATE,
            MMA_ROWSUM, LAZY, TAU, SHIFT)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        s, o, p8, rs, m_i, l_i, vs_prev, w_prev = _f8_step_x(
            i, q_buf, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, s, o, p8, rs, m_i, l_i,
            vs_prev, w_prev, vs_ref_log2, ks_base, vs_base, qk_scale, rows, SEQ_K, diag_off, BLOCK_N, STAGES,
            CAUSAL, True, QB, s_layout, p_layout, orow_layout, rs_layout, rp_layout, PERMUTE_K, CAST_LATE,
            MMA_ROWSUM, LAZY, TAU, SHIFT)

    # ---- tail: O += P8_{n-1} V_{n-1} (and RS_{n-1})
    jv = n_blocks - 1
    vslot = jv % STAGES
    if CAST_LATE:
        p8 = _f8_p_operand(p8, q_buf.dtype, p_layout, PERMUTE_K)
    mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
    o = warpgroup_mma(p8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
    if MMA_ROWSUM:
        r = warpgroup_mma(gl.convert_layout(p8, rp_layout), ones_smem.permute((1, 0)), rs, use_acc=not LAZY,
                          is_async=True)
        o, r = warpgroup_mma_wait(num_outstanding=0, deps=[o, r])
        if LAZY:
            rs = rs + r * w_prev
        else:
            rs = r
        l_i = gl.convert_layout(gl.max(rs, axis=1), row_layout)  # all RS_N columns are the same sum
    else:
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    mbarrier.arrive(v_empty.index(vslot), count=1)

    # ---- epilogue: O * vs / l (vs = vs_{n-1}; LAZY: vs_0); 0 for rows without a visible key
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = o * gl.expand_dims(gl.convert_layout(vs_prev / l_safe, orow_layout), 1)
    if WRITE_LSE:
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe) - SHIFT) * 0.6931471805599453)
        gl.store(lse_ptr + bh.to(gl.int64) * SEQ_Q + rows, lse, mask=rows < SEQ_Q)
    o_buf = o_smem.index(WG)
    o_buf.store(o.to(out_dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], _as_tma_box(o_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _f8_consumer_wg0(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty, qs_ptr,
                     ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     WRITE_LSE: gl.constexpr, QB: gl.constexpr, PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr,
                     POLY_EXP: gl.constexpr = 0, OVERLAP: gl.constexpr = False, pin=None,
                     PINGPONG: gl.constexpr = False, turn=None, MMA_ROWSUM: gl.constexpr = False,
                     LAZY_RESCALE: gl.constexpr = False, ones=None, ABLATE: gl.constexpr = 0, sink=None):
    if MMA_ROWSUM or LAZY_RESCALE:
        _f8_consumer_x(0, o_desc, q_smem, k_smem, v_smem, o_smem, ones, q_bars, k_ready, k_empty, v_ready, v_empty,
                       qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                       sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K, CAST_LATE,
                       MMA_ROWSUM, LAZY_RESCALE)
        return
    _f8_consumer(0, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty, qs_ptr,
                 ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2,
                 HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K, CAST_LATE, OVERLAP, pin, PINGPONG, turn,
                 POLY_EXP, ABLATE, sink)


@gluon.jit
def _f8_consumer_wg1(o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty, qs_ptr,
                     ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     WRITE_LSE: gl.constexpr, QB: gl.constexpr, PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr,
                     POLY_EXP: gl.constexpr = 0, OVERLAP: gl.constexpr = False, pin=None,
                     PINGPONG: gl.constexpr = False, turn=None, MMA_ROWSUM: gl.constexpr = False,
                     LAZY_RESCALE: gl.constexpr = False, ones=None, ABLATE: gl.constexpr = 0, sink=None):
    if MMA_ROWSUM or LAZY_RESCALE:
        _f8_consumer_x(1, o_desc, q_smem, k_smem, v_smem, o_smem, ones, q_bars, k_ready, k_empty, v_ready, v_empty,
                       qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                       sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K, CAST_LATE,
                       MMA_ROWSUM, LAZY_RESCALE)
        return
    _f8_consumer(1, o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty, qs_ptr,
                 ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2,
                 HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K, CAST_LATE, OVERLAP, pin, PINGPONG, turn,
                 POLY_EXP, ABLATE, sink)


@gluon.jit
def _fp8_fa3_fwd_kernel(q_desc, k_desc, vt_desc, o_desc, qs_ptr, ks_ptr, vs_ptr, lse_ptr, sm_scale_log2,
                        H, GROUP, H_KV, SEQ_Q, SEQ_K, NQB, NKB, NUM_M_BLOCKS,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        WRITE_LSE: gl.constexpr, QB: gl.constexpr, PERMUTE_K: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CAST_LATE: gl.constexpr,
                        OVERLAP: gl.constexpr = False, PINGPONG: gl.constexpr = False,
                        POLY_EXP: gl.constexpr = 0, MMA_ROWSUM: gl.constexpr = False,
                        LAZY_RESCALE: gl.constexpr = False, ABLATE: gl.constexpr = 0):
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
    if PINGPONG:
        # turn[w]: arrived on once per GEMM issue group by the other consumer warpgroup (_pp_wait / _pp_arrive)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    if MMA_ROWSUM or LAZY_RESCALE:
        # the B operand of the row-sum wgmma: [RS_N, BLOCK_N] e4m3 ones (K-major after permute), read by both
        # consumer warpgroups; written here by the default warps before the partitions start (LAZY_RESCALE alone:
        # allocated, unused: warp_specialize takes no None arguments)
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RS_N_C, BLOCK_N], fp8)
        ones = gl.allocate_shared_memory(fp8, [RS_N_C, BLOCK_N], ones_layout)
        if MMA_ROWSUM:
            # e4m3 1.0 as its bit pattern 0x38 (int8, bitcast), NOT gl.full(1.0, fp32).to(fp8): that splat became
            # cvt.rn.satfinite.e4m3x2.f32 + mov.b32 {%rs, %rs}, which ptxas 12.8 miscompiles into one
            # F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C whose C operand (the upper 16 bits of every 32-bit word) is
            # an unrelated register (the thread id): keys 4j + 2 got weight e4m3(tid) (up to 448, or NaN), keys
            # 4j + 3 weight 0 (docs/kernels.md "mma_rowsum")
            fill_layout: gl.constexpr = gl.BlockedLayout([1, 16], [RS_N_C // 4, 32 // (RS_N_C // 4)], [4, 1],
                                                         [1, 0])
            ones.store(gl.full([RS_N_C, BLOCK_N], 0x38, gl.int8, layout=fill_layout).to(fp8, bitcast=True))
    fence_async_shared()

    if MMA_ROWSUM or LAZY_RESCALE:
        gl.static_assert(not (OVERLAP or PINGPONG or POLY_EXP), "mma_rowsum / lazy_rescale: not with overlap, "
                         "pingpong or poly_exp")
        gl.warp_specialize([
            (_f8_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, 0, False, None, False, None, MMA_ROWSUM, LAZY_RESCALE, ones)),
            (_f8_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, 0, False, None, False, None, MMA_ROWSUM, LAZY_RESCALE, ones)),
            (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES, PERMUTE_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif OVERLAP:
        # a [ROWS] fp32 slot per consumer warpgroup for the row-sum store that pins the PV wait (never read)
        pin = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_f8_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP, True, pin)),
            (_f8_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP, True, pin)),
            (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES, PERMUTE_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif PINGPONG:
        gl.warp_specialize([
            (_f8_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP, False, turn, True, turn)),
            (_f8_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP, False, turn, True, turn)),
            (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES, PERMUTE_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif _ablates(ABLATE, ABLATE_ALL_C):
        # TIMING ONLY (docs/kernels.md "ablate"): parts of the step left out, results wrong. ``sink``: one e4m3
        # [ROWS, BLOCK_N] tile per consumer warpgroup, written instead of the PV wgmma by bit 8, never read
        gl.static_assert(CAST_LATE and not (OVERLAP or PINGPONG or POLY_EXP),
                         "ablate: cast_late builds without overlap / pingpong / poly_exp only")
        sink = gl.allocate_shared_memory(fp8, [2, ROWS, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        gl.warp_specialize([
            (_f8_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, 0, False, None, False, None, False, False, None, ABLATE, sink)),
            (_f8_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, 0, False, None, False, None, False, False, None, ABLATE, sink)),
            (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES, PERMUTE_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_f8_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP)),
            (_f8_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                qs_ptr, ks_ptr, vs_ptr, lse_ptr, bh, bhk, b, h, m0, n_blocks, SEQ_Q, SEQ_K, NQB, NKB,
                                sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QB, PERMUTE_K,
                                CAST_LATE, POLY_EXP)),
            (_f8_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, bhk, m0, n_blocks, NKB * QB, BLOCK_N, STAGES, PERMUTE_K)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- persistent=True: one CTA per SM looping over work items (docs/kernels.md, "persistent")


@gluon.jit
def _f8_producer_persistent(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, pid, P, n_local, H, GROUP, H_KV, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                            SK_PAD, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            SCHED: gl.constexpr, PERMUTE_K: gl.constexpr):
    """One warp. Item t: Q of both warpgroups into Q buffer t % 2 (its use t // 2), then K_j / V^T_j of the item
    through the ring at the CTA-wide block counter g = g0 + j (slot g % STAGES, use g // STAGES). Runs ahead into
    item t + 1 as soon as buffers / slots are released (attention_gluon.py's ``_fa_producer_persistent``)."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    g0 = 0
    for t in range(n_local):
        bh, pid_m = _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED, CAUSAL)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        bhk = b * H_KV + hk
        m0 = pid_m * (2 * ROWS)
        n_blocks = _fa_tile_blocks(m0, SEQ_Q, SEQ_K, 2 * ROWS, BLOCK_N, CAUSAL)
        qb = t % 2
        # use u = t // 2 of Q buffer qb waits for consumer w's release of use u - 1 (item t - 2); parity
        # (u & 1) ^ 1 passes at once for u = 0 on a fresh barrier
        q_phase = ((t // 2) & 1) ^ 1
        for w in gl.static_range(2):
            mbarrier.wait(q_empty.index(2 * qb + w), q_phase)
            mbarrier.expect(q_ready.index(2 * qb + w), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_ready.index(2 * qb + w),
                                            _as_tma_box(q_smem.index(2 * qb + w), q_desc))
        for g in range(g0, g0 + n_blocks):
            s = g % STAGES
            empty_phase = ((g // STAGES) & 1) ^ 1
            n0 = (g - g0) * BLOCK_N
            mbarrier.wait(k_empty.index(s), empty_phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            if PERMUTE_K:  # the 5-D K view of _f8_producer
                tma.async_copy_global_to_shared(k_desc, [(bhk * SK_PAD + n0) // 16, 0, 0, 0, 0], k_ready.index(s),
                                                _as_tma_box(k_smem.index(s), k_desc))
            else:
                tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], k_ready.index(s),
                                                _as_tma_box(k_smem.index(s), k_desc))
            mbarrier.wait(v_empty.index(s), empty_phase)
            mbarrier.expect(v_ready.index(s), vt_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(vt_desc, [b, hk, 0, n0], v_ready.index(s),
                                            _as_tma_box(v_smem.index(s), vt_desc))
        g0 += n_blocks


@gluon.jit
def _f8_consumer_persistent(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                            k_empty, v_ready, v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP,
                            H_KV, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2,
                            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr,
                            PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr, POLY_EXP: gl.constexpr = 0):
    """Consumer warpgroup WG of the persistent kernel: per item exactly ``_f8_consumer``'s block 0, loops
    (``_f8_step``), tail and epilogue, indexed by the ring position (CTA-wide key-block counter) g0 + j. The K / V
    scale pointers are shifted by -g0 blocks and Sk / the diagonal offset by +g0 * BLOCK_N so that ``_f8_step``'s
    scale loads and mask comparisons see the same values as in the default build (BLOCK_N == QB: one scale per
    block). Q comes from buffer t % 2 and is handed back (``q_empty``) once the item's last QK wgmma was waited for;
    the O tile goes through the warpgroup's own staging buffer, whose TMA store is waited for only right before the
    next item's epilogue writes it."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    out_dtype: gl.constexpr = o_smem.dtype
    fp8: gl.constexpr = q_smem.dtype
    gl.static_assert(BLOCK_N == QB, "persistent: one K / V scale per key block (scale pointers shifted by blocks)")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    diag_off = SEQ_K - SEQ_Q
    o_buf = o_smem.index(WG)
    g0 = 0  # ring position of the item's block 0
    for t in range(n_local):
        bh, pid_m = _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED, CAUSAL)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        bhk = b * H_KV + hk
        m0 = pid_m * (2 * ROWS)
        n_blocks = _fa_tile_blocks(m0, SEQ_Q, SEQ_K, 2 * ROWS, BLOCK_N, CAUSAL)
        row_first = m0 + WG * ROWS
        rows = row_first + gl.arange(0, ROWS, layout=row_layout)
        n_full = SEQ_K // BLOCK_N
        if CAUSAL:
            n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
        n_full = gl.minimum(n_full, n_blocks)

        qk_scale = gl.load(qs_ptr + bh * NQB + m0 // QB) * sm_scale_log2
        ks_base = ks_ptr + (bhk * NKB - g0)  # + ring position = key block j's scale
        vs_base = vs_ptr + (bhk * NKB - g0)
        seq_k_sh = SEQ_K + g0 * BLOCK_N
        diag_sh = diag_off + g0 * BLOCK_N

        qb = t % 2
        q_buf = q_smem.index(2 * qb + WG)
        mbarrier.wait(q_ready.index(2 * qb + WG), (t // 2) & 1)

        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

        # ---- block 0 (ring position g0)
        c0 = qk_scale * gl.load(ks_base + g0)
        vs_prev = gl.load(vs_base + g0)
        ks0 = g0 % STAGES
        mbarrier.wait(k_ready.index(ks0), (g0 // STAGES) & 1)
        s = warpgroup_mma(q_buf, k_smem.index(ks0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        mbarrier.arrive(k_empty.index(ks0), count=1)
        if n_full == 0:
            s = _f8_mask(s, g0 * BLOCK_N, rows, seq_k_sh, diag_sh, BLOCK_N, CAUSAL, s_layout, PERMUTE_K)
        p, m_i, l_i, alpha = _f8_softmax(s, m_i, l_i, c0, POLY_EXP)
        if CAST_LATE:
            p8 = p
        else:
            p8 = _f8_p_operand(p, fp8, p_layout, PERMUTE_K)

        # ---- key blocks 1 .. n_blocks - 1 at ring positions g0 + 1 .. g0 + n_blocks - 1
        for i in range(g0 + 1, g0 + n_full):
            s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                                   o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows,
                                                   seq_k_sh, diag_sh, BLOCK_N, STAGES, CAUSAL, False, QB, s_layout,
                                                   p_layout, orow_layout, PERMUTE_K, CAST_LATE, None, WG, False,
                                                   POLY_EXP)
        for i in range(g0 + gl.maximum(n_full, 1), g0 + n_blocks):
            s, o, p8, m_i, l_i, vs_prev = _f8_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s,
                                                   o, p8, m_i, l_i, vs_prev, ks_base, vs_base, qk_scale, rows,
                                                   seq_k_sh, diag_sh, BLOCK_N, STAGES, CAUSAL, True, QB, s_layout,
                                                   p_layout, orow_layout, PERMUTE_K, CAST_LATE, None, WG, False,
                                                   POLY_EXP)
        # every QK wgmma of the item has been waited for: the Q buffer goes back to the producer (item t + 2's Q)
        mbarrier.arrive(q_empty.index(2 * qb + WG), count=1)

        # ---- tail: O += P8_{n-1} V_{n-1}
        jv = g0 + n_blocks - 1
        vslot = jv % STAGES
        if CAST_LATE:
            p8 = _f8_p_operand(p8, fp8, p_layout, PERMUTE_K)
        mbarrier.wait(v_ready.index(vslot), (jv // STAGES) & 1)
        o = warpgroup_mma(p8, v_smem.index(vslot).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        mbarrier.arrive(v_empty.index(vslot), count=1)
        g0 += n_blocks

        # ---- epilogue (as _f8_consumer's), the TMA store left in flight until the next item's epilogue
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        o = o * gl.expand_dims(gl.convert_layout(vs_prev / l_safe, orow_layout), 1)
        if WRITE_LSE:
            lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe) - 8.0) * 0.6931471805599453)
            # bh * Sq in 64 bits, zero-extended (both >= 0; attention_gluon.py's persistent kernel: a sign-extended
            # Sq's high word is item-invariant, gets hoisted and spilled)
            lse_row = bh.to(gl.uint32).to(gl.int64) * SEQ_Q.to(gl.uint32).to(gl.int64)
            gl.store(lse_ptr + lse_row + rows, lse, mask=rows < SEQ_Q)
        tma.store_wait(0)  # item t - 1's O store has read the staging buffer
        o_buf.store(o.to(out_dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], _as_tma_box(o_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _f8_consumer_persistent_wg0(o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP, H_KV, NUM_BH,
                                NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM: gl.constexpr,
                                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                SCHED: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr,
                                PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr, POLY_EXP: gl.constexpr):
    _f8_consumer_persistent(0, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                            v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP, H_KV, NUM_BH,
                            NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                            SCHED, WRITE_LSE, QB, PERMUTE_K, CAST_LATE, POLY_EXP)


@gluon.jit
def _f8_consumer_persistent_wg1(o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP, H_KV, NUM_BH,
                                NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM: gl.constexpr,
                                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                SCHED: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr,
                                PERMUTE_K: gl.constexpr, CAST_LATE: gl.constexpr, POLY_EXP: gl.constexpr):
    _f8_consumer_persistent(1, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                            v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP, H_KV, NUM_BH,
                            NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                            SCHED, WRITE_LSE, QB, PERMUTE_K, CAST_LATE, POLY_EXP)


# No value specialization of the runtime ints / pointers (a 1 would become a constant, multiples of 16 would be
# marked): one build per constexpr set, exactly the one ``compile_offline(..., persistent=True)`` checks.
@gluon.jit(do_not_specialize=["qs_ptr", "ks_ptr", "vs_ptr", "lse_ptr", "H", "GROUP", "H_KV", "SEQ_Q", "SEQ_K",
                              "NQB", "NKB", "NUM_M_BLOCKS", "NUM_BH"])
def _fp8_fa3_fwd_persistent_kernel(q_desc, k_desc, vt_desc, o_desc, qs_ptr, ks_ptr, vs_ptr, lse_ptr, sm_scale_log2,
                                   H, GROUP, H_KV, SEQ_Q, SEQ_K, NQB, NKB, NUM_M_BLOCKS, NUM_BH,
                                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                   CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, QB: gl.constexpr,
                                   PERMUTE_K: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                   PRODUCER_REGS: gl.constexpr, CAST_LATE: gl.constexpr, SCHED: gl.constexpr,
                                   POLY_EXP: gl.constexpr = 0):
    """persistent=True: grid (P,), P <= number of SMs; CTA pid runs the work items ``_fa_sched_item(t, pid, ...)``
    for t < ``_fa_sched_count(...)``, each exactly like one CTA of ``_fp8_fa3_fwd_kernel`` (the same ``_f8_step``,
    softmax, masks and epilogue). Shared memory: two fp8 Q buffers per consumer warpgroup (4 x 64 x d), the K / V^T
    ring, one O staging tile per warpgroup (2 x 64 x d, 16-bit)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    fp8: gl.constexpr = q_desc.dtype
    out_dtype: gl.constexpr = o_desc.dtype
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    n_local = _fa_sched_count(pid, P, NUM_M_BLOCKS * NUM_BH, SCHED)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], fp8)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], fp8)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], fp8)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], out_dtype)
    q_smem = gl.allocate_shared_memory(fp8, [4, ROWS, HEAD_DIM], q_layout)  # index 2 * buffer + warpgroup
    k_smem = gl.allocate_shared_memory(fp8, [STAGES, BLOCK_N, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(fp8, [STAGES, HEAD_DIM, BLOCK_N], v_layout)
    o_smem = gl.allocate_shared_memory(out_dtype, [2, ROWS, HEAD_DIM], o_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(q_ready.index(i), count=1)  # the producer's expect-arrive + TMA bytes
        mbarrier.init(q_empty.index(i), count=1)  # the one consumer warpgroup that reads this buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_f8_consumer_persistent_wg0, (o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP,
                                       H_KV, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM,
                                       BLOCK_N, STAGES, CAUSAL, SCHED, WRITE_LSE, QB, PERMUTE_K, CAST_LATE,
                                       POLY_EXP)),
        (_f8_consumer_persistent_wg1, (o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
                                       v_ready, v_empty, qs_ptr, ks_ptr, vs_ptr, lse_ptr, pid, P, n_local, H, GROUP,
                                       H_KV, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, NQB, NKB, sm_scale_log2, HEAD_DIM,
                                       BLOCK_N, STAGES, CAUSAL, SCHED, WRITE_LSE, QB, PERMUTE_K, CAST_LATE,
                                       POLY_EXP)),
        (_f8_producer_persistent, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                   k_empty, v_ready, v_empty, pid, P, n_local, H, GROUP, H_KV, NUM_BH, NUM_M_BLOCKS,
                                   SEQ_Q, SEQ_K, NKB * QB, BLOCK_N, STAGES, CAUSAL, SCHED, PERMUTE_K)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def resolve_poly_exp(poly_exp=None) -> int:
    """The POLY_EXP constexpr for a launch: ``poly_exp`` if given, else $FXOPT_FP8_GLUON_POLY_EXP if set, else
    ``POLY_EXP_DEFAULT``. ValueError for anything but an integer in ``POLY_EXP_CHOICES``."""
    src = "poly_exp"
    if poly_exp is None:
        env = os.environ.get("FXOPT_FP8_GLUON_POLY_EXP", "").strip()
        poly_exp, src = (env, "FXOPT_FP8_GLUON_POLY_EXP") if env else (POLY_EXP_DEFAULT, "POLY_EXP_DEFAULT")
    if isinstance(poly_exp, str):
        try:
            value = int(poly_exp)
        except ValueError:
            value = None
    elif isinstance(poly_exp, bool) or not isinstance(poly_exp, int):
        value = None
    else:
        value = poly_exp
    if value not in POLY_EXP_CHOICES:
        raise ValueError(f"fp8_gluon_attention: {src}={poly_exp!r} is not one of {POLY_EXP_CHOICES} (the number of "
                         f"exp2s out of every {POLY_EXP_PACK} per thread computed by the FMA-pipe polynomial)")
    return value


def _resolve_switch(value, arg: str, env_name: str, default: bool) -> bool:
    src = arg
    if value is None:
        env = os.environ.get(env_name, "").strip()
        value, src = (env, env_name) if env else (default, arg.upper() + "_DEFAULT")
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "on", "yes"):
            return True
        if v in ("0", "false", "off", "no"):
            return False
    elif isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"fp8_gluon_attention: {src}={value!r} is not a boolean switch (0 / 1)")


def resolve_mma_rowsum(mma_rowsum=None) -> bool:
    """The MMA_ROWSUM constexpr of a launch: ``mma_rowsum`` if given, else $FXOPT_FP8_GLUON_MMA_ROWSUM if set, else
    ``MMA_ROWSUM_DEFAULT``. ValueError for anything but a boolean (or 0 / 1, "true" / "false")."""
    return _resolve_switch(mma_rowsum, "mma_rowsum", "FXOPT_FP8_GLUON_MMA_ROWSUM", MMA_ROWSUM_DEFAULT)


def resolve_lazy_rescale(lazy_rescale=None) -> bool:
    """The LAZY_RESCALE constexpr of a launch (``lazy_rescale``, $FXOPT_FP8_GLUON_LAZY_RESCALE,
    ``LAZY_RESCALE_DEFAULT``); as ``resolve_mma_rowsum``."""
    return _resolve_switch(lazy_rescale, "lazy_rescale", "FXOPT_FP8_GLUON_LAZY_RESCALE", LAZY_RESCALE_DEFAULT)


def _rowsum_combo_reason(mma_rowsum: bool, lazy: bool, overlap, pingpong, poly_exp: int, persistent: bool):
    """None, or why the MMA_ROWSUM / LAZY_RESCALE switches cannot be combined with the other options."""
    if not (mma_rowsum or lazy):
        return None
    names = " + ".join(n for n, on in (("mma_rowsum", mma_rowsum), ("lazy_rescale", lazy)) if on)
    other = [n for n, on in (("overlap", OVERLAP_DEFAULT if overlap is None else bool(overlap)),
                             ("pingpong", PINGPONG_DEFAULT if pingpong is None else bool(pingpong)),
                             ("poly_exp", bool(poly_exp)), ("persistent", persistent)) if on]
    if other:
        return f"{names} is implemented for the default (non-persistent) build only, not with {', '.join(other)}"
    return None


def resolve_ablate(ablate=None, *, check_env: bool = True, overlap=None, pingpong=None, poly_exp: int = 0,
                   persistent: bool = False, mma_rowsum: bool = False, lazy_rescale: bool = False,
                   cast_late=None) -> int:
    """The ABLATE constexpr of a launch (TIMING ONLY; docs/kernels.md "ablate"): 0 for None / 0; otherwise a
    nonzero int whose bits are in ``ABLATE_BITS``. ValueError for anything else, for a nonzero mask without
    $FXOPT_FP8_GLUON_ABLATE_OK=1 (``check_env``; offline builds pass False: they produce no results), and for a mask
    combined with persistent / overlap / pingpong / poly_exp / mma_rowsum / lazy_rescale or cast_late=False."""
    if ablate is None or (isinstance(ablate, int) and not isinstance(ablate, bool) and ablate == 0):
        return 0
    if isinstance(ablate, bool) or not isinstance(ablate, int) or ablate < 0 or ablate & ~ABLATE_ALL:
        raise ValueError(f"fp8_gluon_attention: ablate={ablate!r} is not a bit mask of {ABLATE_BITS}")
    if check_env and os.environ.get(ABLATE_ENV, "").strip() != "1":
        raise ValueError(f"fp8_gluon_attention: ablate={ablate}: timing-only ablation, results are wrong; set "
                         f"{ABLATE_ENV}=1 to run it")
    other = [n for n, on in (("persistent", persistent),
                             ("overlap", OVERLAP_DEFAULT if overlap is None else bool(overlap)),
                             ("pingpong", PINGPONG_DEFAULT if pingpong is None else bool(pingpong)),
                             ("poly_exp", bool(poly_exp)), ("mma_rowsum", mma_rowsum),
                             ("lazy_rescale", lazy_rescale),
                             ("cast_late=False", not (CAST_LATE_DEFAULT if cast_late is None else bool(cast_late))))
             if on]
    if other:
        raise ValueError(f"fp8_gluon_attention: ablate={ablate} is implemented for the default build only (cast_late, "
                         f"non-persistent), not with {', '.join(other)}")
    return ablate


def config_for(head_dim: int) -> dict:
    block_n, stages = _CONFIGS[head_dim]
    return dict(BLOCK_N=block_n, STAGES=stages, num_warps=4, maxnreg=_MAXNREG,
                CONSUMER_REGS=_CONSUMER_REGS, PRODUCER_REGS=_PRODUCER_REGS)


def persistent_smem_bytes(head_dim: int, stages: int, out_bytes: int = 2) -> int:
    """Shared memory of the persistent kernel's buffers (the mbarriers add 8 B each: (8 + 4 STAGES) x 8)."""
    block_n = _CONFIGS[head_dim][0]
    return (4 * WG_ROWS * head_dim + 2 * stages * block_n * head_dim + 2 * WG_ROWS * head_dim * out_bytes
            + (8 + 4 * stages) * 8)


def persistent_config_for(head_dim: int, stages: Optional[int] = None) -> dict:
    """``config_for`` of the persistent kernel: the default build's tiles, ``STAGES`` = ``stages`` or
    ``_PERSISTENT_STAGES``. ValueError if the head dim is not configured or the buffers exceed 227 KB."""
    if head_dim not in _CONFIGS:
        raise ValueError(f"fp8_gluon_attention: persistent: head dim {head_dim} not supported "
                         f"(only {sorted(_CONFIGS)})")
    st = _PERSISTENT_STAGES[head_dim] if stages is None else stages
    if isinstance(st, bool) or not isinstance(st, int) or st < 2:
        raise ValueError(f"fp8_gluon_attention: persistent: stages={stages!r} must be an integer >= 2")
    need = persistent_smem_bytes(head_dim, st)
    if need > _SMEM_LIMIT:
        raise ValueError(f"fp8_gluon_attention: persistent: stages={st} at d={head_dim} needs {need} B of shared "
                         f"memory (4 Q buffers + {st} K / V^T slots + 2 O tiles) > {_SMEM_LIMIT} B")
    cfg = config_for(head_dim)
    cfg["STAGES"] = st
    return cfg


def resolve_persistent(persistent=None, overlap=None, pingpong=None, num_sms=None, stages=None) -> bool:
    """The persistent switch of a launch (None = ``PERSISTENT_DEFAULT``); ValueError for the combinations it does not
    support (overlap / pingpong; num_sms / stages without persistent)."""
    pers = PERSISTENT_DEFAULT if persistent is None else bool(persistent)
    if pers and (OVERLAP_DEFAULT if overlap is None else bool(overlap)):
        raise ValueError("fp8_gluon_attention: persistent=True is implemented for the build without overlap only "
                         "(overlap=True)")
    if pers and (PINGPONG_DEFAULT if pingpong is None else bool(pingpong)):
        raise ValueError("fp8_gluon_attention: persistent=True is implemented for the build without pingpong only "
                         "(pingpong=True)")
    if num_sms is not None and (not pers or isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                or num_sms < 1):
        raise ValueError(f"fp8_gluon_attention: num_sms={num_sms!r} needs persistent=True and an integer >= 1")
    if stages is not None and not pers:
        raise ValueError(f"fp8_gluon_attention: stages={stages!r} needs persistent=True (the default build's ring "
                         f"depth is config_for's)")
    return pers


def fp8_gluon_supported(q, k, v, causal: bool = False, scale: Optional[float] = None,
                        training: bool = False) -> Optional[str]:
    """None if ``fp8_gluon_attention`` can run these (bf16 / fp16) inputs, else a one-line reason."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"
    if training:
        return "forward only (inference); training keeps bf16 / fp16 attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 4:
            return f"{name} must be 4-D [B, H, S, D], got {tuple(t.shape)}"
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"{name}: dtype {t.dtype} not supported (bf16 / fp16 inputs; quantized here)"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
    if not (q.dtype == k.dtype == v.dtype):
        return f"dtype mismatch q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if not (q.device == k.device == v.device):
        return "q, k, v on different devices"
    cap = device_capability(q.device)
    if cap[0] != 9:
        return f"needs sm_90 (fp8 wgmma + TMA), device is sm_{cap[0]}{cap[1]}"
    B, Hq, Sq, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    if k.shape[0] != B or k.shape[3] != D:
        return f"k / v shape {tuple(k.shape)} does not match q {tuple(q.shape)}"
    if D not in _CONFIGS:
        return f"head dim {D} not supported by the Gluon fp8 kernel (only {sorted(_CONFIGS)})"
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"query heads {Hq} not a multiple of kv heads {Hkv}"
    if scale is not None and not (float(scale) > 0.0):
        return f"scale must be > 0 (got {scale}); it is folded into exp2"
    if max(Sq, k.shape[2]) >= 2 ** 30:
        return "sequence too long for int32 TMA coordinates"
    if B * Hq > 65535:
        return f"B * Hq = {B * Hq} exceeds the grid's y limit (65535)"
    return None


def _quantized_reason(qq, qs, kq, ks, vt, vs, shape_q, seq_k, n_kv_heads, out) -> Optional[str]:
    if _GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"
    B, Hq, Sq, D = shape_q
    if D not in _CONFIGS:
        return f"head dim {D} not supported by the Gluon fp8 kernel (only {sorted(_CONFIGS)})"
    for name, t in (("qq", qq), ("kq", kq), ("vt", vt)):
        if t.dtype != torch.float8_e4m3fn:
            return f"{name}: dtype {t.dtype}, expected torch.float8_e4m3fn (int8 / fp16 emulation not supported)"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
        r = _tma_stride_reason(name, t)
        if r:
            return r
    sq_pad, sk_pad = qq.shape[2], kq.shape[2]
    if sq_pad % QBLOCK or sk_pad % QBLOCK:
        return f"padded lengths {sq_pad} / {sk_pad} are not multiples of QBLOCK={QBLOCK} (quantize_blocks' default)"
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
        r = _tma_stride_reason("out", out)
        if r:
            return r
    return None


def _desc(t: torch.Tensor, block, shape=None, strides=None):
    layout = host_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(shape or t.shape), list(strides or t.stride()), block, layout)


def _k_block(block_n: int, D: int, permute_k: bool):
    return [block_n // 16, 2, 4, 2, D] if permute_k else [1, 1, block_n, D]


def _k_desc(kq: torch.Tensor, block_n: int, permute_k: bool):
    """K's TMA descriptor. permute_k: a 5-D view [rows / 16, jl, q, e, d] of the contiguous [B, Hkv, Sk_pad, d]
    tensor with strides [16 d, 2 d, 4 d, d, 1], so a box lands in shared memory with row 8 jl + 2 q + e holding key
    4 q + 2 jl + e of each 16 (jl and q swapped: non-monotonic strides, which the TMA unit accepts as far as the
    CUDA docs say; NOT verified on a GPU)."""
    D = kq.shape[-1]
    if not permute_k:
        return _desc(kq, _k_block(block_n, D, False))
    rows = kq.shape[0] * kq.shape[1] * kq.shape[2]
    return _desc(kq, _k_block(block_n, D, True), shape=[rows // 16, 2, 4, 2, D], strides=[16 * D, 2 * D, 4 * D, D, 1])


def _refuse_failed_builds(mma_rowsum: bool) -> None:
    """ValueError for a build that failed its H200 check (``MMA_ROWSUM_FAILED``) unless $FXOPT_FP8_GLUON_UNCHECKED=1."""
    if mma_rowsum and os.environ.get(UNCHECKED_ENV, "0") != "1":
        raise ValueError(f"fp8_gluon_attention: mma_rowsum {MMA_ROWSUM_FAILED}; set {UNCHECKED_ENV}=1 to run it "
                         "anyway (debugging / timing only)")


def fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, *, shape_q, seq_k, n_kv_heads, out_dtype,
                                  is_causal=False, scale=None, out=None, return_lse=False, lse=None,
                                  permute_k: Optional[bool] = None, cast_late: Optional[bool] = None,
                                  overlap: Optional[bool] = None, pingpong: Optional[bool] = None,
                                  poly_exp: Optional[int] = None, persistent: Optional[bool] = None,
                                  num_sms: Optional[int] = None, stages: Optional[int] = None,
                                  mma_rowsum: Optional[bool] = None, lazy_rescale: Optional[bool] = None,
                                  ablate: Optional[int] = None):
    """The Gluon kernel alone, on :func:`fp8_attention.quantize_blocks` outputs (same arguments as
    ``fp8_attention.fp8_attention_quantized``). Returns out (or (out, lse) with ``return_lse``). ``permute_k`` /
    ``cast_late`` / ``overlap`` / ``pingpong``: None = ``PERMUTE_K_DEFAULT`` / ``CAST_LATE_DEFAULT`` /
    ``OVERLAP_DEFAULT`` / ``PINGPONG_DEFAULT`` (see the design notes in docs/kernels.md); pingpong with overlap is refused.
    ``poly_exp``: None = $FXOPT_FP8_GLUON_POLY_EXP or ``POLY_EXP_DEFAULT`` (``resolve_poly_exp``).
    ``persistent``: None = ``PERSISTENT_DEFAULT``; True runs ``_fp8_fa3_fwd_persistent_kernel`` (not with overlap /
    pingpong); ``num_sms`` caps its grid (default: the device's SM count; small values force many items per CTA),
    ``stages`` its ring depth (default ``_PERSISTENT_STAGES``). ``mma_rowsum`` / ``lazy_rescale``: None = the
    environment or ``MMA_ROWSUM_DEFAULT`` / ``LAZY_RESCALE_DEFAULT`` (``resolve_mma_rowsum`` /
    ``resolve_lazy_rescale``); not with overlap / pingpong / poly_exp / persistent (ValueError). ``ablate``: a
    TIMING-ONLY bit mask (``ABLATE_BITS``; the results are wrong), only with $FXOPT_FP8_GLUON_ABLATE_OK=1 and the
    default build (``resolve_ablate``)."""
    B, Hq, Sq, D = shape_q
    pe = resolve_poly_exp(poly_exp)
    pers = resolve_persistent(persistent, overlap, pingpong, num_sms, stages)
    mr, lz = resolve_mma_rowsum(mma_rowsum), resolve_lazy_rescale(lazy_rescale)
    combo = _rowsum_combo_reason(mr, lz, overlap, pingpong, pe, pers)
    if combo is not None:
        raise ValueError(f"fp8_gluon_attention: {combo}")
    _refuse_failed_builds(mr)
    ab = resolve_ablate(ablate, overlap=overlap, pingpong=pingpong, poly_exp=pe, persistent=pers, mma_rowsum=mr,
                        lazy_rescale=lz, cast_late=cast_late)
    pcfg = persistent_config_for(D, stages) if pers and D in _CONFIGS else None
    ov = OVERLAP_DEFAULT if overlap is None else bool(overlap)
    pp = PINGPONG_DEFAULT if pingpong is None else bool(pingpong)
    reason = _quantized_reason(qq, qs, kq, ks, vt, vs, shape_q, seq_k, n_kv_heads, out)
    if reason is None and scale is not None and not (float(scale) > 0.0):
        reason = f"scale must be > 0 (got {scale})"
    if reason is None and ov and pp:
        reason = "pingpong is implemented for the build without overlap only (overlap=True, pingpong=True)"
    if reason is not None:
        raise ValueError(f"fp8_gluon_attention: {reason}")
    Hkv = n_kv_heads
    if out is None:
        out = torch.empty((B, Hq, Sq, D), device=qq.device, dtype=out_dtype)
    if return_lse and lse is None:
        lse = torch.empty((B, Hq, Sq), device=qq.device, dtype=torch.float32)
    res = (out, lse) if return_lse else out
    if B * Hq * Sq == 0:
        return res
    if seq_k == 0:
        out.zero_()
        if return_lse:
            lse.fill_(float("inf"))
        return res
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    cfg = config_for(D)
    bn = cfg["BLOCK_N"]
    rows_per_cta = NUM_CONSUMERS * WG_ROWS
    num_m = (Sq + rows_per_cta - 1) // rows_per_cta
    q_desc = _desc(qq, [1, 1, WG_ROWS, D])
    pk = PERMUTE_K_DEFAULT if permute_k is None else bool(permute_k)
    cl = CAST_LATE_DEFAULT if cast_late is None else bool(cast_late)
    k_desc = _k_desc(kq, bn, pk)
    vt_desc = _desc(vt, [1, 1, D, bn])
    o_desc = _desc(out, [1, 1, WG_ROWS, D])
    lse_arg = lse if return_lse else qs
    if pers:
        sched, n_cta = persistent_schedule(num_m, B * Hq, bool(is_causal), int(num_sms or _num_sms(qq.device)))
        # the ring counter g (and the masks' column shift g * BLOCK_N) grows over a CTA's items: keep it in int32
        max_items = (num_m * B * Hq) // n_cta + 3
        if num_m * B * Hq >= 2 ** 30 or max_items * ((seq_k + bn - 1) // bn + 1) * bn + seq_k >= 2 ** 31:
            raise ValueError(f"fp8_gluon_attention: persistent: {num_m * B * Hq} work items, up to {max_items} of "
                             f"Sk = {seq_k} per CTA, overflow its int32 item index / key-block counter")
        _fp8_fa3_fwd_persistent_kernel[(n_cta,)](
            q_desc, k_desc, vt_desc, o_desc, qs, ks, vs, lse_arg, sm_scale * LOG2E,
            Hq, Hq // Hkv, Hkv, Sq, seq_k, qq.shape[2] // QBLOCK, kq.shape[2] // QBLOCK, num_m, B * Hq,
            HEAD_DIM=D, BLOCK_N=bn, STAGES=pcfg["STAGES"], CAUSAL=bool(is_causal), WRITE_LSE=bool(return_lse),
            QB=QBLOCK, PERMUTE_K=pk, CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
            CAST_LATE=cl, SCHED=sched, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
            **({"POLY_EXP": pe} if pe else {}))
        return res
    _fp8_fa3_fwd_kernel[(num_m, B * Hq)](
        q_desc, k_desc, vt_desc, o_desc, qs, ks, vs, lse_arg, sm_scale * LOG2E,
        Hq, Hq // Hkv, Hkv, Sq, seq_k, qq.shape[2] // QBLOCK, kq.shape[2] // QBLOCK, num_m,
        HEAD_DIM=D, BLOCK_N=bn, STAGES=cfg["STAGES"], CAUSAL=bool(is_causal), WRITE_LSE=bool(return_lse),
        QB=QBLOCK, PERMUTE_K=pk, CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
        CAST_LATE=cl, num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"], **({"OVERLAP": True} if ov else {}),
        **({"PINGPONG": True} if pp else {}), **({"POLY_EXP": pe} if pe else {}),
        **({"MMA_ROWSUM": True} if mr else {}), **({"LAZY_RESCALE": True} if lz else {}),
        **({"ABLATE": ab} if ab else {}))
    return res


def fp8_gluon_quantize(q, k, v, hadamard: bool = True, seed: int = 0):
    """fp8_attention.py's own host steps (Hadamard + block quantization; V transposed). Returns
    (qq, qs, kq, ks, vt, vs)."""
    return _fp8.quantize_qkv(q, k, v, hadamard=hadamard, seed=seed)


def fp8_gluon_attention(q, k, v, is_causal: bool = False, scale: Optional[float] = None, hadamard: bool = True,
                        seed: int = 0, *, out=None, return_lse: bool = False, permute_k: Optional[bool] = None,
                        cast_late: Optional[bool] = None, overlap: Optional[bool] = None,
                        pingpong: Optional[bool] = None, poly_exp: Optional[int] = None,
                        persistent: Optional[bool] = None, num_sms: Optional[int] = None,
                        stages: Optional[int] = None, mma_rowsum: Optional[bool] = None,
                        lazy_rescale: Optional[bool] = None, ablate: Optional[int] = None):
    """Same options as ``torch.ops.fxopt.fp8_attention``: quantize with fp8_attention.py's kernels, then run the
    Gluon fp8 kernel. Raises ValueError (with the reason) for inputs it cannot run. ``ablate``: TIMING ONLY (wrong
    results), see ``fp8_gluon_attention_quantized``."""
    if ablate:
        resolve_ablate(ablate)  # the environment gate first (the combinations are checked below)
    reason = fp8_gluon_supported(q, k, v, is_causal, scale)
    if reason is not None:
        raise ValueError(f"fp8_gluon_attention: {reason}")
    pe = resolve_poly_exp(poly_exp)  # refuse a bad value before quantizing
    pers = resolve_persistent(persistent, overlap, pingpong, num_sms, stages)
    if pers:
        persistent_config_for(q.shape[-1], stages)
    mr, lz = resolve_mma_rowsum(mma_rowsum), resolve_lazy_rescale(lazy_rescale)
    combo = _rowsum_combo_reason(mr, lz, overlap, pingpong, pe, pers)
    if combo is not None:
        raise ValueError(f"fp8_gluon_attention: {combo}")
    _refuse_failed_builds(mr)  # before quantizing
    resolve_ablate(ablate, overlap=overlap, pingpong=pingpong, poly_exp=pe, persistent=pers, mma_rowsum=mr,
                   lazy_rescale=lz, cast_late=cast_late)
    _fp8._check_attn_inputs(q, k, v, scale)
    B, Hq, Sq, D = q.shape
    qq, qs, kq, ks, vt, vs = fp8_gluon_quantize(q, k, v, hadamard, seed)
    return fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(B, Hq, Sq, D), seq_k=k.shape[2],
                                         n_kv_heads=k.shape[1], out_dtype=q.dtype, is_causal=is_causal,
                                         scale=scale, out=out, return_lse=return_lse, permute_k=permute_k,
                                         cast_late=cast_late, overlap=overlap, pingpong=pingpong,
                                         poly_exp=poly_exp, persistent=persistent, num_sms=num_sms,
                                         stages=stages, mma_rowsum=mma_rowsum, lazy_rescale=lazy_rescale,
                                         ablate=ablate)


# ----------------------------------------------------------------------------------------------------------------
# Offline compile check (no GPU): python -m fxopt.kernels.fp8_attention_gluon [--dump DIR]
# ----------------------------------------------------------------------------------------------------------------


def _signature(D: int, out_str: str, block_n: int, permute_k: bool):
    ogdt = gl.bfloat16 if out_str == "bf16" else gl.float16

    def tds(dt_str, gdt, block):
        lay = gl.NVMMASharedLayout.get_default_for(block, gdt)
        return f"tensordesc<{dt_str}[{', '.join(map(str, block))}],{lay!r}>"

    return {"q_desc": tds("fp8e4nv", gl.float8e4nv, [1, 1, WG_ROWS, D]),
            "k_desc": tds("fp8e4nv", gl.float8e4nv, _k_block(block_n, D, permute_k)),
            "vt_desc": tds("fp8e4nv", gl.float8e4nv, [1, 1, D, block_n]),
            "o_desc": tds(out_str, ogdt, [1, 1, WG_ROWS, D]),
            "qs_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "lse_ptr": "*fp32", "sm_scale_log2": "fp32",
            "H": "i32", "GROUP": "i32", "H_KV": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "NQB": "i32", "NKB": "i32",
            "NUM_M_BLOCKS": "i32", "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr",
            "CAUSAL": "constexpr", "WRITE_LSE": "constexpr", "QB": "constexpr", "PERMUTE_K": "constexpr",
            "CONSUMER_REGS": "constexpr",
            "PRODUCER_REGS": "constexpr", "CAST_LATE": "constexpr"}


def compile_offline(D: int, causal: bool, out_str: str = "bf16", write_lse: bool = False, arch: int = 90,
                    stages: Optional[int] = None, permute_k: Optional[bool] = None,
                    cast_late: Optional[bool] = None, overlap: Optional[bool] = None,
                    pingpong: Optional[bool] = None, poly_exp: Optional[int] = None,
                    persistent: Optional[bool] = None, sched: Optional[int] = None,
                    mma_rowsum: Optional[bool] = None, lazy_rescale: Optional[bool] = None,
                    ablate: Optional[int] = None):
    """Compile one config for sm_<arch> without a GPU; returns triton's CompiledKernel. The OVERLAP / PINGPONG /
    POLY_EXP constexprs are passed only when set (as the launch does), so the builds without them are compiled as
    before. ``persistent=True``: ``_fp8_fa3_fwd_persistent_kernel`` (``stages`` = its ring depth, default
    ``_PERSISTENT_STAGES``; ``sched`` = the SCHED constexpr, default 1 (zigzag pairs) when causal, else 0).
    ``ablate``: the timing-only ABLATE mask (``resolve_ablate`` without the environment gate: nothing runs here)."""
    pe = resolve_poly_exp(poly_exp)
    mr, lz = resolve_mma_rowsum(mma_rowsum), resolve_lazy_rescale(lazy_rescale)
    combo = _rowsum_combo_reason(mr, lz, overlap, pingpong, pe, resolve_persistent(persistent, overlap, pingpong))
    if combo is not None:
        raise ValueError(f"fp8_gluon_attention: {combo}")
    ab = resolve_ablate(ablate, check_env=False, overlap=overlap, pingpong=pingpong, poly_exp=pe,
                        persistent=resolve_persistent(persistent, overlap, pingpong), mma_rowsum=mr,
                        lazy_rescale=lz, cast_late=cast_late)
    if resolve_persistent(persistent, overlap, pingpong):
        return _compile_offline_persistent(D, causal, out_str, write_lse, arch, stages, permute_k, cast_late, pe,
                                           sched)
    if (OVERLAP_DEFAULT if overlap is None else bool(overlap)) and (
            PINGPONG_DEFAULT if pingpong is None else bool(pingpong)):
        raise ValueError("pingpong is implemented for the build without overlap only")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config_for(D)
    pk = PERMUTE_K_DEFAULT if permute_k is None else bool(permute_k)
    constexprs = {"HEAD_DIM": D, "BLOCK_N": cfg["BLOCK_N"], "STAGES": stages or cfg["STAGES"],
                  "CAUSAL": bool(causal), "WRITE_LSE": bool(write_lse), "QB": QBLOCK, "PERMUTE_K": pk,
                  "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"],
                  "CAST_LATE": CAST_LATE_DEFAULT if cast_late is None else bool(cast_late)}
    sig = _signature(D, out_str, cfg["BLOCK_N"], pk)
    optional = dict(OVERLAP=OVERLAP_DEFAULT if overlap is None else bool(overlap),
                    PINGPONG=PINGPONG_DEFAULT if pingpong is None else bool(pingpong),
                    POLY_EXP=pe, MMA_ROWSUM=mr, LAZY_RESCALE=lz, ABLATE=ab)
    if any(optional.values()):
        # every optional constexpr explicitly: ASTSource binds by position, and Triton 3.6's ASTSource.hash keys the
        # constants by value only (sorted by position), so a partial set would share a cache key with another
        # build (OVERLAP=True alone and PINGPONG=True alone both hashed as "..., True" and returned one binary;
        # MMA_ROWSUM / LAZY_RESCALE / ABLATE likewise). The default build passes none of them.
        constexprs.update(optional)
        for name in optional:
            sig[name] = "constexpr"
        sig = {k: sig[k] for k in _fp8_fa3_fwd_kernel.arg_names if k in sig}
    src = GluonASTSource(_fp8_fa3_fwd_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})


def _compile_offline_persistent(D, causal, out_str, write_lse, arch, stages, permute_k, cast_late, pe, sched):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = persistent_config_for(D, stages)
    pk = PERMUTE_K_DEFAULT if permute_k is None else bool(permute_k)
    sig = _signature(D, out_str, cfg["BLOCK_N"], pk)
    sig["NUM_BH"] = "i32"
    sig["SCHED"] = "constexpr"
    constexprs = {"HEAD_DIM": D, "BLOCK_N": cfg["BLOCK_N"], "STAGES": cfg["STAGES"], "CAUSAL": bool(causal),
                  "WRITE_LSE": bool(write_lse), "QB": QBLOCK, "PERMUTE_K": pk,
                  "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"],
                  "CAST_LATE": CAST_LATE_DEFAULT if cast_late is None else bool(cast_late),
                  "SCHED": (1 if causal else 0) if sched is None else int(sched)}
    if pe:
        constexprs["POLY_EXP"] = pe
        sig["POLY_EXP"] = "constexpr"
    sig = {k: sig[k] for k in _fp8_fa3_fwd_persistent_kernel.arg_names if k in sig}
    src = GluonASTSource(_fp8_fa3_fwd_persistent_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})


def sass_summary(c) -> dict:
    """QGMMA / wait / shuffle counts in the sm_90 SASS and the ptxas wgmma-serialisation warning."""
    import re

    from .attention_gluon import _tool

    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    return {"qgmma": len(re.findall(r"QGMMA", sass)), "hgmma": len(re.findall(r"HGMMA", sass)),
            "depbar_le0": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)),
            "depbar_le1": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)),
            "shfl": len(re.findall(r"\bSHFL\.", sass)), "prmt": len(re.findall(r"\bPRMT\b", sass)),
            "f2fp": len(re.findall(r"\bF2FP\.", sass)), "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
            "sts": len(re.findall(r"\bSTS\b", sass)), "lds": len(re.findall(r"\bLDS", sass)),
            "max_reg_index": max(regs) if regs else None,
            "wgmma_serialized": "C7512" in ptxas or "serialized" in ptxas}


ABLATE_LOOP_MARKER = r"GMMA|FFMA"  # the consumer steps of every ABLATE build (the producer loop has neither)
_SASS_CLASSES = (("QGMMA", r"QGMMA"), ("MUFU.EX2", r"MUFU\.EX2"), ("MUFU", r"MUFU"), ("F2FP", r"F2FP"),
                 ("PRMT", r"PRMT"), ("LOP3", r"LOP3"), ("SHF", r"SHF\."), ("SHFL", r"SHFL"), ("SEL", r"SEL"),
                 ("FMUL", r"FMUL"), ("FFMA", r"FFMA"), ("FADD", r"FADD"), ("FMNMX", r"FMNMX"),
                 ("WARPGROUP", r"WARPGROUP"), ("SYNCS", r"SYNCS"), ("BAR", r"BAR\."))


def main_loops(sass: str, marker: str = "GMMA") -> list[dict]:
    """Innermost loops of the sm_90 SASS (nvdisasm text) that issue wgmma: one dict per loop, in address order,
    with the instruction count ``n`` and counts by opcode class (``_SASS_CLASSES``, first match; the rest under
    "other"). For this kernel: consumer 0's unmasked and masked loops, then consumer 1's. A loop is the address
    range from a predicated backward branch's target to the branch (ptxas places the mbarrier try-wait retries out
    of line, with an unconditional branch back into the loop: not counted). ``marker``: the regex an instruction of
    the loop must match (default: a wgmma; the ABLATE census uses ``ABLATE_LOOP_MARKER``, since an 8|16 build's
    step has no wgmma left)."""
    import re

    i = sass.find("\n.text.")
    j = sass.find("\t.section", i)
    text = sass[i:j if j > 0 else None]
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            ins.append((addr, m.group(2).strip()))
    found = []
    for addr, op in ins:
        m = re.match(r"@!?P\d+ BRA `\((\.L_x_\d+)\)", op)  # predicated: a loop's back edge
        if m and labels.get(m.group(1), addr + 1) < addr:
            body = [o for a, o in ins if labels[m.group(1)] <= a <= addr]
            if any(re.search(marker, o) for o in body):
                found.append((labels[m.group(1)], addr, body))
    inner = [f for f in found if not any(g[0] >= f[0] and g[1] <= f[1] and g[:2] != f[:2] for g in found)]
    out = []
    for lo, hi, body in sorted(inner, key=lambda f: f[0]):
        counts = {"n": len(body), "start": hex(lo), "end": hex(hi)}
        for op in body:
            op = re.sub(r"^@!?U?P[T\d]\s+", "", op)
            key = next((k for k, pat in _SASS_CLASSES if re.search(pat, op.split(" ")[0])), "other")
            counts[key] = counts.get(key, 0) + 1
        out.append(counts)
    return out


def ablate_census(sass: str) -> list[dict]:
    """Per-step SASS census of an ABLATE build (or any build): ``main_loops`` with ``ABLATE_LOOP_MARKER`` (consumer
    0 unmasked / masked, consumer 1 unmasked / masked), reduced to the classes the ablations remove: ``n`` (all
    instructions of the step), MUFU (all MUFU; MUFU.EX2 separately), FMNMX, FMUL, FFMA, FADD, SHFL, F2FP, PRMT,
    QGMMA, WARPGROUP (arrive / commit / waits) and STSM (the bit-8 sink)."""
    out = []
    for lp in main_loops(sass, ABLATE_LOOP_MARKER):
        row = {k: lp.get(k, 0) for k in ("n", "MUFU.EX2", "FMNMX", "FMUL", "FFMA", "FADD", "SHFL", "F2FP", "PRMT",
                                         "QGMMA", "WARPGROUP")}
        row["MUFU"] = lp.get("MUFU.EX2", 0) + lp.get("MUFU", 0)
        out.append(row)
    # STSM is not one of _SASS_CLASSES: count it over the same address ranges
    import re

    i = sass.find("\n.text.")
    j = sass.find("\t.section", i)
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass[i:j if j > 0 else None])]
    for row, lp in zip(out, main_loops(sass, ABLATE_LOOP_MARKER)):
        lo, hi = int(lp["start"], 16), int(lp["end"], 16)
        row["STSM"] = sum(1 for a, op in ins if lo <= a <= hi and "STSM" in op)
    return out


def ex2_under_pv(sass: str) -> list[dict]:
    """Where the PV wait sits, per main loop (``main_loops`` order): for each innermost wgmma loop, ``ex2`` = the
    MUFU.EX2 of one step, ``under_pv`` = how many of them issue between the PV QGMMA group (register A operand, up
    to the one carrying gsb0) and the next ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (i.e. while the warpgroup's own
    PV_{i-1} is in flight), ``after_wait`` = instructions from that wait to the back edge. attention_gluon.py's
    ``ex2_under_pv`` for the bf16 kernel, per loop."""
    import re

    i = sass.find("\n.text.")
    j = sass.find("\t.section", i)
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass[i:j if j > 0 else None])]
    out = []
    for lp in main_loops(sass):
        lo, hi = int(lp["start"], 16), int(lp["end"], 16)
        body = [op for a, op in ins if lo <= a <= hi]
        in_pv, under, wait_at = False, 0, None
        for k, op in enumerate(body):
            if re.search(r"[HQ]GMMA\S* R\d+, R\d+", op) and "gsb0" in op:
                in_pv = True
            elif in_pv and "MUFU.EX2" in op:
                under += 1
            elif in_pv and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in op:
                wait_at = k
                break
        out.append({"ex2": sum("MUFU.EX2" in op for op in body), "under_pv": under,
                    "after_wait": None if wait_at is None else len(body) - wait_at - 1})
    return out


# ----------------------------------------------------------------------------------------------------------------
# CPU model of the persistent kernel's barrier protocol (tests / ``--protocol``)
# ----------------------------------------------------------------------------------------------------------------


def persistent_protocol_model(n_blocks: list, stages: int, seed: int = 0, max_steps: int = 10 ** 6,
                              mutation: Optional[str] = None) -> int:
    """CPU model of ``_fp8_fa3_fwd_persistent_kernel``'s mbarrier protocol: ``_f8_producer_persistent`` and two
    ``_f8_consumer_persistent`` warpgroups, statement for statement (waits, expect-arrives, releases, the Q buffer
    hand-back after the item's last QK, the O staging tile's deferred store and its ``store_wait``), over one CTA's
    items (``n_blocks[t]`` key blocks each) in a random interleaving, with TMA loads landing and TMA stores finishing
    at random later points. mbarriers as in attention_gluon.py's ``persistent_protocol_model`` (``_ModelBar``).
    Differs from the bf16 protocol in that O is not staged in the Q buffer (fp8 Q, 16-bit O): a Q buffer is handed
    back right after the item's loops, and each warpgroup's O tile is rewritten only after ``store_wait``. Also
    checks the per-block scale indexing: ``_f8_step`` reads the K / V scale at (pointer shifted by -g0) + ring
    position, which must be the block's index in its item. AssertionError on a deadlock (no progress in
    max_steps), a consumer reading another item's / block's data or scale, a TMA load landing in a buffer a
    consumer still reads, or an O tile rewritten while its store still reads it. Returns the steps taken.
    ``mutation`` (for the tests: the model must catch a broken protocol): "early_q_release" (hand Q back before
    the item's last QK), "no_store_wait", "no_scale_shift" (scale pointer not shifted by -g0)."""
    import random

    Bar = _ModelBar
    rng = random.Random(seed)
    q_ready, q_empty = [Bar(1) for _ in range(4)], [Bar(1) for _ in range(4)]
    k_ready, v_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    k_empty, v_empty = [Bar(2) for _ in range(stages)], [Bar(2) for _ in range(stages)]
    bufs = {"q": [None] * 4, "k": [None] * stages, "v": [None] * stages, "o": [None] * 2}
    held = {}  # (kind, index) -> consumers reading it
    storing = {0: 0, 1: 0}  # O stores of consumer w still reading its staging tile
    pending = []  # TMA completions not yet happened

    def assert_free(kind, i):
        assert not held.get((kind, i)), f"TMA write into {kind}[{i}] while {held[(kind, i)]} read it"

    def load(kind, i, bar, content):  # mbarrier.expect + async_copy_global_to_shared
        assert_free(kind, i)
        bar.arrive(tx=1)

        def land():
            assert_free(kind, i)
            bufs[kind][i] = content
            bar.tx -= 1
            bar.complete()
        pending.append(land)

    wait = _model_wait

    def producer():
        return _model_persistent_producer(n_blocks, stages, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                                          load)

    def consumer(w):
        def use(kind, i, bar, parity, want):
            yield from wait(bar, parity)
            assert bufs[kind][i] == want, f"consumer {w} wanted {kind} {want}, found {bufs[kind][i]}"
            held.setdefault((kind, i), set()).add(w)

        def release(kind, i, bar):
            yield  # the wgmma reading the buffer runs, then its wait
            held[(kind, i)].discard(w)
            bar.arrive()

        def scale(base_shifted, i, t, j):  # gl.load(ks_base + (i * BLOCK_N) // QB) with BLOCK_N == QB
            assert base_shifted + i == j, f"consumer {w}, item {t}: scale index {base_shifted + i} for block {j}"

        g0 = 0
        for t, n in enumerate(n_blocks):
            qi = 2 * (t % 2) + w
            base = 0 if mutation == "no_scale_shift" else -g0  # ks_ptr + (bhk * NKB - g0), from the head's first
            yield from use("q", qi, q_ready[qi], (t // 2) & 1, (t, w))
            scale(base, g0, t, 0)
            ks = g0 % stages
            yield from use("k", ks, k_ready[ks], (g0 // stages) & 1, (t, 0))
            yield from release("k", ks, k_empty[ks])
            if mutation == "early_q_release":
                held[("q", qi)].discard(w)
                q_empty[qi].arrive()
            for i in range(g0 + 1, g0 + n):
                scale(base, i, t, i - g0)
                assert bufs["q"][qi] == (t, w), f"consumer {w}: Q of item {t} overwritten before its QK {i - g0}"
                ks, vs = i % stages, (i - 1) % stages
                yield from use("k", ks, k_ready[ks], (i // stages) & 1, (t, i - g0))
                yield from use("v", vs, v_ready[vs], ((i - 1) // stages) & 1, (t, i - 1 - g0))
                yield from release("k", ks, k_empty[ks])
                yield from release("v", vs, v_empty[vs])
            # every QK of the item waited for: Q buffer back to the producer
            if mutation != "early_q_release":
                held[("q", qi)].discard(w)
                q_empty[qi].arrive()
            jv = g0 + n - 1
            vs = jv % stages
            yield from use("v", vs, v_ready[vs], (jv // stages) & 1, (t, jv - g0))
            yield from release("v", vs, v_empty[vs])
            g0 += n
            # epilogue: store_wait, then the O tile is rewritten and its TMA store left in flight
            while storing[w] and mutation != "no_store_wait":
                yield
            bufs["o"][w] = ("O", t)
            storing[w] += 1

            def store_done(t=t):
                assert bufs["o"][w] == ("O", t), f"O tile of consumer {w} rewritten before item {t}'s store read it"
                storing[w] -= 1
            pending.append(store_done)
            yield
        while storing[w]:
            yield

    return _interleave({"producer": producer(), "consumer0": consumer(0), "consumer1": consumer(1)}, pending, rng,
                       max_steps)


def check_persistent_protocol(trials: int = 3000, seed: int = 1) -> str:
    """``persistent_protocol_model`` over ``trials`` random interleavings (STAGES 2-5, 1-9 items of 1-6 key blocks);
    the schedules themselves are attention_gluon.py's (``persistent_items``, checked there). Returns a summary."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(1, 9))], 2 + k % 4, seed=k)
    return f"fp8 persistent protocol: {trials} random interleavings without deadlock or hazard"


if __name__ == "__main__":  # pragma: no cover - tooling
    import argparse
    import os
    import re

    from .attention_gluon import _tool
    from .w4a16_gluon import wgmma_sass_hazards

    ap = argparse.ArgumentParser(description="offline sm_90 compile of every Gluon fp8 attention config")
    ap.add_argument("--dump", default=None, help="directory for ttgir / ptx / cubin / sass of each config")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--cast-late", default="0,1", help="CAST_LATE values to build (0 = the default build)")
    ap.add_argument("--overlap", default="0,1",
                    help="OVERLAP values to build (1 only together with cast_late, the combination in the GPU check)")
    ap.add_argument("--pingpong", default="0,1",
                    help="PINGPONG values to build (1 only without overlap; pingpong builds: permute_k + cast_late)")
    ap.add_argument("--poly-exp", default="0",
                    help="POLY_EXP values to build (exp2s of every 16 on the FMA pipe; 0 = the builds as before)")
    ap.add_argument("--loops", action="store_true", help="also print the per-class counts of each main loop")
    ap.add_argument("--persistent", action="store_true",
                    help="build the persistent kernel instead (permute_k + cast_late; --stages = its ring depth)")
    ap.add_argument("--stages", type=int, default=None, help="persistent ring depth (default _PERSISTENT_STAGES)")
    ap.add_argument("--protocol", action="store_true", help="only the CPU check of the persistent barrier protocol")
    ap.add_argument("--ablate", default=None,
                    help="comma-separated ABLATE masks (timing-only builds, e.g. 0,1,2,4,8,16,32,7,24): build each "
                         "(bf16, no lse) and print its per-step SASS census")
    args = ap.parse_args()
    if args.protocol:
        print(check_persistent_protocol())
        raise SystemExit(0)
    if args.ablate is not None:
        for D in [int(x) for x in args.dims.split(",")]:
            for causal in (False, True):
                for ab in [int(x, 0) for x in args.ablate.split(",")]:
                    tag = f"d{D}_{'causal' if causal else 'full'}_ablate{ab}"
                    c = compile_offline(D, causal, ablate=ab)
                    use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
                    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
                    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
                    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
                    print(f"{tag}: {m.group(0) if m else use.strip()}  "
                          f"max_reg={sass_summary(c)['max_reg_index']}  wgmma_hazards={len(wgmma_sass_hazards(sass))}  "
                          f"ptxas_C75xx={sorted(set(re.findall(r'C75[0-9][0-9]', ptxas)))}", flush=True)
                    for lp in ablate_census(sass):
                        print("    ", lp)
        raise SystemExit(0)
    if args.persistent:
        for D in [int(x) for x in args.dims.split(",")]:
            for causal in (False, True):
                for ot in ("bf16", "fp16"):
                    for wl in (False, True):
                        tag = f"persistent_d{D}_{'causal' if causal else 'full'}_{ot}{'_lse' if wl else ''}"
                        c = compile_offline(D, causal, ot, wl, persistent=True, stages=args.stages)
                        use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
                        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
                        sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
                        ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
                        print(f"{tag}: {m.group(0) if m else use.strip()}  smem={c.metadata.shared} B  "
                              f"{sass_summary(c)}  wgmma_hazards={len(wgmma_sass_hazards(sass))}  "
                              f"ptxas_C75xx={sorted(set(re.findall(r'C75[0-9][0-9]', ptxas)))}  "
                              f"main_loop_instr={[lp['n'] for lp in main_loops(sass)]}", flush=True)
        raise SystemExit(0)
    for D in [int(x) for x in args.dims.split(",")]:
        for causal in (False, True):
            for ot in ("bf16", "fp16"):
                for wl, pk in ((False, False), (True, False), (False, True), (True, True)):
                    builds = [(bool(int(x)), bool(int(y)), False) for x in args.cast_late.split(",")
                              for y in args.overlap.split(",") if int(x) or not int(y)]
                    if pk and "1" in args.pingpong.split(",") and "1" in args.cast_late.split(","):
                        builds.append((True, False, True))  # pingpong on the default build (permute_k + cast_late)
                    if "0" not in args.pingpong.split(","):
                        builds = [bd for bd in builds if bd[2]]
                    builds = [bd + (int(pe),) for bd in builds for pe in args.poly_exp.split(",")]
                    for cl, ov, pp, pe in builds:
                        tag = (f"d{D}_{'causal' if causal else 'full'}_{ot}{'_lse' if wl else ''}"
                               f"{'_permk' if pk else ''}{'_castlate' if cl else ''}{'_overlap' if ov else ''}"
                               f"{'_pingpong' if pp else ''}{f'_poly{pe}' if pe else ''}")
                        try:
                            c = compile_offline(D, causal, ot, wl, permute_k=pk, cast_late=cl, overlap=ov,
                                                pingpong=pp, poly_exp=pe)
                        except Exception as e:
                            print(f"{tag}: COMPILE FAILED: {type(e).__name__}: {str(e)[:3000]}")
                            continue
                        use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
                        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
                        sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
                        loops = main_loops(sass)
                        ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
                        print(f"{tag}: {m.group(0) if m else use.strip()}  smem={c.metadata.shared} B  "
                              f"{sass_summary(c)}  wgmma_hazards={len(wgmma_sass_hazards(sass))}  "
                              f"ptxas_C75xx={sorted(set(re.findall(r'C75[0-9][0-9]', ptxas)))}  "
                              f"main_loop_instr={[lp['n'] for lp in loops]}  "
                              f"ex2_under_pv={[(e['under_pv'], e['ex2']) for e in ex2_under_pv(sass)]}", flush=True)
                        if args.loops:
                            for lp in loops:
                                print("    ", lp)
                        if args.dump:
                            os.makedirs(args.dump, exist_ok=True)
                            for ext in ("ttgir", "ptx"):
                                with open(os.path.join(args.dump, f"{tag}.{ext}"), "w") as f:
                                    f.write(c.asm[ext])
                            with open(os.path.join(args.dump, f"{tag}.sass"), "w") as f:
                                f.write(sass)
