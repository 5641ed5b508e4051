"""``fxopt.pipeline``: pipeline parallelism with an automatic, cost-balanced split of the captured graph.

On every rank of an initialized process group, with the same model and example inputs::

    runner = fxopt.pipeline(model, (x,), stages=2, microbatches=4, schedule="1F1B")
    print(runner.plan)                                    # stage costs, balance, bytes per boundary
    out = runner.forward(x)                               # inference: output on the last stage, None elsewhere
    loss = runner.step(x, target=y, loss_fn=F.cross_entropy)   # training: mean micro-batch loss on the last stage

Dynamo captures one micro-batch as one graph (:func:`capture`), the ``pipeline`` pass plans the split,
:func:`build_stage_modules` builds one ``GraphModule`` per stage that owns the model's own Parameters, and each local
stage, compiled with ``backend="fxopt"``, runs in ``torch.distributed.pipelining``'s schedules. Gradients, tied
parameters, CUDA graphs and the limits: docs/architecture.md, "Pipeline parallel".
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..config import Config, PipelineConfig
from ..passes.pipeline import PLAN_KEY, SCHEDULES, STAGE_KEY, DeviceProfile, PipelineError, PipelinePlan

log = logging.getLogger(__name__)

# several stages per rank: stage s on rank s % world ("loop"), or V-shaped for ZBV and DualPipeV (two stages per rank,
# rank r holds stages r and 2 world - 1 - r, so the first and last stage share rank 0)
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def schedule_errors(schedule: str, stages: int, ranks: int, what: str) -> list:
    """Why ``stages`` stages do not fit ``schedule`` on ``ranks`` pipeline ranks (``what`` names that count)."""
    if schedule in V_SHAPED and stages != 2 * ranks:
        return [f"{schedule} runs two stages per rank: stages must be {2 * ranks}, got {stages}"]
    if schedule in MULTI_STAGE and stages % ranks:
        return [f"{schedule} needs stages to be a multiple of {what}, got {stages}"]
    if schedule not in MULTI_STAGE and stages != ranks:
        return [f"schedule {schedule} runs one stage per rank: stages must equal {what}, got {stages} "
                f"(use Interleaved1F1B for several stages per rank)"]
    return []


def stage_rank(s: int, world: int, schedule: str) -> int:
    """The rank of the pipeline group that runs stage ``s``."""
    if schedule in V_SHAPED:
        return s if s < world else 2 * world - 1 - s
    return s % world


def _flat_inputs(args: Sequence, kwargs: dict) -> list:
    return [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]


def _chunks(args: Sequence, kwargs: dict, n: int, i: int = 0) -> tuple:
    """Chunk ``i`` of ``n`` along dim 0 of every tensor of ``args`` and ``kwargs`` (other values pass through)."""
    def cut(v):
        return v.chunk(n, dim=0)[i] if isinstance(v, torch.Tensor) else v
    return [cut(a) for a in args], {k: cut(v) for k, v in kwargs.items()}


def _check_batch(args: Sequence, kwargs: dict, m: int) -> None:
    if m < 1:
        raise PipelineError(f"microbatches must be >= 1, got {m}")
    for i, t in enumerate(_flat_inputs(args, kwargs)):
        if t.dim() == 0 or t.shape[0] % m != 0:
            raise PipelineError(f"microbatches={m} does not divide the batch: input {i} has shape {tuple(t.shape)} "
                                f"(the batch dimension 0 must be a multiple of {m})")


def capture(model: nn.Module, args: Sequence, kwargs: dict) -> tuple:
    """Dynamo graph of ``model(*args, **kwargs)`` (one graph, static shapes) and its example inputs."""
    captured: list = []

    def recorder(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    for attempt in range(2):
        captured.clear()
        try:
            with torch.no_grad():
                torch.compile(model, backend=recorder, fullgraph=True, dynamic=False)(*args, **kwargs)
        except Exception as e:  # Dynamo: Unsupported / graph break / user error, all with a reason
            raise PipelineError(f"fxopt.pipeline needs the model as one graph, but Dynamo could not capture it "
                                f"(graph break or unsupported code): {type(e).__name__}: {str(e).splitlines()[0]}") from e
        if captured:
            break
        torch._dynamo.reset()  # a cached graph from an earlier compile: retrace once from scratch
    if len(captured) != 1:
        raise PipelineError(f"fxopt.pipeline needs the model as one graph, Dynamo produced {len(captured)}")
    return captured[0]


def _state_names(model: nn.Module) -> dict:
    """id(tensor) → qualified name (first one; tied parameters have several)."""
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names


def build_stage_modules(gm: fx.GraphModule, plan: PipelinePlan, state: dict, tensors: dict,
                        input_order: Sequence[str], only: Optional[Sequence[int]] = None) -> dict:
    """One ``GraphModule`` per stage (those in ``only``, default all) from the annotated graph.

    ``state``: placeholder name → qualified name; ``tensors``: qualified name → the Parameter/buffer object;
    ``input_order``: the user-input placeholder names in the order stage 0 receives them.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    n_stages = len(plan.stages)
    out_node = next(n for n in nodes if n.op == "output")

    def stages_of(n):
        s = n.meta.get(STAGE_KEY)
        return set(s) if isinstance(s, list) else ({s} if s is not None else set())

    index = {n: i for i, n in enumerate(nodes)}
    crossing = [sorted((by_name[v] for v, _, _ in b.values), key=index.get) for b in plan.boundaries]

    mods = {}
    for s in range(n_stages) if only is None else only:
        g = fx.Graph()
        env: dict = {}
        ins = [by_name[x] for x in input_order] if s == 0 else crossing[s - 1]
        for n in ins:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        root: dict = {}
        for n in nodes:
            if n in env or n.op in ("placeholder", "output") and n.name not in state:
                continue
            if n.op == "get_attr" or n.name in state:
                if s in stages_of(n):
                    qual = state.get(n.name, n.target)
                    root[qual] = tensors[qual]
                    env[n] = g.get_attr(qual)
                    env[n].meta = dict(n.meta)
                continue
            if s in stages_of(n):
                env[n] = g.node_copy(n, lambda a: env[a])
        if s == n_stages - 1:
            outs = fx.node.map_arg(out_node.args[0], lambda a: env[a])
            if isinstance(outs, (tuple, list)) and len(outs) == 1:
                outs = outs[0]  # a single tensor: what a loss_fn expects
        else:
            outs = tuple(env[n] for n in crossing[s])
            outs = outs[0] if len(outs) == 1 else outs
        g.output(outs)
        sm = fx.GraphModule(root, g, class_name=f"PipelineStage{s}")
        sm.graph.lint()
        mods[s] = sm
    return mods


