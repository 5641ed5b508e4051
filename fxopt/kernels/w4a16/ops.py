"""The W4A16 ops: ``fxopt::w4a16_linear``, ``fxopt::w4a16_linear_cat`` (several linears, one kernel call when the
packed tensors are adjacent slices of one storage) and ``fxopt::dequantize_w4``, over the entry point
``w4a16_matmul`` (launch plans keyed on the arguments plus ``_plan_state``).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from fxopt import env
from fxopt.kernels.launch_plan import plan_cached
from fxopt.kernels.w4a16 import routing, tuner
from fxopt.kernels.w4a16.common import (INTERPRET, MAGIC, W4A16Config, check_inputs, fit_block_k, integer_zeros,
                                        mark_integer_zeros)
from fxopt.kernels.w4a16.dequant import dequantize_w4_triton
from fxopt.quant.format import PACK, dequantize as _dequantize_reference

log = logging.getLogger(__name__)


# Launch plans for the eager path (tests/kernels/test_w4a16_launch_plan_gpu.py); FXOPT_LAUNCH_PLANS=0 turns them off.
_LAUNCH_PLANS = env.launch_plans()


def _plan_state(x, qweight, scales, zeros, *args, **kwargs) -> tuple:
    """The routing state beyond the arguments' metadata: integer zeros, the tuner's table, routes, untuned switch."""
    return (integer_zeros(zeros) if zeros.is_cuda else None, len(tuner._TUNED), routing.active(), env.no_tune())


@plan_cached(state=_plan_state, enabled=lambda: _LAUNCH_PLANS)
def w4a16_matmul(x, qweight, scales, zeros, group_size: int, bias=None,
                 config: Optional[W4A16Config] = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias); x [..., K] (2-D or 3-D). Works on CPU tensors under ``TRITON_INTERPRET=1``
    (the Triton tiles, tiny shapes). ``config`` forces a launch config (else the tuner's pick)."""
    K, N, group_size = check_inputs(x, qweight, scales, zeros, group_size, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, K)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    if config is None or config.method != "dequant_matmul":  # the dequant kernel reads any strides
        scales, zeros = scales.contiguous(), zeros.contiguous()
    if x2d.shape[0] == 0:
        return x.new_empty(*lead, N)
    if config is None:
        config = tuner.choose_config(x2d, qweight, scales, zeros, group_size, bias)
    elif config.method in ("swapx", "swapd"):
        config = replace(config, block_k=fit_block_k(config.block_k, K, group_size))
    y = tuner.launch(x2d, qweight, scales, zeros, group_size, bias, config)
    return y.reshape(*lead, N)


def w4a16_reference(x, qweight, scales, zeros, group_size: int, bias=None) -> torch.Tensor:
    """Reference: dequantize and matmul in float32, add bias, cast to x.dtype (the op's CPU path)."""
    K = qweight.shape[0] * PACK
    w = _dequantize_reference(qweight, scales, zeros, K if group_size == -1 else group_size, dtype=torch.float32)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).contiguous()


# Custom ops
@torch.library.custom_op("fxopt::dequantize_w4", mutates_args=())
def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] = (q - zeros) * scales in scales.dtype, contiguous."""
    from fxopt.quant.format import check_packed

    K = qweight.shape[0] * PACK
    gs = K if group_size == -1 else group_size
    check_packed(qweight, scales, zeros, gs)
    if qweight.device.type == "cuda" and scales.dtype in MAGIC:
        if scales.stride() != zeros.stride():  # the kernel reads both with one pair of strides
            scales, zeros = scales.contiguous(), zeros.contiguous()
        return dequantize_w4_triton(qweight, scales, zeros, gs)
    return _dequantize_reference(qweight, scales, zeros, gs).contiguous()


@dequantize_w4.register_fake
def _(qweight, scales, zeros, group_size):
    return scales.new_empty((qweight.shape[1], qweight.shape[0] * PACK))


@torch.library.custom_op("fxopt::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ ((q - zeros) * scales).T (+ bias); x [..., K] 2-D or 3-D fp16/bf16; y [..., N] contiguous."""
    check_inputs(x, qweight, scales, zeros, group_size, bias)
    if x.device.type == "cuda":
        if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
            # a sibling's column slice (share_sibling_storage) that the pass did not group (a prefill): the
            # dequantize + cuBLAS route reads the slice in place once the tuner picked it for this shape
            cfg = _slice_route(x, qweight, scales, zeros, group_size, bias)
            if cfg is not None:
                return w4a16_matmul(x, qweight, scales, zeros, group_size, bias, config=cfg)
            # the fused kernels take rows whole: a contiguous copy, whose zeros inherit the slice's integer check
            # (kept on the slice: no sync per call)
            intz = integer_zeros(zeros)
            qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
            mark_integer_zeros(zeros, intz)
        return w4a16_matmul(x, qweight, scales, zeros, group_size, bias)
    return w4a16_reference(x, qweight, scales, zeros, group_size, bias)


def _slice_route(x, qweight, scales, zeros, group_size, bias) -> Optional[W4A16Config]:
    """The tuner's pick for this shape when it is "dequant_matmul" and the slices' strides suit its kernel."""
    if qweight.stride(1) != 1 or scales.stride() != zeros.stride() or scales.stride(1) != 1:
        return None
    K = qweight.shape[0] * PACK
    x2d = x.reshape(-1, K)
    if x2d.stride(1) != 1 or x2d.shape[0] == 0 or INTERPRET:
        return None
    cfg = tuner.tuned_config(x2d, qweight.shape[1], zeros, K if group_size == -1 else group_size, bias is not None)
    return cfg if cfg is not None and cfg.method == "dequant_matmul" else None


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, group_size, bias=None):
    check_inputs(x, qweight, scales, zeros, group_size, bias)
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, group_size, bias = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.group_size = group_size
    ctx.has_bias = bias is not None


