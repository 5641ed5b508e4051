"""FA3-style FlashAttention forward for Hopper (sm_90), written in Gluon (``triton.experimental.gluon``).

Why: the Triton-language forward runs QK^T -> softmax -> PV one after the other in every warpgroup and leaves the
schedulers idle most cycles; Triton cannot place the overlap that FA3 uses. Here ``gl.warp_specialize`` splits a
CTA (128 query rows of one (batch, head)) into a TMA producer warp and two consumer warpgroups of 64 rows each.
The consumers software-pipeline the key loop (issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, wait for one group),
keep P in registers as the PV A operand, and alternate their softmax with each other's GEMMs. K / V stream through
an mbarrier ring of shared-memory slots.

Builds the op routes to (``attention._GLUON_FWD_VARIANT``): ``"persistent"`` at d = 64 / 128 (a persistent grid
over (query tile, head) work items, longest first, packed P cast), ``"persistent3"`` at d = 64 for long queries
(three consumer warpgroups, 192-row items), ``"default"`` at d = 256. The other variants (``overlap``,
``overlap2``, ``persistent_lpt``, ``pingpong``, ``persistent_pingpong``, ``mma_rowsum``, ``poly_exp``, ``unroll2``)
are opt-in builds that were measured slower or were never routed; ``docs/kernels.md`` has their results, the
barrier protocol, the tile / register budgets and the SASS observations. ``python -m fxopt.kernels.attention_gluon``
prints the resource usage of every config offline.

Semantics as ``fxopt::flash_attention`` for d in {64, 128, 256}, causal or not, GQA, contiguous last dim with
16-byte aligned strides (TMA rules); anything else is refused by ``gluon_supported`` with the reason.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from fxopt.kernels import device_capability  # noqa: F401 (also imported from here by the fp8 / backward modules)

try:  # Gluon ships with Triton >= 3.5; keep the module importable without it (CPU-only installs, old Triton).
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

    class _Stub:  # lets the decorated definitions below evaluate; the kernels are never launched
        @staticmethod
        def jit(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)

    gluon = _Stub()
    triton = _Stub()
    gl = tl = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The FMA-pipe exp2 (``_exp2_poly``, written for the fp8 kernel, shared): POLY_EXP of every
# POLY_EXP_PACK per-thread exp2s of a score tile computed by a polynomial instead of MUFU.EX2.
POLY_EXP_CHOICES = (0, 1, 2, 3, 4, 8)
POLY_EXP_PACK = 16
# 2^f on [-1/2, 1/2], relative minimax (Remez on p(f) / 2^f - 1, fit_exp2_poly below), rounded to fp32, low order
# first. Degree 3: max relative error 7.5e-5 (2^-13.7) in float64 and with the fp32 evaluation (tests);
# degree 2 would give 1.7e-3 (2^-9.2).
EXP2_POLY_COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716685295105)
# round-to-nearest shifter: x + 1.5 * 2^23 lands in [2^23, 2^24) (ulp 1), so the sum is rint(x) + the constant;
# + 127 makes the low bits of its bit pattern rint(x) + 127 = the biased exponent of 2^rint(x).
_EXP2_SHIFTER = 12582912.0 + 127.0

# Rows of the query tile owned by one consumer warpgroup, and consumer warpgroups per CTA.
WG_ROWS = 64
NUM_CONSUMERS = 2

# Per head dim: (BLOCK_N, STAGES). Chosen to fit sm_90's 227 KB of shared memory and 240 registers per consumer
# thread without spills (checked offline, see __main__).
_CONFIGS = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
_MAXNREG = 168  # 12 warps x 32 threads x 168 = 64512 <= 65536 registers
_CONSUMER_REGS = 240
_PRODUCER_REGS = 24
# variant="persistent3" (d = 64 only): THREE consumer warpgroups (192 query rows per item) + the producer warp.
# warp_specialize rounds the 13 warps up to 16 = 4 warpgroups (512 threads), so the launch's maxnreg is
# 65536 / 512 = 128. setmaxnreg (sm_90 SASS of the offline build): at entry every worker warp drops to 80 and the
# default partition (consumer warpgroup 0) takes 256 for the set-up; when the partitions start it gives back to
# 168 = what is left of 512 x 128 after the workers: consumer warpgroups 1 and 2 raise to 160, the producer
# warpgroup (1 warp + 3 idle) drops to 24. 128 x (168 + 160 + 160 + 24) = 65536 = the whole register file: one
# CTA per SM, as the persistent grid wants. Consumers can not get more: three at 168 would need
# 128 x (3 x 168 + 24) = 67584 > 65536 (24 is setmaxnreg's minimum, counts are multiples of 8).
# In 160 registers the overlap build's pinned PV wait (the row-sum store, ``_fa_step_overlap``) spilled 816 B
# in the step loops (S 64 + O 32 + P_{i-1} 32 registers stay live across the whole softmax); persistent3 drops
# the pin (``PIN_PV``): ptxas waits for PV_{i-1} right after the row max, so a warpgroup's exp2s overlap the
# other two warpgroups' wgmma instead of its own (0 spills, highest register 155-165 over the 10 builds).
_WG3_ROWS = 3 * WG_ROWS
_WG3_HEAD_DIMS = (64,)
_WG3_STAGES = 3
_WG3_MAXNREG = 128
_WG3_CONSUMER_REGS = 160
_WG3_PRODUCER_REGS = 24
# Persistent two-warpgroup builds, opt-in: the unmasked key-block loop unrolled by two. The overlapped
# step issues PV_{i-1} from P_{i-1}'s registers and computes P_i while that wgmma still reads them, so a rolled loop
# ends each step with 32 register moves (PRMT) of P_i into the operand registers of the next PV; unrolled, one of the
# two steps computes P in place (sm_90 SASS offline: 455 -> 431.5 instructions per step at d = 64, 498 -> 474 at
# d = 128; bit-identical). On the H200 (benchmarks/results/attention_fwd_ab_*.md, two rounds, graph-timed) it won
# only at d = 64 non-causal from 4k (+3.5%, where persistent3 is routed and as fast) and lost at short causal
# lengths (d = 64 1k causal -19%, d = 128 512 / 1k causal -12 to -15%, d = 128 4k-16k causal -2%): off by default.
# Not persistent3: in 160 registers the unrolled loop spilled 2.3 KB. FXOPT_ATTN_GLUON_UNROLL2 (read at import;
# comma-separated head dims) turns it on.
_UNROLL2_DIMS = tuple(int(d) for d in os.environ.get("FXOPT_ATTN_GLUON_UNROLL2", "").split(",") if d.strip())
# Persistent builds: P cast to 16 bits by ``_fa_p16`` (one packed cvt per pair, inline PTX) instead of ``p.to(dtype)``.
# The ``overlap2`` build did this for the non-persistent kernel (bit-identical on the
# H200, +4.6% at d = 64, +-1% at d = 128); the persistent builds were first written without it.
# Offline sm_90 SASS of the persistent builds: see docs/kernels.md. On the H200 (
# benchmarks/results/attention_fwd_ab_{base,castlate}*.md, two rounds each, bit-identical): d = 64 +2.5 to +6%
# (persistent3 from 4k +3 to +5%), d = 128 -0.7 to +2.8%: on by default. FXOPT_ATTN_GLUON_CAST_LATE=0 (read at
# import) turns it off.
_CAST_LATE_ON = os.environ.get("FXOPT_ATTN_GLUON_CAST_LATE", "1") == "1"
if gl is not None:
    _PERSISTENT_CAST_LATE = gl.constexpr(_CAST_LATE_ON)
    _UNROLL2_D64 = gl.constexpr(64 in _UNROLL2_DIMS)
    _UNROLL2_D128 = gl.constexpr(128 in _UNROLL2_DIMS)


# ----------------------------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------------------------


@gluon.jit
def _as_tma_box(buf, desc):
    # [rows, d] slot -> the [1, 1, rows, d] box of the 4-D descriptor (same bytes, leading dims of size 1).
    return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _fa_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 b, h, hk, m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    # Q: one 64-row box per consumer warpgroup, each on its own barrier.
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_bars.index(w),
                                        _as_tma_box(q_smem.index(w), q_desc))
    # K_j, V_j into slot j % STAGES. Fill number u = j // STAGES of a slot waits until both consumers released
    # use u - 1 (parity (u & 1) ^ 1; u = 0 passes at once on a fresh barrier).
    for j in range(n_blocks):
        s = j % STAGES
        empty_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s),
                                        _as_tma_box(k_smem.index(s), k_desc))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s),
                                        _as_tma_box(v_smem.index(s), v_desc))


@gluon.jit
def _fa_mask(s, n0, rows, SEQ_K, diag_off, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    # key columns >= Sk and (causal) columns right of the bottom-right aligned diagonal -> -inf
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        # the Sk bound folded into each row's last visible column: one compare and one select per element (the
        # two tests and their AND cost 4 instructions per element in the sm_90 SASS, 2.5 this way)
        last = gl.minimum(rows + diag_off, SEQ_K - 1)
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(last, 1)
    else:
        keep = gl.expand_dims(cols < SEQ_K, 0)
    return gl.where(keep, s, float("-inf"))


@triton.jit
def _exp2_poly(x):
    """2^x on the FMA / ALU pipes (no MUFU), fp32 in and out; elementwise, plain Triton (runs in the interpreter;
    callable from Gluon). Max relative error 2^-13.7 for -126 <= x <= 127 (tests/test_fp8_gluon_poly.py).

    x = n + f with n = rint(x), |f| <= 1/2 (Cody-Waite by the shifter: t = x + 1.5 * 2^23 + 127 rounds x to an
    integer exactly, f = x - (t - shifter) is exact); 2^f by Horner (3 FFMA, EXP2_POLY_COEFFS); 2^n = the float
    with bit pattern (bits(t) << 23) = (n + 127) << 23 (the shifter's high bits shift out), multiplied in.
    Clamping x >= -127 first makes n >= -127: n = -127 gives the bit pattern 0 = +0.0, so x <= -126.5 and
    x = -inf give exactly +0.0 (NaN: unspecified); -126.5 < x < -126 may give a denormal or 0 (fine for
    fp32 / e4m3 P). Valid for x <= 127 (the kernel's arguments are <= P_SHIFT = 8). 9 instructions per value:
    FMNMX, 3 FADD, 3 FFMA, SHF, FMUL."""
    x = tl.maximum(x, -127.0)
    t = x + 12583039.0  # _EXP2_SHIFTER
    f = x - (t - 12583039.0)
    p = tl.fma(f, 0.0551716685295105, 0.2426111251115799)  # EXP2_POLY_COEFFS
    p = tl.fma(p, f, 0.6932609677314758)
    p = tl.fma(p, f, 0.9999280571937561)
    scale = (t.to(tl.int32, bitcast=True) << 23).to(tl.float32, bitcast=True)
    return p * scale


# POLY_EXP: map_elementwise hands each call POLY_EXP_PACK = 16 consecutive per-thread values; _ex2_mix<K> computes K
# of them with the polynomial (spread: positions 16 i / K) and the rest with MUFU.EX2. Which scores of the tile get
# the polynomial does not matter (every P is summed and cast alike); what matters is that the ex2 is not issued.
@gluon.jit
def _ex2_mix1(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return (_exp2_poly(x0), gl.exp2(x1), gl.exp2(x2), gl.exp2(x3), gl.exp2(x4), gl.exp2(x5), gl.exp2(x6),
            gl.exp2(x7), gl.exp2(x8), gl.exp2(x9), gl.exp2(x10), gl.exp2(x11), gl.exp2(x12), gl.exp2(x13),
            gl.exp2(x14), gl.exp2(x15))


@gluon.jit
def _ex2_mix2(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return (_exp2_poly(x0), gl.exp2(x1), gl.exp2(x2), gl.exp2(x3), gl.exp2(x4), gl.exp2(x5), gl.exp2(x6),
            gl.exp2(x7), _exp2_poly(x8), gl.exp2(x9), gl.exp2(x10), gl.exp2(x11), gl.exp2(x12), gl.exp2(x13),
            gl.exp2(x14), gl.exp2(x15))


@gluon.jit
def _ex2_mix3(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return (_exp2_poly(x0), gl.exp2(x1), gl.exp2(x2), gl.exp2(x3), gl.exp2(x4), _exp2_poly(x5), gl.exp2(x6),
            gl.exp2(x7), gl.exp2(x8), gl.exp2(x9), _exp2_poly(x10), gl.exp2(x11), gl.exp2(x12), gl.exp2(x13),
            gl.exp2(x14), gl.exp2(x15))


@gluon.jit
def _ex2_mix4(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return (_exp2_poly(x0), gl.exp2(x1), gl.exp2(x2), gl.exp2(x3), _exp2_poly(x4), gl.exp2(x5), gl.exp2(x6),
            gl.exp2(x7), _exp2_poly(x8), gl.exp2(x9), gl.exp2(x10), gl.exp2(x11), _exp2_poly(x12), gl.exp2(x13),
            gl.exp2(x14), gl.exp2(x15))


@gluon.jit
def _ex2_mix8(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    return (_exp2_poly(x0), gl.exp2(x1), _exp2_poly(x2), gl.exp2(x3), _exp2_poly(x4), gl.exp2(x5), _exp2_poly(x6),
            gl.exp2(x7), _exp2_poly(x8), gl.exp2(x9), _exp2_poly(x10), gl.exp2(x11), _exp2_poly(x12), gl.exp2(x13),
            _exp2_poly(x14), gl.exp2(x15))

@gluon.jit
def _exp2_mixed(x, POLY_EXP: gl.constexpr):
    """exp2 of an fp32 register tile, POLY_EXP of every 16 per-thread values by ``_exp2_poly`` (0: all MUFU)."""
    if POLY_EXP == 1:
        p = gl.map_elementwise(_ex2_mix1, x, pack=16)[0]
    elif POLY_EXP == 2:
        p = gl.map_elementwise(_ex2_mix2, x, pack=16)[0]
    elif POLY_EXP == 3:
        p = gl.map_elementwise(_ex2_mix3, x, pack=16)[0]
    elif POLY_EXP == 4:
        p = gl.map_elementwise(_ex2_mix4, x, pack=16)[0]
    elif POLY_EXP == 8:
        p = gl.map_elementwise(_ex2_mix8, x, pack=16)[0]
    else:
        gl.static_assert(POLY_EXP == 0, "POLY_EXP must be one of POLY_EXP_CHOICES")
        p = gl.exp2(x)
    return p


def fit_exp2_poly(degree: int = 3, lo: float = -0.5, hi: float = 0.5, iters: int = 30):
    """Relative-error minimax polynomial for 2^f on [lo, hi] (Remez exchange on (p(f) - 2^f) / 2^f, numpy float64):
    returns (coefficients low order first, max relative error on a dense grid). How EXP2_POLY_COEFFS were made
    (rounded to fp32); tests/test_fp8_gluon_poly.py re-runs it."""
    import numpy as np

    n = degree + 2
    ref = (lo + hi) / 2 - (hi - lo) / 2 * np.cos(np.pi * np.arange(n) / (n - 1))  # Chebyshev extrema
    grid = np.linspace(lo, hi, 200001)
    coef, err = None, None
    for _ in range(iters):
        a = np.zeros((n, n))
        a[:, :degree + 1] = ref[:, None] ** np.arange(degree + 1)
        a[:, degree + 1] = (-1.0) ** np.arange(n) * 2.0 ** ref  # p(x_i) - 2^x_i = (-1)^i E 2^x_i
        coef = np.linalg.solve(a, 2.0 ** ref)[:degree + 1]
        err = np.polynomial.polynomial.polyval(grid, coef) / 2.0 ** grid - 1.0
        edges = np.concatenate(([0], np.nonzero(np.diff(np.sign(err)))[0] + 1, [grid.size]))
        if edges.size - 1 != n:
            break
        ref = np.array([grid[a0 + np.argmax(np.abs(err[a0:b0]))] for a0, b0 in zip(edges[:-1], edges[1:])])
    return tuple(float(c) for c in coef), float(np.abs(err).max())


@gluon.jit
def _fa_softmax(s, m_i, l_i, qk_scale, POLY_EXP: gl.constexpr = 0, ROW_SUM: gl.constexpr = True):
    """One online-softmax step on (masked) raw scores s [ROWS, BLOCK_N].

    Returns (p fp32, new running max in raw units, new row sum, alpha = rescale factor of the old O).
    ``POLY_EXP`` > 0 (persistent builds, opt-in): that many of every 16 per-thread exp2s by ``_exp2_poly`` on the
    FMA pipe (masked -inf scores still give exactly 0; rows with m = -inf keep the 0 offset).
    ``ROW_SUM=False`` (``MMA_ROWSUM`` builds): no row sum, ``l_i`` comes back unchanged (the tensor cores sum P)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # A row with no visible key so far keeps m = -inf: use 0 as the offset so exp2 sees -inf (-> 0), not NaN.
    m_off = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    alpha = gl.exp2(m_i * qk_scale - m_off)
    if POLY_EXP:  # truthiness: a kernel constexpr the offline build does not pass arrives as None
        p = _exp2_mixed(s * qk_scale - gl.expand_dims(m_off, 1), POLY_EXP)
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_off, 1))  # one FFMA + MUFU.EX2 per score
    if ROW_SUM:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    else:
        l_new = l_i
    return p, m_new, l_new, alpha


