"""The ``w4a16`` pass: fuse ``dequantize_w4 -> linear`` into ``torch.ops.fxopt.w4a16_linear``.

:class:`fxopt.quant.QuantLinear` reads as ``F.linear(x, dequantize_w4(...), bias)`` in a Dynamo graph; left alone,
that writes a 16-bit weight on every call. Each user of the dequantized weight must be a spelling of
``x @ W.T (+ b)`` (``F.linear``, ``matmul`` / ``mm`` of a transpose of W, ``addmm`` with beta = alpha = 1), and each
product is replaced only when dtypes, shapes, layout, devices and the absence of in-place writes to the packed
tensors are proven on ``meta["val"]`` (:func:`_check`, :func:`_mutated_between`); everything else stays, with a
reason. Prefill-sized products stay dequantize + cuBLAS (``DEQUANT_MATMUL_MIN_ROWS``); siblings reading one input
become one ``w4a16_linear_cat`` call. Details: docs/architecture.md, "The W4A16 pass".
"""
from __future__ import annotations

import logging
import math
import operator
import re
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known
from torch.multiprocessing.reductions import StorageWeakRef

from ..config import W4A16Config
from ..kernels import w4a16 as _w4a16_ops  # noqa: F401  registers torch.ops.fxopt.w4a16_linear / dequantize_w4
from ..kernels.w4a16 import routing
from ..quant.format import PACK
from . import match
from .manager import PassContext, PassResult, register_pass

log = logging.getLogger(__name__)

_SUPPORTED_GROUPS = (32, 64, 128)


def _is_dequant(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        torch.ops.fxopt.dequantize_w4, torch.ops.fxopt.dequantize_w4.default)


def _is_transpose_2d(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a transpose of the 2-D tensor ``src`` (every spelling Dynamo produces)."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[0] is src and node.args[1] in ("T", "mT")
    name = match.op_name(node)
    if name == "t" or (node.op == "call_function" and node.target in (torch.t, torch.Tensor.t)):
        return match.get_arg(node, 0, "input") is src
    if name not in ("transpose", "permute") or match.get_arg(node, 0, "input") is not src:
        return False
    if name == "transpose":
        d0, d1 = match.get_arg(node, 1, "dim0"), match.get_arg(node, 2, "dim1")
        return isinstance(d0, int) and isinstance(d1, int) and {d0 % 2, d1 % 2} == {0, 1}
    dims = list(node.args[1:]) if len(node.args) > 1 else list(node.kwargs.get("dims", ()))
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = list(dims[0])
    return all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]


class _Use(NamedTuple):
    """One product ``x @ W.T (+ bias)`` reading the dequantized weight."""

    node: fx.Node
    x: Any
    bias: Any
    transpose: Optional[fx.Node]


def _as_linear_use(user: fx.Node, w: fx.Node) -> Optional[_Use]:
    """Interpret ``user`` of the dequantized weight ``w`` as a linear product, or None."""
    if match.op_name(user) == "linear":
        x = match.get_arg(user, 0, "input")
        if match.get_arg(user, 1, "weight") is w and x is not w and set(user.kwargs) <= {"input", "weight", "bias"}:
            return _Use(user, x, match.get_arg(user, 2, "bias"), None)
        return None
    if not _is_transpose_2d(user, w) or len(user.users) != 1:
        return None
    prod = next(iter(user.users))
    name = match.op_name(prod)
    if name == "matmul" or (prod.op == "call_function" and prod.target in (torch.mm, torch.Tensor.mm)) or (
            prod.op == "call_method" and prod.target == "mm"):
        if len(prod.args) == 2 and prod.args[1] is user and prod.args[0] is not user and not prod.kwargs:
            return _Use(prod, prod.args[0], None, user)
        return None
    if (prod.op == "call_function" and prod.target in (torch.addmm, torch.Tensor.addmm)) or (
            prod.op == "call_method" and prod.target == "addmm"):
        b, x, wt = match.get_arg(prod, 0, "input"), match.get_arg(prod, 1, "mat1"), match.get_arg(prod, 2, "mat2")
        if wt is user and x is not user and b is not user and prod.kwargs.get("beta", 1) == 1 and \
                prod.kwargs.get("alpha", 1) == 1 and len(prod.args) <= 3:
            return _Use(prod, x, b, user)
    return None


def _describe(node: fx.Node) -> str:
    return f"{node.name} ({match.op_name(node) or node.target})"


