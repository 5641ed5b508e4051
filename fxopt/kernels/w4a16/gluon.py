"""W4A16 GEMM for Hopper (sm_90) in Gluon: a warp-specialized TMA ring feeding two consumer warpgroups.

``y^T[BN, BM] = W[BN, K] @ x^T[K, BM]`` (group 128, integer zeros): the dequantized weights are wgmma's register A
operand, x (rewritten in FRAG order by ``triton_tiles.prep_x``) the shared B operand. A producer warp TMA-loads x,
the packed words, scales and zeros into a ring; consumer c dequantizes its half of the columns with packed bf16x2
``sub`` / ``mul`` (exact for integer zeros), relabels the registers into the A layout and keeps one wgmma group in
flight. Small grids split K through a workspace (``ws="regmajor"``: register-major tiles) and per-tile counters.
``regs="async"`` is the register split that keeps wgmma asynchronous (with the last wait inside the K loop);
``deq="xsum"`` (M <= 16) feeds the codes as they are and applies zero and scale once per K tile. Other inputs raise
``ValueError``. Layouts, SASS notes, measurements: ``docs/kernels.md`` ("gluon.py").
"""
from __future__ import annotations

from typing import Optional

import torch

from fxopt.kernels import cdiv, next_pow2
from fxopt.kernels.w4a16.common import (MAGIC, W4A16Config, balanced_split, check_inputs, counters, integer_zeros,
                                        split_for)
from fxopt.kernels.w4a16.triton_tiles import prep_x

try:  # Gluon ships with Triton >= 3.5; importing must not fail without it (or without a GPU)
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

    HAS_GLUON = True
except Exception:  # pragma: no cover - old Triton
    HAS_GLUON = False

__all__ = ["gluon_w4a16_mm", "gluon_candidates", "HAS_GLUON"]