@gluon.jit
def _fa_step(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, m_i, l_i,
             rows, SEQ_K, diag_off, qk_scale,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
             s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr):
    """Key block i >= 1: S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued back to back; wait for S_i only; softmax_i
    runs while PV_{i-1} is on the tensor cores; then wait for PV_{i-1}, rescale O, P_i becomes the next A operand.

    Everything from the first issue to the last wait is straight-line code on purpose. Seen in the sm_90 SASS:
    * a branch (runtime mask test) while a wgmma is in flight: ptxas put the wait for all wgmma at the join, so
      masking is a compile-time variant (MASKED) and the caller runs two loops;
    * keeping PV in flight across the loop back-edge (wait at the top of the next step): ptxas serialised every
      wgmma ("C7512 ... serialized due to insufficient register resources");
    * ptxas 12.8 still schedules the PV wait (WARPGROUP.DEPBAR.LE gsb0, 0x0) right after the row max, above
      the exp2s: it writes P_i / temporaries into the registers that PV_{i-1} reads. Forcing P_{i-1} live past
      the softmax (a select on a runtime-false condition) did not move the wait, so that variant was dropped.
      Within one warpgroup the softmax therefore overlaps only the S_i -> PV_{i-1} tail; the overlap this
      kernel relies on is between the two consumer warpgroups."""
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
def _fa_step_overlap(i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                     pin_buf, rows, SEQ_K, diag_off, qk_scale,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                     s_layout: gl.constexpr, p_layout: gl.constexpr, orow_layout: gl.constexpr,
                     CAST_LATE: gl.constexpr = False, PINGPONG: gl.constexpr = False, WG: gl.constexpr = 0,
                     POLY_EXP: gl.constexpr = 0, PIN_PV: gl.constexpr = True, ones_smem=None,
                     MMA_ROWSUM: gl.constexpr = False):
    """variant="overlap" step (key block i >= 1), FA3's order: issue S_i = Q K_i^T; O *= alpha_{i-1} (the rescale
    owed by the previous softmax, while S_i runs); issue O += P_{i-1} V_{i-1}; wait for S_i; softmax_i; store the
    new row sum l_i to the warpgroup's ``pin_buf`` (never read); wait for PV_{i-1}; P_i = 16-bit copy of p.

    The store is what keeps PV_{i-1} in flight across the exp2s: ptxas's scheduler otherwise hoists
    ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` right behind the row max (it treats it as a free instruction and fills the
    SHFL latency with it; every later write to P_{i-1}'s registers then has to follow it). It does not hoist the
    DEPBAR above a shared-memory store, and the store depends on l_i = l * alpha + rowsum(exp2(...)), i.e. on every
    exp2 of the step. Returns alpha_i instead of applying it (the next step or the tail does).

    ``PINGPONG`` (variant="pingpong"): warpgroup ``WG`` waits for its turn (``_fa_pp_wait``) after K_i landed and
    before the S_i issue, and hands the turn to the other warpgroup (``_fa_pp_pass``) right after the PV_{i-1}
    issue, so the other warpgroup's issues follow this one's and its softmax runs under this one's GEMMs.

    ``PIN_PV=False`` (variant="persistent3" only): no row-sum store, ptxas waits for PV_{i-1} after the row max
    (the pin kept 128 accumulator / operand registers live across the softmax and spilled in 160 registers).

    ``MMA_ROWSUM`` (persistent builds, opt-in): ``l_i`` is the row-sum ACCUMULATOR [ROWS, RS_N] fp32 (wgmma
    layout m64n<RS_N>), handled exactly like O: rescaled by alpha_{i-1} next to O, then L += P_{i-1} E issued right
    after PV_{i-1} (same 16-bit A operand registers; E = ``ones_smem``^T, ones in column 0 only) and waited for
    with it; the softmax does no row sum. S_i's wait allows 2 groups in flight (PV_{i-1} and the row sum). With
    ``PIN_PV`` the pin store holds a bitwise OR over the fp32 bits of the step's P per row (``_fa_pin_value``):
    it still depends on every exp2, on the ALU pipe and with ~half the instructions of the FADD row sum."""
    dtype: gl.constexpr = q_buf.dtype
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    if PINGPONG:
        _fa_pp_wait(WG)
    s = warpgroup_mma(q_buf, k_smem.index(ks).permute((1, 0)), s, use_acc=False, is_async=True)
    o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    if MMA_ROWSUM:
        l_i = _fa_rowsum_rescale(l_i, alpha)
    jv = i - 1
    vs = jv % STAGES
    mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
    o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
    if MMA_ROWSUM:
        l_i = _fa_rowsum_issue(p16, ones_smem, l_i)
    if PINGPONG:
        _fa_pp_pass(WG)
    if MMA_ROWSUM:  # S_i, PV_{i-1}, L_{i-1}: <= 2 in flight means S_i is done
        s = warpgroup_mma_wait(num_outstanding=2, deps=[s])
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    mbarrier.arrive(k_empty.index(ks), count=1)
    if MASKED:
        s = _fa_mask(s, i * BLOCK_N, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    if MMA_ROWSUM:
        p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale, POLY_EXP, False)
        if PIN_PV:
            pin_buf.store(_fa_pin_value(p))
        o, p16, l_i = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16, l_i])
    else:
        p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale, POLY_EXP)
        if PIN_PV:  # False: variant="persistent3" (see _fa_consumer_persistent)
            pin_buf.store(l_i)
        o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
    mbarrier.arrive(v_empty.index(vs), count=1)
    if CAST_LATE:  # variant="overlap2": one packed cvt per element pair (see _fa_p16)
        p16 = _fa_p16(p, dtype, p_layout)
    else:
        p16 = gl.convert_layout(p.to(dtype), p_layout)
    return s, o, p16, alpha, m_i, l_i


# MMA_ROWSUM (persistent builds, opt-in): the softmax row sum of P on the tensor cores, L += P E with E [BLOCK_N, RS_N]
# = a constant tile in shared memory, ones in column 0 and zeros elsewhere, so that column 0 of the fp32 accumulator
# L [64, RS_N] is the row sum of the 16-bit P that P V uses and the other columns are exactly 0 (the epilogue sums
# a row: exact). RS_N = 8, the smallest N of a 16-bit wgmma (m64n8k16).
RS_N = 8


@gluon.jit
def _fa_rowsum_rescale(l_acc, alpha):
    """L *= alpha (per row), like O's deferred rescale: 4 FMUL per thread for a 64 x 8 accumulator."""
    rs_row: gl.constexpr = gl.SliceLayout(1, l_acc.type.layout)
    return l_acc * gl.expand_dims(gl.convert_layout(alpha, rs_row), 1)


@gluon.jit
def _fa_rowsum_issue(p16, ones_smem, l_acc):
    """Issue L += P E (async wgmma m64n8k16, K = BLOCK_N) with P = the PV wgmma's 16-bit register A operand (its
    layout re-expressed with L's accumulator as parent: the same registers, a layout conversion with no data
    movement) and E^T = ``ones_smem`` [RS_N, BLOCK_N] (K-major like a K tile, hence the permute)."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_acc.type.layout, k_width=2)
    return warpgroup_mma(gl.convert_layout(p16, a_layout), ones_smem.permute((1, 0)), l_acc, is_async=True)


@gluon.jit
def _fa_or_combine(a, b):
    return a | b


@gluon.jit
def _fa_pin_value(p):
    """A per-row value that depends on every element of the step's fp32 P (bitwise OR of their bits, as fp32 bits):
    the MMA_ROWSUM build's pin store (the row sum it replaces was the old pin). Never read."""
    bits = gl.reduce(p.to(gl.int32, bitcast=True), 1, _fa_or_combine)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _fa_rowsum_final(l_acc, row_layout: gl.constexpr):
    """The row sum l [ROWS] (row_layout) out of the accumulator: column 0 plus exact zeros."""
    return gl.convert_layout(gl.sum(l_acc, axis=1), row_layout)


