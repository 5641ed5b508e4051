"""Hadamard transform and block quantization of Q, K, V for the FP8 / INT8 attention kernels (Triton).

Q and K times M = H diag(signs) / sqrt(d); Q, K, V quantized with one fp32 scale per 128-row block, V transposed and
not transformed; ``quantize_qkv`` in one launch where it can, else three, the same bits either way.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv, device_capability, outside_graph_pools
from fxopt.kernels._common import INTERPRET, num_sms
from fxopt.kernels.attention.checks import check_qkv

log = logging.getLogger(__name__)

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
QUANT_BLOCK = 128  # rows per quantization block (Q, K, V)
INTERPRET_QBLOCK = 32
HADAMARD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head dims of the attention kernels
DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _fwht(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """x @ H_D for a [ROWS, D] fp32 tile (unnormalised Sylvester Hadamard), log2(D) butterfly stages."""
    for i in tl.static_range(LOG2_D):  # stage i pairs elements 2**i apart
        x4 = tl.reshape(x, [ROWS, D // (2 << i), 2, 1 << i])
        a, b = tl.split(tl.permute(x4, [0, 1, 3, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])
    return x


@triton.jit
def _hadamard_kernel(X, Y, SIGNS, stride_xr, stride_yr, N_ROWS, norm,
                     D: tl.constexpr, LOG2_D: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    row_ok = offs_r[:, None] < N_ROWS
    x = tl.load(X + offs_r[:, None].to(tl.int64) * stride_xr + offs_d[None, :], mask=row_ok, other=0.0)
    y = _fwht(x.to(tl.float32), BLOCK_R, D, LOG2_D)
    signs = tl.load(SIGNS + offs_d)
    y = y * (signs * norm)[None, :]
    tl.store(Y + offs_r[:, None].to(tl.int64) * stride_yr + offs_d[None, :], y.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _quant_kernel(X, XQ, SCALE, SIGNS, XSUM, stride_xz, stride_xh, stride_xs, stride_qz, stride_qh, stride_qs,
                  stride_qd, H, SEQ, N_BLOCKS, norm,
                  HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr, QBLOCK: tl.constexpr, HADAMARD: tl.constexpr,
                  INT8: tl.constexpr = False, SUM_CHUNK: tl.constexpr = 0, HAD_DOT: tl.constexpr = False):
    """Quantize rows [pid * QBLOCK, +QBLOCK) of head (z, h) with one s = amax / 448 (``INT8``: / 127, rounded half
    away from zero) into XQ (any strides: Q / K row-major, V transposed); ``SUM_CHUNK``: also the int8 codes' column
    sums per SUM_CHUNK rows; ``HAD_DOT``: SIGNS is the [D, D] matrix H_D diag(signs), one tensor-core product."""
    pid = tl.program_id(0)
    off_zh = tl.program_id(1)
    off_z = off_zh // H
    off_h = off_zh % H
    offs_r = tl.arange(0, QBLOCK)
    offs_s = pid * QBLOCK + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit math once for the block's base, 32-bit offsets inside it (QBLOCK rows x any row stride, and D rows of
    # the transposed output x S_pad, stay below 2**31)
    row0 = (pid * QBLOCK).to(tl.int64)
    x_base = X + off_z.to(tl.int64) * stride_xz + off_h.to(tl.int64) * stride_xh + row0 * stride_xs
    x = tl.load(x_base + offs_r[:, None] * stride_xs + offs_d[None, :], mask=offs_s[:, None] < SEQ, other=0.0)
    if HADAMARD and HAD_DOT:
        hmat = tl.load(SIGNS + offs_d[:, None] * HEAD_DIM + offs_d[None, :])
        x = tl.dot(x, hmat, out_dtype=tl.float32) * norm
    elif HADAMARD:
        x = _fwht(x.to(tl.float32), QBLOCK, HEAD_DIM, LOG2_D)
        signs = tl.load(SIGNS + offs_d)
        x = x * (signs * norm)[None, :]
    else:
        x = x.to(tl.float32)
    # one flat reduction (per-thread, then shuffles, then across warps) instead of rows then columns
    amax = tl.maximum(tl.max(tl.reshape(tl.abs(x), [QBLOCK * HEAD_DIM], can_reorder=True), 0), 1e-30)
    q_base = XQ + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh + row0 * stride_qs
    q_ptrs = q_base + offs_r[:, None] * stride_qs + offs_d[None, :] * stride_qd
    if INT8:
        xs = x * (127.0 / amax)
        codes = tl.where(xs >= 0, xs + 0.5, xs - 0.5).to(tl.int32)  # the cast truncates toward zero
        codes = tl.minimum(tl.maximum(codes, -127), 127)
        tl.store(q_ptrs, codes.to(tl.int8))
        tl.store(SCALE + off_zh * N_BLOCKS + pid, amax / 127.0)
        if SUM_CHUNK > 0:
            sums = tl.sum(tl.reshape(codes, [QBLOCK // SUM_CHUNK, SUM_CHUNK, HEAD_DIM]), 1)
            chunks = pid * (QBLOCK // SUM_CHUNK) + tl.arange(0, QBLOCK // SUM_CHUNK)
            tl.store(XSUM + off_zh.to(tl.int64) * (N_BLOCKS * (QBLOCK // SUM_CHUNK) * HEAD_DIM)
                     + chunks[:, None] * HEAD_DIM + offs_d[None, :], sums)
    else:
        xq = tl.clamp(x * (448.0 / amax), -448.0, 448.0)
        tl.store(q_ptrs, xq.to(XQ.dtype.element_ty))
        tl.store(SCALE + off_zh * N_BLOCKS + pid, amax / 448.0)


@triton.jit
def _qkv_load_block(X, t, stride_xz, stride_xh, stride_xs, H, SEQ, N_BLOCKS, valid,
                    HEAD_DIM: tl.constexpr, QBLOCK: tl.constexpr):
    """The [QBLOCK, D] tile of quantization block t (= (z * H + h) * N_BLOCKS + row block) of x [B, H, S, D]; rows
    past SEQ (and the whole tile when not ``valid``) read as 0 without touching memory."""
    offs_r = tl.arange(0, QBLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    zh = t // N_BLOCKS
    row0 = (t - zh * N_BLOCKS) * QBLOCK
    z = zh // H
    h = zh - z * H
    x_base = X + z.to(tl.int64) * stride_xz + h.to(tl.int64) * stride_xh + row0.to(tl.int64) * stride_xs
    rows_ok = ((row0 + offs_r) < SEQ) & valid
    return tl.load(x_base + offs_r[:, None] * stride_xs + offs_d[None, :], mask=rows_ok[:, None], other=0.0)


@triton.jit
def _qkv_store_block(y, XQ, SCALE, t, N_BLOCKS, HEAD_DIM: tl.constexpr, QBLOCK: tl.constexpr,
                     TRANSPOSED: tl.constexpr):
    """Quantize block t's fp32 tile y with one scale, exactly as ``_quant_kernel`` does, and store codes + scale.
    y is [QBLOCK, D] (row-major output [B * H * S_pad, D]) or, ``TRANSPOSED``, [D, QBLOCK] (output [B * H, D,
    S_pad]: row d of the tile goes to columns [blk * QBLOCK, +QBLOCK) of row d, 16-byte stores along S)."""
    offs_r = tl.arange(0, QBLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    amax = tl.maximum(tl.max(tl.reshape(tl.abs(y), [QBLOCK * HEAD_DIM], can_reorder=True), 0), 1e-30)
    yq = tl.clamp(y * (448.0 / amax), -448.0, 448.0).to(XQ.dtype.element_ty)
    if TRANSPOSED:
        zh = t // N_BLOCKS
        col0 = (t - zh * N_BLOCKS) * QBLOCK
        q_ptrs = (XQ + zh.to(tl.int64) * (HEAD_DIM * QBLOCK * N_BLOCKS) + col0
                  + offs_d[:, None] * (QBLOCK * N_BLOCKS) + offs_r[None, :])
        tl.store(q_ptrs, yq)
    else:
        tl.store(XQ + t.to(tl.int64) * (QBLOCK * HEAD_DIM) + offs_r[:, None] * HEAD_DIM + offs_d[None, :], yq)
    tl.store(SCALE + t, amax / 448.0)


@triton.jit
def _quant_qkv_kernel(Q, K, V, QQ, KQ, VT, QS, KS, VS, HMAT,
                      stride_qz, stride_qh, stride_qs, stride_kz, stride_kh, stride_ks, stride_vz, stride_vh,
                      stride_vs, HQ, HKV, SEQ_Q, SEQ_K, NB_Q, NB_K, TOTAL_Q, TOTAL_K, TOTAL_V, norm,
                      HEAD_DIM: tl.constexpr, QBLOCK: tl.constexpr, HADAMARD: tl.constexpr,
                      NUM_STAGES: tl.constexpr, V_DOT: tl.constexpr):
    """Block-quantize q, k (row-major, optionally Hadamard-transformed) and v (transposed) in one persistent launch:
    program p walks blocks p, p + P, ... of [V blocks, Q blocks, K blocks] with ``_quant_kernel``'s arithmetic. V:
    a register double buffer (``V_DOT``: V^T = x^T @ I on the tensor cores from a cp.async pipeline); Q / K: one
    cp.async-pipelined loop, the [D, D] transform matrix loaded into shared memory once per program."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # ---- V -> V^T [B, HKV, D, S_pad]
    if V_DOT:
        offs_i = tl.arange(0, QBLOCK)
        ident = (offs_i[:, None] == offs_i[None, :]).to(V.dtype.element_ty)
        for t in tl.range(pid, TOTAL_V, nprog, num_stages=NUM_STAGES, disable_licm=True):
            x = _qkv_load_block(V, t, stride_vz, stride_vh, stride_vs, HKV, SEQ_K, NB_K, True, HEAD_DIM, QBLOCK)
            _qkv_store_block(tl.dot(tl.trans(x), ident, out_dtype=tl.float32), VT, VS, t, NB_K, HEAD_DIM, QBLOCK,
                             True)
    else:
        x = _qkv_load_block(V, pid, stride_vz, stride_vh, stride_vs, HKV, SEQ_K, NB_K, pid < TOTAL_V, HEAD_DIM,
                            QBLOCK)
        for t in tl.range(pid, TOTAL_V, nprog, num_stages=1, disable_licm=True):
            x_next = _qkv_load_block(V, t + nprog, stride_vz, stride_vh, stride_vs, HKV, SEQ_K, NB_K,
                                     t + nprog < TOTAL_V, HEAD_DIM, QBLOCK)
            _qkv_store_block(tl.trans(x.to(tl.float32)), VT, VS, t, NB_K, HEAD_DIM, QBLOCK, True)
            x = x_next
    # ---- Q and K, row-major [B, H, S_pad, D]
    if HADAMARD:
        offs_d = tl.arange(0, HEAD_DIM)
        hmat = tl.load(HMAT + offs_d[:, None] * HEAD_DIM + offs_d[None, :])
    start = (pid + nprog - TOTAL_V % nprog) % nprog  # continue the block sequence where the V loop left off
    for g in tl.range(start, TOTAL_Q + TOTAL_K, nprog, num_stages=NUM_STAGES, disable_licm=True):
        is_k = g >= TOTAL_Q
        t = tl.where(is_k, g - TOTAL_Q, g)
        n_blocks = tl.where(is_k, NB_K, NB_Q)
        x = _qkv_load_block(tl.where(is_k, K, Q), t, tl.where(is_k, stride_kz, stride_qz),
                            tl.where(is_k, stride_kh, stride_qh), tl.where(is_k, stride_ks, stride_qs),
                            tl.where(is_k, HKV, HQ), tl.where(is_k, SEQ_K, SEQ_Q), n_blocks, True, HEAD_DIM, QBLOCK)
        if HADAMARD:
            y = tl.dot(x, hmat, out_dtype=tl.float32) * norm
        else:
            y = x.to(tl.float32)
        _qkv_store_block(y, tl.where(is_k, KQ, QQ), tl.where(is_k, KS, QS), t, n_blocks, HEAD_DIM, QBLOCK, False)


