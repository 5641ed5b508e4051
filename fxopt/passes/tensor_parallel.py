"""The ``tensor_parallel`` pass: Megatron's layout, found from the graph's dataflow (not from module names).

Design
------
The pass runs on the torch-level Dynamo graph that :func:`fxopt.parallelize` captures (parameters are placeholders;
``ctx.extras["tensor_parallel"]`` is a :class:`TPContext` naming the process group, the rank, and which placeholders
are parameters/buffers). Outside ``parallelize`` it leaves the graph alone (with a reason).

**State.** Every tensor node is either replicated (``None``: each rank holds the full value) or a :class:`Shard`:
sharded along ``dim`` with a *section layout* ``((size, rf), ...)``: the global dim is cut into sections (one for a
plain projection, three for a fused ``c_attn`` qkv, two for a fused gate/up) and each rank holds, of every section,
the chunk ``rank // rf`` of ``tp // rf`` equal chunks (``rf`` > 1 = a replication factor, used for GQA kv heads when
``tp`` exceeds their number: each rank keeps the one kv head its query heads read). The local tensor is the
concatenation of its chunks.

**Search (greatest fixed point).** Every linear with a parameter weight (``F.linear``, GPT-2 ``Conv1D``'s
``addmm``, ``fxopt::w4a16_linear``, ``linear(x, dequantize_w4(...))``) starts as a column-parallel *seed*. One
topological sweep propagates states; a linear whose input is sharded along its feature dim becomes row-parallel
(output replicated after one all-reduce). Ops that work per shard carry the state (elementwise ops with
broadcasting, view/reshape/flatten with dim-group tracking, expand, transpose/permute, unsqueeze, getitem,
split/chunk/unbind, cat/stack (cat skips legacy empty ``(0,)`` operands, as torch.cat does), softmax and reductions
off the sharded dim, batched matmul over a sharded batch dim, ``F.scaled_dot_product_attention`` and
``fxopt::flash_attention`` over heads with GQA checked rank by rank). Any other use of a sharded tensor (a norm over
the sharded dim, a residual add with a replicated tensor, the graph output, an in-place op, ...) is a *conflict*:
the seeds that reach it are dropped, with the reason, and the sweep repeats until none is left. Graph outputs that
``TPContext.shardable_outputs`` names (the tensors of the model's KV-cache object) may stay sharded;
``TPContext.sharded_inputs`` (a cache passed back) start sharded, and a conflict one reaches raises
:class:`ShardedInputError` (no seed can undo it). So everything unproven stays replicated; what remains is
Megatron's plan: q/k/v (column) → rotary/attention → o_proj (row) + all-reduce; gate/up (column) → act·mul → down
(row) + all-reduce.

**Rewrite.** Sharded weights/biases become local (their placeholders get local fake values; the plan records how
to cut every real tensor: :class:`TensorShard`). Literal sizes in view/reshape/expand/split args at the sharded
position become local sizes (``-1`` stays; a symbolic size there is a conflict). A row-parallel linear loses its
bias, gets ``_c10d_functional.all_reduce`` + ``wait_tensor`` and the bias is added after. In training form
(``TPContext.training``) the all-reduce's backward is made the identity (``y = ar(x.detach()) + (x - x.detach())``)
and Megatron's *f* (``fxopt::tp_copy``: identity forward, all-reduce backward) guards every replicated tensor that
needs grad where it enters a sharded computation. With ``vocab_parallel`` a sharded tensor reaching the graph output
(the lm_head logits) is all-gathered, and an embedding tied to that lm_head is cut by the same vocabulary rows
(masked lookup + all-reduce); an untied embedding is cut only with ``vocab_parallel_embedding`` (its all-reduce costs
more time than the replicated lookup, which only costs memory).
Afterwards the whole graph is fake-propagated again and every node's shape is checked against the plan's
prediction: a mismatch raises (a wrong shard is never produced silently).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..config import TensorParallelConfig
from . import match
from .manager import PassContext, PassResult, register_pass

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Megatron's f: identity forward, all-reduce backward
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Plan objects
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """A tensor sharded along ``dim``: sections ``((size, rf), ...)`` of the global dim, chunked ``tp // rf`` ways."""

    dim: int
    sections: tuple

    @property
    def size(self) -> int:
        return sum(s for s, _ in self.sections)

    def local(self, tp: int) -> int:
        return sum(s * rf // tp for s, rf in self.sections)

    def valid(self, tp: int) -> bool:
        return all(s > 0 and tp % rf == 0 and s % (tp // rf) == 0 for s, rf in self.sections)

    def moved(self, dim: int) -> "Shard":
        return Shard(dim, self.sections)

    def indices(self, rank: int, tp: int) -> list:
        """Global indices along ``dim`` that ``rank`` holds, in local order."""
        out, off = [], 0
        for s, rf in self.sections:
            c = s // (tp // rf)
            start = off + (rank // rf) * c
            out.extend(range(start, start + c))
            off += s
        return out

    def describe(self) -> str:
        if len(self.sections) == 1 and self.sections[0][1] == 1:
            return f"dim {self.dim}"
        secs = ", ".join(str(s) if rf == 1 else f"{s} (x{rf} replicated)" for s, rf in self.sections)
        return f"dim {self.dim}, sections [{secs}]"


@dataclass
class TensorShard:
    """How to cut one real tensor (a parameter or buffer) for one rank."""

    placeholder: str
    name: str
    shard: Shard
    global_shape: tuple
    local_shape: tuple
    role: str

    def cut(self, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if tuple(t.shape) != tuple(self.global_shape):
            raise ValueError(f"{self.name}: expected shape {self.global_shape}, got {tuple(t.shape)}")
        d, pieces, off = self.shard.dim, [], 0
        for s, rf in self.shard.sections:
            c = s // (tp // rf)
            pieces.append(t.narrow(d, off + (rank // rf) * c, c))
            off += s
        return torch.cat(pieces, d).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


@dataclass
class TensorParallelPlan:
    """The plan found for one graph: which tensors are cut how, where the collectives go, and what stayed."""

    tp: int
    rank: int
    shards: dict = field(default_factory=dict)  # placeholder name -> TensorShard
    linears: list = field(default_factory=list)  # (kind, module/weight name, detail)
    all_reduces: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0  # sequence parallel: row-parallel outputs reduce-scattered over the tokens
    overlap_chunks: int = 1  # token chunks of the row-parallel all-reduces (1: not chunked)
    replicated: list = field(default_factory=list)  # (name, reason)
    notes: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)  # placeholder name -> (description, Shard): graph inputs held local
    outputs: dict = field(default_factory=dict)  # graph output index -> (description, Shard): outputs left local

    def lines(self) -> list:
        rs = f", {self.reduce_scatters} reduce_scatter(s)" if self.reduce_scatters else ""
        out = [f"tensor_parallel plan: tp={self.tp}, rank {self.rank}: {len(self.linears)} sharded op(s), "
               f"{self.all_reduces} all_reduce(s), {self.all_gathers} all_gather(s){rs} in forward"]
        for kind, name, detail in self.linears:
            out.append(f"  {kind:<10} {name}  {detail}")
        for what, table in (("input", self.inputs), ("output", self.outputs)):
            for desc, sh in table.values():
                out.append(f"  {'local ' + what:<10} {desc}  {sh.describe()} ({sh.size} -> {sh.local(self.tp)})")
        for n in self.notes:
            out.append(f"  note: {n}")
        for name, reason in self.replicated:
            out.append(f"  replicated {name}: {reason}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass
class TPContext:
    """What :func:`fxopt.parallelize` hands the pass through ``ctx.extras["tensor_parallel"]``.

    Args:
        group_name: the process group's name (``group.group_name``), used by the functional collectives.
        rank: this rank within the group.
        tp: the group's size.
        params: placeholder name -> parameter/buffer name (FQN) for every placeholder that is model state.
        training: emit the autograd-correct form (f/g with identity/all-reduce backward).
        grad_inputs: placeholder names whose tensors require grad (training form only).
        sharded_inputs: placeholder name -> (description, :class:`Shard`) for graph inputs that hold this rank's
            part of a tensor (a KV cache this module returned sharded); the propagation starts from them.
        shardable_outputs: graph output index -> description for outputs that may stay sharded (each lands only in
            the model's KV cache object, which keeps this rank's heads); every other output follows the default rule.
        plan: filled by the pass.
    """

    group_name: str
    rank: int
    tp: int
    params: dict
    training: bool = False
    grad_inputs: frozenset = frozenset()
    sharded_inputs: dict = field(default_factory=dict)
    shardable_outputs: dict = field(default_factory=dict)
    plan: Optional[TensorParallelPlan] = None


class _Conflict(Exception):
    pass


class ShardedInputError(ValueError):
    """A graph input holds this rank's shard (a KV cache) but the graph needs it whole: no replicated fallback."""


# ----------------------------------------------------------------------------------------------------------------
# Op tables
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Linear sites
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    kind: str  # "dense" (W [N, K]), "conv1d" (addmm, W [K, N]), "w4a16" (fused), "dequant" (linear of dequantize_w4)
    weight: fx.Node  # dense weight placeholder, or qweight placeholder
    bias: Optional[fx.Node]
    N: int
    K: int
    qparams: tuple = ()  # (qweight, scales, zeros) placeholders
    group_size: int = 0
    dequant: Optional[fx.Node] = None
    casts: tuple = ()  # cast nodes between state placeholders and their use (dequant path)


def _strip_casts(n):
    chain = []
    while isinstance(n, fx.Node) and n.op == "call_method" and n.target in ("to", "float", "half", "bfloat16") \
            and len(n.users) == 1:
        chain.append(n)
        n = n.args[0]
    return n, chain


class _Finder:
    def __init__(self, gm: fx.GraphModule, tpc: TPContext):
        self.gm, self.tpc = gm, tpc

    def is_state(self, n) -> bool:
        return isinstance(n, fx.Node) and n.op == "placeholder" and n.name in self.tpc.params

    def linear(self, node: fx.Node) -> Optional[_Linear]:
        k = _kind(node)
        if k == "linear":
            x = match.get_arg(node, 0, "input")
            w = match.get_arg(node, 1, "weight")
            b = match.get_arg(node, 2, "bias")
            if b is not None and not self.is_state(b):
                return None
            ws, casts = _strip_casts(w)
            if self.is_state(ws):
                sh = _shape(ws)
                if sh is None or len(sh) != 2:
                    return None
                if casts:
                    return None
                return _Linear(node, x, "dense", ws, b, sh[0], sh[1])
            if isinstance(ws, fx.Node) and _kind(ws) == "dequantize_w4" and len(ws.users) == 1:
                qw, sc, zr = ws.args[0], ws.args[1], ws.args[2]
                G = ws.args[3] if len(ws.args) > 3 else ws.kwargs.get("group_size")
                srcs, all_casts = [], list(casts)
                for t in (qw, sc, zr):
                    s, c = _strip_casts(t)
                    srcs.append(s)
                    all_casts += c
                if not all(self.is_state(s) for s in srcs) or not isinstance(G, int):
                    return None
                qsh = _shape(srcs[0])
                K = qsh[0] * 8
                return _Linear(node, x, "dequant", srcs[0], b, qsh[1], K, tuple(srcs), K if G == -1 else G, ws,
                               tuple(all_casts))
            return None
        if k == "w4a16_linear":
            x, qw, sc, zr = node.args[:4]
            G = node.args[4] if len(node.args) > 4 else node.kwargs.get("group_size")
            b = node.args[5] if len(node.args) > 5 else node.kwargs.get("bias")
            if not all(self.is_state(t) for t in (qw, sc, zr)) or (b is not None and not self.is_state(b)):
                return None
            qsh = _shape(qw)
            K = qsh[0] * 8
            return _Linear(node, x, "w4a16", qw, b, qsh[1], K, (qw, sc, zr), K if G == -1 else G)
        if k == "addmm":
            b, x, w = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 3:
                return None
            if not self.is_state(w) or not self.is_state(b):
                return None
            sh = _shape(w)
            if sh is None or len(sh) != 2 or _shape(b) != (sh[1],):
                return None
            return _Linear(node, x, "conv1d", w, b, sh[1], sh[0])
        return None


# ----------------------------------------------------------------------------------------------------------------
# Propagation rules
# ----------------------------------------------------------------------------------------------------------------
def _reshape_map(in_shape, out_shape, sh: Shard, tp: int) -> Shard:
    if not (_concrete(in_shape) and _concrete(out_shape)):
        raise _Conflict("reshape with symbolic sizes around the sharded dim")
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape:
        raise _Conflict("reshape of an empty tensor")
    groups, i, j = [], 0, 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni and j < no:
        gi, gj, pi, pj = [i], [j], in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((gi, gj))
    if groups:
        groups[-1][0].extend(range(i, ni))
        groups[-1][1].extend(range(j, no))
    for gi, gj in groups:
        if sh.dim not in gi:
            continue
        k = gi.index(sh.dim)
        P = math.prod(in_shape[d] for d in gi[:k])
        inner = math.prod(in_shape[d] for d in gi[k + 1:])
        flat = [(s * inner, rf) for s, rf in sh.sections] * P
        for jj_i, jj in enumerate(gj):
            Q = math.prod(out_shape[d] for d in gj[:jj_i])
            J = math.prod(out_shape[d] for d in gj[jj_i + 1:])
            if Q == 0 or len(flat) % Q:
                continue
            period = flat[: len(flat) // Q]
            if period * Q != flat or any(l % J for l, _ in period):
                continue
            new = Shard(jj, tuple((l // J, rf) for l, rf in period))
            if new.size == out_shape[jj] and new.valid(tp):
                return new
        raise _Conflict(f"reshape {tuple(in_shape)} -> {tuple(out_shape)} splits the sharded dim "
                        f"({sh.describe()}) across shards (tp={tp})")
    raise _Conflict("reshape: sharded dim not found")


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


class _Propagation:
    """One sweep over the graph for a given set of column seeds."""

    def __init__(self, owner: "_TPAnalysis", seeds: dict):
        self.o = owner
        self.tp = owner.tp
        self.seeds = seeds
        self.state: dict = {}
        self.blame: dict = {}
        self.conflicts: list = []  # (node, blame set, reason)
        self.rewrites: dict = {}  # node -> callable performing the arg edit
        self.rows: dict = {}  # linear node -> Shard of its input
        self.columns: dict = {}  # linear node -> Shard of its output
        self.gathers: dict = {}  # output arg node -> Shard
        self.outputs: dict = {}  # shardable graph output index -> Shard it is left with

    def run(self):
        for node in self.o.gm.graph.nodes:
            ins = [a for a in node.all_input_nodes if self.state.get(a) is not None]
            blame = frozenset().union(*(self.blame.get(a, frozenset()) for a in ins)) if ins else frozenset()
            try:
                st = self.visit(node, ins)
            except _Conflict as e:
                self.conflicts.append((node, blame, str(e)))
                st = None
            if st is not None:
                self.state[node] = st
                self.blame[node] = blame | self.blame.get(node, frozenset())
        return self

    # -- the rules ---------------------------------------------------------------------------------------------
    def visit(self, node: fx.Node, ins: list):
        lin = self.o.linears.get(node)
        if lin is not None:
            return self.visit_linear(lin, ins)
        if node.op == "placeholder":
            entry = self.o.tpc.sharded_inputs.get(node.name)
            if entry is None:
                return None
            self.blame[node] = frozenset([node])
            return entry[1]
        if node.op == "output":
            if ins:
                self.visit_output(node)
            return None
        if not ins:
            return None
        k = _kind(node)
        fn = getattr(self, f"rule_{k}", None) if k else None
        if fn is None:
            raise _Conflict(f"{node.format_node()} is not proven to work per shard")
        return fn(node, ins)

    def visit_output(self, node: fx.Node):
        """Each output position on its own: a conflict blames only the seeds that reach that position."""
        shardable = self.o.tpc.shardable_outputs
        for i, a in enumerate(_output_args(node)):
            sh = self.state.get(a) if isinstance(a, fx.Node) else None
            if sh is None:
                continue
            try:
                if not isinstance(sh, Shard):
                    raise _Conflict("a tuple of shards reaches the graph output")
                if i in shardable:
                    self.outputs[i] = sh  # stays local: this rank's heads of a KV cache
                    continue
                if not self.o.cfg.vocab_parallel:
                    raise _Conflict("reaches the graph output")
                if len(sh.sections) != 1 or sh.sections[0][1] != 1:
                    raise _Conflict("reaches the graph output with a layout one all_gather cannot undo")
                self.gathers[a] = sh
            except _Conflict as e:
                self.conflicts.append((node, self.blame.get(a, frozenset()), str(e)))

    def visit_linear(self, lin: _Linear, ins):
        node = lin.node
        xs = self.state.get(lin.x)
        others = [a for a in ins if a is not lin.x]
        if others:
            raise _Conflict("a sharded tensor is a linear's weight or bias")
        if xs is not None:
            xshape = _shape(lin.x)
            if not isinstance(xs, Shard) or xs.dim != len(xshape) - 1:
                raise _Conflict(f"linear input is sharded on {getattr(xs, 'dim', '?')}, not its feature dim")
            if lin.kind in ("w4a16", "dequant"):
                for s, rf in xs.sections:
                    c = s // (self.tp // rf)
                    if rf != 1 or c % 8 or c % lin.group_size:
                        raise _Conflict(f"row-parallel int4 linear needs K/tp ({c}) to be a multiple of 8 and of "
                                        f"the group size {lin.group_size}")
            self.rows[node] = xs
            return None
        if node in self.seeds:
            rf = self.seeds[node]
            secs = self.o.sections_for(lin, rf)
            sh = Shard(len(_shape(node)) - 1, secs)
            if not sh.valid(self.tp):
                raise _Conflict(f"out features {lin.N} (sections {[s for s, _ in secs]}) not divisible by tp")
            self.columns[node] = sh
            self.blame[node] = frozenset([node])
            return sh
        return None

    def _out_shape(self, node):
        s = _shape(node)
        if s is None:
            raise _Conflict("output is not a tensor")
        return s

    def rule_elementwise(self, node, ins, data_args=None):
        out = self._out_shape(node)
        nd = len(out)
        target_dim, spec = None, None
        args = data_args if data_args is not None else list(node.args) + list(node.kwargs.values())
        tensors = []
        for a in args:
            if isinstance(a, (list, tuple)):
                if any(isinstance(x, fx.Node) and self.state.get(x) is not None for x in a):
                    raise _Conflict("sharded tensor inside a list argument")
                continue
            if isinstance(a, fx.Node) and match.tensor_val(a) is not None:
                tensors.append(a)
        for a in tensors:
            sh = self.state.get(a)
            if sh is None:
                continue
            if not isinstance(sh, Shard):
                raise _Conflict("tuple used as a tensor")
            ash = _shape(a)
            d = sh.dim + nd - len(ash)
            if ash[sh.dim] != out[d]:
                raise _Conflict("sharded dim is broadcast")
            if spec is None:
                target_dim, spec = d, sh
            elif d != target_dim or sh.sections != spec.sections:
                raise _Conflict("operands sharded differently")
        for a in tensors:
            if self.state.get(a) is not None:
                continue
            ash = _shape(a)
            d = target_dim - (nd - len(ash))
            if d >= 0 and ash[d] != 1:
                raise _Conflict(f"replicated operand {a.name} {tuple(ash)} is not broadcast along the sharded dim")
        return spec.moved(target_dim)

    def rule_cast(self, node, ins):
        if node.args[0] not in ins:
            return None
        return self.rule_elementwise(node, ins, data_args=[node.args[0]])

    def rule_reshape(self, node, ins):
        x = node.args[0]
        if x not in ins:
            raise _Conflict("sharded tensor used as a shape")
        sh = self.state[x]
        in_shape, out_shape = _shape(x), self._out_shape(node)
        new = _reshape_map(in_shape, out_shape, sh, self.tp)
        sizes, setter = _shape_arg_list(node)
        if len(sizes) != len(out_shape):
            raise _Conflict("reshape size list does not match the output rank")
        v = sizes[new.dim]
        if isinstance(v, fx.Node):
            raise _Conflict("symbolic size at the sharded position of a reshape")
        if v != -1:
            local = new.local(self.tp)
            self.rewrites[node] = lambda: setter([local if i == new.dim else s for i, s in enumerate(sizes)])
        return new

    def rule_flatten(self, node, ins):
        if node.args[0] not in ins:
            raise _Conflict("sharded tensor in flatten args")
        return _reshape_map(_shape(node.args[0]), self._out_shape(node), self.state[node.args[0]], self.tp)

    def rule_expand(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        in_shape, out_shape = _shape(x), self._out_shape(node)
        d = sh.dim + len(out_shape) - len(in_shape)
        if in_shape[sh.dim] != out_shape[d]:
            raise _Conflict("expand along the sharded dim")
        sizes, setter = _shape_arg_list(node)
        v = sizes[d]
        if isinstance(v, fx.Node):
            raise _Conflict("symbolic size at the sharded position of expand")
        if v != -1:
            local = sh.local(self.tp)
            self.rewrites[node] = lambda: setter([local if i == d else s for i, s in enumerate(sizes)])
        return sh.moved(d)

    def rule_transpose(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        nd = len(_shape(x))
        if node.target == "t":
            a, b = 0, 1
        else:
            a = _norm(match.get_arg(node, 1, "dim0"), nd)
            b = _norm(match.get_arg(node, 2, "dim1"), nd)
        d = b if sh.dim == a else a if sh.dim == b else sh.dim
        return sh.moved(d)

    def rule_permute(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        nd = len(_shape(x))
        dims = node.args[1:] if node.op == "call_method" else (match.get_arg(node, 1, "dims"),)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        dims = [_norm(d, nd) for d in dims]
        return sh.moved(dims.index(sh.dim))

    def rule_unsqueeze(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        d = _norm(match.get_arg(node, 1, "dim"), len(_shape(x)) + 1)
        return sh.moved(sh.dim + 1 if d <= sh.dim else sh.dim)

    def rule_getitem(self, node, ins):
        x, idx = node.args[0], node.args[1]
        st = self.state[x]
        if isinstance(st, tuple):
            if not isinstance(idx, int):
                raise _Conflict("non-literal index into a tuple")
            return st[idx]
        if any(isinstance(a, fx.Node) for a in node.args[1:] if not isinstance(a, tuple)) or (
                isinstance(idx, tuple) and any(isinstance(i, fx.Node) for i in idx)):
            raise _Conflict("tensor indexing of a sharded tensor")
        shape = _shape(x)
        items = idx if isinstance(idx, tuple) else (idx,)
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        i_in = i_out = 0
        for it in items:
            if it is None:
                i_out += 1
            elif it is Ellipsis:
                skip = len(shape) - consumed
                if i_in <= st.dim < i_in + skip:
                    return st.moved(i_out + st.dim - i_in)
                i_in += skip
                i_out += skip
            elif isinstance(it, int):
                if i_in == st.dim:
                    raise _Conflict("integer index on the sharded dim")
                i_in += 1
            elif isinstance(it, slice):
                if i_in == st.dim:
                    full = it.start in (None, 0) and it.step in (None, 1) and (
                        it.stop is None or (isinstance(it.stop, int) and it.stop >= shape[i_in]))
                    if not full:
                        raise _Conflict("slice of the sharded dim")
                    return st.moved(i_out)
                i_in += 1
                i_out += 1
            else:
                raise _Conflict(f"index {it!r} of a sharded tensor")
        return st.moved(i_out + st.dim - i_in)

    def _split_sizes(self, node, x, dim_arg_index):
        return _split_sizes(node, x)

    def rule_split(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        sizes, d, raw = self._split_sizes(node, x, 2)
        if d != sh.dim:
            return tuple(sh for _ in sizes)
        if sizes != [s for s, _ in sh.sections]:
            raise _Conflict(f"split {sizes} does not follow the shard sections {[s for s, _ in sh.sections]}")
        outs = tuple(Shard(d, (sec,)) for sec in sh.sections)
        if raw is not None:
            if isinstance(raw, int):
                locs = {o.local(self.tp) for o in outs}
                if len(locs) != 1:
                    raise _Conflict("split by one size over unequal local sections")
                loc = locs.pop()
                self.rewrites[node] = lambda: _set_arg(node, 1, "split_size_or_sections", loc)
            else:
                new = [o.local(self.tp) for o in outs]
                self.rewrites[node] = lambda: _set_arg(node, 1, "split_size_or_sections", type(raw)(new))
        return outs

    def rule_chunk(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        sizes, d, _ = self._split_sizes(node, x, 2)
        if d != sh.dim:
            return tuple(sh for _ in sizes)
        if sizes != [s for s, _ in sh.sections] or len({o for o in sh.sections}) != 1:
            raise _Conflict("chunk of the sharded dim does not follow the shard sections")
        return tuple(Shard(d, (sec,)) for sec in sh.sections)

    def rule_unbind(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        shape = _shape(x)
        d = _norm(match.get_arg(node, 1, "dim", 0), len(shape))
        if d == sh.dim:
            raise _Conflict("unbind along the sharded dim")
        return tuple(sh.moved(sh.dim - 1 if sh.dim > d else sh.dim) for _ in range(shape[d]))

    def rule_cat(self, node, ins):
        # torch.cat skips legacy empty 1-D operands (shape (0,)): transformers' DynamicLayer starts from one
        tensors = [t for t in match.get_arg(node, 0, "tensors") if not _legacy_empty(t)]
        return self._joined(node, tensors)

    def _joined(self, node, tensors):
        out = self._out_shape(node)
        d = _norm(match.get_arg(node, 1, "dim", 0), len(out))
        specs = {self.state.get(t) for t in tensors}
        if len(specs) != 1 or None in specs:
            raise _Conflict("cat of sharded and replicated tensors")
        sh = specs.pop()
        if sh.dim == d:
            raise _Conflict("cat along the sharded dim")
        return sh

    def rule_stack(self, node, ins):
        sh = self._joined(node, match.get_arg(node, 0, "tensors"))
        d = _norm(match.get_arg(node, 1, "dim", 0), len(self._out_shape(node)))
        return sh.moved(sh.dim + 1 if d <= sh.dim else sh.dim)

    def rule_softmax(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        if any(a is not x and isinstance(a, fx.Node) for a in node.all_input_nodes):
            raise _Conflict("softmax with tensor arguments")
        d = _norm(match.get_arg(node, 1, "dim"), len(_shape(x)))
        if d == sh.dim:
            raise _Conflict("softmax over the sharded dim")
        return sh

    def rule_reduce(self, node, ins):
        x = node.args[0]
        sh = self.state[x]
        nd = len(_shape(x))
        dims = match.get_arg(node, 1, "dim")
        if dims is None:
            raise _Conflict("full reduction of a sharded tensor")
        dims = [_norm(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if sh.dim in dims:
            raise _Conflict("reduction over the sharded dim")
        keep = match.get_arg(node, 2, "keepdim", False)
        return sh if keep else sh.moved(sh.dim - sum(1 for d in dims if d < sh.dim))

    def rule_matmul(self, node, ins):
        a, b = node.args[0], node.args[1]
        sa, sb = self.state.get(a), self.state.get(b)
        ash, bsh, out = _shape(a), _shape(b), self._out_shape(node)
        if len(ash) < 2 or len(bsh) < 2:
            raise _Conflict("matmul with a vector")
        nd = len(out)
        if sa is not None and sa.dim == len(ash) - 1 or sb is not None and sb.dim == len(bsh) - 2:
            raise _Conflict("matmul contracts over the sharded dim")
        if sa is not None and sa.dim == len(ash) - 2:
            if sb is not None:
                raise _Conflict("matmul with both operands sharded on M and N")
            return sa.moved(nd - 2)
        if sb is not None and sb.dim == len(bsh) - 1:
            if sa is not None:
                raise _Conflict("matmul with both operands sharded on M and N")
            return sb.moved(nd - 1)
        # batch dims
        da = sa.dim + nd - len(ash) if sa is not None else None
        db = sb.dim + nd - len(bsh) if sb is not None else None
        if da is not None and db is not None and (da != db or sa.sections != sb.sections):
            raise _Conflict("matmul operands sharded on different batch dims")
        d, sh = (da, sa) if da is not None else (db, sb)
        other, osh = (b, bsh) if da is not None else (a, ash)
        if self.state.get(other) is None:
            od = d - (nd - len(osh))
            if od >= 0 and osh[od] != 1:
                raise _Conflict("replicated matmul operand not broadcast along the sharded batch dim")
        return sh.moved(d)

    def _attention(self, node, ins, q, k, v, masks):
        sq, sk, sv = self.state.get(q), self.state.get(k), self.state.get(v)
        if sq is None or sk is None or sv is None:
            missing = [n for n, s in (("q", sq), ("k", sk), ("v", sv)) if s is None]
            raise _Conflict(f"attention with {'/'.join(missing)} not sharded by heads")
        qs, ks = _shape(q), _shape(k)
        hd = len(qs) - 3
        for name, s, shp in (("q", sq, qs), ("k", sk, ks), ("v", sv, _shape(v))):
            if s.dim != hd or len(s.sections) != 1:
                raise _Conflict(f"attention {name} is sharded on dim {s.dim} ({s.describe()}), not heads")
        if sk != sv:
            raise _Conflict("attention k and v are sharded differently")
        Hq, Hkv = qs[hd], ks[hd]
        if Hq % Hkv:
            raise _Conflict("query heads not a multiple of kv heads")
        # GQA check, rank by rank: each local query head must read the kv head it reads globally.
        for r in range(self.tp):
            lq, lk = sq.indices(r, self.tp), sk.indices(r, self.tp)
            if len(lq) % len(lk):
                raise _Conflict("local query heads not a multiple of local kv heads")
            g = len(lq) // len(lk)
            if any(h // (Hq // Hkv) != lk[j // g] for j, h in enumerate(lq)):
                raise _Conflict(f"rank {r}'s query heads would read the wrong kv heads")
        for m in masks:
            if not isinstance(m, fx.Node):
                continue
            sm = self.state.get(m)
            mshape = _shape(m)
            if sm is None:
                d = hd - (len(qs) - len(mshape))
                if d >= 0 and mshape[d] != 1 and len(mshape) == len(qs):
                    raise _Conflict("replicated attention mask has a head dim")
            elif sm.dim != hd + len(mshape) - len(qs) or sm.sections != sq.sections:
                raise _Conflict("attention mask sharded unlike q")
        return sq

    def rule_sdpa(self, node, ins):
        q, k, v = (match.get_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        mask = match.get_arg(node, 3, "attn_mask")
        qs, ks = _shape(q), _shape(k)
        if qs[-3] != ks[-3] and not node.kwargs.get("enable_gqa", False):
            raise _Conflict("GQA attention without enable_gqa")
        return self._attention(node, ins, q, k, v, [mask])

    def rule_flash_attention(self, node, ins):
        q, k, v = node.args[:3]
        mask = match.get_arg(node, 3, "attn_mask")
        kpm = match.get_arg(node, 9, "key_padding_mask")
        if self.state.get(kpm) is not None:
            raise _Conflict("sharded key padding mask")
        return self._attention(node, ins, q, k, v, [mask])


# ----------------------------------------------------------------------------------------------------------------
# Analysis: fixed point over the seed set
# ----------------------------------------------------------------------------------------------------------------
class _TPAnalysis:
    def __init__(self, gm: fx.GraphModule, cfg: TensorParallelConfig, tpc: TPContext, result: PassResult):
        self.gm, self.cfg, self.tpc, self.result = gm, cfg, tpc, result
        self.tp = tpc.tp
        finder = _Finder(gm, tpc)
        self.finder = finder
        self.linears: dict = {}
        self.all_linears: dict = {}
        self.dropped: dict = {}  # linear node -> reason
        for n in gm.graph.nodes:
            lin = finder.linear(n)
            if lin is None:
                continue
            self.all_linears[n] = lin
            users = [len(lin.weight.users)] + [len(t.users) for t in lin.qparams]
            if max(users) > 1 and not self._tied_ok(lin):
                self.dropped[n] = "its weight is also used by another op"
                continue
            self.linears[n] = lin

    def _tied_ok(self, lin):
        # a weight tied with a vocab-parallel embedding (GPT-2 wte / lm_head): same row cut
        if not self.cfg.vocab_parallel or lin.kind != "dense":
            return False
        others = [u for u in lin.weight.users if u is not lin.node]
        return all(_kind(u) == "embedding" and u.args[1] is lin.weight for u in others)

    def name(self, node: fx.Node) -> str:
        return self.tpc.params.get(node.name, node.name)

    def lin_name(self, lin: _Linear) -> str:
        n = self.name(lin.weight)
        for suffix in (".weight", ".qweight"):
            if n.endswith(suffix):
                return n[: -len(suffix)]
        return n

    def sections_for(self, lin: _Linear, rf: int) -> tuple:
        """Output sections: the sizes of a split/chunk of the output's feature dim that follows (fused qkv)."""
        cur = lin.node
        N = lin.N
        while len(cur.users) == 1:
            u = next(iter(cur.users))
            k = _kind(u)
            us = _shape(u)
            if k in ("reshape", "cast", "elementwise") and us is not None and us[-1] == N and (
                    k != "elementwise" or len(u.all_input_nodes) == 1):
                cur = u
                continue
            break
        for u in cur.users:
            k = _kind(u)
            if k in ("split", "chunk"):
                try:
                    sizes, d, _ = _split_sizes(u, cur)
                except _Conflict:
                    continue
                if d == len(_shape(cur)) - 1 and sum(sizes) == N and len(sizes) > 1:
                    return tuple((s, rf) for s in sizes)
        return ((N, rf),)

    def gqa_replication(self) -> dict:
        """rf per linear for kv projections whose head count tp does not divide (tp % Hkv == 0 only)."""
        rfs = {}
        for n in self.gm.graph.nodes:
            k = _kind(n)
            if k not in _ATTENTION:
                continue
            q, kk, v = (n.args[:3] if k == "flash_attention" else
                        [match.get_arg(n, i, nm) for i, nm in enumerate(("query", "key", "value"))])
            qs, ks = _shape(q), _shape(kk)
            if qs is None or ks is None or len(qs) < 3:
                continue
            Hq, Hkv = qs[-3], ks[-3]
            if Hkv % self.tp == 0 or Hq % self.tp or self.tp % Hkv or Hq % Hkv:
                continue
            rf = self.tp // Hkv
            q_src = self._source_linears(q)
            for t in (kk, v):
                for lin in self._source_linears(t):
                    if lin in q_src:
                        continue
                    rfs[lin] = rf
            note = (f"tensor_parallel: {Hkv} kv head(s) < tp={self.tp}: kv projections replicated over {rf} ranks "
                f"(rank r holds kv head r // {rf})")
            if note not in self.result.notes:
                self.result.notes.append(note)
        return rfs

    def _source_linears(self, node) -> set:
        out, stack, seen = set(), [node], set()
        while stack:
            n = stack.pop()
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            if n in self.linears:
                out.add(n)
                continue
            stack.extend(n.all_input_nodes)
        return out

    def solve(self) -> _Propagation:
        rfs = self.gqa_replication()
        seeds = {n: rfs.get(n, 1) for n in self.linears}
        while True:
            prop = _Propagation(self, seeds).run()
            if not prop.conflicts:
                break
            inputs = set(self.tpc.sharded_inputs)
            # conflicts a sharded input reaches cannot be undone by dropping seeds: judged once no other is left
            seeded = [c for c in prop.conflicts if not any(b.name in inputs for b in c[1] if b.op == "placeholder")]
            dropped_any = False
            for node, blame, reason in seeded:
                for s in blame:
                    if s in seeds:
                        del seeds[s]
                        self.dropped.setdefault(s, f"{reason} (at {node.name})")
                        dropped_any = True
            if dropped_any:
                continue
            for node, blame, reason in prop.conflicts:
                held = sorted(b.name for b in blame if b.op == "placeholder" and b.name in inputs)
                if held:
                    desc = ", ".join(self.tpc.sharded_inputs[h][0] for h in held)
                    raise ShardedInputError(f"tensor_parallel: {desc} holds this rank's part (sharded), but at "
                                            f"{node.name} {reason}; the graph would need the whole tensor")
            raise RuntimeError(f"tensor_parallel: unexplained conflicts {prop.conflicts[:3]}")
        return prop


# ----------------------------------------------------------------------------------------------------------------
# Rewrite
# ----------------------------------------------------------------------------------------------------------------
def _copy_meta(new: fx.Node, old: fx.Node):
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


class _Rewriter:
    def __init__(self, an: _TPAnalysis, prop: _Propagation):
        self.an, self.prop = an, prop
        self.g = an.gm.graph
        self.tpc = an.tpc
        self.tp, self.rank = an.tp, an.tpc.rank
        self.plan = TensorParallelPlan(self.tp, self.rank)
        self.f_cache: dict = {}
        self.dead: list = []  # unchunked row linears replaced by their chunks, erased at the end of run()
        self.reduced: list = []  # (input, all_reduce, wait) of every whole (unchunked) inference all-reduce
        self.local_shapes: dict = {}  # node -> local shape changed by the sequence-parallel step
        self.unchecked: set = set()  # nodes whose shape the sequence-parallel step changed without a prediction

    def shard_placeholder(self, ph: fx.Node, sh: Shard, role: str):
        gshape = tuple(_shape(ph))
        local = list(gshape)
        local[sh.dim] = sh.local(self.tp)
        prev = self.plan.shards.get(ph.name)
        if prev is not None:
            if prev.shard != sh:
                raise RuntimeError(f"tensor_parallel: {ph.name} would be cut two ways")
            return
        self.plan.shards[ph.name] = TensorShard(ph.name, self.an.name(ph), sh, gshape, tuple(local), role)

    def all_reduce(self, after: fx.Node, x: fx.Node) -> fx.Node:
        g = self.g
        with g.inserting_before(after.next):
            if self.tpc.training:
                xd = g.call_method("detach", (x,))
                ar = g.call_function(_ALL_REDUCE, (xd, "sum", self.tpc.group_name))
                w = g.call_function(_WAIT, (ar,))
                zero = g.call_method("sub", (x, xd))  # exact zeros that carry the gradient (identity backward)
                out = g.call_function(operator.add, (w, zero))
                nodes = [xd, ar, w, zero, out]
            else:
                ar = g.call_function(_ALL_REDUCE, (x, "sum", self.tpc.group_name))
                out = g.call_function(_WAIT, (ar,))
                nodes = [ar, out]
                self.reduced.append((x, ar, out))
        for n in nodes:
            _copy_meta(n, x)
        self.plan.all_reduces += 1
        return out

    def _overlap_chunks(self, lin: _Linear, node: fx.Node) -> int:
        """How many token chunks to cut this row-parallel linear into (1: none). Inference graphs only; the token
        dimension (dim -2 of the input) must be static and divisible."""
        c = self.an.cfg.overlap_chunks
        if c <= 1 or self.tpc.training:
            return 1
        xv = lin.x.meta.get("val") if isinstance(lin.x, fx.Node) else None
        if xv is None or xv.dim() < 2 or not isinstance(xv.shape[-2], int) or xv.shape[-2] % c:
            return 1
        return c if lin.x in node.all_input_nodes else 1

    def _chunked_all_reduce(self, node: fx.Node, x: fx.Node, chunks: int) -> fx.Node:
        """y = linear(x) + all_reduce  ->  per token chunk i: y_i = linear(x_i); all_reduce(y_i) issued at once;
        the waits after the last chunk's matmul; cat. Chunk i's all-reduce then runs on the communication stream
        while chunk i + 1's matmul runs on the compute stream."""
        g = self.g
        pending, outs = [], []
        cursor = node
        with g.inserting_after(cursor):
            parts = g.call_function(torch.chunk, (x, chunks, -2))
        cursor = parts
        for i in range(chunks):
            with g.inserting_after(cursor):
                xi = g.call_function(operator.getitem, (parts, i))
            with g.inserting_after(xi):
                yi = g.node_copy(node, lambda n: xi if n is x else n)
            with g.inserting_after(yi):
                ar = g.call_function(_ALL_REDUCE, (yi, "sum", self.tpc.group_name))
            for n in (xi, yi, ar):
                _copy_meta(n, node)
            pending.append(ar)
            cursor = ar
        for ar in pending:
            with g.inserting_after(cursor):
                w = g.call_function(_WAIT, (ar,))
            _copy_meta(w, node)
            outs.append(w)
            cursor = w
        with g.inserting_after(cursor):
            out = g.call_function(torch.cat, (outs, -2))
        _copy_meta(out, node)
        _copy_meta(parts, node)
        self.plan.all_reduces += chunks
        self.plan.overlap_chunks = max(self.plan.overlap_chunks, chunks)
        # the unchunked linear has no users left once the caller rewires them to ``out``
        self.dead.append(node)
        return out

    def tp_copy(self, src: fx.Node, consumer: fx.Node) -> fx.Node:
        """Megatron's f on a replicated tensor that needs grad and enters a sharded computation."""
        if src in self.f_cache:
            return self.f_cache[src]
        with self.g.inserting_before(consumer):
            f = self.g.call_function(torch.ops.fxopt.tp_copy.default, (src, self.tpc.group_name))
        _copy_meta(f, src)
        self.f_cache[src] = f
        return f

    def run(self):
        an, prop, g = self.an, self.prop, self.g
        # 1. argument edits (view sizes, split sizes)
        for node, fn in prop.rewrites.items():
            fn()
        # 2./3. linears in graph order: columns cut along out features, rows along in features (+ all-reduce)
        order = {n: i for i, n in enumerate(g.nodes)}
        todo = sorted([(n, "column") for n in prop.columns] + [(n, "row") for n in prop.rows],
                      key=lambda t: order[t[0]])
        for node, kind in todo:
            if kind == "column":
                self._column(node, prop.columns[node])
            else:
                self._row(node, prop.rows[node])
        # 4. vocab-parallel embeddings
        if an.cfg.vocab_parallel:
            self._vocab_embeddings()
        # 5. gathers at the output (vocab-parallel lm_head)
        for node, sh in prop.gathers.items():
            self._gather(node, sh)
        # 6. Megatron's f where replicated tensors needing grad enter sharded computations
        if self.tpc.training:
            self._insert_f()
        for node in self.dead:
            if not node.users:
                self.prop.state.pop(node, None)
                g.erase_node(node)
        # 7. sequence parallel: reduce-scatter instead of all-reduce, token-wise ops on the local tokens
        if an.cfg.sequence_parallel:
            if self.tpc.training:
                self.plan.notes.append("sequence_parallel applies to inference graphs; this training graph keeps "
                                       "its all-reduces")
            else:
                _SequenceParallel(self).run()

    def _column(self, node, sh):
        an = self.an
        lin = an.linears[node]
        secs = sh.sections
        if lin.kind == "dense":
            self.shard_placeholder(lin.weight, Shard(0, secs), "column weight")
        elif lin.kind == "conv1d":
            self.shard_placeholder(lin.weight, Shard(1, secs), "column weight (Conv1D)")
        else:
            for t in lin.qparams:
                self.shard_placeholder(t, Shard(1, secs), "column int4 " + self.an.name(t).rsplit(".", 1)[-1])
        if lin.bias is not None:
            self.shard_placeholder(lin.bias, Shard(0, secs), "column bias")
        secs_txt = "" if secs == ((lin.N, 1),) else "  " + sh.describe().split(", ", 1)[-1]
        self.plan.linears.append(("column", an.lin_name(lin), f"out features {lin.N} -> {sh.local(self.tp)}"
                                  f"{secs_txt}"))
        an.result.rewrites += 1

    def _row(self, node, sh):
        an = self.an
        lin = an.linears[node]
        secs = sh.sections
        if lin.kind == "dense":
            self.shard_placeholder(lin.weight, Shard(1, secs), "row weight")
        elif lin.kind == "conv1d":
            self.shard_placeholder(lin.weight, Shard(0, secs), "row weight (Conv1D)")
        else:
            qw, sc, zr = lin.qparams
            self.shard_placeholder(qw, Shard(0, tuple((s // 8, rf) for s, rf in secs)), "row int4 qweight")
            for t in (sc, zr):
                self.shard_placeholder(t, Shard(0, tuple((s // lin.group_size, rf) for s, rf in secs)),
                                       "row int4 " + self.an.name(t).rsplit(".", 1)[-1])
        chunks = self._row_rewrite(lin)
        chunked = f" in {chunks} token chunks" if chunks > 1 else ""
        self.plan.linears.append(("row", an.lin_name(lin), f"in features {lin.K} -> {sh.local(self.tp)}"
                                  f"{' (bias after all_reduce)' if lin.bias is not None else ''} + all_reduce"
                                  f"{chunked}"))
        an.result.rewrites += 1

    def _row_rewrite(self, lin: _Linear) -> int:
        """Cut bias out, insert the all-reduce (in token chunks where configured); returns the chunk count."""
        node, g = lin.node, self.g
        bias = lin.bias
        if bias is not None:
            if lin.kind == "dense" or lin.kind == "dequant":
                _set_arg(node, 2, "bias", None)
            elif lin.kind == "w4a16":
                _set_arg(node, 5, "bias", None)
            elif lin.kind == "conv1d":
                with g.inserting_before(node):
                    mm = g.call_function(torch.mm, (lin.x, lin.weight))
                _copy_meta(mm, node)
                if "val" in node.meta:  # same (full) shape as the addmm it replaces
                    mm.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(mm)
                g.erase_node(node)
                node = mm
        users = list(node.users)
        chunks = self._overlap_chunks(lin, node)
        out = self._chunked_all_reduce(node, lin.x, chunks) if chunks > 1 else self.all_reduce(node, node)
        last = out
        if bias is not None:
            with g.inserting_after(out):
                last = g.call_function(operator.add, (out, bias))
            _copy_meta(last, node)
            if "val" in node.meta:  # the full output, as before the cut (read by the sequence-parallel step)
                last.meta["val"] = node.meta["val"]
        for u in users:
            u.replace_input_with(node, last)
        if lin.node is not node:  # conv1d: keep the analysis' maps pointing at live nodes
            self.prop.state.pop(lin.node, None)
        return chunks

    def _vocab_embeddings(self):
        an, g, tp, r = self.an, self.g, self.tp, self.rank
        head_sizes = {sh.size for sh in self.prop.gathers.values()}
        for node in list(g.nodes):
            if _kind(node) != "embedding":
                continue
            ids, w = node.args[0], node.args[1]
            if not an.finder.is_state(w):
                continue
            V, E = _shape(w)
            extra = list(node.args[2:]) + list(node.kwargs.values())
            max_norm = match.get_arg(node, 3, "max_norm")
            padding_idx = match.get_arg(node, 2, "padding_idx")
            if V not in head_sizes:
                an.result.skip(node, f"embedding rows {V} != the gathered lm_head's out features {head_sizes}: "
                                     f"not the vocabulary embedding, replicated")
                continue
            if V % tp:
                an.result.skip(node, f"vocab {V} not divisible by tp={tp}: embedding replicated")
                self.plan.replicated.append((an.name(w), f"vocab {V} not divisible by tp={tp}"))
                continue
            if max_norm is not None:
                an.result.skip(node, "embedding with max_norm: replicated")
                continue
            other = [u for u in w.users if u is not node]
            if not other and not an.cfg.vocab_parallel_embedding:
                reason = ("untied vocabulary embedding kept replicated (vocab_parallel_embedding=False): no masked "
                          "lookup, no all-reduce")
                an.result.skip(node, reason)
                self.plan.replicated.append((an.name(w), reason))
                continue
            ok = all(u in self.prop.columns and self.prop.columns[u].sections == ((V, 1),) and
                     an.linears[u].kind == "dense" for u in other)
            if not ok:
                reason = "embedding weight is tied to an op that is not vocab-parallel"
                an.result.skip(node, reason)
                self.plan.replicated.append((an.name(w), reason))
                continue
            Vl = V // tp
            start = r * Vl
            self.shard_placeholder(w, Shard(0, ((V, 1),)), "vocab embedding")
            with g.inserting_before(node):
                lo = g.call_function(operator.lt, (ids, start))
                hi = g.call_function(operator.ge, (ids, start + Vl))
                outside = g.call_function(operator.or_, (lo, hi))
                shifted = g.call_function(operator.sub, (ids, start))
                local_ids = g.call_method("masked_fill", (shifted, outside, 0))
            for n in (lo, hi, outside, shifted, local_ids):
                _copy_meta(n, node)
            node.replace_input_with(ids, local_ids)
            if isinstance(padding_idx, int):
                p = padding_idx % V
                _set_arg(node, 2, "padding_idx", (p - start) if start <= p < start + Vl else None)
            users = list(node.users)
            with g.inserting_after(node):
                m = g.call_method("unsqueeze", (outside, -1))
            with g.inserting_after(m):
                masked = g.call_method("masked_fill", (node, m, 0.0))
            _copy_meta(m, node)
            _copy_meta(masked, node)
            if "val" in node.meta:  # the embeddings' full shape (read by the sequence-parallel step)
                masked.meta["val"] = node.meta["val"]
            out = self.all_reduce(masked, masked)
            for u in users:
                u.replace_input_with(node, out)
            self.plan.linears.append(("vocab", an.name(w).rsplit(".", 1)[0], f"embedding rows {V} -> {Vl} "
                                      f"(masked lookup) + all_reduce"))
            an.result.rewrites += 1

    def _gather(self, node: fx.Node, sh: Shard):
        g, tp = self.g, self.tp
        d = sh.dim
        out_node = next(n for n in g.nodes if n.op == "output")
        with g.inserting_before(out_node):
            src = g.call_method("detach", (node,)) if self.tpc.training else node
            moved = g.call_method("movedim", (src, d, 0)) if d != 0 else src
            cont = g.call_method("contiguous", (moved,))
            ag = g.call_function(_ALL_GATHER, (cont, tp, self.tpc.group_name))
            w = g.call_function(_WAIT, (ag,))
            back = g.call_method("movedim", (w, 0, d)) if d != 0 else w
            res = back
            new = [src, moved, cont, ag, w, back]
            if self.tpc.training:
                # gradient of the local slice = the matching slice of the full gradient
                nd = len(_shape(node))
                zero = g.call_method("sub", (node, src))
                Vl = sh.local(tp)
                pad = [0, 0] * (nd - 1 - d) + [self.rank * Vl, (tp - 1 - self.rank) * Vl]
                padded = g.call_function(F.pad, (zero, pad))
                res = g.call_function(operator.add, (back, padded))
                new += [zero, padded, res]
        for n in new:
            _copy_meta(n, node)
        # only where the full value is due: a shardable output (a KV cache) keeps the local one
        shardable = self.tpc.shardable_outputs
        outs = tuple(res if a is node and i not in shardable else a for i, a in enumerate(_output_args(out_node)))
        out_node.args = (outs if isinstance(out_node.args[0], (tuple, list)) else outs[0],)
        self.plan.all_gathers += 1
        self.plan.linears.append(("gather", node.name, f"all_gather of {sh.describe()} at the graph output"))

    def _insert_f(self):
        prop, plan = self.prop, self.plan
        needs = set()  # nodes whose value depends on a tensor that requires grad (meta requires_grad is unreliable)
        for n in self.g.nodes:
            if n.op == "placeholder":
                if n.name in self.tpc.grad_inputs:
                    needs.add(n)
            elif not (n.op == "call_method" and n.target == "detach") and any(a in needs for a in n.all_input_nodes):
                v = match.tensor_val(n)
                if v is None or v.is_floating_point() or isinstance(match.val(n), (tuple, list)):
                    needs.add(n)
        targets = []
        for node in list(self.g.nodes):
            if node in prop.columns:
                cands = [self.an.linears[node].x]
            elif prop.state.get(node) is not None and node.op in ("call_function", "call_method"):
                cands = [a for a in node.all_input_nodes if prop.state.get(a) is None]
            else:
                continue
            for a in cands:
                v = match.tensor_val(a)
                if v is not None and a in needs and a.name not in plan.shards:
                    targets.append((node, a))
        for node, a in targets:
            node.replace_input_with(a, self.tp_copy(a, node))


# ----------------------------------------------------------------------------------------------------------------
# Sequence parallel (inference graphs)
# ----------------------------------------------------------------------------------------------------------------
_INPLACE_FUNCS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


class _SequenceParallel:
    """Megatron's sequence parallelism on an inference graph, after the tensor-parallel rewrite.

    Every whole row-parallel all-reduce becomes a reduce-scatter over the tokens: the output, seen as
    [N tokens, H], is left as this rank's N / tp consecutive token rows. Token-wise ops (elementwise, casts, norms as
    reductions over the last dim with keepdim, views that keep the last dim) then run on those rows only: a
    replicated operand with the same tokens is sliced locally (no communication), one that does not vary over the
    tokens (a norm weight, a bias, a scalar) is used as it is. Any other consumer (the next column-parallel linear,
    attention, the graph output) gets the full tensor back from one all-gather per value. The bytes moved equal the
    all-reduce's; the norms and residual adds run on 1 / tp of the tokens, and every all-gather feeding a matmul is
    the pattern Inductor's micro-pipeline TP can overlap with that matmul. An all-reduce whose token count the group
    size does not divide stays as it is."""

    def __init__(self, rw: _Rewriter):
        self.rw, self.g = rw, rw.g
        self.tp, self.rank, self.group = rw.tp, rw.rank, rw.tpc.group_name
        self.gshape: dict = {}  # token-sharded node -> its global shape
        self.gathered: dict = {}  # token-sharded node -> its all-gathered value, in its global shape
        self.gathered_2d: dict = {}  # ... as the [N, H] all-gather result
        self.sliced: dict = {}

    def _tokens(self, shape) -> int:
        return math.prod(shape[:-1])

    def run(self):
        inplace = [n for n in self.g.nodes
                   if (n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("_"))
                   or (n.op == "call_function" and n.target in _INPLACE_FUNCS)]
        if inplace:  # a mutation of a value that got gathered would miss its other users: stay with all-reduces
            self.rw.plan.notes.append(f"sequence_parallel: not applied, the graph mutates tensors in place "
                                      f"({inplace[0].format_node()[:80]})")
            return
        converted, small = 0, 0
        min_bytes = self.rw.an.cfg.sequence_parallel_min_bytes
        for x, ar, w in self.rw.reduced:
            shape = _shape(x)  # the row-parallel output: full size on every rank (new nodes carry no "val")
            if shape is None or not _concrete(shape) or len(shape) < 2 or self._tokens(shape) % self.tp:
                continue
            if math.prod(shape) * x.meta["val"].element_size() < min_bytes:
                small += 1
                continue
            n, h = self._tokens(shape), shape[-1]
            with self.g.inserting_before(ar):
                flat = self.g.call_method("reshape", (x, (n, h)))
                rs = self.g.call_function(_REDUCE_SCATTER, (flat, "sum", self.tp, self.group))
                wrs = self.g.call_function(_WAIT, (rs,))
            for nd in (flat, rs, wrs):
                _copy_meta(nd, w)
            w.replace_all_uses_with(wrs)
            self.g.erase_node(w)
            self.g.erase_node(ar)
            self.gshape[wrs] = tuple(shape)
            self.rw.local_shapes[wrs] = (n // self.tp, h)
            converted += 1
        if not converted:
            why = (f"{small} all-reduce(s) under sequence_parallel_min_bytes={min_bytes} (decode-sized: one "
                   f"collective beats two)" if small else "no all-reduce with a token count divisible by tp")
            self.rw.plan.notes.append(f"sequence_parallel: not applied, {why}")
            return
        self.rw.plan.all_reduces -= converted
        self.rw.plan.reduce_scatters += converted
        for node in list(self.g.nodes):
            if node in self.gshape or not any(a in self.gshape for a in node.all_input_nodes):
                continue
            if not self._keep_local(node):
                for a in [a for a in node.all_input_nodes if a in self.gshape]:
                    if not self._linear_on_gathered(node, a):
                        node.replace_input_with(a, self._gather(a))
        self.rw.plan.notes.append(f"sequence_parallel: {converted} all-reduce(s) became reduce-scatter(s) over the "
                                  f"tokens; token-wise ops run on 1/{self.tp} of them")

    def _keep_local(self, node: fx.Node) -> bool:
        """Make ``node`` run on the local token rows if it is token-wise (rewriting its operands); False if not."""
        out = _shape(node)
        if out is None or not _concrete(out) or len(out) < 1 or node.op not in ("call_function", "call_method"):
            return False
        tok = [a for a in node.all_input_nodes if a in self.gshape]
        n = self._tokens(self.gshape[tok[0]])
        if any(self._tokens(self.gshape[a]) != n for a in tok):
            return False
        kind = _kind(node)  # the op tables the sharding rules use
        if kind == "reshape":
            # a view that only regroups the token dims keeps the local rows as they are
            x = node.args[0]
            if x not in self.gshape or out[-1] != self.gshape[x][-1] or self._tokens(out) != n:
                return False
            node.args = (x, (n // self.tp, out[-1]))
            node.kwargs = {}
        elif kind == "reduce":
            x = node.args[0]
            if x not in self.gshape or len(out) != len(self.gshape[x]) or out[-1] != 1 or self._tokens(out) != n:
                return False  # only keepdim reductions over the last dim
            if not self._rewrite_operands(node, out, n, skip=(0,)):
                return False
        elif node.op == "call_function" and node.target in (F.layer_norm, getattr(F, "rms_norm", None)):
            shape_arg = match.get_arg(node, 1, "normalized_shape")
            if node.args[0] not in self.gshape or tuple(shape_arg or ()) != (out[-1],):
                return False  # normalized over more than the last dim
            if not self._rewrite_operands(node, out, n, skip=(0,)):
                return False
        elif node.op == "call_function" and node.target in (F.dropout, torch.dropout):
            training = match.get_arg(node, 2, "training", node.kwargs.get("train", True))
            if training is not False or node.args[0] not in self.gshape:
                return False  # eval-mode dropout (the identity) only: a random mask per rank would differ
        elif kind in ("elementwise", "cast"):
            if self._tokens(out) != n:
                return False
            # a cast reads data from its first argument only (``type_as``'s second gives just a dtype)
            skip = tuple(range(1, len(node.args))) if kind == "cast" else ()
            if not self._rewrite_operands(node, out, n, skip=skip):
                return False
        else:
            return False
        self.gshape[node] = tuple(out)
        self.rw.local_shapes[node] = (n // self.tp, out[-1])
        return True

    def _rewrite_operands(self, node, out, n, skip=()) -> bool:
        """Replicated tensor operands: sliced to the local tokens, or flattened when they do not vary over the
        tokens; False (nothing changed) if one is neither."""
        edits = {}
        for i, a in enumerate(node.args):
            if i in skip or not isinstance(a, fx.Node) or a in self.gshape:
                continue
            s = _shape(a)
            if s is None:
                if "val" in a.meta and not isinstance(a.meta["val"], torch.Tensor):
                    continue  # a number
                return False  # unknown: not proven token-wise
            if not _concrete(s):
                return False
            lead = s[:-1] if len(s) >= 1 else ()
            if math.prod(lead) == 1:
                if len(s) > 1:
                    edits[a] = ("flat", s[-1] if len(s) else 1)
            elif tuple(s[:-1]) == tuple(out[:-1]):  # the same token dims, in the same order
                edits[a] = ("slice", s[-1])
            elif len(s) <= len(out) and all(d == 1 or d == o for d, o in zip(s[-2::-1], out[-2::-1])):
                edits[a] = ("expand", s[-1])  # broadcast over some token dims (a position embedding [1, S, H])
            else:
                return False
        for kw in node.kwargs.values():
            if isinstance(kw, fx.Node) and kw not in self.gshape:
                s = _shape(kw)
                if s is None or len(s) > 1:
                    return False  # only [H]-shaped keyword operands (a norm's weight or bias) pass as they are
        for a, (kind, last) in edits.items():
            if kind == "flat":
                node.replace_input_with(a, self._flat(a, last))
            else:
                node.replace_input_with(a, self._slice(a, n, last, node, tuple(out[:-1]) if kind == "expand" else None))
        return True

    def _flat(self, a: fx.Node, last: int) -> fx.Node:
        with self.g.inserting_after(a):
            v = self.g.call_method("reshape", (a, (last,)))
        _copy_meta(v, a)
        return v

    def _slice(self, a: fx.Node, n: int, last: int, before: fx.Node, expand_to=None) -> fx.Node:
        """This rank's token rows of a replicated operand (expanded first to ``expand_to`` token dims if it
        broadcasts over some of them)."""
        key = (a, n, last, expand_to)
        if key not in self.sliced:
            per = n // self.tp
            with self.g.inserting_before(before):
                src = self.g.call_method("expand", (a, (*expand_to, last))) if expand_to else a
                flat = self.g.call_method("reshape", (src, (n, last)))
                part = self.g.call_method("narrow", (flat, 0, self.rank * per, per))
            for nd in (src, flat, part):
                _copy_meta(nd, a)
            self.sliced[key] = part
        return self.sliced[key]

    def _linear_on_gathered(self, node: fx.Node, a: fx.Node) -> bool:
        """A dense linear reading the gathered tokens takes them as the 2-D [N, H] all-gather result itself and
        its output is viewed back to the token dims: all_gather -> wait -> mm is the pattern Inductor's
        micro-pipeline TP fuses (a view in between, shared by q/k/v or gate/up, hides it)."""
        lin = self.rw.an.all_linears.get(node)
        if lin is None or lin.kind != "dense" or lin.x is not a or len(self.gshape[a]) < 2:
            return False
        if sum(1 for x in node.all_input_nodes if x is a) != 1 or "val" not in node.meta:
            return False
        flat = self._gather_2d(a)
        node.replace_input_with(a, flat)
        users = list(node.users)
        with self.g.inserting_after(node):
            back = self.g.call_method("reshape", (node, (*self.gshape[a][:-1], -1)))
        _copy_meta(back, node)
        for u in users:
            u.replace_input_with(node, back)
        self.rw.unchecked.add(node)  # its local shape is now [N, out / tp]; ``back`` restores the checked one
        return True

    def _gather_2d(self, a: fx.Node) -> fx.Node:
        if a not in self.gathered_2d:
            with self.g.inserting_after(a):
                cont = self.g.call_method("contiguous", (a,))
            with self.g.inserting_after(cont):
                ag = self.g.call_function(_ALL_GATHER, (cont, self.tp, self.group))
            with self.g.inserting_after(ag):
                w = self.g.call_function(_WAIT, (ag,))
            for nd in (cont, ag, w):
                _copy_meta(nd, a)
            self.gathered_2d[a] = w
            self.rw.plan.all_gathers += 1
        return self.gathered_2d[a]

    def _gather(self, a: fx.Node) -> fx.Node:
        if a not in self.gathered:
            w = self._gather_2d(a)
            with self.g.inserting_after(w):
                full = self.g.call_method("reshape", (w, self.gshape[a]))
            _copy_meta(full, a)
            self.gathered[a] = full
        return self.gathered[a]


# ----------------------------------------------------------------------------------------------------------------
# Fake re-propagation and shape check
# ----------------------------------------------------------------------------------------------------------------
def _repropagate(gm: fx.GraphModule, plan: TensorParallelPlan, expected: dict):
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [match.val(n) for n in phs]
    fakes = [v for v in vals if isinstance(v, torch._subclasses.FakeTensor)]
    mode = fakes[0].fake_mode if fakes else detect_fake_mode()
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    local_inputs = {}
    for name, (_, sh) in plan.inputs.items():
        shape = list(match.val(next(n for n in phs if n.name == name)).shape)
        shape[sh.dim] = sh.local(plan.tp)
        local_inputs[name] = tuple(shape)
    with mode:
        for n, v in zip(phs, vals):
            ts = plan.shards.get(n.name)
            local = ts.local_shape if ts is not None else local_inputs.get(n.name)
            if local is not None:
                t = torch.empty(local, dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
                inputs.append(t)
            elif isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.FakeTensor):
                inputs.append(mode.from_tensor(v))
            else:
                inputs.append(v)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    for n in gm.graph.nodes:
        if "val" in n.meta and "example_value" in n.meta:
            n.meta["example_value"] = n.meta["val"]
        if n in expected:
            got = _shape(n)
            if got is not None and tuple(got) != tuple(expected[n]):
                raise RuntimeError(f"tensor_parallel: {n.format_node()} has local shape {tuple(got)}, the plan "
                                   f"predicts {tuple(expected[n])}")


# ----------------------------------------------------------------------------------------------------------------
# The pass
# ----------------------------------------------------------------------------------------------------------------
@register_pass("tensor_parallel")
def tensor_parallel_pass(gm: fx.GraphModule, cfg: TensorParallelConfig, ctx: PassContext) -> PassResult:
    result = PassResult("tensor_parallel")
    tpc = ctx.extras.get("tensor_parallel")
    if not isinstance(tpc, TPContext):
        result.skip("graph", "tensor_parallel runs through fxopt.parallelize (it needs the process group and the "
                             "parameters to cut)")
        return result
    if cfg.tp != tpc.tp:
        raise ValueError(f"tensor_parallel: config tp={cfg.tp} but the process group has {tpc.tp} ranks")
    an = _TPAnalysis(gm, cfg, tpc, result)
    prop = an.solve()
    # expected local shapes of every node the plan touches (checked after re-propagation)
    expected = {}
    for n, st in prop.state.items():
        if isinstance(st, Shard):
            s = list(_shape(n))
            s[st.dim] = st.local(tpc.tp)
            expected[n] = tuple(s)
    for n in gm.graph.nodes:
        if n not in expected and n.op not in ("placeholder", "output") and _shape(n) is not None:
            expected[n] = tuple(_shape(n))
    rw = _Rewriter(an, prop)
    rw.run()
    expected.update(rw.local_shapes)
    for n in rw.unchecked:
        expected.pop(n, None)
    plan = rw.plan
    plan.inputs = dict(tpc.sharded_inputs)
    plan.outputs = {i: (tpc.shardable_outputs[i], sh) for i, sh in sorted(prop.outputs.items())}
    kind_rank = {"vocab": 0, "column": 1, "row": 1, "gather": 2}
    plan.linears.sort(key=lambda e: kind_rank.get(e[0], 1))
    for n, reason in an.dropped.items():
        lin = an.all_linears.get(n)
        name = an.lin_name(lin) if lin else n.name
        result.skip(n, f"left replicated: {reason}")
        plan.replicated.append((name, reason))
    for n, lin in an.linears.items():
        if n not in prop.columns and n not in prop.rows and n not in an.dropped:
            plan.replicated.append((an.lin_name(lin), "not in a column → row chain"))
    plan.notes.extend(l.replace("tensor_parallel: ", "") for l in result.notes)
    expected = {n: s for n, s in expected.items() if n.graph is gm.graph and n in set(gm.graph.nodes)}
    gm.graph.lint()
    gm.recompile()
    _repropagate(gm, plan, expected)
    tpc.plan = plan
    gm.meta["fxopt_tp_plan"] = plan
    result.notes = plan.lines()
    if not plan.shards:
        log.warning("tensor_parallel: nothing sharded (tp=%d):\n%s", tpc.tp, plan)
    return result