# variant="pingpong": hardware named barriers (``bar.sync`` / ``bar.arrive``, 256 threads = both consumer
# warpgroups) that order the two warpgroups' wgmma issues. Barrier _PP_BAR0 + w is "warpgroup w's turn": w syncs
# on it (128 threads), the other warpgroup arrives on it (128 threads). Triton 3.6 uses ids 0 (default partition),
# 1 (whole CTA, warp_specialize entry / exit) and 2 (worker partitions) in this kernel; 14 / 15 stay clear of them.
_PP_BAR0 = 14


@gluon.jit
def _fa_pp_wait(WG: gl.constexpr):
    """Block warpgroup WG until the other warpgroup passed it the turn (``bar.sync 14 + WG, 256``). The asm has
    no operands and a dummy result; is_pure=False keeps it (and its order against the wgmma asm) in place."""
    if WG == 0:
        gl.inline_asm_elementwise("bar.sync 14, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync 15, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fa_pp_pass(WG: gl.constexpr):
    """Give the turn to the other warpgroup (``bar.arrive 14 + (1 - WG), 256``; does not block)."""
    if WG == 0:
        gl.inline_asm_elementwise("bar.arrive 15, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive 14, 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fa_p16(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """fp32 P -> 16-bit wgmma A operand with one packed ``cvt.rn.{bf16x2,f16x2}.f32`` per element pair (inline PTX,
    so LLVM cannot split it into scalar casts: see below). Round-to-nearest-even per element, the
    same rounding as ``p.to(dtype)``; the pair is (element 2k, element 2k+1) of a thread, low half first, which is
    how the 16-bit tensor is packed into 32-bit registers anyway.

    Why (offline sm_90 SASS): in the overlap build the TTGIR loop carries the 16-bit P operand, but
    LLVM folds the loop phi of ``truncf`` into a phi of the fp32 exp2 results. The 64 scalar ``cvt.rn.bf16.f32``
    then sit in the loop header block and the ``mov.b32 {lo, hi}`` packing into the wgmma operand in the body
    block (after the loop-exit branch), so the NVPTX backend cannot pair them; ptxas emits 32 F2FP.PACK_AB with the
    halves the wrong way round plus 32 ``PRMT 0x5432`` half-swaps per step (64 PRMT in the masked loop, plus
    LOP3 / SEL / SHF byte work), and the loop carries 64 fp32 registers instead of 32 packed ones. The inline asm
    result cannot be split: 32 F2FP, no PRMT. Same rounding, so the output is bit-identical to "overlap".
    (Carrying fp32 P and casting next to the PV issue gives the same loop but spilled 60 B at the loop
    transitions of the d = 128 causal build.)"""
    if dtype == gl.bfloat16:
        p16 = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                        is_pure=True, pack=2)
    else:
        p16 = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                        is_pure=True, pack=2)
    return gl.convert_layout(p16, p_layout)


@gluon.jit
def _fa_consumer(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 OVERLAP: gl.constexpr = False, pin=None, CAST_LATE: gl.constexpr = False,
                 PINGPONG: gl.constexpr = False):
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
    # Leading key blocks that need no mask for any row of this warpgroup: fully inside Sk and (causal) left of
    # the diagonal for the first row. The rest (diagonal blocks, ragged last block) take the masked loop.
    n_full = SEQ_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
    n_full = gl.minimum(n_full, n_blocks)

    q_buf = q_smem.index(WG)
    mbarrier.wait(q_bars.index(WG), 0)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # ---- block 0: S_0 = Q K_0^T, softmax -> P_0 (no PV in flight yet, so a runtime branch is harmless here)
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:  # issue point 0: warpgroup 0 holds the first turn and does not wait (see the docstring)
        if WG == 1:
            _fa_pp_wait(WG)
    s = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        _fa_pp_pass(WG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        s = _fa_mask(s, 0, rows, SEQ_K, diag_off, BLOCK_N, CAUSAL, s_layout)
    p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale)
    if CAST_LATE:
        p16 = _fa_p16(p, dtype, p_layout)
    else:
        p16 = gl.convert_layout(p.to(dtype), p_layout)

    if OVERLAP:
        # variant="overlap" / "overlap2" (CAST_LATE): same loops, _fa_step_overlap (O rescale deferred to the next
        # issue, pinned PV wait)
        pin_buf = pin.index(WG)
        for i in range(1, n_full):
            s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i, pin_buf,
                rows, SEQ_K, diag_off, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout, p_layout, orow_layout,
                CAST_LATE, PINGPONG, WG)
        for i in range(gl.maximum(n_full, 1), n_blocks):
            s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i, pin_buf,
                rows, SEQ_K, diag_off, qk_scale, BLOCK_N, STAGES, CAUSAL, True, s_layout, p_layout, orow_layout,
                CAST_LATE, PINGPONG, WG)
        # ---- tail: O = O * alpha_{n-1} + P_{n-1} V_{n-1} (alpha_0 = 0 multiplies the zero O when n = 1)
        jv = n_blocks - 1
        vs = jv % STAGES
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
        if PINGPONG:  # issue point n_blocks, the last one: warpgroup 1 does not pass the turn back
            _fa_pp_wait(WG)
        o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
        if PINGPONG:
            if WG == 0:
                _fa_pp_pass(WG)
        o, p16 = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16])
        mbarrier.arrive(v_empty.index(vs), count=1)
    else:
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
    tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], _as_tma_box(q_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _fa_consumer_wg0(o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                     lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     OVERLAP: gl.constexpr = False, pin=None, CAST_LATE: gl.constexpr = False,
                     PINGPONG: gl.constexpr = False):
    _fa_consumer(0, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                 OVERLAP, pin, CAST_LATE, PINGPONG)


@gluon.jit
def _fa_consumer_wg1(o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                     lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     OVERLAP: gl.constexpr = False, pin=None, CAST_LATE: gl.constexpr = False,
                     PINGPONG: gl.constexpr = False):
    _fa_consumer(1, o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                 lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                 OVERLAP, pin, CAST_LATE, PINGPONG)


@gluon.jit
def _fa3_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, OVERLAP: gl.constexpr = False,
                    CAST_LATE: gl.constexpr = False, PINGPONG: gl.constexpr = False):
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

    # Key blocks this CTA visits (both consumers walk all of them; see the design notes in docs/kernels.md).
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
    if PINGPONG:
        # variant="pingpong": the overlap build plus named-barrier turns between the consumer warpgroups
        pin = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_fa_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin, False, True)),
            (_fa_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin, False, True)),
            (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, m0, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif CAST_LATE:
        # variant="overlap2": the overlap variant's pin slot; P cast by _fa_p16
        pin = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_fa_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin, True)),
            (_fa_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin, True)),
            (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, m0, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif OVERLAP:
        # variant="overlap": a [ROWS] fp32 slot per consumer warpgroup for the row-sum store that pins the PV wait
        pin = gl.allocate_shared_memory(gl.float32, [2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_fa_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin)),
            (_fa_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL, True, pin)),
            (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, m0, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_fa_consumer_wg0, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL)),
            (_fa_consumer_wg1, (o_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty,
                                lse_ptr, bh, b, h, m0, n_blocks, SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                                CAUSAL)),
            (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready,
                            v_empty, b, h, hk, m0, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- variant="persistent" / "persistent_lpt": one CTA per SM, looping over work items (see the design notes in docs/kernels.md)


@gluon.jit
def _fa_sched_count(pid, P, T, SCHED: gl.constexpr):
    """Work items of CTA ``pid`` (of P) out of T = NUM_M_BLOCKS * NUM_BH under schedule SCHED (_fa_sched_item)."""
    if SCHED == 1:  # pairs: CTA pid owns units c = pid + k P (items 2c, 2c + 1); the odd last item is unit T // 2
        half = T // 2
        n = 2 * ((gl.maximum(half - pid, 0) + P - 1) // P)
        n += ((T % 2 == 1) & (half % P == pid)).to(gl.int32)
    elif SCHED == 2:  # snake over rounds of P items: round R = T // P is the partial one
        rnd = T // P
        pos = pid
        if rnd % 2 == 1:
            pos = P - 1 - pid
        n = rnd + (pos < T % P).to(gl.int32)
    else:  # stride: items pid, pid + P, ...
        n = (gl.maximum(T - pid, 0) + P - 1) // P
    return n


@gluon.jit
def _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch * head, query block) of CTA pid's t-th work item. Every partition calls this with the same values.

    SCHED 0: items heads-major (consecutive CTAs share a head's K / V in L2), CTA pid takes pid, pid + P, ...;
    causal: the query blocks of a head longest first. SCHED 1 (causal): the same order, but the blocks of a head
    in zigzag order num_m - 1, 0, num_m - 2, 1, ... and a CTA takes two consecutive items at a time, so every unit
    (a long and the matching short block) has about the same number of key blocks (balanced by construction).
    SCHED 2 (causal, longest processing time first): items rank-major (every head's longest block, then every
    head's second longest, ...), dealt out in snake order (round k to CTAs 0..P-1, round k + 1 back from P-1)."""
    if SCHED == 1:
        x = 2 * (pid + (t // 2) * P) + t % 2
        bh = x // NUM_M_BLOCKS
        j = x % NUM_M_BLOCKS
        pid_m = j // 2
        if j % 2 == 0:
            pid_m = NUM_M_BLOCKS - 1 - j // 2
    elif SCHED == 2:
        pos = pid
        if t % 2 == 1:
            pos = P - 1 - pid
        x = t * P + pos
        bh = x % NUM_BH
        pid_m = NUM_M_BLOCKS - 1 - x // NUM_BH
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
    """One warp. Item t: Q of every consumer warpgroup (NUM_WG of them: 2, or 3 for variant="persistent3") into
    Q buffer t % 2 (use t // 2 of that buffer), then K_j / V_j of the item through the ring with the CTA-wide block
    counter g (slot g % STAGES, use g // STAGES). It runs ahead into item t + 1 as soon as buffers / slots are
    released, i.e. while the consumers finish item t."""
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
        # use u = t // 2 of Q buffer qb waits until consumer w released use u - 1 (item t - 2); parity
        # (u & 1) ^ 1 passes at once for u = 0 on a fresh barrier
        q_phase = ((t // 2) & 1) ^ 1
        for w in gl.static_range(NUM_WG):
            mbarrier.wait(q_empty.index(NUM_WG * qb + w), q_phase)
            mbarrier.expect(q_ready.index(NUM_WG * qb + w), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0 + w * ROWS, 0], q_ready.index(NUM_WG * qb + w),
                                            _as_tma_box(q_smem.index(NUM_WG * qb + w), q_desc))
        for g in range(g0, g0 + n_blocks):
            s = g % STAGES
            empty_phase = ((g // STAGES) & 1) ^ 1
            n0 = (g - g0) * BLOCK_N
            mbarrier.wait(k_empty.index(s), empty_phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], k_ready.index(s),
                                            _as_tma_box(k_smem.index(s), k_desc))
            mbarrier.wait(v_empty.index(s), empty_phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], v_ready.index(s),
                                            _as_tma_box(v_smem.index(s), v_desc))
        g0 += n_blocks


@gluon.jit
def _fa_consumer_persistent(WG: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                            qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                            PINGPONG: gl.constexpr = False, POLY_EXP: gl.constexpr = 0, NUM_WG: gl.constexpr = 2,
                            ones=None, MMA_ROWSUM: gl.constexpr = False):
    """Consumer warpgroup WG (of NUM_WG: 2, or 3 for variant="persistent3") of the persistent kernel: per item
    exactly the "overlap" consumer's block 0, loops (``_fa_step_overlap``), tail and epilogue, with the ring
    position offset by the CTA-wide block counter g0. NUM_WG = 3: 192-row items, no PV pin (``PIN_PV``, see
    _WG3_CONSUMER_REGS: in 160 registers it spilled).
    Differences: Q comes from buffer t % 2; the O tile is staged in that buffer and its TMA store is NOT waited for
    in the epilogue: item t + 1 waits for it (``store_wait``, the store had block 0 of item t + 1 to read the
    shared memory) and then hands the buffer back to the producer (``q_empty``) for item t + 2's Q.

    ``PINGPONG`` (variant="persistent_pingpong"): variant="pingpong"'s turns per item, made to chain across items:
    warpgroup 1 passes the turn back after its last issue (the tail PV) when the CTA has another item, and
    warpgroup 0 waits for it before item t + 1's first issue (S_0), so both warpgroups' turns strictly alternate
    over the CTA's whole life (a warpgroup never arrives twice on the other's barrier without a sync between: two
    arrivals of one warpgroup would complete a 256-thread generation on their own). Per CTA, warpgroup 0 waits
    sum(n) + items - 1 times and warpgroup 1 passes as often; warpgroup 1 waits sum(n + 1) times, warpgroup 0 passes
    as often: no barrier is left with partial arrivals at exit.

    ``MMA_ROWSUM``: ``l_i`` is the row-sum accumulator (see ``_fa_step_overlap``), reduced to the row sum in the
    epilogue; ``ones`` = the constant [RS_N, BLOCK_N] tile the kernel filled before the partitions started."""
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
    # MMA_ROWSUM == 2 (mma_rowsum="nopin"): the row-sum wgmma without the OR pin (PV waited after the row max)
    PIN_PV: gl.constexpr = (NUM_WG == 2) and (MMA_ROWSUM != 2)
    UNROLL2: gl.constexpr = ((NUM_WG == 2) and (not PINGPONG) and (not MMA_ROWSUM)
                             and ((HEAD_DIM == 64 and _UNROLL2_D64) or (HEAD_DIM == 128 and _UNROLL2_D128)))
    # the unrolled loop was measured with p.to(dtype); with the packed cast too it spills 100 bytes
    CAST_LATE: gl.constexpr = _PERSISTENT_CAST_LATE and (not MMA_ROWSUM) and (not UNROLL2)
    if MMA_ROWSUM:
        RS_COLS: gl.constexpr = ones.shape[0]
        rs_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, RS_COLS, 16])
    g0 = 0  # ring position (CTA-wide key-block counter) of the item's block 0
    for t in range(n_local):
        bh, pid_m = _fa_sched_item(t, pid, P, NUM_BH, NUM_M_BLOCKS, SCHED, CAUSAL)
        b = bh // H
        h = bh % H
        m0 = pid_m * (NUM_WG * ROWS)
        n_blocks = _fa_tile_blocks(m0, SEQ_Q, SEQ_K, NUM_WG * ROWS, BLOCK_N, CAUSAL)
        row_first = m0 + WG * ROWS
        rows = row_first + gl.arange(0, ROWS, layout=row_layout)
        n_full = SEQ_K // BLOCK_N
        if CAUSAL:
            n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
        n_full = gl.minimum(n_full, n_blocks)

        qb = t % 2
        q_buf = q_smem.index(NUM_WG * qb + WG)
        mbarrier.wait(q_ready.index(NUM_WG * qb + WG), (t // 2) & 1)

        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        if MMA_ROWSUM:  # the row-sum accumulator L [ROWS, RS_N] (m64n8 wgmma layout), zero like O
            l_i = gl.zeros([ROWS, RS_COLS], gl.float32, layout=rs_layout)
        else:
            l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

        # ---- block 0 (ring position g0)
        ks0 = g0 % STAGES
        mbarrier.wait(k_ready.index(ks0), (g0 // STAGES) & 1)
        if PINGPONG:  # issue point 0: warpgroup 0 waits from the second item on (the turn warpgroup 1 passed back)
            if WG == 1:
                _fa_pp_wait(WG)
            else:
                if t > 0:
                    _fa_pp_wait(WG)
        s = warpgroup_mma(q_buf, k_smem.index(ks0).permute((1, 0)), s, use_acc=False, is_async=True)
        if PINGPONG:
            _fa_pp_pass(WG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        mbarrier.arrive(k_empty.index(ks0), count=1)
        # Every mask of the item sees its key columns shifted by g0 * BLOCK_N (_fa_step_overlap takes the ring
        # position as its block index), Sk and the diagonal offset shifted by the same amount: the same
        # comparisons, exactly. For block 0 the shift also keeps LLVM from hoisting its item-invariant
        # ``cols < Sk`` predicates out of the item loop (~30 registers live across it: 184 B of spills).
        seq_k_sh = SEQ_K + g0 * BLOCK_N
        diag_sh = diag_off + g0 * BLOCK_N
        if n_full == 0:
            s = _fa_mask(s, g0 * BLOCK_N, rows, seq_k_sh, diag_sh, BLOCK_N, CAUSAL, s_layout)
        if MMA_ROWSUM:
            p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale, POLY_EXP, False)
        else:
            p, m_i, l_i, alpha = _fa_softmax(s, m_i, l_i, qk_scale, POLY_EXP)
        if CAST_LATE:
            p16 = _fa_p16(p, dtype, p_layout)
        else:
            p16 = gl.convert_layout(p.to(dtype), p_layout)

        # ---- item t - 1's O store (from the other Q buffer) has read its shared memory: give that buffer back to
        # the producer (item t + 1's Q). Nothing is outstanding for t = 0 and the arrive is skipped then.
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(NUM_WG * (1 - qb) + WG), count=1, pred=t > 0)

        # ---- key blocks 1 .. n_blocks - 1 at ring positions g0 + 1 .. g0 + n_blocks - 1
        if UNROLL2:  # the unmasked steps in pairs, then the odd one (see _UNROLL2_DIMS)
            n_unmasked = gl.maximum(n_full - 1, 0)
            for i in range(g0 + 1, g0 + 1 + (n_unmasked // 2) * 2, 2):
                s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                    i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                    pin_buf, rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout, p_layout,
                    orow_layout, CAST_LATE, PINGPONG, WG, POLY_EXP, PIN_PV, ones, MMA_ROWSUM)
                s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                    i + 1, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                    pin_buf, rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout, p_layout,
                    orow_layout, CAST_LATE, PINGPONG, WG, POLY_EXP, PIN_PV, ones, MMA_ROWSUM)
            if n_unmasked % 2 == 1:
                s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                    g0 + n_unmasked, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha,
                    m_i, l_i, pin_buf, rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout,
                    p_layout, orow_layout, CAST_LATE, PINGPONG, WG, POLY_EXP, PIN_PV, ones, MMA_ROWSUM)
        else:
            for i in range(g0 + 1, g0 + n_full):
                s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                    i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i,
                    pin_buf, rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, False, s_layout, p_layout,
                    orow_layout, CAST_LATE, PINGPONG, WG, POLY_EXP, PIN_PV, ones, MMA_ROWSUM)
        for i in range(g0 + gl.maximum(n_full, 1), g0 + n_blocks):
            s, o, p16, alpha, m_i, l_i = _fa_step_overlap(
                i, q_buf, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, s, o, p16, alpha, m_i, l_i, pin_buf,
                rows, seq_k_sh, diag_sh, qk_scale, BLOCK_N, STAGES, CAUSAL, True, s_layout, p_layout, orow_layout,
                CAST_LATE, PINGPONG, WG, POLY_EXP, PIN_PV, ones, MMA_ROWSUM)
        # ---- tail: O = O * alpha_{n-1} + P_{n-1} V_{n-1}
        jv = g0 + n_blocks - 1
        vs = jv % STAGES
        o = o * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        if MMA_ROWSUM:
            l_i = _fa_rowsum_rescale(l_i, alpha)
        mbarrier.wait(v_ready.index(vs), (jv // STAGES) & 1)
        if PINGPONG:  # issue point n_blocks: warpgroup 1 passes back only when the CTA has another item
            _fa_pp_wait(WG)
        o = warpgroup_mma(p16, v_smem.index(vs), o, is_async=True)
        if MMA_ROWSUM:
            l_i = _fa_rowsum_issue(p16, ones, l_i)
        if PINGPONG:
            if WG == 0:
                _fa_pp_pass(WG)
            else:
                if t + 1 < n_local:
                    _fa_pp_pass(WG)
        if MMA_ROWSUM:
            o, p16, l_i = warpgroup_mma_wait(num_outstanding=0, deps=[o, p16, l_i])
            l_i = _fa_rowsum_final(l_i, row_layout)
        else:
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
            # item-invariant, LLVM hoists it and ptxas spilled it (8 B)
            lse_row = bh.to(gl.uint32).to(gl.int64) * SEQ_Q.to(gl.uint32).to(gl.int64)
            gl.store(lse_ptr + lse_row + rows, lse, mask=rows < SEQ_Q)
        q_buf.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row_first, 0], _as_tma_box(q_buf, o_desc))
    tma.store_wait(0)


@gluon.jit
def _fa_consumer_persistent_wg0(o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                                qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                                PINGPONG: gl.constexpr, POLY_EXP: gl.constexpr, NUM_WG: gl.constexpr = 2,
                                ones=None, MMA_ROWSUM: gl.constexpr = False):
    _fa_consumer_persistent(0, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                            pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, qk_scale,
                            HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED, WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG, ones,
                            MMA_ROWSUM)


@gluon.jit
def _fa_consumer_persistent_wg1(o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                                qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                                PINGPONG: gl.constexpr, POLY_EXP: gl.constexpr, NUM_WG: gl.constexpr = 2,
                                ones=None, MMA_ROWSUM: gl.constexpr = False):
    _fa_consumer_persistent(1, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                            pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, qk_scale,
                            HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED, WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG, ones,
                            MMA_ROWSUM)


@gluon.jit
def _fa_consumer_persistent_wg2(o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K,
                                qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                CAUSAL: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                                PINGPONG: gl.constexpr, POLY_EXP: gl.constexpr, NUM_WG: gl.constexpr,
                                ones=None, MMA_ROWSUM: gl.constexpr = False):
    # variant="persistent3" only: the third consumer warpgroup, query rows m0 + 128 .. m0 + 191 of the 192-row tile
    _fa_consumer_persistent(2, o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                            pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS, SEQ_Q, SEQ_K, qk_scale,
                            HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED, WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG, ones,
                            MMA_ROWSUM)


# No value specialization of the runtime ints (Triton would make a 1 a constant and mark multiples of 16) or of
# lse_ptr's alignment: one build per constexpr set, and it is exactly the build ``compile_offline`` checks.
@gluon.jit(do_not_specialize=["lse_ptr", "H", "GROUP", "SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "NUM_BH"])
def _fa3_fwd_persistent_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, SEQ_Q, SEQ_K,
                               NUM_M_BLOCKS, NUM_BH, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, SCHED: gl.constexpr, WRITE_LSE: gl.constexpr,
                               PINGPONG: gl.constexpr = False, POLY_EXP: gl.constexpr = 0,
                               NUM_WG: gl.constexpr = 2, MMA_ROWSUM: gl.constexpr = False):
    """variant="persistent" / "persistent_lpt" / "persistent_pingpong" (PINGPONG) / "persistent3" (NUM_WG = 3):
    grid (P,), P <= number of SMs; CTA pid runs the work items
    ``_fa_sched_item(t, pid, ...)`` for t < ``_fa_sched_count(...)``, each exactly like one CTA of the "overlap"
    build. Shared memory: two Q buffers per consumer warpgroup (2 x NUM_WG x 64 x d), the K / V ring, the pin slots.
    NUM_WG = 3: three consumer warpgroups (a 192-row query tile per item), no ping-pong. ``MMA_ROWSUM``: the
    softmax row sums by wgmma against a constant [RS_N, BLOCK_N] tile filled here, before the partitions fork (the
    fence orders the generic-proxy stores before the wgmma's async-proxy reads; warp_specialize's entry barrier
    orders them before every consumer warpgroup)."""
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
    if MMA_ROWSUM:
        # E^T [RS_N, BLOCK_N], K-major like a K tile: row 0 ones, rows 1 .. RS_N - 1 zeros (column 0 of L = row sum)
        RS_COLS: gl.constexpr = 8  # = RS_N (a module global is not visible in here)
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        e_rows = gl.arange(0, RS_COLS, layout=gl.SliceLayout(1, fill_layout))
        e_val = gl.where(gl.expand_dims(e_rows, 1) == 0, 1.0, 0.0) + gl.zeros([RS_COLS, BLOCK_N], gl.float32,
                                                                                 layout=fill_layout)
        ones = gl.allocate_shared_memory(dtype, [RS_COLS, BLOCK_N],
                                         gl.NVMMASharedLayout.get_default_for([RS_COLS, BLOCK_N], dtype),
                                         e_val.to(dtype))
        fence_async_shared()
    # (the partitions get ``ones if MMA_ROWSUM else MMA_ROWSUM``: without the tile a constexpr False, which adds
    # nothing to the warp_specialize captures, so the builds without MMA_ROWSUM are unchanged)
    if NUM_WG == 3:
        # variant="persistent3": consumer warpgroups 0 (default partition), 1, 2 and the producer warp: 13 warps,
        # 16 after rounding to warpgroups; registers per SM: see _WG3_CONSUMER_REGS
        gl.static_assert(not PINGPONG, "persistent3 has no ping-pong turns (they are written for two warpgroups)")
        gl.warp_specialize([
            (_fa_consumer_persistent_wg0, (o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                           v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                           SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                           WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG,
                                           (ones if MMA_ROWSUM else MMA_ROWSUM), MMA_ROWSUM)),
            (_fa_consumer_persistent_wg1, (o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                           v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                           SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                           WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG,
                                           (ones if MMA_ROWSUM else MMA_ROWSUM), MMA_ROWSUM)),
            (_fa_consumer_persistent_wg2, (o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                           v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                           SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                           WRITE_LSE, PINGPONG, POLY_EXP, NUM_WG,
                                           (ones if MMA_ROWSUM else MMA_ROWSUM), MMA_ROWSUM)),
            (_fa_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                       k_empty, v_ready, v_empty, pid, P, n_local, H, GROUP, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, BLOCK_N, STAGES, CAUSAL, SCHED, NUM_WG)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_fa_consumer_persistent_wg0, (o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                           v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                           SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                           WRITE_LSE, PINGPONG, POLY_EXP, 2,
                                           (ones if MMA_ROWSUM else MMA_ROWSUM), MMA_ROWSUM)),
            (_fa_consumer_persistent_wg1, (o_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                           v_ready, v_empty, pin, lse_ptr, pid, P, n_local, H, NUM_BH, NUM_M_BLOCKS,
                                           SEQ_Q, SEQ_K, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SCHED,
                                           WRITE_LSE, PINGPONG, POLY_EXP, 2,
                                           (ones if MMA_ROWSUM else MMA_ROWSUM), MMA_ROWSUM)),
            (_fa_producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                       k_empty, v_ready, v_empty, pid, P, n_local, H, GROUP, NUM_BH, NUM_M_BLOCKS,
                                       SEQ_Q, SEQ_K, BLOCK_N, STAGES, CAUSAL, SCHED)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

_TORCH_TO_GL = {}


def _gl_dtype(dt):
    if not _TORCH_TO_GL:
        _TORCH_TO_GL.update({torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                             torch.float8_e4m3fn: gl.float8e4nv})
    return _TORCH_TO_GL[dt]


@functools.lru_cache(maxsize=None)
def host_layout(block: tuple, dtype: torch.dtype):
    """``NVMMASharedLayout.get_default_for(block, dtype)`` for a host-side TensorDescriptor, cached (a frozen
    dataclass): building it was ~7 of the ~10 us a descriptor cost on the host, and a forward launch builds four,
    a backward launch six or more (the op's launch path was measured longer than the GPU work below S = 4096).
    float32 (the backward's lse / delta vectors) included."""
    gdt = gl.float32 if dtype == torch.float32 else _gl_dtype(dtype)
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


# Builds that failed their H200 check: refused by gluon_attention_fwd unless FXOPT_ATTN_GLUON_UNCHECKED=1.
_FAILED_GPU_CHECK = {"persistent_pingpong": "was not bit-identical to variant 'overlap' on the H200"}
VARIANTS = ("default", "overlap", "overlap2", "persistent", "persistent_lpt", "pingpong", "persistent_pingpong",
            "persistent3")
# Persistent variants: the head dims whose two Q buffers per consumer warpgroup fit in shared memory next to the
# K / V ring (d = 256 would need 2 x 2 x 64 x 256 x 2 = 128 KB of Q plus 128 KB of K / V > 227 KB).
_PERSISTENT_HEAD_DIMS = (64, 128)
# Causal schedule of each persistent variant (``_fa_sched_item``): 1 = zigzag pairs, 2 = LPT snake.
_PERSISTENT_SCHED = {"persistent": 1, "persistent_lpt": 2, "persistent_pingpong": 1, "persistent3": 1}
# variant="pingpong": the overlap build's tiles; every head dim compiles clean offline.
_PINGPONG_HEAD_DIMS = (64, 128, 256)


def config_for(head_dim: int, variant: str = "default") -> dict:
    """Kernel meta-parameters the wrapper uses for a head dim (also used by the offline compile check).

    ``variant="overlap"``: same tiles, ``OVERLAP=True``; ``variant="overlap2"``: also ``CAST_LATE=True``;
    ``variant="pingpong"``: ``OVERLAP=True`` and ``PINGPONG=True`` (named-barrier turns of the two warpgroups);
    ``variant="persistent"`` / ``"persistent_lpt"``: the overlap build's tiles in ``_fa3_fwd_persistent_kernel``
    (``PERSISTENT=True``; ``SCHED_CAUSAL`` = the causal schedule), d = 64 / 128 only (see the module
    docstring). ``variant="persistent3"``: the persistent kernel with three consumer warpgroups (``NUM_WG=3``,
    192-row query tiles; registers and ``maxnreg`` of the 16-warp CTA), d = 64 only.
    Raises ValueError for an unknown variant, head dim, or an unsupported combination."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (one of {VARIANTS})")
    if head_dim not in _CONFIGS:
        raise ValueError(f"head dim {head_dim} not supported (only {sorted(_CONFIGS)})")
    if variant == "persistent3" and head_dim not in _WG3_HEAD_DIMS:
        raise ValueError(_wg3_head_dim_reason(head_dim))
    if variant in _PERSISTENT_SCHED and head_dim not in _PERSISTENT_HEAD_DIMS:
        raise ValueError(f"variant {variant!r} supports head dims {_PERSISTENT_HEAD_DIMS}, not {head_dim}: its two "
                         f"Q buffers per consumer warpgroup and the K / V ring do not fit in 227 KB of shared memory")
    block_n, stages = _CONFIGS[head_dim]
    cfg = dict(BLOCK_N=block_n, STAGES=stages, num_warps=4, maxnreg=_MAXNREG,
               CONSUMER_REGS=_CONSUMER_REGS, PRODUCER_REGS=_PRODUCER_REGS)
    if variant in ("overlap", "overlap2", "pingpong"):
        cfg["OVERLAP"] = True
    if variant in ("pingpong", "persistent_pingpong"):
        cfg["PINGPONG"] = True
    if variant == "overlap2":
        cfg["CAST_LATE"] = True
    if variant in _PERSISTENT_SCHED:
        cfg["PERSISTENT"] = True
        cfg["SCHED_CAUSAL"] = _PERSISTENT_SCHED[variant]
    if variant == "persistent3":
        cfg.update(STAGES=_WG3_STAGES, NUM_WG=3, maxnreg=_WG3_MAXNREG, CONSUMER_REGS=_WG3_CONSUMER_REGS,
                   PRODUCER_REGS=_WG3_PRODUCER_REGS)
    return cfg


def _wg3_head_dim_reason(head_dim: int) -> str:
    return (f"variant 'persistent3' supports head dim 64 only, not {head_dim}: its three consumer warpgroups get "
            f"{_WG3_CONSUMER_REGS} registers per thread (16 warps share the 64K register file), which holds the "
            f"64 x 64 fp32 O accumulator (32 / thread), the 64 x 128 S tile (64) and the 16-bit P (32) at d = 64; "
            f"at d = 128 O alone is 64 registers per thread and the working set exceeds {_WG3_CONSUMER_REGS}")


def rows_per_item(variant: str = "default") -> int:
    """Query rows per CTA tile / work item of a variant: 3 x 64 for "persistent3", else 2 x 64."""
    return _WG3_ROWS if variant == "persistent3" else NUM_CONSUMERS * WG_ROWS


def persistent_schedule(num_m: int, num_bh: int, causal: bool, num_sms: int, variant: str = "persistent"):
    """(SCHED, grid size P) of a persistent launch over num_m query tiles x num_bh heads on num_sms SMs:
    non-causal, or causal with at most one item per SM: SCHED 0 (stride); causal otherwise the variant's schedule
    (1 zigzag pairs: P = min(num_sms, ceil(T / 2)); 2 LPT snake: P = num_sms)."""
    T = num_m * num_bh
    sched = _PERSISTENT_SCHED[variant] if causal and T > num_sms else 0
    units = (T + 1) // 2 if sched == 1 else T
    return sched, max(1, min(num_sms, units))


def persistent_items(pid: int, P: int, num_m: int, num_bh: int, sched: int, causal: bool) -> list:
    """CPU mirror of ``_fa_sched_count`` / ``_fa_sched_item``: CTA pid's work items [(bh, pid_m), ...] in order
    (same integer formulas; for the unit test that every (bh, pid_m) is covered exactly once)."""
    T = num_m * num_bh
    if sched == 1:
        half = T // 2
        n = 2 * ((max(half - pid, 0) + P - 1) // P) + int(T % 2 == 1 and half % P == pid)
    elif sched == 2:
        rnd = T // P
        pos = P - 1 - pid if rnd % 2 == 1 else pid
        n = rnd + int(pos < T % P)
    else:
        n = (max(T - pid, 0) + P - 1) // P
    out = []
    for t in range(n):
        if sched == 1:
            x = 2 * (pid + (t // 2) * P) + t % 2
            bh, j = divmod(x, num_m)
            pid_m = num_m - 1 - j // 2 if j % 2 == 0 else j // 2
        elif sched == 2:
            x = t * P + (P - 1 - pid if t % 2 == 1 else pid)
            pid_m, bh = num_m - 1 - x // num_bh, x % num_bh
        else:
            bh, pid_m = divmod(pid + t * P, num_m)
            if causal:
                pid_m = num_m - 1 - pid_m
        out.append((bh, pid_m))
    return out


def persistent_tile_blocks(pid_m: int, wg: int, seq_q: int, seq_k: int, causal: bool, variant: str = "persistent"):
    """CPU mirror of the persistent consumer's per-item key-block plan (``_fa_tile_blocks`` and the ``n_full`` of
    ``_fa_consumer_persistent``; same integer formulas): (first query row of warpgroup ``wg``, key blocks of the
    item, leading blocks that warpgroup runs unmasked), for the variant's tile (192 rows for "persistent3")."""
    tile_m = rows_per_item(variant)
    block_n = config_for(64 if variant == "persistent3" else 128, variant)["BLOCK_N"]
    m0 = pid_m * tile_m
    hi = min(seq_k, m0 + tile_m + (seq_k - seq_q)) if causal else seq_k
    n_blocks = max(-(-hi // block_n), 1)
    row_first = m0 + wg * WG_ROWS
    n_full = seq_k // block_n
    if causal:
        n_full = min(n_full, max(row_first + (seq_k - seq_q) + 1, 0) // block_n)
    return row_first, n_blocks, min(n_full, n_blocks)


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_stride_reason(name: str, t: torch.Tensor) -> Optional[str]:
    if t.stride(-1) != 1:
        return f"{name}: last dim must be contiguous for TMA (stride {t.stride(-1)})"
    esz = t.element_size()
    for i, st in enumerate(t.stride()[:-1]):
        if (st * esz) % 16:
            return f"{name}: stride {st} of dim {i} is not 16-byte aligned (TMA)"
    if t.data_ptr() % 16:
        return f"{name}: base pointer not 16-byte aligned (TMA)"
    return None


def gluon_supported(q, k, v, causal: bool = False, scale: Optional[float] = None) -> Optional[str]:
    """None if ``gluon_attention_fwd`` can run these inputs, else a one-line reason (for a fallback decision)."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({_GLUON_IMPORT_ERROR})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
        if t.dim() != 4:
            return f"{name} must be 4-D [B, H, S, D], got {tuple(t.shape)}"
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"{name}: dtype {t.dtype} not supported (bf16 / fp16 only)"
    if not (q.dtype == k.dtype == v.dtype):
        return f"dtype mismatch q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if not (q.device == k.device == v.device):
        return "q, k, v on different devices"
    cap = device_capability(q.device)
    if cap[0] < 9:
        return f"needs sm_90+ (TMA / wgmma), device is sm_{cap[0]}{cap[1]}"
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    if k.shape[0] != B or k.shape[3] != D:
        return f"k / v shape {tuple(k.shape)} does not match q {tuple(q.shape)}"
    if D not in _CONFIGS:
        return f"head dim {D} not supported (only {sorted(_CONFIGS)})"
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"query heads {Hq} not a multiple of kv heads {Hkv}"
    if scale is not None and not (float(scale) > 0.0):
        return f"scale must be > 0 (got {scale}); it is folded into exp2"
    for name, t in (("q", q), ("k", k), ("v", v)):
        r = _tma_stride_reason(name, t)
        if r is not None:
            return r
    if max(Sq, k.shape[2]) >= 2 ** 30:
        return "sequence too long for int32 TMA coordinates"
    if B * Hq > 65535:
        return f"B * Hq = {B * Hq} exceeds the grid's y limit (65535)"
    return None


def _desc(t: torch.Tensor, rows: int):
    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, host_layout(tuple(block), t.dtype))


def resolve_poly_exp(poly_exp, persistent: bool) -> int:
    """The POLY_EXP constexpr of a launch: ``poly_exp`` if given (non-zero needs a persistent variant), else
    ``FXOPT_ATTN_GLUON_POLY_EXP`` for persistent launches (other variants ignore it), else 0. ValueError for a value
    outside ``POLY_EXP_CHOICES``."""
    src = "poly_exp"
    if poly_exp is None:
        env = os.environ.get("FXOPT_ATTN_GLUON_POLY_EXP")
        if env is None or not persistent:
            return 0
        src, poly_exp = "FXOPT_ATTN_GLUON_POLY_EXP", env
    try:
        value = int(poly_exp) if not isinstance(poly_exp, (bool, float)) else None
    except (TypeError, ValueError):
        value = None
    if value not in POLY_EXP_CHOICES:
        raise ValueError(f"gluon_attention_fwd: {src}={poly_exp!r} is not one of {POLY_EXP_CHOICES} (exp2s out of "
                         f"every {POLY_EXP_PACK} per thread computed by the FMA-pipe polynomial)")
    if value and not persistent:
        raise ValueError(f"gluon_attention_fwd: {src}={value} needs a persistent variant ({tuple(_PERSISTENT_SCHED)})")
    return value


# MMA_ROWSUM (persistent variants, opt-in): the softmax row sum by a small wgmma next to PV (see
# _fa_step_overlap). The default when neither ``mma_rowsum=`` nor FXOPT_ATTN_GLUON_MMA_ROWSUM says otherwise.
MMA_ROWSUM = False
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def resolve_mma_rowsum(mma_rowsum, variant: str) -> int:
    """The MMA_ROWSUM constexpr of a launch (0 off, 1 on, 2 on without the PV pin): ``mma_rowsum`` if given (True /
    False, or "nopin"; on needs a persistent variant: ValueError otherwise), else ``FXOPT_ATTN_GLUON_MMA_ROWSUM``
    (1 / 0, true / false, ..., nopin) for persistent launches (other variants ignore it), else the module constant
    ``MMA_ROWSUM``. ValueError for any other value. "nopin": no OR-of-P pin store before the PV wait (fewer
    instructions per step, but ptxas then waits for PV_{i-1} after the row max: the exp2s no longer run under the
    own PV; persistent3 never pins, so there it is the same build as True)."""
    persistent = variant in _PERSISTENT_SCHED
    src = "mma_rowsum"
    if mma_rowsum is None:
        env = os.environ.get("FXOPT_ATTN_GLUON_MMA_ROWSUM")
        if not persistent:
            return 0
        if env is None:
            mma_rowsum = MMA_ROWSUM
        else:
            src, mma_rowsum = "FXOPT_ATTN_GLUON_MMA_ROWSUM", env
    if isinstance(mma_rowsum, str) and mma_rowsum.strip().lower() in _TRUE + _FALSE + ("nopin",):
        word = mma_rowsum.strip().lower()
        value = 2 if word == "nopin" else int(word in _TRUE)
    elif isinstance(mma_rowsum, (bool, int)) and int(mma_rowsum) in (0, 1):
        value = int(mma_rowsum)
    else:
        raise ValueError(f"gluon_attention_fwd: {src}={mma_rowsum!r} is not a boolean or 'nopin' (row sum of P by "
                         f"wgmma on / off)")
    if value and not persistent:
        raise ValueError(f"gluon_attention_fwd: {src}=True (softmax row sum on the tensor cores) needs a persistent "
                         f"variant {tuple(_PERSISTENT_SCHED)}, not {variant!r}")
    return value


def gluon_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None, checked: bool = False, variant: str = "default",
                        write_lse: bool = True, num_sms: Optional[int] = None, poly_exp: Optional[int] = None,
                        mma_rowsum=None):
    """FA3-style forward. q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] -> (out [B, Hq, Sq, D], lse fp32 [B, Hq, Sq],
    natural log, +inf for rows with no visible key). Raises ValueError when unsupported.

    out / lse: buffers to write (``out`` like q, any strides TMA accepts; the attention op passes
    ``empty_like(q)`` so that its strides match the op's fake impl); default contiguous. ``checked=True`` skips
    ``gluon_supported`` (the caller ran it). ``variant``: "default" or "overlap" (see the design notes in docs/kernels.md; both
    checked on the H200, "overlap" is what the op routes to), "overlap2", "pingpong", "persistent",
    "persistent_lpt" (opt-in; persistent d = 64 / 128 only), "persistent3" (opt-in, d = 64 only: three consumer
    warpgroups, 192-row tiles). ``write_lse=False``: return (out, None); the persistent kernel then skips the lse
    stores (constexpr ``WRITE_LSE``), the others write a scratch buffer. ``num_sms``: persistent variants only,
    the grid's upper bound (default: the device's SM count; small values force many items per CTA).
    ``poly_exp``: persistent variants only (opt-in, offline only): that many of every 16 per-thread
    softmax exp2s on the FMA pipe (``_exp2_poly``) instead of MUFU.EX2; None = ``FXOPT_ATTN_GLUON_POLY_EXP`` (applied
    to persistent launches only) or 0. Not bit-identical to poly_exp=0 (P differs by up to 2^-13.7 relative before
    its 16-bit rounding). ``mma_rowsum``: persistent variants only (opt-in): the softmax row sum by a
    wgmma of the 16-bit P against a constant tile (``MMA_ROWSUM``); "nopin": the same without the PV pin; None =
    ``FXOPT_ATTN_GLUON_MMA_ROWSUM`` (persistent launches only) or the module constant ``MMA_ROWSUM``. Not bit-identical to the FADD row sum (it sums the rounded
    P that P V uses)."""
    if variant not in VARIANTS:
        raise ValueError(f"gluon_attention_fwd: unknown variant {variant!r} (one of {VARIANTS})")
    if variant in _FAILED_GPU_CHECK and os.environ.get("FXOPT_ATTN_GLUON_UNCHECKED", "0") != "1":
        raise ValueError(f"gluon_attention_fwd: variant {variant!r} {_FAILED_GPU_CHECK[variant]}; set "
                         f"FXOPT_ATTN_GLUON_UNCHECKED=1 to run it anyway (debugging only)")
    persistent = variant in _PERSISTENT_SCHED
    poly = resolve_poly_exp(poly_exp, persistent)
    rowsum = resolve_mma_rowsum(mma_rowsum, variant)
    if num_sms is not None and (not persistent or int(num_sms) < 1):
        raise ValueError(f"gluon_attention_fwd: num_sms={num_sms} needs a persistent variant and a value >= 1")
    if not write_lse and lse is not None:
        raise ValueError("gluon_attention_fwd: an lse buffer was given with write_lse=False")
    reason = None if checked else gluon_supported(q, k, v, causal, scale)
    if reason is None and out is not None:
        reason = _tma_stride_reason("out", out) if out.shape == q.shape and out.dtype == q.dtype else \
            f"out {tuple(out.shape)} {out.dtype} does not match q {tuple(q.shape)} {q.dtype}"
    if reason is None and variant == "persistent3" and q.shape[-1] not in _WG3_HEAD_DIMS:
        reason = _wg3_head_dim_reason(q.shape[-1])
    if reason is None and persistent and q.shape[-1] not in _PERSISTENT_HEAD_DIMS:
        reason = (f"variant {variant!r} supports head dims {_PERSISTENT_HEAD_DIMS}, not {q.shape[-1]} (two Q "
                  f"buffers per consumer warpgroup do not fit in shared memory next to the K / V ring)")
    if reason is not None:
        raise ValueError(f"gluon_attention_fwd: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty((B, Hq, Sq, D), device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((B, Hq, Sq) if (write_lse or not persistent) else (1,), device=q.device,
                          dtype=torch.float32)
    lse_ret = lse if write_lse else None
    if B * Hq * Sq == 0:
        return out, lse_ret
    if Sk == 0:
        out.zero_()
        if write_lse:
            lse.fill_(float("inf"))
        return out, lse_ret
    cfg = config_for(D, variant)
    rows_per_cta = rows_per_item(variant)  # 192 for persistent3 (NUM_WG = 3), else 128
    num_m = (Sq + rows_per_cta - 1) // rows_per_cta  # not triton.cdiv: a ConstexprFunction, slow on the host
    if persistent:
        sched, n_cta = persistent_schedule(num_m, B * Hq, bool(causal), int(num_sms or _num_sms(q.device)),
                                           variant)
        # the ring counter g (and the masks' column shift g * BLOCK_N) grows over a CTA's items: keep it in int32
        max_items = (num_m * B * Hq) // n_cta + 3
        if (num_m * B * Hq >= 2 ** 30
                or max_items * ((Sk + cfg["BLOCK_N"] - 1) // cfg["BLOCK_N"] + 1) * cfg["BLOCK_N"] + Sk >= 2 ** 31):
            raise ValueError(f"gluon_attention_fwd: variant {variant!r}: {num_m * B * Hq} work items, up to "
                             f"{max_items} of Sk = {Sk} per CTA, overflow its int32 item index / key-block counter")
    q_desc = _desc(q, WG_ROWS)
    o_desc = _desc(out, WG_ROWS)
    k_desc = _desc(k, cfg["BLOCK_N"])
    v_desc = _desc(v, cfg["BLOCK_N"])
    if persistent:
        _fa3_fwd_persistent_kernel[(n_cta,)](
            q_desc, k_desc, v_desc, o_desc, lse, sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, num_m, B * Hq,
            HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], CAUSAL=bool(causal),
            CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"], SCHED=sched,
            WRITE_LSE=bool(write_lse), num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
            **({"PINGPONG": True} if cfg.get("PINGPONG") else {}), **({"POLY_EXP": poly} if poly else {}),
            **({"NUM_WG": cfg["NUM_WG"]} if cfg.get("NUM_WG", 2) != 2 else {}),
            **({"MMA_ROWSUM": rowsum} if rowsum else {}))
        return out, lse_ret
    grid = (num_m, B * Hq)
    _fa3_fwd_kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, sm_scale * LOG2E, Hq, Hq // Hkv, Sq, Sk, num_m,
                          HEAD_DIM=D, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], CAUSAL=bool(causal),
                          CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                          num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"],
                          **({"OVERLAP": True} if cfg.get("OVERLAP") else {}),
                          **({"CAST_LATE": True} if cfg.get("CAST_LATE") else {}),
                          **({"PINGPONG": True} if cfg.get("PINGPONG") else {}))
    return out, lse_ret


# ----------------------------------------------------------------------------------------------------------------
# Offline compile check (no GPU needed): python -m fxopt.kernels.attention_gluon [--sass DIR]
# ----------------------------------------------------------------------------------------------------------------


def _signature(dtype_str: str, D: int, block_n: int):
    def td(rows):
        gdt = gl.bfloat16 if dtype_str == "bf16" else gl.float16
        lay = gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], gdt)
        return f"tensordesc<{dtype_str}[1, 1, {rows}, {D}],{lay!r}>"

    sig = {"q_desc": td(WG_ROWS), "k_desc": td(block_n), "v_desc": td(block_n), "o_desc": td(WG_ROWS),
           "lse_ptr": "*fp32", "qk_scale": "fp32", "H": "i32", "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32",
           "NUM_M_BLOCKS": "i32", "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr",
           "CAUSAL": "constexpr", "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr"}
    return sig


def compile_offline(D: int, causal: bool, dtype_str: str = "bf16", arch: int = 90, variant: str = "default",
                    sched: Optional[int] = None, write_lse: bool = True, poly_exp: int = 0,
                    mma_rowsum=False):
    """Compile one config for sm_<arch> without a GPU; returns triton's CompiledKernel (asm: ttgir, ptx, cubin).

    Persistent variants: ``sched`` = the ``SCHED`` constexpr (default: the variant's causal schedule when causal,
    else 0; the host uses 0 for causal launches with at most one item per SM), ``write_lse`` = ``WRITE_LSE``,
    ``poly_exp`` = ``POLY_EXP``, ``mma_rowsum`` = ``MMA_ROWSUM`` (ValueError for a non-persistent variant)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config_for(D, variant)
    rowsum = resolve_mma_rowsum(mma_rowsum, variant)
    constexprs = {"HEAD_DIM": D, "BLOCK_N": cfg["BLOCK_N"], "STAGES": cfg["STAGES"], "CAUSAL": bool(causal),
                  "CONSUMER_REGS": cfg["CONSUMER_REGS"], "PRODUCER_REGS": cfg["PRODUCER_REGS"]}
    sig = _signature(dtype_str, D, cfg["BLOCK_N"])
    if cfg.get("PERSISTENT"):
        sig = dict(sig)
        tail = {k: sig.pop(k) for k in ("HEAD_DIM", "BLOCK_N", "STAGES", "CAUSAL", "CONSUMER_REGS", "PRODUCER_REGS")}
        sig["NUM_BH"] = "i32"
        sig.update(tail)
        sig["SCHED"] = sig["WRITE_LSE"] = "constexpr"
        constexprs["SCHED"] = (cfg["SCHED_CAUSAL"] if causal else 0) if sched is None else int(sched)
        constexprs["WRITE_LSE"] = bool(write_lse)
        # the trailing constexprs in the kernel's positional order; all given (a constexpr the offline build
        # leaves out arrives as None, not as its default): PINGPONG False / POLY_EXP 0 / NUM_WG 2 compile to the
        # code a launch without them gets
        sig["PINGPONG"] = sig["POLY_EXP"] = sig["NUM_WG"] = "constexpr"
        constexprs["PINGPONG"] = bool(cfg.get("PINGPONG"))
        constexprs["POLY_EXP"] = resolve_poly_exp(poly_exp, True)
        constexprs["NUM_WG"] = cfg.get("NUM_WG", 2)
        if rowsum:  # left out otherwise: the exact constexpr set of the builds before MMA_ROWSUM existed
            sig["MMA_ROWSUM"] = "constexpr"
            constexprs["MMA_ROWSUM"] = rowsum
        src = GluonASTSource(_fa3_fwd_persistent_kernel, signature=sig, constexprs=constexprs)
    else:
        if cfg.get("OVERLAP"):
            constexprs["OVERLAP"] = True
            sig["OVERLAP"] = "constexpr"
        if cfg.get("CAST_LATE"):
            constexprs["CAST_LATE"] = True
            sig["CAST_LATE"] = "constexpr"
        if cfg.get("PINGPONG"):
            sig["CAST_LATE"] = "constexpr"  # positional order of the kernel's constexprs
            constexprs["CAST_LATE"] = False
            constexprs["PINGPONG"] = True
            sig["PINGPONG"] = "constexpr"
        src = GluonASTSource(_fa3_fwd_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]})


def _tool(name: str, data, suffix: str, *args) -> str:
    import subprocess
    import tempfile

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=suffix, delete=False, mode="wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
        path = f.name
    try:
        r = subprocess.run([os.path.join(bindir, name), *args, path], capture_output=True, text=True)
        return r.stdout + r.stderr
    finally:
        os.unlink(path)


def sass_summary(c) -> dict:
    """Counts in the sm_90 SASS of a compiled kernel: HGMMA, waits, ptxas wgmma-serialisation warnings."""
    import re

    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", sass)]
    return {"hgmma": len(re.findall(r"HGMMA", sass)),
            "depbar_le0": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)),
            "depbar_le1": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)),
            "setmaxnreg": sorted(set(re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass))),
            "max_reg_index": max(regs) if regs else None,
            "wgmma_serialized": "C7512" in ptxas or "serialized" in ptxas,
            "c75xx": sorted(set(re.findall(r"C75\d\d", ptxas))),
            "spill_bytes": sum(int(a) + int(b) for a, b in
                               re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)),
            "ex2_under_pv": ex2_under_pv(sass)}


