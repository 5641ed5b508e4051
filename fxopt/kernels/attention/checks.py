"""Input checks and argument packing shared by the attention launch paths, the CPU reference and the FP8 op."""
from __future__ import annotations

import torch

from fxopt.kernels import next_pow2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_qkv(op: str, q, k, v, dtypes) -> None:
    """The checks every attention op shares: 4-D q/k/v of one allowed dtype and device, k and v alike, batch and
    head dim matching q, query heads a multiple of kv heads. Raises ValueError prefixed with ``op``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{op}: {name} dtype {t.dtype} unsupported ({names})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: dtype mismatch q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: device mismatch q {q.device}, k {k.device}, v {v.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{op}: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def check_inputs(q, k, v, attn_mask, dropout_p, window, softcap, key_padding_mask):
    check_qkv("flash_attention", q, k, v, DTYPES)
    B, Hq, Sq, D = q.shape
    if D > 256 or D < 1:
        raise ValueError(f"flash_attention: head dim {D} unsupported (1..256)")
    Sk = k.shape[2]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"flash_attention: attn_mask must be bool or floating, got {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            raise ValueError(f"flash_attention: attn_mask has {attn_mask.dim()} dims (at most 4)")
        shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        for have, want in zip(shape, (B, Hq, Sq, Sk)):
            if have not in (1, want):
                raise ValueError(f"flash_attention: attn_mask shape {tuple(attn_mask.shape)} does not broadcast to "
                                 f"[B, Hq, Sq, Sk] = {[B, Hq, Sq, Sk]}")
        if attn_mask.device != q.device:
            raise ValueError(f"flash_attention: attn_mask on {attn_mask.device}, q on {q.device}")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, Sk):
            raise ValueError(f"flash_attention: key_padding_mask must be bool [B, Sk] = {[B, Sk]}, got "
                             f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"flash_attention: key_padding_mask on {key_padding_mask.device}, q on {q.device}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"flash_attention: dropout_p must be in [0, 1), got {dropout_p}")
    if softcap < 0:
        raise ValueError(f"flash_attention: softcap must be >= 0, got {softcap}")
    if window < -1:
        raise ValueError(f"flash_attention: window must be -1 (off) or >= 0, got {window}")


def last_contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def mask_args(attn_mask, key_padding_mask, q, B, Hq, Sq, Sk):
    """(mask tensor, MASK_KIND, 4 strides, kpm tensor, HAS_KPM, 2 strides); broadcast dims get stride 0."""
    if attn_mask is None:
        mask, kind, mstr = q, 0, (0, 0, 0, 0)
    else:
        m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() < 4 \
            else attn_mask
        m = m.expand(B, Hq, Sq, Sk)
        kind = 1 if m.dtype == torch.bool else 2
        mask = m.view(torch.uint8) if kind == 1 else m
        mstr = tuple(mask.stride())
    if key_padding_mask is None:
        kpm, has_kpm, kstr = q, False, (0, 0)
    else:
        kpm = key_padding_mask.view(torch.uint8)
        has_kpm, kstr = True, tuple(kpm.stride())
    return mask, kind, mstr, kpm, has_kpm, kstr


def block_d(D):
    return max(16, next_pow2(D))
