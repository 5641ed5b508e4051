"""``fxopt.parallelize``: tensor parallelism found in the model's graph.

Dynamo captures the model (one graph, static shapes) with a recording backend that runs fxopt's passes, the
``tensor_parallel`` pass among them, and never runs the full model. :class:`TensorParallelModule` holds this rank's
shards under the original names, runs the rewritten graph, re-captures a zero-memory skeleton for new input shapes
and keeps KV caches sharded by heads (:mod:`fxopt.parallel.kv_cache`). Design: docs/architecture.md, "Tensor
parallel".
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import Config
from ..passes import match
from ..passes.manager import run_passes
from ..passes.tensor_parallel import TensorParallelPlan, TPContext
from . import kv_cache
from .pipeline import _state_names

log = logging.getLogger(__name__)

__all__ = ["parallelize", "TensorParallelModule"]


@dataclasses.dataclass
class _Captured:
    """One rewritten graph and how to feed it / rebuild the model's output."""

    gm: fx.GraphModule
    in_bind: list  # per placeholder: ("input", flat leaf index) | ("state", fqn) | ("const", tensor)
    out_bind: list  # per output leaf: ("graph", i) | ("input", flat leaf index) | ("cache", CacheOutput) | ("const", v)
    out_spec: Any
    plan: Optional[TensorParallelPlan]
    results: list


def _key(args, kwargs, flat, caches=(), specs=None) -> tuple:
    """Hashable input signature (Dynamo-traceable without caches: no TreeSpec in it). ``flat``: the leaves with
    caches opened; ``specs``: flat index -> Shard of their tensors."""
    key = (tuple(type(a).__name__ for a in args), tuple(kwargs), _signature(flat))
    if caches:
        key += (tuple((c.leaf, c.slots, c.statics) for c in caches), tuple(sorted(specs.items())))
    return key


def _signature(leaves) -> tuple:
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
        else:
            try:
                hash(x)
                sig.append(("V", type(x).__name__, x))
            except TypeError:
                sig.append(("O", type(x).__name__))
    return tuple(sig)


def _capture(model: nn.Module, args: tuple, kwargs: dict, cfg: Config, base: TPContext,
             cache_specs: Optional[dict] = None) -> _Captured:
    """Dynamo-capture ``model(*args, **kwargs)``, run the passes with ``base`` filled in for this graph, return the
    rewritten graph.

    ``cache_specs``: flat leaf index -> Shard | None of the KV-cache tensors among the inputs (the capture sees
    zero-memory stand-ins of their global shapes; the pass starts the sharded ones sharded)."""
    state = _state_names(model)
    cache_specs = cache_specs or {}
    leaves, in_spec = tree_flatten((tuple(args), dict(kwargs)))
    flat, caches = kv_cache.open_caches(leaves)
    if caches:
        leaves = kv_cache.capture_copies(leaves, caches, cache_specs, cfg.tensor_parallel.tp)
        flat, caches = kv_cache.open_caches(leaves)
        args, kwargs = tree_unflatten(leaves, in_spec)
    before = {c.leaf: dict(vars(leaves[c.leaf])) for c in caches}
    leaf_ids = {id(x): i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)}
    rec: dict = {}

    def recorder(gm: fx.GraphModule, example_inputs):
        if "gm" in rec:
            raise RuntimeError("fxopt.parallelize: the model was captured as more than one graph")
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        bind = []
        for n, ex in zip(phs, example_inputs):
            if isinstance(ex, torch.Tensor) and id(ex) in state:
                bind.append(("state", state[id(ex)]))
            elif isinstance(ex, torch.Tensor) and id(ex) in leaf_ids:
                bind.append(("input", leaf_ids[id(ex)]))
            elif isinstance(ex, torch.Tensor):
                bind.append(("const", ex))
            else:
                raise RuntimeError(f"fxopt.parallelize: graph input {n.name} is a {type(ex).__name__} "
                                   f"(symbolic sizes?); capture is static")
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outs = out_node.args[0]
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        dummies = []
        for o in outs:
            v = match.val(o) if isinstance(o, fx.Node) else o
            dummies.append(torch.empty(v.shape, dtype=v.dtype, device=v.device) if isinstance(v, torch.Tensor)
                           else v)
        grads = frozenset(n.name for n, ex in zip(phs, example_inputs)
                          if isinstance(ex, torch.Tensor) and ex.requires_grad)
        params = {n.name: what for n, (kind, what) in zip(phs, bind) if kind == "state"}
        rec.update(gm=gm, example_inputs=list(example_inputs), phs=[n.name for n in phs], bind=bind,
                   params=params, grads=grads, dummies=dummies)

        def stand_in(*_):
            return tuple(rec["dummies"])

        return stand_in

    compiled = torch.compile(model, backend=recorder, fullgraph=True, dynamic=False)
    try:
        with torch.set_grad_enabled(base.training):
            out = compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()  # drop the cache entry (it references the full parameters)
    out_leaves, out_spec = tree_flatten(out)
    dummy_ids = {id(d): i for i, d in enumerate(rec.pop("dummies")) if isinstance(d, torch.Tensor)}
    cache_leaves = {id(leaves[c.leaf]): c.leaf for c in caches}
    out_bind = []
    for x in out_leaves:
        if isinstance(x, torch.Tensor):
            out_bind.append(kv_cache.tensor_source(x, dummy_ids, leaf_ids, "an output tensor"))
        elif kv_cache.is_cache(x):
            inplace = cache_leaves.get(id(x))
            out_bind.append(("cache", kv_cache.CacheOutput.capture(x, dummy_ids, leaf_ids, inplace,
                                                                   before.get(inplace))))
        else:
            out_bind.append(("const", x))
    # graph outputs that land only in a cache object may stay sharded (each rank keeps its heads)
    direct = {what for kind, what in out_bind if kind == "graph"}
    shardable = {}
    for kind, what in out_bind:
        if kind == "cache":
            shardable.update((i, d) for i, d in what.graph_outputs().items() if i not in direct)
    names = kv_cache.slot_names(caches)
    sharded_inputs = {}
    for name, (kind, what) in zip(rec["phs"], rec["bind"]):
        sh = cache_specs.get(what) if kind == "input" else None
        if sh is not None:
            sharded_inputs[name] = (names[what], sh)
    tpc = dataclasses.replace(base, params=rec["params"], grad_inputs=rec["grads"], sharded_inputs=sharded_inputs,
                              shardable_outputs=shardable)
    gm, results = run_passes(rec["gm"], rec["example_inputs"], cfg, {"tensor_parallel": tpc})
    real_recompile = getattr(gm, "real_recompile", None)  # Dynamo hands a lazy GraphModule: make it real
    if real_recompile is not None:
        real_recompile()
    plan = tpc.plan
    if plan is not None:
        for kind, what in out_bind:
            if kind == "cache":
                what.specs = tuple(plan.outputs[w][1] if k == "graph" and w in plan.outputs else None
                                   for k, w in what.sources)
    return _Captured(gm, rec["bind"], out_bind, out_spec, plan, results)