def _static(*dims) -> bool:
    return all(isinstance(d, int) for d in dims)


def _rows_collapse(xv: torch.Tensor) -> bool:
    """Whether x [..., K] provably has unit stride along K and leading dims that merge into one (a [M, K] view, no
    copy). Symbolic sizes (``dynamic=True``) are fine when the relation holds for every value."""
    size, stride = tuple(xv.shape), tuple(xv.stride())
    if not (known(size[-1] == 1) or known(stride[-1] == 1)):
        return False
    if len(size) == 3 and not (known(size[0] == 1) or known(size[1] == 1) or known(stride[0] == size[1] * stride[1])):
        return False
    return True


def _check(use: _Use, qweight, scales, zeros, group_size) -> Optional[str]:
    """Reason the product cannot be fused, or None if it can."""
    xv = match.tensor_val(use.x)
    qv, sv, zv = match.tensor_val(qweight), match.tensor_val(scales), match.tensor_val(zeros)
    if xv is None or qv is None or sv is None or zv is None:
        return "no tensor meta['val'] on the input or the packed weight"
    if qv.dtype != torch.int32 or qv.dim() != 2:
        return f"qweight is {qv.dtype} {qv.dim()}-D; the packed weight is int32 [K // 8, N]"
    if not _static(*qv.shape):
        return f"packed weight shape {tuple(qv.shape)} is symbolic; K and N must be static"
    K, N = qv.shape[0] * PACK, qv.shape[1]
    if xv.dtype not in (torch.float16, torch.bfloat16):
        return f"activations are {xv.dtype}; w4a16_linear needs float16/bfloat16"
    if xv.dtype != sv.dtype or xv.dtype != zv.dtype:
        return f"activation dtype {xv.dtype} differs from scales/zeros dtype ({sv.dtype}, {zv.dtype})"
    if xv.dim() not in (2, 3):
        return f"input is {xv.dim()}-D; w4a16_linear takes 2-D or 3-D input"
    if not known(xv.shape[-1] == K):
        return f"input has {xv.shape[-1]} features, not provably the packed weight's K = {K}"
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        return f"group size is not a constant int ({group_size!r})"
    G = K if group_size == -1 else group_size
    if G not in _SUPPORTED_GROUPS and G != K:
        return f"group size {G} not supported by the kernel (32, 64, 128 or K = {K})"
    if G <= 0 or K % G:
        return f"group size {G} does not divide K = {K}"
    for name, t in (("scales", sv), ("zeros", zv)):
        if tuple(t.shape) != (K // G, N):
            return f"{name} shape {tuple(t.shape)} is not [K // G, N] = [{K // G}, {N}] (K={K}, group {G})"
    if not _rows_collapse(xv):
        return (f"input layout size {tuple(xv.shape)} stride {tuple(xv.stride())} is not rows of unit stride along "
                f"K; the kernel would copy x on every call")
    for name, t in (("qweight", qv), ("scales", sv), ("zeros", zv)):
        # a column slice (a sibling laid out by share_sibling_storage) is grouped below, or copied by the op
        if not t.is_contiguous() and t.stride(-1) != 1:
            return f"{name} is not contiguous (stride {tuple(t.stride())}); the kernel would copy it on every call"
    if sv.requires_grad or zv.requires_grad:
        return "scales/zeros require grad; w4a16_linear gives them no gradient"
    tensors = [xv, qv, sv, zv]
    if use.bias is not None:
        bv = match.tensor_val(use.bias)
        if bv is None:
            return "bias is not a tensor"
        if bv.dim() != 1 or bv.shape[0] != N:
            return f"bias shape {tuple(bv.shape)} is not [{N}]"
        if bv.dtype != xv.dtype:
            return f"bias dtype {bv.dtype} differs from activation dtype {xv.dtype}"
        tensors.append(bv)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return f"tensors on several devices: {sorted(map(str, devices))}"
    return None


def _written(node: fx.Node) -> Optional[list]:
    """The arguments ``node`` writes in place (possibly empty), or None when it writes something it cannot name."""
    out = [node.kwargs["out"]] if "out" in node.kwargs else []
    if node.op == "call_method":
        name = node.target
        if (name.endswith("_") and not name.endswith("__")) or name in ("__setitem__", "__iadd__", "__imul__"):
            out.append(node.args[0])
        return out
    if node.op != "call_function":
        return out if node.op in ("placeholder", "get_attr", "output") else None
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = getattr(t, "default", None) or t
    if isinstance(t, torch._ops.OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(match.get_arg(node, i, a.name))
        return out
    name = getattr(t, "__name__", "")
    if t is operator.setitem or node.kwargs.get("inplace") is True or (
            name.endswith("_") and not name.endswith("__")):
        out.append(node.args[0] if node.args else None)
    return out


def _mutated_between(start: fx.Node, end: fx.Node, packed: list) -> Optional[str]:
    """Why a node strictly between ``start`` and ``end`` may write to the packed tensors' storage, or None."""
    storages = set()
    for p in packed:
        v = match.tensor_val(p)
        if v is None:
            return f"{p} has no tensor meta['val']"
        storages.add(StorageWeakRef(v.untyped_storage()))
    node = start.next
    while node is not end and node.op != "root":
        written = _written(node)
        if written is None:
            return f"{_describe(node)} may write in place (unknown op)"
        for w in written:
            wv = match.tensor_val(w) if isinstance(w, fx.Node) else None
            if wv is None:
                if isinstance(w, fx.Node) or w is None:
                    return f"{_describe(node)} writes in place to a tensor without meta['val']"
                continue
            if StorageWeakRef(wv.untyped_storage()) in storages:
                return (f"{_describe(node)} writes in place to the packed weight between {start.name} and "
                        f"{end.name}; the fused op would read the new values")
        node = node.next
    return None


def _fake_out(args: tuple, bias) -> Optional[torch.Tensor]:
    vals = [match.val(a) if isinstance(a, fx.Node) else a for a in args]
    bval = match.val(bias) if isinstance(bias, fx.Node) else bias
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # The inputs' own mode (the manager may have re-propagated with a mode other than the tracing context's).
    modes = [v.fake_mode for v in vals + [bval] if isinstance(v, FakeTensor)]
    mode = modes[0] if modes else FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return torch.ops.fxopt.w4a16_linear(*vals, bias=bval)


@register_pass("w4a16")
def w4a16_pass(gm: fx.GraphModule, cfg: W4A16Config, ctx: PassContext) -> PassResult:
    """Replace every fusable ``dequantize_w4 -> linear`` by ``torch.ops.fxopt.w4a16_linear``."""
    result = PassResult("w4a16")
    graph = gm.graph
    for dq in [n for n in graph.nodes if _is_dequant(n)]:
        qweight, scales, zeros, group_size = (match.get_arg(dq, i, name) for i, name in
                                              enumerate(("qweight", "scales", "zeros", "group_size")))
        if not dq.users:
            result.skip(dq, "dequantized weight is unused")
            continue
        read = [(u, _as_linear_use(u, dq)) for u in list(dq.users)]
        uses = [use for _, use in read if use is not None]
        others = [u for u, use in read if use is None]
        if others:
            cast = all(match.op_name(o) in ("to", "float", "half", "bfloat16", "type_as") for o in others)
            why = ("dequantized weight is cast before use (activation dtype differs from the scales dtype): " if cast
                   else "dequantized weight is used elsewhere, so it must be materialized: ")
            result.skip(dq, why + ", ".join(_describe(o) for o in others))
            continue
        for use in uses:
            reason = (_check(use, qweight, scales, zeros, group_size)
                      or _mutated_between(dq, use.node, [qweight, scales, zeros])
                      or _left_to_cublas(use, ctx.config.kernels.w4a16_dequant_matmul))
            if reason is not None:
                result.skip(use.node, reason)
                continue
            args = (use.x, qweight, scales, zeros, group_size)
            try:
                new_val = _fake_out(args, use.bias)
            except Exception as e:  # the op's own input checks: never crash the compile, leave the node
                result.skip(use.node, f"w4a16_linear rejects these inputs: {e}")
                continue
            old_val = match.tensor_val(use.node)
            if old_val is not None and (tuple(old_val.shape) != tuple(new_val.shape) or old_val.dtype != new_val.dtype):
                result.skip(use.node, f"fused output {tuple(new_val.shape)} {new_val.dtype} would differ from "
                            f"{tuple(old_val.shape)} {old_val.dtype}")
                continue
            with graph.inserting_before(use.node):
                new = graph.call_function(torch.ops.fxopt.w4a16_linear.default, args, {"bias": use.bias})
            new.meta["val"] = new_val
            _copy_source(use.node, new)
            log.debug("w4a16: %s -> %s", use.node.format_node(), new.name)
            use.node.replace_all_uses_with(new)
            graph.erase_node(use.node)
            if use.transpose is not None and not use.transpose.users:
                graph.erase_node(use.transpose)
            result.rewrites += 1
            xv = match.tensor_val(use.x)
            qv = match.tensor_val(qweight)
            module = _module_path(new)
            result.notes.append(f"w4a16: {new.name}{' (' + module + ')' if module else ''}: "
                                f"x {tuple(xv.shape)} {xv.dtype} @ int4 [K={qv.shape[0] * PACK}, N={qv.shape[1]}], "
                                f"group {qv.shape[0] * PACK if group_size == -1 else group_size}"
                                f"{', bias' if use.bias is not None else ''}")
        if not dq.users:
            graph.erase_node(dq)
    if cfg.group_siblings:
        if ctx.config.tensor_parallel.enabled:
            log.debug("w4a16: siblings not grouped: tensor_parallel shards each linear on its own")
        else:
            _group_siblings(graph, result)
    fp32 = [sk for sk in result.skipped if sk.reason.startswith("activations are torch.float32")]
    if fp32 and not result.rewrites:
        log.warning("w4a16: fused none of %d quantized linear(s): activations are float32 and the int4 kernels take "
                    "float16/bfloat16. Cast the model before compiling, e.g. model.to(torch.float16) (or "
                    "torch.bfloat16); in float32 the weights are dequantized on every call.", len(fp32))
    if result.rewrites:  # the ops this graph calls run with the compiling config's kernel choices
        routing.use_config(ctx.config.kernels)
    return result


def _copy_source(src: fx.Node, *dst: fx.Node) -> None:
    """The module and source of ``src`` onto ``dst`` (later passes, tensor parallel, read ``nn_module_stack``)."""
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in src.meta:
            for d in dst:
                d.meta[k] = src.meta[k]


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) else str(last)
    return re.sub(r"^L\['[^']*'\](\[\d+\])*\.?", "", path)  # Dynamo's source prefix, e.g. L['self'].


def _is_fused(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.fxopt.w4a16_linear.default


def _fused_parts(node: fx.Node):
    """(x, qweight, scales, zeros, group_size, bias) of a ``w4a16_linear`` node."""
    return tuple(match.get_arg(node, i, n) for i, n in enumerate(("x", "qweight", "scales", "zeros", "group_size",
                                                                   "bias")))


# From this many static rows (a prefill) dequantize + cuBLAS beat every fused kernel, and Inductor calls it with no
# Python of the fused op around it; below, the op's tuner times both routes.
DEQUANT_MATMUL_MIN_ROWS = 1024


def _left_to_cublas(use, dequant_matmul: str) -> Optional[str]:
    if dequant_matmul != "auto":
        return None
    rows = _rows(match.tensor_val(use.x))
    if rows is None or rows < DEQUANT_MATMUL_MIN_ROWS:
        return None
    return (f"{rows} rows: left as dequantize_w4 -> linear (a 16-bit W and cuBLAS beat the fused kernels from "
            f"{DEQUANT_MATMUL_MIN_ROWS} rows; kernels.w4a16_dequant_matmul='off' fuses it)")


# Up to this many rows (a decode step) one joint call for siblings saves launches; above it, it saves nothing and its
# output slices would cost copies of the activations.
GROUP_MAX_ROWS = 256


def _rows(xv) -> Optional[int]:
    """The number of rows of x [..., K] when static, else None."""
    if xv is None or not _static(*xv.shape[:-1]):
        return None
    return math.prod(int(d) for d in xv.shape[:-1])


def _group_siblings(graph: fx.Graph, result: PassResult) -> None:
    """Make ``w4a16_linear`` calls that read one input and adjacent column slices of one packed storage (the
    siblings of :func:`fxopt.quant.linear.share_sibling_storage`) one ``w4a16_linear_cat`` call, when proven from the
    graph (same x and group size, bias on all or none, :func:`column_span` of each packed tensor, inputs defined
    before the first call, no in-place write in between, at most ``GROUP_MAX_ROWS`` static rows). Each original
    output becomes a contiguous slice of the joint output."""
    from ..kernels.w4a16 import column_span

    order = {n: i for i, n in enumerate(graph.nodes)}
    by_input: dict = {}
    for node in graph.nodes:
        if _is_fused(node):
            x, _, _, _, g, bias = _fused_parts(node)
            by_input.setdefault((x, g, bias is None), []).append(node)
    for (x, g, no_bias), nodes in by_input.items():
        if len(nodes) < 2:
            continue
        rows = _rows(match.tensor_val(x))
        if rows is None or rows > GROUP_MAX_ROWS:
            log.debug("w4a16: %s not grouped: %s rows of input (joint calls pay off up to %d)",
                      [n.name for n in nodes], "symbolic" if rows is None else rows, GROUP_MAX_ROWS)
            continue
        # members in storage order: one run per storage, sorted by the qweight's offset
        runs: dict = {}
        for n in nodes:
            qv = match.tensor_val(_fused_parts(n)[1])
            if qv is None:
                continue
            runs.setdefault(StorageWeakRef(qv.untyped_storage()), []).append(n)
        if len(runs) == len(nodes):
            result.skip(nodes[0], f"{', '.join(n.name for n in nodes)} read one input, but their packed tensors sit "
                        f"in separate storages: separate calls (fxopt.quant.linear.share_sibling_storage lays "
                        f"siblings out side by side)")
        for members in runs.values():
            members.sort(key=lambda n: match.tensor_val(_fused_parts(n)[1]).storage_offset())
            if len(members) < 2:
                continue
            reason = _group_reason(members, order, column_span, no_bias)
            if reason is not None:
                result.skip(members[0], f"siblings {', '.join(m.name for m in members)} stay separate calls: "
                            + reason)
                continue
            _rewrite_group(graph, members, x, g, no_bias, result)


def _group_reason(members: list, order: dict, column_span, no_bias: bool) -> Optional[str]:
    parts = [_fused_parts(m) for m in members]
    for i, name in ((1, "qweight"), (2, "scales"), (3, "zeros")) + (() if no_bias else ((5, "bias"),)):
        vals = [match.tensor_val(p[i]) for p in parts]
        if any(v is None for v in vals) or column_span(vals) is None:
            return f"their {name} tensors are not adjacent slices of one storage"
    first, last = min(members, key=order.get), max(members, key=order.get)
    for p in parts:
        for a in (p[0], p[1], p[2], p[3], p[5]):
            if isinstance(a, fx.Node) and order[a] > order[first]:
                return f"{a.name} is defined after {first.name}"
    inputs = [parts[0][0]] + [a for p in parts for a in (p[1], p[2], p[3]) + (() if no_bias else (p[5],))]
    return _mutated_between(first, last, inputs)


def _rewrite_group(graph: fx.Graph, members: list, x, g, no_bias: bool, result: PassResult) -> None:
    parts = [_fused_parts(m) for m in members]
    first = min(members, key=lambda m: list(graph.nodes).index(m))
    args = (x, [p[1] for p in parts], [p[2] for p in parts], [p[3] for p in parts], g,
            [] if no_bias else [p[5] for p in parts])
    from torch._subclasses.fake_tensor import FakeTensor

    xv = match.tensor_val(x)
    mode = xv.fake_mode if isinstance(xv, FakeTensor) else None
    vals = [match.tensor_val(p[1]).shape[1] for p in parts]
    with graph.inserting_before(first):
        joint = graph.call_function(torch.ops.fxopt.w4a16_linear_cat.default, args)
    _copy_source(first, joint)
    col = 0
    for m, n_cols in zip(members, vals):
        with graph.inserting_before(first):  # ``first`` is erased only after the loop
            piece = graph.call_function(torch.narrow, (joint, -1, col, n_cols))
            out = graph.call_method("contiguous", (piece,))
        _copy_source(m, piece, out)
        out.meta["val"] = m.meta.get("val")
        col += n_cols
        m.replace_all_uses_with(out)
    for m in members:
        graph.erase_node(m)
    if mode is not None:
        def fake(a):
            return [match.tensor_val(t) for t in a] if isinstance(a, list) else match.val(a) \
                if isinstance(a, fx.Node) else a

        with mode:
            joint.meta["val"] = torch.ops.fxopt.w4a16_linear_cat(*[fake(a) for a in args])
            for piece in joint.users:
                piece.meta["val"] = torch.narrow(joint.meta["val"], -1, piece.args[2], piece.args[3])
    result.rewrites += 1
    result.notes.append(f"w4a16: {joint.name}: {len(members)} sibling linears in one call "
                        f"(N = {' + '.join(map(str, vals))}): {', '.join(_module_path(m) or m.name for m in members)}")