def retarget_devices(gm: fx.GraphModule, src: torch.device, dst: torch.device) -> int:
    """Replace device literals equal to ``src`` in ``gm``'s node arguments by ``dst``; returns how many changed."""
    src, dst = torch.device(src), torch.device(dst)
    if src == dst:
        return 0
    changed = 0

    def fix(a):
        nonlocal changed
        if isinstance(a, torch.device) and a == src:
            changed += 1
            return dst
        if isinstance(a, str) and a in ("cpu", "cuda", "meta") and torch.device(a) == src:
            changed += 1
            return str(dst)
        return a

    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            n.args = fx.node.map_aggregate(n.args, fix)
            n.kwargs = fx.node.map_aggregate(n.kwargs, fix)
    if changed:
        gm.recompile()
    return changed


class _HostStaged(nn.Module):
    """Runs a stage on ``device`` with inputs and outputs in host memory: gloo's send/recv take host memory only. The
    copies are autograd ops, so the gradients sent between stages are on the host too."""

    def __init__(self, stage: nn.Module, device: torch.device):
        super().__init__()
        self.stage, self.device = stage, device

    def forward(self, *args):
        if any(a.device.type == "meta" for a in args):  # the schedule's shape inference: nothing to move
            return self.stage(*args)
        out = self.stage(*(a.to(self.device) for a in args))
        return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


