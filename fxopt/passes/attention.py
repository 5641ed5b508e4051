"""Attention pass: SDPA and hand-written attention → ``torch.ops.fxopt.flash_attention``.

Matching (on Dynamo's torch-level graph, through :mod:`fxopt.passes.match`):

* ``F.scaled_dot_product_attention`` (every argument). SDPA's ``is_causal`` is top-left aligned, the kernel's
  bottom-right: they agree when Sq == Sk; otherwise an explicit ``ones(Sq, Sk).tril()`` mask is built.
* Hand-written attention, anchored at each softmax over the last dim::

      QK  = matmul(q, kᵀ) | bmm | einsum          (q, kᵀ may carry a scalar mul/div: number, sqrt(d), math.sqrt)
      s   = QK [* c | / c]... [softcap: tanh(s / c) * c] [+ mask | masked_fill(m, fill) | where(m, s, fill)]...
      p   = softmax(s [.float()], -1 [, dtype]) [.to(dtype)] [dropout(p, training)]
      out = matmul(p, v) | bmm | einsum

  Casts in the score chain may only go to float32 or to q's dtype (the kernel computes scores in fp32); a softmax
  ``dtype`` is a cast of its input. A scale may be a number, a SymInt / SymFloat or any 0-d real tensor (known only
  at run time: it moves onto q, where it scales every score alike).
  3-D bmm graphs [B*H, S, D] run as one batch of B*H heads; einsum operands are permuted into [B, H, S, D].
  Views that only split or merge the batch dims ([A*C, Sq, Sk] <-> [A, C, Sq, Sk], ``expand`` to the same shape) may
  sit anywhere on the scores and probabilities (Inductor's MBart form): the op then runs on [A, C, S, D] (3-D q/k/v
  unflattened, a 3-D output flattened back); a view moving query or key positions, or a mask over the merged A*C
  dim applied to 3-D scores, leaves the region.
* ATen spellings written in the model (``torch.ops.aten.mul.Scalar``, ``div.Tensor``, ``bmm``, ``view``,
  ``_softmax``, ``_safe_softmax``..., see ``_ATEN_NAMES``) read as the torch-level op. The pass only ever sees
  Dynamo's torch-level graph: the matmul decompositions (expand / clone / ``_unsafe_view`` around ``bmm``) are made
  by AOTAutograd after it, so ATen ops reach it only where user code calls them. ``_safe_softmax`` gives 0 on a row
  of -inf (the op's own value, no NaN policy).
* repeat_kv (``x[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, Hkv*rep, S, D)`` or ``repeat_interleave`` on dim
  1) on *both* k and v is dropped: the kernel does GQA natively (query head h reads kv head h // rep).

Masks. Every mask on the score chain is turned into a conjunction of "keep" literals (bool, True = attend) with a
fill value (``-inf`` for bool / masked_fill(-inf) / SDPA bool masks; a finite fill such as ``finfo.min``) plus
additive float masks. transformers' eager additive mask ``where(bool_mask, 0, fill)`` is read as a keep literal.
With ``cfg.lower_masks`` each keep literal is analysed:

* a subgraph with no data-dependent input (only constants, sizes, ``arange``...) is *evaluated* on CPU for the
  captured shapes (Dynamo guards re-capture on a shape change, so the proof holds for the graph it is made on) and
  compared with the causal (bottom-right), sliding-window and all-True patterns;
* a subgraph reading exactly one placeholder P [B, L] through gathers only (indexing with constant indices,
  unsqueeze/view/expand/permute, casts to bool, device moves) is evaluated on an index probe (``arange`` in P's
  shape, casts skipped: casting commutes with gathering); when the gathered index is ``b * L + j`` everywhere the
  literal is ``key_padding_mask = P[:, :Sk].bool()``.

If everything lowers, the kernel gets ``is_causal`` / ``window`` / ``key_padding_mask`` and no S×S tensor.

Exactness. A region is rewritten only when every node in it is accounted for:

* a fill counts as a mask only when it is -inf or <= finfo(dtype).min of the scores it is written into (0, 5,
  +inf, NaN, -1e4... change the softmax and leave the region as it was);
* every cast on the scores / probabilities goes to float32, float64 or q's dtype (a bool, int or bf16 round trip
  is not the kernel's arithmetic);
* no in-place write (``_Mutations``: in-place methods, ``x[i] = y``, ``out=``) to a value aliasing what the op
  reads, between the region's first node and the op, nor to an intermediate; the mask prover never evaluates a
  subgraph touched by a write. ``s += mask`` on a fresh, otherwise unused intermediate is its functional form;
* rows where every key may be masked get eager's value: NaN for -inf fills (with eager's NaN gradient pattern in
  training), the mean of v for one finite fill (with the softmax's gradient at p = 1/n for an additive fill, written
  through Kᵀ V); the op's lse (+inf on such rows) says which rows. Where eager's value cannot be reproduced (mixed
  fills, several additive fills, float16 additive masks, softcap in training) the region stays, with the reason;
* empty dims stay out of the kernels; the output gets the strides of the original; symbolic scales (SymInt /
  SymFloat) multiply q, so the op's float scale never specialises them; a node is created only after its fake
  value was computed.

Activation-checkpoint bodies (``tag_activation_checkpoint``) are rewritten as well, except with dropout.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ..config import AttentionConfig
from .manager import PassContext, PassResult, register_pass
from .match import get_arg, tensor_val
from .match import op_name as _torch_op_name

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# ATen ops in a Dynamo graph (user code calling ``torch.ops.aten.*``, as Inductor's own patterns are written) read as
# the torch-level op of the same name: each one takes its operands in the same positions and keywords. Overloads that
# mean something else (``view.dtype``: a bitcast; ``div.*_mode``: rounding; ``_softmax`` with half_to_float, read by
# :func:`op_name` itself) are left out.
_ATEN_NAMES = {
    _aten.mul.Tensor: "mul", _aten.mul.Scalar: "mul", _aten.mul: "mul",
    _aten.div.Tensor: "div", _aten.div.Scalar: "div", _aten.div: "div",  # rounding_mode is a keyword, checked
    _aten.add.Tensor: "add", _aten.add: "add",
    _aten.bmm.default: "bmm", _aten.bmm: "bmm", _aten.matmul.default: "matmul", _aten.matmul: "matmul",
    _aten.softmax.int: "softmax", _aten._safe_softmax.default: "softmax", _aten._safe_softmax: "softmax",
    _aten.transpose.int: "transpose", _aten.permute.default: "permute", _aten.permute: "permute",
    _aten.t.default: "t", _aten.view.default: "view", _aten.reshape.default: "reshape", _aten.reshape: "reshape",
    _aten._unsafe_view.default: "reshape", _aten.clone.default: "clone", _aten.clone: "clone",
    _aten.expand.default: "expand", _aten.unsqueeze.default: "unsqueeze", _aten.tanh.default: "tanh",
    _aten.tanh: "tanh", _aten.masked_fill.Scalar: "masked_fill", _aten.masked_fill.Tensor: "masked_fill",
    _aten.where.self: "where", _aten.dropout.default: "dropout", _aten.dropout: "dropout",
}
_SAFE_SOFTMAX = (_aten._safe_softmax.default, _aten._safe_softmax)


def op_name(node: Any) -> Optional[str]:
    """:func:`fxopt.passes.match.op_name`, with the ATen ops of :data:`_ATEN_NAMES` read as their torch-level op."""
    if isinstance(node, fx.Node) and node.op == "call_function":
        try:
            name = _ATEN_NAMES.get(node.target)
        except TypeError:  # an unhashable target
            name = None
        if name is not None:
            return name
        if node.target is _aten._softmax.default and len(node.args) == 3 and node.args[2] is False:
            return "softmax"  # half_to_float=False: softmax in the input's dtype
    return _torch_op_name(node)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_EVAL_NUMEL = 1 << 24  # biggest intermediate tensor the mask prover will materialize
_MAX_EVAL_NODES = 400  # biggest mask subgraph the prover will walk


def _flash_op():
    """``torch.ops.fxopt.flash_attention.default`` or None when the kernel module cannot be imported."""
    try:
        import fxopt.kernels.ops  # noqa: F401
    except ImportError as e:  # another kernel module missing: the attention op alone is enough
        log.debug("fxopt.kernels.ops not importable (%s); importing fxopt.kernels.attention", e)
        try:
            import fxopt.kernels.attention  # noqa: F401
        except ImportError as e2:
            log.warning("attention pass: flash_attention op unavailable: %s", e2)
            return None
    op = getattr(torch.ops.fxopt, "flash_attention", None)
    return None if op is None else op.default


# ----------------------------------------------------------------------------------------------------------------
# small graph helpers
# ----------------------------------------------------------------------------------------------------------------

_CASTS = ("to", "float", "half", "bfloat16", "type", "type_as")
_IMPURE_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "empty", "exponential", "multinomial",
                 "poisson", "seed", "print", "log_api")


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype a cast node produces (from its meta val), or None if ``node`` is not a pure dtype cast."""
    name = op_name(node)
    if name not in _CASTS:
        return None
    if name == "to":
        # .to(dtype) / .to(device) / .to(device, dtype) / .to(other): only dtype/device changes are casts here
        for a in list(node.args[1:]) + list(node.kwargs.values()):
            if isinstance(a, fx.Node):
                return None
    if name == "type" and (len(node.args) < 2 and "dtype" not in node.kwargs):
        return None
    v = tensor_val(node)
    return None if v is None else v.dtype


def _fake_mode(*nodes):
    for n in nodes:
        v = tensor_val(n)
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


