"""What the attention pass reads off a graph: op names (ATen spellings included), casts and scalars, the in-place
writes of the graph (:class:`Mutations`), constants evaluated from the graph as it runs (:func:`const_eval`), and a
:class:`Builder` that creates a node only once its fake value is known."""
from __future__ import annotations

import contextlib
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ..match import tensor_val, val
from ..match import op_name as _torch_op_name

log = logging.getLogger(__name__)

aten = torch.ops.aten
# ATen ops user code calls read as the torch-level op of the same name (same operand positions and keywords);
# overloads that mean something else (``view.dtype``, ``div.*_mode``, ``_softmax``: see op_name) are left out.
_ATEN_NAMES = {
    aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.mul: "mul",
    aten.div.Tensor: "div", aten.div.Scalar: "div", aten.div: "div",  # rounding_mode is a keyword, checked
    aten.add.Tensor: "add", aten.add: "add",
    aten.bmm.default: "bmm", aten.bmm: "bmm", aten.matmul.default: "matmul", aten.matmul: "matmul",
    aten.softmax.int: "softmax", aten._safe_softmax.default: "softmax", aten._safe_softmax: "softmax",
    aten.transpose.int: "transpose", aten.permute.default: "permute", aten.permute: "permute",
    aten.t.default: "t", aten.view.default: "view", aten.reshape.default: "reshape", aten.reshape: "reshape",
    aten._unsafe_view.default: "reshape", aten.clone.default: "clone", aten.clone: "clone",
    aten.expand.default: "expand", aten.unsqueeze.default: "unsqueeze", aten.tanh.default: "tanh",
    aten.tanh: "tanh", aten.masked_fill.Scalar: "masked_fill", aten.masked_fill.Tensor: "masked_fill",
    aten.where.self: "where", aten.dropout.default: "dropout", aten.dropout: "dropout",
}
SAFE_SOFTMAX = (aten._safe_softmax.default, aten._safe_softmax)

MAX_EVAL_NUMEL = 1 << 24  # biggest intermediate tensor the mask prover will materialize
MAX_EVAL_NODES = 400  # biggest mask subgraph the prover will walk


def op_name(node: Any) -> Optional[str]:
    """:func:`fxopt.passes.match.op_name`, with the ATen ops of :data:`_ATEN_NAMES` read as their torch-level op."""
    if isinstance(node, fx.Node) and node.op == "call_function":
        try:
            name = _ATEN_NAMES.get(node.target)
        except TypeError:  # an unhashable target
            name = None
        if name is not None:
            return name
        if node.target is aten._softmax.default and len(node.args) == 3 and node.args[2] is False:
            return "softmax"  # half_to_float=False: softmax in the input's dtype
    return _torch_op_name(node)


_CASTS = ("to", "float", "half", "bfloat16", "type", "type_as")
_IMPURE_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "empty", "exponential", "multinomial",
                 "poisson", "seed", "print", "log_api")


def num(x: Any) -> Optional[float]:
    """``x`` as a float when it is a Python int or float (not a bool), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype a cast node produces (from its meta val), or None if ``node`` is not a pure dtype cast."""
    name = op_name(node)
    if name not in _CASTS:
        return None
    # .to(dtype) / .to(device) / .to(device, dtype) / .to(other): only dtype/device changes are casts here
    if name == "to" and any(isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values())):
        return None
    if name == "type" and (len(node.args) < 2 and "dtype" not in node.kwargs):
        return None
    v = tensor_val(node)
    return None if v is None else v.dtype


def scalar_value(x: Any, facts: GraphFacts) -> Optional[float]:
    """``x`` as a float: a number, or a 0-d tensor whose value the graph fixes (:func:`const_eval`); else None."""
    n = num(x)
    if n is not None:
        return n
    if isinstance(x, fx.Node):
        v = tensor_val(x)
        if v is not None and v.dim() == 0:
            c = const_eval(x, facts)
            if isinstance(c, torch.Tensor) and c.numel() == 1 and not c.dtype.is_complex:
                return float(c)
    return None


def sym_scalar(x: Any) -> Optional[fx.Node]:
    """``x`` when it is a graph node holding one number known only at run time: a (symbolic) Python number or a 0-d
    real tensor (it multiplies every score alike, so it moves onto q exactly, without changing q's dtype)."""
    if isinstance(x, fx.Node):
        v = val(x)
        if isinstance(v, (torch.SymInt, torch.SymFloat)) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return x
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.bool and not v.dtype.is_complex:
            return x
    return None


