"""``fxopt.distribute``: data × pipeline × tensor parallelism on one ("dp", "pp", "tp") device mesh.

Composes :func:`fxopt.parallelize` on "tp" and :func:`fxopt.pipeline` on "pp" (which takes the tensor-parallel
module as its model), with DDP / FSDP2 or an averaging all-reduce on "dp". Every rank validates its inputs alone,
then one ``all_gather_object`` makes a bad input raise the same :class:`DistributeError` everywhere. Design:
docs/architecture.md, "Data × pipeline × tensor".
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config
from .pipeline import MULTI_STAGE, SCHEDULES, _chunks, _flat_inputs, schedule_errors
from .schedules import choose_schedule, predicted_bubble

log = logging.getLogger(__name__)

__all__ = ["distribute", "Distributed", "DistributePlan", "DistributeError", "validate"]

DATA_PARALLEL = ("ddp", "fsdp")
_DIMS = ("dp", "pp", "tp")


class DistributeError(ValueError):
    """Bad input to :func:`distribute`, raised on every rank before any collective but the agreement check."""


def _hf_config(model: nn.Module):
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict"):
            return c
    return None


def _model_dims(model: nn.Module) -> dict:
    """heads / kv heads / ffn / layers, from a transformers config or fxopt's demo config; absent keys unknown."""
    c = _hf_config(model)
    out = {}
    if c is not None:
        for key, names in (("heads", ("num_attention_heads", "n_head")), ("ffn", ("intermediate_size", "n_inner")),
                           ("layers", ("num_hidden_layers", "n_layer")), ("hidden", ("hidden_size", "n_embd"))):
            v = next((getattr(c, n) for n in names if getattr(c, n, None) is not None), None)
            if v is not None:
                out[key] = int(v)
        if "ffn" not in out and "hidden" in out:
            out["ffn"] = 4 * out["hidden"]  # GPT-2's n_inner=None
    if "layers" not in out:
        lists = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
        if lists:
            out["layers"] = max(lists)
    return out


def validate(model: nn.Module, example_args: Sequence, example_kwargs: dict, *, world: int, dp: int, pp: int, tp: int,
             microbatches: int, schedule: str, data_parallel: str, stages: Optional[int] = None) -> list:
    """Every problem with these inputs, as sentences (empty: fine). Local: talks to no other rank."""
    errs = []
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            errs.append(f"{name} must be a positive int, got {v!r}")
    if errs:
        return errs
    if dp * pp * tp != world:
        errs.append(f"the mesh dp={dp} x pp={pp} x tp={tp} has {dp * pp * tp} ranks but the world has {world}")
    if schedule not in SCHEDULES:
        errs.append(f"unknown schedule {schedule!r}; choose one of {SCHEDULES} or 'auto'")
    if data_parallel not in DATA_PARALLEL:
        errs.append(f"unknown data_parallel {data_parallel!r}; choose one of {DATA_PARALLEL}")
    dims = _model_dims(model)
    if tp > 1:
        for key in ("heads", "ffn"):
            if key in dims and dims[key] % tp:
                what = "attention heads" if key == "heads" else "FFN width (intermediate size)"
                errs.append(f"tp={tp} does not divide the model's {dims[key]} {what}")
    n_stages = stages or (2 * pp if schedule in MULTI_STAGE and pp > 1 else pp)
    if pp > 1 and "layers" in dims and n_stages > dims["layers"]:
        errs.append(f"{n_stages} pipeline stages but the model has only {dims['layers']} layers")
    if pp > 1:
        errs += schedule_errors(schedule, n_stages, pp, f"pp={pp}")
    leaves = _flat_inputs(example_args, example_kwargs)
    if not leaves:
        errs.append("the example inputs hold no tensor (the batch is cut along dim 0 of the tensor inputs)")
    for i, t in enumerate(leaves):
        if t.dim() == 0 or t.shape[0] % (dp * microbatches):
            errs.append(f"the batch of input {i} (shape {tuple(t.shape)}) is not divisible by dp x microbatches = "
                        f"{dp} x {microbatches}")
    return errs


