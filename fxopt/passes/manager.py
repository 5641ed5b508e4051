"""The pass manager: one registry, one fixed order (``attention → w4a16 → tensor_parallel → pipeline``), one report
format. A pass is ``fn(gm, pass_config, ctx) -> PassResult`` (contract: docs/architecture.md, "Pass contract").
Attention goes first so later passes see fused attention, not its matmuls; w4a16 before tensor_parallel so sharding
sees the fused quantized linears; pipeline last because it cuts the final graph. The manager gives every node
``meta["val"]`` first, lints and recompiles after each pass, logs to this module's logger and, with
``FXOPT_DUMP_DIR``, writes each graph before and after each pass.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .. import env
from ..config import Config

log = logging.getLogger(__name__)

PASS_ORDER = ("attention", "w4a16", "tensor_parallel", "pipeline")


@dataclass
class Skip:
    """A candidate a pass left alone."""

    pass_name: str
    node: str
    reason: str


@dataclass
class PassResult:
    """What one pass did to one graph: the number of rewrites and every candidate it skipped, with a reason."""

    name: str
    rewrites: int = 0
    skipped: list = field(default_factory=list)
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # free-form lines for explain (e.g. a parallel plan)

    def skip(self, node: Any, reason: str) -> None:
        label = node.format_node() if isinstance(node, fx.Node) else str(node)
        name = node.name if isinstance(node, fx.Node) else str(node)
        log.debug("%s: left %s alone: %s", self.name, label, reason)
        self.skipped.append(Skip(self.name, name, reason))


@dataclass
class PassContext:
    """What a pass may need besides the graph and its own config: the whole :class:`fxopt.Config`, the graph's
    example inputs (placeholder order) and pass-specific ``extras`` (e.g. a process group for tensor_parallel)."""

    config: Config
    example_inputs: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)


@dataclass
class _Registered:
    name: str
    fn: Callable


_REGISTRY: dict[str, _Registered] = {}


def register_pass(name: str):
    """Register ``fn(gm, pass_config, ctx) -> PassResult`` under ``name`` (one of ``PASS_ORDER``)."""
    if name not in PASS_ORDER:
        raise ValueError(f"pass {name!r} is not in the documented order {PASS_ORDER}")

    def deco(fn):
        _REGISTRY[name] = _Registered(name, fn)
        return fn

    return deco


def registered_passes() -> list[_Registered]:
    return [_REGISTRY[n] for n in PASS_ORDER if n in _REGISTRY]


_graph_counter = itertools.count()


def ensure_meta_val(gm: fx.GraphModule, example_inputs: list) -> None:
    """Give every node ``meta["val"]``: Dynamo's ``example_value`` as is, or fake-tensor propagation for other graphs.

    A Dynamo graph is never propagated again: that would specialise its symbolic sizes or fail on data-dependent ops.
    Its nodes without ``example_value`` simply have no value (``match.val`` gives None)."""
    nodes = list(gm.graph.nodes)
    dynamo_graph = False
    for n in nodes:
        if "example_value" in n.meta:
            dynamo_graph = True
            if "val" not in n.meta:
                n.meta["val"] = n.meta["example_value"]
    if dynamo_graph or all("val" in n.meta for n in nodes if n.op not in ("output",)):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = next((x.fake_mode for x in example_inputs if isinstance(x, torch._subclasses.FakeTensor)), None)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def run_passes(gm: fx.GraphModule, example_inputs: list, config: Config,
               extras: Optional[dict] = None) -> tuple[fx.GraphModule, list[PassResult]]:
    """Run every enabled pass in the fixed order; return the rewritten module and one result per pass run."""
    results: list[PassResult] = []
    if not config.enabled:
        log.info("fxopt disabled by config: no pass runs")
        return gm, results
    ensure_meta_val(gm, example_inputs)
    ctx = PassContext(config, list(example_inputs), dict(extras or {}))
    graph_id = next(_graph_counter)
    dump_dir = env.dump_dir()
    for i, p in enumerate(registered_passes()):
        pcfg = getattr(config, p.name)
        if not getattr(pcfg, "enabled", True):
            log.debug("pass %s disabled by config", p.name)
            continue
        if dump_dir:
            _dump(gm, dump_dir, f"graph{graph_id}_{i:02d}_{p.name}_before.py")
        t0 = time.perf_counter()
        result = p.fn(gm, pcfg, ctx)
        result.seconds = time.perf_counter() - t0
        gm.graph.lint()
        gm.recompile()
        results.append(result)
        log.info("pass %s: %d rewrite(s), %d skipped, %.1f ms", p.name, result.rewrites, len(result.skipped),
                 result.seconds * 1e3)
        if dump_dir:
            _dump(gm, dump_dir, f"graph{graph_id}_{i:02d}_{p.name}_after.py")
    return gm, results


def _dump(gm: fx.GraphModule, dump_dir: str, name: str) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, name), "w") as f:
        f.write(gm.print_readable(print_output=False))
