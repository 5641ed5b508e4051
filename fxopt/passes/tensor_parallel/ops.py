"""Op tables and graph helpers shared by the search, the rules and the rewrite: :func:`_kind` names what a node does
(the rules are ``rule_<kind>``), shapes from fake values, dims, and the size arguments of view/split nodes."""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import match
from .plan import _Conflict


_EW_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow, operator.neg,
    operator.invert, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.neg, torch.where,
    torch.masked_fill, torch.maximum, torch.minimum, torch.clamp, torch.tanh, torch.sigmoid, torch.exp, torch.rsqrt,
    torch.sqrt, torch.abs, torch.erf, torch.sin, torch.cos, torch.relu, torch.square, torch.logical_not,
    torch.bitwise_not, torch.clone, torch.detach, F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus, F.mish,
    F.leaky_relu, F.elu, F.hardtanh, F.relu6, F.dropout, torch.nn.functional.gelu, torch.dropout,
}
_EW_METHODS = {
    "add", "sub", "mul", "div", "pow", "neg", "masked_fill", "where", "clamp", "tanh", "sigmoid", "exp", "rsqrt",
    "sqrt", "abs", "relu", "silu", "square", "float", "half", "bfloat16", "contiguous", "clone", "detach", "__add__",
    "__mul__", "__sub__", "__truediv__", "__neg__", "__radd__", "__rmul__", "sin", "cos", "erf", "logical_not",
}
_CAST_METHODS = {"to", "type_as", "type"}  # only arg 0 carries data
_VIEW_NAMES = {"view", "reshape"}
_ATTENTION = ("sdpa", "flash_attention")


def _kind(node: fx.Node) -> Optional[str]:
    if node.op == "call_function":
        t = node.target
        if t is F.scaled_dot_product_attention:
            return "sdpa"
        s = str(t)
        if s.startswith("fxopt.flash_attention"):
            return "flash_attention"
        if s.startswith("fxopt.w4a16_linear"):
            return "w4a16_linear"
        if s.startswith("fxopt.dequantize_w4"):
            return "dequantize_w4"
        if t is torch.addmm:
            return "addmm"
        if t is F.embedding:
            return "embedding"
        if t in (torch.cat, torch.concat):
            return "cat"
        if t is torch.stack:
            return "stack"
        if t in (torch.split, torch.Tensor.split):
            return "split"
        if t in (torch.chunk,):
            return "chunk"
        if t in (torch.unbind,):
            return "unbind"
        if t in (torch.flatten,):
            return "flatten"
        if t in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax):
            return "softmax"
        if t in (torch.sum, torch.mean, torch.amax, torch.amin):
            return "reduce"
        if t in (torch.transpose, torch.swapaxes):
            return "transpose"
        if t is torch.permute:
            return "permute"
        if t is torch.unsqueeze:
            return "unsqueeze"
        if t is torch.reshape:
            return "reshape"
        if t in (torch.matmul, operator.matmul, torch.bmm):
            return "matmul"
        if t is operator.getitem:
            return "getitem"
        if t in _EW_FUNCS:
            return "elementwise"
        if t in (F.linear, torch._C._nn.linear):
            return "linear"
        return None
    if node.op == "call_method":
        m = node.target
        if m in _VIEW_NAMES:
            return "reshape"
        if m in ("split", "chunk", "unbind", "flatten", "expand", "transpose", "permute", "unsqueeze", "t"):
            return {"t": "transpose"}.get(m, m)
        if m in ("softmax", "log_softmax"):
            return "softmax"
        if m in ("sum", "mean", "amax", "amin"):
            return "reduce"
        if m in ("matmul", "__matmul__", "bmm"):
            return "matmul"
        if m in _CAST_METHODS:
            return "cast"
        if m in _EW_METHODS:
            return "elementwise"
        return None
    return None


def _shape(node) -> Optional[tuple]:
    v = match.tensor_val(node)
    return tuple(v.shape) if v is not None else None


def _concrete(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _legacy_empty(node) -> bool:
    """A tensor of shape (0,), proven from its fake value: ``torch.cat`` leaves such operands out."""
    v = match.tensor_val(node) if isinstance(node, fx.Node) else None
    return v is not None and v.dim() == 1 and isinstance(v.shape[0], int) and v.shape[0] == 0


def _output_args(node: fx.Node) -> tuple:
    outs = node.args[0]
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def _norm(d, nd):
    if not isinstance(d, int):
        raise _Conflict(f"dim {d!r} is not a literal")
    return d + nd if d < 0 else d


def _shape_arg_list(node: fx.Node):
    """(list of size args, setter) for view/reshape/expand written either as f(x, *sizes) or f(x, sizes)."""
    if node.op == "call_function":  # torch.reshape(x, shape)
        shape = match.get_arg(node, 1, "shape")
        return list(shape), lambda new: _set_arg(node, 1, "shape", type(shape)(new))
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        seq = rest[0]
        return list(seq), lambda new: _set_arg(node, 1, None, tuple(new))
    if not rest and "size" in node.kwargs:
        seq = node.kwargs["size"]
        return list(seq), lambda new: _set_arg(node, 99, "size", tuple(new))
    return list(rest), lambda new: setattr(node, "args", (node.args[0], *new))


def _set_arg(node, index, name, value):
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        kw = dict(node.kwargs)
        kw[name] = value
        node.kwargs = kw


def _split_sizes(node: fx.Node, x: fx.Node):
    """(section sizes, normalized dim, raw size argument or None for chunk) of a split/chunk node."""
    shape = _shape(x)
    if node.target == "chunk" or node.target is torch.chunk:
        n = match.get_arg(node, 1, "chunks")
        d = _norm(match.get_arg(node, 2, "dim", 0), len(shape))
        if not isinstance(n, int) or shape[d] % n:
            raise _Conflict("uneven chunk")
        return [shape[d] // n] * n, d, None
    sizes = match.get_arg(node, 1, "split_size_or_sections", node.kwargs.get("split_size"))
    d = _norm(match.get_arg(node, 2, "dim", 0), len(shape))
    if isinstance(sizes, int):
        full = [sizes] * (shape[d] // sizes) + ([shape[d] % sizes] if shape[d] % sizes else [])
        return full, d, sizes
    if not isinstance(sizes, (list, tuple)) or any(not isinstance(s, int) for s in sizes):
        raise _Conflict("symbolic split sizes")
    return list(sizes), d, sizes