def _signature(model, args, kwargs, dims: tuple) -> tuple:
    leaves = _flat_inputs(args, kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    return (dims, tuple((tuple(t.shape), str(t.dtype)) for t in leaves), tuple(kwargs), n_params)


def agree(group, signature, errors: list, what: str) -> None:
    """One ``all_gather_object`` on ``group``: the same :class:`DistributeError` on every rank if any rank reported
    errors or the signatures differ (no rank proceeds into collectives the others never join)."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, (signature, errors), group=group)
    bad = {r: e for r, (_, e) in enumerate(got) if e}
    if bad:
        lines = [f"rank {r}: {'; '.join(e)}" for r, e in sorted(bad.items())]
        raise DistributeError(f"{what}: bad input on {len(bad)} rank(s):\n  " + "\n  ".join(lines))
    sigs = [s for s, _ in got]
    if any(s != sigs[0] for s in sigs):
        groups: dict = {}
        for r, s in enumerate(sigs):
            groups.setdefault(repr(s), []).append(r)
        lines = [f"ranks {rs}: {s}" for s, rs in groups.items()]
        raise DistributeError(f"{what}: the ranks were called with different models or example inputs (the same "
                              f"shapes are needed on every rank):\n  " + "\n  ".join(lines))


def _collective_bytes(gm) -> dict:
    """Bytes of the tensors each functional collective of ``gm`` returns, summed per collective kind."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or "_c10d_functional" not in str(n.target) or "wait_tensor" in str(n.target):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            kind = str(n.target).split(".")[-2]
            out[kind] = out.get(kind, 0) + v.numel() * v.element_size()
    return out


@dataclass
class DistributePlan:
    """What :func:`distribute` runs on this rank, printable. ``tp_bytes``: per collective kind, per micro-batch
    forward; ``pp_bytes``: per stage boundary and micro-batch forward; ``dp_bytes``: gradients averaged per step."""

    mesh: dict
    coords: dict
    microbatches: int
    schedule: str
    training: bool
    tp_plan: Any = None
    pipeline_plan: Any = None
    layers: Optional[int] = None
    tp_bytes: dict = field(default_factory=dict)
    pp_bytes: list = field(default_factory=list)
    dp_bytes: int = 0
    bubble: float = 0.0
    data_parallel: str = "ddp"
    schedule_bubbles: dict = field(default_factory=dict)

    def bytes_per_step(self) -> dict:
        """Bytes this rank sends per step on each mesh dimension (ring all-reduce: 2 (n-1)/n of the tensor)."""
        m, tp, pp, dp = self.microbatches, self.mesh["tp"], self.mesh["pp"], self.mesh["dp"]
        back = 2 if self.training else 1
        tpb = sum(b * (2 * (tp - 1) / tp if k == "all_reduce" else (tp - 1) / tp) for k, b in self.tp_bytes.items())
        out = {"tp": int(tpb * m * back)}
        s = self.coords["pp"]
        out["pp"] = int(self.pp_bytes[s] * m * back) if pp > 1 and s < len(self.pp_bytes) else 0
        out["dp"] = int(self.dp_bytes * 2 * (dp - 1) / dp) if dp > 1 else 0
        return out

    def lines(self) -> list:
        mesh = " x ".join(f"{k}={self.mesh[k]}" for k in _DIMS)
        coords = ", ".join(f"{k} {self.coords[k]}" for k in _DIMS)
        mode = f"training ({self.data_parallel} on dp)" if self.training else "inference"
        out = [f"distribute plan: {mesh} = {self.mesh['dp'] * self.mesh['pp'] * self.mesh['tp']} ranks, {mode}; "
               f"this rank: {coords}; {self.microbatches} micro-batch(es), schedule {self.schedule}"]
        if self.schedule_bubbles:
            out.append("  schedule auto: predicted bubble of each: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} ({v})" for k, v in self.schedule_bubbles.items()))
        if self.pipeline_plan is not None:
            out.append(f"  predicted bubble {self.bubble:.3f}")
            out += ["  " + x for x in self.pipeline_plan.lines()]
        if self.tp_plan is not None:
            tpp = self.tp_plan
            if self.layers:
                per = (tpp.all_reduces + tpp.all_gathers + tpp.reduce_scatters) / self.layers
                out.append(f"  tp collectives: {tpp.all_reduces} all_reduce, {tpp.all_gathers} all_gather, "
                           f"{tpp.reduce_scatters} reduce_scatter per forward = {per:.2f} per layer "
                           f"({self.layers} layers)")
            out += ["  " + x for x in tpp.lines()]
        b = self.bytes_per_step()
        out.append(f"  bytes sent per step by this rank: tp {b['tp']}, pp {b['pp']}, dp {b['dp']}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


class Distributed:
    """What :func:`distribute` returns on each rank: ``plan``; ``module`` (pp = 1: the model this rank runs, in DDP /
    FSDP2 for dp training) or ``runner`` (pp > 1: the ``PipelineRunner``); ``is_last``: this rank has outputs."""

    def __init__(self, plan, mesh, module, runner, tp_module, loss_fn, dp_group):
        self.plan, self.mesh, self.module, self.runner = plan, mesh, module, runner
        self._tp_module, self.loss_fn, self._dp_group = tp_module, loss_fn, dp_group
        self._dp, self._dp_rank = plan.mesh["dp"], plan.coords["dp"]
        self.is_last = runner is None or runner.is_last

    def local_batch(self, t):
        """This dp replica's slice of a global-batch tensor (non-tensors pass through)."""
        if not isinstance(t, torch.Tensor) or self._dp == 1:
            return t
        return t.chunk(self._dp, dim=0)[self._dp_rank]

    def _local(self, args, kwargs):
        return [self.local_batch(a) for a in args], {k: self.local_batch(v) for k, v in kwargs.items()}

    def parameters(self):
        return (self.runner or self.module).parameters()

    def named_parameters(self):
        return (self.runner or self.module).named_parameters()

    def forward(self, *args, **kwargs):
        """Inference on the global batch: this replica's slice of the output on ranks with ``is_last``, else None."""
        return _naming_failures("forward", self._forward, args, kwargs)

    __call__ = forward

    def _forward(self, *args, **kwargs):
        args, kwargs = self._local(args, kwargs)
        with torch.no_grad():
            if self.runner is not None:
                return self.runner.forward(*args, **kwargs)
            return self.module(*args, **kwargs)

    def step(self, *args, target=None, loss_fn: Optional[Callable] = None, **kwargs):
        """Forward and backward of ``loss_fn(output, target)`` on this replica's slice of the global batch; gradients
        land in :meth:`parameters`. Returns this replica's loss on ranks with ``is_last``, else None. A rank that fails
        records the error in the store; a peer whose collective then fails raises :class:`DistributeError` naming it."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise DistributeError("step() needs a loss_fn (here or in fxopt.distribute(..., loss_fn=...))")
        return _naming_failures("step", self._step, args, dict(kwargs, target=target, loss_fn=loss_fn))

    def _step(self, *args, target, loss_fn, **kwargs):
        args, kwargs = self._local(args, kwargs)
        target = self.local_batch(target)
        if self.runner is not None:
            loss = self.runner.step(*args, target=target, loss_fn=loss_fn, **kwargs)
            self._after_backward()
            if self._dp > 1:  # replicas average their gradients on dp only
                grads = [p.grad for p in self.runner.parameters() if p.grad is not None]
                for g in grads:
                    dist.all_reduce(g, group=self._dp_group)
                if grads:
                    torch._foreach_div_(grads, float(self._dp))
            return loss
        out = self.module(*args, **kwargs)
        out = out if isinstance(out, torch.Tensor) else getattr(out, "logits", out)
        loss = loss_fn(out, target)
        loss.backward()
        self._after_backward()
        return loss.detach()

    def _after_backward(self):
        if self._tp_module is not None:
            self._tp_module.reduce_replicated_grads()


_FAILED_KEY = "fxopt/distribute/failed"


def _naming_failures(what: str, fn, args, kwargs):
    """Run ``fn(*args, **kwargs)``; on an error, say which rank failed first (see :meth:`Distributed.step`)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        store, me = _store(), dist.get_rank()
        # a failed collective is most likely a peer's failure: give its report a moment to arrive
        first = _read_failure(store, wait_s=5.0 if _is_collective_error(e) else 0.0)
        if first is not None and first[0] != me and not isinstance(e, DistributeError):
            rank, message = first
            raise DistributeError(f"fxopt.distribute {what} on rank {me} stopped: rank {rank} failed with "
                                  f"{message}") from e
        if store is not None:
            try:  # the first report stays: compare_set writes only where no rank wrote yet
                store.compare_set(_FAILED_KEY, "", f"{me}\n{type(e).__name__}: {e}"[:2000])
            except Exception:  # the store may be gone with the job; the error itself still surfaces
                pass
        raise


def _is_collective_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(k in text for k in ("timeout", "timed out", "connection", "gloo", "nccl", "peer", "closed",
                                   "distbackenderror", "aborted"))


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no default store (e.g. the fake process group)
        return None


def _read_failure(store, wait_s: float):
    """(rank, message) of the first rank that recorded a failure, or None."""
    import time

    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([_FAILED_KEY]):
                rank, _, message = store.get(_FAILED_KEY).decode().partition("\n")
                return int(rank), message
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _mesh_sizes(mesh) -> dict:
    names = mesh.mesh_dim_names
    if names is None or any(n not in _DIMS for n in names) or len(set(names)) != len(names):
        raise DistributeError(f"the mesh's dimension names must be among {_DIMS}, each once; got {names}")
    return {d: (mesh.size(names.index(d)) if d in names else 1) for d in _DIMS}


def _auto_schedule(model, sizes: dict, microbatches, training: bool, stages, errs: list) -> tuple:
    """``schedule="auto"``: the schedule with the least predicted bubble (:func:`choose_schedule`) and the table."""
    pp = sizes["pp"]
    if not isinstance(pp, int) or not isinstance(microbatches, int) or pp <= 1 or microbatches < 1:
        return "1F1B", {}  # no pipeline (or sizes that validate() reports)
    v = 2 if stages is None else max(1, stages // pp)
    try:
        return choose_schedule(pp, microbatches, training, _model_dims(model).get("layers"), v)
    except ValueError as e:
        errs.append(f"schedule='auto': {e}")
        return "1F1B", {}


def distribute(model: nn.Module, example_args: Any, example_kwargs: Optional[dict] = None, *, mesh=None,
               dp: Optional[int] = None, pp: Optional[int] = None, tp: Optional[int] = None, microbatches: int = 1,
               schedule: str = "1F1B", stages: Optional[int] = None, training: Optional[bool] = None,
               data_parallel: str = "ddp", loss_fn: Optional[Callable] = None, config: Optional[Config] = None,
               compile: Any = False, device: Any = None, split_points: Sequence[str] = (),
               plan_only: bool = False) -> Distributed:
    """Run ``model`` data × pipeline × tensor parallel (call on every rank of the world with the same arguments).

    Args:
        model: the full model (same weights on every rank).
        example_args / example_kwargs: one *global* batch; tensors are cut along dim 0 over dp, then micro-batches.
        mesh: a ``DeviceMesh`` whose dimension names are among ``("dp", "pp", "tp")`` (a missing one has size 1).
            Default: ``init_device_mesh`` of ``(dp, pp, tp)`` on ``device``'s type after validation.
        dp / pp / tp: the sizes when no mesh is given (default 1 each; their product must be the world size).
        microbatches: micro-batches per dp replica and step (pp > 1); must divide the replica's batch.
        schedule: pipeline schedule, one of :data:`fxopt.parallel.pipeline.SCHEDULES` (GPipe, 1F1B,
            Interleaved1F1B and torch's zero-bubble InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), or ``"auto"``:
            the one with the least predicted bubble for these sizes and mode (:mod:`fxopt.parallel.schedules`;
            ``result.plan`` lists each one's prediction).
        stages: pipeline stages (default pp; the multi-stage schedules: 2 pp).
        training: build for training (default: grad enabled and a parameter requires grad).
        data_parallel: training with dp > 1 and pp = 1: ``"ddp"`` (DistributedDataParallel on the dp group) or
            ``"fsdp"`` (FSDP2 ``fully_shard`` on the dp sub-mesh). With pp > 1 the gradients are averaged on dp
            after each step (``"ddp"`` only).
        loss_fn: default ``loss_fn(output, target)`` for :meth:`Distributed.step`.
        config: an :class:`fxopt.Config` for the tensor-parallel capture and the stage compiles.
        compile: with pp > 1, compile each stage (see :func:`fxopt.pipeline`); default False.
        device: where the stages run (default: CUDA's local device if there is one, else CPU).
        split_points: module names that must start a pipeline stage.
        plan_only: plan and return without building stages or running anything (``result.plan`` only).

    Raises:
        DistributeError: bad input on any rank (raised on every rank, before the other collectives).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fxopt.distribute needs an initialized process group (torchrun + "
                           "dist.init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if training is None:
        training = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    training = bool(training)
    errs: list = []
    if mesh is not None:
        if dp is not None or pp is not None or tp is not None:
            errs.append("give either mesh= or dp/pp/tp sizes, not both")
        try:
            sizes = _mesh_sizes(mesh)
        except DistributeError as e:
            errs.append(str(e))
            sizes = {d: 1 for d in _DIMS}
    else:
        sizes = {"dp": dp or 1, "pp": pp or 1, "tp": tp or 1}
    bubbles: dict = {}
    if schedule == "auto":
        schedule, bubbles = _auto_schedule(model, sizes, microbatches, training, stages, errs)
    errs += validate(model, args, kwargs, world=world, dp=sizes["dp"], pp=sizes["pp"], tp=sizes["tp"],
                     microbatches=microbatches, schedule=schedule, data_parallel=data_parallel, stages=stages)
    if not training and sizes["pp"] > 1 and schedule in ("ZBVZeroBubble", "DualPipeV"):
        errs.append(f"{schedule} is a training schedule; inference needs GPipe, 1F1B, Interleaved1F1B or "
                    f"InterleavedZeroBubble")
    if training and data_parallel == "fsdp" and sizes["pp"] > 1 and sizes["dp"] > 1:
        errs.append("data_parallel='fsdp' with pp > 1 is not supported yet; use 'ddp'")
    sig = _signature(model, args, kwargs, tuple(sizes[d] for d in _DIMS))
    agree(None, sig, errs, "fxopt.distribute")

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        from ..passes.pipeline import default_device

        mesh = init_device_mesh(default_device(device).type, tuple(sizes[d] for d in _DIMS), mesh_dim_names=_DIMS)
    names = mesh.mesh_dim_names
    coords = {d: (mesh.get_local_rank(d) if d in names else 0) for d in _DIMS}
    groups = {d: (mesh[d].get_group() if d in names and sizes[d] > 1 else None) for d in _DIMS}
    dp_n, pp_n, tp_n = sizes["dp"], sizes["pp"], sizes["tp"]

    # this replica's slice and one micro-batch of it (the tp capture's shapes: the pipeline runs micro-batches)
    l_args, l_kwargs = _chunks(args, kwargs, dp_n, coords["dp"])
    m = microbatches if pp_n > 1 else 1
    mb_args, mb_kwargs = _chunks(l_args, l_kwargs, m)

    cfg = copy.deepcopy(config) if config is not None else Config()
    dims = _model_dims(model)
    tp_module, stage_model = None, model
    if tp_n > 1:
        from .tensor_parallel import parallelize

        with torch.set_grad_enabled(training):
            tp_module = parallelize(model, tuple(mb_args), mb_kwargs, tp=tp_n, group=groups["tp"], config=cfg,
                                    training=training)
        stage_model = tp_module
    plan = DistributePlan(mesh=dict(sizes), coords=coords, microbatches=m, schedule=schedule, training=training,
                          tp_plan=tp_module.plan if tp_module is not None else None, layers=dims.get("layers"),
                          data_parallel=data_parallel, schedule_bubbles=bubbles)
    if tp_module is not None:
        plan.tp_bytes = _collective_bytes(tp_module.graph_module)
    runner = None
    if pp_n > 1:
        from ..passes.pipeline import DeviceProfile
        from .pipeline import pipeline, plan_pipeline

        n_stages = stages or (2 * pp_n if schedule in MULTI_STAGE else pp_n)
        if plan_only:
            _, pplan, _, _, _ = plan_pipeline(stage_model, l_args, l_kwargs, stages=n_stages, microbatches=m,
                                              schedule=schedule, split_points=split_points,
                                              profile=DeviceProfile.for_device(torch.device(device or "cpu")))
        else:
            runner = pipeline(stage_model, l_args, l_kwargs, stages=n_stages, microbatches=m, schedule=schedule,
                              split_points=split_points, loss_fn=loss_fn, compile=compile, device=device,
                              group=groups["pp"], config=config)
            pplan = runner.plan
        plan.pipeline_plan = pplan
        plan.pp_bytes = [b.bytes for b in pplan.boundaries]
        plan.bubble = predicted_bubble(schedule, pp_n, m, n_stages // pp_n, training)
    if training and dp_n > 1:
        local = (runner or stage_model).parameters()
        plan.dp_bytes = sum(p.numel() * p.element_size() for p in local if p.requires_grad)
    if plan_only:
        return Distributed(plan, mesh, None, None, tp_module, loss_fn, groups["dp"])

    module = None
    if runner is None:
        module = stage_model
        if training and dp_n > 1:
            if data_parallel == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                module = DistributedDataParallel(module, process_group=groups["dp"])
            else:
                from torch.distributed.fsdp import fully_shard

                module = fully_shard(module, mesh=mesh["dp"])
    if rank == 0:
        log.info("%s", plan)
    return Distributed(plan, mesh, module, runner, tp_module, loss_fn, groups["dp"])