def _grads(ctx, grad_y, packs):
    """(grad x or None, [grad bias per linear] or None) of ``cat([x @ W_i.T + b_i], -1)``, W_i packed in ``packs``
    [(qweight, scales, zeros)]."""
    grad_x = grad_biases = None
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias, grad_biases = grad_y.reshape(-1, grad_y.shape[-1]).sum(0), []
    col = 0
    for qweight, scales, zeros in packs:
        n = qweight.shape[1]
        if ctx.needs_input_grad[0]:
            w = torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, ctx.group_size)  # [N_i, K]
            g = torch.matmul(grad_y[..., col:col + n], w.to(grad_y.dtype))
            grad_x = g if grad_x is None else grad_x + g
        if grad_biases is not None:
            grad_biases.append(grad_bias[col:col + n])
        col += n
    return grad_x, grad_biases


def _backward(ctx, grad_y):
    grad_x, grad_biases = _grads(ctx, grad_y, [ctx.saved_tensors])
    return grad_x, None, None, None, None, grad_biases[0] if grad_biases else None


w4a16_linear.register_autograd(_backward, setup_context=_setup_context)


def column_span(parts) -> Optional[torch.Tensor]:
    """The contiguous tensor whose blocks along the last dim are ``parts`` (all 2-D [R, N_i] or all 1-D) when they
    are adjacent slices of one storage (``share_sibling_storage``), else None; reads only metadata (fake ones too)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        return first if first.is_contiguous() else None
    lead = tuple(first.shape[:-1])
    if first.dim() not in (1, 2) or any(p.dim() != first.dim() or tuple(p.shape[:-1]) != lead or p.dtype != first.dtype
                                        or p.device != first.device for p in parts):
        return None
    total = sum(int(p.shape[-1]) for p in parts)
    storage = StorageWeakRef(first.untyped_storage())
    offset = first.storage_offset()
    for p in parts:
        if StorageWeakRef(p.untyped_storage()) != storage or p.storage_offset() != offset:
            return None
        if p.shape[-1] > 1 and p.stride(-1) != 1:
            return None
        if p.dim() == 2 and p.shape[0] > 1 and p.stride(0) != total:
            return None
        offset += int(p.shape[-1])
    if first.dim() == 1:
        return first.as_strided((total,), (1,), first.storage_offset())
    return first.as_strided((lead[0], total), (total, 1), first.storage_offset())


def _check_cat_inputs(x, qweights, scales, zeros, group_size, biases):
    n = len(qweights)
    if n == 0 or len(scales) != n or len(zeros) != n or (biases and len(biases) != n):
        raise ValueError(f"w4a16_linear_cat: {n} qweight(s), {len(scales)} scales, {len(zeros)} zeros and "
                         f"{len(biases)} bias(es): one of each per linear")
    for i in range(n):
        check_inputs(x, qweights[i], scales[i], zeros[i], group_size, biases[i] if biases else None)
    return sum(q.shape[1] for q in qweights)


@torch.library.custom_op("fxopt::w4a16_linear_cat", mutates_args=())
def w4a16_linear_cat(x: torch.Tensor, qweights: list[torch.Tensor], scales: list[torch.Tensor],
                     zeros: list[torch.Tensor], group_size: int, biases: list[torch.Tensor]) -> torch.Tensor:
    """``cat([w4a16_linear(x, qweights[i], scales[i], zeros[i], group_size, biases[i]) for i], -1)`` (``biases``:
    one per linear or empty): one kernel call when every list spans one storage (:func:`column_span`)."""
    _check_cat_inputs(x, qweights, scales, zeros, group_size, biases)
    spans = [column_span(t) for t in (qweights, scales, zeros)]
    bias = column_span(biases) if biases else None
    if all(s is not None for s in spans) and (not biases or bias is not None):
        if x.device.type == "cuda":
            return w4a16_matmul(x, *spans, group_size, bias)
        return w4a16_reference(x, *spans, group_size, bias)
    log.debug("w4a16_linear_cat: packed tensors are not adjacent slices of one storage; one call per linear")
    parts = [torch.ops.fxopt.w4a16_linear(x, qweights[i], scales[i], zeros[i], group_size,
                                          biases[i] if biases else None) for i in range(len(qweights))]
    return torch.cat(parts, dim=-1)


@w4a16_linear_cat.register_fake
def _(x, qweights, scales, zeros, group_size, biases):
    N = _check_cat_inputs(x, qweights, scales, zeros, group_size, biases)
    return x.new_empty((*x.shape[:-1], N))


def _setup_context_cat(ctx, inputs, output):
    x, qweights, scales, zeros, group_size, biases = inputs
    ctx.save_for_backward(*qweights, *scales, *zeros)
    ctx.n, ctx.group_size, ctx.has_bias = len(qweights), group_size, bool(biases)


def _backward_cat(ctx, grad_y):
    saved, n = ctx.saved_tensors, ctx.n
    grad_x, grad_biases = _grads(ctx, grad_y, list(zip(saved[:n], saved[n:2 * n], saved[2 * n:])))
    none = [None] * n  # list inputs take a list of gradients
    return grad_x, none, none, none, None, (grad_biases or none) if ctx.has_bias else []


w4a16_linear_cat.register_autograd(_backward_cat, setup_context=_setup_context_cat)