class _Builder:
    """Inserts nodes before ``anchor`` and gives each one ``meta["val"]`` computed under the graph's fake mode."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, mode):
        self.graph, self.anchor, self.mode = graph, anchor, mode
        self.created: list[fx.Node] = []

    def call(self, target, args=(), kwargs=None, method: bool = False) -> fx.Node:
        kwargs = kwargs or {}

        def to_val(a):
            return a.meta["val"] if isinstance(a, fx.Node) else a

        fargs = fx.node.map_aggregate(args, to_val)
        fkwargs = fx.node.map_aggregate(kwargs, to_val)
        ctx = self.mode if self.mode is not None else _nullctx()
        with ctx:
            if method:
                val = getattr(fargs[0], target)(*fargs[1:], **fkwargs)
            else:
                val = target(*fargs, **fkwargs)
        # the node exists only once its value could be computed: a failed check leaves no half-built node
        with self.graph.inserting_before(self.anchor):
            node = (self.graph.call_method if method else self.graph.call_function)(target, tuple(args), kwargs)
        node.meta["val"] = val
        node.meta["example_value"] = val
        src = self.anchor.meta.get("stack_trace")
        if src:
            node.meta["stack_trace"] = src
        self.created.append(node)
        return node


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


# ----------------------------------------------------------------------------------------------------------------
# mutations
# ----------------------------------------------------------------------------------------------------------------

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
    mutates = False
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


class _Mutations:
    """Every in-place write of a graph and which values it may change (alias classes, found conservatively: any op
    not known to return fresh memory is taken to alias its first input).

    An in-place op on a fresh, otherwise unused intermediate (``s = q @ kᵀ; s += mask``) changes nothing anyone else
    reads: it is taken as its functional form (:func:`_functional_inplace`) and is not a mutation here."""

    def __init__(self, graph: fx.Graph):
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.parent: dict = {}
        self.writes: list = []  # (node, root of the value it writes)
        for n in graph.nodes:
            first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if first is not None and (_mutated_arg(n) is not None or not self._fresh(n)):
                self._union(n, first)
        for n in graph.nodes:
            t = _mutated_arg(n)
            if t is not None and _functional_inplace(n) is None:
                self.writes.append((n, self._root(t)))

    @staticmethod
    def _fresh(n: fx.Node) -> bool:
        if n.op not in ("call_function", "call_method"):
            return True
        if n.op == "call_function" and n.target in _FRESH_TARGETS:
            return True
        return op_name(n) in _FRESH

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
    if not isinstance(x, fx.Node) or len(x.users) != 1 or not _Mutations._fresh(x) or x.op == "placeholder":
        return None
    if _mutated_arg(x) is not None and _functional_inplace(x) is None:
        return None
    return base


def _node_name(n: Any) -> Optional[str]:
    """``op_name``, with an exact in-place form (:func:`_functional_inplace`) read as its functional op."""
    base = _functional_inplace(n) if isinstance(n, fx.Node) else None
    return base or op_name(n)


# ----------------------------------------------------------------------------------------------------------------
# constant evaluation (the mask prover)
# ----------------------------------------------------------------------------------------------------------------


def _ancestors(node: fx.Node, limit: int = _MAX_EVAL_NODES) -> Optional[list[fx.Node]]:
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


def _is_pure_eval_target(n: fx.Node) -> bool:
    if n.op not in ("call_function", "call_method"):
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    name = str(name).lower()
    if n.op == "call_method" and name.endswith("_") and not name.endswith("__"):
        return False  # in-place method
    return not any(w in name for w in _IMPURE_WORDS)


def _cpu_args(x: Any) -> Any:
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


def _eval_node(n: fx.Node, env: dict) -> Any:
    def get(a):
        if isinstance(a, fx.Node):
            return env[a]
        return _cpu_args(a)

    args = tuple(fx.node.map_aggregate(n.args, get))
    kwargs = dict(fx.node.map_aggregate(n.kwargs, get))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    if n.op == "call_method":
        if n.target == "to":  # drop device-only moves, keep dtype casts
            args = tuple(a if not isinstance(a, str) else torch.device("cpu") for a in args)
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def _too_big(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() > _MAX_EVAL_NUMEL


def _try_eval(n: fx.Node, env: dict) -> bool:
    """Evaluate ``n`` into ``env`` on CPU; False (nothing provable here) if it fails or grows too big."""
    try:
        with torch.no_grad():
            env[n] = _eval_node(n, env)
    except Exception as e:  # noqa: BLE001  (any failure means: not provable here)
        log.debug("mask prover could not evaluate %s: %s", n.format_node(), e)
        return False
    return not _too_big(env[n])


def _const_eval(node: fx.Node, cache: dict) -> Optional[Any]:
    """Value of ``node`` when it depends on no graph input (only constants and shapes), evaluated on CPU; else None."""
    if node in cache:
        return cache[node]
    cache[node] = None
    nodes = _ancestors(node)
    if nodes is None:
        return None
    muts = cache.get("__mutations__")
    if muts is not None and muts.touching(nodes) is not None:
        return None  # written in place somewhere: its compile-time value is not the value the graph reads
    env: dict = {}
    for n in nodes:
        if not _is_pure_eval_target(n):
            return None
        if not _try_eval(n, env):
            return None
    cache[node] = env[node]
    return env[node]


_GATHER_METHODS = {"getitem", "unsqueeze", "view", "reshape", "expand", "contiguous", "permute", "transpose",
                   "clone", "to", "bool", "expand_as", "squeeze", "flatten"}


def _padding_probe(node: fx.Node, cache: dict) -> Optional[tuple[fx.Node, torch.Tensor]]:
    """If ``node`` is ``bool(P)`` gathered with constant indices from one placeholder P, return (P, index map)."""
    nodes = _ancestors(node)
    if nodes is None:
        return None
    muts = cache.get("__mutations__")
    if muts is not None and muts.touching(nodes) is not None:
        return None
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return None
    p = placeholders[0]
    pv = tensor_val(p)
    v = tensor_val(node)
    if pv is None or v is None or pv.dim() != 2 or v.dtype != torch.bool:
        return None
    dep = {p}
    env: dict = {p: torch.arange(pv.numel(), dtype=torch.int64).view(tuple(pv.shape))}
    for n in nodes:
        if n is p:
            continue
        if not any(a in dep for a in n.all_input_nodes):
            if not _is_pure_eval_target(n):
                return None
            if not _try_eval(n, env):
                return None
            continue
        dep.add(n)
        name = op_name(n)
        if name not in _GATHER_METHODS or n.op == "placeholder":
            return None
        # only the gathered tensor may depend on P (indices, sizes must be constant)
        first = n.args[0] if n.args else None
        if first not in dep or any(a in dep for a in n.all_input_nodes if a is not first):
            return None
        if name in ("to", "bool"):
            nv = tensor_val(n)
            if nv is None or (nv.dtype != torch.bool and nv.dtype != tensor_val(first).dtype):
                return None  # only casts to bool (elementwise != 0) or device moves commute with the probe
            env[n] = env[first]
            continue
        if name == "getitem":
            idx = n.args[1]
            if isinstance(idx, fx.Node) and idx in dep:
                return None
        if not _try_eval(n, env):
            return None
    out = env.get(node)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int64:
        return None
    return p, out


# ----------------------------------------------------------------------------------------------------------------
# mask description
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Keep:
    """A bool literal of the mask: ``node`` (True = attend), negated when ``negate``."""

    node: fx.Node
    negate: bool = False


@dataclass
class _Masks:
    keeps: list = field(default_factory=list)  # list[_Keep]
    fills: list = field(default_factory=list)  # fill value per replacement (float; -inf for bool semantics)
    additive: list = field(default_factory=list)  # float mask nodes, added to the scores
    additive_first: bool = True  # all additive masks are applied before every replacement (closer to QK)


@dataclass
class _Lowered:
    is_causal: bool = False
    window: int = -1
    kpm: Optional[fx.Node] = None  # placeholder P; key_padding_mask = P[:, :Sk].bool()
    kpm_len: int = 0
    const_has_empty_row: bool = False


def _analyze_keep(lit: _Keep, cache: dict, shape4: tuple) -> Optional[tuple[Optional[torch.Tensor], list]]:
    """Split ``lit`` into (constant bool tensor or None, [(placeholder, index map)]) or None if not provable."""
    const_parts: list[torch.Tensor] = []
    pads: list = []

    def visit(n: Any, positive: bool) -> bool:
        if not isinstance(n, fx.Node):
            return False
        c = _const_eval(n, cache)
        if isinstance(c, torch.Tensor) and c.dtype == torch.bool:
            const_parts.append(c if positive else ~c)
            return True
        name = op_name(n)
        v = tensor_val(n)
        if name in ("and_",) or n.target in (operator.and_, torch.logical_and, torch.bitwise_and) or \
                (n.op == "call_method" and n.target in ("__and__", "logical_and", "bitwise_and")):
            if not positive or v is None or v.dtype != torch.bool:
                return False
            return visit(n.args[0], True) and visit(n.args[1], True)
        if n.target in (operator.or_, torch.logical_or, torch.bitwise_or) or \
                (n.op == "call_method" and n.target in ("__or__", "logical_or", "bitwise_or")):
            if positive or v is None or v.dtype != torch.bool:
                return False
            return visit(n.args[0], False) and visit(n.args[1], False)
        if name == "invert" or (n.op == "call_method" and n.target in ("logical_not", "bitwise_not", "__invert__")):
            src = tensor_val(n.args[0])
            if src is None or src.dtype != torch.bool:
                return False
            return visit(n.args[0], not positive)
        if n.target in (operator.eq, torch.eq) or (n.op == "call_method" and n.target in ("eq", "__eq__")):
            if _num(n.args[1]) == 0.0 and isinstance(n.args[0], fx.Node):
                return visit_bool(n.args[0], not positive)
            return False
        if n.target in (operator.ne, torch.ne) or (n.op == "call_method" and n.target in ("ne", "__ne__")):
            if _num(n.args[1]) == 0.0 and isinstance(n.args[0], fx.Node):
                return visit_bool(n.args[0], positive)
            return False
        if name in ("to", "contiguous", "expand") and v is not None and v.dtype == torch.bool \
                and tensor_val(n.args[0]) is not None and tensor_val(n.args[0]).dtype == torch.bool:
            return visit(n.args[0], positive)
        if positive:
            probe = _padding_probe(n, cache)
            if probe is not None:
                pads.append(probe)
                return True
        return False

    def visit_bool(n: fx.Node, positive: bool) -> bool:
        # n is any numeric tensor; the literal is bool(n) (== n != 0)
        v = tensor_val(n)
        if v is None:
            return False
        if v.dtype == torch.bool:
            return visit(n, positive)
        c = _const_eval(n, cache)
        if isinstance(c, torch.Tensor):
            b = c != 0
            const_parts.append(b if positive else ~b)
            return True
        if positive:
            probe = _padding_probe_bool(n, cache)
            if probe is not None:
                pads.append(probe)
                return True
        return False

    if not visit(lit.node, not lit.negate):
        return None
    const = None
    for c in const_parts:
        try:
            const = c if const is None else (const & c)
        except RuntimeError:
            return None
    return const, pads


def _padding_probe_bool(n: fx.Node, cache: dict):
    """Padding literal ``P[...] != 0`` where the gathered tensor is numeric (the cast to bool is implicit)."""
    nodes = _ancestors(n)
    if nodes is None:
        return None
    # reuse _padding_probe by treating n as if it were cast to bool: check its chain with a relaxed dtype rule
    v = tensor_val(n)
    if v is None:
        return None
    fake = dict(n.meta)
    n.meta["val"] = torch.empty(v.shape, dtype=torch.bool, device="meta")
    try:
        return _padding_probe(n, cache)
    finally:
        n.meta.clear()
        n.meta.update(fake)


def _lower(masks: _Masks, cache: dict, shape4: tuple, bh_layout: bool) -> tuple[Optional[_Lowered], str]:
    """Prove the keep literals are causal / window / key padding; (None, reason) when not provable."""
    B, H, Sq, Sk = shape4
    const = None
    pads: list = []
    for lit in masks.keeps:
        got = _analyze_keep(lit, cache, shape4)
        if got is None:
            return None, "mask is not a provable causal/window/padding pattern"
        c, p = got
        if c is not None:
            const = c if const is None else const & c
        pads += p
    low = _Lowered()
    if const is not None:
        if const.dim() > 4:
            return None, "mask has more than 4 dims"
        c4 = const.reshape((1,) * (4 - const.dim()) + tuple(const.shape))
        try:
            c4 = torch.broadcast_to(c4, (c4.shape[0], c4.shape[1], Sq, Sk))
        except RuntimeError:
            return None, "constant mask does not broadcast to [Sq, Sk]"
        for d, full in ((0, B), (1, H)):
            if c4.shape[d] not in (1, full):
                return None, "constant mask does not broadcast to the scores"
        flat = c4.reshape(-1, Sq, Sk)
        c2 = flat[0]
        if not bool((flat == c2).all()):
            return None, "constant mask differs across batch/heads"
        i = torch.arange(Sq)[:, None]
        j = torch.arange(Sk)[None, :]
        off = Sk - Sq
        causal = j <= i + off
        if bool(c2.all()):
            pass
        elif torch.equal(c2, causal):
            low.is_causal = True
        else:
            w = int(c2.sum(-1).max())
            if w >= 1 and torch.equal(c2, causal & (i + off - j < w)):
                low.is_causal, low.window = True, w
            else:
                return None, "constant mask is neither causal (bottom-right) nor a sliding window"
        low.const_has_empty_row = not bool(c2.any(-1).all())
    if pads:
        if not bh_layout:
            return None, "padding mask on a 3-D (bmm) layout"
        ps = {p for p, _ in pads}
        if len(ps) != 1:
            return None, "padding literals read different inputs"
        (p,) = ps
        L = tensor_val(p).shape[1]
        if tensor_val(p).shape[0] != B or L < Sk:
            return None, "padding input does not match [B, Sk]"
        expect = (torch.arange(B)[:, None, None, None] * L + torch.arange(Sk)[None, None, None, :]).expand(B, H, Sq, Sk)
        for _, g in pads:
            if g.dim() > 4:
                return None, "padding mask has more than 4 dims"
            g4 = g.reshape((1,) * (4 - g.dim()) + tuple(g.shape))
            try:
                g4 = torch.broadcast_to(g4, (B, H, Sq, Sk))
            except RuntimeError:
                return None, "padding mask does not broadcast to the scores"
            if not torch.equal(g4, expect):
                return None, "gathered padding is not P[b, j]"
        low.kpm, low.kpm_len = p, L
    return low, ""


# ----------------------------------------------------------------------------------------------------------------
# matching
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Match:
    q: fx.Node
    k: fx.Node  # [.., Sk, D] layout (not transposed)
    v: fx.Node
    out: fx.Node  # node whose uses are replaced
    scale: Optional[float] = None  # None = 1/sqrt(D)
    softcap: float = 0.0
    dropout_p: float = 0.0
    masks: _Masks = field(default_factory=_Masks)
    sdpa_causal: bool = False  # SDPA's (top-left) is_causal
    q_perm: Optional[list] = None  # einsum: permute q into [B, H, S, D]
    k_perm: Optional[list] = None
    v_perm: Optional[list] = None
    out_perm: Optional[list] = None  # permute the op output into the graph's layout
    three_d: bool = False
    matched: list = field(default_factory=list)  # nodes replaced (erased if unused)
    k_is_kt: bool = False  # k node is kᵀ [.., D, Sk]: insert a transpose
    scale_syms: list = field(default_factory=list)  # (node, divides): symbolic (SymInt / SymFloat) scale factors
    casts: list = field(default_factory=list)  # dtypes of every cast matched on the scores / probabilities
    safe_softmax: bool = False  # aten._safe_softmax: a row of -inf gives 0, not NaN
    heads: Optional[int] = None  # C when the chain views [A*C, Sq, Sk] as [A, C, Sq, Sk]: 3-D q/k/v/out unflattened
    add_dtypes: list = field(default_factory=list)  # dtype of the scores each additive mask is added into


class _Layout:
    """Views of the scores / probabilities that only split or merge the batch dims: [A*C, Sq, Sk] <-> [A, C, Sq, Sk]
    (row-major, as ``view`` / ``reshape`` always are: index n of the merged dim is (n // C, n % C)), and ``expand`` to
    the same shape. Every element keeps its (query, key) position, so the softmax over keys and every elementwise
    op commute with them; each split must agree on C."""

    def __init__(self):
        self.heads: Optional[int] = None

    def step(self, node: fx.Node, src: Optional[torch.Tensor], dst: Optional[torch.Tensor]) -> str:
        if src is None or dst is None:
            return "no meta val on a view of the scores"
        if op_name(node) == "expand":
            return "" if tuple(src.shape) == tuple(dst.shape) else "expand of the scores to another shape"
        if node.target is _aten.view.default or node.op == "call_method" and node.target == "view":
            if any(isinstance(a, torch.dtype) for a in node.args[1:]):
                return "view of the scores as another dtype"
        if tuple(src.shape) == tuple(dst.shape):
            return ""
        if src.dim() + dst.dim() != 7 or tuple(src.shape[-2:]) != tuple(dst.shape[-2:]):
            return f"view of the scores {tuple(src.shape)} -> {tuple(dst.shape)} moves the query or key dims"
        four = src if src.dim() == 4 else dst
        three = dst if four is src else src
        heads = four.shape[1]
        if not isinstance(heads, int):
            return "view of the scores with a dynamic head count"
        if four.shape[0] * heads != three.shape[0]:
            return "view of the scores changes the batch size"
        if self.heads is not None and self.heads != heads:
            return f"views of the scores split the batch dim as {self.heads} and {heads} heads"
        self.heads = heads
        return ""


def _strip_scalar(node: fx.Node, matched: list, cache: dict, syms: list) -> tuple[fx.Node, float]:
    """Peel ``x * c`` / ``x / c`` (c a number, a constant 0-d tensor, or a symbolic number, appended to ``syms``)
    off a single-use operand chain."""
    factor = 1.0
    while True:
        name = op_name(node)
        if name not in ("mul", "div") or len(node.users) != 1:
            return node, factor
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        c = _scalar_value(b, cache)
        if c is None and name == "mul":
            c = _scalar_value(a, cache)
            if c is not None:
                a = b
        if c is None and _sym_scalar(b) is not None and isinstance(a, fx.Node) and node.kwargs.get(
                "rounding_mode") is None:
            syms.append((b, name == "div"))
            matched.append(node)
            node = a
            continue
        if c is None and name == "mul" and _sym_scalar(a) is not None and isinstance(b, fx.Node):
            syms.append((a, False))
            matched.append(node)
            node = b
            continue
        if c is None or not isinstance(a, fx.Node):
            return node, factor
        if name == "div" and node.kwargs.get("rounding_mode") is not None:
            return node, factor
        if c == 0.0 and name == "div":
            return node, factor
        factor = factor * c if name == "mul" else factor / c
        matched.append(node)
        node = a


def _scalar_value(x: Any, cache: dict) -> Optional[float]:
    n = _num(x)
    if n is not None:
        return n
    if isinstance(x, fx.Node):
        v = tensor_val(x)
        if v is not None and v.dim() == 0:
            c = _const_eval(x, cache)
            if isinstance(c, torch.Tensor) and c.numel() == 1 and c.dtype.is_floating_point | (not c.dtype.is_complex):
                return float(c)
    return None


def _sym_scalar(x: Any) -> Optional[fx.Node]:
    """``x`` when it is a graph node holding one number known only at run time: a (symbolic) Python number, or a
    0-d real tensor (``torch.full((), math.sqrt(S))``, ``torch.tensor(q.size(-1)) ** -0.5``, a learned temperature).
    Either multiplies every score alike, so it moves onto q exactly; a 0-d tensor does not change the dtype of the
    tensor it multiplies (type promotion), in eager nor on q."""
    if isinstance(x, fx.Node):
        v = x.meta.get("val", x.meta.get("example_value"))
        if isinstance(v, (torch.SymInt, torch.SymFloat)) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return x
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.bool and not v.dtype.is_complex:
            return x
    return None


def _is_last2_transpose(n: fx.Node) -> bool:
    name = op_name(n)
    v = tensor_val(n)
    if v is None:
        return False
    nd = v.dim()
    if name == "transpose" or (n.op == "call_method" and n.target == "transpose"):
        d0 = get_arg(n, 1, "dim0")
        d1 = get_arg(n, 2, "dim1")
        if not isinstance(d0, int) or not isinstance(d1, int):
            return False
        return {d0 % nd, d1 % nd} == {nd - 2, nd - 1}
    if name == "t" and nd == 2:
        return True
    if name == "permute":
        dims = n.args[1:] if n.op == "call_method" else n.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [d % nd for d in dims] if all(isinstance(d, int) for d in dims) else None
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _parse_einsum(node: fx.Node):
    eq = node.args[0]
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    if not isinstance(eq, str) or len(ops) != 2 or "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms + [out]):
        return None
    return terms[0], terms[1], out, ops[0], ops[1]


def _qk_einsum(node: fx.Node):
    """q, k, q_perm, k_perm for an einsum computing scores [b0, b1, q, k]."""
    p = _parse_einsum(node)
    if p is None:
        return None
    A, Bt, out, qa, kb = p
    contracted = (set(A) & set(Bt)) - set(out)
    if len(contracted) != 1 or len(out) != 4:
        return None
    (d,) = contracted
    b0, b1, qi, ki = out
    if not (b0 in A and b0 in Bt and b1 in A and b1 in Bt and qi in A and qi not in Bt and ki in Bt and ki not in A):
        return None
    if set(A) != {b0, b1, qi, d} or set(Bt) != {b0, b1, ki, d}:
        return None
    return qa, kb, [A.index(c) for c in (b0, b1, qi, d)], [Bt.index(c) for c in (b0, b1, ki, d)]


def _pv_einsum(node: fx.Node, p_node: fx.Node):
    """v, v_perm, out_perm for an einsum contracting probabilities [b0, b1, q, k] with v."""
    parsed = _parse_einsum(node)
    if parsed is None:
        return None
    A, Bt, out, x, y = parsed
    if x is p_node and y is not p_node:
        Pl, Vl, v = A, Bt, y
    elif y is p_node and x is not p_node:
        Pl, Vl, v = Bt, A, x
    else:
        return None
    if len(Pl) != 4 or len(Vl) != 4 or len(out) != 4:
        return None
    b0, b1, qi, ki = Pl
    extra = set(Vl) - {b0, b1, ki}
    if ki in out or not {b0, b1, ki} <= set(Vl) or len(extra) != 1 or qi in Vl:
        return None
    (e,) = extra
    if set(out) != {b0, b1, qi, e}:
        return None
    v_perm = [Vl.index(c) for c in (b0, b1, ki, e)]
    out_perm = [[b0, b1, qi, e].index(c) for c in out]
    return v, v_perm, out_perm


def _repeat_kv_source(n: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(x, rep) when ``n`` is x [B, Hkv, S, D] repeated to [B, Hkv*rep, S, D] head-wise (repeat_kv)."""
    v = tensor_val(n)
    if v is None or v.dim() != 4:
        return None
    name = op_name(n)
    if n.op == "call_function" and n.target is torch.repeat_interleave or \
            (n.op == "call_method" and n.target == "repeat_interleave"):
        x = n.args[0]
        rep = get_arg(n, 1, "repeats")
        dim = get_arg(n, 2, "dim")
        xv = tensor_val(x)
        if isinstance(rep, int) and dim in (1, -3) and xv is not None and xv.dim() == 4 and \
                "output_size" not in n.kwargs:
            return x, rep
        return None
    if name not in ("reshape", "view"):
        return None
    e = n.args[0]
    ev = tensor_val(e)
    if op_name(e) != "expand" or ev is None or ev.dim() != 5:
        return None
    u = e.args[0]
    uv = tensor_val(u)
    if uv is None or uv.dim() != 5 or uv.shape[2] != 1:
        return None
    Bsz, Hkv, rep, S, D = ev.shape
    if tuple(uv.shape) != (Bsz, Hkv, 1, S, D) or tuple(v.shape) != (Bsz, Hkv * rep, S, D):
        return None
    x = None
    if op_name(u) == "unsqueeze" and get_arg(u, 1, "dim") in (2, -3):
        x = u.args[0]
    elif op_name(u) == "getitem":
        idx = u.args[1]
        if isinstance(idx, tuple) and len(idx) == 5 and idx[2] is None and all(
                isinstance(s, slice) and s == slice(None) for i, s in enumerate(idx) if i != 2):
            x = u.args[0]
        elif isinstance(idx, tuple) and len(idx) == 3 and idx[0] == slice(None) and idx[1] == slice(None) and \
                idx[2] is None:
            x = u.args[0]
    if x is None:
        return None
    xv = tensor_val(x)
    if xv is None or tuple(xv.shape) != (Bsz, Hkv, S, D):
        return None
    return x, rep


def _is_where_zero_fill(m: fx.Node, cache: dict) -> Optional[tuple[fx.Node, float]]:
    """(cond, fill) when the float mask ``m`` is ``where(cond, 0, fill)`` (transformers' eager mask), possibly cast
    to other float dtypes afterwards (``fill`` is then the value the last cast stores)."""
    dtypes = []
    while _cast_dtype(m) is not None and isinstance(m.args[0], fx.Node) and tensor_val(m.args[0]) is not None:
        dtypes.append(_cast_dtype(m))
        m = m.args[0]
    if op_name(m) != "where" or len(m.args) != 3:
        return None
    if not all(dt.is_floating_point for dt in dtypes):
        return None
    cond, a, b = m.args
    za = _scalar_value(a, cache)
    fb = _scalar_value(b, cache)
    if za != 0.0 or fb is None:
        return None
    cv = tensor_val(cond)
    if cv is None or cv.dtype != torch.bool or tensor_val(m) is None:
        return None
    for dt in [tensor_val(m).dtype] + dtypes[::-1]:
        fb = _in_dtype(fb, dt)
    return cond, fb


def _match_softmax(sm: fx.Node, cache: dict) -> tuple[Optional[_Match], str]:
    sv = tensor_val(sm)
    if sv is None:
        return None, "no meta val"
    dim = get_arg(sm, 1, "dim")
    if not isinstance(dim, int) or dim % sv.dim() != sv.dim() - 1:
        return None, "softmax is not over the last dim"
    sdt = sm.kwargs.get("dtype", sm.args[3] if sm.op == "call_function" and len(sm.args) > 3 else None)
    if sdt not in (None, torch.float32) and sdt != sv.dtype:
        return None, f"softmax dtype {sdt} unsupported"
    matched = [sm]
    casts: list = []
    x_in = sm.args[0] if sm.args else sm.kwargs.get("input")
    if tensor_val(x_in) is not None and tensor_val(x_in).dtype != sv.dtype:
        casts.append(sv.dtype)  # softmax(x, dtype=t) casts x to t first
    layout = _Layout()
    # downstream: casts, dropout, views of the batch dims, then P @ V
    dropout_p = 0.0
    cur = sm
    while True:
        if len(cur.users) != 1:
            return None, "attention probabilities are used elsewhere"
        (u,) = cur.users
        if op_name(u) in ("view", "reshape", "expand"):
            why = layout.step(u, tensor_val(cur), tensor_val(u))
            if why:
                return None, why
            matched.append(u)
            cur = u
            continue
        if op_name(u) == "clone" or (u.op == "call_function" and u.target is torch.clone):
            if u.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
                return None, "clone of the probabilities with a memory format"
            matched.append(u)
            cur = u
            continue
        if _cast_dtype(u) is not None:
            casts.append(_cast_dtype(u))
            matched.append(u)
            cur = u
            continue
        if op_name(u) == "dropout" or (u.op == "call_function" and u.target is torch.nn.functional.dropout):
            p = get_arg(u, 1, "p", 0.5)
            training = get_arg(u, 2, "training" if u.target is torch.nn.functional.dropout else "train", True)
            if u.target is torch.nn.functional.dropout and get_arg(u, 3, "inplace", False):
                return None, "in-place dropout"
            if _num(p) is None or not isinstance(training, bool):
                return None, "dropout with a non-constant p or training flag"
            if training and not 0 <= p < 1:
                return None, f"dropout p={p} (the kernel takes 0 <= p < 1)"
            if training and p > 0:
                if dropout_p > 0:
                    return None, "two dropouts on the probabilities"
                dropout_p = float(p)
            matched.append(u)
            cur = u
            continue
        break
    pv = u
    m = _Match(q=None, k=None, v=None, out=pv, dropout_p=dropout_p, casts=casts,
               safe_softmax=sm.target in _SAFE_SOFTMAX)
    pname = op_name(pv)
    if pname in ("matmul", "bmm"):
        if pv.args[0] is not cur or len(pv.args) < 2:
            return None, "probabilities are not the left matmul operand"
        m.v = pv.args[1]
    elif pname == "einsum":
        got = _pv_einsum(pv, cur)
        if got is None:
            return None, "einsum equation not understood"
        m.v, m.v_perm, m.out_perm = got
    else:
        return None, f"probabilities feed {pname or pv.target}, not a matmul"
    # upstream: casts, masks, softcap, scale
    x = x_in
    scores_shape = tuple(sv.shape)  # the shape of the chain node being read (changes at a view of the batch dims)
    mask_ranks: list = []  # (mask node, rank of the scores it is applied to)
    scale = 1.0
    phase = 0  # 0: masks/casts; 1: softcap/scale/casts
    masks = m.masks
    seen_replacement = False
    while True:
        if not isinstance(x, fx.Node) or len(_value_users(x)) != 1:
            return None, "score chain has other users"
        xv = tensor_val(x)
        if xv is None or tuple(xv.shape) != scores_shape:
            return None, "score chain changes shape"
        name = _node_name(x)
        if name in ("view", "reshape", "expand") and isinstance(x.args[0], fx.Node):
            why = layout.step(x, tensor_val(x.args[0]), xv)
            if why:
                return None, why
            matched.append(x)
            x = x.args[0]
            scores_shape = tuple(tensor_val(x).shape)
            continue
        dt = _cast_dtype(x)
        if dt is not None:
            casts.append(dt)
            matched.append(x)
            x = x.args[0]
            continue
        if name == "add" and phase == 0:
            a, b = x.args[0], x.args[1] if len(x.args) > 1 else x.kwargs.get("other")
            if x.kwargs.get("alpha", 1) != 1:
                return None, "add with alpha"
            # the chain is the operand of the scores' shape; the other is the mask
            if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                av, bv = tensor_val(a), tensor_val(b)
                if av is not None and tuple(av.shape) == scores_shape and _chain_like(a):
                    chain, mask = a, b
                elif bv is not None and tuple(bv.shape) == scores_shape and _chain_like(b):
                    chain, mask = b, a
                else:
                    return None, "cannot tell the scores from the mask in an add"
                mv = tensor_val(mask)
                if mv is None or not (mv.dtype.is_floating_point or mv.dtype == torch.bool):
                    return None, f"additive mask of dtype {None if mv is None else mv.dtype}"
                masks.additive.append(mask)
                mask_ranks.append((mask, xv.dim()))
                m.add_dtypes.append(xv.dtype)
                if seen_replacement:
                    masks.additive_first = False
                matched.append(x)
                x = chain
                continue
            return None, "add of a number on the scores"
        if name == "masked_fill" and phase == 0:
            mnode = get_arg(x, 1, "mask")
            fill = _scalar_value(get_arg(x, 2, "value"), cache)
            if fill is None or not isinstance(mnode, fx.Node):
                return None, "masked_fill with a non-constant fill value"
            if not _masks_out(fill, xv.dtype):
                return None, f"masked_fill value {fill} is neither -inf nor <= finfo({xv.dtype}).min: it does not mask"
            masks.keeps.append(_Keep(mnode, negate=True))
            masks.fills.append(fill)
            mask_ranks.append((mnode, xv.dim()))
            seen_replacement = True
            matched.append(x)
            x = x.args[0]
            continue
        if name == "where" and phase == 0 and len(x.args) == 3:
            cond, a, b = x.args
            if a is not None and isinstance(a, fx.Node) and tensor_val(a) is not None and \
                    tuple(tensor_val(a).shape) == scores_shape and _chain_like(a) and _scalar_value(b, cache) is not None:
                masks.keeps.append(_Keep(cond, negate=False))
                masks.fills.append(_scalar_value(b, cache))
                chain = a
            elif isinstance(b, fx.Node) and tensor_val(b) is not None and tuple(tensor_val(b).shape) == scores_shape \
                    and _chain_like(b) and _scalar_value(a, cache) is not None:
                masks.keeps.append(_Keep(cond, negate=True))
                masks.fills.append(_scalar_value(a, cache))
                chain = b
            else:
                return None, "where on the scores not understood"
            if not _masks_out(masks.fills[-1], xv.dtype):
                return None, (f"where fill {masks.fills[-1]} is neither -inf nor <= finfo({xv.dtype}).min: it "
                              "does not mask")
            if not isinstance(cond, fx.Node) or tensor_val(cond) is None or tensor_val(cond).dtype != torch.bool:
                return None, "where condition is not a bool tensor"
            mask_ranks.append((cond, xv.dim()))
            seen_replacement = True
            matched.append(x)
            x = chain
            continue
        if name == "mul":
            # softcap: tanh(y / c) * c
            a, b = x.args[0], x.args[1] if len(x.args) > 1 else None
            c = _scalar_value(b, cache)
            t = a
            if c is None:
                c, t = _scalar_value(a, cache), b
            if c is not None and isinstance(t, fx.Node) and op_name(t) == "tanh" and len(t.users) == 1 \
                    and phase == 0 and c > 0:
                inner = t.args[0]
                if isinstance(inner, fx.Node) and op_name(inner) in ("mul", "div") and len(inner.users) == 1:
                    ia, ib = inner.args[0], inner.args[1]
                    ic = _scalar_value(ib, cache)
                    if ic is None and op_name(inner) == "mul":
                        ic, ia = _scalar_value(ia, cache), ib
                    if ic is not None and ic != 0 and (
                            (op_name(inner) == "div" and math.isclose(ic, c, rel_tol=1e-6)) or
                            (op_name(inner) == "mul" and math.isclose(ic * c, 1.0, rel_tol=1e-6))) \
                            and inner.kwargs.get("rounding_mode") is None:
                        m.softcap = float(c)
                        phase = 2  # scales below softcap are pre-softcap: fine
                        matched += [x, t, inner]
                        x = ia
                        continue
            # a scalar scale
            if c is not None and isinstance(t, fx.Node):
                scale *= c
                phase = max(phase, 1)
                matched.append(x)
                x = t
                continue
            sym = _sym_scalar(b) if isinstance(a, fx.Node) else None
            if sym is None and isinstance(b, fx.Node):
                sym, a = _sym_scalar(a), b
            if sym is not None:
                m.scale_syms.append((sym, False))
                phase = max(phase, 1)
                matched.append(x)
                x = a
                continue
            return None, "mul of the scores by a non-constant tensor"
        if name == "div":
            other = x.args[1] if len(x.args) > 1 else x.kwargs.get("other")
            c = _scalar_value(other, cache)
            if c is None and _sym_scalar(other) is not None and x.kwargs.get("rounding_mode") is None \
                    and isinstance(x.args[0], fx.Node):
                m.scale_syms.append((other, True))
                phase = max(phase, 1)
                matched.append(x)
                x = x.args[0]
                continue
            if c is None or c == 0 or x.kwargs.get("rounding_mode") is not None or not isinstance(x.args[0], fx.Node):
                return None, "div of the scores by a non-constant tensor or by 0"
            scale /= c
            phase = max(phase, 1)
            matched.append(x)
            x = x.args[0]
            continue
        if name in ("matmul", "bmm", "einsum"):
            break
        if name in ("add", "masked_fill", "where"):
            return None, "mask applied before the scale or softcap (not expressible)"
        return None, f"score chain op {name or x.target} not understood"
    qk = x
    matched.append(qk)
    if op_name(qk) == "einsum":
        got = _qk_einsum(qk)
        if got is None:
            return None, "einsum equation not understood"
        q, k, m.q_perm, m.k_perm = got
    else:
        q, kt = qk.args[0], qk.args[1]
        if not isinstance(q, fx.Node) or not isinstance(kt, fx.Node):
            return None, "matmul operands are not tensors"
        kt_node, kfac = _strip_scalar(kt, matched, cache, m.scale_syms)
        scale *= kfac
        if _is_last2_transpose(kt_node) and len(kt_node.users) == 1:
            matched.append(kt_node)
            k = kt_node.args[0]
        else:
            k, m.k_is_kt = kt_node, True
    q, qfac = _strip_scalar(q, matched, cache, m.scale_syms)
    scale *= qfac
    if not m.k_is_kt:
        k, kfac = _strip_scalar(k, matched, cache, m.scale_syms)
        scale *= kfac
    m.q, m.k = q, k
    m.scale = scale
    m.matched = matched
    qv = tensor_val(qk)
    m.three_d = qv is not None and qv.dim() == 3 and op_name(qk) == "bmm"
    if op_name(qk) == "bmm" and not m.three_d:
        return None, "bmm of unexpected rank"
    if op_name(qk) == "matmul" and (qv is None or qv.dim() not in (3, 4)):
        return None, "matmul of rank other than 3 or 4"
    if op_name(qk) == "matmul" and qv.dim() == 3:
        m.three_d = True
    if layout.heads is not None:
        # the chain views [A*C, Sq, Sk] as [A, C, Sq, Sk] (or back): the op runs on [A, C, S, D]. A mask applied to
        # the 3-D scores broadcasts the same way in 4-D only when it does not index the merged dim.
        for mask, rank in mask_ranks:
            mv = tensor_val(mask)
            if rank == 3 and (mv is None or (mv.dim() == 3 and mv.shape[0] != 1)):
                return None, "a mask indexes the merged batch*heads dim of a score chain viewed as 4-D"
        if m.q_perm is not None or m.k_perm is not None or m.v_perm is not None:
            return None, "einsum operands in a score chain viewed as 4-D"
        m.three_d, m.heads = False, layout.heads
    return m, ""


def _masks_out(fill: float, dtype: torch.dtype) -> bool:
    """Whether writing ``fill`` into scores of ``dtype`` removes those keys: -inf, or at most finfo(dtype).min (a
    smaller finite fill, 0, +inf or NaN changes the softmax instead, and is not a mask)."""
    if fill is None or math.isnan(fill) or not dtype.is_floating_point:
        return False
    return fill == -math.inf or fill <= torch.finfo(dtype).min


_SHAPE_READERS = ("expand_as", "type_as", "size", "dim", "new_zeros", "new_ones", "new_full", "new_empty")


def _value_users(x: fx.Node) -> list:
    """Users of ``x`` that read its values: ``m.expand_as(x)``, ``m.type_as(x)``, ``x.size()`` read only its
    shape or dtype and are not counted."""
    out = []
    for u in x.users:
        if u.op == "call_method" and u.target in _SHAPE_READERS and (
                (u.target in ("expand_as", "type_as") and u.args[0] is not x and x not in u.kwargs.values())
                or (u.target not in ("expand_as", "type_as") and u.args[0] is x)):
            continue
        out.append(u)
    return out


def _chain_like(n: fx.Node) -> bool:
    """Whether ``n`` can be the score chain (comes from a matmul through elementwise ops)."""
    seen = 0
    while isinstance(n, fx.Node) and seen < 16:
        name = _node_name(n)
        if name in ("matmul", "bmm", "einsum"):
            return True
        if name in ("view", "reshape", "expand"):
            n = n.args[0]
            seen += 1
            continue
        if name in ("mul", "div", "add", "masked_fill", "where", "tanh") or _cast_dtype(n) is not None:
            if name == "where":
                cand = [a for a in n.args[1:] if isinstance(a, fx.Node) and _chain_like(a)]
                return bool(cand)
            if name in ("mul", "add"):
                return any(isinstance(a, fx.Node) and _chain_like(a) for a in n.args[:2])
            n = n.args[0] if name != "where" else n.args[1]
            seen += 1
            continue
        return False
    return False


# ----------------------------------------------------------------------------------------------------------------
# rewriting
# ----------------------------------------------------------------------------------------------------------------


def _emit(gm: fx.GraphModule, m: _Match, cfg: AttentionConfig, op, cache: dict,
          result: PassResult) -> Optional[fx.Node]:
    """Build the flash_attention call for ``m``; returns the replacement node or None (graph untouched).

    Every check runs before the first node is created."""
    g = gm.graph
    mode = _fake_mode(m.q, m.k, m.v, m.out)
    qv, kv_, vv = tensor_val(m.q), tensor_val(m.k), tensor_val(m.v)
    if qv is None or kv_ is None or vv is None:
        return _fail(result, m.out, "missing meta val on q/k/v")

    def shape_after(v, perm, kt=False, three=False):
        s = list(v.shape)
        if perm is not None:
            s = [s[i] for i in perm]
        if kt:
            s[-1], s[-2] = s[-2], s[-1]
        if three:
            s = [1] + s
        if m.heads is not None and len(s) == 3:
            s = [s[0] // m.heads, m.heads] + s[1:]
        return s

    qs = shape_after(qv, m.q_perm, three=m.three_d)
    ks = shape_after(kv_, m.k_perm, kt=m.k_is_kt, three=m.three_d)
    vs = shape_after(vv, m.v_perm, three=m.three_d)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return _fail(result, m.out, f"q/k/v ranks {len(qs)}/{len(ks)}/{len(vs)} (need 4)")
    # GQA: drop repeat_kv on both k and v
    k_src = v_src = None
    if not m.three_d and m.heads is None and m.k_perm is None and m.v_perm is None and not m.k_is_kt:
        kr = _repeat_kv_source(m.k)
        vr = _repeat_kv_source(m.v)
        if kr is not None and vr is not None and kr[1] == vr[1] and \
                tuple(tensor_val(kr[0]).shape) == tuple(tensor_val(vr[0]).shape):
            k_src, v_src = kr[0], vr[0]
            ks = list(tensor_val(k_src).shape)
            vs = list(tensor_val(v_src).shape)
    reason = _check_shapes(qs, ks, vs, qv, kv_, vv)
    if reason:
        return _fail(result, m.out, reason)
    ov = tensor_val(m.out)
    if ov is None or ov.dtype != qv.dtype:
        return _fail(result, m.out, "attention output dtype differs from q's")
    B, Hq, Sq, D = qs
    Sk = ks[2]
    empty = [n for n, x in zip(("B", "Hq", "Sq", "Sk", "D"), (B, Hq, Sq, Sk, D)) if isinstance(x, int) and x == 0]
    if empty:
        return _fail(result, m.out, f"empty dim {', '.join(empty)} = 0: the kernels are not called on empty tensors")
    bad_casts = [dt for dt in m.casts if dt not in (torch.float32, torch.float64, qv.dtype)]
    if bad_casts:
        return _fail(result, m.out, f"cast to {bad_casts[0]} on the scores or probabilities (the kernel computes "
                                    f"them in float32 for {qv.dtype} inputs; a cast to another dtype rounds them)")
    dynamic = not all(isinstance(x, int) for x in (B, Sq, Sk))
    training = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (qv, kv_, vv))
    # masks: transformers' eager additive mask where(cond, 0, fill) with a fill that masks is a keep literal
    masks = m.masks
    add_keep, rest_add = [], []
    for i, a in enumerate(masks.additive):
        wz = _is_where_zero_fill(a, cache)
        add_dt = m.add_dtypes[i] if i < len(m.add_dtypes) else torch.float32
        if wz is not None and _masks_out(_in_dtype(wz[1], tensor_val(a).dtype), add_dt):
            add_keep.append((a, wz, add_dt))
        else:
            rest_add.append(a)
    trial = _Masks(keeps=masks.keeps + [_Keep(c) for _, (c, _), _ in add_keep],
                   fills=masks.fills + [f for _, (_, f), _ in add_keep], additive=rest_add,
                   additive_first=masks.additive_first)
    low, why = None, ""
    if trial.keeps and cfg.lower_masks and dynamic:
        why = "dynamic shapes: a mask's structure is proven at static sizes only"
    elif trial.keeps and cfg.lower_masks:
        low, why = _lower(trial, cache, (B, Hq, Sq, Sk), not m.three_d)
    if low is None and why:
        result.notes.append(f"attention {m.out.name}: mask passed as a tensor ({why})")
    # rows where every key may be masked: what eager gives there, and whether the op can give the same
    if m.sdpa_causal or not (trial.keeps or trial.additive):
        dead_possible = False
    elif low is not None:
        dead_possible = low.kpm is not None or low.const_has_empty_row or bool(trial.additive)
    else:
        dead_possible = True
    fp16_adds = [a for i, a in enumerate(masks.additive) if a in rest_add and i < len(m.add_dtypes)
                 and m.add_dtypes[i] == torch.float16]
    if fp16_adds and dead_possible and not _is_sdpa(m.out):
        return _fail(result, m.out, "additive mask on float16 scores: eager rounds scores + mask in float16 (a row "
                                    "of finfo(float16).min fills overflows or keeps the scores), the kernel adds in "
                                    "float32")
    dead = _dead_row_policy(m, trial, add_keep, dead_possible, training)
    if dead == "nan" and training and m.three_d:
        return _fail(result, m.out, "rows may be fully masked in a 3-D (bmm) layout in training: eager's NaN "
                                    "gradients are reproduced for the 4-D layout only")
    if isinstance(dead, str) and dead.startswith("!"):
        return _fail(result, m.out, dead[1:])
    if m.sdpa_causal and (trial.keeps or trial.additive):
        return _fail(result, m.out, "SDPA is_causal with an attn_mask")
    # A learned bias (an additive mask that requires grad, e.g. T5's position bias): the op gives its gradient, but
    # from an S x S float32 pass after the kernels (attention._mask_grad_impl); SDPA's own backends are the better
    # choice there, so the original stays.
    if any(getattr(tensor_val(a), "requires_grad", False) for a in masks.additive):
        return _fail(result, m.out, "additive mask requires grad (a learned bias): left to the original, whose "
                                    "backward gives the bias gradient without an extra S x S pass")
    # no in-place write to what the op reads, or to an intermediate, between the region's first node and the op
    muts = cache.get("__mutations__")
    if muts is not None:
        reads = [m.q, k_src or m.k, v_src or m.v] + [lit.node for lit in trial.keeps] + list(trial.additive)
        reads += [node for node, _ in m.scale_syms if tensor_val(node) is not None]
        if low is not None and low.kpm is not None:
            reads.append(low.kpm)
        lo = min(muts.pos.get(n, 1 << 60) for n in m.matched) if m.matched else muts.pos.get(m.out, 0)
        w = muts.touching(reads, lo, muts.pos.get(m.out)) or muts.touching(
            [n for n in m.matched if n is not m.out])
        if w is not None:
            return _fail(result, m.out, f"in-place write {w.format_node()} inside the attention region: the fused "
                                        "op would read other values than the original")
    # --- build -----------------------------------------------------------------------------------------------
    b = _Builder(g, m.out, mode)
    try:
        q = m.q
        k = k_src if k_src is not None else m.k
        v = v_src if v_src is not None else m.v
        if m.q_perm is not None:
            q = b.call(torch.permute, (q, m.q_perm))
        if m.k_perm is not None:
            k = b.call(torch.permute, (k, m.k_perm))
        if m.v_perm is not None:
            v = b.call(torch.permute, (v, m.v_perm))
        if m.k_is_kt:
            k = b.call(torch.transpose, (k, -2, -1))
        if m.three_d:
            q = b.call(torch.unsqueeze, (q, 0))
            k = b.call(torch.unsqueeze, (k, 0))
            v = b.call(torch.unsqueeze, (v, 0))
        if m.heads is not None:  # [A*C, S, D] -> [A, C, S, D], the layout the chain's views give the scores
            q, k, v = (x if tensor_val(x).dim() == 4 else b.call(torch.unflatten, (x, 0, (-1, m.heads)))
                       for x in (q, k, v))
        kwargs: dict = {}
        if m.scale_syms:
            # a symbolic factor goes onto q, the op's scale stays a number: a custom op's float argument would
            # specialise the SymFloat (a guard on its value, a compile per size)
            for node, divides in m.scale_syms:
                q = b.call(operator.truediv if divides else operator.mul, (q, node))
            kwargs["scale"] = float(1.0 if m.scale is None else m.scale)
        elif m.scale is not None:
            kwargs["scale"] = float(m.scale)
        if m.softcap:
            kwargs["softcap"] = float(m.softcap)
        if m.dropout_p:
            kwargs["dropout_p"] = float(m.dropout_p)
        is_causal = False
        attn_mask = None
        if m.sdpa_causal:
            if Sq == Sk:  # with symbolic lengths, a guard
                is_causal = True
            elif dynamic:
                raise _Abort("SDPA is_causal with Sq != Sk and dynamic shapes (the top-left mask needs static sizes)")
            else:
                ones = b.call(torch.ones, (Sq, Sk), {"dtype": torch.bool, "device": qv.device})
                attn_mask = b.call(torch.tril, (ones,))
        if low is not None:
            is_causal = low.is_causal
            if low.window >= 0:
                kwargs["window"] = int(low.window)
            if low.kpm is not None:
                kpm = low.kpm
                if low.kpm_len != Sk:
                    kpm = b.call(operator.getitem, (kpm, (slice(None), slice(None, Sk))))
                if tensor_val(kpm).dtype != torch.bool:
                    kpm = b.call(torch.ne, (kpm, 0))
                if tensor_val(kpm).device != qv.device:
                    kpm = b.call("to", (kpm, qv.device), method=True)
                kwargs["key_padding_mask"] = kpm
            attn_mask = _sum_additive(b, trial.additive)
        elif trial.keeps or trial.additive:
            attn_mask = _materialize(b, trial, dead is not None or dead_possible)
        if attn_mask is not None:
            mv = tensor_val(attn_mask)
            if mv.dim() > 4:
                raise _Abort("mask has more than 4 dims")
            shape = (1,) * (4 - mv.dim()) + tuple(mv.shape)
            if any(h not in (1, w) for h, w in zip(shape, (B, Hq, Sq, Sk))):
                raise _Abort(f"mask shape {tuple(mv.shape)} does not broadcast to {[B, Hq, Sq, Sk]}")
            if mv.device != qv.device:
                raise _Abort("mask on another device")
            kwargs["attn_mask"] = attn_mask
        if is_causal:
            kwargs["is_causal"] = True
        out = None
        if cfg.fp8 and dead is None:
            fp8_ok, fp8_why = _fp8_eligible(tensor_val(q), tensor_val(k), tensor_val(v), kwargs)
            if fp8_ok:
                out = b.call(torch.ops.fxopt.fp8_attention.default, (q, k, v),
                             {"is_causal": bool(kwargs.get("is_causal", False)), "scale": kwargs.get("scale")})
            else:
                result.notes.append(f"attention {m.out.name}: fp8 not used ({fp8_why}); fp16/bf16 flash_attention")
        if out is None and dead is None:
            out = b.call(op, (q, k, v), kwargs)
        elif out is None:
            out = _call_with_dead_rows(b, q, k, v, kwargs, dead, Hq, training)
        if m.three_d:
            out = b.call(torch.squeeze, (out, 0))
        if m.heads is not None and ov.dim() == 3:
            out = b.call(torch.flatten, (out, 0, 1))
        if m.out_perm is not None:
            out = b.call(torch.permute, (out, m.out_perm))
        if tuple(tensor_val(out).shape) != tuple(ov.shape) or tensor_val(out).dtype != ov.dtype:
            raise _Abort(f"rewrite would change shape {tuple(ov.shape)} -> {tuple(tensor_val(out).shape)}")
        out = _match_layout(b, out, ov)
    except _Abort as e:
        _undo(g, b.created)
        result.skip(m.out, str(e))
        return None
    except Exception as e:  # noqa: BLE001  (fake propagation refused the call: leave the graph as it was)
        _undo(g, b.created)
        result.skip(m.out, f"rewrite failed: {type(e).__name__}: {e}")
        return None
    out.meta["fxopt_attention"] = {
        "lowered": None if low is None else {"is_causal": low.is_causal, "window": low.window,
                                             "key_padding_mask": low.kpm is not None},
        "gqa": k_src is not None or (Hq != ks[1]),
        "dead_rows": dead,
    }
    return out


def _in_dtype(x: float, dtype: torch.dtype) -> float:
    """``x`` as stored in a tensor of ``dtype`` (finfo.min of a wider dtype becomes -inf in a narrower one)."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype)) if dtype.is_floating_point else x


def _dead_row_policy(m: _Match, masks: _Masks, add_keep: list, possible: bool, training: bool) -> Any:
    """What eager gives on a row whose every key is masked, when such rows may exist: None (none can, or the op
    already gives it: SDPA's zeros), "nan" (every fill is -inf: softmax of -inf only), "mean" (one finite fill: a
    uniform softmax, the mean of the values), or "!reason" when the op cannot reproduce it."""
    if not possible or m.out is None or _is_sdpa(m.out):
        return None
    fills = set(masks.fills)
    if m.safe_softmax and (not masks.keeps or fills == {-math.inf}):
        return None  # _safe_softmax gives a row of -inf 0, with a zero gradient: the op's own value
    if not masks.keeps or fills == {-math.inf}:
        replaced = len(masks.keeps) - len(add_keep)  # masked_fill / where literals: no gradient where they fill
        if not training:
            return "nan"
        if replaced and (add_keep or masks.additive):
            return ("!rows may be fully masked by both -inf fills and additive masks, in training: which scores "
                    "eager's NaN gradient reaches is not reproduced")
        return "nan_filled" if replaced else "nan"
    if len(fills) != 1 or m.dropout_p:
        return (f"!rows may be fully masked with fills {sorted(fills)}"
                + (" and dropout" if m.dropout_p else "") + ": eager's result there cannot be reproduced")
    (f,) = fills
    if add_keep:
        # scores + where(keep, 0, f): a masked row is uniform only when f swamps every score in the add's dtype
        (a, (_, fa), add_dt), = add_keep if len(add_keep) == 1 else ((None, (None, None), None),)
        if a is None or masks.keeps[:-1] or masks.additive:
            return "!rows may be fully masked by several additive masks: eager's sum of fills is not reproduced"
        if add_dt not in (torch.float32, torch.bfloat16) or abs(_in_dtype(fa, add_dt)) < 1e30:
            return (f"!rows may be fully masked and a fill of {fa} added to {add_dt} scores does not swamp them "
                    "(eager's rounded row is not reproduced)")
        if training and m.softcap:
            return "!rows may be fully masked by an additive fill, with softcap, in training"
        return "mean_additive" if training else "mean"
    if masks.additive and not masks.additive_first:
        return "!rows may be fully masked, with an additive mask after the fill"
    return "mean"


def _is_sdpa(n: fx.Node) -> bool:
    return op_name(n) == "sdpa" or (n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention)


def _call_with_dead_rows(b: _Builder, q, k, v, kwargs: dict, dead: str, Hq: int, training: bool) -> fx.Node:
    """The forward op (out, lse); rows the kernel found without a visible key (lse = +inf) get eager's value.

    "nan": eager's softmax of a row of -inf is NaN, and so is its backward: dq on that row, dk and dv on the whole
    (kv) head. In training a term that is 0 on every other row and NaN on the dead ones, times q, k and v (each times
    0), carries exactly that NaN pattern into the gradients."""
    seed = None
    if kwargs.get("dropout_p"):
        seed = b.call(torch.randint, (0, 2**31 - 1, ()), {"dtype": torch.int64})
    args = (q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
            kwargs.get("scale"), kwargs.get("window", -1), kwargs.get("softcap", 0.0), kwargs.get("key_padding_mask"),
            seed)
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "window", "softcap", "key_padding_mask", "seed")
    pair = b.call(torch.ops.fxopt.flash_attention_fwd.default, args[:3], dict(zip(names, args[3:])))
    out = b.call(operator.getitem, (pair, 0))
    lse = b.call(operator.getitem, (pair, 1))
    is_dead = b.call(operator.getitem, (b.call(operator.eq, (lse, math.inf)), (Ellipsis, None)))
    if dead in ("nan", "nan_filled"):
        # "nan_filled": the row's scores were replaced (masked_fill), so eager's NaN gradient stops there: only dv
        res = b.call(torch.where, (is_dead, math.nan, out))
        if training:
            poison = b.call(torch.where, (is_dead, math.nan, 0.0))  # [B, Hq, Sq, 1], float32, no gradient
            terms = [] if dead == "nan_filled" else [
                b.call("sum", (b.call(operator.mul, (q, 0.0)), -1), {"keepdim": True}, method=True)]
            Hkv = tensor_val(k).shape[1]
            for x in ((v,) if dead == "nan_filled" else (k, v)):
                t = b.call("sum", (b.call(operator.mul, (x, 0.0)), (-2, -1)), {"keepdim": True}, method=True)
                if Hkv != Hq:
                    t = b.call(torch.repeat_interleave, (t, Hq // Hkv), {"dim": 1})
                terms.append(t)
            for t in terms:
                pt = b.call(operator.mul, (poison, t))
                res = b.call(operator.add, (res, b.call("to", (pt, tensor_val(out).dtype), method=True)))
        return res
    Bv, Hkv, Sk, D = tensor_val(v).shape

    def heads(x):
        return x if Hkv == Hq else b.call(torch.repeat_interleave, (x, Hq // Hkv), {"dim": 1})

    mean = heads(b.call("mean", (v, -2), {"keepdim": True}, method=True))  # [B, Hq, 1, D]
    if dead == "mean_additive":
        # scores + f with f swamping them: the value is the uniform mean, but the softmax's gradient still reaches
        # the scores, at p = 1/n: d out / d s_j = (v_j - mean v) / n. With s^ = s - detach(s) (value 0) that is
        # mean v + (1/n) sum_j (s^_j - mean s^) v_j, written through K^T V ([D, D] per head, no S x S term):
        # X = scale/n q (K^T sg(V)) - scale (q . mean k) sg(mean v); out = mean v + X - detach(X).
        scale = kwargs.get("scale")
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        vd = b.call("detach", (v,), method=True)
        ktv = heads(b.call(torch.matmul, (b.call(torch.transpose, (k, -2, -1)), vd)))  # [B, Hq, D, D]
        kbar = heads(b.call("mean", (k, -2), {"keepdim": True}, method=True))  # [B, Hq, 1, D]
        x1 = b.call(operator.mul, (b.call(torch.matmul, (q, ktv)), scale / Sk))
        qk = b.call("sum", (b.call(operator.mul, (q, kbar)), -1), {"keepdim": True}, method=True)
        x2 = b.call(operator.mul, (b.call(operator.mul, (qk, scale)), b.call("detach", (mean,), method=True)))
        x = b.call(operator.sub, (x1, x2))
        mean = b.call(operator.add, (mean, b.call(operator.sub, (x, b.call("detach", (x,), method=True)))))
    mean = b.call("to", (mean, tensor_val(out).dtype), method=True)
    return b.call(torch.where, (is_dead, mean, out))


def _match_layout(b: _Builder, out: fx.Node, ov: torch.Tensor) -> fx.Node:
    """``out`` with the strides of the original output ``ov`` (eager's matmul layout), where they differ."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    def same(t):
        return all(statically_known_true(a == b_) for a, b_ in zip(t.stride(), ov.stride()))

    cur = tensor_val(out)
    if same(cur):
        return out
    order = sorted(range(ov.dim()), key=lambda d: ov.stride()[d], reverse=True)
    inv = [order.index(d) for d in range(ov.dim())]
    if order == list(range(ov.dim())):
        new = b.call("contiguous", (out,), method=True)
    else:
        new = b.call(torch.permute, (b.call("contiguous", (b.call(torch.permute, (out, order)),), method=True), inv))
    if not same(tensor_val(new)):
        raise _Abort(f"cannot give the output the original layout (strides {tuple(ov.stride())})")
    return new


class _Abort(Exception):
    pass


# Tests on CPU set this to route through the FP8 op's CPU reference (which emulates the kernel's quantization).
_FP8_ALLOW_CPU_REFERENCE = False


def _fp8_eligible(qv, kv_, vv, kwargs) -> tuple:
    """(ok, reason): the FP8 kernel takes inference attention with only ``is_causal`` and ``scale``."""
    from ..kernels.fp8 import fp8_attention_supported

    training = torch.is_grad_enabled() and any(t.requires_grad for t in (qv, kv_, vv))
    ok, why = fp8_attention_supported(qv, kv_, vv, training, allow_cpu_reference=_FP8_ALLOW_CPU_REFERENCE)
    extra = sorted(set(kwargs) - {"scale", "is_causal"})
    if ok and extra:
        return False, "the fp8 kernel has no " + ", ".join(extra)
    return ok, why


def _fail(result: PassResult, node: fx.Node, reason: str):
    result.skip(node, reason)
    return None


def _undo(g: fx.Graph, created: list) -> None:
    for n in reversed(created):
        if not n.users:
            g.erase_node(n)


def _check_shapes(qs, ks, vs, qv, kv_, vv) -> str:
    if not (qv.dtype == kv_.dtype == vv.dtype) or qv.dtype not in _SUPPORTED_DTYPES:
        return f"dtypes {qv.dtype}/{kv_.dtype}/{vv.dtype} unsupported"
    if not (qv.device == kv_.device == vv.device):
        return "q/k/v on different devices"
    # Batch and sequence lengths may be symbolic (Dynamo's dynamic shapes): the kernel reads them at run time, and a
    # comparison below that relates two of them becomes a guard. Head counts and the head dim must be static: they
    # pick the kernel's configuration.
    for s in (qs[1], qs[3], ks[1], ks[3], vs[1], vs[3]):
        if not isinstance(s, int):
            return "dynamic head count or head dim"
    B, Hq, Sq, D = qs
    if list(ks) != list(vs):
        return f"k {list(ks)} and v {list(vs)} shapes differ"
    if ks[0] != B or ks[3] != D:
        return f"k/v {list(ks)} do not match q {list(qs)}"
    if ks[1] == 0 or Hq % ks[1] != 0:
        return f"Hq={Hq} is not a multiple of Hkv={ks[1]}"
    if D > _MAX_HEAD_DIM or D < 1:
        return f"head dim {D} unsupported (max {_MAX_HEAD_DIM})"
    return ""


def _sum_additive(b: _Builder, adds: list) -> Optional[fx.Node]:
    out = None
    for a in adds:
        if not tensor_val(a).dtype.is_floating_point:  # a bool tensor added to the scores adds 1.0 where True
            a = b.call("to", (a, torch.float32), method=True)
        out = a if out is None else b.call(operator.add, (out, a))
    return out


def _materialize(b: _Builder, masks: _Masks, keep_as_inf: bool):
    """One tensor mask for the kernel: the keep literals as a bool mask (a masked key removed: exact with an -inf fill
    and with any fill that masks, ``_masks_out``, except on fully masked rows, which ``_dead_row_policy`` handles),
    combined with the additive masks."""
    keep = None
    for lit in masks.keeps:
        node = b.call(operator.invert, (lit.node,)) if lit.negate else lit.node
        keep = node if keep is None else b.call(operator.and_, (keep, node))
    add = _sum_additive(b, masks.additive)
    if keep is None:
        return add
    if add is None:
        return keep
    return b.call(torch.where, (keep, add, -math.inf))


def _erase_dead(g: fx.Graph, candidates: list) -> int:
    """Erase unused pure nodes among ``candidates`` and (transitively) their ancestors."""
    erased = 0
    work = list(candidates)
    seen: set = set()
    while work:
        n = work.pop()
        if n in seen or n.graph is not g:
            continue
        if n.op not in ("call_function", "call_method") or n.users:
            continue
        if not _is_pure_eval_target(n) and op_name(n) != "dropout":
            continue
        try:
            if n.is_impure():
                continue
        except Exception:  # noqa: BLE001
            continue
        seen.add(n)
        inputs = list(n.all_input_nodes)
        g.erase_node(n)
        erased += 1
        work.extend(inputs)
    return erased


# ----------------------------------------------------------------------------------------------------------------
# SDPA
# ----------------------------------------------------------------------------------------------------------------


def _match_sdpa(node: fx.Node, cache: dict) -> tuple[Optional[_Match], str]:
    q = get_arg(node, 0, "query")
    k = get_arg(node, 1, "key")
    v = get_arg(node, 2, "value")
    mask = get_arg(node, 3, "attn_mask")
    dropout_p = get_arg(node, 4, "dropout_p", 0.0)
    is_causal = get_arg(node, 5, "is_causal", False)
    scale = get_arg(node, 6, "scale")
    enable_gqa = get_arg(node, 7, "enable_gqa", False)
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        return None, "q/k/v are not tensors"
    if _num(dropout_p) is None or not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return None, "non-constant dropout_p / is_causal / enable_gqa"
    sym = None
    if scale is not None and _num(scale) is None:
        sym = _sym_scalar(scale)
        if sym is None:
            return None, "scale is neither a number nor a symbolic number"
    if not 0 <= float(dropout_p) < 1:
        return None, f"dropout_p={dropout_p} (the kernel takes 0 <= p < 1)"
    qv, kv_ = tensor_val(q), tensor_val(k)
    if qv is None or kv_ is None:
        return None, "missing meta val"
    if qv.dim() == 4 and kv_.dim() == 4 and qv.shape[1] != kv_.shape[1] and not enable_gqa:
        return None, "different head counts without enable_gqa"
    if qv.dim() != 4:
        return None, f"q rank {qv.dim()} (need 4)"
    m = _Match(q=q, k=k, v=v, out=node, scale=None if scale is None else 1.0 if sym is not None else float(scale),
               scale_syms=[] if sym is None else [(sym, False)],
               dropout_p=float(dropout_p), sdpa_causal=is_causal, matched=[node])
    if mask is not None:
        if not isinstance(mask, fx.Node) or tensor_val(mask) is None:
            return None, "attn_mask is not a tensor"
        if is_causal:
            return None, "attn_mask together with is_causal"
        if tensor_val(mask).dtype == torch.bool:
            m.masks.keeps.append(_Keep(mask))
            m.masks.fills.append(-math.inf)  # SDPA's bool semantics: fully masked rows give 0, like the kernel
        elif tensor_val(mask).dtype.is_floating_point:
            m.masks.additive.append(mask)
        else:
            return None, f"attn_mask dtype {tensor_val(mask).dtype}"
    return m, ""


# ----------------------------------------------------------------------------------------------------------------
# the pass
# ----------------------------------------------------------------------------------------------------------------


def _checkpoint_bodies(gm: fx.GraphModule) -> list:
    """The graph modules of ``tag_activation_checkpoint`` regions (Dynamo's form of ``torch.utils.checkpoint``)."""
    bodies = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and type(n.target).__name__ == "TagActivationCheckpoint" and n.args:
            body = n.args[0]
            if isinstance(body, fx.Node) and body.op == "get_attr":
                sub = getattr(gm, body.target, None)
                if isinstance(sub, fx.GraphModule) and sub not in bodies:
                    bodies.append(sub)
    return bodies


@register_pass("attention")
def attention_pass(gm: fx.GraphModule, cfg: AttentionConfig, ctx: PassContext) -> PassResult:
    """Rewrite every SDPA / hand-written attention it can prove into ``torch.ops.fxopt.flash_attention``, in the
    graph and in its activation-checkpoint bodies (recomputed in the backward: the op is deterministic without
    dropout, so the recomputation gives the same values; with dropout the body's attention stays as it was)."""
    result = PassResult("attention")
    for sub in [gm] + _checkpoint_bodies(gm):
        _rewrite_graph(sub, cfg, result, checkpointed=sub is not gm)
        if sub is not gm:
            sub.graph.lint()
            sub.recompile()
    return result


def _rewrite_graph(gm: fx.GraphModule, cfg: AttentionConfig, result: PassResult, checkpointed: bool) -> None:
    candidates = [n for n in gm.graph.nodes if op_name(n) in ("sdpa", "softmax")
                  or (n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention)]
    if not candidates:
        return
    for n in gm.graph.nodes:  # a checkpoint body: Dynamo's values, as the manager does for the outer graph
        if "val" not in n.meta and "example_value" in n.meta:
            n.meta["val"] = n.meta["example_value"]
    op = _flash_op()
    if op is None:
        for n in candidates:
            result.skip(n, "torch.ops.fxopt.flash_attention is not available")
        return
    cache: dict = {"__mutations__": _Mutations(gm.graph)}
    for n in candidates:
        if n.graph is not gm.graph:
            continue  # erased by an earlier rewrite
        if op_name(n) == "sdpa" or n.target is torch._C._nn.scaled_dot_product_attention:
            m, why = _match_sdpa(n, cache)
        else:
            m, why = _match_softmax(n, cache)
        if m is not None and checkpointed and m.dropout_p:
            m, why = None, "dropout inside an activation-checkpoint region (its recomputation must redraw the mask)"
        if m is None:
            result.skip(n, why)
            continue
        new = _emit(gm, m, cfg, op, cache, result)
        if new is None:
            continue
        m.out.replace_all_uses_with(new)
        dead = [m.out] + list(m.matched)
        _erase_dead(gm.graph, dead + [a for d in dead for a in d.all_input_nodes])
        cache["__mutations__"] = _Mutations(gm.graph)
        result.rewrites += 1
        info = new.meta.get("fxopt_attention", {})
        low = info.get("lowered")
        result.notes.append(f"attention {n.name}: -> flash_attention"
                            + (" (GQA native)" if info.get("gqa") else "")
                            + (" (activation checkpoint)" if checkpointed else "")
                            + ("" if not low else f" mask lowered {low}"))
