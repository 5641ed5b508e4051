"""The pass entry point, registered with the pass manager: search, rewrite, the plan's text, then a fake
re-propagation that checks every node's local shape against the plan's prediction."""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ...config import TensorParallelConfig
from .. import match
from ..manager import PassContext, PassResult, register_pass
from .ops import _shape
from .plan import Shard, TensorParallelPlan, TPContext
from .rewrite import _Rewriter
from .search import _TPAnalysis

log = logging.getLogger(__name__)


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
    with mode:
        for n, v in zip(phs, vals):
            ts, held = plan.shards.get(n.name), plan.inputs.get(n.name)  # a parameter's cut, a KV cache's shard
            local = ts.local_shape if ts is not None else held[1].local_shape(v.shape, plan.tp) if held else None
            if local is not None:
                inputs.append(torch.empty(local, dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad))
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
    expected = {n: st.local_shape(_shape(n), tpc.tp) for n, st in prop.state.items() if isinstance(st, Shard)}
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
