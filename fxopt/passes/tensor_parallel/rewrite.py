"""The rewrite for this rank: argument edits, column/row cuts of the linears (row: bias after one all-reduce, in token
chunks with ``overlap_chunks``), vocab-parallel embeddings, the all-gather of sharded graph outputs, Megatron's *f* in
training graphs, then the sequence-parallel step. Every cut goes into the :class:`TensorParallelPlan`."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import match
from .collectives import _ALL_GATHER, _ALL_REDUCE, _WAIT, _copy_meta
from .linears import _Linear
from .ops import _kind, _output_args, _set_arg, _shape
from .plan import Shard, TensorParallelPlan, TensorShard
from .rules import _Propagation
from .search import _TPAnalysis
from .sequence_parallel import _SequenceParallel


# (side, linear kind) -> (cut dim of the weight, role); int4 linears cut their qparams in _cut_linear
_WEIGHT_CUTS = {("column", "dense"): (0, "column weight"), ("column", "conv1d"): (1, "column weight (Conv1D)"),
                ("row", "dense"): (1, "row weight"), ("row", "conv1d"): (0, "row weight (Conv1D)")}
_BIAS_ARG = {"dense": 2, "dequant": 2, "w4a16": 5}  # position of the bias argument (conv1d: addmm's first)


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
        prev = self.plan.shards.get(ph.name)
        if prev is not None:
            if prev.shard != sh:
                raise RuntimeError(f"tensor_parallel: {ph.name} would be cut two ways")
            return
        self.plan.shards[ph.name] = TensorShard(ph.name, self.an.name(ph), sh, gshape, sh.local_shape(gshape, self.tp),
                                                  role)

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
        with g.inserting_before(node.next):
            parts = g.call_function(torch.chunk, (x, chunks, -2))
            new, pending = [parts], []
            for i in range(chunks):
                xi = g.call_function(operator.getitem, (parts, i))
                yi = g.node_copy(node, lambda n: xi if n is x else n)
                pending.append(g.call_function(_ALL_REDUCE, (yi, "sum", self.tpc.group_name)))
                new += [xi, yi, pending[-1]]
            outs = [g.call_function(_WAIT, (ar,)) for ar in pending]
            out = g.call_function(torch.cat, (outs, -2))
        for n in new + outs + [out]:
            _copy_meta(n, node)
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
        for node, side in todo:
            self._cut_linear(node, side, prop.columns[node] if side == "column" else prop.rows[node])
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

    def _cut_linear(self, node, side: str, sh: Shard):
        """Shard the weight (and a column bias) of a column / row linear; a row one also gets its all-reduce."""
        an = self.an
        lin = an.linears[node]
        secs = sh.sections
        if (side, lin.kind) in _WEIGHT_CUTS:
            dim, role = _WEIGHT_CUTS[side, lin.kind]
            self.shard_placeholder(lin.weight, Shard(dim, secs), role)
        elif side == "column":
            for t in lin.qparams:
                self.shard_placeholder(t, Shard(1, secs), "column int4 " + an.name(t).rsplit(".", 1)[-1])
        else:
            qw, sc, zr = lin.qparams
            self.shard_placeholder(qw, Shard(0, tuple((s // 8, rf) for s, rf in secs)), "row int4 qweight")
            for t in (sc, zr):
                self.shard_placeholder(t, Shard(0, tuple((s // lin.group_size, rf) for s, rf in secs)),
                                       "row int4 " + an.name(t).rsplit(".", 1)[-1])
        if side == "column":
            if lin.bias is not None:
                self.shard_placeholder(lin.bias, Shard(0, secs), "column bias")
            secs_txt = "" if secs == ((lin.N, 1),) else "  " + sh.describe().split(", ", 1)[-1]
            detail = f"out features {lin.N} -> {sh.local(self.tp)}{secs_txt}"
        else:
            chunks = self._row_rewrite(lin)
            detail = (f"in features {lin.K} -> {sh.local(self.tp)}"
                      f"{' (bias after all_reduce)' if lin.bias is not None else ''} + all_reduce"
                      f"{f' in {chunks} token chunks' if chunks > 1 else ''}")
        self.plan.linears.append((side, an.lin_name(lin), detail))
        an.result.rewrites += 1

    def _row_rewrite(self, lin: _Linear) -> int:
        """Cut bias out, insert the all-reduce (in token chunks where configured); returns the chunk count."""
        node, g = lin.node, self.g
        bias = lin.bias
        if bias is not None:
            if lin.kind in _BIAS_ARG:
                _set_arg(node, _BIAS_ARG[lin.kind], "bias", None)
            else:  # conv1d: addmm(bias, x, w) -> mm(x, w)
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
            max_norm = match.get_arg(node, 3, "max_norm")
            padding_idx = match.get_arg(node, 2, "padding_idx")
            other = [u for u in w.users if u is not node]
            skip = listed = None  # the skip reason, and the one plan.replicated lists
            if V not in head_sizes:
                skip = (f"embedding rows {V} != the gathered lm_head's out features {head_sizes}: not the vocabulary "
                        f"embedding, replicated")
            elif V % tp:
                listed = f"vocab {V} not divisible by tp={tp}"
                skip = listed + ": embedding replicated"
            elif max_norm is not None:
                skip = "embedding with max_norm: replicated"
            elif not other and not an.cfg.vocab_parallel_embedding:
                skip = listed = ("untied vocabulary embedding kept replicated (vocab_parallel_embedding=False): no "
                                 "masked lookup, no all-reduce")
            elif not all(u in self.prop.columns and self.prop.columns[u].sections == ((V, 1),) and
                         an.linears[u].kind == "dense" for u in other):
                skip = listed = "embedding weight is tied to an op that is not vocab-parallel"
            if skip is not None:
                an.result.skip(node, skip)
                if listed is not None:
                    self.plan.replicated.append((an.name(w), listed))
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
            with g.inserting_before(node.next):
                m = g.call_method("unsqueeze", (outside, -1))
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