def _cache_spec_key(args, kwargs, token):
    """(flat leaves, leaf pytree, caches, cache specs, signature key) of one call's inputs."""
    leaves, _ = tree_flatten((args, kwargs))
    flat, caches = kv_cache.open_caches(leaves)
    specs = kv_cache.lookup(flat, caches, token) if caches else {}
    return flat, leaves, caches, specs, _key(args, kwargs, flat, caches, specs)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    z = kv_cache.stand_in(t)
    return nn.Parameter(z, requires_grad=False) if isinstance(t, nn.Parameter) else z


class TensorParallelModule(nn.Module):
    """This rank's part of a tensor-parallel model (returned by :func:`parallelize`): ``plan`` (printable),
    ``graph_module`` (the rewritten graph for the example inputs), ``pass_results`` (that capture's pass results)."""

    def __init__(self, model: nn.Module, captured: _Captured, key: tuple, *, group, cfg: Config, base: TPContext):
        super().__init__()
        self.plan: TensorParallelPlan = captured.plan
        self.graph_module = captured.gm
        self.pass_results = captured.results
        rank, tp = base.rank, base.tp
        self._rank, self._tp, self._group, self._cfg, self._base = rank, tp, group, cfg, base
        self._token = object()  # owner of the KV-cache tensors this module returns
        self._cuts = {ts.name: ts for ts in self.plan.shards.values()}
        self._slots: dict = {}  # fqn -> (owner module, attribute)
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        for kind, what in captured.in_bind:
            if kind != "state" or what in self._slots:
                continue
            full = params.get(what, buffers.get(what))
            ts = self._cuts.get(what)
            t = full if ts is None else ts.cut(full.detach(), rank, tp)
            if what in params and ts is not None:
                t = nn.Parameter(t, requires_grad=full.requires_grad)
            self._register(what, t, is_param=what in params)
        # a zero-memory skeleton for re-capturing at new input shapes
        memo = {id(t): _stand_in(t) for t in list(params.values()) + list(buffers.values())}
        self._skeleton = [copy.deepcopy(model, memo)]  # in a list: not a submodule
        self._graphs = {key: captured}

    def _register(self, fqn: str, t, is_param: bool):
        owner = self
        parts = fqn.split(".")
        for p in parts[:-1]:
            child = owner._modules.get(p)
            if child is None:
                child = nn.Module()
                owner.add_module(p, child)
            owner = child
        if is_param:  # t is a Parameter: the model's own, or this rank's cut of it
            owner.register_parameter(parts[-1], t)
        else:
            owner.register_buffer(parts[-1], t)
        self._slots[fqn] = (owner, parts[-1])

    def _get(self, fqn: str) -> torch.Tensor:
        owner, attr = self._slots[fqn]
        return getattr(owner, attr)

    def forward(self, *args, **kwargs):
        flat, leaves, caches, specs, key = _cache_spec_key(args, kwargs, self._token)
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._recapture(args, kwargs, key, specs)
        outs = cap.gm(*(flat[what] if kind == "input" else self._get(what) if kind == "state" else what
                        for kind, what in cap.in_bind))

        def leaf(kind, what):
            if kind == "cache":
                return what.build(outs, flat, leaves, self._token)
            return outs[what] if kind == "graph" else flat[what] if kind == "input" else what

        return tree_unflatten([leaf(kind, what) for kind, what in cap.out_bind], cap.out_spec)

    @torch._dynamo.disable
    def _recapture(self, args, kwargs, key, cache_specs):
        skeleton = self._skeleton[0]
        log.info("fxopt.parallelize: new input signature, re-capturing the skeleton")
        cap = _capture(skeleton, args, kwargs, self._cfg, self._base, cache_specs)
        new = {ts.name: ts.shard for ts in cap.plan.shards.values()}
        old = {name: ts.shard for name, ts in self._cuts.items()}
        used = {what for kind, what in cap.in_bind if kind == "state"}
        for name in used:
            if new.get(name) != old.get(name):
                raise RuntimeError(f"fxopt.parallelize: at the new input shapes the plan cuts {name} as "
                                   f"{new.get(name)}, not as {old.get(name)}; call parallelize with these shapes")
            if name not in self._slots:
                raise RuntimeError(f"fxopt.parallelize: the new graph needs {name}, unused at capture time")
        self._graphs[key] = cap
        return cap

    def generate(self, *args, **kwargs):
        """transformers' ``generate()`` of the model, each forward run by this module. Call it on every rank with the
        same inputs (and seed): the logits are whole everywhere, so every rank gets the same tokens."""
        skeleton = self._skeleton[0]
        if not callable(getattr(skeleton, "generate", None)):
            raise TypeError(f"fxopt.parallelize: {type(skeleton).__name__} has no generate() (not a transformers "
                            f"generative model)")
        shell = copy.copy(skeleton)  # shares the skeleton's state; only its forward differs

        @functools.wraps(skeleton.forward)  # generate() reads the forward's signature
        def forward(*a, **kw):
            return self(*a, **kw)

        object.__setattr__(shell, "forward", forward)
        return shell.generate(*args, **kwargs)

    @torch.no_grad()
    def reduce_replicated_grads(self) -> None:
        """Sum the gradients of tensors several ranks hold a copy of (GQA kv heads when tp > kv heads)."""
        for name, ts in self._cuts.items():
            if all(rf == 1 for _, rf in ts.shard.sections):
                continue
            p = self._get(name)
            if not isinstance(p, nn.Parameter) or p.grad is None:
                continue
            idx = torch.tensor(ts.shard.indices(self._rank, self._tp), device=p.grad.device)
            shape = list(p.grad.shape)
            shape[ts.shard.dim] = ts.global_shape[ts.shard.dim]
            full = torch.zeros(shape, dtype=p.grad.dtype, device=p.grad.device)
            full.index_add_(ts.shard.dim, idx, p.grad)
            dist.all_reduce(full, group=self._group)
            p.grad.copy_(full.index_select(ts.shard.dim, idx))


