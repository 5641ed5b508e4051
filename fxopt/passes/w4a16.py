"""The ``w4a16`` pass: fuse ``dequantize_w4 -> linear`` into ``torch.ops.fxopt.w4a16_linear``.

Design
------
:class:`fxopt.quant.QuantLinear` computes ``F.linear(x, dequantize_w4(qweight, scales, zeros, G), bias)``, so the
Dynamo graph of a quantized model holds a ``dequantize_w4`` node per quantized linear. Left alone, that
materializes a 16-bit weight in memory on every call; fused, the kernel reads the int4 weight once.

Candidates are the ``torch.ops.fxopt.dequantize_w4`` nodes. Each user of the dequantized weight ``W`` [N, K] must be
one of the spellings of ``x @ W.T (+ b)``:

* ``F.linear(x, W, b)`` / ``torch._C._nn.linear`` (what ``QuantLinear`` emits);
* ``matmul(x, Wt)`` / ``x @ Wt`` / ``torch.mm(x, Wt)`` with ``Wt`` one of ``W.t()``, ``W.T``, ``W.mT``,
  ``W.transpose(0, 1)`` (any spelling of the two dims), ``W.permute(1, 0)``, used only by that product;
* ``torch.addmm(b, x, Wt)`` with ``beta = alpha = 1``.

If any user is something else, ``W`` is needed in memory anyway and the candidate stays (reason: the weight is used
elsewhere). Otherwise each product is checked on ``meta["val"]`` and replaced by
``w4a16_linear(x, qweight, scales, zeros, G, bias)`` when all of these hold:

* ``x`` is fp16/bf16, with the dtype of ``scales`` and ``zeros``; 2-D or 3-D (the op's contract); ``x.shape[-1] = K``;
* the group size is a literal int the kernel supports (32, 64, 128 or K);
* ``x``, the packed tensors and the bias are on one device; the bias is [N] in ``x``'s dtype;
* ``scales`` / ``zeros`` need no gradient (the fused op gives none to them).

Everything else stays as it was, with a reason (``result.skip``). The new node gets ``meta["val"]`` by running the op's
fake implementation under the graph's fake mode, and inherits the replaced node's ``nn_module_stack`` /
``stack_trace``, so later passes (tensor parallel) still see which module it belongs to. The dequantize node (and a
transpose) are erased once unused. One note line per rewrite goes to ``result.notes``.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

import torch
import torch.fx as fx

from ..config import W4A16Config
from ..kernels import w4a16 as _w4a16_ops  # noqa: F401  registers torch.ops.fxopt.w4a16_linear / dequantize_w4
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
    if name == "transpose":
        if match.get_arg(node, 0, "input") is not src:
            return False
        d0, d1 = match.get_arg(node, 1, "dim0"), match.get_arg(node, 2, "dim1")
        return isinstance(d0, int) and isinstance(d1, int) and {d0 % 2, d1 % 2} == {0, 1}
    if name == "permute":
        if match.get_arg(node, 0, "input") is not src:
            return False
        dims = list(node.args[1:]) if len(node.args) > 1 else list(node.kwargs.get("dims", ()))
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = list(dims[0])
        return all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]
    return False


class _Use:
    """One product ``x @ W.T (+ bias)`` reading the dequantized weight."""

    def __init__(self, node: fx.Node, x, bias, transpose: Optional[fx.Node]):
        self.node, self.x, self.bias, self.transpose = node, x, bias, transpose


def _as_linear_use(user: fx.Node, w: fx.Node) -> Optional[_Use]:
    """Interpret ``user`` of the dequantized weight ``w`` as a linear product, or None."""
    if match.op_name(user) == "linear":
        x = match.get_arg(user, 0, "input")
        if match.get_arg(user, 1, "weight") is w and x is not w:
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


def _check(use: _Use, qweight, scales, zeros, group_size) -> Optional[str]:
    """Reason the product cannot be fused, or None if it can."""
    xv = match.tensor_val(use.x)
    qv, sv, zv = match.tensor_val(qweight), match.tensor_val(scales), match.tensor_val(zeros)
    if xv is None or qv is None or sv is None or zv is None:
        return "no tensor meta['val'] on the input or the packed weight"
    K, N = qv.shape[0] * PACK, qv.shape[1]
    if xv.dtype not in (torch.float16, torch.bfloat16):
        return f"activations are {xv.dtype}; w4a16_linear needs float16/bfloat16"
    if xv.dtype != sv.dtype or xv.dtype != zv.dtype:
        return f"activation dtype {xv.dtype} differs from scales/zeros dtype ({sv.dtype}, {zv.dtype})"
    if xv.dim() not in (2, 3):
        return f"input is {xv.dim()}-D; w4a16_linear takes 2-D or 3-D input"
    if xv.shape[-1] != K:
        return f"input has {xv.shape[-1]} features but the packed weight has K = {K}"
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        return f"group size is not a constant int ({group_size!r})"
    G = K if group_size == -1 else group_size
    if G not in _SUPPORTED_GROUPS and G != K:
        return f"group size {G} not supported by the kernel (32, 64, 128 or K = {K})"
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
        qweight = match.get_arg(dq, 0, "qweight")
        scales = match.get_arg(dq, 1, "scales")
        zeros = match.get_arg(dq, 2, "zeros")
        group_size = match.get_arg(dq, 3, "group_size")
        if not dq.users:
            result.skip(dq, "dequantized weight is unused")
            continue
        uses, others = [], []
        for u in list(dq.users):
            use = _as_linear_use(u, dq)
            if use is None:
                others.append(u)
            else:
                uses.append(use)
        if others:
            casts = [o for o in others if match.op_name(o) in ("to", "float", "half", "bfloat16", "type_as")]
            if casts and len(casts) == len(others):
                result.skip(dq, "dequantized weight is cast before use (activation dtype differs from the scales "
                            "dtype): " + ", ".join(_describe(o) for o in others))
            else:
                result.skip(dq, "dequantized weight is used elsewhere, so it must be materialized: "
                            + ", ".join(_describe(o) for o in others))
            continue
        for use in uses:
            reason = _check(use, qweight, scales, zeros, group_size)
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
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in use.node.meta:
                    new.meta[key] = use.node.meta[key]
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
    fp32 = [sk for sk in result.skipped if sk.reason.startswith("activations are torch.float32")]
    if fp32 and not result.rewrites:
        log.warning("w4a16: fused none of %d quantized linear(s): activations are float32 and the int4 kernels take "
                    "float16/bfloat16. Cast the model before compiling, e.g. model.to(torch.float16) (or "
                    "torch.bfloat16); in float32 the weights are dequantized on every call.", len(fp32))
    return result


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) else str(last)
    return re.sub(r"^L\['[^']*'\](\[\d+\])*\.?", "", path)  # Dynamo's source prefix, e.g. L['self'].

