"""GPTQ (Frantar et al., 2022): int4 weights that minimise a linear's output error on calibration inputs.

The layer-wise objective ``||X Wᵀ - X Qᵀ||²`` has the Hessian ``H = 2 XᵀX / n`` in each row of W. Columns are
quantized one at a time and each one's error is spread over the columns not yet quantized through the upper Cholesky
factor of ``H⁻¹``, with lazy batch updates per block, as in the paper's reference code (dead inputs, dampening,
act-order, static or dynamic groups, the ``mse`` range grid: docs/architecture.md, "Quantization"). Scales are
rounded to the stored dtype before use, so the error feedback sees the weights the kernel will dequantize.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import PackedW4, group_params, pack_result, range_params


class HessianAccumulator:
    """``H = 2 XᵀX / n`` over every row of every batch added (``x`` [..., K], any leading shape)."""

    def __init__(self, in_features: int, device=None):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.H.device, dtype=torch.float32)
        self.H.addmm_(x.T, x)
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration rows were added to the Hessian")
        return self.H * (2.0 / self.n)


@dataclass
class QuantResult:
    """One quantized weight: the packed form and its dequantized float [N, K] in the original column order."""

    packed: PackedW4
    weight: torch.Tensor


def round_params(weight: torch.Tensor, group_size: int, sym: bool, scale_dtype: torch.dtype, maxq: int = 15,
                 mse: bool = False):
    """:func:`group_params` with the scale rounded to ``scale_dtype``; ``mse``: the range among [min, max] shrunk by
    ``1 - i/100`` (i < 80) with the least ``sum |q - w|^2.4`` per row and group (the reference code's grid)."""
    tiny = torch.finfo(scale_dtype).tiny
    if not mse:
        scale, zero = group_params(weight, group_size, sym, maxq)
        return scale.clamp(min=tiny).to(scale_dtype).float(), zero
    N, K = weight.shape
    G = K if group_size == -1 else group_size
    w = weight.float().reshape(N, K // G, G)
    wmin, wmax = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    best = torch.full(wmin.shape, float("inf"), device=w.device)
    best_scale, best_zero = torch.ones_like(wmin), torch.zeros_like(wmin)
    for i in range(80):
        p = 1 - i / 100
        scale, zero = range_params(wmin * p, wmax * p, sym, maxq)
        scale = scale.clamp(min=tiny).to(scale_dtype).float()
        q = (torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, maxq) - zero[..., None]) \
            * scale[..., None]
        err = (q - w).abs().pow(2.4).sum(-1)
        better = err < best
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def fake_quantize(weight: torch.Tensor, group_size: int, sym: bool, scale_dtype: torch.dtype = torch.float16,
                  maxq: int = 15):
    """Round-to-nearest: returns (dequantized float32 [N, K], codes uint8 [N, K], scale [N, K//G], zero [N, K//G])."""
    N, K = weight.shape
    G = K if group_size == -1 else group_size
    scale, zero = round_params(weight, G, sym, scale_dtype, maxq)
    w = weight.float().reshape(N, K // G, G)
    codes = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, maxq)
    deq = (codes - zero[..., None]) * scale[..., None]
    return deq.reshape(N, K), codes.reshape(N, K).to(torch.uint8), scale, zero


def rtn_quantize(weight: torch.Tensor, group_size: int = 128, sym: bool = False,
                 scale_dtype: torch.dtype = torch.float16) -> QuantResult:
    """Round-to-nearest baseline in the same result form as :func:`gptq_quantize`."""
    K = weight.shape[1]
    G = K if group_size == -1 else group_size
    deq, codes, scale, zero = fake_quantize(weight, G, sym, scale_dtype)
    return QuantResult(pack_result(codes, scale, zero, G, scale_dtype), deq)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, group_size: int = 128, sym: bool = False,
                  act_order: bool = True, static_groups: bool = False, damp: float = 0.01, block_size: int = 128,
                  scale_dtype: torch.dtype = torch.float16, maxq: int = 15, mse: bool = False) -> QuantResult:
    """GPTQ of ``weight`` [N, K] (linears reading one input stacked along N) for the Hessian ``H`` [K, K]."""
    cdt = torch.float64 if weight.dtype == torch.float64 else torch.float32  # float64 only for reference tests
    W = weight.detach().to(cdt).clone()
    N, K = W.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"group size {group_size} does not divide in_features {K}")
    if tuple(H.shape) != (K, K):
        raise ValueError(f"Hessian must be [{K}, {K}], got {tuple(H.shape)}")
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    H = H.detach().to(device=W.device, dtype=cdt).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    static = None
    if static_groups:
        static = [round_params(W[:, g:g + G], G, sym, scale_dtype, maxq, mse) for g in range(0, K, G)]

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]

    diag = torch.arange(K, device=W.device)
    H[diag, diag] += damp * torch.mean(torch.diag(H))
    Hinv = _upper_cholesky_of_inverse(H)

    Q = torch.zeros_like(W)
    codes = torch.zeros(N, K, dtype=torch.uint8, device=W.device)
    scales = torch.zeros(N, K // G, dtype=torch.float32, device=W.device)
    zeros = torch.zeros_like(scales)
    scale = zero = None
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                g = int(perm[col]) // G if perm is not None else col // G
                scale, zero = static[g][0][:, 0], static[g][1][:, 0]
            elif col % G == 0:
                # the group's G columns as they are now (error-corrected), possibly spilling past this block
                current = W1[:, i:i + G]
                if current.shape[1] < G:
                    current = torch.cat([current, W[:, i2:i2 + G - current.shape[1]]], dim=1)
                s, z = round_params(current, G, sym, scale_dtype, maxq, mse)
                scale, zero = s[:, 0], z[:, 0]
                scales[:, col // G], zeros[:, col // G] = scale, zero
            w = W1[:, i]
            c = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            q = (c - zero) * scale
            codes[:, col] = c.to(torch.uint8)
            Q[:, col] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if static is not None:  # original contiguous groups: store in the original order, no permutation
            codes = codes[:, inv]
            perm = None
    if static is not None:
        scales = torch.cat([s for s, _ in static], dim=1)
        zeros = torch.cat([z for _, z in static], dim=1)
    packed = pack_result(codes, scales, zeros, G, scale_dtype, perm)
    return QuantResult(packed, Q)


def _upper_cholesky_of_inverse(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of ``H⁻¹`` (``H⁻¹ = UᵀU``); raises ValueError if H is not positive definite."""
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        raise ValueError("GPTQ: the dampened Hessian is not positive definite; raise damp")
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info) != 0:
        raise ValueError("GPTQ: the inverse Hessian is not positive definite; raise damp")
    return U


def output_error(weight: torch.Tensor, approx: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(ΔW H ΔWᵀ)``: the summed squared output error of ``approx`` against ``weight`` up to H's scale."""
    D = (approx.float() - weight.float()).to(H.device)
    return float(((D @ H) * D).sum())
