"""The attention ops: ``torch.ops.fxopt.flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
scale=None, window=-1, softcap=0.0, key_padding_mask=None)``, q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D], any strides.

``CompositeImplicitAutograd`` over ``fxopt::flash_attention_fwd`` / ``_bwd`` / ``_mask_grad``; CUDA runs ``launch``,
CPU the float32 ``reference``. Eager calls on real tensors take a plain ``autograd.Function`` over the same bodies.
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
    """Rows whose every visible key carries a huge finite bias (a ``finfo.min`` fill): lse = max + log(n) lost log(n)
    to rounding, so p recomputed from it would be 1 instead of 1 / n. The forward leaves them a hugely negative lse."""
    if attn_mask is None or not attn_mask.is_floating_point() or dropout_p > 0:
        return False
    return bool((lse < -1e30).any())


@flash_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _mask_grad_impl(dout, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale, window, softcap,
                    key_padding_mask, seed):
    """dL / d attn_mask for an additive float mask that requires grad: the logits' gradient (``_reference_bwd``,
    float32, S x S memory) summed over the dims the mask broadcasts along, laid out like ``empty_like(attn_mask)``."""
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


def _save(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed, out, lse):
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, seed)
    ctx.params = (dropout_p, is_causal, scale, window, softcap)


def _grads(ctx, dout, bwd, mask_grad):
    """(dq, dk, dv, d attn_mask, None...) through ``bwd`` / ``mask_grad`` (the custom ops or their bodies)."""
    q, k, v, out, lse, attn_mask, key_padding_mask, seed = ctx.saved_tensors
    args = (torch.zeros_like(out) if dout is None else dout, q, k, v, out, lse, attn_mask, *ctx.params,
            key_padding_mask, seed)
    dq, dk, dv = bwd(*args)
    wants_mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    return dq, dk, dv, mask_grad(*args) if wants_mask_grad else None, None, None, None, None, None, None, None


def _fwd_setup_context(ctx, inputs, output):
    _save(ctx, *inputs, *output)


def _fwd_backward(ctx, dout, _dlse):
    return _grads(ctx, dout, torch.ops.fxopt.flash_attention_bwd, torch.ops.fxopt.flash_attention_mask_grad)


flash_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)

torch.library.define(
    "fxopt::flash_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, "
    "float? scale=None, int window=-1, float softcap=0.0, Tensor? key_padding_mask=None) -> Tensor")


class _EagerFlashAttention(torch.autograd.Function):
    """Eager fast path of ``fxopt::flash_attention``: the custom ops' bodies (same kernels, same results bit for bit)
    under a plain autograd.Function (32 x 16 x 512 x 128 fwd+bwd: 1.10 against 1.66 ms per call)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed):
        args = (q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap, key_padding_mask, seed)
        out, lse = _flash_fwd_impl(*args)
        _save(ctx, *args, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative raises, as through the custom ops
    def backward(ctx, dout):
        return _grads(ctx, dout, _flash_bwd_impl, _mask_grad_impl)


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
