"""The float reference of ``fxopt::flash_attention``: the ops' CPU path and the tests' oracle (in float64), with the
kernels' semantics (rows with no visible key give 0 and lse = +inf). The plain CPU case takes aten's CPU attention.
"""
from __future__ import annotations

import math

import torch

from .checks import last_contig


def _visible(B, Hq, Sq, Sk, is_causal, window, key_padding_mask, device):
    i = torch.arange(Sq, device=device)[:, None] + (Sk - Sq)
    j = torch.arange(Sk, device=device)[None, :]
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if is_causal:
        vis &= j <= i
    if window >= 0:
        vis &= (i - j) < window
    vis = vis.expand(B, Hq, Sq, Sk)
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, None, None, :]
    return vis


def _reference_probs(q, k, attn_mask, is_causal, scale, window, softcap, key_padding_mask, dtype):
    """(p [B, Hq, Sq, Sk], lse [B, Hq, Sq], visible, tanh-or-None, GQA group) computed in ``dtype``."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qf = q.to(dtype).reshape(B, Hkv, g, Sq, D)
    kf = k.to(dtype)[:, :, None]
    s = (qf @ kf.transpose(-1, -2)).reshape(B, Hq, Sq, Sk) * sm_scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    vis = _visible(B, Hq, Sq, Sk, is_causal, window, key_padding_mask, q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            vis = vis & attn_mask
        else:
            s = s + attn_mask.to(dtype)
            vis = vis & (s > float("-inf"))
    any_vis = vis.any(-1, keepdim=True)
    s_m = torch.where(vis, s, torch.full_like(s, float("-inf")))
    s_m = torch.where(any_vis, s_m, torch.zeros_like(s_m))  # keeps the row max (and its grad) finite
    # Normalize by the sum rather than through exp(s - logsumexp): with a finite fill like finfo.min the
    # log-sum is absorbed by the huge max, and exp(s - lse) would sum to Sk instead of 1.
    m = s_m.amax(-1, keepdim=True).detach()
    e = torch.where(vis, torch.exp(s - m), torch.zeros_like(s))
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = (m + torch.log(den.clamp_min(torch.finfo(den.dtype).tiny)))[..., 0]
    lse = torch.where(any_vis[..., 0], lse, torch.full_like(lse, float("inf")))
    return p, lse, vis, t, g


def _cpu_dropout_keep(seed, shape, dropout_p, device):
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return (torch.rand(shape, generator=gen) >= dropout_p).to(device)


def attention_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, window=-1,
                        softcap=0.0, key_padding_mask=None, *, dropout_keep=None, compute_dtype=torch.float32,
                        return_lse=False):
    """Plain PyTorch attention with the op's semantics (differentiable; ``dropout_keep`` = bool keep mask)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    p, lse, _, _, g = _reference_probs(q, k, attn_mask, is_causal, scale, window, softcap, key_padding_mask,
                                       compute_dtype)
    if dropout_keep is not None and dropout_p > 0:
        p = torch.where(dropout_keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    out = (p.reshape(B, Hkv, g, Sq, Sk) @ v.to(compute_dtype)[:, :, None]).reshape(B, Hq, Sq, D)
    return (out, lse) if return_lse else out


def _cpu_flash_fwd(q, k, v, is_causal, scale):
    """PyTorch's own fused CPU attention for the plain case (no mask of any kind but causal with Sq == Sk, no
    dropout, softcap or window): ~15x faster than the S x S reference, same (out, natural-log lse)."""
    # GQA is native in this kernel since torch 2.5's enable_gqa (query head h reads kv head h // (Hq / Hkv)).
    # aten's CPU kernel reads the head dim as contiguous: a view with last stride != 1 (e.g. v stored [B, H, D, S])
    # gives garbage there, so such operands are copied first
    q, k, v = last_contig(q), last_contig(k), last_contig(v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return torch.empty_like(q).copy_(o), lse.float().contiguous()


def _reference_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
    B, Hq, Sq, _ = q.shape
    if (q.device.type == "cpu" and attn_mask is None and key_padding_mask is None and dropout_p == 0 and softcap == 0
            and window < 0 and (not is_causal or Sq == k.shape[2]) and k.shape[2] > 0
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")):
        return _cpu_flash_fwd(q, k, v, is_causal, scale)
    keep = None
    if dropout_p > 0:
        keep = _cpu_dropout_keep(seed, (B, Hq, Sq, k.shape[2]), dropout_p, q.device)
    o, lse = attention_reference(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                 key_padding_mask, dropout_keep=keep, return_lse=True)
    return torch.empty_like(q).copy_(o), lse.float().contiguous()


def _reference_bwd(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                   key_padding_mask, seed, from_lse: bool = True, logits_grad: bool = False):
    """Explicit backward in float32 from the saved lse, as the kernels do (``from_lse=False``: from the normalized
    probabilities, see ``_has_swamped_rows``). ``logits_grad=True``: the gradient of the logits the additive mask is
    added to, [B, Hq, Sq, Sk] float32, instead of (dq, dk, dv)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(D)
    f = torch.float32
    p, _, vis, t, _ = _reference_probs(q, k, attn_mask, is_causal, scale, window, softcap, key_padding_mask, f)
    if from_lse:  # recompute p from the saved lse, as the kernels do
        s = torch.log(p.clamp_min(1e-38)) + torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
        p = torch.where(vis & ~torch.isinf(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(p))
    do = dout.to(f)
    vf = v.to(f)[:, :, None]
    dp = (do.reshape(B, Hkv, g, Sq, D) @ vf.transpose(-1, -2)).reshape(B, Hq, Sq, Sk)
    pd = p
    if dropout_p > 0:
        keep = _cpu_dropout_keep(seed, (B, Hq, Sq, Sk), dropout_p, q.device)
        pd = torch.where(keep, p / (1 - dropout_p), torch.zeros_like(p))
        dp = torch.where(keep, dp / (1 - dropout_p), torch.zeros_like(dp))
    delta = (do * out.to(f)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if logits_grad:
        return ds
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds * sm_scale
    dv = (pd.reshape(B, Hkv, g, Sq, Sk).transpose(-1, -2) @ do.reshape(B, Hkv, g, Sq, D)).sum(2)
    dk = (ds.reshape(B, Hkv, g, Sq, Sk).transpose(-1, -2) @ q.to(f).reshape(B, Hkv, g, Sq, D)).sum(2)
    dq = (ds.reshape(B, Hkv, g, Sq, Sk) @ k.to(f)[:, :, None]).reshape(B, Hq, Sq, D)
    return tuple(torch.empty_like(like).copy_(grad) for grad, like in ((dq, q), (dk, k), (dv, v)))
