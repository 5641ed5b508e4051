"""References of the FP8 / INT8 attention: ``fp8_attention_reference`` (fp32 with e4m3 rounding, the kernels'
blocks), ``int8_attention_reference`` (float64, exact integer products), ``attention_float64`` (the yardstick).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fxopt.kernels.attention.reference import attention_reference

from .quant import FP8_DTYPE, FP8_MAX, QUANT_BLOCK, hadamard_matrix, hadamard_reference

LOG2E = 1.4426950408889634
P_SHIFT = 8.0  # P is stored as p * 2**P_SHIFT in e4m3


def quantize_reference(x: torch.Tensor, granularity: str = "block", qblock: int = QUANT_BLOCK,
                       qdtype=None):
    """Fake-quantize x [B, H, S, D] (fp32 math): returns (x_q as fp32 values of the qdtype grid, scale broadcastable
    to x). granularity: 'block' (one scale per qblock rows of a head, as the kernel), 'tensor' (one scale)."""
    qdtype = qdtype or FP8_DTYPE
    x = x.float()
    if granularity == "tensor":
        amax = x.abs().amax().clamp_min(1e-30)
        inv, scale = 448.0 / amax, amax / 448.0
        return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(qdtype).float(), scale
    if granularity != "block":
        raise ValueError(f"granularity must be 'block' or 'tensor', got {granularity!r}")
    return _blocks(x, qblock, 448.0, lambda xp: xp.clamp(-FP8_MAX, FP8_MAX).to(qdtype).float())


def _blocks(x: torch.Tensor, qblock: int, qmax: float, codes_of):
    """Per block of ``qblock`` rows of a head, scale = amax / qmax: (``codes_of(x / scale)`` [B, H, S, D], scale
    [B, H, S, 1])."""
    B, H, S, D = x.shape
    n = max(1, -(-S // qblock))
    xp = torch.nn.functional.pad(x, (0, 0, 0, n * qblock - S)).reshape(B, H, n, qblock, D)
    amax = xp.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-30)
    codes = codes_of(xp * (qmax / amax))
    scale = (amax / qmax).expand(B, H, n, qblock, 1).reshape(B, H, n * qblock, 1)[:, :, :S]
    return codes.reshape(B, H, n * qblock, D)[:, :, :S], scale


def fp8_attention_reference(q, k, v, is_causal=False, scale=None, hadamard=True, seed=0, *,
                            granularity: str = "block", qblock: int = QUANT_BLOCK, block_n: Optional[int] = None,
                            qdtype=None, quantize_p: bool = True):
    """Emulates the kernel in fp32 with real e4m3 rounding (``qdtype``), any device. Returns q's dtype."""
    qdtype = qdtype or FP8_DTYPE
    block_n = block_n or qblock
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    qf, kf = q.float(), k.float()
    if hadamard:
        qf, kf = hadamard_reference(qf, seed), hadamard_reference(kf, seed)
    q8, qsc = quantize_reference(qf, granularity, qblock, qdtype)
    k8, ksc = quantize_reference(kf, granularity, qblock, qdtype)
    v8, vsc = quantize_reference(v.float(), granularity, qblock, qdtype)
    if group > 1:
        k8, v8 = k8.repeat_interleave(group, 1), v8.repeat_interleave(group, 1)
        if granularity == "block":
            ksc, vsc = ksc.repeat_interleave(group, 1), vsc.repeat_interleave(group, 1)
    if granularity == "tensor":
        ksc = ksc.reshape(1, 1, 1, 1).expand(B, Hq, Sk, 1)
        vsc = vsc.reshape(1, 1, 1, 1).expand(B, Hq, Sk, 1)
    c = qsc * (sm_scale * LOG2E)  # [B, Hq, Sq, 1] or scalar
    qpos = torch.arange(Sq, device=q.device)[:, None]
    m = torch.full((B, Hq, Sq, 1), float("-inf"), device=q.device)
    l = torch.zeros((B, Hq, Sq, 1), device=q.device)
    acc = torch.zeros((B, Hq, Sq, D), device=q.device)
    for n0 in range(0, Sk, block_n):
        n1 = min(n0 + block_n, Sk)
        s = (q8 @ k8[:, :, n0:n1].transpose(-1, -2)) * c * ksc[:, :, n0:n1, 0][:, :, None, :]
        if is_causal:
            kpos = torch.arange(n0, n1, device=q.device)[None, :]
            s = s.masked_fill(kpos > qpos + (Sk - Sq), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - (m_use - P_SHIFT))
        alpha = torch.exp2(m - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        if quantize_p:
            p = p.to(qdtype).float()
        acc = acc * alpha + p @ (v8[:, :, n0:n1] * vsc[:, :, n0:n1])
        m = m_new
    out = acc / torch.where(l == 0, torch.ones_like(l), l)
    return out.to(q.dtype)


def _int8_blocks(x: torch.Tensor, qblock: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of ``qblock`` rows of a head: (codes in [-127, 127] as float64, scale [B, H, S, 1])."""
    return _blocks(x, qblock, 127.0, lambda xp: torch.round(xp).clamp(-127, 127))


def int8_attention_reference(q, k, v, is_causal=False, scale=None, seed=0, *, qblock: int = QUANT_BLOCK,
                             block_n: Optional[int] = None):
    """Emulation of the INT8 design (``int8_attention_triton`` is its kernel; ``docs/kernels.md``, "FP8 attention"),
    its integer products exact in float64."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    M = hadamard_matrix(D, seed, torch.float64).to(q.device)
    qi, qsc = _int8_blocks(q.double() @ M, qblock)
    ki, ksc = _int8_blocks(k.double() @ M, qblock)
    vi, vsc = _int8_blocks(v.double() @ M, qblock)
    if group > 1:
        ki, ksc, vi, vsc = (t.repeat_interleave(group, 1) for t in (ki, ksc, vi, vsc))
    qpos = torch.arange(Sq, device=q.device)[:, None]
    m = torch.full((B, Hq, Sq, 1), float("-inf"), dtype=torch.float64, device=q.device)
    l = torch.zeros((B, Hq, Sq, 1), dtype=torch.float64, device=q.device)
    acc = torch.zeros((B, Hq, Sq, D), dtype=torch.float64, device=q.device)
    block_n = block_n or qblock
    for n0 in range(0, Sk, block_n):
        n1 = min(n0 + block_n, Sk)
        s = (qi @ ki[:, :, n0:n1].transpose(-1, -2)) * (qsc * sm_scale) * ksc[:, :, n0:n1, 0][:, :, None, :]
        s = s.float().double()  # the kernel's scores are fp32
        if is_causal:
            kpos = torch.arange(n0, n1, device=q.device)[None, :]
            s = s.masked_fill(kpos > qpos + (Sk - Sq), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_use).float().double()
        alpha = torch.exp(m - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        u = torch.round(p * 255.0)  # 0..255; the kernel feeds u - 128 and adds 128 * colsum(v block)
        pv = (u - 128.0) @ vi[:, :, n0:n1] + 128.0 * vi[:, :, n0:n1].sum(-2, keepdim=True)
        # all rows of a V block share one scale
        acc = acc * alpha + pv.float().double() * (vsc[:, :, n0:n0 + 1, :] / 255.0)
        m = m_new
    out = acc / torch.where(l == 0, torch.ones_like(l), l)
    return (out @ M.transpose(0, 1)).to(q.dtype)


def attention_float64(q, k, v, is_causal=False, scale=None):
    """Exact attention in float64 (the accuracy yardstick); same causal convention as the kernel."""
    return attention_reference(q, k, v, is_causal=is_causal, scale=scale, compute_dtype=torch.float64)
