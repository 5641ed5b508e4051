"""W4A16 at small M on mma.sync (m16n8k16) with both operands in registers: Gluon, sm_80+; method "mma", M <= 16.

``out^T[N, M] = W^T[N, K] . x^T[K, M]``: the mma's 16 rows are weight columns, its 8 columns the (zero-padded)
activation rows. Both axes are relabeled so that lane t reads the 8 nibbles of one packed word per 32-K chunk; the
codes enter as OFFSET + q and scale / zero are applied once per K tile (sums of x from a second mma). Split-K by
relaxed fp32 atomics into the zeroed workspace, sized to one wave (``choose_split``). Lane maps, register budgets
and measurements: ``docs/kernels.md`` ("w4a16/mma.py").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from fxopt.kernels import cdiv, device_capability, has_pdl
from fxopt.kernels.w4a16.common import (MAGIC, NUM_SMS_DEFAULT, W4A16Config, balanced_split, check_inputs, counters,
                                        num_sms, one_wave_split, zeroed_workspace)

log = logging.getLogger(__name__)

try:  # Gluon ships with Triton >= 3.5; importing this module must work without it (CPU, old Triton)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = True
except Exception:  # pragma: no cover - old Triton
    HAS_GLUON = False

__all__ = ["MmaConfig", "w4a16_mma", "mma_configs", "HAS_GLUON"]


# Kernel
if HAS_GLUON:
    # the relabeling chains of ``_a_operand`` / ``_b_operand`` (also emulated by tests/kernels/test_w4a16_mma.py)
    _A_PERM = gl.constexpr((4, 2, 5, 3, 0, 7, 6, 1, 8))  # (c t warp g rep h hk kb e) -> (rep warp h g | c kb hk t e)
    _B_PERM = gl.constexpr((1, 4, 5, 2, 3, 0))  # (m c t e kb hk) -> (c kb hk t e | m)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _fence_gpu():
        """fence.acq_rel.gpu in every thread: its REDs into the workspace are performed at GPU scope before the
        CTA barrier that precedes the counter's acq_rel atomic (as gemv1)."""
        gl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _rows(v, R: gl.constexpr, W: gl.constexpr, acc_layout: gl.constexpr):
        """[BN] in ``sz_layout`` (thread: columns n = 2R (8 warp + g) + 0..2R-1) -> [BN] along the accumulator rows
        r = 16 W rep + 16 warp + 8 h + g (SliceLayout(1, acc)): the same registers, relabeled."""
        v = gl.reshape(v, [W, 8, R, 2])  # warp g rep h
        v = gl.permute(v, [2, 0, 3, 1])  # rep warp h g
        v = gl.reshape(v, [16 * R * W])
        return gl.convert_layout(v, gl.SliceLayout(1, acc_layout), assert_trivial=True)

    @gluon.jit
    def _a_operand(words, MAGIC2, DT: gl.constexpr, C: gl.constexpr, R: gl.constexpr, W: gl.constexpr,
                   a_layout: gl.constexpr):
        """Packed words [4C, BN] (row 4 c + t, column 2R (8 warp + g) + 2 rep + h) -> OFFSET + q as DT [BN, 32 C] in
        the mma A layout: tile column 32 c + 16 kb + 8 hk + 2 t + e = nibble 2 kb + hk + 4 e of word row 4 c + t."""
        d0 = (words & 0x000F000F) | MAGIC2
        d1 = ((words >> 4) & 0x000F000F) | MAGIC2
        d2 = ((words >> 8) & 0x000F000F) | MAGIC2
        d3 = ((words >> 12) & 0x000F000F) | MAGIC2
        p = gl.join(gl.join(d0, d1), gl.join(d2, d3))  # [4C, BN, hk, kb]
        h16 = gl.join(p.to(gl.int16), (p >> 16).to(gl.int16))  # [4C, BN, hk, kb, e]
        w = h16.to(DT, bitcast=True)
        w = gl.reshape(w, [C, 4, W, 8, R, 2, 2, 2, 2])  # c t warp g rep h hk kb e
        w = gl.permute(w, _A_PERM.value)  # rep warp h g | c kb hk t e
        w = gl.reshape(w, [16 * R * W, 32 * C])
        return gl.convert_layout(w, a_layout, assert_trivial=True)

    @gluon.jit
    def _b_operand(xv, BM: gl.constexpr, C: gl.constexpr, b_layout: gl.constexpr):
        """x [BM, 4C, 8] (natural K order: k = 8 row + jj, jj = 4 e + 2 kb + hk) -> x^T [32 C, BM] in the mma B
        layout, K position 32 c + 16 kb + 8 hk + 2 t + e (the A operand's order)."""
        xv = gl.reshape(xv, [BM, C, 4, 2, 2, 2])  # m c t e kb hk
        xv = gl.permute(xv, _B_PERM.value)  # c kb hk t e | m
        xv = gl.reshape(xv, [32 * C, BM])
        return gl.convert_layout(xv, b_layout, assert_trivial=True)

    @gluon.jit
    def _w_loads(t, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg, GROUP_SIZE: gl.constexpr,
                 BK: gl.constexpr, MASK_N: gl.constexpr, MASK_K: gl.constexpr):
        """K tile t's weight loads: packed words [BK/8, BN], scale and zero rows [BN] (raw)."""
        KPT: gl.constexpr = BK // 8
        qp = q_ptrs + t * KPT * stride_qk
        g = (t * BK) // GROUP_SIZE
        if MASK_N or MASK_K:
            qm = gl.expand_dims(t * KPT + kp_w < KP, 1) & gl.expand_dims(n_w < N, 0)
            words = gl.load(qp, mask=qm, other=0)
        else:
            words = gl.load(qp)
        if MASK_N:
            s = gl.load(s_ptrs + g * stride_sg, mask=n_sz < N, other=0.0)
            z = gl.load(z_ptrs + g * stride_sg, mask=n_sz < N, other=0.0)
        else:
            s = gl.load(s_ptrs + g * stride_sg)
            z = gl.load(z_ptrs + g * stride_sg)
        return words, s, z

    @gluon.jit
    def _x_loads(t, x_ptrs, kp_x, KP, BK: gl.constexpr, MASK_K: gl.constexpr):
        """K tile t's activations [BM, BK/8, 8] (K past the end reads as 0). Rows >= M were pointed at row M - 1
        by the caller: an mma column depends only on its own B column, and those output columns are not stored,
        so no mask (and no zero-fill) is needed for them."""
        KPT: gl.constexpr = BK // 8
        xp = x_ptrs + t * BK
        if MASK_K:
            xm = gl.expand_dims(gl.expand_dims(t * KPT + kp_x < KP, 0), 2)
            return gl.load(xp, mask=xm, other=0.0)
        return gl.load(xp)

    @gluon.jit
    def _fold_tile(acc, words, s, z, xv, ones, MAGIC2, OFFSET, DT: gl.constexpr, BM: gl.constexpr,
                   C: gl.constexpr, R: gl.constexpr, W: gl.constexpr, mma: gl.constexpr, a_layout: gl.constexpr,
                   b_layout: gl.constexpr):
        """acc += s * (x . (OFFSET + q) - (OFFSET + z) * sum x) over one K tile."""
        BN: gl.constexpr = 16 * R * W
        a = _a_operand(words, MAGIC2, DT, C, R, W, a_layout)
        b = _b_operand(xv, BM, C, b_layout)
        part = mma_v2(a, b, gl.zeros([BN, BM], gl.float32, layout=mma))
        xs = mma_v2(ones, b, gl.zeros([16 * W, BM], gl.float32, layout=mma))  # every row: sum of x over the tile
        # broadcast the [16 W, BM] sums over the R row blocks of the accumulator: register relabeling only
        p3 = gl.reshape(part, [R, 16 * W, BM])
        xs3 = gl.expand_dims(gl.convert_layout(xs, gl.SliceLayout(0, p3.type.layout), assert_trivial=True), 0)
        xs3, p3 = gl.broadcast(xs3, p3)
        xsb = gl.convert_layout(gl.reshape(xs3, [BN, BM]), mma, assert_trivial=True)
        sr = gl.expand_dims(_rows(s.to(gl.float32), R, W, mma), 1)
        zr = gl.expand_dims(_rows(z.to(gl.float32) + OFFSET, R, W, mma), 1)
        return acc + (part - zr * xsb) * sr

    @gluon.jit
    def _w4a16_mma_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, KP, SPLIT_K, TILES_PER_SPLIT, MAGIC2, OFFSET,
        stride_xm, stride_qk, stride_sg, stride_ym,
        GROUP_SIZE: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, R: gl.constexpr, W: gl.constexpr,
        HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, MASK_M: gl.constexpr, MASK_N: gl.constexpr,
        MASK_K: gl.constexpr, USE_GDC: gl.constexpr, PREFETCH: gl.constexpr,
        w_layout: gl.constexpr, x_layout: gl.constexpr, sz_layout: gl.constexpr,
    ):
        """y[M <= BM, N] = x @ dequant(W)^T (+ bias): program (pid_n, pid_k) = columns [pid_n BN, + BN) x K tiles
        [pid_k TILES_PER_SPLIT, ...). Module docstring: layouts, arithmetic, split-K."""
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        if USE_GDC:  # the next kernel may launch now; it waits for this grid before its own reads
            _gdc_launch_dependents()
        DT: gl.constexpr = x_ptr.dtype.element_ty
        BN: gl.constexpr = 16 * R * W
        KPT: gl.constexpr = BK // 8
        C: gl.constexpr = BK // 32
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

        kp_w = gl.arange(0, KPT, layout=gl.SliceLayout(1, w_layout))
        n_w = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, w_layout))
        q_ptrs = qw_ptr + gl.expand_dims(kp_w, 1) * stride_qk + gl.expand_dims(n_w, 0)
        n_sz = pid_n * BN + gl.arange(0, BN, layout=sz_layout)
        s_ptrs = s_ptr + n_sz
        z_ptrs = z_ptr + n_sz
        m_x = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
        kp_x = gl.arange(0, KPT, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
        jj_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
        if MASK_M:
            m_x = gl.minimum(m_x, M - 1)
        x_ptrs = (x_ptr + gl.expand_dims(gl.expand_dims(m_x, 1), 2) * stride_xm
                  + gl.expand_dims(gl.expand_dims(kp_x, 0), 2) * 8 + gl.expand_dims(gl.expand_dims(jj_x, 0), 1))
        ones = gl.full([16 * W, BK], 1.0, DT, layout=a_layout)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)

        t_start = pid_k * TILES_PER_SPLIT
        t_end = gl.minimum(t_start + TILES_PER_SPLIT, gl.cdiv(KP, KPT))
        t_first = gl.minimum(t_start, t_end - 1)
        # tile indices are clamped to the split's last tile (repeated loads: cache hits, results unused)
        aq, a_s, a_z = _w_loads(t_first, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                GROUP_SIZE, BK, MASK_N, MASK_K)
        if USE_GDC:  # only the weights (never written by the previous kernel) are read before this wait
            _gdc_wait()
        ax = _x_loads(t_first, x_ptrs, kp_x, KP, BK, MASK_K)
        if PREFETCH == 1:
            # two register buffers, the loop unrolled by two so that they swap roles without register copies:
            # tile t + 1's loads are issued before tile t is computed, tile t + 2's before tile t + 1
            for t in range(t_start, t_end, 2):
                t1 = gl.minimum(t + 1, t_end - 1)
                bq, b_s, b_z = _w_loads(t1, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BK, MASK_N, MASK_K)
                bx = _x_loads(t1, x_ptrs, kp_x, KP, BK, MASK_K)
                acc = _fold_tile(acc, aq, a_s, a_z, ax, ones, MAGIC2, OFFSET, DT, BM, C, R, W, mma, a_layout,
                                 b_layout)
                t2 = gl.minimum(t + 2, t_end - 1)
                aq, a_s, a_z = _w_loads(t2, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BK, MASK_N, MASK_K)
                ax = _x_loads(t2, x_ptrs, kp_x, KP, BK, MASK_K)
                if t + 1 < t_end:
                    acc = _fold_tile(acc, bq, b_s, b_z, bx, ones, MAGIC2, OFFSET, DT, BM, C, R, W, mma, a_layout,
                                     b_layout)
        else:
            # three register buffers, the loop unrolled by three: every tile's loads are issued two tiles before
            # it is computed, still without register copies
            t1 = gl.minimum(t_start + 1, t_end - 1)
            bq, b_s, b_z = _w_loads(t1, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                    GROUP_SIZE, BK, MASK_N, MASK_K)
            bx = _x_loads(t1, x_ptrs, kp_x, KP, BK, MASK_K)
            for t in range(t_start, t_end, 3):
                t2 = gl.minimum(t + 2, t_end - 1)
                cq, c_s, c_z = _w_loads(t2, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BK, MASK_N, MASK_K)
                cx = _x_loads(t2, x_ptrs, kp_x, KP, BK, MASK_K)
                acc = _fold_tile(acc, aq, a_s, a_z, ax, ones, MAGIC2, OFFSET, DT, BM, C, R, W, mma, a_layout,
                                 b_layout)
                t3 = gl.minimum(t + 3, t_end - 1)
                aq, a_s, a_z = _w_loads(t3, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BK, MASK_N, MASK_K)
                ax = _x_loads(t3, x_ptrs, kp_x, KP, BK, MASK_K)
                if t + 1 < t_end:
                    acc = _fold_tile(acc, bq, b_s, b_z, bx, ones, MAGIC2, OFFSET, DT, BM, C, R, W, mma, a_layout,
                                     b_layout)
                t4 = gl.minimum(t + 4, t_end - 1)
                bq, b_s, b_z = _w_loads(t4, q_ptrs, s_ptrs, z_ptrs, kp_w, n_w, n_sz, N, KP, stride_qk, stride_sg,
                                        GROUP_SIZE, BK, MASK_N, MASK_K)
                bx = _x_loads(t4, x_ptrs, kp_x, KP, BK, MASK_K)
                if t + 2 < t_end:
                    acc = _fold_tile(acc, cq, c_s, c_z, cx, ones, MAGIC2, OFFSET, DT, BM, C, R, W, mma, a_layout,
                                     b_layout)

        # epilogue: output element (row r, column m) is y[m, n(r)]
        n_r = gl.expand_dims(_rows(n_sz, R, W, mma), 1)
        m_c = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, mma)), 0)
        mask_y = (n_r < N) & (m_c < M)
        y_ptrs = y_ptr + m_c * stride_ym + n_r
        if USE_SPLIT:
            ws_ptrs = ws_ptr + m_c * N + n_r
            gl.atomic_add(ws_ptrs, acc, mask=mask_y, sem="relaxed")
            _fence_gpu()
            gl.thread_barrier()
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                tot = gl.load(ws_ptrs, mask=mask_y, other=0.0, cache_modifier=".cg")
                gl.store(ws_ptrs, gl.zeros_like(tot), mask=mask_y)
                if HAS_BIAS:
                    tot += gl.load(bias_ptr + n_r, mask=n_r < N, other=0.0).to(gl.float32)
                gl.store(y_ptrs, tot.to(DT), mask=mask_y)
                gl.atomic_xchg(cnt_ptr + pid_n, 0)
        else:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + n_r, mask=n_r < N, other=0.0).to(gl.float32)
            gl.store(y_ptrs, acc.to(DT), mask=mask_y)


