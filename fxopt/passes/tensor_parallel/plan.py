"""What the pass finds and hands back: shard specs (:class:`Shard`), the cut of each real tensor
(:class:`TensorShard`), the plan (:class:`TensorParallelPlan`, its text is what ``print(module.plan)`` shows), the
context :func:`fxopt.parallelize` passes in (:class:`TPContext`) and the two errors of the search."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


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

    def local_shape(self, shape, tp: int) -> tuple:
        """``shape`` (the global one) with ``dim`` cut to one rank's part."""
        out = list(shape)
        out[self.dim] = self.local(tp)
        return tuple(out)

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
    """What :func:`fxopt.parallelize` hands the pass through ``ctx.extras["tensor_parallel"]``."""

    group_name: str  # the process group's name, for the functional collectives
    rank: int
    tp: int
    params: dict  # placeholder name -> parameter/buffer name, for every placeholder that is model state
    training: bool = False  # emit the autograd-correct form
    grad_inputs: frozenset = frozenset()  # placeholder names whose tensors require grad
    sharded_inputs: dict = field(default_factory=dict)  # placeholder -> (description, Shard): a KV cache passed back
    shardable_outputs: dict = field(default_factory=dict)  # output index -> description: may stay sharded
    plan: Optional[TensorParallelPlan] = None  # filled by the pass


class _Conflict(Exception):
    pass


class ShardedInputError(ValueError):
    """A graph input holds this rank's shard (a KV cache) but the graph needs it whole: no replicated fallback."""
