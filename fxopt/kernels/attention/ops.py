"""The ``torch.ops.fxopt`` attention ops: registration, fake implementations, autograd, the eager fast path.

Public op::

    torch.ops.fxopt.flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                    window=-1, softcap=0.0, key_padding_mask=None) -> Tensor

q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] with any strides (GQA / MQA without repeating K/V), D <= 256. It is
``CompositeImplicitAutograd`` over ``fxopt::flash_attention_fwd`` -> (out, lse) and ``fxopt::flash_attention_bwd``
(custom ops with fake implementations whose strides match the kernels' outputs), plus
``fxopt::flash_attention_mask_grad`` for an additive float mask that requires grad (exact, S x S memory). On CUDA
the bodies call ``launch``; on CPU the float32 ``reference``. Eager calls on real tensors outside any tracing take a
plain ``autograd.Function`` over the same bodies instead of the custom ops' Python autograd layer (same kernels,
about 0.5 ms less host time per fwd+bwd on the H200 box); graphs keep the opaque custom-op nodes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .checks import check_inputs
from .launch import flash_attention_triton, flash_attention_triton_bwd
from .reference import _reference_bwd, _reference_fwd


def _seed_int(seed):
    return 0 if seed is None else int(seed.item())


def _flash_fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
    """The body of ``fxopt::flash_attention_fwd`` (and of the eager fast path, ``_EagerFlashAttention``)."""
    if q.device.type == "cuda":  # flash_attention_triton checks the inputs itself (once per call: host time)
        return flash_attention_triton(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                      key_padding_mask, _seed_int(seed), return_lse=True)
    check_inputs(q, k, v, attn_mask, dropout_p, window, softcap, key_padding_mask)
    return _reference_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask,
                          _seed_int(seed))


@torch.library.custom_op("fxopt::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                        window: int = -1, softcap: float = 0.0, key_padding_mask: Optional[torch.Tensor] = None,
                        seed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward -> (out like q, lse [B, Hq, Sq] float32, natural log, +inf on fully masked rows)."""
    return _flash_fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed)


@flash_attention_fwd.register_fake
def _(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, window=-1, softcap=0.0,
      key_padding_mask=None, seed=None):
    check_inputs(q, k, v, attn_mask, dropout_p, window, softcap, key_padding_mask)
    B, Hq, Sq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def _flash_bwd_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                    key_padding_mask, seed):
    """The body of ``fxopt::flash_attention_bwd`` (and of the eager fast path's backward)."""
    if _has_swamped_rows(attn_mask, lse, dropout_p):  # exact but S x S: only for such rare masks
        return _reference_bwd(dout, q, k, v, out, lse, attn_mask, 0.0, is_causal, scale, window, softcap,
                              key_padding_mask, None, from_lse=False)
    if q.device.type == "cuda":
        return flash_attention_triton_bwd(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window,
                                          softcap, key_padding_mask, _seed_int(seed))
    return _reference_bwd(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                          key_padding_mask, _seed_int(seed))