# Layouts (host side: constexpr arguments of the kernel)
def _lg(v: int) -> int:
    return int(math.log2(v))


def _layouts(BM: int, BK: int, R: int, W: int) -> dict:
    """The load layouts (docs/kernels.md, "Lane mapping"): ``w_layout`` for the packed words [BK/8, BN] (registers
    2R consecutive columns, then the chunks; lanes (t: word row, g: column block); warps: column blocks), ``x_layout``
    for x [BM, BK/8, 8] (a word row's 8 activations per lane, same x in every warp), ``sz_layout`` for [BN] rows."""
    C = BK // 32
    BN = 16 * R * W
    w_layout = gl.DistributedLinearLayout(
        [[0, 1 << i] for i in range(_lg(2 * R))] + [[4 << i, 0] for i in range(_lg(C))],
        [[1, 0], [2, 0], [0, 2 * R], [0, 4 * R], [0, 8 * R]],
        [[0, (16 * R) << i] for i in range(_lg(W))], [], [BK // 8, BN])
    x_layout = gl.DistributedLinearLayout(
        [[0, 0, 1], [0, 0, 2], [0, 0, 4]] + [[0, 4 << i, 0] for i in range(_lg(C))] + ([[8, 0, 0]] if BM == 16 else []),
        [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        [[0, 0, 0]] * _lg(W), [], [BM, BK // 8, 8])
    sz_layout = gl.DistributedLinearLayout(
        [[1 << i] for i in range(_lg(2 * R))], [[0], [0], [2 * R], [4 * R], [8 * R]],
        [[(16 * R) << i] for i in range(_lg(W))], [], [BN])
    return dict(w_layout=w_layout, x_layout=x_layout, sz_layout=sz_layout)


# Host side
@dataclass(frozen=True)
class MmaConfig:
    """``warps`` per CTA; ``cols_per_warp`` = 16 R weight columns per warp (16, 32 or 64: R mma row tiles);
    ``split_k`` = K splits (0: one wave over the GPU, ``choose_split``); ``prefetch`` = K tiles of loads kept in
    flight ahead of the one computed (1 or 2); ``block_k`` = K tile (32, 64 or 128; capped at the group size);
    ``pdl`` = programmatic dependent launch (sm_90)."""

    warps: int = 4
    cols_per_warp: int = 32
    split_k: int = 0
    prefetch: int = 1
    block_k: int = 128
    pdl: bool = False

    @property
    def block_n(self) -> int:
        return self.warps * self.cols_per_warp

    def label(self) -> str:
        return (f"mma bn{self.block_n} bk{self.block_k} sk{self.split_k} w{self.warps}"
                + (" pdl" if self.pdl else "") + (f" p{self.prefetch}" if self.prefetch != 1 else ""))


# Resident CTAs per SM of each listed tile (cols_per_warp, warps, prefetch), from offline sm_90 register counts
# (BM = 8: 128 registers x 128 threads -> 4, 168 -> 3, 128 x 256 -> 2; BM = 16: 255 registers, 8 warps per SM).
_RESIDENT = {(32, 4, 1): 4, (64, 4, 1): 3, (32, 8, 1): 2, (32, 4, 2): 3}
_RESIDENT16 = {(64, 4, 1): 2, (64, 2, 1): 4, (64, 1, 1): 8}
# The tuner's candidates (cols_per_warp, warps, prefetch, pdl) for M <= 8 (BM = 8).
_TILES = ((32, 4, 1, False), (64, 4, 1, False), (32, 8, 1, False), (32, 4, 2, False), (32, 4, 1, True))
# ... and for M = 9..16 (BM = 16: two n8 tiles): only R = 4 (docs/kernels.md, "M = 9..16").
_TILES16 = ((64, 4, 1, False), (64, 2, 1, False), (64, 1, 1, False), (64, 2, 1, True))
# When the one-wave grid leaves more than 10% of the slots idle, the PDL tile is also listed with twice the split
# (8192 x 28672 fills 85% of 528 slots: two waves ran 38.9 against 40.9 us at M = 1).
_FILL_FOR_SECOND_SPLIT = 0.9


def _resident(bm: int, cols_per_warp: int, warps: int, prefetch: int) -> int:
    """Resident CTAs per SM of a tile (the tables above; 4 / 2 for one not listed at BM 8 / 16)."""
    table = _RESIDENT16 if bm == 16 else _RESIDENT
    return table.get((cols_per_warp, warps, prefetch), 2 if bm == 16 else 4)


def _geometry(M: int, K: int, group_size: int, cfg: MmaConfig) -> tuple[int, int, int, int]:
    """(BM, BK, R, W) of a launch; ValueError naming what is not supported."""
    if not 1 <= M <= 16:
        raise ValueError(f"w4a16_mma: handles 1 <= M <= 16 rows, got M = {M}")
    if cfg.warps not in (1, 2, 4, 8):
        raise ValueError(f"w4a16_mma: warps must be 1, 2, 4 or 8, got {cfg.warps}")
    if cfg.cols_per_warp not in (16, 32, 64):
        raise ValueError(f"w4a16_mma: cols_per_warp must be 16, 32 or 64 (16 R), got {cfg.cols_per_warp}")
    if cfg.prefetch not in (1, 2):
        raise ValueError(f"w4a16_mma: prefetch must be 1 or 2 K tiles, got {cfg.prefetch}")
    if cfg.block_k not in (32, 64, 128):
        raise ValueError(f"w4a16_mma: block_k must be 32, 64 or 128, got {cfg.block_k}")
    if cfg.split_k < 0:
        raise ValueError(f"w4a16_mma: split_k must be >= 0 (0 = automatic), got {cfg.split_k}")
    bk = cfg.block_k if group_size == K else min(cfg.block_k, group_size)
    if bk % 32:
        raise ValueError(f"w4a16_mma: group size {group_size} gives a K tile of {bk}, not a multiple of 32")
    return (8 if M <= 8 else 16), bk, cfg.cols_per_warp // 16, cfg.warps


def choose_split(n_tiles: int, k_tiles: int, resident_ctas: int, num_sms: int = NUM_SMS_DEFAULT) -> int:
    """K split for ``n_tiles`` column tiles: one wave of ``resident_ctas`` x ``num_sms`` CTA slots (as gemv1)."""
    return one_wave_split(n_tiles, k_tiles, max(1, resident_ctas) * num_sms)


def _check(x, qweight, scales, zeros, group_size, bias, cfg: MmaConfig):
    """Shape / dtype / config checks (ValueError naming the problem); returns (M, K, N, group, BM, BK, R, W)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"w4a16_mma: x must be 2-D [M, K] (reshape 3-D inputs), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    K, N, group = check_inputs(x, qweight, scales, zeros, group_size, bias)
    M = x.shape[0]
    bm, bk, R, W = _geometry(M, K, group, cfg)
    if cfg.block_n > N and N >= 16 * W:
        log.debug("w4a16_mma: block_n %d > N %d (masked columns)", cfg.block_n, N)
    return M, K, N, group, bm, bk, R, W


def w4a16_mma(x, qweight, scales, zeros, group_size: int, bias=None,
              config: Optional[MmaConfig] = None) -> torch.Tensor:
    """y [M, N] = x @ dequant(W)^T (+ bias) on mma.sync with register operands; x 2-D [M <= 16, K] fp16 / bf16 on a
    CUDA device of compute capability >= 8.0; fxopt's packed format (group 32 / 64 / 128 or -1 = per channel)."""
    cfg = config or MmaConfig()
    M, K, N, group, bm, bk, R, W = _check(x, qweight, scales, zeros, group_size, bias, cfg)
    if not HAS_GLUON:
        raise ValueError("w4a16_mma: needs triton.experimental.gluon (Triton >= 3.5)")
    if x.device.type != "cuda":
        raise ValueError(f"w4a16_mma: needs a CUDA device, got {x.device}")
    if device_capability(x.device) < (8, 0):
        raise ValueError(f"w4a16_mma: mma.sync bf16/fp16 needs compute capability >= 8.0, got "
                         f"{device_capability(x.device)}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()  # 16-byte loads of 8 activations (K is a multiple of 8: packed)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    n_tiles = cdiv(N, 16 * R * W)
    split_k = cfg.split_k or choose_split(n_tiles, cdiv(K, bk), _resident(bm, cfg.cols_per_warp, W, cfg.prefetch),
                                          num_sms(x.device))
    split, tps = balanced_split(cdiv(K, bk), split_k)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if split > 1:
        ws, cnt = zeroed_workspace(x.device, M * N), counters(x.device, n_tiles)
    else:
        ws, cnt = y, y  # unused
    pdl = cfg.pdl and has_pdl(x.device)
    magic, offset = MAGIC[x.dtype]
    _w4a16_mma_kernel[(n_tiles, split)](
        x, qweight, scales, zeros, bias if bias is not None else y, y, ws, cnt,
        M, N, K // 8, split, tps, magic * 0x10001, offset,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=group, BM=bm, BK=bk, R=R, W=W, HAS_BIAS=bias is not None, USE_SPLIT=split > 1, MASK_M=M != bm,
        MASK_N=N % (16 * R * W) != 0, MASK_K=K % bk != 0, USE_GDC=pdl, PREFETCH=cfg.prefetch,
        **_layouts(bm, bk, R, W), num_warps=W, **({"launch_pdl": True} if pdl else {}))
    return y


# Tuner candidates and their W4A16Config form
def to_mma_config(cfg: W4A16Config) -> MmaConfig:
    """W4A16Config(method="mma") -> MmaConfig: num_warps = warps, block_n = warps x cols_per_warp."""
    return MmaConfig(warps=cfg.num_warps, cols_per_warp=cfg.block_n // cfg.num_warps, split_k=cfg.split_k,
                     prefetch=cfg.prefetch, block_k=cfg.block_k, pdl=cfg.pdl)


def mma_configs(M: int, N: int, K: int, group_size: int, num_sms: int = NUM_SMS_DEFAULT) -> list[W4A16Config]:
    """The "mma" candidates for M <= 16: the ``_TILES`` list for M <= 8, ``_TILES16`` for M = 9..16 (only the tiles
    that divide N, and only when the K tile divides K), each with the one-wave split."""
    if not 1 <= M <= 16:
        return []
    group = K if group_size == -1 else group_size
    out = []
    for cpw, warps, prefetch, pdl in (_TILES if M <= 8 else _TILES16):
        cfg = MmaConfig(warps=warps, cols_per_warp=cpw, prefetch=prefetch, pdl=pdl)
        try:
            bm, bk, R, W = _geometry(M, K, group, cfg)
        except ValueError:
            continue
        if bm == 16 and (N % cfg.block_n or K % bk):
            continue  # masked loads at R = 4, BM = 16 spill (56-528 B of stack offline): not listed
        n_tiles, resident = cdiv(N, cfg.block_n), _resident(bm, cpw, warps, prefetch)
        split = choose_split(n_tiles, cdiv(K, bk), resident, num_sms)
        splits = [split]
        if pdl and bm == 8 and n_tiles * split < _FILL_FOR_SECOND_SPLIT * resident * num_sms:
            second = balanced_split(cdiv(K, bk), 2 * split)[0]
            if second != split:
                splits.append(second)
        for sk in splits:
            out.append(W4A16Config(block_m=bm, block_n=cfg.block_n, block_k=bk, split_k=sk, num_warps=warps,
                                   num_stages=1, method="mma", pdl=pdl, prefetch=prefetch))
    return out


def launch_mma(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Run a W4A16Config(method="mma")."""
    return w4a16_mma(x2d, qweight, scales, zeros, group_size, bias, to_mma_config(cfg))
