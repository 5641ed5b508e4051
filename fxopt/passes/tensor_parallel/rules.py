"""Propagation: one topological sweep for a given set of column seeds. Every tensor node gets a state (``None``:
replicated, a :class:`Shard`, or a tuple of them for split/unbind); each op kind has a ``rule_<kind>`` that proves it
works per shard and says the output's state, or raises :class:`_Conflict` with the reason. Rules record the argument
edits (local sizes) the rewrite applies later."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch.fx as fx

from .. import match
from .linears import _Linear
from .ops import _concrete, _kind, _legacy_empty, _norm, _output_args, _set_arg, _shape, _shape_arg_list, _split_sizes
from .plan import Shard, _Conflict

if TYPE_CHECKING:
    from .search import _TPAnalysis


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
        self._local_size(node, new.dim, new.local(self.tp), "a reshape", rank=len(out_shape))
        return new

    def _local_size(self, node, d: int, local: int, what: str, rank=None):
        """Record the edit of a view/expand size list: position ``d`` becomes ``local`` (unless it is -1)."""
        sizes, setter = _shape_arg_list(node)
        if rank is not None and len(sizes) != rank:
            raise _Conflict("reshape size list does not match the output rank")
        if isinstance(sizes[d], fx.Node):
            raise _Conflict(f"symbolic size at the sharded position of {what}")
        if sizes[d] != -1:
            self.rewrites[node] = lambda: setter([local if i == d else s for i, s in enumerate(sizes)])

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
        self._local_size(node, d, sh.local(self.tp), "expand")
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

    def rule_split(self, node, ins):
        """split and chunk (whose raw size argument is None: nothing to edit, the sections must be equal)."""
        x = node.args[0]
        sh = self.state[x]
        sizes, d, raw = _split_sizes(node, x)
        if d != sh.dim:
            return tuple(sh for _ in sizes)
        if raw is None and (sizes != [s for s, _ in sh.sections] or len(set(sh.sections)) != 1):
            raise _Conflict("chunk of the sharded dim does not follow the shard sections")
        if sizes != [s for s, _ in sh.sections]:
            raise _Conflict(f"split {sizes} does not follow the shard sections {[s for s, _ in sh.sections]}")
        outs = tuple(Shard(d, (sec,)) for sec in sh.sections)
        if isinstance(raw, int):
            locs = {o.local(self.tp) for o in outs}
            if len(locs) != 1:
                raise _Conflict("split by one size over unequal local sections")
            loc = locs.pop()
            self.rewrites[node] = lambda: _set_arg(node, 1, "split_size_or_sections", loc)
        elif raw is not None:
            new = [o.local(self.tp) for o in outs]
            self.rewrites[node] = lambda: _set_arg(node, 1, "split_size_or_sections", type(raw)(new))
        return outs

    rule_chunk = rule_split

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

    def _attention(self, q, k, v, mask):
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
        if isinstance(mask, fx.Node):
            sm, mshape = self.state.get(mask), _shape(mask)
            if sm is None:
                d = hd - (len(qs) - len(mshape))
                if d >= 0 and mshape[d] != 1 and len(mshape) == len(qs):
                    raise _Conflict("replicated attention mask has a head dim")
            elif sm.dim != hd + len(mshape) - len(qs) or sm.sections != sq.sections:
                raise _Conflict("attention mask sharded unlike q")
        return sq

    def rule_sdpa(self, node, ins):
        q, k, v = (match.get_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        if _shape(q)[-3] != _shape(k)[-3] and not node.kwargs.get("enable_gqa", False):
            raise _Conflict("GQA attention without enable_gqa")
        return self._attention(q, k, v, match.get_arg(node, 3, "attn_mask"))

    def rule_flash_attention(self, node, ins):
        if self.state.get(match.get_arg(node, 9, "key_padding_mask")) is not None:
            raise _Conflict("sharded key padding mask")
        return self._attention(*node.args[:3], match.get_arg(node, 3, "attn_mask"))