def ex2_under_pv(sass: str) -> list:
    """For each PV wgmma group in the SASS (HGMMAs with a register A operand, up to the one carrying gsb0):
    the number of MUFU.EX2 between its issue and the next ``WARPGROUP.DEPBAR.LE gsb0, 0x0``, i.e. the exp2s that
    run while that PV is in flight. Per step of the loop there are BLOCK_N / 2 + 2 exp2 (scores + alpha)."""
    import re

    out, in_pv, n = [], False, 0
    for m in re.finditer(r"(HGMMA\S* R\d+, R\d+[^;]*|WARPGROUP\.DEPBAR\.LE gsb0, 0x0|MUFU\.EX2)", sass):
        t = m.group(1)
        if t.startswith("HGMMA"):
            if "gsb0" in t:
                in_pv, n = True, 0
        elif t.startswith("MUFU"):
            n += in_pv
        elif in_pv:
            out.append(n)
            in_pv = False
    return out


class _ModelBar:
    """An mbarrier in the CPU protocol models: an arrival count, a phase counter and a transaction count."""

    def __init__(self, count):
        self.count, self.pending, self.phase, self.tx = count, count, 0, 0

    def arrive(self, tx=0):
        self.pending -= 1
        self.tx += tx
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self.complete()

    def complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count


