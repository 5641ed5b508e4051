"""Host side of the split-KV decode kernels of ``triton_kernels``, for few query rows and long keys (``use_split``).
``docs/kernels.md`` ("Decode").
"""
from __future__ import annotations

import torch

from fxopt.kernels import cdiv, has_pdl, next_pow2
from fxopt.kernels._common import INTERPRET, kept_zeros, num_sms

from .triton_kernels import _attn_combine, _attn_fwd_split

CTAS_PER_SM = 4  # programs per SM the split plan aims for
FUSED_MAX_KV_BYTES = 192 << 20


def use_split(q, k, dropout_p) -> bool:
    """The split-KV decode path: few query rows and long keys, or keys from 256 on when the one-pass kernel would
    give fewer programs than SMs (batch-1 decode over a 640-slot cache: 32 programs, 23 us a layer, cuDNN 9 us)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if dropout_p != 0.0 or Sq > 16 or (Hq // Hkv) * Sq > 128:
        return False
    return Sk >= 1024 or (Sk >= 256 and B * Hq < num_sms(q.device))


def split_plan(B, Hkv, Sk, device, block_n, sms=None):
    """(number of key chunks, chunk length): B * Hkv * chunks fills the GPU ``CTAS_PER_SM`` times over."""
    target = (sms or num_sms(device)) * CTAS_PER_SM
    cap = min(cdiv(Sk, 2 * block_n), 128)
    splits = max(1, min(cdiv(target, B * Hkv), cap))
    split_len = cdiv(cdiv(Sk, splits), block_n) * block_n
    return cdiv(Sk, split_len), split_len


def fused_combine_rule(is_cuda: bool, capturing: bool, kv_bytes: int) -> bool:
    """Fused when launched eagerly on at most 192 MB of K/V: an eager small step is bound by the host (one kernel
    fewer: 1.27 against 0.57 TB/s at B = 8, H = 32, 4k); from a CUDA graph or on more K/V the combine kernel wins."""
    return is_cuda and not capturing and kv_bytes <= FUSED_MAX_KV_BYTES


_LOCKS: dict = {}


def _decode_locks(device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of the fused combine, per (device, stream); under CUDA-graph capture a fresh,
    uncached buffer (its memset replays with the graph; graph-pool memory must not leak to eager calls)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return kept_zeros(_LOCKS, (idx, torch.cuda.current_stream(idx).cuda_stream), n, torch.int32, device, 4096)


def launch_split(q, k, v, o, lse, mask, mstr, kpm, kstr, group, sm_scale, softcap, window, flags, fused=None):
    """Split-KV decode into ``o`` / ``lse``. ``fused``: merge the partials in the split kernel (True), by the
    combine kernel (False), or by ``fused_combine_rule`` (None)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    BLOCK_D = flags["BLOCK_D"]
    BLOCK_R = max(16, next_pow2(group * Sq))
    if INTERPRET:
        block_n, num_warps, num_stages = 16, 4, 1
    else:
        block_n, num_warps, num_stages = (128 if BLOCK_D <= 128 and BLOCK_R <= 64 else 64 if BLOCK_D <= 128 else 32,
                                          4, 3)
    num_splits, split_len = split_plan(B, Hkv, Sk, q.device, block_n)
    # one allocation for both partial buffers (an allocator call costs host microseconds)
    n_o = B * Hq * Sq * num_splits * BLOCK_D
    parts = torch.empty(n_o + B * Hq * Sq * num_splits, device=q.device, dtype=torch.float32)
    opart = parts[:n_o].view(B, Hq, Sq, num_splits, BLOCK_D)
    lpart = parts[n_o:].view(B, Hq, Sq, num_splits)
    if fused is None:
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        fused = fused_combine_rule(q.is_cuda, capturing, 2 * k.numel() * k.element_size())
    locks = _decode_locks(q.device, B * Hkv) if fused else lpart
    # programmatic dependent launch (sm_90+): the combine kernel is launched while the split kernel drains
    pdl = not fused and not INTERPRET and q.is_cuda and has_pdl(q.device)
    _attn_fwd_split[(num_splits, B * Hkv)](
        q, k, v, opart, lpart, mask, kpm, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mstr, *kstr,
        Hq, group, Sq, Sk, split_len, num_splits, sm_scale, float(softcap), int(window),
        o, lse, locks, *o.stride()[:3],
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, USE_GDC=pdl, FUSED_COMBINE=bool(fused), num_warps=num_warps,
        num_stages=num_stages, **flags)
    if not fused:
        _attn_combine[(B * Hq * Sq,)](opart, lpart, o, lse, *o.stride()[:3], Hq, Sq, num_splits,
                                      HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_S=max(2, next_pow2(num_splits)),
                                      USE_GDC=pdl, num_warps=4 if INTERPRET else 1,
                                      **({"launch_pdl": True} if pdl else {}))