if HAS_GLUON:

    @gluon.jit
    def _pair_bits(v):
        """16-bit float tensor [1, BN_C] -> int32 with its bits in both halves (a bf16x2 / f16x2 operand)."""
        b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.jit
    def _deq_pairs(words, j: gl.constexpr, zz, ss, MAGIC2, IS_BF16: gl.constexpr):
        """Pair words of nibbles j and j + 4, dequantized: ``((OFFSET + q) - (OFFSET + z)) * s`` on both bf16x2
        (or f16x2) halves by packed PTX (two weights per instruction)."""
        # low half = OFFSET + nibble j, high half = OFFSET + nibble j + 4 (the bits of exact 16-bit floats)
        t = ((words >> (4 * j)) & 0x000F000F) | MAGIC2
        if IS_BF16:
            t = gl.inline_asm_elementwise("{ .reg .b32 d; sub.rn.bf16x2 d, $1, $2; mul.rn.bf16x2 $0, d, $3; }",
                                          "=r,r,r,r", [t, zz, ss], dtype=gl.int32, is_pure=True, pack=1)
        else:
            t = gl.inline_asm_elementwise("{ .reg .b32 d; sub.rn.f16x2 d, $1, $2; mul.rn.f16x2 $0, d, $3; }",
                                          "=r,r,r,r", [t, zz, ss], dtype=gl.int32, is_pure=True, pack=1)
        return t

    @gluon.jit
    def _dequant_chunk(words, zz, ss, MAGIC2, BN_C: gl.constexpr, KC: gl.constexpr, R: gl.constexpr,
                       IS_BF16: gl.constexpr, a_layout: gl.constexpr):
        """Packed words [KC/8, BN_C] int32 (row 4 q + t, column 2R (8 warp + g) + 2 rep + h of the consumer's slice)
        -> dequantized weights [BN_C, KC] in the wgmma A-operand layout ``a_layout``: tile row r = 64 rep + 16 warp +
        8 h + g, tile column 32 q + 16 kb + 8 hk + 2 t + e = code nibble 2 kb + hk + 4 e of word 4 q + t (FRAG
        order, matching x prepared by ``_prep_x(frag=True)``)."""
        zz, _ = gl.broadcast(zz, words)
        ss, _ = gl.broadcast(ss, words)
        d0 = _deq_pairs(words, 0, zz, ss, MAGIC2, IS_BF16)
        d1 = _deq_pairs(words, 1, zz, ss, MAGIC2, IS_BF16)
        d2 = _deq_pairs(words, 2, zz, ss, MAGIC2, IS_BF16)
        d3 = _deq_pairs(words, 3, zz, ss, MAGIC2, IS_BF16)
        return _pairs_to_a_operand(d0, d1, d2, d3, BN_C, KC, R, IS_BF16, a_layout)

    @gluon.jit
    def _pairs_to_a_operand(d0, d1, d2, d3, BN_C: gl.constexpr, KC: gl.constexpr, R: gl.constexpr,
                            IS_BF16: gl.constexpr, a_layout: gl.constexpr):
        """Four [KC/8, BN_C] pair-word tensors (nibble pairs 0..3 of each packed word) -> [BN_C, KC] 16-bit weights
        in the wgmma A-operand layout, by register relabeling only (no data movement)."""
        # pair index j = 2 kb + hk: [KC/8, BN_C] x (hk, kb), then the two 16-bit halves (e) as the last dim
        p = gl.join(gl.join(d0, d1), gl.join(d2, d3))  # [KC/8, BN_C, 2 (hk), 2 (kb)]
        h16 = gl.join(p.to(gl.int16), (p >> 16).to(gl.int16))  # [KC/8, BN_C, hk, kb, e]
        if IS_BF16:
            w = h16.to(gl.bfloat16, bitcast=True)
        else:
            w = h16.to(gl.float16, bitcast=True)
        # split word row (q, t) and column (warp, g, rep, h); gather into (r = rep warp h g, k = q kb hk t e)
        w = gl.reshape(w, [KC // 32, 4, 4, 8, R, 2, 2, 2, 2])  # q t warp g rep h hk kb e
        w = gl.permute(w, [4, 2, 5, 3, 0, 7, 6, 1, 8])  # rep warp h g | q kb hk t e
        w = gl.reshape(w, [BN_C, KC])
        return gl.convert_layout(w, a_layout, assert_trivial=True)

    @gluon.jit
    def _tile_words(q_tile, BN_C: gl.constexpr, NCHUNK: gl.constexpr, w_layout: gl.constexpr):
        """A K tile's packed words [16, BN_C] from shared memory, split into NCHUNK (2 or 4) per-chunk tensors of
        KC / 8 word rows each (w2 / w3 repeat w0 / w1 when NCHUNK == 2)."""
        words_all = q_tile.load(w_layout)
        if NCHUNK == 4:
            wr = gl.permute(gl.reshape(words_all, [2, 2, 4, BN_C]), [2, 3, 0, 1])  # t n q1 q0 (q = 2 q1 + q0)
            w_e, w_o = gl.split(wr)  # q0 = 0 / 1: [4, BN_C, 2 (q1)]
            w0, w2 = gl.split(w_e)
            w1, w3 = gl.split(w_o)
        else:
            wr = gl.permute(gl.reshape(words_all, [2, 8, BN_C]), [1, 2, 0])  # rows-in-chunk n chunk
            w0, w1 = gl.split(wr)
            w2 = w0
            w3 = w1
        return w0, w1, w2, w3

    @gluon.jit
    def _consumer(x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                  M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                  C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                  HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr,
                  DRAIN_IN_LOOP: gl.constexpr, SPLIT_REGMAJOR: gl.constexpr):
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        if IS_BF16:
            DT: gl.constexpr = gl.bfloat16
        else:
            DT: gl.constexpr = gl.float16
        # one warpgroup: wgmma M = 16 per warp x 4 warps x R repetitions = BN_C; wgmma N = BM; k = 16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        # packed words [rows, BN_C]: word row 4 q + t on lane t (+ registers for q), 2R consecutive columns per
        # thread, column block g = lane / 4 and warp
        w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * R], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 4], order=[0, 1])

        acc = gl.zeros([BN_C, BM], gl.float32, acc_layout)
        # n_iter >= 1 (host: every split gets at least one K tile). Without this the zero-trip path (acc = zeros,
        # defined by MOVs) merges into the final wgmma wait and ptxas serializes every wgmma (C7515).
        gl.assume(n_iter > 0)
        for i in range(n_iter):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)  # the slot's TMA bytes have landed
            sc = s_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)  # [1, BN_C]
            zr = z_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)
            ss = _pair_bits(sc)
            zz = _pair_bits((zr.to(gl.float32) + OFFSET).to(DT))  # OFFSET + zero, exact for integer zeros
            q_tile = q_bufs.index(s).slice(C * BN_C, BN_C, dim=1)  # [BK/8, BN_C]
            xt = x_bufs.index(s).permute((1, 0))  # x^T [BK, BM] (K-major B operand)
            # all BK/8 word rows at once (a slice of 4 rows would cut the 8-row swizzle pattern), then split into
            # chunks in registers (word row 4 q + t: q is a register index, so the split moves no data)
            w0, w1, w2, w3 = _tile_words(q_tile, BN_C, NCHUNK, w_layout)
            for cq in gl.static_range(NCHUNK):
                if cq == 0:
                    words = w0
                elif cq == 1:
                    words = w1
                elif cq == 2:
                    words = w2
                else:
                    words = w3
                words = gl.convert_layout(words, w_layout, assert_trivial=True)  # same registers, named layout
                a = _dequant_chunk(words, zz, ss, MAGIC2, BN_C, KC, R, IS_BF16, a_layout)
                acc = warpgroup_mma(a, xt.slice(cq * KC, KC, dim=0), acc, is_async=True)
                # keep this chunk's wgmma in flight while the next chunk is dequantized
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if cq == 0:
                    # every wgmma of this consumer's previous K tile has completed: release its slot
                    fence_async_shared()
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
            if DRAIN_IN_LOOP:
                if i == n_iter - 1:
                    # retire the last wgmma INSIDE the loop: ptxas 12.8 schedules the epilogue's reads of acc
                    # (F2FP bf16 packs) above the DEPBAR of the post-loop wait (docs/kernels.md, "Epilogue
                    # hazard"); it does not move them into the loop, so this DEPBAR.LE gsb0 0x0 stays before them
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, tile_id, pid_k,
                  SPLIT_K, C, BM, BN_C, R, HAS_BIAS, USE_SPLIT, SPLIT_REGMAJOR)

    @gluon.jit
    def _epilogue(acc, acc_layout: gl.constexpr, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n,
                  tile_id, pid_k, SPLIT_K, C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, R: gl.constexpr,
                  HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, SPLIT_REGMAJOR: gl.constexpr = False):
        """Store a consumer's finished [BN_C, BM] accumulator: tile row r -> weight column n (see
        ``_dequant_chunk``), column m -> activation row; with split-K through the fp32 workspace and the per-tile
        counter (the last program to arrive sums, adds the bias, writes y and resets the counter)."""
        r = gl.arange(0, BN_C, layout=gl.SliceLayout(1, acc_layout))
        m_loc = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        n_loc = 2 * R * (8 * ((r // 16) % 4) + r % 8) + 2 * (r // 64) + (r // 8) % 2
        offs_n = off_n + C * BN_C + n_loc
        offs_m = off_m + m_loc
        mask = gl.expand_dims(offs_m < M, 0) & gl.expand_dims(offs_n < N, 1)
        y_ptrs = y_ptr + gl.expand_dims(offs_m, 0) * stride_ym + gl.expand_dims(offs_n, 1)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + offs_n).to(gl.float32)
        if USE_SPLIT:
            if SPLIT_REGMAJOR:
                # a register-major workspace [SPLIT_K, tiles, 2 consumers, BM * BN_C / 128, 128 threads]: element
                # (r, m) goes to slot(r, m) * 128 + thread(r, m), thread = its owner in the wgmma accumulator layout
                # (warp (r // 16) % 4, lane 4 (r % 8) + (m // 2) % 4), slot = its register; so one store instruction
                # of a warp writes 128 contiguous bytes (the [split, M, N] layout writes 4 rows x 64 B with gaps),
                # and the last program reloads every slice in the same layout. Rows past M exist in the block, so
                # no mask.
                blk_elems = BM * BN_C
                slice_elems = gl.num_programs(0) * 2 * blk_elems
                rr = gl.expand_dims(r, 1)
                mm = gl.expand_dims(m_loc, 0)
                owner = 32 * ((rr // 16) % 4) + 4 * (rr % 8) + (mm // 2) % 4
                slot = (((rr // 64) * (BM // 8) + mm // 8) * 2 + (rr // 8) % 2) * 2 + mm % 2
                ws_ptrs = ws_ptr + (tile_id * 2 + C) * blk_elems + slot * 128 + owner
                ws_mask = None
                ws_other = None
            else:
                ws_ptrs = ws_ptr + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1)
                slice_elems = M * N
                ws_mask = mask
                ws_other = 0.0
            gl.store(ws_ptrs + pid_k * slice_elems, acc, mask=ws_mask)
            gl.thread_barrier()  # all of this partition's partial stores precede the counter bump
            cnt = cnt_ptr + tile_id * 2 + C
            arrived = gl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                # reuse acc's registers for the sum (a second accumulator spills at 128 fp32 per thread)
                acc = gl.load(ws_ptrs, mask=ws_mask, other=ws_other, cache_modifier=".cg")
                for sk in range(1, SPLIT_K):
                    acc += gl.load(ws_ptrs + sk * slice_elems, mask=ws_mask, other=ws_other, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += gl.expand_dims(bias, 1)
                gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt, 0)
        else:
            if HAS_BIAS:
                acc += gl.expand_dims(bias, 1)
            gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _producer(x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                  off_m, off_n, k_tile0, n_iter):
        BK: gl.constexpr = x_bufs.shape[2]
        STAGES: gl.constexpr = x_bufs.shape[0]
        NBYTES: gl.constexpr = (x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
        for i in range(n_iter):
            s = i % STAGES
            # the slot's previous contents (K tile i - STAGES) have been released by both consumers
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            kt = k_tile0 + i
            tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], bar, x_bufs.index(s))
            tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(s))
            tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(s))
            tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(s))

    @gluon.jit
    def _w4a16_gluon_kernel(x_desc, q_desc, s_desc, z_desc, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                            M, N, K_TILES, TILES_PER_SPLIT, SPLIT_K, stride_ym, MAGIC2, OFFSET,
                            BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
                            HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            DRAIN_IN_LOOP: gl.constexpr = False, SPLIT_REGMAJOR: gl.constexpr = False):
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN_C: gl.constexpr = BN // 2
        gl.static_assert(BK == 128, "one ring stage = one group of 128")
        gl.static_assert(BN_C % 64 == 0, "each consumer warpgroup needs a multiple of 64 weight columns")
        gl.static_assert(BK % KC == 0 and KC % 32 == 0, "KC: a multiple of 32 dividing 128")

        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        num_pid_m = gl.cdiv(M, BM)
        pid_m = pid % num_pid_m  # neighbouring CTAs share the weight tile (second read hits L2)
        pid_n = pid // num_pid_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        k_tile0 = pid_k * TILES_PER_SPLIT
        n_iter = gl.minimum(TILES_PER_SPLIT, K_TILES - k_tile0)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        z_bufs = gl.allocate_shared_memory(z_desc.dtype, [STAGES] + z_desc.block_type.shape, z_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(empty.index(st), count=2)  # one arrival per consumer warpgroup

        tile_id = pid
        gl.warp_specialize([
            (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                         M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                         0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_REGMAJOR)),
            (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                         M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                         1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_REGMAJOR)),
            (_producer, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                         off_m, off_n, k_tile0, n_iter)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    # Small-M consumer ("xsum"): scale and zero applied once per K tile to an fp32 partial product
    @gluon.jit
    def _rows_for_acc(v, BN_C: gl.constexpr, R: gl.constexpr, acc_layout: gl.constexpr):
        """[1, BN_C] in the packed-word layout (column n = 2R (8 warp + g) + 2 rep + h of the consumer's slice) ->
        [BN_C, 1] in the accumulator layout, row r = 64 rep + 16 warp + 8 h + g (the weight-column relabeling of
        ``_dequant_chunk``): the same registers, renamed (``assert_trivial``)."""
        v = gl.reshape(v, [4, 8, R, 2])  # warp g rep h
        v = gl.permute(v, [2, 0, 3, 1])  # rep warp h g
        v = gl.reshape(v, [BN_C])
        v = gl.convert_layout(v, gl.SliceLayout(1, acc_layout), assert_trivial=True)
        return gl.expand_dims(v, 1)

    @gluon.jit
    def _codes_chunk(words, MAGIC2, BN_C: gl.constexpr, KC: gl.constexpr, R: gl.constexpr, IS_BF16: gl.constexpr,
                     a_layout: gl.constexpr):
        """Like ``_dequant_chunk`` (same register relabeling), but the codes as they are: the pair words
        ``OFFSET + q``, no floating-point instruction."""
        d0 = ((words >> 0) & 0x000F000F) | MAGIC2
        d1 = ((words >> 4) & 0x000F000F) | MAGIC2
        d2 = ((words >> 8) & 0x000F000F) | MAGIC2
        d3 = ((words >> 12) & 0x000F000F) | MAGIC2
        return _pairs_to_a_operand(d0, d1, d2, d3, BN_C, KC, R, IS_BF16, a_layout)

    @gluon.jit
    def _fold(acc, part, s_rows, z_rows, xs_cols):
        """acc += the finished K tile's partial product, zero-corrected and scaled per weight column."""
        return acc + (part - z_rows * xs_cols) * s_rows

    @gluon.jit
    def _small_tile(i, n_iter, acc, part, s_prev, z_prev, xs_prev, xs_row, m_idx, M, x_bufs, q_bufs, s_bufs,
                    z_bufs, ready, empty, MAGIC2, OFFSET, C: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                    R: gl.constexpr, NCHUNK: gl.constexpr, STAGES: gl.constexpr, IS_BF16: gl.constexpr,
                    acc_layout: gl.constexpr, a_layout: gl.constexpr, w_layout: gl.constexpr):
        """K tile ``i`` of ``n_iter`` of the small-M consumer. Returns the carried state."""
        s = i % STAGES
        # sums of x over this K tile (from prep_x), one fp32 per activation row: issued before the wait
        xs_cur = gl.expand_dims(gl.load(xs_row + i, mask=m_idx < M, other=0.0), 0)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        sc = s_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)  # [1, BN_C]
        zr = z_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)
        s_cur = _rows_for_acc(sc.to(gl.float32), BN_C, R, acc_layout)
        z_cur = _rows_for_acc(zr.to(gl.float32) + OFFSET, BN_C, R, acc_layout)
        q_tile = q_bufs.index(s).slice(C * BN_C, BN_C, dim=1)
        xt = x_bufs.index(s).permute((1, 0))
        w0, w1, w2, w3 = _tile_words(q_tile, BN_C, NCHUNK, w_layout)
        for cq in gl.static_range(NCHUNK):
            if cq == 0:
                words = w0
            elif cq == 1:
                words = w1
            elif cq == 2:
                words = w2
            else:
                words = w3
            words = gl.convert_layout(words, w_layout, assert_trivial=True)
            a = _codes_chunk(words, MAGIC2, BN_C, KC, R, IS_BF16, a_layout)
            if cq == 0:
                # tile i - 1's last wgmma group ran during the loop back edge, the ready wait and the loads;
                # retire it, fold its partial, release its slot, start tile i's partial (use_acc=False).
                # ptxas hoists this wait above chunk 0's dequantization (no dependency); a second wgmma
                # accumulator kept in flight across the fold makes ptxas serialize every wgmma (C7514: an
                # accumulator read while any wgmma is in flight), so one group per tile is not overlapped
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                acc = _fold(acc, part, s_prev, z_prev, xs_prev)
                fence_async_shared()
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
                part = warpgroup_mma(a, xt.slice(0, KC, dim=0), part, use_acc=False, is_async=True)
            else:
                part = warpgroup_mma(a, xt.slice(cq * KC, KC, dim=0), part, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
        if i == n_iter - 1:
            # the last tile: retire and fold INSIDE the loop, so the epilogue never reads a wgmma register
            # (docs/kernels.md, "Epilogue hazard")
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _fold(acc, part, s_cur, z_cur, xs_cur)
        return acc, part, s_cur, z_cur, xs_cur

    @gluon.jit
    def _consumer_xsum(x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                       M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id, pid_k,
                       SPLIT_K, C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                       HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr):
        """``_consumer`` with the codes ``OFFSET + q`` in the wgmma and the zero and scale applied per K tile (= group)
        to a per-tile fp32 partial: ``acc += (part - (OFFSET + z) * sum_k x) * s``. The last wgmma of tile i stays in
        flight while chunk 0 of tile i + 1 is unpacked; then ``warpgroup_mma_wait(0)``, the fold of tile i's partial
        into ``acc``, the release of tile i's slot, and chunk 0's wgmma with ``use_acc=False``."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * R], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 4], order=[0, 1])
        acc = gl.zeros([BN_C, BM], gl.float32, acc_layout)
        part = gl.zeros([BN_C, BM], gl.float32, acc_layout)  # the K tile's partial product (wgmma accumulator)
        s_prev = gl.zeros([BN_C, 1], gl.float32, acc_layout)  # zeros: the fold at i = 0 adds 0 * 0
        z_prev = gl.zeros([BN_C, 1], gl.float32, acc_layout)
        xs_prev = gl.zeros([1, BM], gl.float32, acc_layout)
        m_idx = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        xs_row = xs_ptr + m_idx * K_TILES + k_tile0
        gl.assume(n_iter > 0)
        for i in range(n_iter):
            acc, part, s_prev, z_prev, xs_prev = _small_tile(
                i, n_iter, acc, part, s_prev, z_prev, xs_prev, xs_row, m_idx, M, x_bufs, q_bufs, s_bufs, z_bufs,
                ready, empty, MAGIC2, OFFSET, C, BN_C, KC, R, NCHUNK, STAGES, IS_BF16, acc_layout, a_layout,
                w_layout)
        _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, tile_id, pid_k,
                  SPLIT_K, C, BM, BN_C, R, HAS_BIAS, USE_SPLIT)

    # integer arguments not specialized (M == 1, divisibility of M / K tiles / splits): one build per config, bias,
    # split and dtype
    @gluon.jit(do_not_specialize=["M", "K_TILES", "TILES_PER_SPLIT", "SPLIT_K"])
    def _w4a16_gluon_small_kernel(x_desc, q_desc, s_desc, z_desc, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                                  M, N, K_TILES, TILES_PER_SPLIT, SPLIT_K, stride_ym, MAGIC2, OFFSET,
                                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
                                  HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """``_w4a16_gluon_kernel`` with the small-M consumer ``_consumer_xsum``."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN_C: gl.constexpr = BN // 2
        gl.static_assert(BK == 128, "one ring stage = one group of 128")
        gl.static_assert(BN_C % 64 == 0, "each consumer warpgroup needs a multiple of 64 weight columns")
        gl.static_assert(BK % KC == 0 and KC % 32 == 0, "KC: a multiple of 32 dividing 128")

        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        num_pid_m = gl.cdiv(M, BM)
        pid_m = pid % num_pid_m
        pid_n = pid // num_pid_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        k_tile0 = pid_k * TILES_PER_SPLIT
        n_iter = gl.minimum(TILES_PER_SPLIT, K_TILES - k_tile0)

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        z_bufs = gl.allocate_shared_memory(z_desc.dtype, [STAGES] + z_desc.block_type.shape, z_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=2)

        tile_id = pid
        gl.warp_specialize([
            (_consumer_xsum, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                              M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id,
                              pid_k, SPLIT_K, 0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16)),
            (_consumer_xsum, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                              M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id,
                              pid_k, SPLIT_K, 1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16)),
            (_producer, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                         off_m, off_n, k_tile0, n_iter)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Host side
GROUP = 128  # K per ring stage = the (only supported) group size
_SMEM_LIMIT = 227 * 1024

# Named register splits (consumer warpgroups, producer warpgroup) for ``regs=`` at maxnreg 168. With the producer
# below 112 ptxas serializes every wgmma (C7512); "async" keeps one wgmma group in flight (docs/kernels.md).
_REGS = {"default": (232, 40), "async": (200, 112)}


def _smem_bytes(block_m: int, block_n: int, stages: int) -> int:
    per_stage = block_m * GROUP * 2 + (GROUP // 8) * block_n * 4 + 2 * block_n * 2
    return stages * per_stage + 2 * stages * 8 + 1024  # + barriers + alignment slack


def _block_m_for(M: int) -> int:
    return min(max(next_pow2(M), 16), 256)


def _config_ok(M: int, K: int, N: int, block_m: int, block_n: int, stages: int, kc: int) -> bool:
    bn_c = block_n // 2
    return (bn_c % 64 == 0 and bn_c <= 256 and N % block_n == 0 and bn_c * block_m // 128 <= 128
            and block_m in (16, 32, 64, 128, 256) and kc in (32, 64) and stages >= 2
            and _smem_bytes(block_m, block_n, stages) <= _SMEM_LIMIT)


def _max_stages(block_m: int, block_n: int, cap: int = 8) -> int:
    s = cap
    while s > 2 and _smem_bytes(block_m, block_n, s) > _SMEM_LIMIT:
        s -= 1
    return s


def _async_regs_ok(block_m: int, block_n: int, kc: int, split: bool) -> bool:
    """Configs whose ``regs="async"`` build was checked offline (sm_90 SASS, split-K on and off): no C7512,
    DEPBAR.LE gsb0 0x1 in the main loop, no spill (docs/kernels.md, "Register split")."""
    acc = (block_n // 2) * block_m // 128  # fp32 accumulators per consumer thread
    a_regs = (block_n // 2) * kc // 256  # bf16x2 A-operand registers per thread per chunk
    return acc <= 64 and acc + a_regs <= 80 and (block_m <= 64 or not split)


def _split_epilogue_spills(block_m: int, block_n: int, consumer_regs: int, producer_regs: int) -> bool:
    """Tiles whose split-K epilogue spills (offline sm_90 builds); ``gluon_w4a16_mm`` runs them without split-K."""
    return ((block_n // 2) * block_m // 128 >= 128
            or ((consumer_regs, producer_regs) == _REGS["async"] and block_m > 64))


def _drain_in_loop(consumer_regs: int, producer_regs: int) -> bool:
    """Whether the build retires its last wgmma inside the K loop (docs/kernels.md, "Epilogue hazard"): every
    register split but the default, whose SASS waits after every HGMMA anyway."""
    return (consumer_regs, producer_regs) != _REGS["default"]


def _maxnreg(consumer_regs: int, producer_regs: int) -> int:
    """Launch register limit: 12 warps share 64K registers; Triton then emits ``setmaxnreg`` per partition."""
    if consumer_regs >= 256 and producer_regs >= 256:
        return 168
    return (2 * 4 * consumer_regs + 4 * producer_regs) // 12 // 8 * 8


def _nvmma(block_shape, gl_dtype, swizzle: Optional[int] = None):
    if swizzle is None:
        return gl.NVMMASharedLayout.get_default_for(block_shape, gl_dtype)
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=gl_dtype.primitive_bitwidth, rank=2)


def make_descriptors(xp, qweight, scales, zeros, block_m: int, block_n: int):
    """TMA descriptors (x prepared in FRAG order [M, K], packed codes, scales, zeros)."""
    gdt = gl.bfloat16 if xp.dtype == torch.bfloat16 else gl.float16
    x_desc = TensorDescriptor.from_tensor(xp, [block_m, GROUP], _nvmma([block_m, GROUP], gdt))
    q_desc = TensorDescriptor.from_tensor(qweight, [GROUP // 8, block_n], _nvmma([GROUP // 8, block_n], gl.int32))
    s_desc = TensorDescriptor.from_tensor(scales, [1, block_n], _nvmma([1, block_n], gdt, swizzle=0))
    z_desc = TensorDescriptor.from_tensor(zeros, [1, block_n], _nvmma([1, block_n], gdt, swizzle=0))
    return x_desc, q_desc, s_desc, z_desc


def _check(x, qweight, scales, zeros, group_size, bias, block_m, block_n, stages, kc):
    if not HAS_GLUON:
        raise ValueError("gluon_w4a16: triton.experimental.gluon is not available in this Triton")
    K, N, group_size = check_inputs(x, qweight, scales, zeros, group_size, bias)
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError(f"gluon_w4a16: needs an sm_90 (Hopper) CUDA device, got {x.device}")
    if K % GROUP or N % GROUP or group_size != GROUP:
        raise ValueError(f"gluon_w4a16: K ({K}) and N ({N}) must be multiples of {GROUP}, the only group size")
    if not _config_ok(1, K, N, block_m, block_n, stages, kc):
        raise ValueError(f"gluon_w4a16: unsupported config block_m={block_m} block_n={block_n} stages={stages} "
                         f"kc={kc} for N={N} (block_n/2 a multiple of 64 dividing N, block_m*block_n/256 <= 128 "
                         f"accumulators per thread, shared memory {_smem_bytes(block_m, block_n, stages)} B <= "
                         f"{_SMEM_LIMIT})")
    if not integer_zeros(zeros):
        raise ValueError("gluon_w4a16: zeros must be integers (the bf16x2 dequantization is exact only then)")
    return K, N


def gluon_w4a16_mm(x, qweight, scales, zeros, group_size: int = GROUP, bias=None, *, block_m: int = 64,
                   block_n: int = 256, stages: int = 4, kc: int = 32, split_k: Optional[int] = None,
                   regs: Optional[str] = None, deq: Optional[str] = None, ws_layout: Optional[str] = None
                   ) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) with the warp-specialized Gluon kernel; x [..., K] bf16 / fp16 on sm_90, group
    128, integer zeros; ValueError when unsupported. ``split_k`` None: about one CTA per SM (tiles whose split
    epilogue spills run without split-K); ``regs`` None / "default" / "async" (``_REGS``); ``deq`` None or "xsum"
    (the small-M consumer); ``ws_layout`` None or "regmajor" (the main kernel's register-major workspace)."""
    if deq not in (None, "xsum"):
        raise ValueError(f"gluon_w4a16: deq must be None or 'xsum', got {deq!r}")
    if ws_layout not in (None, "regmajor") or (ws_layout and deq):
        raise ValueError(f"gluon_w4a16: ws_layout must be None or 'regmajor' (main kernel), got {ws_layout!r}")
    if regs not in (None, *_REGS):
        raise ValueError(f"gluon_w4a16: regs must be one of {sorted(_REGS)} or None, got {regs!r}")
    consumer_regs, producer_regs = _REGS[regs or "default"]
    K, N = _check(x, qweight, scales, zeros, group_size, bias, block_m, block_n, stages, kc)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, K)
    M = x2d.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    xp, xs = prep_x(x2d.contiguous(), GROUP, True)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    k_tiles = K // GROUP
    n_tiles = cdiv(M, block_m) * (N // block_n)
    if split_k is None:
        split_k = split_for(n_tiles, k_tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    if _split_epilogue_spills(block_m, block_n, consumer_regs, producer_regs):
        split_k = 1
    split_k, tiles_per_split = balanced_split(k_tiles, split_k)
    regmajor = ws_layout == "regmajor" and split_k > 1
    if regmajor:
        # tile-major [split, tiles, 2 consumers, BM x BN/2] in register-major order (rows past M included)
        ws = torch.empty((split_k, n_tiles * block_m * block_n), dtype=torch.float32, device=x.device)
    elif split_k > 1:
        ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    else:
        ws = y  # unused
    cnt = counters(x.device, 2 * n_tiles) if split_k > 1 else y
    magic, offset = MAGIC[x.dtype]
    x_desc, q_desc, s_desc, z_desc = make_descriptors(xp, qweight, scales, zeros, block_m, block_n)
    common = dict(BM=block_m, BN=block_n, STAGES=stages, KC=kc, HAS_BIAS=bias is not None, USE_SPLIT=split_k > 1,
                  IS_BF16=x.dtype == torch.bfloat16, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                  num_warps=4, maxnreg=_maxnreg(consumer_regs, producer_regs))
    b = bias if bias is not None else y
    if deq:
        _w4a16_gluon_small_kernel[(n_tiles, split_k)](
            x_desc, q_desc, s_desc, z_desc, y, b, ws, cnt, xs.contiguous(),
            M, N, k_tiles, tiles_per_split, split_k, y.stride(0), magic * 0x10001, offset, **common)
    else:
        _w4a16_gluon_kernel[(n_tiles, split_k)](
            x_desc, q_desc, s_desc, z_desc, y, b, ws, cnt,
            M, N, k_tiles, tiles_per_split, split_k, y.stride(0), magic * 0x10001, offset,
            DRAIN_IN_LOOP=_drain_in_loop(consumer_regs, producer_regs),
            **({"SPLIT_REGMAJOR": True} if regmajor else {}), **common)
    return y.reshape(*lead, N)


def launch_gluon(x2d, qweight, scales, zeros, group_size, bias, cfg: W4A16Config) -> torch.Tensor:
    """Run a W4A16Config(method="gluon"); ValueError on what it does not support (non-integer zeros included)."""
    return gluon_w4a16_mm(x2d, qweight, scales, zeros, group_size, bias, block_m=cfg.block_m, block_n=cfg.block_n,
                          stages=cfg.num_stages, kc=cfg.kc, split_k=cfg.split_k or None, regs=cfg.regs or None,
                          deq=cfg.deq or None, ws_layout=cfg.ws or None)


def gluon_candidates(M: int, K: int, N: int) -> list[W4A16Config]:
    """The tuner's Gluon candidates of an M bucket (first = default): the main kernel's tiles, with the register-major
    split-K workspace wherever the split epilogue does not spill, then (M <= 16) the small-M consumer."""
    bm = _block_m_for(M)
    out: list[W4A16Config] = []

    def add(block_m, block_n, stages=None, kc=32, regs=""):
        stages = stages or _max_stages(block_m, block_n)
        # gluon_w4a16_mm runs regs="async" with BM > 64 without split-K
        if regs and not _async_regs_ok(block_m, block_n, kc, block_m <= 64):
            return
        ws = "" if _split_epilogue_spills(block_m, block_n, *_REGS[regs or "default"]) else "regmajor"
        cfg = W4A16Config(block_m, block_n, 128, 0, 4, stages, "gluon", kc=kc, regs=regs, ws=ws)
        if _config_ok(M, K, N, block_m, block_n, stages, kc) and cfg not in out:
            out.append(cfg)

    if bm <= 64:
        add(bm, 256)
        add(bm, 128)
        add(bm, 256, kc=64)
        add(bm, 256, stages=4)
    elif bm == 128:
        add(128, 256)
        add(128, 128)
        add(128, 256, kc=64)
        add(64, 256)  # two M tiles
    else:
        add(256, 128)
        add(128, 256)
        add(256, 128, kc=64)
        add(128, 128)
    if not out:  # e.g. N not a multiple of 256 and the BN = 128 tiles dropped for another reason
        add(min(bm, 128), 128, stages=2)
    # regs="async" (wgmma left asynchronous): the best async tile was 6-10% faster at M = 64 / 256 and 13% slower at
    # M = 128 (8192 x 8192), so the tuner decides
    if bm <= 64:
        add(bm, 128, regs="async")
        add(bm, 256, regs="async")
    else:
        add(128, 128, kc=64, regs="async")
        add(128, 128, regs="async")
        add(64, 256, regs="async")
    # the small-M consumer: BM 16 x BN 256, deq="xsum", the async split, KC 32, split-K to fill the SMs
    stages = _max_stages(16, 256)
    if M <= 16 and _config_ok(M, K, N, 16, 256, stages, 32) and _async_regs_ok(16, 256, 32, True):
        out.append(W4A16Config(16, 256, 128, 0, 4, stages, "gluon", kc=32, regs="async", deq="xsum"))
    return out
