"""W4A16 "dequant_matmul": the packed weight dequantized to a 16-bit W [N, K] by a Triton kernel, then cuBLAS
(above M = 256, ``docs/kernels.md``). ``dequantize_w4_triton`` is also the CUDA path of ``fxopt::dequantize_w4``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxopt.kernels import cdiv
from fxopt.kernels.w4a16.common import MAGIC, fit_block_k
from fxopt.quant.format import PACK


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_wn, stride_wk,
    GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W[n, k] = (q - z) * s for one [BLOCK_K, BLOCK_N] tile (BLOCK_K divides GROUP_SIZE), stored as W [N, K]."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kp = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_n[None, :],
                     other=0)
    g = (pid_k * BLOCK_K) // GROUP_SIZE
    s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    shifts = tl.arange(0, 8) * 4
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    wq = (codes | MAGIC).to(tl.int16).to(w_ptr.dtype.element_ty, bitcast=True)
    wq = tl.reshape(wq, (BLOCK_K, BLOCK_N))
    w = tl.fma(wq.to(tl.float32), s[None, :], -((z + OFFSET) * s)[None, :]).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, w, mask=mask_n[None, :])


def dequantize_w4_triton(qweight, scales, zeros, group_size: int, block_n: int = 64,
                         block_k: int = 128) -> torch.Tensor:
    """W [N, K] (contiguous, scales.dtype) with the Triton dequant kernel (CUDA, or CPU under the interpreter)."""
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size == -1:
        group_size = K
    if scales.dtype not in MAGIC:
        raise ValueError(f"dequantize_w4: scales must be fp16/bf16 for the Triton kernel, got {scales.dtype}")
    bk = fit_block_k(block_k, K, group_size)
    if bk < 8:
        raise ValueError(f"dequantize_w4: group size {group_size} / K {K} not a multiple of 8")
    magic, offset = MAGIC[scales.dtype]
    w = torch.empty((N, K), dtype=scales.dtype, device=qweight.device)
    grid = (K // bk, cdiv(N, block_n))
    _dequant_kernel[grid](
        qweight, scales, zeros, w, N, K,
        qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), w.stride(0), w.stride(1),
        GROUP_SIZE=group_size, MAGIC=magic, OFFSET=offset, BLOCK_N=block_n, BLOCK_K=bk, num_warps=4,
    )
    return w


def launch_dequant_matmul(x2d, qweight, scales, zeros, group_size, bias, cfg=None) -> torch.Tensor:
    """Method "dequant_matmul": ``linear(x, dequantize(W), bias)``."""
    return torch.nn.functional.linear(x2d, dequantize_w4_triton(qweight, scales, zeros, group_size), bias)
