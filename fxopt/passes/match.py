"""The one place that says what a node *is*, whatever way Dynamo spelled it (``a @ b``, ``torch.matmul``,
``a.matmul(b)``...): :func:`op_name` maps them to one canonical name, :func:`get_arg` reads an argument by position
or keyword, :func:`val` / :func:`tensor_val` read ``meta["val"]``.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

_FUNCTIONS: dict[Any, str] = {}


def _add(name: str, *fns: Any) -> None:
    for fn in fns:
        if fn is not None:
            _FUNCTIONS[fn] = name


_add("matmul", torch.matmul, operator.matmul, torch.Tensor.matmul)
_add("bmm", torch.bmm, torch.Tensor.bmm)
_add("einsum", torch.einsum, torch.functional.einsum)
_add("baddbmm", torch.baddbmm)
_add("mul", operator.mul, torch.mul, torch.Tensor.mul)
_add("div", operator.truediv, torch.div, torch.true_divide, torch.Tensor.div)
_add("add", operator.add, torch.add, torch.Tensor.add)
_add("sub", operator.sub, torch.sub)
_add("neg", operator.neg, torch.neg)
_add("invert", operator.invert, torch.bitwise_not, torch.logical_not)
_add("softmax", torch.softmax, F.softmax, torch.Tensor.softmax, torch._C._nn.softmax if hasattr(torch._C._nn, "softmax") else None)
_add("dropout", F.dropout, torch.dropout)
_add("transpose", torch.transpose, torch.Tensor.transpose)
_add("permute", torch.permute, torch.Tensor.permute)
_add("reshape", torch.reshape, torch.Tensor.reshape)
_add("view", torch.Tensor.view)
_add("expand", torch.Tensor.expand)
_add("contiguous", torch.Tensor.contiguous)
_add("to", torch.Tensor.to)
_add("float", torch.Tensor.float)
_add("half", torch.Tensor.half)
_add("bfloat16", torch.Tensor.bfloat16)
_add("type_as", torch.Tensor.type_as)
_add("masked_fill", torch.masked_fill, torch.Tensor.masked_fill)
_add("where", torch.where)
_add("sqrt", torch.sqrt, torch.Tensor.sqrt)
_add("getitem", operator.getitem)
_add("linear", F.linear, torch._C._nn.linear)
_add("sdpa", F.scaled_dot_product_attention)
_add("unsqueeze", torch.unsqueeze, torch.Tensor.unsqueeze)
_add("tanh", torch.tanh, torch.Tensor.tanh)

# Tensor method names (call_method targets) that are spelled differently from the canonical name.
_METHOD_ALIASES = {"__matmul__": "matmul", "__truediv__": "div", "__mul__": "mul", "__add__": "add",
                   "softmax": "softmax", "transpose": "transpose", "permute": "permute", "t": "t"}


def op_name(node: Any) -> Optional[str]:
    """Canonical name of what ``node`` computes (``None`` for placeholders, outputs, and unknown ops)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target)
        if name is None and isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(node.target)
        return name
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    return None


def get_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``: positional ``index`` (counting ``self`` for methods) or keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> Any:
    """The node's example value (a FakeTensor for tensors) or ``None``."""
    if isinstance(node, fx.Node):
        return node.meta.get("val", node.meta.get("example_value"))
    return None


def tensor_val(node: Any) -> Optional[torch.Tensor]:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None