@functools.lru_cache(maxsize=64)
def _signs_cpu(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.float32)


_ON_DEVICE: dict = {}


def _kept_on_device(key, device, make) -> torch.Tensor:
    """``make()`` (a CPU tensor) moved to ``device`` once per ``key`` and device, never into a CUDA-graph pool."""
    device = torch.device(device)
    key = (*key, str(device))
    t = _ON_DEVICE.get(key)
    if t is None:
        t = outside_graph_pools(lambda: make().to(device)) if device.type == "cuda" else make().to(device)
        _ON_DEVICE[key] = t
    return t


def hadamard_signs(d: int, seed: int, device) -> torch.Tensor:
    """The random +-1 diagonal of M = H diag(signs) / sqrt(d), fp32, identical on every device for a seed."""
    return _kept_on_device(("signs", d, int(seed)), device, lambda: _signs_cpu(d, int(seed)))


def _sylvester(d: int, dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(d: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """Dense M = H_d diag(signs) / sqrt(d) (for tests and documentation; the kernels never build it)."""
    return _sylvester(d, dtype) * _signs_cpu(d, seed).to(dtype)[None, :] / math.sqrt(d)


def hadamard_reference(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x @ M along the last dim, butterfly in fp32 (float64 stays float64); returns x's dtype."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform: last dim {d} is not a power of two")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work).reshape(-1, d)
    h = 1
    while h < d:
        y4 = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y4[:, :, 0, :], y4[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    y = y * (hadamard_signs(d, seed, x.device).to(work) / math.sqrt(d))
    return y.reshape(x.shape).to(x.dtype)


def _check_hadamard_input(x):
    d = x.shape[-1] if x.dim() else 0
    if d not in HADAMARD_DIMS:
        raise ValueError(f"hadamard_transform: last dim {d} unsupported (a power of two in {HADAMARD_DIMS})")
    if not x.dtype.is_floating_point:
        raise ValueError(f"hadamard_transform: dtype {x.dtype} is not floating point")


def hadamard_triton(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x @ M along the last dim with the Triton kernel (CUDA, or CPU under TRITONINTERPRET=1)."""
    _check_hadamard_input(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    y2 = y.view(-1, d)
    n = x2.shape[0]
    if n == 0:
        return y
    block_r = 16 if INTERPRET else max(1, min(64, 2048 // d))  # 16 fp32 per thread: no spills on sm_90
    grid = (cdiv(n, block_r),)
    _hadamard_kernel[grid](x2, y2, hadamard_signs(d, seed, x.device), x2.stride(0), y2.stride(0), n,
                           1.0 / math.sqrt(d), D=d, LOG2_D=d.bit_length() - 1, BLOCK_R=block_r, num_warps=4)
    return y


def _qblock():
    return INTERPRET_QBLOCK if INTERPRET else QUANT_BLOCK


def quantize_blocks(x: torch.Tensor, *, hadamard: bool, seed: int = 0, transpose: bool = False,
                    qblock: Optional[int] = None, qdtype=None, sum_chunk: int = 0, fused: bool = True,
                    tensor_core: bool = True):
    """Block-quantize x [B, H, S, D] -> (xq [B, H, S_pad, D] (``transpose``: [B, H, D, S_pad]) in ``qdtype``
    (default e4m3), rows past S zero; scales fp32 [B * H, S_pad / qblock]). int8 with ``sum_chunk``: also the codes'
    column sums per ``sum_chunk`` rows. ``fused`` / ``tensor_core`` False: the per-tensor kernel / the butterflies."""
    qblock = qblock or _qblock()
    qdtype = qdtype or FP8_DTYPE
    int8 = qdtype == torch.int8
    if sum_chunk and (not int8 or qblock % sum_chunk):
        raise ValueError(f"quantize_blocks: sum_chunk={sum_chunk} needs int8 and must divide qblock={qblock}")
    B, H, S, D = x.shape
    if (fused and (tensor_core or not hadamard) and not sum_chunk and not (transpose and hadamard)
            and _fused_quant_ok(x, D, qblock, qdtype, hadamard)):
        outs = _quantize_fused(*((None, None, x) if transpose else (x, None, None)), hadamard=hadamard, seed=seed,
                               qblock=qblock, qdtype=qdtype)
        return outs[2] if transpose else outs[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_blocks = max(1, cdiv(S, qblock))
    s_pad = n_blocks * qblock
    shape = (B, H, D, s_pad) if transpose else (B, H, s_pad, D)
    xq = torch.empty(shape, device=x.device, dtype=qdtype)
    scales = torch.empty((B * H, n_blocks), device=x.device, dtype=torch.float32)
    sqz, sqh = xq.stride(0), xq.stride(1)
    sqs, sqd = (xq.stride(3), xq.stride(2)) if transpose else (xq.stride(2), xq.stride(3))
    had_dot = hadamard and tensor_core and _had_dot_ok(x, D, qblock)
    if had_dot:
        signs = hadamard_dot_matrix(D, seed, x.dtype, x.device)
    else:
        signs = hadamard_signs(D, seed, x.device) if hadamard else scales
    sums = (torch.empty((B * H, s_pad // sum_chunk, D), device=x.device, dtype=torch.int32) if sum_chunk
            else scales)
    if B * H:
        _quant_kernel[(n_blocks, B * H)](x, xq, scales, signs, sums, x.stride(0), x.stride(1), x.stride(2),
                                         sqz, sqh, sqs, sqd, H, S, n_blocks, 1.0 / math.sqrt(D),
                                         HEAD_DIM=D, LOG2_D=D.bit_length() - 1, QBLOCK=qblock,
                                         HADAMARD=bool(hadamard), INT8=int8, SUM_CHUNK=sum_chunk,
                                         HAD_DOT=had_dot, num_warps=_quant_warps(D, hadamard and not had_dot))
    return (xq, scales, sums) if sum_chunk else (xq, scales)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, hadamard: bool, seed: int = 0,
                 qblock: Optional[int] = None, qdtype=None, fused: bool = True):
    """(qq, qs, kq, ks, vt, vs): ``quantize_blocks`` of q and k (Hadamard when ``hadamard``) and of v (transposed, no
    transform), in one ``_quant_qkv_kernel`` launch where ``_fused_quant_ok`` takes them, else three launches."""
    qblock = qblock or _qblock()
    qdtype = qdtype or FP8_DTYPE
    D = q.shape[-1]
    if (fused and q.dim() == 4 and tuple(k.shape) == tuple(v.shape) and k.dim() == 4 and k.shape[-1] == D
            and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
            and _fused_quant_ok(q, D, qblock, qdtype, hadamard)):
        (qq, qs), (kq, ks), (vt, vs) = _quantize_fused(q, k, v, hadamard=hadamard, seed=seed, qblock=qblock,
                                                      qdtype=qdtype)
        return qq, qs, kq, ks, vt, vs
    qq, qs = quantize_blocks(q, hadamard=hadamard, seed=seed, qblock=qblock, qdtype=qdtype, fused=fused)
    kq, ks = quantize_blocks(k, hadamard=hadamard, seed=seed, qblock=qblock, qdtype=qdtype, fused=fused)
    vt, vs = quantize_blocks(v, hadamard=False, transpose=True, qblock=qblock, qdtype=qdtype, fused=fused)
    return qq, qs, kq, ks, vt, vs


def _fused_quant_ok(x: torch.Tensor, D: int, qblock: int, qdtype, hadamard: bool) -> bool:
    """Whether ``_quant_qkv_kernel`` takes x: 16-bit, D a power of two in 16..128 (the shared-memory stages fit), a
    power-of-two qblock >= 16, non-int8 codes, and for the transform ``_had_dot_ok``."""
    if x.dtype not in (torch.float16, torch.bfloat16) or qdtype == torch.int8:
        return False
    if D & (D - 1) or not 16 <= D <= 128 or qblock < 16 or qblock & (qblock - 1):
        return False
    if INTERPRET and x.dtype == torch.bfloat16:  # the interpreter computes bf16 wrongly
        return False
    if x.device.type == "cuda" and (device_capability(x.device)[0] < 9 or (x.device, D) in _FUSED_QUANT_FAILED):
        return False  # sm_8x: ~100 KB of shared memory per SM, below the 144 KB of a D = 128 program
    return not hadamard or _had_dot_ok(x, D, qblock)


_FUSED_QUANT_FAILED: set = set()


def _quant_cfg(D: int) -> tuple[int, int, int, bool]:
    """(num_warps, num_stages, programs per SM, V_DOT) of ``_quant_qkv_kernel``, the winners of a GPU sweep."""
    return (8, 2, 2, True) if D > 64 else (8, 3, 3, False)


def _quantize_fused(q, k, v, *, hadamard: bool, seed: int, qblock: int, qdtype):
    """One ``_quant_qkv_kernel`` launch over any of q, k (row-major outputs) and v (transposed output); a None input
    gets None back. Inputs [B, H, S, D] with any strides (last dim made contiguous); outputs as ``quantize_blocks``."""
    ref = next(t for t in (q, k, v) if t is not None)
    D = ref.shape[-1]
    outs, args = [], []
    for x, transpose in ((q, False), (k, False), (v, True)):
        if x is None:
            outs.append(None)
            args.append((ref, None, None, (0, 0, 0), 1, 0, 1, 0))
            continue
        if x.stride(-1) != 1:
            x = x.contiguous()
        B, H, S, _ = x.shape
        n_blocks = max(1, cdiv(S, qblock))
        s_pad = n_blocks * qblock
        xq = torch.empty((B, H, D, s_pad) if transpose else (B, H, s_pad, D), device=x.device, dtype=qdtype)
        scales = torch.empty((B * H, n_blocks), device=x.device, dtype=torch.float32)
        outs.append((xq, scales))
        args.append((x, xq, scales, (x.stride(0), x.stride(1), x.stride(2)), H, S, n_blocks, B * H * n_blocks))
    (q_, qq, qs, q_str, hq, sq, nbq, tq), (k_, kq, ks, k_str, hk, sk, nbk, tk), \
        (v_, vt, vs, v_str, hv, sv, nbv, tv) = args
    if v is not None and k is not None and (hk, sk, nbk) != (hv, sv, nbv):
        raise ValueError(f"_quantize_fused: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if v is not None:
        hk, sk, nbk = hv, sv, nbv  # k and v share the HKV / SEQ_K / NB_K arguments
    hadamard = bool(hadamard) and tq + tk > 0
    hmat = hadamard_dot_matrix(D, seed, ref.dtype, ref.device) if hadamard else ref
    total = tq + tk + tv
    if total == 0:
        return outs
    warps, stages, per_sm, v_dot = _quant_cfg(D)
    nprog = min(total, 3 if INTERPRET else num_sms(ref.device) * per_sm)
    dummy = outs[0] or outs[1] or outs[2]
    qq, qs = outs[0] or dummy
    kq, ks = outs[1] or dummy
    vt, vs = outs[2] or dummy
    try:
        _quant_qkv_kernel[(nprog,)](q_, k_, v_, qq, kq, vt, qs, ks, vs, hmat, *q_str, *k_str, *v_str, hq, hk, sq,
                                    sk, nbq, nbk, tq, tk, tv, 1.0 / math.sqrt(D), HEAD_DIM=D, QBLOCK=qblock,
                                    HADAMARD=hadamard, NUM_STAGES=stages, V_DOT=v_dot,
                                    num_warps=4 if INTERPRET else warps)
    except triton.runtime.errors.OutOfResources as e:  # a GPU with less shared memory than the H200
        _FUSED_QUANT_FAILED.add((ref.device, D))
        log.warning("fp8 quantization: fused kernel does not fit (%s); per-tensor kernels for D=%d on %s", e, D,
                    ref.device)
        return [None if x is None else quantize_blocks(x, hadamard=hadamard and not t, seed=seed, transpose=t,
                                                       qblock=qblock, qdtype=qdtype)
                for x, t in ((q, False), (k, False), (v, True))]
    return outs


# warps for a [128, D] tile: the butterflies' layout changes need ~2 registers per element (sm_90 builds: no spills
# at D <= 128; a small spill at D = 256)
_QUANT_WARPS = {64: 8, 128: 16, 256: 32}


def _quant_warps(D: int, butterflies: bool) -> int:
    """Warps of one quantization program: many for the butterflies (``_QUANT_WARPS``), else 8 (16 at D = 256)."""
    if INTERPRET:
        return 4
    if butterflies:
        return _QUANT_WARPS.get(D, 4)
    return 8 if D <= 128 else 16


def _had_dot_ok(x: torch.Tensor, D: int, qblock: int) -> bool:
    """Whether the quantization kernel can take the tensor-core transform: 16-bit x (exact operands), 16 <= D <= 128,
    a dot-sized block; not bf16 in the Triton interpreter (it computes bf16 wrongly)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not 16 <= D <= 128 or qblock < 16:
        return False
    return not (INTERPRET and x.dtype == torch.bfloat16)


def hadamard_dot_matrix(d: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """H_d diag(signs) as a contiguous [d, d] matrix in ``dtype`` (entries +-1, exact in 16 bits); x M = (x @ this)
    / sqrt(d). Cached per (d, seed, dtype, device)."""
    return _kept_on_device(("dot", d, int(seed), dtype), device,
                           lambda: (_sylvester(d, torch.float32) * _signs_cpu(d, int(seed))[None, :]).to(dtype)
                           .contiguous())


def check_attn_inputs(q, k, v, scale):
    check_qkv("fp8_attention", q, k, v, DTYPES)
    D = q.shape[3]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"fp8_attention: head dim {D} unsupported (the Hadamard transform and the fp8 kernel "
                         f"support {SUPPORTED_HEAD_DIMS})")
    if scale is not None and not (scale > 0):
        raise ValueError(f"fp8_attention: scale must be > 0, got {scale}")
