"""Collectives the rewrite inserts: Megatron's *f* (``fxopt::tp_copy``, identity forward, all-reduce backward) and the
functional c10d ops, plus the metadata copy every inserted node gets from the node it stands for."""
from __future__ import annotations

import torch
import torch.fx as fx


@torch.library.custom_op("fxopt::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's *f*: forward copies ``x``; backward all-reduces (sums) the gradient over ``group_name``."""
    return x.clone()


@tp_copy.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def _tp_copy_backward(ctx, grad):
    out = torch.ops._c10d_functional.all_reduce.default(grad.contiguous(), "sum", ctx.group_name)
    return torch.ops._c10d_functional.wait_tensor.default(out), None


def _tp_copy_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


tp_copy.register_autograd(_tp_copy_backward, setup_context=_tp_copy_setup)

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def _copy_meta(new: fx.Node, old: fx.Node):
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
