"""fxopt's one packed int4 format (W4A16), and the reference math around it.

A linear ``y = x @ W.T`` with ``W`` [N, K] is stored as:

* ``qweight``: int32 [K // 8, N]; nibble j (bits 4j..4j+3) of element (i, n) is the code of W[n, 8i + j] (GPTQ's
  qweight layout);
* ``scales``, ``zeros``: [K // G, N] in the activation dtype (fp16/bf16), G = 32, 64, 128 or K;
  ``W[n, k] = (q - zeros) * scales`` for group k // G (symmetric: zeros = 8);
* ``perm``: optional int64 [K]: the stored rows follow ``perm`` (act-order) and the layer gathers ``x[..., perm]``.

Codes are unsigned 0..15. Why this nibble order: docs/kernels.md; the kernels live in ``fxopt/kernels/w4a16/``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PACK = 8  # int4 codes per int32
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [K, N] (integers 0..15) into int32 [K // 8, N] (nibble j of row i = codes[8i + j])."""
    if codes.dim() != 2 or codes.shape[0] % PACK:
        raise ValueError(f"pack_int4 needs codes [K, N] with K % 8 == 0, got {tuple(codes.shape)}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise ValueError("pack_int4: codes must lie in 0..15")
    c = c.view(-1, PACK, c.shape[1])
    shifts = (torch.arange(PACK, device=c.device) * 4).view(1, PACK, 1)
    packed = (c << shifts).sum(dim=1)  # disjoint bits: sum == bitwise or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # wrap to int32 range
    return packed.to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [K // 8, N] -> uint8 codes [K, N]."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"unpack_int4 needs int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    shifts = (torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4).view(1, PACK, 1)
    codes = (qweight.unsqueeze(1) >> shifts) & 0xF
    return codes.reshape(-1, qweight.shape[1]).to(torch.uint8)


@dataclass
class PackedW4:
    """One quantized weight in fxopt's format (see the module docstring; ``group_size`` -1 becomes K)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.group_size == -1:
            self.group_size = self.in_features
        check_packed(self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def check_packed(qweight, scales, zeros, group_size, perm=None) -> None:
    """Raise ValueError naming the problem if the tensors do not form a valid packed weight."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features {K}")
    G = K // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (G, N):
            raise ValueError(f"{name} must be [{G}, {N}] for K={K}, group {group_size}; got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be fp16/bf16/fp32, got {t.dtype}")
    if zeros.dtype != scales.dtype:
        raise ValueError(f"zeros dtype {zeros.dtype} differs from scales dtype {scales.dtype}")
    if perm is not None and (perm.dim() != 1 or perm.numel() != K):
        raise ValueError(f"perm must be [{K}], got {tuple(perm.shape)}")


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, sym: bool = False,
                 dtype: Optional[torch.dtype] = None) -> PackedW4:
    """Round-to-nearest int4 quantization of ``weight`` [N, K] (the baseline every method is compared to)."""
    scales, zeros = group_params(weight, group_size, sym)
    G = weight.shape[1] if group_size == -1 else group_size
    s, z = scales.repeat_interleave(G, dim=1), zeros.repeat_interleave(G, dim=1)
    codes = torch.clamp(torch.round(weight.float() / s) + z, 0, 15).to(torch.uint8)
    dtype = dtype or (weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    return pack_result(codes, scales, zeros, group_size, dtype)


def pack_result(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                scale_dtype: torch.dtype, perm: Optional[torch.Tensor] = None) -> PackedW4:
    """Codes [N, K] and per-group float params [N, K // G] → :class:`PackedW4` (rows of K in stored order)."""
    return PackedW4(pack_int4(codes.T.contiguous()), scale.T.contiguous().to(scale_dtype),
                    zero.T.contiguous().to(scale_dtype), group_size, perm)


def group_params(weight: torch.Tensor, group_size: int, sym: bool, maxq: int = 15):
    """Per-group (scale, zero) [N, K // G] in float32 from min/max, as RTN/GPTQ/AWQ use them."""
    N, K = weight.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"group size {group_size} does not divide in_features {K}")
    w = weight.float().reshape(N, K // G, G)
    return range_params(w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0), sym, maxq)


def range_params(lo: torch.Tensor, hi: torch.Tensor, sym: bool, maxq: int = 15):
    """(scale, zero) of the grids covering [lo, hi] (lo <= 0 <= hi); symmetric grids are centred on code 8."""
    if sym:
        scale = (2 * torch.maximum(lo.abs(), hi) / maxq).clamp(min=1e-10)
        return scale, torch.full_like(scale, (maxq + 1) / 2)
    scale = ((hi - lo) / maxq).clamp(min=1e-10)
    return scale, torch.round(-lo / scale)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Reference dequantization to W [N, K] (rows of K in stored order, i.e. already permuted if act-order)."""
    K = qweight.shape[0] * PACK
    G = K if group_size == -1 else group_size
    codes = unpack_int4(qweight).float()  # [K, N]
    s = scales.float().repeat_interleave(G, dim=0)
    z = zeros.float().repeat_interleave(G, dim=0)
    w = ((codes - z) * s).T
    return w.to(dtype or scales.dtype)
