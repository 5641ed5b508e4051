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
_ATTENTION = ("sdpa", "flash_attention")
# what a node does (the rules are ``rule_<kind>``); the explicit entries win over "elementwise"
_FUNC_KINDS = {
    **{f: "elementwise" for f in _EW_FUNCS}, F.linear: "linear", torch._C._nn.linear: "linear",
    F.scaled_dot_product_attention: "sdpa", torch.addmm: "addmm", F.embedding: "embedding", torch.cat: "cat",
    torch.concat: "cat", torch.stack: "stack", torch.split: "split", torch.Tensor.split: "split",
    torch.chunk: "chunk", torch.unbind: "unbind", torch.flatten: "flatten", torch.softmax: "softmax",
    F.softmax: "softmax", torch.log_softmax: "softmax", F.log_softmax: "softmax", torch.sum: "reduce",
    torch.mean: "reduce", torch.amax: "reduce", torch.amin: "reduce", torch.transpose: "transpose",
    torch.swapaxes: "transpose", torch.permute: "permute", torch.unsqueeze: "unsqueeze", torch.reshape: "reshape",
    torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "matmul", operator.getitem: "getitem",
}
_FXOPT_KINDS = ("flash_attention", "w4a16_linear", "dequantize_w4")
_METHOD_KINDS = {
    **{m: "elementwise" for m in _EW_METHODS},
    "view": "reshape", "reshape": "reshape", "split": "split", "chunk": "chunk", "unbind": "unbind",
    "flatten": "flatten", "expand": "expand", "transpose": "transpose", "permute": "permute",
    "unsqueeze": "unsqueeze", "t": "transpose", "softmax": "softmax", "log_softmax": "softmax", "sum": "reduce",
    "mean": "reduce", "amax": "reduce", "amin": "reduce", "matmul": "matmul", "__matmul__": "matmul",
    "bmm": "matmul", **{m: "cast" for m in _CAST_METHODS},
}


def _kind(node: fx.Node) -> Optional[str]:
    if node.op == "call_function":
        t = node.target
        s = str(t)
        for name in _FXOPT_KINDS:
            if s.startswith("fxopt." + name):
                return name
        return _FUNC_KINDS.get(t)
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target)
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
