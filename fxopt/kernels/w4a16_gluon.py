"""W4A16 GEMM for Hopper (sm_90) written in Gluon: warp-specialized, producer ring + two consumer warpgroups.

Computes ``y[M, N] = x[M, K] @ dequant(W)^T (+ bias)`` from fxopt's packed format (``w4a16.py``), group size 128,
integer zeros. The weight is wgmma's A operand from registers: a consumer warpgroup loads packed words, unpacks
them to bf16 (exact pair arithmetic on OFFSET + q), and multiplies by x^T from shared memory; weight columns are
relabeled so that each thread's A fragment comes from whole packed words. x is rewritten once per call in FRAG
order (``w4a16._prep_x``) so its TMA tiles match. A producer warp TMA-loads x and weight tiles into a ring of
STAGES slots guarded by ``ready`` / ``empty`` mbarriers. Small grids split K; partials go to a register-major fp32
workspace and the last CTA of a tile reduces them. An epilogue wait placed before the first accumulator read avoids
a SASS hazard ptxas leaves in async builds without split-K.

Candidates the tuner lists: ``gluon_w4a16_configs`` (every M bucket, bf16) and the small-M consumer (``deq="xsum"``,
BN 256). Opt-in builds kept for comparison (stream-K, chunked split-K fixup, deeper wgmma queue, four consumers,
PDL, timing probes) were measured slower or not checked; their results, the cycle model and the SASS census are in
``docs/kernels.md``. Unsupported shapes raise ``ValueError``.
"""
from __future__ import annotations

from typing import Optional

import torch

from fxopt.kernels import cdiv, next_pow2, outside_graph_pools

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

__all__ = ["gluon_w4a16_mm", "gluon_w4a16_configs", "gluon_w4a16_async_configs", "gluon_w4a16_small_configs",
           "gluon_w4a16_streamk_configs", "HAS_GLUON"]