@torch.library.custom_op("fxopt::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                        scale: Optional[float], window: int, softcap: float,
                        key_padding_mask: Optional[torch.Tensor],
                        seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the saved lse -> (dq, dk, dv) allocated like q, k, v."""
    return _flash_bwd_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                           key_padding_mask, seed)


def _has_swamped_rows(attn_mask, lse, dropout_p) -> bool:
    """Rows whose every visible key carries a huge finite bias (a ``finfo.min`` fill): their forward is right (the
    uniform average eager computes), but lse = max + log(n) has lost log(n) to rounding, so recomputing p from it
    (as the kernels and ``_reference_bwd`` do) would give p = 1 instead of 1 / n. The forward leaves such rows with a
    hugely negative finite lse, which is how they are found (one small reduction, float masks only)."""
    if attn_mask is None or not attn_mask.is_floating_point() or dropout_p > 0:
        return False
    return bool((lse < -1e30).any())


@flash_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _mask_grad_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                    key_padding_mask, seed):
    """dL / d attn_mask for an additive float mask that requires grad (a learned bias): the logits' gradient
    (``_reference_bwd(logits_grad=True)``, float32 over [B, Hq, Sq, Sk]: exact, S x S memory) summed over the dims
    the mask broadcasts along, laid out like ``torch.empty_like(attn_mask)``. The kernels do not write it;
    returning None here would leave a learned bias without its gradient, and no error would say so."""
    if dropout_p > 0 and q.device.type != "cpu":
        raise ValueError("flash_attention: the gradient of attn_mask with dropout_p > 0 is only computed on CPU (the "
                         "reference cannot replay the GPU kernel's dropout mask); use dropout_p=0 or SDPA")
    ds = _reference_bwd(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                        key_padding_mask, _seed_int(seed), from_lse=not _has_swamped_rows(attn_mask, lse, dropout_p),
                        logits_grad=True)
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    dims = [i for i in range(4) if shape[i] == 1 and ds.shape[i] != 1]
    g = ds.sum(dims, keepdim=True) if dims else ds
    return torch.empty_like(attn_mask).copy_(g.reshape(attn_mask.shape))


@torch.library.custom_op("fxopt::flash_attention_mask_grad", mutates_args=())
def flash_attention_mask_grad(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, attn_mask: torch.Tensor, dropout_p: float,
                              is_causal: bool, scale: Optional[float], window: int, softcap: float,
                              key_padding_mask: Optional[torch.Tensor],
                              seed: Optional[torch.Tensor]) -> torch.Tensor:
    """Gradient of an additive float attn_mask (``_mask_grad_impl``), like attn_mask."""
    return _mask_grad_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                           key_padding_mask, seed)


@flash_attention_mask_grad.register_fake
def _(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
    return torch.empty_like(attn_mask)


def _wants_mask_grad(ctx, attn_mask) -> bool:
    return attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, seed)
    ctx.params = (dropout_p, is_causal, scale, window, softcap)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, key_padding_mask, seed = ctx.saved_tensors
    dropout_p, is_causal, scale, window, softcap = ctx.params
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fxopt.flash_attention_bwd(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal,
                                                     scale, window, softcap, key_padding_mask, seed)
    dmask = None
    if _wants_mask_grad(ctx, attn_mask):
        dmask = torch.ops.fxopt.flash_attention_mask_grad(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal,
                                                          scale, window, softcap, key_padding_mask, seed)
    return dq, dk, dv, dmask, None, None, None, None, None, None, None


flash_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)

torch.library.define(
    "fxopt::flash_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, "
    "float? scale=None, int window=-1, float softcap=0.0, Tensor? key_padding_mask=None) -> Tensor")


class _EagerFlashAttention(torch.autograd.Function):
    """Eager fast path of ``fxopt::flash_attention``: the same bodies as the custom ops (``_flash_fwd_impl`` /
    ``_flash_bwd_impl``, same kernels, same results bit for bit) under a plain autograd.Function. The custom op's
    autograd layer is Python (default filling, a generated Function, a redispatch into the backward op): 32 x 16 x
    512 x 128 fwd+bwd took 1.66 ms per call through it and 1.10 ms through this, for 0.67-0.74 ms of kernels. Only
    real tensors outside any tracing take it (``_eager_fast_path_ok``)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
        out, lse = _flash_fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                   key_padding_mask, seed)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, seed)
        ctx.params = (dropout_p, is_causal, scale, window, softcap)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative raises, as through the custom ops
    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask, key_padding_mask, seed = ctx.saved_tensors
        dropout_p, is_causal, scale, window, softcap = ctx.params
        dq, dk, dv = _flash_bwd_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window,
                                     softcap, key_padding_mask, seed)
        dmask = None
        if _wants_mask_grad(ctx, attn_mask):
            dmask = _mask_grad_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                    key_padding_mask, seed)
        return dq, dk, dv, dmask, None, None, None, None, None, None, None


def _eager_fast_path_ok(*tensors) -> bool:
    """Plain eager call on real tensors: not compiling, no dispatch mode (fake / proxy / functional tracing), every
    tensor exactly a ``torch.Tensor`` and not wrapped by a functorch transform (vmap, grad)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(t is None or (type(t) is torch.Tensor and not wrapped(t)) for t in tensors)


@torch.library.impl("fxopt::flash_attention", "CompositeImplicitAutograd")
def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, window=-1, softcap=0.0,
                    key_padding_mask=None):
    """Public op: attention output only (dropout seed drawn here from torch's default CPU generator)."""
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    if _eager_fast_path_ok(q, k, v, attn_mask, key_padding_mask):
        return _EagerFlashAttention.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                          key_padding_mask, seed)
    out, _ = torch.ops.fxopt.flash_attention_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                                 key_padding_mask, seed)
    return out
