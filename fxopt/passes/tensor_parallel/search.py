"""The search: linear sites become column seeds (GQA kv projections replicated when tp exceeds their heads, fused
qkv / gate-up outputs cut by sections, a weight tied to a vocab-parallel embedding kept), and the sweep repeats,
dropping the seeds each conflict blames, until none is left (the greatest fixed point)."""
from __future__ import annotations

import torch.fx as fx

from ...config import TensorParallelConfig
from .. import match
from ..manager import PassResult
from .linears import _Finder, _Linear
from .ops import _ATTENTION, _kind, _shape, _split_sizes
from .plan import ShardedInputError, TPContext, _Conflict
from .rules import _Propagation


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
            for lin in (self._source_linears(kk) | self._source_linears(v)) - self._source_linears(q):
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