def _interleave(agents: dict, pending: list, rng, max_steps: int) -> int:
    """Run the protocol models' agents (generators, one yield per step) and pending completions (TMA loads landing,
    stores finishing) in a random interleaving until all are done; AssertionError on no progress (deadlock)."""
    steps = 0
    while agents or pending:
        steps += 1
        assert steps < max_steps, f"no progress after {max_steps} steps: deadlock ({sorted(agents)} left)"
        pick = rng.randrange(len(agents) + (1 if pending else 0))
        if pick == len(agents):
            pending.pop(rng.randrange(len(pending)))()
            continue
        name = list(agents)[pick]
        try:
            next(agents[name])
        except StopIteration:
            del agents[name]
    return steps


def _model_wait(bar, parity):
    """A waiter on mbarrier ``bar`` in the CPU protocol models: yields while its phase parity is ``parity``."""
    while (bar.phase & 1) == parity:
        yield


def _model_persistent_producer(n_blocks, stages, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, load,
                               n_consumers: int = 2, q_stride: Optional[int] = None):
    """The persistent kernels' producer warp in the CPU models (bf16 and fp8 share it): per item t, every consumer
    warpgroup's Q (``n_consumers`` of them: 2, or 3 for variant="persistent3") into buffer t % 2 once its previous
    reader released it, then the item's K / V blocks on the CTA-wide ring (``load(kind, index, barrier, content)``:
    an async TMA copy that lands later). Q buffer of (t, w): ``q_stride * (t % 2) + w``, q_stride = n_consumers
    as in the kernel (another value only to plant a bug in the tests)."""
    q_stride = n_consumers if q_stride is None else q_stride
    g0 = 0
    for t, n in enumerate(n_blocks):
        qb, q_phase = t % 2, ((t // 2) & 1) ^ 1
        for w in range(n_consumers):
            yield from _model_wait(q_empty[q_stride * qb + w], q_phase)
            load("q", q_stride * qb + w, q_ready[q_stride * qb + w], (t, w))
        for g in range(g0, g0 + n):
            s, empty_phase = g % stages, ((g // stages) & 1) ^ 1
            yield from _model_wait(k_empty[s], empty_phase)
            load("k", s, k_ready[s], (t, g - g0))
            yield from _model_wait(v_empty[s], empty_phase)
            load("v", s, v_ready[s], (t, g - g0))
        g0 += n


# Planted bugs for the tests of persistent_protocol_model (the model must catch each):
# "empty_count_2": k_empty / v_empty initialised with count 2 whatever the number of consumers (a 2-consumer
#   leftover: with 3 warpgroups the producer refills a slot the third one still reads);
# "q_stride_2": Q buffer index 2 * (t % 2) + w (the 2-consumer formula: with 3 warpgroups item t + 1's Q of
#   warpgroup 0 lands in the buffer warpgroup 2 reads for item t);
# "no_store_wait": the Q buffer handed back without waiting for the O store that reads it.
PROTOCOL_MUTATIONS = ("empty_count_2", "q_stride_2", "no_store_wait")


def persistent_protocol_model(n_blocks: list, stages: int, seed: int = 0, max_steps: int = 10 ** 6,
                              n_consumers: int = 2, mutation: Optional[str] = None) -> int:
    """CPU model of the persistent kernel's mbarrier protocol: ``_fa_producer_persistent`` and ``n_consumers``
    ``_fa_consumer_persistent`` warpgroups (2; 3 = variant="persistent3", ``NUM_WG``), statement for statement
    (waits, expect-arrives, releases, the deferred O store and its ``store_wait``), run over one CTA's items
    (``n_blocks[t]`` key blocks each) in a random interleaving, with TMA loads landing and TMA stores finishing at
    random later points. mbarriers as on sm_90: a count, a phase counter, a transaction count, parity waits
    (``wait(parity)`` passes once the phase of that parity completed; a fresh barrier passes parity 1). Raises
    AssertionError on a deadlock (no progress in max_steps), on a consumer reading data of another item / block,
    or on a TMA write landing in a buffer that a consumer still reads or that an O store still reads. Returns the
    number of steps taken. ``mutation``: one of ``PROTOCOL_MUTATIONS`` (a planted bug, for the tests)."""
    import random

    assert mutation is None or mutation in PROTOCOL_MUTATIONS, mutation
    nc = n_consumers
    q_stride = 2 if mutation == "q_stride_2" else nc
    n_q = 2 * max(nc, q_stride)
    Bar = _ModelBar
    rng = random.Random(seed)
    q_ready, q_empty = [Bar(1) for _ in range(n_q)], [Bar(1) for _ in range(n_q)]
    k_ready, v_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    empty_count = 2 if mutation == "empty_count_2" else nc
    k_empty, v_empty = [Bar(empty_count) for _ in range(stages)], [Bar(empty_count) for _ in range(stages)]
    bufs = {"q": [None] * n_q, "k": [None] * stages, "v": [None] * stages}
    held = {}  # (kind, index) -> consumers reading it
    storing = {w: set() for w in range(nc)}  # Q buffers an O store of consumer w still reads
    pending = []  # TMA completions not yet happened

    def assert_free(kind, i):
        assert not held.get((kind, i)), f"TMA write into {kind}[{i}] while {held[(kind, i)]} read it"
        assert kind != "q" or all(i not in s for s in storing.values()), f"TMA write into q[{i}] under an O store"

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
                                          load, nc, q_stride)

    def consumer(w):
        def use(kind, i, bar, parity, want):
            yield from wait(bar, parity)
            assert bufs[kind][i] == want, f"consumer {w} wanted {kind} {want}, found {bufs[kind][i]}"
            held.setdefault((kind, i), set()).add(w)

        def release(kind, i, bar):
            yield  # the wgmma reading the buffer runs, then its wait
            held[(kind, i)].discard(w)
            bar.arrive()

        def store_wait():
            while storing[w] and mutation != "no_store_wait":
                yield

        g0 = 0
        for t, n in enumerate(n_blocks):
            qb = t % 2
            qi = q_stride * qb + w
            yield from use("q", qi, q_ready[qi], (t // 2) & 1, (t, w))
            ks = g0 % stages
            yield from use("k", ks, k_ready[ks], (g0 // stages) & 1, (t, 0))
            yield from release("k", ks, k_empty[ks])
            yield from store_wait()
            if t > 0:
                q_empty[q_stride * (1 - qb) + w].arrive()
            for i in range(g0 + 1, g0 + n):
                ks, vs = i % stages, (i - 1) % stages
                yield from use("k", ks, k_ready[ks], (i // stages) & 1, (t, i - g0))
                yield from use("v", vs, v_ready[vs], ((i - 1) // stages) & 1, (t, i - 1 - g0))
                yield from release("k", ks, k_empty[ks])
                yield from release("v", vs, v_empty[vs])
            jv = g0 + n - 1
            vs = jv % stages
            yield from use("v", vs, v_ready[vs], (jv // stages) & 1, (t, jv - g0))
            yield from release("v", vs, v_empty[vs])
            g0 += n
            # epilogue: O staged in the item's Q buffer, TMA store left in flight
            assert bufs["q"][qi] == (t, w), f"Q buffer {qi} overwritten before item {t}'s epilogue"
            bufs["q"][qi] = ("O", t, w)
            held[("q", qi)].discard(w)
            storing[w].add(qi)

            def store_done(qi=qi, t=t):
                assert bufs["q"][qi] == ("O", t, w), f"O of item {t} overwritten before its store read it"
                storing[w].discard(qi)
            pending.append(store_done)
            yield
        while storing[w]:  # the kernel's final store_wait (kept in every mutation: it ends the model)
            yield

    agents = {"producer": producer()}
    agents.update({f"consumer{w}": consumer(w) for w in range(nc)})
    return _interleave(agents, pending, rng, max_steps)


def check_persistent_schedules_and_protocol(trials: int = 3000, seed: int = 1, n_consumers=(2, 3)) -> str:
    """CPU checks behind the persistent variants: (1) ``persistent_items`` covers every (bh, query block) exactly
    once for every schedule over a sweep of grids, (2) ``persistent_protocol_model`` finds no deadlock or buffer
    hazard over ``trials`` random interleavings (STAGES 1-3, 1-9 items of 1-6 key blocks) for each consumer count
    in ``n_consumers`` (2: persistent / persistent_lpt / persistent_pingpong; 3: persistent3), (3) the
    variant="pingpong" named-barrier model (``check_pingpong_protocol``, trials / 2). Returns a summary."""
    import itertools
    import random

    n_grids = 0
    for num_m, num_bh in itertools.chain(itertools.product(range(1, 20), range(1, 12)), [(32, 64), (128, 16)]):
        T = num_m * num_bh
        for P in list(range(1, 24)) + [131, 132, 133]:
            for sched in (0, 1, 2):
                if P > ((T + 1) // 2 if sched == 1 else T):
                    continue
                for causal in ((True,) if sched else (False, True)):
                    seen = [x for p in range(P) for x in persistent_items(p, P, num_m, num_bh, sched, causal)]
                    assert sorted(seen) == [(b, m) for b in range(num_bh) for m in range(num_m)], \
                        (num_m, num_bh, P, sched)
                    n_grids += 1
    for nc in n_consumers:
        rng = random.Random(seed)
        for k in range(trials):
            persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(1, 9))], 1 + k % 3, seed=k,
                                      n_consumers=nc)
    return (f"schedules: {n_grids} (grid, schedule) cases cover every work item once; protocol: {trials} random "
            f"interleavings each with {', '.join(map(str, n_consumers))} consumer warpgroups without deadlock or "
            f"hazard; " + check_pingpong_protocol(max(trials // 2, 1), seed))


def pingpong_protocol_model(n_blocks, stages: int, n_full=(0, 0), seed: int = 0, max_steps: int = 10 ** 6):
    """CPU model of variant="pingpong" (one CTA of ``_fa3_fwd_kernel`` with PINGPONG): ``_fa_producer`` and the
    two ``_fa_consumer`` warpgroups statement for statement (mbarrier waits / releases as in
    ``persistent_protocol_model``, the unmasked loop up to ``n_full[w]`` then the masked loop, the tail), plus the
    two named barriers of ``_fa_pp_wait`` / ``_fa_pp_pass`` as on sm_90: 256 threads = one contribution of 128
    threads from each warpgroup; ``bar.sync`` blocks until its generation completes, ``bar.arrive`` does not; the
    barrier resets when complete. Random interleaving, TMA loads landing at random later points. Raises
    AssertionError on a deadlock, on a warpgroup contributing twice to one barrier generation (the hardware would
    count both 128-thread arrivals and release the wrong turn), on a consumer reading the wrong block, on a TMA
    write into a slot still read, on wgmma issue points out of ping-pong order (WG0 point p, WG1 point p, WG0 point
    p + 1, ...), or on a named barrier left with pending arrivals at exit. Returns the number of steps.

    ``n_blocks`` a list: variant="persistent_pingpong", one CTA running those work items back to back (key blocks
    at consecutive ring positions, the K / V ring never drained; Q treated as always resident, the Q double buffer
    is ``persistent_protocol_model``'s business): warpgroup 0 waits for the turn before an item's first issue from
    the second item on, warpgroup 1 passes it back after its last issue when another item follows."""
    import random

    items = [int(n_blocks)] if isinstance(n_blocks, int) else [int(n) for n in n_blocks]
    single = isinstance(n_blocks, int)
    n_total = sum(items)

    Bar = _ModelBar
    class Named:  # bar.sync / bar.arrive id, 256 with two 128-thread warpgroups
        def __init__(self):
            self.members, self.gen = set(), 0

        def join(self, w):
            assert w not in self.members, f"warpgroup {w} contributed twice to one named-barrier generation"
            self.members.add(w)
            gen = self.gen
            if len(self.members) == 2:
                self.members, self.gen = set(), self.gen + 1
            return gen

    rng = random.Random(seed)
    q_bars = [Bar(1) for _ in range(2)]
    k_ready, v_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    k_empty, v_empty = [Bar(2) for _ in range(stages)], [Bar(2) for _ in range(stages)]
    turn = [Named(), Named()]  # turn[w]: warpgroup w's turn (ids 14, 15)
    bufs = {"k": [None] * stages, "v": [None] * stages}
    held = {}
    pending = []
    issues = []

    def load(kind, i, bar, content):
        if kind != "q":
            assert not held.get((kind, i)), f"TMA write into {kind}[{i}] while {held[(kind, i)]} read it"
        bar.arrive(tx=1)

        def land():
            if kind != "q":
                assert not held.get((kind, i)), f"TMA write into {kind}[{i}] while {held[(kind, i)]} read it"
                bufs[kind][i] = content
            bar.tx -= 1
            bar.complete()
        pending.append(land)

    def wait(bar, parity):
        while (bar.phase & 1) == parity:
            yield

    def producer():
        for w in (0, 1):
            load("q", w, q_bars[w], w)
        for j in range(n_total):
            s, empty_phase = j % stages, ((j // stages) & 1) ^ 1
            yield from wait(k_empty[s], empty_phase)
            load("k", s, k_ready[s], j)
            yield from wait(v_empty[s], empty_phase)
            load("v", s, v_ready[s], j)

    def consumer(w):
        def use(kind, i, bar, parity, want):
            yield from wait(bar, parity)
            assert bufs[kind][i] == want, f"consumer {w} wanted {kind} {want}, found {bufs[kind][i]}"
            held.setdefault((kind, i), set()).add(w)

        def release(kind, i, bar):
            yield  # the wgmma reading the slot runs, then its wait
            held[(kind, i)].discard(w)
            bar.arrive()

        def pp_wait():  # bar.sync 14 + w, 256
            gen = turn[w].join(w)
            while turn[w].gen == gen:
                yield

        def pp_pass():  # bar.arrive 14 + (1 - w), 256
            turn[1 - w].join(w)
            yield

        def step(i):
            ks, vs = i % stages, (i - 1) % stages
            yield from use("k", ks, k_ready[ks], (i // stages) & 1, i)
            yield from pp_wait()
            issues.append((w, i))  # global ring position; mapped to (item, point) below
            yield from use("v", vs, v_ready[vs], ((i - 1) // stages) & 1, i - 1)
            yield from pp_pass()
            yield from release("k", ks, k_empty[ks])
            yield from release("v", vs, v_empty[vs])

        yield from wait(q_bars[w], 0)
        g0 = 0
        for t, n in enumerate(items):
            ks = g0 % stages
            yield from use("k", ks, k_ready[ks], (g0 // stages) & 1, g0)
            if w == 1 or t > 0:
                yield from pp_wait()
            issues.append((w, t, 0))
            yield from pp_pass()
            yield from release("k", ks, k_empty[ks])
            nf = min(n_full[w], n) if single else n
            for i in range(g0 + 1, g0 + nf):
                yield from step(i)
            for i in range(g0 + max(nf, 1), g0 + n):
                yield from step(i)
            jv = g0 + n - 1
            vs = jv % stages
            yield from use("v", vs, v_ready[vs], (jv // stages) & 1, jv)
            yield from pp_wait()
            issues.append((w, t, n))
            if w == 0 or t + 1 < len(items):
                yield from pp_pass()
            yield from release("v", vs, v_empty[vs])
            g0 += n

    steps = _interleave({"producer": producer(), "consumer0": consumer(0), "consumer1": consumer(1)}, pending, rng,
                        max_steps)
    starts = [sum(items[:t]) for t in range(len(items))]

    def point(e):  # (w, t, p) as recorded, or (w, ring position i) of a loop step: item t, point i - start
        if len(e) == 3:
            return e
        w, i = e
        t = max(t for t in range(len(items)) if starts[t] <= i)
        return (w, t, i - starts[t])
    got = [point(e) for e in issues]
    want = [(w, t, p) for t, n in enumerate(items) for p in range(n + 1) for w in (0, 1)]
    assert got == want, f"issue order {got}"
    assert not turn[0].members and not turn[1].members, "named barrier left with pending arrivals"
    return steps


def check_pingpong_protocol(trials: int = 2000, seed: int = 2) -> str:
    """``pingpong_protocol_model`` over ``trials`` random interleavings: STAGES 1-3, 1-8 key blocks, each
    warpgroup's unmasked / masked split point drawn independently (the causal diagonal differs per warpgroup)."""
    import random

    rng = random.Random(seed)
    for k in range(trials):
        n = rng.randint(1, 8)
        pingpong_protocol_model(n, 1 + k % 3, (rng.randint(0, n), rng.randint(0, n)), seed=k)
    for k in range(trials):  # persistent_pingpong: 1-5 items of 1-6 blocks each on one CTA
        pingpong_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(1, 5))], 1 + k % 3, seed=trials + k)
    return (f"pingpong: {trials} random interleavings (one item) and {trials} (persistent, several items) without "
            f"deadlock, hazard or out-of-order issue")


if __name__ == "__main__":  # pragma: no cover - tooling
    import argparse
    import re

    ap = argparse.ArgumentParser(description="offline sm_90 compile of every Gluon attention config")
    ap.add_argument("--dump", default=None, help="directory for ttgir / ptx / cubin of each config")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--protocol", action="store_true",
                    help="only the CPU checks of the persistent schedules / mbarrier protocol and of the pingpong "
                         "named-barrier protocol")
    args = ap.parse_args()
    if args.protocol:
        print(check_persistent_schedules_and_protocol())
        print(check_pingpong_protocol())
        raise SystemExit(0)
    try:  # register-hazard check of the async wgmma (CPU-only, parses cuobjdump -sass)
        from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
    except Exception:  # pragma: no cover
        sass_of = wgmma_sass_hazards = None
    for variant in args.variants.split(","):
        for D in [int(x) for x in args.dims.split(",")]:
            if (variant in _PERSISTENT_SCHED and D not in _PERSISTENT_HEAD_DIMS) or (
                    variant == "persistent3" and D not in _WG3_HEAD_DIMS):
                print(f"{variant}_d{D}: not supported (config_for raises ValueError)")
                continue
            for causal in (False, True):
                # persistent: every SCHED the host can pick (causal: the variant's and 0), lse on and off
                extras = [{}]
                if variant in _PERSISTENT_SCHED:
                    extras = [dict(sched=s, write_lse=w) for s in
                              ((_PERSISTENT_SCHED[variant], 0) if causal else (0,)) for w in (True, False)]
                for dt in ("bf16", "fp16"):
                    for extra in extras:
                        tag = f"{variant}_d{D}_{'causal' if causal else 'full'}_{dt}" + "".join(
                            f"_{k}{int(v)}" for k, v in extra.items())
                        try:
                            c = compile_offline(D, causal, dt, variant=variant, **extra)
                        except Exception as e:  # report and go on
                            print(f"{tag}: COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]}")
                            continue
                        use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
                        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
                        hz = "n/a" if sass_of is None else len(wgmma_sass_hazards(sass_of(c)))
                        print(f"{tag}: {m.group(0) if m else use.strip()}  smem={c.metadata.shared} B  "
                              f"warps={c.metadata.num_warps}  {sass_summary(c)}  wgmma_hazards={hz}", flush=True)
                        if args.dump:
                            os.makedirs(args.dump, exist_ok=True)
                            for ext in ("ttgir", "ptx"):
                                with open(os.path.join(args.dump, f"{tag}.{ext}"), "w") as f:
                                    f.write(c.asm[ext])
                            with open(os.path.join(args.dump, f"{tag}.cubin"), "wb") as f:
                                f.write(c.asm["cubin"])