class Builder:
    """Inserts nodes before ``anchor`` and gives each one ``meta["val"]`` computed under the graph's fake mode."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, nodes: tuple):
        self.graph, self.anchor = graph, anchor
        self.mode = next((m for m in (getattr(tensor_val(n), "fake_mode", None) for n in nodes) if m is not None),
                         None)
        self.created: list[fx.Node] = []

    def call(self, target, args=(), kwargs=None, method: bool = False) -> fx.Node:
        kwargs = kwargs or {}
        fargs, fkwargs = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.mode if self.mode is not None else contextlib.nullcontext():
            if method:
                value = getattr(fargs[0], target)(*fargs[1:], **fkwargs)
            else:
                value = target(*fargs, **fkwargs)
        # the node exists only once its value could be computed: a failed check leaves no half-built node
        with self.graph.inserting_before(self.anchor):
            node = (self.graph.call_method if method else self.graph.call_function)(target, tuple(args), kwargs)
        node.meta["val"] = value
        node.meta["example_value"] = value
        src = self.anchor.meta.get("stack_trace")
        if src:
            node.meta["stack_trace"] = src
        self.created.append(node)
        return node

    def undo(self) -> None:
        """Erase the nodes this builder created (none of them is used once the original stays)."""
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)


_INPLACE_FUNCTIONS = {operator.setitem: "setitem", operator.iadd: "add", operator.isub: "sub", operator.imul: "mul",
                      operator.itruediv: "div", operator.iand: "and", operator.ior: "or", operator.ixor: "xor"}
_INPLACE_BASE = {"add_": "add", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill", "__iadd__": "add",
                 "__imul__": "mul", "__itruediv__": "div"}
# ops whose result never shares memory with an input (everything else is assumed to alias its first input)
_FRESH = {"matmul", "bmm", "einsum", "baddbmm", "mul", "div", "add", "sub", "neg", "invert", "softmax", "masked_fill",
          "where", "tanh", "sqrt", "linear", "sdpa", "clone", "tril", "triu", "ones", "zeros", "full", "arange",
          "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "cat", "stack", "exp"}
_FRESH_TARGETS = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
                  operator.or_, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_and,
                  torch.logical_or, torch.tril, torch.triu, torch.ones, torch.zeros, torch.full, torch.arange,
                  torch.cat, torch.stack, torch.exp, torch.clone}


def _mutated_arg(n: fx.Node) -> Optional[fx.Node]:
    """The tensor ``n`` writes in place (``x.add_``, ``x[i] = y``, ``x += y``, ``out=``, ``inplace=True``), or None."""
    if n.op not in ("call_function", "call_method"):
        return None
    first = n.args[0] if n.args else None
    if isinstance(n.kwargs.get("out"), fx.Node):
        return n.kwargs["out"]
    if n.op == "call_method":
        t = n.target
        mutates = (t.endswith("_") and not t.startswith("__")) or t in ("__setitem__", "__iadd__", "__isub__",
                                                                       "__imul__", "__itruediv__")
    elif n.target in _INPLACE_FUNCTIONS:
        mutates = True
    elif isinstance(n.target, torch._ops.OpOverload):
        mutates = n.target._schema.is_mutable
    else:
        name = getattr(n.target, "__name__", "")
        mutates = name.endswith("_") and not name.startswith("_") and n.target not in (
            operator.and_, operator.or_, operator.not_, operator.inv, operator.invert)
    if n.kwargs.get("inplace") is True:
        mutates = True
    return first if mutates and isinstance(first, fx.Node) else None


def _is_fresh(n: fx.Node) -> bool:
    if n.op not in ("call_function", "call_method"):
        return True
    if n.op == "call_function" and n.target in _FRESH_TARGETS:
        return True
    return op_name(n) in _FRESH


class Mutations:
    """Every in-place write of a graph and which values it may change (alias classes, found conservatively: an op
    not known to return fresh memory aliases its first input). An exact in-place form of a functional op on a fresh,
    otherwise unused intermediate (:func:`_functional_inplace`) is not a mutation here."""

    def __init__(self, graph: fx.Graph):
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.parent: dict = {}
        self.writes: list = []  # (node, root of the value it writes)
        for n in graph.nodes:
            first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if first is not None and (_mutated_arg(n) is not None or not _is_fresh(n)):
                self._union(n, first)
        for n in graph.nodes:
            t = _mutated_arg(n)
            if t is not None and _functional_inplace(n) is None:
                self.writes.append((n, self._root(t)))

    def _root(self, n):
        while self.parent.get(n, n) is not n:
            n = self.parent[n]
        return n

    def _union(self, a, b):
        ra, rb = self._root(a), self._root(b)
        if ra is not rb:
            self.parent[ra] = rb

    def touching(self, nodes, lo: int = -1, hi: Optional[int] = None) -> Optional[fx.Node]:
        """A write at a position in (lo, hi) to a value that may alias one of ``nodes``, or None."""
        roots = {self._root(n) for n in nodes if isinstance(n, fx.Node)}
        for w, r in self.writes:
            p = self.pos.get(w, -1)
            if r in roots and p > lo and (hi is None or p < hi):
                return w
        return None


def _functional_inplace(n: fx.Node) -> Optional[str]:
    """Base op name when ``n`` writes in place into a fresh intermediate that nothing else reads (exactly its
    functional form), else None."""
    if n.op == "call_function":
        base = _INPLACE_FUNCTIONS.get(n.target)
    elif n.op == "call_method":
        base = _INPLACE_BASE.get(n.target)
    else:
        base = None
    if base not in ("add", "mul", "div", "sub", "masked_fill"):
        return None
    x = n.args[0] if n.args else None
    if not isinstance(x, fx.Node) or len(x.users) != 1 or not _is_fresh(x) or x.op == "placeholder":
        return None
    if _mutated_arg(x) is not None and _functional_inplace(x) is None:
        return None
    return base


def node_name(n: Any) -> Optional[str]:
    """``op_name``, with an exact in-place form (:func:`_functional_inplace`) read as its functional op."""
    base = _functional_inplace(n) if isinstance(n, fx.Node) else None
    return base or op_name(n)


@dataclass
class GraphFacts:
    """What the pass knows of one graph: its in-place writes and the constants evaluated so far (None: not one)."""

    mutations: Mutations
    values: dict = field(default_factory=dict)


def unwritten_ancestors(node: fx.Node, facts: GraphFacts) -> Optional[list[fx.Node]]:
    """:func:`ancestors`, or None when one of them is written in place somewhere (its compile-time value is not the
    value the graph reads)."""
    nodes = ancestors(node)
    return None if nodes is None or facts.mutations.touching(nodes) is not None else nodes


def ancestors(node: fx.Node, limit: int = MAX_EVAL_NODES) -> Optional[list[fx.Node]]:
    """All ancestors of ``node`` (itself included) in graph order, or None past ``limit`` nodes."""
    seen: set = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def is_pure_eval_target(n: fx.Node) -> bool:
    """Whether evaluating ``n`` writes nothing and draws no random numbers (by its target's name)."""
    if n.op not in ("call_function", "call_method"):
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    name = str(name).lower()
    if n.op == "call_method" and name.endswith("_") and not name.endswith("__"):
        return False  # in-place method
    return not any(w in name for w in _IMPURE_WORDS)


def _eval_node(n: fx.Node, env: dict) -> Any:
    def get(a):
        if isinstance(a, fx.Node):
            return env[a]
        return torch.device("cpu") if isinstance(a, torch.device) else a

    args = tuple(fx.node.map_aggregate(n.args, get))
    kwargs = dict(fx.node.map_aggregate(n.kwargs, get))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    if n.op == "call_method":
        if n.target == "to":  # drop device-only moves, keep dtype casts
            args = tuple(a if not isinstance(a, str) else torch.device("cpu") for a in args)
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def try_eval(n: fx.Node, env: dict) -> bool:
    """Evaluate ``n`` into ``env`` on CPU; False (nothing provable here) if it fails or grows too big."""
    try:
        with torch.no_grad():
            env[n] = _eval_node(n, env)
    except Exception as e:  # noqa: BLE001  (any failure means: not provable here)
        log.debug("mask prover could not evaluate %s: %s", n.format_node(), e)
        return False
    v = env[n]
    return not (isinstance(v, torch.Tensor) and v.numel() > MAX_EVAL_NUMEL)


def const_eval(node: fx.Node, facts: GraphFacts) -> Optional[Any]:
    """Value of ``node`` when it depends on no graph input (only constants and shapes), evaluated on CPU; else None."""
    if node in facts.values:
        return facts.values[node]
    facts.values[node] = None
    nodes = unwritten_ancestors(node, facts)
    if nodes is None:
        return None
    env: dict = {}
    for n in nodes:
        if not is_pure_eval_target(n) or not try_eval(n, env):
            return None
    facts.values[node] = env[node]
    return env[node]