def parallelize(model: nn.Module, example_args: Any, example_kwargs: Optional[dict] = None, *, tp: int,
                group: Optional[dist.ProcessGroup] = None, config: Optional[Config] = None,
                vocab_parallel: Optional[bool] = None, training: Optional[bool] = None,
                overlap_chunks: Optional[int] = None,
                vocab_parallel_embedding: Optional[bool] = None,
                sequence_parallel: Optional[bool] = None) -> TensorParallelModule:
    """Return this rank's tensor-parallel module for ``model`` (call on every rank of the process group).

    Args:
        model: the full model (same weights on every rank).
        example_args: positional example inputs (a tuple, or one tensor); their shapes are the captured ones.
        example_kwargs: keyword example inputs.
        tp: tensor-parallel degree; must equal the group's size.
        group: the process group (default: the world group).
        config: an :class:`fxopt.Config` for the passes run during capture (default: ``fxopt.Config()``); its
            ``tensor_parallel`` section is set to ``enabled=True, tp=tp``.
        vocab_parallel: also cut the lm_head by vocabulary (logits are all-gathered), and an embedding tied to it.
            Default: ``config.tensor_parallel.vocab_parallel``.
        training: emit the autograd-correct collectives (default: grad enabled and a parameter requires grad).
        overlap_chunks: inference only: cut each row-parallel linear and its all-reduce into this many chunks along
            the tokens, so communication overlaps the next chunk's matmul. Default:
            ``config.tensor_parallel.overlap_chunks`` (1).
        vocab_parallel_embedding: with ``vocab_parallel``, also cut an untied vocabulary embedding (less memory, one
            more all-reduce per forward). Default: ``config.tensor_parallel.vocab_parallel_embedding`` (False).
        sequence_parallel: inference only: reduce-scatter the row-parallel outputs over the tokens and run the
            token-wise ops after them on 1/tp of the tokens, all-gathering before the next column-parallel linear.
            Default: ``config.tensor_parallel.sequence_parallel`` (False). Not combined with ``overlap_chunks`` > 1.

    Raises:
        RuntimeError: no initialized process group, or the model is not captured as one graph.
        ValueError: ``tp`` differs from the group's size.
        DistributeError: the ranks were called with different example shapes, models or ``training``
            (raised on every rank, before the first collective of the graph).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fxopt.parallelize needs an initialized process group (torchrun + "
                           "dist.init_process_group)")
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"fxopt.parallelize: tp must be a positive int, got {tp!r}")
    if tp != world:
        raise ValueError(f"fxopt.parallelize: tp={tp} but the process group has {world} ranks (they must match)")
    cfg = copy.deepcopy(config) if config is not None else Config()
    tpcfg = cfg.tensor_parallel
    vp = tpcfg.vocab_parallel if vocab_parallel is None else bool(vocab_parallel)
    chunks = tpcfg.overlap_chunks if overlap_chunks is None else overlap_chunks
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"fxopt.parallelize: overlap_chunks must be a positive int, got {chunks!r}")
    vpe = tpcfg.vocab_parallel_embedding if vocab_parallel_embedding is None else bool(vocab_parallel_embedding)
    sp = tpcfg.sequence_parallel if sequence_parallel is None else bool(sequence_parallel)
    if sp and chunks > 1:
        raise ValueError("fxopt.parallelize: sequence_parallel and overlap_chunks > 1 are two ways to place the "
                         "row-parallel communication; choose one")
    cfg.tensor_parallel = dataclasses.replace(tpcfg, enabled=True, tp=tp, vocab_parallel=vp, overlap_chunks=chunks,
                                              vocab_parallel_embedding=vpe, sequence_parallel=sp)
    cfg.pipeline = dataclasses.replace(cfg.pipeline, enabled=False)
    if training is None:
        training = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    args = example_args if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    group_name = group.group_name
    # Ranks that capture different shapes would cut different plans and fail inside the backend's first collective
    # (gloo aborts on mismatched sizes); one all_gather of the signatures turns that into the same error everywhere.
    from .distribute import agree

    flat, caches = kv_cache.open_caches(tree_flatten((tuple(args), kwargs))[0])
    errors = []
    if any(c.slots for c in caches):
        errors.append("the example inputs hold a filled KV cache; pass none or an empty one (the module returns "
                      "its own, sharded by heads)")
    n_params = sum(p.numel() for p in model.parameters())
    caches_sig = tuple((c.leaf, c.slots, c.statics) for c in caches)
    agree(group, (_signature(flat), caches_sig, tuple(kwargs), n_params, bool(training)), errors,
          "fxopt.parallelize")
    key = _key(tuple(args), kwargs, flat, caches, {})
    base = TPContext(group_name, rank, tp, {}, bool(training))
    cap = _capture(model, tuple(args), kwargs, cfg, base)
    if cap.plan is None:
        raise RuntimeError("fxopt.parallelize: the tensor_parallel pass did not run (is it disabled in config?)")
    if not cap.plan.shards:
        log.warning("fxopt.parallelize: nothing could be sharded; every rank runs the full model:\n%s", cap.plan)
    mod = TensorParallelModule(model, cap, key, group=group, cfg=cfg, base=base)
    log.info("%s", cap.plan)
    return mod
