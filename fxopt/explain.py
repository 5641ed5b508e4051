"""``fxopt.explain``: what fxopt would do to a model, without code generation.

The model is captured with Dynamo, each graph goes through the passes (no Inductor), and the results are gathered
into an :class:`ExplainReport`. Dynamo's caches and counters are left alone: the capture enters the function (or the
module's ``forward``) through a copy with a code object of its own, and the new backend object fails the guard of
any entry compiled before, so nothing cached is reused and a model compiled before does not recompile afterwards.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .config import Config
from .passes.manager import PASS_ORDER


@dataclass
class ExplainReport:
    """Result of :func:`fxopt.explain`: rewrites per pass (every pass of ``PASS_ORDER`` a key), every skipped
    candidate (:class:`fxopt.passes.Skip`), the graph and graph-break counts with Dynamo's reasons, seconds per pass
    and the passes' notes."""

    rewrites: dict = field(default_factory=lambda: {p: 0 for p in PASS_ORDER})
    skipped: list = field(default_factory=list)
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: list = field(default_factory=list)
    pass_seconds: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fxopt.explain: {self.graphs} graph(s), {self.graph_breaks} graph break(s)"]
        lines += [f"  break: {r}" for r in self.break_reasons]
        lines.append(f"{'pass':<16}{'rewrites':>9}{'skipped':>9}{'ms':>9}")
        for p in PASS_ORDER:
            n_skip = sum(1 for s in self.skipped if s.pass_name == p)
            ms = self.pass_seconds.get(p)
            lines.append(f"{p:<16}{self.rewrites.get(p, 0):>9}{n_skip:>9}{'-' if ms is None else f'{ms * 1e3:.1f}':>9}")
        if self.skipped:
            lines.append("left alone:")
            lines += [f"  [{s.pass_name}] {s.node}: {s.reason}" for s in self.skipped]
        lines += self.notes
        return "\n".join(lines)


def explain(model_or_fn: Any, *args: Any, config: Optional[Config] = None, **kwargs: Any) -> ExplainReport:
    """Capture ``model_or_fn(*args, **kwargs)`` with Dynamo, run fxopt's passes without codegen, and report."""
    from torch._dynamo.utils import counters

    from .backends import Backend

    backend = Backend(config, inductor=False)
    before = dict(counters["graph_break"])
    with _fresh_code(model_or_fn) as target:
        torch.compile(target, backend=backend)(*args, **kwargs)
    grown = {r: n - before.get(r, 0) for r, n in counters["graph_break"].items() if n > before.get(r, 0)}
    rep = ExplainReport(graphs=len(backend.results), graph_breaks=sum(grown.values()), break_reasons=list(grown))
    for r in (r for results in backend.results for r in results):
        rep.rewrites[r.name] = rep.rewrites.get(r.name, 0) + r.rewrites
        rep.skipped.extend(r.skipped)
        rep.pass_seconds[r.name] = rep.pass_seconds.get(r.name, 0.0) + r.seconds
        rep.notes.extend(r.notes)
    return rep


def _copy_function(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a new (equal) code object: Dynamo's compiled entries for it are kept apart from ``fn``'s."""
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__, g.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    g.__dict__.update(fn.__dict__)
    return g


@contextlib.contextmanager
def _fresh_code(target: Any):
    """The same callable, entered through a code object of its own: a function or bound method is copied, a module
    gets a copied ``forward`` for the call; anything else is captured as is."""
    if isinstance(target, torch.nn.Module):
        own = target.__dict__.get("forward", None)
        fn = own.__func__ if isinstance(own, types.MethodType) else type(target).forward if own is None else None
        if not isinstance(fn, types.FunctionType):
            yield target
            return
        target.forward = types.MethodType(_copy_function(fn), target)
        try:
            yield target
        finally:
            if own is None:
                del target.forward
            else:
                target.forward = own
    elif isinstance(target, types.FunctionType):
        yield _copy_function(target)
    elif isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        yield types.MethodType(_copy_function(target.__func__), target.__self__)
    else:
        yield target