class _GraphSlot:
    """One captured forward/backward pair of a stage: its static buffers and its own memory pool."""

    def __init__(self):
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd = torch.cuda.CUDAGraph()
        self.inputs: list = []  # static inputs (leaves; floating ones that arrived with requires_grad keep it)
        self.outputs: list = []  # static outputs of the forward graph
        self.diff: list = []  # positions of the outputs that carry a gradient
        self.grad_outputs: list = []  # static incoming gradients, one per differentiable output
        self.input_grads: list = []  # static gradients of the inputs that require grad (None where unused)
        self.busy = False  # forward replayed, backward not yet


class _Replay(torch.autograd.Function):
    """A training forward replayed from a slot's graph, its backward from the slot's backward graph. The parameters
    are arguments only so that autograd runs the backward (their gradients go to ``main_grads``, autograd gets None)."""

    @staticmethod
    def forward(ctx, stage, slot, n_args, *args_and_params):
        args = args_and_params[:n_args]
        for s, a in zip(slot.inputs, args):
            if s.data_ptr() != a.data_ptr():
                s.copy_(a)
        slot.fwd.replay()
        slot.busy = True
        ctx.slot, ctx.n_args, ctx.n_params = slot, n_args, len(args_and_params) - n_args
        # copies: the slot's buffers are rewritten when the slot is next replayed, the callers' tensors are not
        outs = tuple(o.clone() for o in slot.outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in slot.diff])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        slot = ctx.slot
        for buf, i in zip(slot.grad_outputs, slot.diff):
            g = grads[i]
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
        slot.bwd.replay()
        slot.busy = False
        it = iter(slot.input_grads)
        in_grads = []
        for s in slot.inputs:
            g = next(it) if s.requires_grad else None
            in_grads.append(None if g is None else g.clone())
        return (None, None, None, *in_grads, *([None] * ctx.n_params))


