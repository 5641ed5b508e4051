"""Sequence parallelism on an inference graph after the tensor-parallel rewrite: row-parallel all-reduces become
reduce-scatters over the tokens and token-wise ops run on this rank's rows (see :class:`_SequenceParallel`)."""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import match
from .collectives import _ALL_GATHER, _REDUCE_SCATTER, _WAIT, _copy_meta
from .ops import _concrete, _kind, _shape

if TYPE_CHECKING:
    from .rewrite import _Rewriter


_INPLACE_FUNCS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


class _SequenceParallel:
    """Megatron's sequence parallelism (docs/architecture.md, "Tensor parallel"): each whole row-parallel all-reduce
    becomes a reduce-scatter to this rank's N / tp token rows, token-wise ops run on those rows, and every other
    consumer gets the tokens back from one all-gather. An all-reduce whose token count tp does not divide stays."""

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
        x = node.args[0] if node.args else None
        skip = (0,)  # operand positions _rewrite_operands leaves alone (None: no operand to rewrite)
        if kind == "reshape":
            # a view that only regroups the token dims keeps the local rows as they are
            if x not in self.gshape or out[-1] != self.gshape[x][-1] or self._tokens(out) != n:
                return False
            node.args = (x, (n // self.tp, out[-1]))
            node.kwargs = {}
            skip = None
        elif kind == "reduce":
            if x not in self.gshape or len(out) != len(self.gshape[x]) or out[-1] != 1 or self._tokens(out) != n:
                return False  # only keepdim reductions over the last dim
        elif node.op == "call_function" and node.target in (F.layer_norm, getattr(F, "rms_norm", None)):
            shape_arg = match.get_arg(node, 1, "normalized_shape")
            if x not in self.gshape or tuple(shape_arg or ()) != (out[-1],):
                return False  # normalized over more than the last dim
        elif node.op == "call_function" and node.target in (F.dropout, torch.dropout):
            training = match.get_arg(node, 2, "training", node.kwargs.get("train", True))
            if training is not False or x not in self.gshape:
                return False  # eval-mode dropout (the identity) only: a random mask per rank would differ
            skip = None
        elif kind in ("elementwise", "cast"):
            if self._tokens(out) != n:
                return False
            # a cast reads data from its first argument only (``type_as``'s second gives just a dtype)
            skip = tuple(range(1, len(node.args))) if kind == "cast" else ()
        else:
            return False
        if skip is not None and not self._rewrite_operands(node, out, n, skip=skip):
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
            with self.g.inserting_before(a.next):
                cont = self.g.call_method("contiguous", (a,))
                ag = self.g.call_function(_ALL_GATHER, (cont, self.tp, self.group))
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