GROUP = 128  # K per ring stage = the (only supported) group size
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
_SMEM_LIMIT = 227 * 1024
_NUM_SMS_DEFAULT = 132


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
                  DRAIN_IN_LOOP: gl.constexpr, SPLIT_CHUNKED: gl.constexpr = False, INFLIGHT: gl.constexpr = 1,
                  PROBE: gl.constexpr = 0, NCONS: gl.constexpr = 2, KSTEP: gl.constexpr = 1,
                  KPAR: gl.constexpr = 0, PDL: gl.constexpr = False, SPLIT_REGMAJOR: gl.constexpr = False):
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        gl.static_assert(INFLIGHT >= 1 and INFLIGHT <= NCHUNK, "INFLIGHT: 1 .. chunks per K tile")
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

        if PDL:
            _gdc_wait()  # bias, the split-K workspace and counters: only after the preceding grid
        acc = gl.zeros([BN_C, BM], gl.float32, acc_layout)
        # n_iter >= 1 (host: every split gets at least one K tile). Without this the zero-trip path (acc = zeros,
        # defined by MOVs) merges into the final wgmma wait and ptxas serializes every wgmma (C7515).
        # KSTEP 2 (four consumers, K pairs): this consumer takes the slice's K tiles KPAR, KPAR + 2,..
        # (host: every slice has >= 2 K tiles, so both parities have work)
        if KSTEP == 1:
            n_mine = n_iter
        else:
            n_mine = (n_iter - KPAR + KSTEP - 1) // KSTEP
        if PROBE == 1:
            # timing probe "loads only": every slot released unread, nothing computed (y = 0 or the bias)
            for j in range(n_mine):
                i = j * KSTEP + KPAR
                mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
                mbarrier.arrive(empty.index(i % STAGES))
            n_main = 0 * n_mine
        else:
            gl.assume(n_mine > 0)
            n_main = n_mine
        for j in range(n_main):
            i = j * KSTEP + KPAR
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
                if PROBE == 5:
                    # timing probe "smem A": A read by wgmma from shared memory (the packed slot reinterpreted as
                    # bf16 [BN_C, KC] per consumer; values meaningless), no dequantization (ring as probe 2)
                    a_s = q_bufs.index(s)._reinterpret(DT, [2 * BN_C, KC], gl.NVMMASharedLayout(
                        swizzle_byte_width=64, element_bitwidth=16, rank=2)).slice(C * BN_C, BN_C, dim=0)
                    acc = warpgroup_mma(a_s, xt.slice(cq * KC, KC, dim=0), acc, is_async=True)
                else:
                    if PROBE == 4:
                        # timing probe "mma only": a constant A operand, no dequantization (ring as probe 2)
                        a = gl.full([BN_C, KC], 1.0, DT, a_layout)
                    else:
                        a = _dequant_chunk(words, zz, ss, MAGIC2, BN_C, KC, R, IS_BF16, a_layout)
                    acc = warpgroup_mma(a, xt.slice(cq * KC, KC, dim=0), acc, is_async=True)
                # keep this chunk's wgmma (and INFLIGHT - 1 earlier ones) in flight while the next chunk is
                # dequantized
                acc = warpgroup_mma_wait(num_outstanding=INFLIGHT, deps=(acc, ))
                if cq == INFLIGHT - 1:
                    # at most chunks 0 .. INFLIGHT - 1 of this tile are still in flight, so every wgmma of
                    # this consumer's previous K tile (i - KSTEP) has completed: release its slot
                    fence_async_shared()
                    mbarrier.arrive(empty.index((i + STAGES - KSTEP) % STAGES), pred=j > 0)
            if DRAIN_IN_LOOP:
                if j == n_main - 1:
                    # retire the last wgmma INSIDE the loop: ptxas 12.8 schedules the epilogue's reads of acc
                    # (F2FP bf16 packs) above the DEPBAR of the post-loop wait (docs/kernels.md, "Epilogue
                    # hazard"); it does not move them into the loop, so this DEPBAR.LE gsb0 0x0 stays before them
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        # ---- epilogue: tile row r -> weight column n (see _dequant_chunk), column m -> activation row
        # K pairs: the two parities are two more split-K slices of the same columns (workspace [2 SPLIT_K, M, N])
        _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, tile_id,
                  pid_k * KSTEP + KPAR, SPLIT_K * KSTEP, C, BM, BN_C, R, HAS_BIAS, USE_SPLIT, SPLIT_CHUNKED, NCONS,
                  SPLIT_REGMAJOR)

    @gluon.jit
    def _epilogue(acc, acc_layout: gl.constexpr, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n,
                  tile_id, pid_k, SPLIT_K, C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, R: gl.constexpr,
                  HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, SPLIT_CHUNKED: gl.constexpr = False,
                  NCONS: gl.constexpr = 2, SPLIT_REGMAJOR: gl.constexpr = False):
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
        if HAS_BIAS and not (USE_SPLIT and SPLIT_CHUNKED):
            bias = gl.load(bias_ptr + offs_n).to(gl.float32)
        if USE_SPLIT and SPLIT_CHUNKED:
            # a tile-major workspace [SPLIT_K, tiles, 2, BM, BN_C] (consumer-local columns n_loc), so a
            # thread's partial addresses are one base plus constants (the [split, M, N] workspace's per-element
            # 64-bit addresses spill at 128 accumulators per thread), and the fixup in row chunks
            blk_elems = BM * BN_C
            split_stride = gl.num_programs(0) * NCONS * blk_elems
            blk = ws_ptr + (tile_id * NCONS + C) * blk_elems
            offs_blk = gl.expand_dims(m_loc, 0) * BN_C + gl.expand_dims(n_loc, 1)
            gl.store(blk + pid_k * split_stride + offs_blk, acc)
            gl.thread_barrier()  # all of this partition's partial stores precede the counter bump
            cnt = cnt_ptr + tile_id * NCONS + C
            arrived = gl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                _split_reduce_chunked(y_ptr, bias_ptr, blk, split_stride, M, N, stride_ym, off_m, off_n + C * BN_C,
                                      SPLIT_K, BM, BN_C, HAS_BIAS)
                gl.atomic_xchg(cnt, 0)
        elif USE_SPLIT:
            if SPLIT_REGMAJOR:
                # a register-major workspace [SPLIT_K, tiles, NCONS,
                # BM * BN_C / 128, 128 threads]: element (r, m) goes to slot(r, m) * 128 + thread(r, m), thread = its
                # owner in the wgmma accumulator layout (warp (r // 16) % 4, lane 4 (r % 8) + (m // 2) % 4), slot =
                # its register; so one store instruction of a warp writes 128 contiguous bytes (the [split, M, N]
                # layout writes 4 rows x 64 B with gaps), and the last program reloads every slice in the same
                # layout. Any bijection would be correct (writer and reader share it); this one coalesces. Rows past
                # M exist in the block, so no mask.
                blk_elems = BM * BN_C
                slice_elems = gl.num_programs(0) * NCONS * blk_elems
                rr = gl.expand_dims(r, 1)
                mm = gl.expand_dims(m_loc, 0)
                owner = 32 * ((rr // 16) % 4) + 4 * (rr % 8) + (mm // 2) % 4
                slot = (((rr // 64) * (BM // 8) + mm // 8) * 2 + (rr // 8) % 2) * 2 + mm % 2
                ws_ptrs = ws_ptr + (tile_id * NCONS + C) * blk_elems + slot * 128 + owner
                ws_mask = None
                ws_other = None
            else:
                ws_ptrs = ws_ptr + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1)
                slice_elems = M * N
                ws_mask = mask
                ws_other = 0.0
            gl.store(ws_ptrs + pid_k * slice_elems, acc, mask=ws_mask)
            gl.thread_barrier()  # all of this partition's partial stores precede the counter bump
            cnt = cnt_ptr + tile_id * NCONS + C
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
    def _split_reduce_chunked(y_ptr, bias_ptr, blk, split_stride, M, N, stride_ym, off_m, col0, SPLIT_K,
                              BM: gl.constexpr, BN_C: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Split-K fixup of one consumer's block by the last program to arrive: sum the SPLIT_K fp32 partials
        ``blk + sk * split_stride`` ([BM, BN_C] row-major, column = consumer-local weight column), add the bias and
        store y[off_m + m, col0 + n]; CH activation rows at a time in a row-major blocked layout (coalesced along
        n, CH * BN_C / 128 values per thread), rows past M skipped by the mask."""
        CH: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BN_C // 32], threads_per_warp=[1, 32],
                                                warps_per_cta=[4, 1], order=[1, 0])
        rows = gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BN_C, layout=gl.SliceLayout(0, layout))
        col_ok = gl.expand_dims(col0 + cols < N, 0)
        if HAS_BIAS:
            bias = gl.expand_dims(gl.load(bias_ptr + col0 + cols).to(gl.float32), 0)
        for m0 in range(0, BM, CH):
            offs_m = off_m + m0 + rows
            mask = gl.expand_dims(offs_m < M, 1) & col_ok
            offs = gl.expand_dims(m0 + rows, 1) * BN_C + gl.expand_dims(cols, 0)
            tot = gl.load(blk + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for sk in range(1, SPLIT_K):
                tot += gl.load(blk + sk * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += bias
            y_ptrs = y_ptr + gl.expand_dims(offs_m, 1) * stride_ym + gl.expand_dims(col0 + cols, 0)
            gl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _producer(x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                  off_m, off_n, k_tile0, n_iter, PROBE: gl.constexpr = 0, PDL: gl.constexpr = False):
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        NBYTES: gl.constexpr = (x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
        i0 = 0
        if PDL:
            # as _producer_g, the first slots' weight copies go out before griddepcontrol.wait (they do
            # not depend on the x-prep kernel), x's after it (a copy of _producer_g's lines: calling one from the
            # other changed the GPU-checked small-M PDL build's SASS)
            n_pre = gl.minimum(n_iter, STAGES)
            for i in range(n_pre):  # fresh slots: no empty wait
                bar = ready.index(i)
                mbarrier.expect(bar, NBYTES)
                kt = k_tile0 + i
                tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(i))
                tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(i))
                tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(i))
            _gdc_wait()
            for i in range(n_pre):
                tma.async_copy_global_to_shared(x_desc, [off_m, (k_tile0 + i) * BK], ready.index(i), x_bufs.index(i))
            i0 = n_pre
        for i in range(i0, n_iter):
            s = i % STAGES
            # the slot's previous contents (K tile i - STAGES) have been released by both consumers
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if PROBE == 2 or PROBE == 4 or PROBE == 5:
                # timing probe "compute only": the ring is loaded once, later tiles reuse the stale slots
                kt = k_tile0 + i
                if i < STAGES:
                    mbarrier.expect(bar, NBYTES)
                    tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], bar, x_bufs.index(s))
                    tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(s))
                    tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(s))
                    tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(s))
                else:
                    mbarrier.arrive(bar)
            elif PROBE == 3:
                # timing probe "no x": only the weight, scale and zero tiles are loaded (x slots stay stale)
                mbarrier.expect(bar, NBYTES - x_desc.block_type.nbytes)
                kt = k_tile0 + i
                tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(s))
                tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(s))
                tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(s))
            else:
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
                            DRAIN_IN_LOOP: gl.constexpr = False, SPLIT_CHUNKED: gl.constexpr = False,
                            INFLIGHT: gl.constexpr = 1, PROBE: gl.constexpr = 0, NCONS: gl.constexpr = 2,
                            KPAIRS: gl.constexpr = False, PDL: gl.constexpr = False,
                            SPLIT_REGMAJOR: gl.constexpr = False):
        BK: gl.constexpr = x_desc.block_type.shape[1]
        # four consumers: four column slices of BN / 4, or (KPAIRS) two column slices x two K parities
        if KPAIRS:
            BN_C: gl.constexpr = BN // 2
        else:
            BN_C: gl.constexpr = BN // NCONS
        gl.static_assert(NCONS == 2 or NCONS == 4, "2 or 4 consumer warpgroups")
        gl.static_assert(not KPAIRS or (NCONS == 4 and USE_SPLIT), "K pairs: four consumers, split-K workspace")
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
            # one arrival per consumer warpgroup that reads the slot (K pairs: the two of its parity)
            mbarrier.init(empty.index(st), count=2 if KPAIRS else NCONS)

        tile_id = pid
        if KPAIRS:
            gl.warp_specialize([
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 2, 0)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 2, 0)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 2, 1)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 2, 1)),
                (_producer, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                             off_m, off_n, k_tile0, n_iter, PROBE)),
            ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        elif NCONS == 2:
            gl.warp_specialize([
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 1, 0, PDL, SPLIT_REGMAJOR)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, 2, 1, 0, PDL, SPLIT_REGMAJOR)),
                (_producer, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                             off_m, off_n, k_tile0, n_iter, PROBE, PDL)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            # four consumer warpgroups (16 warps, 4 per scheduler) share each x tile
            gl.warp_specialize([
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, NCONS)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, NCONS)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             2, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, NCONS)),
                (_consumer, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_ym, MAGIC2, OFFSET, off_m, off_n, n_iter, tile_id, pid_k, SPLIT_K,
                             3, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DRAIN_IN_LOOP, SPLIT_CHUNKED,
                             INFLIGHT, PROBE, NCONS)),
                (_producer, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                             off_m, off_n, k_tile0, n_iter, PROBE)),
            ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


    # ------------------------------------------------------------------------------------------------------------
    # Small-M variant (opt-in: gluon_w4a16_mm(..., deq="group" / "xsum", pdl=True); GPU-checked).
    # A separate kernel so that the builds of the measured configs above stay byte-identical.
    # ------------------------------------------------------------------------------------------------------------
    @gluon.jit
    def _gdc_wait():
        """``griddepcontrol.wait``: block until the preceding grid (the x-prep kernel) has completed and its writes
        are visible (programmatic dependent launch; returns at once when the kernel was not launched with PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

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
    def _code_pairs(words, j: gl.constexpr, zz, MAGIC2, IS_BF16: gl.constexpr, DEQ: gl.constexpr):
        """Pair words of nibbles j and j + 4: ``OFFSET + q`` (DEQ 2) or ``q - z`` (DEQ 1, one packed sub)."""
        t = ((words >> (4 * j)) & 0x000F000F) | MAGIC2
        if DEQ == 1:
            if IS_BF16:
                t = gl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [t, zz], dtype=gl.int32,
                                              is_pure=True, pack=1)
            else:
                t = gl.inline_asm_elementwise("sub.rn.f16x2 $0, $1, $2;", "=r,r,r", [t, zz], dtype=gl.int32,
                                              is_pure=True, pack=1)
        return t

    @gluon.jit
    def _codes_chunk(words, zz, MAGIC2, BN_C: gl.constexpr, KC: gl.constexpr, R: gl.constexpr,
                     IS_BF16: gl.constexpr, DEQ: gl.constexpr, a_layout: gl.constexpr):
        """Like ``_dequant_chunk`` (same register relabeling), but without the scale: DEQ 1 ("group") gives the
        integers ``q - z`` (one ``sub.rn`` per two weights, exact: both terms are OFFSET + a 4-bit integer),
        DEQ 2 ("xsum") gives ``OFFSET + q`` (the pair words as they are, no floating-point instruction)."""
        if DEQ == 1:
            zz, _ = gl.broadcast(zz, words)
        d0 = _code_pairs(words, 0, zz, MAGIC2, IS_BF16, DEQ)
        d1 = _code_pairs(words, 1, zz, MAGIC2, IS_BF16, DEQ)
        d2 = _code_pairs(words, 2, zz, MAGIC2, IS_BF16, DEQ)
        d3 = _code_pairs(words, 3, zz, MAGIC2, IS_BF16, DEQ)
        return _pairs_to_a_operand(d0, d1, d2, d3, BN_C, KC, R, IS_BF16, a_layout)

    @gluon.jit
    def _fold(acc, part, s_rows, z_rows, xs_cols, DEQ: gl.constexpr):
        """acc += the finished K tile's partial product, scaled (and zero-corrected for "xsum") per weight column."""
        if DEQ == 1:
            return acc + part * s_rows
        else:
            return acc + (part - z_rows * xs_cols) * s_rows

    @gluon.jit
    def _small_tile(i, j, n_iter, acc, part, s_prev, z_prev, xs_prev, xs_row, m_idx, M, x_bufs, q_bufs, s_bufs,
                    z_bufs, ready, empty, MAGIC2, OFFSET, C: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                    R: gl.constexpr, NCHUNK: gl.constexpr, STAGES: gl.constexpr, IS_BF16: gl.constexpr,
                    DT: gl.constexpr, DEQ: gl.constexpr, acc_layout: gl.constexpr, a_layout: gl.constexpr,
                    w_layout: gl.constexpr):
        """One K tile of the small-M consumers: ring slot of use ``i``, the ``j``-th of ``n_iter`` tiles of this
        output tile (split-K: i = j; stream-K: i runs on across the CTA's tiles). Returns the carried state."""
        s = i % STAGES
        if DEQ == 2:
            # sums of x over this K tile (from _prep_x), one fp32 per activation row: issued before the wait
            xs_cur = gl.expand_dims(gl.load(xs_row + j, mask=m_idx < M, other=0.0), 0)
        else:
            xs_cur = xs_prev
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        sc = s_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)  # [1, BN_C]
        zr = z_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)
        s_cur = _rows_for_acc(sc.to(gl.float32), BN_C, R, acc_layout)
        if DEQ == 1:
            zz = _pair_bits((zr.to(gl.float32) + OFFSET).to(DT))  # OFFSET + zero, exact for integer zeros
            z_cur = z_prev
        else:
            zz = MAGIC2  # unused
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
            a = _codes_chunk(words, zz, MAGIC2, BN_C, KC, R, IS_BF16, DEQ, a_layout)
            if cq == 0:
                # tile i - 1's last wgmma group ran during the loop back edge, the ready wait and the loads;
                # retire it, fold its partial, release its slot, start tile i's partial (use_acc=False).
                # ptxas hoists this wait above chunk 0's dequantization (no dependency); a second wgmma
                # accumulator kept in flight across the fold makes ptxas serialize every wgmma (C7514: an
                # accumulator read while any wgmma is in flight), so one group per tile is not overlapped
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
                acc = _fold(acc, part, s_prev, z_prev, xs_prev, DEQ)
                fence_async_shared()
                mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=j > 0)
                part = warpgroup_mma(a, xt.slice(0, KC, dim=0), part, use_acc=False, is_async=True)
            else:
                part = warpgroup_mma(a, xt.slice(cq * KC, KC, dim=0), part, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
        s_prev = s_cur
        z_prev = z_cur
        xs_prev = xs_cur
        if j == n_iter - 1:
            # the last tile: retire and fold INSIDE the loop, so the epilogue never reads a wgmma register
            # (docs/kernels.md, "Epilogue hazard")
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = _fold(acc, part, s_cur, z_cur, xs_cur, DEQ)
        return acc, part, s_prev, z_prev, xs_prev

    @gluon.jit
    def _consumer_g(x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                    M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id, pid_k,
                    SPLIT_K, C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                    HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr, DEQ: gl.constexpr,
                    PDL: gl.constexpr):
        """``_consumer`` with the scale (and for DEQ 2 the zero) applied per K tile (= group) to a per-tile fp32
        partial product instead of per weight (docs/kernels.md, "Small-M variant"). The last wgmma of tile i
        stays in flight while chunk 0 of tile i + 1 is dequantized; then ``warpgroup_mma_wait(0)``, the fold of
        tile i's partial into ``acc``, the release of tile i's slot, and chunk 0's wgmma with ``use_acc=False``."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        if IS_BF16:
            DT: gl.constexpr = gl.bfloat16
        else:
            DT: gl.constexpr = gl.float16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * R], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 4], order=[0, 1])
        if PDL:
            _gdc_wait()  # xs, bias, the split-K workspace and counters: only after the preceding grid
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
                i, i, n_iter, acc, part, s_prev, z_prev, xs_prev, xs_row, m_idx, M, x_bufs, q_bufs, s_bufs, z_bufs,
                ready, empty, MAGIC2, OFFSET, C, BN_C, KC, R, NCHUNK, STAGES, IS_BF16, DT, DEQ, acc_layout, a_layout,
                w_layout)

        # ---- epilogue: as in _consumer
        _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, tile_id, pid_k,
                  SPLIT_K, C, BM, BN_C, R, HAS_BIAS, USE_SPLIT)

    @gluon.jit
    def _producer_g(x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                    off_m, off_n, k_tile0, n_iter, PDL: gl.constexpr):
        """``_producer``; with PDL the weight copies (packed codes, scales, zeros) of the first ring slots are issued
        BEFORE ``griddepcontrol.wait`` (they do not depend on the prep kernel), x's after it."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        NBYTES: gl.constexpr = (x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
        i0 = 0
        if PDL:
            n_pre = gl.minimum(n_iter, STAGES)
            for i in range(n_pre):  # fresh slots: no empty wait needed
                bar = ready.index(i)
                mbarrier.expect(bar, NBYTES)
                kt = k_tile0 + i
                tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(i))
                tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(i))
                tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(i))
            _gdc_wait()
            for i in range(n_pre):
                tma.async_copy_global_to_shared(x_desc, [off_m, (k_tile0 + i) * BK], ready.index(i), x_bufs.index(i))
            i0 = n_pre
        for i in range(i0, n_iter):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            kt = k_tile0 + i
            tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], bar, x_bufs.index(s))
            tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(s))
            tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(s))
            tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(s))

    # integer arguments not specialized (M == 1, divisibility of M / K tiles / splits): one build per config, bias,
    # split and dtype (the offline builds of compile_offline carry no specialization either)
    @gluon.jit(do_not_specialize=["M", "K_TILES", "TILES_PER_SPLIT", "SPLIT_K"])
    def _w4a16_gluon_small_kernel(x_desc, q_desc, s_desc, z_desc, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                                  M, N, K_TILES, TILES_PER_SPLIT, SPLIT_K, stride_ym, MAGIC2, OFFSET,
                                  BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
                                  HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, IS_BF16: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DEQ: gl.constexpr,
                                  PDL: gl.constexpr):
        """``_w4a16_gluon_kernel`` with ``_consumer_g`` / ``_producer_g`` (DEQ 0: per-weight sub + mul as
        ``_consumer`` is NOT offered here; use the main kernel)."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN_C: gl.constexpr = BN // 2
        gl.static_assert(BK == 128, "one ring stage = one group of 128")
        gl.static_assert(BN_C % 64 == 0, "each consumer warpgroup needs a multiple of 64 weight columns")
        gl.static_assert(BK % KC == 0 and KC % 32 == 0, "KC: a multiple of 32 dividing 128")
        gl.static_assert(DEQ == 1 or DEQ == 2, "DEQ: 1 (group) or 2 (xsum)")

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
            (_consumer_g, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                           M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id, pid_k,
                           SPLIT_K, 0, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DEQ, PDL)),
            (_consumer_g, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                           M, N, K_TILES, stride_ym, MAGIC2, OFFSET, off_m, off_n, k_tile0, n_iter, tile_id, pid_k,
                           SPLIT_K, 1, BM, BN_C, KC, HAS_BIAS, USE_SPLIT, IS_BF16, DEQ, PDL)),
            (_producer_g, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                           off_m, off_n, k_tile0, n_iter, PDL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    # ------------------------------------------------------------------------------------------------------------
    # Stream-K schedule (opt-in: gluon_w4a16_mm(..., schedule="streamk"); GPU-checked). A separate
    # kernel again: every build above stays byte-identical. Module docstring, "Stream-K schedule".
    # ------------------------------------------------------------------------------------------------------------
    @gluon.jit
    def _sk_start(p, TOTAL, NUM_CTAS):
        """First work unit (output tile x K tile, K tile fastest) of CTA p: floor(p TOTAL / NUM_CTAS), so the
        ranges differ in length by at most one unit (host: TOTAL x NUM_CTAS < 2^31)."""
        return (p * TOTAL) // NUM_CTAS

    @gluon.jit
    def _sk_owner(u, TOTAL, NUM_CTAS):
        """The CTA whose range holds work unit u: the largest p with floor(p TOTAL / NUM_CTAS) <= u."""
        return ((u + 1) * NUM_CTAS - 1) // TOTAL

    @gluon.jit
    def _sk_segment_epilogue(acc, acc_layout: gl.constexpr, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym,
                             off_m, off_n, t, pid, K_TILES, TOTAL, NUM_CTAS, C: gl.constexpr, BM: gl.constexpr,
                             BN_C: gl.constexpr, R: gl.constexpr, HAS_BIAS: gl.constexpr):
        """A finished segment (the K tiles of output tile t that this CTA owns): the whole tile -> y directly;
        else the partial goes to workspace slice ``pid - owner(first unit of t)`` and the per-(tile, consumer)
        counter counts up to the number of CTAs that own a part of t (known from the schedule); the last one to
        arrive sums the slices, adds the bias, writes y and resets the counter (``_epilogue``'s split path)."""
        first = _sk_owner(t * K_TILES, TOTAL, NUM_CTAS)
        n_contrib = _sk_owner((t + 1) * K_TILES - 1, TOTAL, NUM_CTAS) - first + 1
        # the direct path is a second inlined epilogue: with more than 16 fp32 accumulators per thread ptxas then
        # spills (offline sm_90: BM 32 x BN 256 24 bytes, BM 64 x BN 128 16-24, BM 64 x BN 256 about 700), so there
        # a whole tile also goes through the workspace (one contributor: its counter bump reads 0 = SPLIT_K - 1)
        DIRECT: gl.constexpr = BN_C * BM // 128 <= 16
        if DIRECT and n_contrib == 1:
            _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, t, 0,
                      1, C, BM, BN_C, R, HAS_BIAS, False)
        else:
            _epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n, t,
                      pid - first, n_contrib, C, BM, BN_C, R, HAS_BIAS, True)

    @gluon.jit
    def _consumer_sk(x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                     M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                     C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                     HAS_BIAS: gl.constexpr, IS_BF16: gl.constexpr, DRAIN_IN_LOOP: gl.constexpr):
        """``_consumer`` over the CTA's unit range [u0, u1): one segment per output tile it touches; the ring
        position runs on across segments (no restart), each segment ends with the drained accumulator going to
        ``_sk_segment_epilogue``."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        if IS_BF16:
            DT: gl.constexpr = gl.bfloat16
        else:
            DT: gl.constexpr = gl.float16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * R], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 4], order=[0, 1])
        num_pid_m = gl.cdiv(M, BM)
        i0 = 0  # ring position of the segment's first K tile
        for t in range(u0 // K_TILES, (u1 - 1) // K_TILES + 1):
            n_iter = gl.minimum(u1, (t + 1) * K_TILES) - gl.maximum(u0, t * K_TILES)
            off_m = (t % num_pid_m) * BM
            off_n = (t // num_pid_m) * (2 * BN_C)
            acc = gl.zeros([BN_C, BM], gl.float32, acc_layout)
            gl.assume(n_iter > 0)  # as in _consumer (C7515 otherwise)
            for j in range(n_iter):
                i = i0 + j
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                sc = s_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)
                zr = z_bufs.index(s).slice(C * BN_C, BN_C, dim=1).load(w_layout)
                ss = _pair_bits(sc)
                zz = _pair_bits((zr.to(gl.float32) + OFFSET).to(DT))
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
                    a = _dequant_chunk(words, zz, ss, MAGIC2, BN_C, KC, R, IS_BF16, a_layout)
                    acc = warpgroup_mma(a, xt.slice(cq * KC, KC, dim=0), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    if cq == 0:
                        # every wgmma of the segment's previous K tile is done: release its slot (the
                        # previous segment's last slot was released at that segment's end)
                        fence_async_shared()
                        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=j > 0)
                if DRAIN_IN_LOOP:
                    if j == n_iter - 1:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))  # "Epilogue hazard"
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            # the segment's last slot: all its wgmmas are done; release it now (the producer is already filling
            # the next segment's K tiles into the other slots: the ring is not drained between tiles)
            fence_async_shared()
            mbarrier.arrive(empty.index((i0 + n_iter - 1) % STAGES))
            i0 += n_iter
            _sk_segment_epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n,
                                 t, pid, K_TILES, TOTAL, NUM_CTAS, C, BM, BN_C, R, HAS_BIAS)

    @gluon.jit
    def _consumer_g_sk(x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                       M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                       C: gl.constexpr, BM: gl.constexpr, BN_C: gl.constexpr, KC: gl.constexpr,
                       HAS_BIAS: gl.constexpr, IS_BF16: gl.constexpr, DEQ: gl.constexpr, PDL: gl.constexpr):
        """``_consumer_g`` (scale / zero applied per K tile to an fp32 partial) over the CTA's unit range, one
        segment per output tile as ``_consumer_sk``."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        R: gl.constexpr = BN_C // 64
        NCHUNK: gl.constexpr = BK // KC
        if IS_BF16:
            DT: gl.constexpr = gl.bfloat16
        else:
            DT: gl.constexpr = gl.float16
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2 * R], threads_per_warp=[4, 8],
                                                  warps_per_cta=[1, 4], order=[0, 1])
        if PDL:
            _gdc_wait()
        num_pid_m = gl.cdiv(M, BM)
        i0 = 0
        for t in range(u0 // K_TILES, (u1 - 1) // K_TILES + 1):
            seg_lo = gl.maximum(u0, t * K_TILES)
            n_iter = gl.minimum(u1, (t + 1) * K_TILES) - seg_lo
            off_m = (t % num_pid_m) * BM
            off_n = (t // num_pid_m) * (2 * BN_C)
            acc = gl.zeros([BN_C, BM], gl.float32, acc_layout)
            part = gl.zeros([BN_C, BM], gl.float32, acc_layout)
            s_prev = gl.zeros([BN_C, 1], gl.float32, acc_layout)
            z_prev = gl.zeros([BN_C, 1], gl.float32, acc_layout)
            xs_prev = gl.zeros([1, BM], gl.float32, acc_layout)
            m_idx = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
            xs_row = xs_ptr + m_idx * K_TILES + (seg_lo - t * K_TILES)
            gl.assume(n_iter > 0)
            for j in range(n_iter):
                acc, part, s_prev, z_prev, xs_prev = _small_tile(
                    i0 + j, j, n_iter, acc, part, s_prev, z_prev, xs_prev, xs_row, m_idx, M, x_bufs, q_bufs, s_bufs,
                    z_bufs, ready, empty, MAGIC2, OFFSET, C, BN_C, KC, R, NCHUNK, STAGES, IS_BF16, DT, DEQ,
                    acc_layout, a_layout, w_layout)
            # the segment's last slot (its wgmmas were retired in the loop's last iteration)
            fence_async_shared()
            mbarrier.arrive(empty.index((i0 + n_iter - 1) % STAGES))
            i0 += n_iter
            _sk_segment_epilogue(acc, acc_layout, y_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, off_m, off_n,
                                 t, pid, K_TILES, TOTAL, NUM_CTAS, C, BM, BN_C, R, HAS_BIAS)

    @gluon.jit
    def _sk_unit(u, K_TILES, num_pid_m, BM: gl.constexpr, BN: gl.constexpr):
        """Work unit u -> (off_m, off_n, K tile): tile t = u // K_TILES (M tiles fastest, as the split-K grid)."""
        t = u // K_TILES
        return (t % num_pid_m) * BM, (t // num_pid_m) * BN, u - t * K_TILES

    @gluon.jit
    def _producer_sk(x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                     u0, u1, K_TILES, M, PDL: gl.constexpr):
        """``_producer_g`` over the CTA's unit range [u0, u1): one ring, one running slot index across output-tile
        boundaries (the next tile's copies are issued while the consumers finish the previous one)."""
        STAGES: gl.constexpr = x_bufs.shape[0]
        BK: gl.constexpr = x_bufs.shape[2]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = q_desc.block_type.shape[1]
        NBYTES: gl.constexpr = (x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
        num_pid_m = gl.cdiv(M, BM)
        n_units = u1 - u0
        i0 = 0
        if PDL:
            n_pre = gl.minimum(n_units, STAGES)
            for i in range(n_pre):  # fresh slots: no empty wait needed
                off_m, off_n, kt = _sk_unit(u0 + i, K_TILES, num_pid_m, BM, BN)
                bar = ready.index(i)
                mbarrier.expect(bar, NBYTES)
                tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(i))
                tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(i))
                tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(i))
            _gdc_wait()
            for i in range(n_pre):
                off_m, off_n, kt = _sk_unit(u0 + i, K_TILES, num_pid_m, BM, BN)
                tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], ready.index(i), x_bufs.index(i))
            i0 = n_pre
        for i in range(i0, n_units):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            off_m, off_n, kt = _sk_unit(u0 + i, K_TILES, num_pid_m, BM, BN)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], bar, x_bufs.index(s))
            tma.async_copy_global_to_shared(q_desc, [kt * (BK // 8), off_n], bar, q_bufs.index(s))
            tma.async_copy_global_to_shared(s_desc, [kt, off_n], bar, s_bufs.index(s))
            tma.async_copy_global_to_shared(z_desc, [kt, off_n], bar, z_bufs.index(s))

    @gluon.jit(do_not_specialize=["M", "K_TILES", "TOTAL", "NUM_CTAS"])
    def _w4a16_gluon_sk_kernel(x_desc, q_desc, s_desc, z_desc, y_ptr, bias_ptr, ws_ptr, cnt_ptr, xs_ptr,
                               M, N, K_TILES, TOTAL, NUM_CTAS, stride_ym, MAGIC2, OFFSET,
                               BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
                               HAS_BIAS: gl.constexpr, IS_BF16: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, DRAIN_IN_LOOP: gl.constexpr, DEQ: gl.constexpr,
                               PDL: gl.constexpr):
        """Stream-K: grid = NUM_CTAS (<= TOTAL = output tiles x K tiles); CTA p owns units
        [floor(p TOTAL / NUM_CTAS), floor((p + 1) TOTAL / NUM_CTAS)). DEQ 0: ``_consumer``'s per-weight
        dequantization (``_consumer_sk``); DEQ 1 / 2: the small-M consumer (``_consumer_g_sk``)."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN_C: gl.constexpr = BN // 2
        gl.static_assert(BK == 128, "one ring stage = one group of 128")
        gl.static_assert(BN_C % 64 == 0, "each consumer warpgroup needs a multiple of 64 weight columns")
        gl.static_assert(BK % KC == 0 and KC % 32 == 0, "KC: a multiple of 32 dividing 128")
        gl.static_assert(DEQ == 0 or DEQ == 1 or DEQ == 2, "DEQ: 0 (per weight), 1 (group) or 2 (xsum)")
        gl.static_assert(DEQ > 0 or not PDL, "PDL: small-M consumer only")

        pid = gl.program_id(0)
        u0 = _sk_start(pid, TOTAL, NUM_CTAS)
        u1 = _sk_start(pid + 1, TOTAL, NUM_CTAS)

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        z_bufs = gl.allocate_shared_memory(z_desc.dtype, [STAGES] + z_desc.block_type.shape, z_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=2)

        if DEQ == 0:
            gl.warp_specialize([
                (_consumer_sk, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                                M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                                0, BM, BN_C, KC, HAS_BIAS, IS_BF16, DRAIN_IN_LOOP)),
                (_consumer_sk, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                                M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                                1, BM, BN_C, KC, HAS_BIAS, IS_BF16, DRAIN_IN_LOOP)),
                (_producer_sk, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                                u0, u1, K_TILES, M, False)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_g_sk, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                                  xs_ptr, M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                                  0, BM, BN_C, KC, HAS_BIAS, IS_BF16, DEQ, PDL)),
                (_consumer_g_sk, (x_bufs, q_bufs, s_bufs, z_bufs, ready, empty, y_ptr, bias_ptr, ws_ptr, cnt_ptr,
                                  xs_ptr, M, N, stride_ym, MAGIC2, OFFSET, u0, u1, K_TILES, TOTAL, NUM_CTAS, pid,
                                  1, BM, BN_C, KC, HAS_BIAS, IS_BF16, DEQ, PDL)),
                (_producer_sk, (x_desc, q_desc, s_desc, z_desc, x_bufs, q_bufs, s_bufs, z_bufs, ready, empty,
                                u0, u1, K_TILES, M, PDL)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------
def _smem_bytes(block_m: int, block_n: int, stages: int) -> int:
    per_stage = block_m * GROUP * 2 + (GROUP // 8) * block_n * 4 + 2 * block_n * 2
    return stages * per_stage + 2 * stages * 8 + 1024  # + barriers + alignment slack


def _block_m_for(M: int) -> int:
    return min(max(next_pow2(M), 16), 256)


def _split_for(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    split = max(1, min(k_tiles, round(num_sms / max(n_tiles, 1))))
    return cdiv(k_tiles, cdiv(k_tiles, split))  # balanced: every split gets the same number of K tiles


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
    """Configs whose ``regs="async"`` build was checked offline (sm_90 SASS, bf16 and fp16, split-K on and off):
    no C7512, DEPBAR.LE gsb0 0x1 in the main loop, no spill. Outside it (128 accumulators per thread, or
    64 accumulators + KC = 64 at BM = 64) ptxas still serializes; BM = 128 spills in the split-K epilogue."""
    acc = (block_n // 2) * block_m // 128  # fp32 accumulators per consumer thread
    a_regs = (block_n // 2) * kc // 256  # bf16x2 A-operand registers per thread per chunk
    return acc <= 64 and acc + a_regs <= 80 and (block_m <= 64 or not split)


def gluon_w4a16_configs(M: int, K: int, N: int) -> list[dict]:
    """A handful of candidate configs for this shape (first = default). Keys: block_m, block_n, stages, kc,
    split_k (None = fill the SMs)."""
    bm = _block_m_for(M)
    out: list[dict] = []

    def add(block_m, block_n, stages=None, kc=32, split_k=None, regs=None):
        stages = stages or _max_stages(block_m, block_n)
        cfg = dict(block_m=block_m, block_n=block_n, stages=stages, kc=kc, split_k=split_k)
        if regs is not None:
            # the wrapper runs regs="async" with BM > 64 without split-K (see gluon_w4a16_mm)
            if not _async_regs_ok(block_m, block_n, kc, split_k != 1 and block_m <= 64):
                return
            cfg["regs"] = regs
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
    # regs="async" (wgmma left asynchronous): with the epilogue fix (DRAIN_IN_LOOP) all 72 checked cases passed on
    # the H200 (an H200 check) and the best async tile was 6-10% faster at
    # M = 64 / 256, 13% slower at M = 128 (8192 x 8192), so they are candidates and the tuner decides
    if bm <= 64:
        add(bm, 128, regs="async")
        add(bm, 256, regs="async")
    else:
        add(128, 128, kc=64, regs="async")
        add(128, 128, regs="async")
        add(64, 256, regs="async")
    return out


def gluon_w4a16_async_configs(M: int, K: int, N: int) -> list[dict]:
    """``regs="async"`` configs to check on the GPU after the epilogue fix (docs/kernels.md, "Epilogue hazard"); NOT
    tuner candidates until that check passes. The tiles of the session-6 check (which gave the 5 wrong cases) plus
    BM 128 x BN 128 with KC 64, and, for BM <= 64, the same tiles with ``split_k=1``: the non-split epilogue (where
    the hazard was) then also runs at M = 16 / 64, and the split-K one stays covered by ``split_k=None``."""
    bm = _block_m_for(M)
    out: list[dict] = []

    def add(block_m, block_n, kc=32, split_k=None):
        stages = _max_stages(block_m, block_n)
        if not _async_regs_ok(block_m, block_n, kc, split_k != 1 and block_m <= 64):
            return
        cfg = dict(block_m=block_m, block_n=block_n, stages=stages, kc=kc, split_k=split_k, regs="async")
        if _config_ok(M, K, N, block_m, block_n, stages, kc) and cfg not in out:
            out.append(cfg)

    if bm <= 64:
        for block_n, kc in ((256, 32), (128, 32), (256, 64)):
            add(bm, block_n, kc)
            add(bm, block_n, kc, split_k=1)
    else:
        add(64, 256)
        add(64, 256, split_k=1)
        add(128, 128)
        add(128, 128, kc=64)
    return out


def gluon_w4a16_small_configs(M: int, K: int, N: int) -> list[dict]:
    """Opt-in small-M candidates (M <= 16; docs/kernels.md, "Small-M variant") for the GPU check
    an H200 check; of these only BN 256 xsum without PDL is a tuner candidate. BM 16, the
    ``regs="async"`` split, KC 32, the ring of ``_max_stages``, split-K as ``_split_for``; per tile: BN 256 (M = 1's
    best existing tile) and BN 128 (M = 16's), each with ``deq="xsum"`` and ``deq="group"``, PDL on; plus BN 256 xsum
    without PDL, to separate the two effects. Keys as ``gluon_w4a16_configs`` plus ``deq`` and ``pdl``."""
    if M > 16:
        return []
    out: list[dict] = []
    for block_n, deq, pdl in ((256, "xsum", True), (256, "group", True), (128, "xsum", True),
                              (128, "group", True), (256, "xsum", False)):
        stages = _max_stages(16, block_n)
        cfg = dict(block_m=16, block_n=block_n, stages=stages, kc=32, split_k=None, regs="async", deq=deq, pdl=pdl)
        if _config_ok(M, K, N, 16, block_n, stages, 32) and _async_regs_ok(16, block_n, 32, True):
            out.append(cfg)
    return out


# ----: split-K for the tiles whose standard split epilogue spills (opt-in, offline only so far) -------
# Per K tile of one CTA, cycles at 1.83 GHz, fitted on the session-8 H200 measurements at M = 256
# (docs/kernels.md): serialized builds (default registers, C7512) cost about
# (tensor + issue) x 1.25, async builds max(tensor, issue) x 1.7; tensor = BM x BN / 16 cycles (4096 bf16 flop
# per cycle and SM), issue = 2 consumer warps per scheduler x the loop's instructions per thread (``loop_profile``
# of the offline builds: about 230 at BN/2 = 64 and 380 at BN/2 = 128).
_MODEL_GHZ = 1.83
_MODEL_L2_BYTES_PER_US = 117e3  # one SM's share of L2 bandwidth (64 B per cycle)


def largem_schedule_model(M: int, K: int, N: int, cfg: dict, num_sms: int = _NUM_SMS_DEFAULT) -> dict:
    """Cost model of one config of the per-weight Gluon kernel (``_w4a16_gluon_kernel``), one CTA per SM:
    the grid ``gluon_w4a16_mm`` would launch (split-K as its rules), waves, K tiles per CTA, dequantization work
    (each weight is dequantized once per M tile), the split-K workspace traffic and a time estimate (us). A model,
    not a measurement: see ``docs/kernels.md`` for its fit and its limits."""
    bm, bn = cfg["block_m"], cfg["block_n"]
    regs = cfg.get("regs")
    cons, prod = _regs_for(regs, 232, 40)
    k_tiles = K // GROUP
    m_tiles = cdiv(M, bm)
    n_tiles = m_tiles * (N // bn)
    split = cfg.get("split_k")
    spills = _split_epilogue_spills(bm, bn, cons, prod)
    chunked = spills and split is not None and split > 1
    if split is None:
        split = _split_for(n_tiles, k_tiles, num_sms)
    if spills and not chunked:
        split = 1  # as gluon_w4a16_mm
    split = max(1, min(split, k_tiles))
    tps = cdiv(k_tiles, split)
    split = cdiv(k_tiles, tps)
    ctas = n_tiles * split
    waves = cdiv(ctas, num_sms)
    tensor = bm * bn / 16
    issue = 2 * (230 if bn // 2 == 64 else 380 * (bn // 2) / 128)
    is_async = regs == "async"
    per_kt = max(tensor, issue) * 1.7 if is_async else (tensor + issue) * 1.25
    main_us = waves * tps * per_kt / (_MODEL_GHZ * 1e3)
    part_bytes = bm * bn * 4
    fixup_us = (waves + split) * part_bytes / _MODEL_L2_BYTES_PER_US if split > 1 else 0.0
    return dict(tiles=n_tiles, split=split, ctas=ctas, waves=waves, sm_fill=round(ctas / (waves * num_sms), 3),
                k_tiles_per_cta=tps, dequant_passes=m_tiles, dequant_mweights=round(m_tiles * K * N / 1e6, 1),
                tensor_cycles_per_kt=tensor, issue_cycles_per_kt=issue, cycles_per_kt=round(per_kt),
                ws_mb=round(split * m_tiles * bm * N * 4 / 1e6, 1) if split > 1 else 0.0,
                chunked=chunked and split > 1, model_us=round(main_us + fixup_us, 1))


def _wave_split_for(n_tiles: int, k_tiles: int, num_sms: int = _NUM_SMS_DEFAULT, max_split: int = 4,
                    fixup_kt: float = 0.5) -> int:
    """K split minimizing the critical path in K tiles, waves x K tiles per CTA + split x ``fixup_kt`` (one
    partial written / read costs about half a K tile at BM 256 x BN 128: 131 KB at one SM's L2 share against
    about 1.7 us per K tile); ties go to the smaller split."""
    best, best_cost = 1, None
    for s in range(1, max_split + 1):
        tps = cdiv(k_tiles, s)
        s_eff = cdiv(k_tiles, tps)
        cost = cdiv(n_tiles * s_eff, num_sms) * tps + (s_eff * fixup_kt if s_eff > 1 else 0.0)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s_eff, cost
    return best


def gluon_w4a16_largem_configs(M: int, K: int, N: int, num_sms: int = _NUM_SMS_DEFAULT) -> list[dict]:
    """Opt-in candidates for the M = 256 bucket (``w4a16._gluon_configs`` lists them for the tuner only
    with ``FXOPT_W4A16_GLUON_LARGEM=1`` until their GPU test): the tiles whose standard split-K
    epilogue spills, BM 256 x BN 128 (default registers, KC 32 / 64) and BM 128 x BN 128 (``regs="async"``,
    KC 32 / 64), with an EXPLICIT ``split_k`` >= 2 from ``_wave_split_for``, which makes ``gluon_w4a16_mm`` use the
    chunked fixup (tile-major workspace, ``_split_reduce_chunked``). Listed only where the grid without split is
    below one wave and the split grid stays within two waves (small grids: 8192 x 8192, 4096 x 11008,
    11008 x 4096 at M = 256; not 8192 x 28672, whose 224 tiles already fill 1.7 waves)."""
    bm_bucket = _block_m_for(M)
    out: list[dict] = []
    if bm_bucket != 256 or K % GROUP or N % 128:
        return out
    k_tiles = K // GROUP
    for block_m, block_n, regs in ((256, 128, None), (128, 128, "async")):
        n_tiles = cdiv(M, block_m) * (N // block_n)
        if n_tiles >= num_sms:
            continue
        split = _wave_split_for(n_tiles, k_tiles, num_sms)
        if split < 2 or n_tiles * split > 2 * num_sms:
            continue
        for kc in (32, 64):
            stages = _max_stages(block_m, block_n)
            if not _config_ok(M, K, N, block_m, block_n, stages, kc):
                continue
            cfg = dict(block_m=block_m, block_n=block_n, stages=stages, kc=kc, split_k=split)
            if regs is not None:
                if not _async_regs_ok(block_m, block_n, kc, False):
                    continue
                cfg["regs"] = regs
            out.append(cfg)
    return out


def gluon_w4a16_streamk_configs(M: int, K: int, N: int) -> list[dict]:
    """Opt-in stream-K candidates (docs/kernels.md, "Stream-K schedule") for the GPU check
    an H200 check; NOT tuner candidates (slower on the GPU). M <= 64 (BM <= 64, the
    grids that leave SMs idle or need split-K), ``regs="async"``, KC 32, the ring of ``_max_stages``: BN 256 and
    BN 128 with the per-weight consumer, and for M <= 16 BN 256 with ``deq="xsum"`` + PDL (the small-M consumer).
    Keys as ``gluon_w4a16_small_configs`` plus ``schedule="streamk"`` (``split_k`` stays None)."""
    bm = _block_m_for(M)
    if bm > 64:
        return []
    out: list[dict] = []
    cands = [(256, None, False), (128, None, False)] + ([(256, "xsum", True)] if M <= 16 else [])
    for block_n, deq, pdl in cands:
        stages = _max_stages(bm, block_n)
        cfg = dict(block_m=bm, block_n=block_n, stages=stages, kc=32, split_k=None, regs="async",
                   schedule="streamk")
        if deq is not None:
            cfg.update(deq=deq, pdl=pdl)
        if _config_ok(M, K, N, bm, block_n, stages, 32) and _async_regs_ok(bm, block_n, 32, True):
            out.append(cfg)
    return out


def _streamk_plan(n_tiles: int, k_tiles: int, num_sms: int) -> tuple[int, int]:
    """(CTAs, most CTAs sharing one output tile) of the stream-K schedule: min(num_sms, units) CTAs, CTA p owning
    units [floor(p U / P), floor((p + 1) U / P)) of the U = n_tiles x k_tiles (tile-major) units. Every range has
    L = floor(U / P) or L + 1 units, so a tile (k_tiles consecutive units) meets at most floor((k_tiles - 2) / L)
    + 2 ranges (two partial ones at its ends and whole ones between), and at most P."""
    total = n_tiles * k_tiles
    ctas = max(1, min(num_sms, total))
    if total * ctas >= 2 ** 31:
        raise ValueError(f"gluon_w4a16: stream-K unit indices overflow int32 ({total} units x {ctas} CTAs)")
    if k_tiles == 1:
        return ctas, 1
    return ctas, min(ctas, (k_tiles - 2) // (total // ctas) + 2)


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:  # kept across calls: never from a CUDA-graph pool
        buf = outside_graph_pools(lambda: torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        _COUNTERS[device] = buf
    return buf


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


def _check(x, qweight, scales, zeros, group_size, bias, block_m, block_n, stages, kc, check_zeros):
    if not HAS_GLUON:
        raise ValueError("gluon_w4a16: triton.experimental.gluon is not available in this Triton")
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        raise ValueError("gluon_w4a16: x must be a CUDA tensor")
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError(f"gluon_w4a16: needs sm_90 (Hopper), got {torch.cuda.get_device_capability(x.device)}")
    if x.dtype not in _MAGIC:
        raise ValueError(f"gluon_w4a16: x must be bfloat16 or float16, got {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"gluon_w4a16: qweight must be int32 [K/8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != K or x.dim() not in (2, 3):
        raise ValueError(f"gluon_w4a16: x must be [..., {K}] (2-D or 3-D), got {tuple(x.shape)}")
    if K % GROUP or N % GROUP:
        raise ValueError(f"gluon_w4a16: K ({K}) and N ({N}) must be multiples of {GROUP}")
    if group_size != GROUP:
        raise ValueError(f"gluon_w4a16: only group size {GROUP} is supported, got {group_size}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != x.dtype or tuple(t.shape) != (K // GROUP, N):
            raise ValueError(f"gluon_w4a16: {name} must be {x.dtype} [{K // GROUP}, {N}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"gluon_w4a16: bias must be [{N}], got {tuple(bias.shape)}")
    if not _config_ok(1, K, N, block_m, block_n, stages, kc):
        raise ValueError(f"gluon_w4a16: unsupported config block_m={block_m} block_n={block_n} stages={stages} "
                         f"kc={kc} for N={N} (block_n/2 a multiple of 64 dividing N, block_m*block_n/256 <= 128 "
                         f"accumulators per thread, shared memory {_smem_bytes(block_m, block_n, stages)} B <= "
                         f"{_SMEM_LIMIT})")
    if check_zeros:
        from fxopt.kernels.w4a16 import _integer_zeros

        if not _integer_zeros(zeros):
            raise ValueError("gluon_w4a16: zeros must be integers (the bf16x2 dequantization is exact only then)")
    return K, N


def gluon_w4a16_mm(x, qweight, scales, zeros, group_size: int = GROUP, bias=None, *, block_m: int = 64,
                   block_n: int = 256, stages: int = 4, kc: int = 32, split_k: Optional[int] = None,
                   xp: Optional[torch.Tensor] = None, consumer_regs: int = 232, producer_regs: int = 40,
                   check_zeros: bool = True, num_sms: Optional[int] = None,
                   regs: Optional[str] = None, deq: Optional[str] = None, pdl: bool = False,
                   xs: Optional[torch.Tensor] = None, schedule: Optional[str] = None,
                   inflight: int = 1, probe: int = 0, consumers: int = 2,
                   ws_layout: Optional[str] = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) with the warp-specialized Gluon kernel. ``x`` [..., K] bf16/fp16 CUDA;
    ``qweight`` int32 [K/8, N]; ``scales`` / ``zeros`` [K/128, N] in x's dtype (integer zeros). ``xp``: x already
    in FRAG order (``fxopt.kernels.w4a16._prep_x(x2d, 128, frag=True)[0]``), to skip the prep kernel.
    ``split_k`` None: enough K splits to give the grid about one CTA per SM. ``regs``: None / "default" = the
    ``consumer_regs`` / ``producer_regs`` arguments, "async" = the register split of ``_REGS["async"]`` (wgmma not
    serialized by ptxas; see ``_REGS``). Raises ValueError when unsupported.

    Small-M variant (docs/kernels.md, "Small-M variant"; GPU-checked):
    ``deq="group"`` / ``"xsum"`` runs ``_w4a16_gluon_small_kernel`` (scale, and for "xsum" the zero point, applied
    once per K tile to an fp32 partial instead of per weight); ``pdl=True`` launches it with
    programmatic dependent launch after the x-prep kernel (weight TMAs issued before ``griddepcontrol.wait``;
    assumes the weights are not written by the kernel just before). ``pdl=True`` without ``deq`` does
    the same for the main kernel (two consumers, no ``inflight`` / ``probe``; opt-in, not a tuner candidate). ``xs``: fp32 [M, K/128] sums of x per group
    (``_prep_x``'s second output) when ``xp`` is given with ``deq="xsum"`` (else computed with torch).

    Opt-in stream-K schedule (docs/kernels.md, "Stream-K schedule"; GPU-checked, slower):
    ``schedule="streamk"`` launches ``_w4a16_gluon_sk_kernel`` on ``num_sms`` CTAs (None: the device's SM count),
    each owning an equal contiguous range of (output tile, K tile) units; with ``deq=None`` the per-weight consumer
    (``regs`` as usual), with ``deq`` / ``pdl`` the small-M one. ``split_k`` must be None (the schedule decides).

    ``ws_layout="regmajor"`` (GPU-checked and the tuner's default for the main tiles):
    the split-K partials in a register-major tile workspace (one coalesced 128-byte line per warp store;
    ``_epilogue``), main kernel with two consumers.

    ``inflight`` (docs/kernels.md "Deeper wgmma queue"): wgmma chunk groups each consumer keeps in
    flight while it dequantizes the next chunk (1: the measured builds; 2 or 3 need ``regs="async"``, the main
    kernel and at least that many KC chunks per K tile).

    ``probe`` (timing only, results WRONG; an H200 check): 1 = loads only (the consumers
    release each slot unread), 2 = compute only (the ring is loaded once, later K tiles reuse stale slots),
    3 = no x loads (x slots stale), 4 = as 2 without the dequantization (a constant A operand), 5 = as 4 with A
    read from shared memory (BN 128). Main kernel only.

    ``consumers=4`` (opt-in, docs/kernels.md "Four consumer warpgroups"): 16 consumer warps instead of
    8. BN 256: four 64-column consumer warpgroups share each x tile; BN 128: two column halves x two K parities
    (each pair takes every other K tile; the parities are summed through the split-K workspace). ``regs`` None /
    "four" = 112 / 24 registers. BM <= 64, main kernel, standard split-K only."""
    small = _small_variant(deq, pdl)
    streamk = _streamk_variant(schedule, split_k)
    _inflight_ok(inflight, block_m, block_n, kc, regs, small or streamk)
    if consumers == 4:
        regs = regs or "four"
    _consumers_ok(consumers, block_m, block_n, regs, bool(small or streamk or inflight != 1))
    if ws_layout not in (None, "regmajor") or (ws_layout and (small or streamk or consumers != 2)):
        raise ValueError(f"gluon_w4a16: ws_layout must be None or 'regmajor' (main kernel, two consumers), got "
                         f"{ws_layout!r}")
    if pdl and not small and (streamk or consumers != 2 or inflight != 1 or probe):
        raise ValueError("gluon_w4a16: pdl=True needs deq='group' / 'xsum' (the small-M kernel) or the main kernel "
                         "with two consumers, inflight=1 and no probe")
    if probe not in (0, 1, 2, 3, 4, 5) or (probe and (small or streamk or (probe == 5 and block_n != 128))):
        raise ValueError(f"gluon_w4a16: probe must be 0..5 (5: block_n 128) and only on the main kernel, got "
                         f"{probe!r}")
    consumer_regs, producer_regs = _regs_for(regs, consumer_regs, producer_regs)
    K, N = _check(x, qweight, scales, zeros, group_size, bias, block_m, block_n, stages, kc, check_zeros)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, K)
    M = x2d.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    if small:
        pdl = bool(pdl)
        if xp is None:
            from fxopt.kernels.w4a16 import _prep_x

            xp, xs_p = _prep_x(x2d.contiguous(), GROUP, True, pdl)
            xs = xs_p if xs is None else xs
        elif deq == "xsum" and xs is None:
            xs = x2d.float().reshape(M, K // GROUP, GROUP).sum(-1)
        if deq == "xsum" and (xs.dtype != torch.float32 or tuple(xs.shape) != (M, K // GROUP)):
            raise ValueError(f"gluon_w4a16: xs must be float32 [{M}, {K // GROUP}], got {xs.dtype} "
                             f"{tuple(xs.shape)}")
    if xp is None:
        from fxopt.kernels.w4a16 import _prep_x

        xp, _ = _prep_x(x2d.contiguous(), GROUP, True, bool(pdl))
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    k_tiles = K // GROUP
    n_tiles = cdiv(M, block_m) * (N // block_n)
    if streamk:
        _streamk_config_ok(block_m, block_n, consumer_regs, producer_regs)
        sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        ctas, contrib = _streamk_plan(n_tiles, k_tiles, sms)
        # always a real fp32 workspace: tiles with > 16 accumulators per thread use it even with one owner
        ws = torch.empty((contrib, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, 2 * n_tiles)
        magic, offset = _MAGIC[x.dtype]
        x_desc, q_desc, s_desc, z_desc = make_descriptors(xp, qweight, scales, zeros, block_m, block_n)
        _w4a16_gluon_sk_kernel[(ctas, )](
            x_desc, q_desc, s_desc, z_desc, y, bias if bias is not None else y, ws, cnt,
            xs.contiguous() if deq == "xsum" else ws,
            M, N, k_tiles, n_tiles * k_tiles, ctas, y.stride(0), magic * 0x10001, offset,
            BM=block_m, BN=block_n, STAGES=stages, KC=kc, HAS_BIAS=bias is not None,
            IS_BF16=x.dtype == torch.bfloat16, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
            DRAIN_IN_LOOP=_drain_in_loop(consumer_regs, producer_regs), DEQ=_DEQ[deq] if small else 0, PDL=pdl,
            num_warps=4, maxnreg=_maxnreg(consumer_regs, producer_regs), **({"launch_pdl": True} if pdl else {}),
        )
        return y.reshape(*lead, N)
    # where the standard split-K epilogue spills (offline sm_90 builds), an explicit split_k > 1 selects the chunked
    # fixup; otherwise such tiles run without split-K
    spills = consumers == 2 and _split_epilogue_spills(block_m, block_n, consumer_regs, producer_regs)
    chunked = not small and spills and split_k is not None and split_k > 1
    regmajor = ws_layout == "regmajor" and not chunked
    if split_k is None:
        sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        split_k = _split_for(n_tiles, k_tiles, sms)
    if spills and not chunked:
        split_k = 1
    split_k = max(1, min(split_k, k_tiles))
    tiles_per_split = cdiv(k_tiles, split_k)
    split_k = cdiv(k_tiles, tiles_per_split)
    kpairs = consumers == 4 and block_n == 128
    if kpairs:
        # K pairs: both parities of every slice need a K tile (>= 2 per slice), and the parities are summed
        # through the split-K workspace even without a K split
        if k_tiles < 2:
            raise ValueError(f"gluon_w4a16: consumers=4 with block_n=128 needs K >= {2 * GROUP}, got {K}")
        tiles_per_split = max(tiles_per_split, 2)
        while k_tiles - (cdiv(k_tiles, tiles_per_split) - 1) * tiles_per_split < 2:
            tiles_per_split += 1
        split_k = cdiv(k_tiles, tiles_per_split)
        ws = torch.empty((2 * split_k, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, 2 * n_tiles)
    elif split_k > 1 and (chunked or regmajor):
        # tile-major [split, tiles, 2 consumers, BM x BN/2] (rows past M included; row-major for the chunked
        # fixup, register-major for ws_layout="regmajor"), see _epilogue
        ws = torch.empty((split_k, n_tiles * block_m * block_n), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, 2 * n_tiles)
    elif split_k > 1:
        ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, consumers * n_tiles)
    else:
        ws, cnt = y, y  # unused
    magic, offset = _MAGIC[x.dtype]
    x_desc, q_desc, s_desc, z_desc = make_descriptors(xp, qweight, scales, zeros, block_m, block_n)
    maxnreg = _maxnreg(consumer_regs, producer_regs, consumers)
    if small:
        _w4a16_gluon_small_kernel[(n_tiles, split_k)](
            x_desc, q_desc, s_desc, z_desc, y, bias if bias is not None else y, ws, cnt,
            xs.contiguous() if deq == "xsum" else ws,
            M, N, k_tiles, tiles_per_split, split_k, y.stride(0), magic * 0x10001, offset,
            BM=block_m, BN=block_n, STAGES=stages, KC=kc, HAS_BIAS=bias is not None, USE_SPLIT=split_k > 1,
            IS_BF16=x.dtype == torch.bfloat16, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
            DEQ=_DEQ[deq], PDL=pdl, num_warps=4, maxnreg=maxnreg, **({"launch_pdl": True} if pdl else {}),
        )
        return y.reshape(*lead, N)
    _w4a16_gluon_kernel[(n_tiles, split_k)](
        x_desc, q_desc, s_desc, z_desc, y, bias if bias is not None else y, ws, cnt,
        M, N, k_tiles, tiles_per_split, split_k, y.stride(0), magic * 0x10001, offset,
        BM=block_m, BN=block_n, STAGES=stages, KC=kc, HAS_BIAS=bias is not None, USE_SPLIT=split_k > 1 or kpairs,
        IS_BF16=x.dtype == torch.bfloat16, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        DRAIN_IN_LOOP=_drain_in_loop(consumer_regs, producer_regs), num_warps=4, maxnreg=maxnreg,
        **({"SPLIT_CHUNKED": True} if chunked and split_k > 1 else {}),
        **({"INFLIGHT": inflight} if inflight != 1 else {}),
        **({"PROBE": probe} if probe else {}),
        **({"NCONS": consumers} if consumers != 2 else {}),
        **({"KPAIRS": True} if kpairs else {}),
        **({"PDL": True, "launch_pdl": True} if pdl else {}),
        **({"SPLIT_REGMAJOR": True} if regmajor and split_k > 1 else {}),
    )
    return y.reshape(*lead, N)


# Named register splits (consumer warpgroups, producer warpgroup) for ``regs=``. Same launch limit (maxnreg 168 from
# _maxnreg); Triton gives the default partition what is left of the 3 x 168 per-thread pool (504 - c - p):
# "default" 232/40/232, "async" 200/112/192. Offline sm_90 (Triton 3.6, ptxas 12.8): with the producer warpgroup
# at < 112 registers ptxas serializes every wgmma (C7512, DEPBAR.LE gsb0 0x0 after each HGMMA), whatever the
# consumer value (tried 88..104 with consumers 200..232, and PTX edits of the producer's setmaxnreg from 24 to 104);
# from 112 up (consumers <= 200 to stay in the pool) the main loop keeps one wgmma group in flight
# (DEPBAR.LE gsb0 0x1 once per KC chunk). Only for the configs of ``_async_regs_ok``. Such builds need the in-loop
# final wait (``_drain_in_loop``, docs/kernels.md "Epilogue hazard").
_REGS = {"default": (232, 40), "async": (200, 112), "four": (112, 24)}

# Small-M variant (``_w4a16_gluon_small_kernel``): ``deq=`` names, see the design notes in docs/kernels.md "Small-M variant".
_DEQ = {"group": 1, "xsum": 2}


def _inflight_ok(inflight: int, block_m: int, block_n: int, kc: int, regs: Optional[str],
                 other_kernel: bool) -> None:
    """Raise ValueError unless ``inflight`` is usable (docs/kernels.md, "Deeper wgmma queue"): 1 always; 2 / 3 only
    for the builds checked offline: ``regs="async"``, the main kernel, KC 32 (a K tile's slot is released after
    chunk ``inflight - 1`` of the next tile, and KC 64 has only 2 chunks), BN 128, and BM <= 64 (BM 128: 2 only).
    Elsewhere ptxas serializes the wgmmas (C7512 / C7514) or the SASS has register hazards."""
    if inflight == 1:
        return
    if (inflight not in (2, 3) or regs != "async" or other_kernel or kc != 32 or block_n != 128
            or block_m > 128 or (block_m == 128 and inflight != 2)):
        raise ValueError(f"gluon_w4a16: inflight={inflight!r} is only built for regs='async', the main kernel (no "
                         f"deq, pdl or schedule), kc=32, block_n=128 and block_m <= 64 (2 or 3) or 128 (2); got "
                         f"regs={regs!r} kc={kc} block_n={block_n} block_m={block_m}")


def _consumers_ok(consumers: int, block_m: int, block_n: int, regs: Optional[str], other: bool) -> None:
    """Raise ValueError unless ``consumers`` is usable: 2 always; 4 only as built offline: BN 256 (64
    columns per consumer) or BN 128 (K pairs), BM <= 64, the "four" register split, the main kernel without
    ``inflight``."""
    if consumers == 2:
        return
    if consumers != 4 or block_n not in (128, 256) or block_m > 64 or regs != "four" or other:
        raise ValueError(f"gluon_w4a16: consumers={consumers!r} needs 2, or 4 with block_n 128 / 256, block_m <= 64, "
                         f"regs='four' and the main kernel (no deq, pdl, schedule or inflight); got block_n="
                         f"{block_n} block_m={block_m} regs={regs!r}")


def _small_variant(deq: Optional[str], pdl: bool) -> bool:
    """Whether ``deq`` / ``pdl`` select ``_w4a16_gluon_small_kernel`` (raises ValueError on a bad combination)."""
    if deq is not None and deq not in _DEQ:
        raise ValueError(f"gluon_w4a16: deq must be one of {sorted(_DEQ)} or None, got {deq!r}")
    return deq is not None


_SCHEDULES = ("streamk", )


def _streamk_variant(schedule: Optional[str], split_k: Optional[int]) -> bool:
    """Whether ``schedule`` selects ``_w4a16_gluon_sk_kernel`` (raises ValueError on a bad combination)."""
    if schedule is not None and schedule not in _SCHEDULES:
        raise ValueError(f"gluon_w4a16: schedule must be one of {list(_SCHEDULES)} or None, got {schedule!r}")
    if schedule is not None and split_k is not None:
        raise ValueError("gluon_w4a16: schedule='streamk' decides the K split itself; split_k must be None")
    return schedule is not None


def _streamk_config_ok(block_m: int, block_n: int, consumer_regs: int, producer_regs: int) -> None:
    """Stream-K always carries the split epilogue (partial tiles): the tiles whose split-K epilogue spills are
    refused rather than silently rescheduled (128 fp32 accumulators per thread; BM > 64 with ``regs="async"``)."""
    if (block_n // 2) * block_m // 128 >= 128 or ((consumer_regs, producer_regs) == _REGS["async"] and block_m > 64):
        raise ValueError(f"gluon_w4a16: schedule='streamk' does not support block_m={block_m} block_n={block_n} "
                         f"with these registers (the split epilogue spills)")


def _split_epilogue_spills(block_m: int, block_n: int, consumer_regs: int, producer_regs: int) -> bool:
    """Tiles whose standard split-K epilogue spills (offline sm_90 builds): 128 fp32 accumulators per thread, or
    BM > 64 with the "async" register split. ``gluon_w4a16_mm`` runs them without split-K unless ``split_k`` > 1 is
    given explicitly, which selects the chunked fixup (``SPLIT_CHUNKED``, ``_split_reduce_chunked``)."""
    return ((block_n // 2) * block_m // 128 >= 128
            or ((consumer_regs, producer_regs) == _REGS["async"] and block_m > 64))


def _drain_in_loop(consumer_regs: int, producer_regs: int) -> bool:
    """Whether the build retires its last wgmma inside the K loop (``DRAIN_IN_LOOP``; docs/kernels.md, "Epilogue
    hazard"): every register split except the measured default (232 / 40), whose SASS waits after every HGMMA
    anyway and which is kept byte-identical to the build checked on the H200."""
    return (consumer_regs, producer_regs) != _REGS["default"]


def _regs_for(regs: Optional[str], consumer_regs: int, producer_regs: int) -> tuple[int, int]:
    if regs is None:
        return consumer_regs, producer_regs
    if regs not in _REGS:
        raise ValueError(f"gluon_w4a16: regs must be one of {sorted(_REGS)} or None, got {regs!r}")
    return _REGS[regs]


def _maxnreg(consumer_regs: int, producer_regs: int, consumers: int = 2) -> int:
    """Launch register limit: 12 warps (default consumer, worker consumer, producer padded to a warpgroup) share
    64K registers; Triton then emits ``setmaxnreg`` (consumers ``consumer_regs``, producer ``producer_regs``).
    KNOWN ISSUE (offline sm_90 SASS): with ``setmaxnreg`` in the kernel, ptxas 12.8 serializes every wgmma (C7512
    "insufficient register resources": DEPBAR.LE gsb0 0x0 after each HGMMA). The same PTX with the setmaxnreg lines
    removed keeps one wgmma group in flight (DEPBAR.LE gsb0 0x1, 168 registers, no spill). Requests of (256, 256)
    stop Triton's reallocation but the warp-specialize lowering still emits two setmaxnreg (and ptxas then spills)."""
    if consumer_regs >= 256 and producer_regs >= 256:
        return 168
    if consumers == 4:
        # 20 warps (4 consumer warpgroups + the producer's, padded) get at most 65536 / (20 x 32) =
        # 102 registers each at launch: 96, a pool of 20 x 96 per lane; the default partition (consumer 0) gets
        # what the workers leave (3 x 4 x consumer_regs + 4 x producer_regs)
        if 16 * consumer_regs + 4 * producer_regs > 20 * 96:
            raise ValueError(f"gluon_w4a16: four consumers at {consumer_regs} and a producer at {producer_regs} "
                             "registers exceed the 20 x 96 register pool")
        return 96
    return (2 * 4 * consumer_regs + 4 * producer_regs) // 12 // 8 * 8


def compile_offline(M: int, K: int, N: int, cfg: dict, dtype: str = "bf16", split: bool = True,
                    consumer_regs: int = 232, producer_regs: int = 40, bias: bool = False):
    """Compile one config for sm_90 without a GPU (for resource checks); returns the CompiledKernel. ``cfg["regs"]``
    (if present) overrides ``consumer_regs`` / ``producer_regs`` as in ``gluon_w4a16_mm``. ``bias``: HAS_BIAS.
    Check the result with ``wgmma_sass_hazards(sass_of(compiled))``."""
    consumer_regs, producer_regs = _regs_for(cfg.get("regs"), consumer_regs, producer_regs)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    bm, bn = cfg["block_m"], cfg["block_n"]
    xp = torch.empty(max(M, 1), K, dtype=tdt)
    qw = torch.empty(K // 8, N, dtype=torch.int32)
    sc = torch.empty(K // GROUP, N, dtype=tdt)
    descs = make_descriptors(xp, qw, sc, sc, bm, bn)
    sig = {"x_desc": mangle_type(descs[0]), "q_desc": mangle_type(descs[1]), "s_desc": mangle_type(descs[2]),
           "z_desc": mangle_type(descs[3]), "y_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K_TILES": "i32", "TILES_PER_SPLIT": "i32", "SPLIT_K": "i32",
           "stride_ym": "i32", "MAGIC2": "i32", "OFFSET": "fp32"}
    consts = dict(BM=bm, BN=bn, STAGES=cfg["stages"], KC=cfg["kc"], HAS_BIAS=bias, USE_SPLIT=split,
                  IS_BF16=dtype == "bf16", CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                  DRAIN_IN_LOOP=_drain_in_loop(consumer_regs, producer_regs))
    kernel = _w4a16_gluon_kernel
    # always given: an offline build with an explicit signature does not fill in constexpr defaults
    consts["INFLIGHT"] = cfg.get("inflight", 1)
    consts["PROBE"] = cfg.get("probe", 0)
    consts["NCONS"] = cfg.get("consumers", 2)
    if cfg.get("pdl") and not cfg.get("deq"):
        consts["PDL"] = True  # the main kernel with PDL
    if cfg.get("ws_layout") == "regmajor" and split:
        consts["SPLIT_REGMAJOR"] = True  # the register-major split-K workspace
    if consts["NCONS"] == 4:
        _consumers_ok(4, bm, bn, cfg.get("regs") or "four", consts["INFLIGHT"] != 1)
        if cfg.get("regs") is None:
            consumer_regs, producer_regs = _REGS["four"]
        consts.update(CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                      DRAIN_IN_LOOP=_drain_in_loop(consumer_regs, producer_regs))
        if bn == 128:
            consts.update(KPAIRS=True, USE_SPLIT=True)
    _inflight_ok(consts["INFLIGHT"], bm, bn, cfg["kc"], cfg.get("regs"),
                 bool(cfg.get("deq") or cfg.get("pdl") or cfg.get("schedule")))
    if split and (cfg.get("split_k") or 0) > 1 and _split_epilogue_spills(bm, bn, consumer_regs, producer_regs):
        consts["SPLIT_CHUNKED"] = True  # as gluon_w4a16_mm with an explicit split_k > 1 on such a tile
    if _streamk_variant(cfg.get("schedule"), cfg.get("split_k")):
        # ``split`` is ignored: the stream-K kernel always has both epilogue paths
        _streamk_config_ok(bm, bn, consumer_regs, producer_regs)
        kernel = _w4a16_gluon_sk_kernel
        sig = dict(list(sig.items())[:8] + [("xs_ptr", "*fp32")] + list(sig.items())[8:])
        del sig["TILES_PER_SPLIT"], sig["SPLIT_K"]
        sig = dict(list(sig.items())[:12] + [("TOTAL", "i32"), ("NUM_CTAS", "i32")] + list(sig.items())[12:])
        del consts["USE_SPLIT"], consts["INFLIGHT"], consts["PROBE"], consts["NCONS"]
        small = _small_variant(cfg.get("deq"), cfg.get("pdl", False))
        consts.update(DEQ=_DEQ[cfg["deq"]] if small else 0, PDL=bool(cfg.get("pdl", False)))
    elif _small_variant(cfg.get("deq"), cfg.get("pdl", False)):
        kernel = _w4a16_gluon_small_kernel
        sig = dict(list(sig.items())[:8] + [("xs_ptr", "*fp32")] + list(sig.items())[8:])
        del consts["DRAIN_IN_LOOP"], consts["INFLIGHT"], consts["PROBE"], consts["NCONS"]  # drained in the loop
        consts.update(DEQ=_DEQ[cfg.get("deq") or "group"], PDL=bool(cfg.get("pdl", False)))
    for k in consts:
        sig[k] = "constexpr"
    src = GluonASTSource(kernel, signature=sig, constexprs=consts)
    opts = {"num_warps": 4, "maxnreg": _maxnreg(consumer_regs, producer_regs, consts.get("NCONS", 2))}
    if cfg.get("pdl"):
        opts["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass_of(compiled) -> str:
    """SASS text (``cuobjdump -sass``, the copy shipped with Triton) of a ``compile_offline`` result."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def wgmma_sass_hazards(sass: str) -> list[tuple[str, str, str]]:
    """CPU-side check of async-wgmma register ordering in sm_90 SASS: (address, instruction, kind) for every
    instruction that touches an in-flight HGMMA group's accumulator registers ("acc") or overwrites its register A
    operand ("A"). Model: a group is the HGMMAs up to one carrying ``gsb0``; ``WARPGROUP.DEPBAR.LE gsb0, n``
    retires all but the n most recent groups. The code is walked in address order (fall-through: a DEPBAR skipped
    by a forward predicated branch counts as executed, right for the DRAIN_IN_LOOP wait, whose skip branch tests
    the back edge's condition, i != n_iter - 1), and each innermost loop (backward branch over HGMMAs) again, from
    the groups in flight at its back edge, with such conditional DEPBARs counted as NOT executed (the iterations
    that loop back); a conditional region without a branch inside is there checked as executed from its start
    (its DEPBARs retire groups for the instructions after them in the region) and then skipped. Not modelled:
    other control flow, shared-memory (ring) ordering."""
    import re

    # HGMMA (16-bit) and QGMMA (8-bit): both have 4 A-operand registers per thread and N / 2 accumulators
    hg = re.compile(r"[HQ]GMMA\.(\d+)x(\d+)x(\d+)\.F32(?:\.\w+)* R(\d+), (?:R(\d+)|gdesc)")
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass)]

    def regs(text):
        return [int(r) for r in re.findall(r"\bR(\d+)\b", text)]

    index = {a: i for i, (a, _) in enumerate(ins)}

    def local(lo, hi):  # no HGMMA or EXIT in ins[lo:hi] (not a partition dispatch, not an out-of-line retry stub)
        return not any(("GMMA" in x or "EXIT" in x) for _, x in ins[lo:hi])

    conditional = set()  # instructions a short forward predicated branch may skip
    region = {}  # straight-line such regions (no branch inside): instruction -> first instruction of its region
    for i, (addr, op) in enumerate(ins):
        m = re.match(r"@!?U?P\d+ BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) > addr and int(m.group(1), 16) in index:
            end = index[int(m.group(1), 16)]
            if local(i + 1, end):
                conditional.update(range(i + 1, end))
                if not any("BRA" in x for _, x in ins[i + 1:end]):
                    region.update((k, i + 1) for k in range(i + 1, end) if k not in region)

    def walk(lo, hi, pending, out, skip_conditional=False):
        acc_now, a_now = set(), set()
        for k in range(lo, hi):
            addr, op = ins[k]
            if skip_conditional and k in region:
                # a straight-line region the looping iterations skip (e.g. the last tile's drain + fold of the
                # small-M consumer): checked as executed from its start, its DEPBARs included, on a copy of the
                # state; the state after it is the skipped path's (regions hold no HGMMA)
                if region[k] == k:
                    r_pending = list(pending)
                r_pending = walk(k, k + 1, r_pending, out)
                continue
            m = hg.search(op)
            if m:
                base = int(m.group(4))
                acc_now |= set(range(base, base + int(m.group(2)) // 2))
                if m.group(5):
                    a_now |= set(range(int(m.group(5)), int(m.group(5)) + 4))
                if "gsb0" in op:
                    pending, acc_now, a_now = pending + [(acc_now, a_now)], set(), set()
                continue
            m = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", op)
            if m and skip_conditional and k in conditional:
                continue
            if m:
                keep = int(m.group(1))
                pending = pending[len(pending) - keep:] if keep else []
                continue
            if not pending:
                continue
            body = op.split(None, 1)[1] if op.startswith("@") else op
            rs = regs(body)
            stores = body.startswith(("ST", "SYNCS", "RED", "BAR", "BRA", "WARPGROUP"))
            dst = set() if stores or not rs else {rs[0]}
            if dst and re.match(r"\S*\.64\b", body):
                dst.add(rs[0] + 1)
            if dst and re.match(r"\S*\.128\b", body):
                dst |= {rs[0] + 1, rs[0] + 2, rs[0] + 3}
            acc = set().union(*(p[0] for p in pending))
            a_ops = set().union(*(p[1] for p in pending))
            if set(rs) & acc:
                out.append((hex(addr), op, "acc"))
            elif dst & a_ops:
                out.append((hex(addr), op, "A"))
        return pending

    out: list = []
    walk(0, len(ins), [], out)
    loops = []  # (first, back edge) of backward branches over HGMMAs, without EXIT (not a retry stub)
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            t = index[int(m.group(1), 16)]
            if not local(t, i + 1) and not any("EXIT" in x for _, x in ins[t:i + 1]):
                loops.append((t, i))
    for t, i in loops:  # innermost only (the warp-specialize dispatch loop encloses whole partitions)
        if not any(t <= t2 and i2 < i for t2, i2 in loops if (t2, i2) != (t, i)):
            walk(t, i + 1, walk(t, i + 1, [], [], True), out, True)
    seen, uniq = set(), []
    for h in out:
        if h[0] not in seen:
            seen.add(h[0])
            uniq.append(h)
    return uniq


def loop_profile(sass: str) -> list[dict]:
    """Per innermost loop over HGMMAs in sm_90 SASS (the consumers' K loops): instructions per iteration by opcode,
    ``static`` (all of the body) and ``dynamic`` (without the straight-line regions a forward predicated branch
    skips on the looping iterations, e.g. the last tile's drain; what one non-final K tile executes)."""
    import collections
    import re

    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            t = index[int(m.group(1), 16)]
            if any("GMMA" in x for _, x in ins[t:i + 1]) and not any("EXIT" in x for _, x in ins[t:i + 1]):
                loops.append((t, i))
    out = []
    for t, i in loops:
        if any(t <= t2 and i2 < i and (t2, i2) != (t, i) for t2, i2 in loops):
            continue
        skipped = set()
        for k in range(t, i):
            m = re.match(r"@!?U?P\d+ BRA (0x[0-9a-f]+)", ins[k][1])
            if m and int(m.group(1), 16) in index and k < index[int(m.group(1), 16)] <= i:
                body = ins[k + 1:index[int(m.group(1), 16)]]
                if not any(("GMMA" in x or "BRA" in x) for _, x in body):
                    skipped.update(range(k + 1, index[int(m.group(1), 16)]))
        ops = [ins[k][1] for k in range(t, i + 1) if k not in skipped]
        cnt = collections.Counter((op.split(None, 1)[1] if op.startswith("@") else op).split()[0].split(".")[0]
                                  for op in ops)
        out.append(dict(static=i - t + 1, dynamic=len(ops), ops=dict(cnt.most_common())))
    return out


# ----: instruction census and per-tile cycle model (pure Python on SASS text; no GPU, no kernel change) ----
# Opcode classes of the census (first token of the opcode, predicate stripped). "alu": the integer ALU pipe, assumed
# half rate on sm_90 (64 lanes / clk / SM = 2 issue cycles per warp instruction on its SMSP); "imad": IMAD on the
# FMA-heavy pipe, also assumed half rate; "half2" (HADD2 / HMUL2 / HFMA2, bf16x2 / f16x2) and "fp32" (FFMA / FADD /
# FMUL) assumed full rate (1 cycle per warp instruction); "uniform": the uniform datapath (descriptor math), which
# takes an issue slot but no vector pipe.
_CENSUS_CLASSES = {
    "hgmma": ("HGMMA", "QGMMA"),
    "alu": ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "SGXT", "PLOP3", "VIADD", "VIADDMNMX", "IABS",
            "FLO", "POPC", "IMNMX", "BMSK", "LOP"),
    "imad": ("IMAD",),
    "half2": ("HADD2", "HMUL2", "HFMA2"),
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP"),
    "cvt": ("F2F", "F2FP", "I2F", "F2I", "I2FP"),
    "smem": ("LDS", "LDSM", "STS"),
    "gmem": ("LDG", "STG", "RED", "ATOM", "ATOMG", "LDC"),
    "tma": ("UTMALDG", "UTMASTG", "UBLKCP"),
    "sync": ("SYNCS", "BAR", "MEMBAR", "FENCE", "WARPGROUP", "DEPBAR", "WARPSYNC"),
    "branch": ("BRA", "BRX", "RET", "CALL"),
}


def _census_class(opcode: str) -> str:
    for cls, names in _CENSUS_CLASSES.items():
        if opcode in names:
            return cls
    if opcode.startswith("U") or opcode == "R2UR":
        return "uniform"
    return "other"


def sass_census(sass: str) -> dict:
    """Per-K-tile instruction census of a warp-specialized W4A16 build from its SASS text (``sass_of``): the consumer
    loops (innermost backward branches over HGMMA / QGMMA, as ``loop_profile``: ``dynamic`` = one non-final K tile,
    i.e. without straight-line regions a forward predicated branch skips) and the producer loop (the innermost loop
    issuing ``UTMALDG``, without HGMMA). Every count is per warp and per loop iteration (= one K tile of the CTA).
    Returns ``{"consumers": [...], "producer": {...} or None}``; each entry has ``total``, the classes of
    ``_CENSUS_CLASSES`` (plus "uniform" and "other"), ``hgmma_shapes`` ({"64x64x16": 8}) and ``ops`` (opcode
    counts). Pure Python: testable on hand-made SASS."""
    import collections
    import re

    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))

    def innermost(pred):
        sel = [(t, i) for t, i in loops if pred([x for _, x in ins[t:i + 1]])]
        return [(t, i) for t, i in sel if not any(t <= t2 and i2 < i and (t2, i2) != (t, i) for t2, i2 in sel)]

    def count(t, i):
        skipped = set()
        for k in range(t, i):
            m = re.match(r"@!?U?P\d+ BRA (0x[0-9a-f]+)", ins[k][1])
            if m and int(m.group(1), 16) in index and k < index[int(m.group(1), 16)] <= i:
                body = ins[k + 1:index[int(m.group(1), 16)]]
                if not any(("GMMA" in x or "BRA" in x) for _, x in body):
                    skipped.update(range(k + 1, index[int(m.group(1), 16)]))
        ops = [(op.split(None, 1)[1] if op.startswith("@") else op) for k, (_, op) in enumerate(ins[t:i + 1], t)
               if k not in skipped]
        names = collections.Counter(op.split()[0].split(".")[0] for op in ops)
        out = dict(total=len(ops), static=i - t + 1, **{c: 0 for c in list(_CENSUS_CLASSES) + ["uniform", "other"]})
        for name, n in names.items():
            out[_census_class(name)] += n
        out["hgmma_shapes"] = dict(collections.Counter(
            m.group(1) for op in ops for m in [re.match(r"[HQ]GMMA\.(\d+x\d+x\d+)", op)] if m))
        out["ops"] = dict(names.most_common())
        return out

    no_exit = lambda body: not any("EXIT" in x for x in body)  # noqa: E731 - not a retry stub / dispatch loop
    consumers = [count(t, i) for t, i in innermost(lambda b: any("GMMA" in x for x in b) and no_exit(b))]
    prod = innermost(lambda b: any("UTMALDG" in x for x in b) and not any("GMMA" in x for x in b) and no_exit(b))
    return dict(consumers=consumers, producer=count(*prod[0]) if prod else None)


# Machine figures of the per-tile model (H200, sm_90). Tensor: dense bf16 wgmma at 4096 FLOP / clk / SM (989 TFLOP/s
# at 1.83 GHz x 132 SMs). DRAM: 4.2 TB/s (the anchors' 1 GiB device copy, 4.23 TB/s). L2 -> SM: 27.5 B / clk / SM
# (about 6.6 TB/s over 132 SMs at 1.83 GHz), scaled from a public H100 PCIe microbenchmark (5.5 TB/s over 114 SMs at
# 1.755 GHz; chipsandcheese, 2023): the least certain figure. Shared memory: 128 B / clk / SM.
_MODEL_TENSOR_FLOP_PER_CLK = 4096
_MODEL_DRAM_TBPS = 4.2
_MODEL_L2_B_PER_CLK = 27.5
_MODEL_SMEM_B_PER_CLK = 128


def tile_cycle_model(census: dict, M: int, K: int, N: int, cfg: dict, us: Optional[float] = None,
                     num_sms: int = _NUM_SMS_DEFAULT, ghz: float = _MODEL_GHZ, t0_us: Optional[float] = None,
                     split_k: Optional[int] = None) -> dict:
    """Cycles per CTA tile iteration (one K tile of 128 for the CTA's [BM, BN] output tile) per SM, per resource, from
    a ``sass_census`` of the build, against the measured time per tile when ``us`` (the op's measured time per call)
    is given. Resources (each a lower bound on the tile time if it were the only limit):

    * ``tensor``: 2 BM BN 128 / 4096 (BM = the wgmma N: rows past M are computed too);
    * ``issue``: the busiest SMSP issues its 2 consumer warps' loop instructions (one warp of each consumer
      warpgroup per SMSP) plus the producer warp's (1 instruction / clk / SMSP);
    * ``alu``: 2 warps x 2 clk per integer-ALU instruction (half-rate assumption); ``fma``: 2 warps x (half2 +
      fp32 + 2 x IMAD) clk;
    * ``smem``: TMA writes of the stage + each consumer's wgmma B reads (the whole x tile, BM x 128 bf16) + the
      consumers' shared loads of packed words, scales and zeros, at 128 B / clk;
    * ``dram``: the packed tile, scale and zero rows (x assumed L2-resident) at this SM's share of 4.2 TB/s
      (active SMs = min(CTAs, SMs));
    * ``l2``: all the stage's bytes (x included: every N tile re-reads it) at 27.5 B / clk / SM.

    Measured: ``tile_clk = (us - t0) * ghz * 1e3 / (K tiles per CTA x waves)``, t0 (fixed cost: the x-prep launch
    and gap ~1.5 us + ring fill ~1 us, + ~1 us of split-K tail, breakdown) by default 2.5 us (+1 with
    split-K). ``split_k`` None: as ``gluon_w4a16_mm`` (``_split_for``; BM > 64 async and 128-accumulator tiles run
    without split-K). ``frac`` = resource cycles / measured tile cycles; ``bound`` = the largest."""
    bm, bn, bk = cfg["block_m"], cfg["block_n"], GROUP
    k_tiles = K // bk
    n_tiles = cdiv(M, bm) * (N // bn)
    if split_k is None:
        split_k = cfg.get("split_k")
    if split_k is None:
        regs = _REGS.get(cfg.get("regs") or "default")
        split_k = 1 if _split_epilogue_spills(bm, bn, *regs) else _split_for(n_tiles, k_tiles, num_sms)
    tps = cdiv(k_tiles, split_k)
    split_k = cdiv(k_tiles, tps)
    ctas = n_tiles * split_k
    waves = cdiv(ctas, num_sms)
    active = min(ctas, num_sms)
    cons = census["consumers"]
    c = {k: sum(x[k] for x in cons) / len(cons) for k in ("total", "alu", "imad", "half2", "fp32", "smem")}
    p = census["producer"] or {"total": 0, "alu": 0}
    stage = bm * bk * 2 + (bk // 8) * bn * 4 + 2 * bn * 2  # x tile + packed tile + scale and zero rows
    w_bytes = (bk // 8) * bn * 4 + 2 * bn * 2
    lds_bytes = (bk // 8) * bn * 4 + 2 * bn * 2  # both consumers' halves of the packed tile, scales, zeros
    res = dict(
        tensor=2 * bm * bn * bk / _MODEL_TENSOR_FLOP_PER_CLK,
        issue=2 * c["total"] + p["total"],
        alu=2 * 2 * c["alu"] + 2 * p["alu"],
        fma=2 * (c["half2"] + c["fp32"] + 2 * c["imad"]),
        smem=(stage + 2 * bm * bk * 2 + lds_bytes) / _MODEL_SMEM_B_PER_CLK,
        dram=w_bytes / (_MODEL_DRAM_TBPS * 1e12 / active / (ghz * 1e9)),
        l2=stage / _MODEL_L2_B_PER_CLK,
    )
    out = dict(M=M, K=K, N=N, block_m=bm, block_n=bn, split_k=split_k, ctas=ctas, waves=waves,
               tiles_per_cta=tps, stage_bytes=stage, weight_bytes=w_bytes,
               clk={k: round(v, 1) for k, v in res.items()}, bound_model=max(res, key=res.get))
    if us is not None:
        t0 = t0_us if t0_us is not None else 2.5 + (1.0 if split_k > 1 else 0.0)
        tile_clk = (us - t0) * ghz * 1e3 / (tps * waves)
        out.update(us=us, t0_us=t0, tile_clk=round(tile_clk, 1),
                   frac={k: round(v / tile_clk, 3) for k, v in res.items()})
    return out


def offline_census(M: int, K: int, N: int, cfg: dict, dtype: str = "bf16", split: bool = True,
                   bias: bool = False) -> dict:
    """``sass_census`` of the offline sm_90 build of ``cfg`` (``compile_offline``; no GPU), plus the PTX ``maxnreg``
    and the number of ``DEPBAR.LE gsb0, 0x1`` (wgmma kept asynchronous)."""
    import re

    c = compile_offline(M, K, N, cfg, dtype, split=split, bias=bias)
    sass = sass_of(c)
    out = sass_census(sass)
    m = re.search(r"\.maxnreg (\d+)", c.asm["ptx"])
    out.update(maxnreg=int(m.group(1)) if m else None, depbar_le1=sass.count("DEPBAR.LE gsb0, 0x1"))
    return out


def offline_report(M: int, K: int, N: int, cfg: dict, dtype: str = "bf16", split: bool = True,
                   bias: bool = False) -> dict:
    """Compile one config for sm_90 (``compile_offline``) and summarize: resource usage (REG / STACK / LOCAL),
    ptxas wgmma-serialization remarks (C7512 / C7514 ...), ``wgmma_sass_hazards`` count, DEPBAR counts and the
    consumer loops' instruction counts per iteration (``loop_profile``) and per weight (one iteration = one K
    tile of 128 x BN/2 weights per consumer warpgroup, 128 threads)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    c = compile_offline(M, K, N, cfg, dtype, split=split, bias=bias)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cub, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cub, "wb") as f:
            f.write(c.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(c.asm["ptx"])
        use = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", cub],
                             capture_output=True, text=True).stdout
        pt = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", "-o", os.devnull, ptx],
                            capture_output=True, text=True)
    sass = sass_of(c)
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
    loops = loop_profile(sass)
    w_per_iter = GROUP * (cfg["block_n"] // 2) // 128
    return dict(reg=int(res.group(1)), stack=int(res.group(2)), local=int(res.group(4)),
                serialized=sorted(set(re.findall(r"\((C75\d\d)\)", pt.stdout + pt.stderr))),
                hazards=len(wgmma_sass_hazards(sass)),
                depbar_le0=sass.count("DEPBAR.LE gsb0, 0x0"), depbar_le1=sass.count("DEPBAR.LE gsb0, 0x1"),
                loops=[dict(lp, per_weight=round(lp["dynamic"] / w_per_iter, 3)) for lp in loops])


if __name__ == "__main__":  # pragma: no cover - offline tooling (no GPU needed)
    import argparse
    import json

    ap = argparse.ArgumentParser(description="offline sm_90 builds of the Gluon W4A16 small-M variant")
    ap.add_argument("--shape", default="16x8192x8192", help="MxKxN for the descriptors")
    ap.add_argument("--json", default=None)
    ap.add_argument("--streamk", action="store_true", help="the stream-K candidates (gluon_w4a16_streamk_configs)")
    args = ap.parse_args()
    M_, K_, N_ = (int(v) for v in args.shape.split("x"))
    base = [dict(block_m=16, block_n=bn, stages=_max_stages(16, bn), kc=32, split_k=None, regs="async")
            for bn in (256, 128)]
    rows = []
    todo = base + gluon_w4a16_small_configs(1, K_, N_)
    if args.streamk:  # split on / off is the same build there
        todo = gluon_w4a16_streamk_configs(1, K_, N_) + gluon_w4a16_streamk_configs(64, K_, N_)
    for cfg in todo:
        for dt in ("bf16", "fp16"):
            for split in ((True, ) if cfg.get("schedule") else (True, False)):
                for bias in (False, True):
                    r = offline_report(M_, K_, N_, cfg, dt, split, bias)
                    rows.append(dict(cfg=cfg, dtype=dt, split=split, bias=bias, **r))
                    lp = "; ".join(f"{x['dynamic']} instr/iter, {x['per_weight']}/weight" for x in r["loops"])
                    print(f"{cfg.get('schedule') or ''} bm{cfg['block_m']} {cfg.get('deq') or 'per-weight'} "
                          f"pdl={cfg.get('pdl', False)} bn{cfg['block_n']} {dt} "
                          f"split={split} bias={bias}: REG {r['reg']} STACK {r['stack']} LOCAL {r['local']} "
                          f"ptxas {r['serialized'] or '-'} hazards {r['hazards']} DEPBAR0/1 {r['depbar_le0']}/"
                          f"{r['depbar_le1']} | {lp}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