class _GraphedStage(nn.Module):
    """Runs a stage's training micro-batches from CUDA graphs (docs/architecture.md, "Pipeline parallel"): the first
    step runs eagerly and records the input specs, then ``slots`` forward/backward graph pairs are captured, one per
    micro-batch in flight. Parameter gradients are summed in the backward graph into ``main_grads``. Forward-only
    calls and the meta-device shape inference run the stage directly; a failed capture leaves it eager (``failure``).
    """

    def __init__(self, fn, params: list, slots: int):
        super().__init__()
        self.fn = fn
        self.params = [p for p in params if p.requires_grad]
        self.n_slots = slots
        self.slots: list = []
        self.main_grads: list = []
        self.spec = None  # [(shape, dtype, device, requires_grad)] of the inputs seen in the first step
        self.failure: Optional[str] = None
        self._tuple_out = False

    @property
    def captured(self) -> bool:
        return bool(self.slots)

    def forward(self, *args):
        if (not self.captured or not torch.is_grad_enabled()
                or any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)):
            if torch.is_grad_enabled() and self.spec is None and args and all(
                    isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args):
                self.spec = [(a.shape, a.dtype, a.device, a.requires_grad) for a in args]
            return self.fn(*args)
        got = [(a.shape, a.dtype, a.device) for a in args]
        if got != [s[:3] for s in self.spec]:
            raise PipelineError(f"cuda_graphs: stage inputs {got} differ from the captured {self.spec}")
        slot = next((s for s in self.slots if not s.busy), None)
        if slot is None:
            raise PipelineError(f"cuda_graphs: all {len(self.slots)} graph slots hold a micro-batch awaiting its "
                                "backward; the schedule keeps more micro-batches in flight than planned")
        outs = _Replay.apply(self, slot, len(args), *args, *self.params)
        return outs if len(outs) > 1 or self._tuple_out else outs[0]

    def begin_step(self) -> None:
        """Before each training step: capture once a step has run, zero the gradient buffers, free every slot."""
        if not self.captured and self.failure is None and self.spec is not None:
            self.capture()
        for s in self.slots:
            s.busy = False
        if self.main_grads:
            torch._foreach_zero_(self.main_grads)

    def capture(self) -> None:
        try:
            self.main_grads = [torch.zeros_like(p) for p in self.params]
            stream = torch.cuda.Stream()  # one capture stream, warmed up once, for every slot
            self._warm_up(stream)
            self.slots = [self._capture_one(stream) for _ in range(self.n_slots)]
        except Exception as e:  # noqa: BLE001 - any capture failure means: stay eager, say why
            self.slots, self.main_grads = [], []
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("fxopt.pipeline: CUDA-graph capture failed, the stage stays eager: %s", self.failure)

    def _inputs(self) -> list:
        # random floats, zero integers (valid indices): a warm-up run must not meet inf/NaN or out-of-range ids
        return [(torch.randn(shape, device=dev).to(dt) if dt.is_floating_point
                 else torch.zeros(shape, dtype=dt, device=dev)).requires_grad_(rg)
                for shape, dt, dev, rg in self.spec]

    def _warm_up(self, stream) -> None:
        """One forward and backward on the capture stream, so that per-stream lazy state (cuBLAS workspaces) is not
        created during a capture."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            xs = self._inputs()
            out = self.fn(*xs)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            wrt = [x for x in xs if x.requires_grad] + self.params
            if outs:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture_one(self, stream) -> "_GraphSlot":
        slot = _GraphSlot()
        pool = torch.cuda.graph_pool_handle()
        slot.inputs = self._inputs()
        with torch.cuda.graph(slot.fwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = self.fn(*slot.inputs)
        self._tuple_out = isinstance(out, tuple)
        slot.outputs = list(out) if self._tuple_out else [out]
        slot.diff = [i for i, o in enumerate(slot.outputs) if o.requires_grad]
        slot.grad_outputs = [torch.zeros_like(slot.outputs[i]) for i in slot.diff]
        wrt = [x for x in slot.inputs if x.requires_grad] + self.params
        with torch.cuda.graph(slot.bwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
            # no retain_graph: the saved activations' memory stays reserved in the slot's pool (and AOTAutograd's
            # backwards with donated buffers refuse retain_graph=True)
            grads = torch.autograd.grad([slot.outputs[i] for i in slot.diff], wrt, slot.grad_outputs,
                                        allow_unused=True)
            n_in = len(wrt) - len(self.params)
            pairs = [(m, g) for m, g in zip(self.main_grads, grads[n_in:]) if g is not None]
            if pairs:
                torch._foreach_add_([m for m, _ in pairs], [g for _, g in pairs])
        slot.input_grads = list(grads[:n_in])
        return slot


def _comm_device(device: torch.device, group) -> torch.device:
    """Where p2p buffers live: the stage device, except CUDA stages over gloo (host memory only)."""
    if torch.device(device).type != "cpu" and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(device)


class PipelineRunner:
    """What :func:`pipeline` returns: ``plan`` (printable), ``stage_modules`` (stage index → this rank's uncompiled
    stage), ``stage_indices`` (the stages this rank holds), ``is_last`` (it holds the last stage: outputs, losses)."""

    def __init__(self, plan, stage_modules, compiled, stage_indices, n_stages, microbatches, schedule, device, group,
                 loss_fn, shared_groups, input_spec):
        self.plan: PipelinePlan = plan
        self.stage_modules = stage_modules
        self._compiled = compiled
        self.stage_indices = list(stage_indices)
        self.n_stages = n_stages
        self.microbatches = microbatches
        self.schedule = schedule
        self.device = device
        self.group = group
        self.comm_device = _comm_device(device, group)
        self.loss_fn = loss_fn
        self._shared = shared_groups  # list of (param, process group) this rank takes part in
        self._input_spec = input_spec  # (shapes of the full-batch tensor inputs, kwargs keys)
        self._fwd = None
        self._train = None
        self._train_loss_fn = None
        self.is_last = (n_stages - 1) in self.stage_indices
        self._graphed = [m for m in compiled.values() if isinstance(m, _GraphedStage)]

    @property
    def cuda_graphs(self) -> dict:
        """Per local stage: ``"captured (N slots)"``, ``"eager until the second step"`` or why capture failed
        (empty without ``cuda_graphs=True``)."""
        out = {}
        for s in self.stage_indices:
            g = self._compiled[s]
            if isinstance(g, _GraphedStage):
                out[s] = (f"captured ({len(g.slots)} slots)" if g.captured else
                          f"eager: capture failed: {g.failure}" if g.failure else "eager until the second step")
        return out

    def parameters(self):
        """This rank's parameters (each once, also when several local stages share one)."""
        return (p for _, p in self.named_parameters())

    def named_parameters(self):
        seen = set()
        for s in self.stage_indices:
            for name, p in self.stage_modules[s].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def _make(self, loss_fn):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, schedules

        def wrap(m):
            return m if self.comm_device == torch.device(self.device) else _HostStaged(m, self.device)

        stages = [PipelineStage(wrap(self._compiled[s]), s, self.n_stages, self.comm_device, group=self.group)
                  for s in self.stage_indices]
        kw = {"loss_fn": loss_fn, "scale_grads": False}
        if self.schedule in MULTI_STAGE:
            name = self.schedule
            if loss_fn is None and name == "InterleavedZeroBubble":
                name = "Interleaved1F1B"  # forward only: the same order, no backward to split
            return getattr(schedules, "Schedule" + name)(stages, self.microbatches, **kw)
        # With fewer micro-batches than stages, 1F1B's warm-up already covers every micro-batch: the order of work is
        # GPipe's (PyTorch's Schedule1F1B refuses that case), so GPipe runs it.
        one_f_one_b = self.schedule == "1F1B" and loss_fn is not None and self.microbatches >= self.n_stages
        if self.schedule == "1F1B" and loss_fn is not None and not one_f_one_b:
            log.info("fxopt.pipeline: %d micro-batch(es) < %d stages: 1F1B is GPipe's order; running ScheduleGPipe",
                     self.microbatches, self.n_stages)
        cls = Schedule1F1B if one_f_one_b else ScheduleGPipe
        return cls(stages[0], self.microbatches, **kw)

    def _inputs(self, args, kwargs):
        flat = _flat_inputs(args, kwargs)
        shapes, keys = self._input_spec
        got = [tuple(t.shape) for t in flat]
        if got != shapes or list(kwargs) != keys:
            raise PipelineError(f"inputs must match the example the pipeline was built for: tensor shapes {shapes} "
                                f"(kwargs {keys}), got {got} (kwargs {list(kwargs)}); shapes are static")
        return [t.to(self.comm_device) for t in flat]

    def forward(self, *args, **kwargs):
        """Inference over micro-batches (GPipe order, no grad): the output on the last stage, ``None`` elsewhere."""
        if self.schedule in V_SHAPED:
            raise PipelineError(f"{self.schedule} is a training schedule (its V-shaped stage placement has no "
                                f"forward-only order in torch); use step(), or build inference with another schedule")
        flat = self._inputs(args, kwargs)
        if self._fwd is None:
            self._fwd = self._make(None)
        with torch.no_grad():
            out = self._fwd.step(*(flat if 0 in self.stage_indices else ()))
        if not self.is_last:
            return None
        return tuple(o.to(self.device) for o in out) if isinstance(out, tuple) else out.to(self.device)

    __call__ = forward

    def step(self, *args, target=None, loss_fn: Optional[Callable] = None, **kwargs):
        """One training step over micro-batches: forward, ``loss_fn(output, target)`` per micro-batch on the last
        stage, backward. Gradients (of the mean micro-batch loss) accumulate in the stage parameters. Returns the
        mean micro-batch loss (detached) on the last stage, ``None`` elsewhere."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise PipelineError("step() needs a loss_fn (here or in fxopt.pipeline(..., loss_fn=...))")
        flat = self._inputs(args, kwargs)
        if self.is_last and target is None:
            raise PipelineError("step() needs target= on the rank holding the last stage")
        if self._train is None or self._train_loss_fn is not loss_fn:
            self._train, self._train_loss_fn = self._make(loss_fn), loss_fn
        for g in self._graphed:
            g.begin_step()
        params = list(self.parameters())
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        losses: list = []
        kw = {"target": target.to(self.comm_device), "losses": losses} if self.is_last else {}
        self._train.step(*(flat if 0 in self.stage_indices else ()), **kw)
        for g in self._graphed:  # gradients summed inside the backward graphs
            if g.captured and g.params:
                fresh = torch._foreach_mul(g.main_grads, 1.0)
                for p, f in zip(g.params, fresh):
                    p.grad = f if p.grad is None else p.grad.add_(f)
        # one multi-tensor kernel per dtype group rather than a launch per parameter: the host is the bottleneck
        # when micro-batches are small
        grads = [p.grad for p in params if p.grad is not None]
        if grads and self.microbatches != 1:
            torch._foreach_div_(grads, float(self.microbatches))
        for p, grp in self._shared:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=grp)
        acc_new, acc_old = [], []
        for p, g in zip(params, before):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                acc_new.append(p.grad)
                acc_old.append(g)
        if acc_new:
            torch._foreach_add_(acc_new, acc_old)
        if self.is_last:
            return torch.stack([l.detach() for l in losses]).mean()
        return None


def plan_pipeline(model: nn.Module, example_args: Sequence, example_kwargs: dict, *, stages: int,
                  microbatches: int, schedule: str, split_points: Sequence[str] = (),
                  profile: Optional[DeviceProfile] = None, balance_slack: float = 0.05) -> tuple:
    """Capture one micro-batch of ``model`` and run the pipeline pass: ``(gm, plan, state, tensors, input_order)``
    (see :func:`build_stage_modules`). Runs no collective, so it also plans meshes larger than the machine."""
    from ..passes.manager import run_passes

    _check_batch(example_args, example_kwargs, microbatches)
    # 1. Capture one micro-batch.
    mb_args, mb_kwargs = _chunks(example_args, example_kwargs, microbatches)
    gm, example_inputs = capture(model, mb_args, mb_kwargs)
    names = _state_names(model)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(example_inputs):
        raise PipelineError(f"captured graph has {len(phs)} inputs but {len(example_inputs)} example values "
                            "(symbolic shapes?)")
    flat_mb = _flat_inputs(mb_args, mb_kwargs)
    state, tensors, user_pos = {}, {}, {}
    for n, v in zip(phs, example_inputs):
        if isinstance(v, torch.Tensor) and id(v) in names:
            state[n.name] = names[id(v)]
            tensors[names[id(v)]] = v
        else:
            pos = next((i for i, t in enumerate(flat_mb) if t is v), None)
            if pos is None:
                raise PipelineError(f"graph input {n.name} is neither a model parameter/buffer nor a tensor argument "
                                    f"(a global tensor or a non-tensor input Dynamo lifted): not supported")
            user_pos[n.name] = pos
    input_order = sorted(user_pos, key=user_pos.get)

    # 2. Plan (the pipeline pass alone; the other passes run later, inside each stage's compile).
    cfg = Config()
    cfg.attention.enabled = cfg.w4a16.enabled = cfg.tensor_parallel.enabled = False
    cfg.pipeline = PipelineConfig(enabled=True, stages=stages, microbatches=microbatches, schedule=schedule,
                                  split_points=list(split_points))
    trainable = {q for q, t in tensors.items() if isinstance(t, nn.Parameter) and t.requires_grad}
    extras = {"pipeline_state": state, "pipeline_trainable": trainable, "pipeline_slack": balance_slack,
              "pipeline_profile": profile or DeviceProfile.for_device(torch.device("cpu"))}
    gm, results = run_passes(gm, example_inputs, cfg, extras)
    plan = gm.meta.get(PLAN_KEY)
    if plan is None:
        reasons = "; ".join(s.reason for r in results for s in r.skipped) or "the pipeline pass did not run"
        raise PipelineError(f"no pipeline split: {reasons}")

    return gm, plan, state, tensors, input_order


def pipeline(model: nn.Module, example_args: Sequence, example_kwargs: Optional[dict] = None, *,
             stages: Optional[int] = None, microbatches: int = 1, schedule: str = "1F1B",
             split_points: Sequence[str] = (), loss_fn: Optional[Callable] = None, compile: Any = True,
             device: Any = None, group: Optional[dist.ProcessGroup] = None, config: Optional[Config] = None,
             profile: Optional[DeviceProfile] = None, balance_slack: float = 0.05,
             cuda_graphs: bool = False) -> PipelineRunner:
    """Split ``model`` into pipeline stages balanced by a cost model and run them with PyTorch's schedules.

    Call on every rank of ``group`` (default: the world) with the same model (same initial weights) and example
    inputs (the full batch).

    Args:
        model: an ``nn.Module`` Dynamo can capture as one graph; it returns a tensor or a tuple of tensors.
        example_args / example_kwargs: a full batch; tensors are cut along dim 0 into ``microbatches`` chunks.
        stages: number of stages (default: the world size; ``Interleaved1F1B``: twice the world size).
        microbatches: micro-batches per step (must divide the batch).
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` or, for training, one of torch's zero-bubble
            schedules ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"`` (inference with those runs
            Interleaved1F1B's order; ZBV and DualPipeV place two stages per rank in a V).
        split_points: module names that must start a stage (``["layers.2"]``); the rest is balanced.
        loss_fn: default ``loss_fn(output, target)`` for :meth:`PipelineRunner.step`.
        compile: ``True`` compiles each stage with ``backend="fxopt"`` (the passes of ``config``, minus pipeline
            and tensor_parallel); ``False`` runs stages eagerly; a string names another backend
            (``"fxopt_eager"``).
        device: where this rank's stages run (default ``cuda:<local rank>`` with CUDA, else CPU); the parameters
            the local stages use are moved there.
        group: the pipeline process group (default: world).
        config: an :class:`fxopt.Config` for the stage compiles; its ``pipeline`` section is overridden by the
            arguments here.
        profile: the cost model's :class:`DeviceProfile` (default: the preset for ``device``).
        balance_slack: a stage may be predicted up to this fraction slower than the best bottleneck when that
            sends fewer bytes between stages (0 = strict balance first).
        cuda_graphs: replay each local stage's training forward and backward from CUDA graphs from the second
            :meth:`PipelineRunner.step` on (CUDA stages; GPipe or 1F1B). Small micro-batches are otherwise bound
            by the host's kernel launches. ``runner.cuda_graphs`` reports each stage's state.
    """
    import os

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineError("fxopt.pipeline needs an initialized process group (torch.distributed.init_process_group)")
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if stages is None:
        stages = 2 * world if schedule in MULTI_STAGE else world
    if stages < 2:
        raise PipelineError(f"stages must be >= 2, got {stages}")
    errs = schedule_errors(schedule, stages, world, f"the world size {world}")
    if errs:
        raise PipelineError(errs[0])
    if cuda_graphs and schedule in MULTI_STAGE:
        raise PipelineError(f"cuda_graphs supports the GPipe and 1F1B schedules, not {schedule}")
    example_kwargs = dict(example_kwargs or {})
    _check_batch(example_args, example_kwargs, microbatches)
    if device is None:
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank) or 0) % torch.cuda.device_count())
                  if torch.cuda.is_available() else torch.device("cpu"))
    device = torch.device(device)
    if cuda_graphs and device.type != "cuda":
        raise PipelineError(f"cuda_graphs needs CUDA stages; this rank's stages run on {device}")

    gm, plan, state, tensors, input_order = plan_pipeline(
        model, example_args, example_kwargs, stages=stages, microbatches=microbatches, schedule=schedule,
        split_points=split_points, profile=profile or DeviceProfile.for_device(device), balance_slack=balance_slack)
    if rank == 0:
        log.info("%s", plan)

    # 3. Split; this rank builds its own stages. Device literals Dynamo recorded (``arange(..., device=cpu)``
    # in a model captured on the host) must name the stage device, or the stage mixes devices.
    src = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)), device)
    retarget_devices(gm, src, device)
    local = [s for s in range(stages) if stage_rank(s, world, schedule) == rank]
    mods = build_stage_modules(gm, plan, state, tensors, input_order, only=local)
    for m in mods.values():
        m.to(device)

    # Shared parameters across ranks: one group per rank set (created by every rank, in the same order).
    shared_groups = []
    for qual, st in plan.shared.items():
        ranks = sorted({stage_rank(s, world, schedule) for s in st})
        if len(ranks) < 2 or not isinstance(tensors.get(qual), nn.Parameter):
            continue
        global_ranks = [dist.get_global_rank(group, r) for r in ranks] if group is not None else ranks
        if len(ranks) == world:  # the whole pipeline group (always so with one stage per rank): no new group
            grp = group if group is not None else dist.group.WORLD
        elif group is not None and dist.get_world_size() != world:
            raise PipelineError(f"parameter {qual} is shared by pipeline ranks {ranks} of a sub-group of "
                                f"{world}: sub-groups of it are not created inside a device mesh")
        else:
            grp = dist.new_group(global_ranks)
        if rank in ranks:
            p = tensors[qual]
            with torch.no_grad():
                dist.broadcast(p.data, src=global_ranks[0], group=grp)
            shared_groups.append((p, grp))

    # 4. Compile the local stages.
    compiled = {}
    for s, m in mods.items():
        if compile is False or compile is None:
            compiled[s] = m
            continue
        if compile is True:
            from ..backends import Backend

            scfg = Config.from_options(None, base=config) if config is not None else Config()
            scfg.pipeline = PipelineConfig(enabled=False)
            scfg.tensor_parallel.enabled = False
            backend = Backend(scfg)
        else:
            backend = compile
        compiled[s] = torch.compile(m, backend=backend, dynamic=False)
    if cuda_graphs:
        # micro-batches a stage holds between forward and backward: 1F1B, the later stages plus one; GPipe (and
        # 1F1B with fewer micro-batches than stages, which runs in GPipe's order) all of them
        gpipe_order = schedule == "GPipe" or microbatches < stages
        for s in list(compiled):
            slots = microbatches if gpipe_order else min(microbatches, stages - s)
            compiled[s] = _GraphedStage(compiled[s], list(mods[s].parameters()), slots)

    spec = ([tuple(t.shape) for t in _flat_inputs(example_args, example_kwargs)], list(example_kwargs))
    return PipelineRunner(plan, mods, compiled, local, stages, microbatches, schedule, device, group, loss_fn,
                          shared_groups, spec)


__all__ = ["pipeline", "plan_pipeline", "PipelineRunner", "PipelineError", "build_stage_modules", "capture", "SCHEDULES"]
