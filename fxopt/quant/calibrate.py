"""``fxopt.quantize``: GPTQ / AWQ / RTN int4 calibration driven by the model's captured graph.

The model is captured once with Dynamo; which linears are quantized, how they group (one input node: one Hessian,
one AWQ scale) and where an AWQ scale folds (a norm, or a preceding linear whose channel map a float64 probe
verifies) all come from that graph, with no per-architecture layer lists. Calibration runs as an interpreter over
the graph, group by group, on the inputs the already quantized model gives (true-sequential); ``float_target`` adds
a float stream and aims each linear at the float model's output. On any error the parameters are restored. Design:
docs/architecture.md, "Quantization".
"""
from __future__ import annotations

import fnmatch
import logging
import operator
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .awq import find_norm_fold, search_clip, search_scale
from .format import SUPPORTED_GROUP_SIZES, PackedW4, dequantize
from .gptq import HessianAccumulator, QuantResult, gptq_quantize, output_error, rtn_quantize

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "rtn")
AWQ_ROUNDINGS = ("gptq", "nearest")  # AWQ's last step: GPTQ's error feedback on the clipped grids, or the paper's RTN


@dataclass
class _Target:
    """One linear to quantize."""

    name: str
    module: nn.Linear
    node: fx.Node
    result: Optional[QuantResult] = None


@dataclass
class _Fold:
    kind: str  # "norm", "linear", "explicit"
    norm: Any = None
    producer: Optional[nn.Linear] = None
    producer_name: str = ""
    channel_map: Optional[torch.Tensor] = None
    reason: str = ""


@dataclass
class QuantizeReport:
    """Filled by :func:`quantize` when ``report=`` is given: per-linear rows and what was skipped."""

    method: str = ""
    rows: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    folds: list = field(default_factory=list)
    seconds: float = 0.0


def quantize(model: nn.Module, calibration: Optional[Iterable], method: str = "gptq", bits: int = 4,
             group_size: int = 128, sym: bool = False, act_order: bool = True, static_groups: bool = False,
             damp: float = 0.01, *, mse: bool = False, float_target: Optional[bool] = None, block_size: int = 128,
             exclude: Iterable[str] = (), include_head: bool = False, n_grid: int = 20, max_shrink: float = 0.5,
             clip: bool = True, awq_rounding: Optional[str] = None, offload: bool = False, pack: bool = True,
             progress: bool = True, report: Optional[QuantizeReport] = None) -> nn.Module:
    """Quantize ``model``'s linears to int4 in place and return it.

    Args:
        model: any module Dynamo can capture in one graph for the calibration inputs.
        calibration: iterable of model inputs: tensors, tuples of positional args, or kwargs dicts
            (``{"input_ids": ...}``); all with the same shapes. RTN uses only the first (to capture the graph).
        method: ``"gptq"``, ``"awq"`` or ``"rtn"``.
        bits: 4 (the packed format's only width).
        group_size: 32, 64, 128 or -1 (per output channel over all of K).
        sym: symmetric quantization (zero point 8).
        act_order: GPTQ: quantize columns by decreasing Hessian diagonal (stored as a permutation of K).
        static_groups: GPTQ: group parameters from the original weight (no permutation needed with act-order).
        damp: GPTQ dampening, a fraction of the mean Hessian diagonal.
        mse: GPTQ: per-group (scale, zero) from a search over shrunk ranges minimising the rounding error, instead
            of the group's min/max (helps weights that are already on a coarser grid, e.g. dequantized GGUF).
        float_target: aim each linear at the float model's output ``W x`` instead of ``W x̃`` (a float copy of the
            graph runs alongside; a least-squares correction ridge-regularised by ``damp``).
            ``None``: on for GPTQ and AWQ, off for RTN; ``False`` gives the papers' plain algorithms.
        block_size: GPTQ lazy-batch block.
        exclude: ``fnmatch`` patterns of module names kept in float.
        include_head: also quantize the output head (excluded by default).
        n_grid, max_shrink, clip: AWQ scale grid size, clip search range, and whether to clip at all.
        awq_rounding: AWQ's last step (``None``, the default, is ``"gptq"``): GPTQ's error feedback on the grids
            the clip search picked (no permutation, AWQ's layout), or ``"nearest"`` (the paper's round-to-nearest).
        offload: keep calibration activations on the CPU between nodes (for models on an accelerator).
        pack: replace linears with :class:`fxopt.quant.linear.QuantLinear`; ``False`` keeps ``nn.Linear`` with the
            dequantized weights (simulated quantization, same numbers; for quality studies).
        progress: tqdm bar over linears.
        report: a :class:`QuantizeReport` to fill with per-linear output errors (method vs. RTN) and skips.

    The defaults are the settings that measured best on held-out text; the papers' plain algorithms are
    ``float_target=False`` (and ``awq_rounding="nearest"``). Costs and quality: benchmarks/results/quant_quality.md.
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if bits != 4:
        raise ValueError(f"only bits=4 is supported (fxopt's packed int4 format), got bits={bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize needs an nn.Module, got {type(model).__name__}")
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    if awq_rounding is not None and method != "awq":
        raise ValueError(f"awq_rounding applies to method='awq', not {method!r}")
    if awq_rounding not in (None,) + AWQ_ROUNDINGS:
        raise ValueError(f"awq_rounding must be one of {AWQ_ROUNDINGS}, got {awq_rounding!r}")
    from .linear import QuantLinear, share_sibling_storage

    samples = _normalize_samples(calibration)
    if method == "rtn":
        samples = samples[:1]
    device = _model_device(model)
    samples = [pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, s) for s in samples]

    was_training = model.training
    model.eval()
    cal = _Calibrator(model, samples, method, group_size, sym, act_order, static_groups, damp, block_size,
                      tuple(exclude), include_head, n_grid, max_shrink, clip, offload, progress, report, mse=mse,
                      awq_rounding=awq_rounding or "gptq",
                      float_target=method in ("gptq", "awq") if float_target is None else float_target)
    _warn_fp32(model, pack)
    try:
        cal.run()
        if report is not None:
            report.method = method
            report.seconds = time.perf_counter() - t0
        cal.install(QuantLinear if pack else None)
        if pack:
            share_sibling_storage(model)
    except BaseException:
        cal.restore()
        raise
    finally:
        model.train(was_training)
    return model


def _warn_fp32(model: nn.Module, pack: bool) -> None:
    """The packed int4 kernels take float16/bfloat16 activations: a float32 model compiles to dequantize + matmul."""
    if not pack:
        return
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if torch.float32 in dts and not dts & {torch.float16, torch.bfloat16}:
        log.warning("fxopt.quantize: the model is float32, but the W4A16 kernels take float16/bfloat16 activations, "
                    "so torch.compile(backend='fxopt') would fuse none of the quantized linears. Cast it first: "
                    "model.to(torch.float16) (or torch.bfloat16), before or after quantize.")


def _normalize_samples(calibration) -> list:
    if calibration is None:
        raise ValueError("calibration is empty: give an iterable of model inputs (tensors, tuples or kwargs dicts)")
    if isinstance(calibration, (torch.Tensor, dict)):
        raise ValueError("calibration must be an iterable of samples (e.g. a list), not a single "
                         f"{type(calibration).__name__}")
    samples = []
    for i, s in enumerate(calibration):
        if isinstance(s, torch.Tensor):
            samples.append(((s,), {}))
        elif isinstance(s, (tuple, list)):
            samples.append((tuple(s), {}))
        elif isinstance(s, dict):
            samples.append(((), dict(s)))
        else:
            raise ValueError(f"calibration sample {i} is a {type(s).__name__}; expected a tensor, tuple or dict")
    if not samples:
        raise ValueError("calibration is empty: give at least one model input")
    spec0 = _signature(samples[0])
    for i, s in enumerate(samples[1:], 1):
        if _signature(s) != spec0:
            raise ValueError(f"calibration sample {i} differs in structure or shapes from sample 0 "
                             f"({_signature(s)} vs {spec0}); pad or cut samples to one shape")
    return samples


def _signature(sample):
    leaves, spec = pytree.tree_flatten(sample)
    return (str(spec), tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves))


def _model_device(model):
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _run_node(node: fx.Node, args, kwargs, gm: fx.GraphModule):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    raise RuntimeError(f"cannot run node {node.format_node()}")


def _is_linear(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        torch._C._nn.linear, torch.nn.functional.linear)


def _weight_arg(n: fx.Node):
    return n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")


def _closure(start: Iterable[fx.Node], step) -> set:
    """``start`` and every node reached from it through ``step(node)`` (its users, or its inputs)."""
    seen, stack = set(start), list(start)
    while stack:
        for m in step(stack.pop()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def _linear_owners(model: nn.Module) -> dict:
    """id(weight) -> (name, module) of every ``nn.Linear`` of ``model``."""
    return {id(m.weight): (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


class _Calibrator:
    def __init__(self, model, samples, method, group_size, sym, act_order, static_groups, damp, block_size,
                 exclude, include_head, n_grid, max_shrink, clip, offload, progress, report, mse=False,
                 float_target=False, awq_rounding="nearest"):
        self.model, self.samples, self.method = model, samples, method
        self.group_size, self.sym, self.act_order, self.static_groups = group_size, sym, act_order, static_groups
        self.damp, self.block_size, self.exclude, self.include_head = damp, block_size, exclude, include_head
        self.mse, self.awq_rounding = mse, awq_rounding
        if float_target and method not in ("gptq", "awq"):
            raise ValueError(f"float_target applies to method='gptq' or 'awq', not {method!r}")
        self.float_target = float_target
        self.n_grid, self.max_shrink, self.clip, self.offload = n_grid, max_shrink, clip, offload
        self.progress, self.report = progress, report
        self.saved: dict[int, tuple] = {}
        self.float_weights: dict[int, torch.Tensor] = {}  # float_target: originals of the parameters changed so far
        self.targets: dict[fx.Node, _Target] = {}
        self._awq_scales: dict[str, torch.Tensor] = {}  # AWQ: input scale s of each quantized linear
        self.device = _model_device(model)

    def touch(self, p: torch.Tensor) -> None:
        """Called before any parameter changes: keeps its original for undo (and for the float stream)."""
        if id(p) not in self.saved:
            self.saved[id(p)] = (p, p.detach().to("cpu", copy=True))
            if self.float_target:
                self.float_weights[id(p)] = p.detach().clone()

    @torch.no_grad()
    def restore(self) -> None:
        for p, orig in self.saved.values():
            p.copy_(orig.to(p.device))
        self.saved.clear()

    @torch.no_grad()
    def set_weight(self, module: nn.Linear, w: torch.Tensor) -> None:
        self.touch(module.weight)
        module.weight.copy_(w.to(module.weight.dtype))

    def capture(self):
        args, kwargs = self.samples[0]
        with torch.no_grad():
            try:
                self.model(*args, **kwargs)
            except Exception as e:
                raise ValueError(f"the model rejects calibration sample 0: {type(e).__name__}: {e}") from None
        graphs = []

        def record(gm, example_inputs):
            graphs.append((gm, list(example_inputs)))
            return gm.forward

        try:
            with torch.no_grad():
                torch.compile(self.model, backend=record, fullgraph=True, dynamic=False)(*args, **kwargs)
        except Exception as e:
            msg = str(e).strip().splitlines()
            raise ValueError(f"fxopt.quantize could not capture {type(self.model).__name__} in one graph "
                             f"(Dynamo: {type(e).__name__}: {msg[0] if msg else ''}); calibration needs the whole "
                             "forward as one graph") from None
        if len(graphs) != 1:
            raise ValueError(f"capture produced {len(graphs)} graphs; calibration needs exactly one")
        gm, example_inputs = graphs[0]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise ValueError("captured graph inputs do not match Dynamo's example inputs")
        by_id = {id(p): p for p in self.model.parameters()}
        by_id.update({id(b): b for b in self.model.buffers()})
        leaves0 = pytree.tree_leaves(self.samples[0])
        self.const_env: dict[fx.Node, Any] = {}
        self.input_index: dict[fx.Node, int] = {}
        self.params: dict[fx.Node, nn.Parameter] = {}

        def constant(node, v):
            self.const_env[node] = v
            if isinstance(v, nn.Parameter):
                self.params[node] = v

        for node, value in zip(placeholders, example_inputs):
            idx = next((i for i, leaf in enumerate(leaves0) if leaf is value), None)
            if id(value) in by_id:
                constant(node, by_id[id(value)])
            elif idx is None:
                if isinstance(value, torch.Tensor):
                    raise ValueError(f"captured graph input {node.name!r} is neither a calibration input nor a "
                                     "parameter/buffer of the model (a tensor held elsewhere); cannot calibrate")
                self.const_env[node] = value
            else:
                self.input_index[node] = idx
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                constant(node, _run_node(node, (), {}, gm))
        self.gm = gm

    def select(self):
        owner = _linear_owners(self.model)
        nodes = list(self.gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        # linear descendants: a linear with none after it is the output head
        has_linear_after: dict[fx.Node, bool] = {}
        for n in reversed(nodes):
            has_linear_after[n] = any(_is_linear(u) or has_linear_after.get(u, False) for u in n.users)
        skipped, indivisible, G = [], [], self.group_size
        linears = [n for n in nodes if _is_linear(n)]
        weights = [self.params.get(_weight_arg(n)) for n in linears]
        weight_uses = Counter(id(p) for p in weights if p is not None)
        for n in linears:
            w = _weight_arg(n)
            p = self.params.get(w)
            if p is None or id(p) not in owner:
                skipped.append((n.name, "weight is not an nn.Linear parameter"))
                continue
            name, mod = owner[id(p)]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            K = mod.weight.shape[1]
            if b is not None and (not isinstance(b, fx.Node) or self.params.get(b) is not mod.bias):
                why = "bias is not the module's own bias"
            elif weight_uses[id(p)] > 1 or len(w.users) > 1:
                why = "weight is shared (tied or called several times)"
            elif not self.include_head and not has_linear_after[n]:
                why = "output head (no linear after it); include_head=True quantizes it"
            elif any(fnmatch.fnmatch(name, pat) for pat in self.exclude):
                why = "excluded by pattern"
            elif K % 8 or (G != -1 and K % G):
                indivisible.append(name)
                why = f"in_features {K} not divisible by group size {G} (and 8)"
            else:
                self.targets[n] = _Target(name, mod, n)
                continue
            skipped.append((name, why))
        for name, why in skipped:
            log.info("fxopt.quantize: skipping %s: %s", name, why)
        if self.report is not None:
            self.report.skipped.extend(skipped)
        if not self.targets:
            if indivisible:
                raise ValueError(f"group size {G} divides the in_features of no linear (e.g. {indivisible[0]}, "
                                 f"in_features {dict(self.model.named_modules())[indivisible[0]].in_features})")
            raise ValueError(f"no linear to quantize in {type(self.model).__name__}'s graph ({len(linears)} linear "
                             f"calls; skipped: {skipped})")
        # groups: targets reading the same input node
        self.groups: dict[fx.Node, list[_Target]] = {}
        for n, t in self.targets.items():
            self.groups.setdefault(n.args[0], []).append(t)
        self.needed = _closure(self.targets, lambda n: n.all_input_nodes)  # only ancestors of targets are computed

    def plan_folds(self):
        self.folds: dict[fx.Node, _Fold] = {}
        owner = _linear_owners(self.model)
        probes = []
        for x, members in self.groups.items():
            K = members[0].module.in_features
            if not set(x.users) <= {t.node for t in members}:
                self.folds[x] = _Fold("explicit", reason=f"input {x.name} has users besides the quantized linears")
                continue
            nf = find_norm_fold(x, self.params, K)
            if nf is not None:
                self.folds[x] = _Fold("norm", norm=nf, reason=nf.description)
                continue
            n_probes = len(probes)
            for L1 in self._frontier_linears(x):
                p = self.params.get(_weight_arg(L1))
                S = None if p is None or id(p) not in owner or len(L1.args) < 1 else self._between(L1, x)
                if S is not None:
                    probes.append((x, L1, S, owner[id(p)]))
            if len(probes) == n_probes:
                self.folds[x] = _Fold("explicit", reason="no norm or preceding linear can absorb the scale")
        if probes:
            self._run_probes(probes)
        for x in self.groups:
            if x not in self.folds:
                self.folds[x] = _Fold("explicit", reason="probe: no preceding linear maps channels one-to-one")
        for x, f in self.folds.items():
            line = (f"{', '.join(t.name for t in self.groups[x])}: scale folded into "
                    + ({"norm": "norm", "linear": f"{f.producer_name} output rows", "explicit": "nothing (no AWQ scale, clip only)"}
                       [f.kind]) + f" ({f.reason})")
            log.info("fxopt.quantize AWQ: %s", line)
            if self.report is not None:
                self.report.folds.append(line)

    def _frontier_linears(self, x):
        out, seen, stack = [], set(), [x]
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if _is_linear(a):
                    out.append(a)
                elif a.op not in ("placeholder", "get_attr"):
                    stack.append(a)
        return out

    def _between(self, L1, x):
        """Nodes strictly after L1 up to x on paths L1 → x, if every value there only flows on to x."""
        S = (_closure([L1], lambda n: n.users) - {L1}) & _closure([x], lambda n: n.all_input_nodes)
        if x not in S:
            return None
        for n in [L1, *S]:
            if n is x:
                continue
            # graph outputs on the way (a KV cache holding v) are only ever read back through the same path
            if not {u for u in n.users if u.op != "output"} <= S:
                return None
        return sorted(S, key=self.order.__getitem__)

    @torch.no_grad()
    def _run_probes(self, probes):
        """Run sample 0 (float model) keeping what the probes need, then test each (x, L1) candidate."""
        keep = set()
        for x, L1, S, _ in probes:
            keep.add(L1)
            for n in S:
                keep.add(n)
                keep.update(n.all_input_nodes)
        env = self._single_sample_env(0, keep)
        gen = torch.Generator().manual_seed(0)
        for x, L1, S, (pname, pmod) in probes:
            if x in self.folds:
                continue
            base = env[L1]
            C = base.shape[-1]
            cmap = None
            # two probes with distinct, evenly spaced factors (a permutation of 0.5 + 1.5 (i + 0.5) / C): the first
            # recovers the map, the second must confirm it. Random factors could nearly coincide and swap two
            # channels unnoticed, which is harmless for the probe but fatal for a scale spanning 1e-2..1e2.
            ref = self._probe_once(env, x, L1, S, base, torch.ones(C, dtype=torch.float64, device=base.device))
            for _ in range(2 if ref is not None else 0):
                r = (0.5 + 1.5 * (torch.randperm(C, generator=gen, dtype=torch.float64) + 0.5) / C).to(base.device)
                xp = self._probe_once(env, x, L1, S, base, r)
                if xp is None:
                    cmap = None
                    break
                flat, flatp = ref.reshape(-1, ref.shape[-1]), xp.reshape(-1, xp.shape[-1])
                if cmap is None:
                    big = flat.abs() > 1e-3 * flat.abs().max()
                    ratio = torch.where(big, flatp / torch.where(big, flat, torch.ones_like(flat)), torch.nan)
                    est = torch.nanmedian(ratio, dim=0).values
                    if torch.isnan(est).any():
                        break
                    cmap = (est[:, None] - r[None, :]).abs().argmin(dim=1)
                expect = flat * r[cmap]
                tol = 1e-4 * flatp.abs().max() + 1e-4 * flatp.abs()
                if not bool(((flatp - expect).abs() <= tol).all()):
                    cmap = None
                    break
            if cmap is not None:
                self.folds[x] = _Fold("linear", producer=pmod, producer_name=pname, channel_map=cmap.cpu(),
                                      reason=f"probe verified channel map onto {pmod.out_features} outputs")

    def _probe_once(self, env, x, L1, S, base, r):
        """``x`` when L1's output channels are multiplied by ``r``, computed in float64 from L1's output on (every
        floating input and result cast up), so that a float16/bfloat16 model's rounding cannot hide a fold; None if
        that cannot be computed."""
        up = lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        penv = {L1: base.double() * r.to(base.device)}
        try:
            for n in S:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: penv[a] if a in penv else env[a])
                args, kwargs = pytree.tree_map(up, (args, kwargs))
                penv[n] = pytree.tree_map(up, _run_node(n, args, kwargs, self.gm))
        except Exception as e:  # noqa: BLE001 - a probe that cannot run is just not a fold
            log.debug("probe %s -> %s failed: %s", L1.name, x.name, e)
            return None
        xp = penv[x]
        if not isinstance(xp, torch.Tensor) or not isinstance(env[x], torch.Tensor) or xp.shape != env[x].shape:
            return None
        return xp

    def _single_sample_env(self, i, keep):
        env = {}
        nodes = [n for n in self.gm.graph.nodes if n in self.needed]
        last = self._last_use(nodes)
        leaves = pytree.tree_leaves(self.samples[i])
        for idx, n in enumerate(nodes):
            if n in self.const_env:
                env[n] = self.const_env[n]
            elif n in self.input_index:
                env[n] = leaves[self.input_index[n]]
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = _run_node(n, args, kwargs, self.gm)
            for a in n.all_input_nodes:
                if last.get(a) == idx and a not in keep and a not in self.const_env:
                    env.pop(a, None)
        return env

    def _last_use(self, nodes):
        last = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last[a] = i
        return last

    def run(self):
        self.capture()
        self.select()
        if self.method == "rtn" and self.report is None:
            for t in self.targets.values():
                t.result = rtn_quantize(t.module.weight.detach(), self.group_size, self.sym, self._scale_dtype(t))
            return
        if self.method == "awq":
            self.plan_folds()
        self._sweep()

    def _scale_dtype(self, t):
        dt = t.module.weight.dtype
        return dt if dt in (torch.float16, torch.bfloat16) else torch.float16

    @torch.no_grad()
    def _sweep(self):
        nodes = [n for n in self.gm.graph.nodes if n in self.needed]
        last = self._last_use(nodes)
        ns = len(self.samples)
        leaves = [pytree.tree_leaves(s) for s in self.samples]
        env: dict[fx.Node, list] = {}
        done_groups = set()
        bar = None
        if self.progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(self.targets), desc=f"fxopt.quantize {self.method}", unit="linear")
            except ImportError:  # pragma: no cover
                pass
        dev = self.device
        # float_target: a second stream through the same graph with the float model's parameters. Every change to
        # a parameter (quantized weights, AWQ folds) goes through touch(), which keeps the original for this stream.
        env_f: dict[fx.Node, list] = {}

        def compute(n, e, float_stream):
            vals = []
            for i in range(ns):
                def get(a):
                    if a in self.const_env:
                        v = self.const_env[a]
                        return self.float_weights.get(id(v), v) if float_stream else v
                    v = e[a][i]
                    if self.offload and isinstance(v, torch.Tensor):
                        v = v.to(dev, non_blocking=True)
                    return v

                args, kwargs = fx.node.map_arg((n.args, n.kwargs), get)
                v = _run_node(n, args, kwargs, self.gm)
                if self.offload and isinstance(v, torch.Tensor):
                    v = v.to("cpu")
                vals.append(v)
            return vals

        try:
            for idx, n in enumerate(nodes):
                if n in self.targets and n.args[0] not in done_groups:
                    x = n.args[0]
                    self._quantize_group(x, env[x], env_f.get(x))
                    done_groups.add(x)
                    if bar is not None:
                        bar.update(len(self.groups[x]))
                if n in self.const_env:
                    pass
                elif n in self.input_index:
                    env[n] = [leaves[i][self.input_index[n]] for i in range(ns)]
                    if self.float_target:
                        env_f[n] = env[n]
                else:
                    env[n] = compute(n, env, False)
                    if self.float_target:
                        env_f[n] = compute(n, env_f, True)
                for a in n.all_input_nodes:
                    if last.get(a) == idx:
                        env.pop(a, None)
                        env_f.pop(a, None)
        finally:
            if bar is not None:
                bar.close()
            env.clear()
            env_f.clear()
            self.float_weights.clear()

    @torch.no_grad()
    def _quantize_group(self, x: fx.Node, xs: list, xs_float: Optional[list] = None):
        members = self.groups[x]
        K = members[0].module.in_features
        dev = self.device
        acc = HessianAccumulator(K, device=dev)
        absmean = torch.zeros(K, dtype=torch.float32, device=dev)
        cross = torch.zeros(K, K, dtype=torch.float32, device=dev) if xs_float is not None else None
        for j, v in enumerate(xs):
            v = v.to(dev)
            acc.add(v)
            absmean += v.reshape(-1, K).abs().float().sum(0)
            if cross is not None:  # Σ x_float x̃ᵀ over tokens
                vf = xs_float[j].to(dev).reshape(-1, K).float()
                cross.addmm_(vf.T, v.reshape(-1, K).float())
        absmean /= max(acc.n, 1)
        H = acc.hessian()  # 2 XᵀX / n
        originals = ({t.name: t.module.weight.detach().float().clone() for t in members}
                     if self.report is not None else {})
        sd = self._scale_dtype(members[0])
        if cross is not None:
            cross = cross * (2.0 / max(acc.n, 1))
        if self.method == "gptq":
            W = torch.cat([t.module.weight.detach() for t in members], dim=0)
            if cross is not None:
                W = _float_target_weight(W, cross, H, self.damp)
            res = gptq_quantize(W, H, self.group_size, self.sym, self.act_order, self.static_groups, self.damp,
                                self.block_size, sd, mse=self.mse)
            self._set_results(members, _split_rows(res, [t.module.out_features for t in members]))
        elif self.method == "rtn":
            self._set_results(members, [rtn_quantize(t.module.weight.detach(), self.group_size, self.sym, sd)
                                        for t in members])
        else:
            self._awq_group(x, xs, members, H, absmean, sd, cross)
        for t in members if self.report is not None else ():  # per-linear errors only when asked
            eff, w0 = t.result.weight.float(), originals[t.name]
            if t.name in self._awq_scales:
                eff = eff / self._awq_scales[t.name].to(eff.device)
            err = output_error(w0, eff, H)
            rtn_err = output_error(w0, rtn_quantize(w0, self.group_size, self.sym, sd).weight, H)
            ref = output_error(w0, torch.zeros_like(eff), H)
            self.report.rows.append({"linear": t.name, "in": K, "out": t.module.out_features,
                                     "rel_err": err / max(ref, 1e-30), "rtn_rel_err": rtn_err / max(ref, 1e-30),
                                     "err_vs_rtn": err / max(rtn_err, 1e-30)})

    def _awq_group(self, x, xs, members, H, absmean, sd, cross=None):
        Hg = H / 2.0  # XᵀX / n
        fold = self.folds[x]
        weights = [t.module.weight.detach().float() for t in members]
        if cross is not None:  # float_target: search scales and clips for the weight that maps x̃ to W x
            V = _float_target_weight(torch.cat(weights), cross, H, self.damp)
            weights = list(V.split([w.shape[0] for w in weights]))
        cmap = fold.channel_map.to(H.device) if fold.kind == "linear" else None
        if fold.kind == "explicit":  # nothing can absorb x / s: no scale (clip search only), so the checkpoint
            s = torch.ones(H.shape[0], dtype=H.dtype, device=H.device)  # stays a plain GPTQ/AWQ layout
        else:
            found = search_scale(weights, Hg, absmean, self.group_size, self.sym, self.n_grid, sd, cmap)
            s = found.scale.to(H.device)
        if fold.kind == "norm":
            fold.norm.apply(s, self.touch)
        elif fold.kind == "linear":
            self._fold_into_linear(fold, found.source_scale.to(H.device))
        for i, v in enumerate(xs):  # the stored input becomes x / s, as the fold makes it
            xs[i] = v / s.to(v.device, v.dtype)
        Hs = Hg / (s[:, None] * s[None, :])
        clipped = []
        for t, W in zip(members, weights):
            Ws = W * s
            if self.clip and not self._feeds_attention_scores(t.node):
                Ws = search_clip(Ws, Hs, self.group_size, self.sym, self.n_grid, self.max_shrink, sd)
            clipped.append(Ws)
        if self.awq_rounding == "gptq":
            # the clip search fixed each group's grid; GPTQ's error feedback rounds on those grids (static groups:
            # no permutation is stored, so the result keeps the AWQ layout)
            res = gptq_quantize(torch.cat(clipped), 2.0 * Hs, self.group_size, self.sym, True, True, self.damp,
                                self.block_size, sd)
            results = _split_rows(res, [t.module.out_features for t in members])
        else:
            results = [rtn_quantize(Ws, self.group_size, self.sym, sd) for Ws in clipped]
        self._set_results(members, results)
        for t in members:
            self._awq_scales[t.name] = s.detach().cpu()

    def _set_results(self, members: list, results: list) -> None:
        for t, r in zip(members, results):
            t.result = r
            self.set_weight(t.module, r.weight)

    def _feeds_attention_scores(self, lin: fx.Node) -> bool:
        """Whether ``lin``'s output reaches attention scores (a softmax, or an SDPA query/key) before any other
        linear: a query or key projection. Clipping those hurts more than the layer-wise error shows, since the
        softmax amplifies their errors (AWQ's reference code skips their clip search for the same reason)."""
        from ..passes.match import op_name

        seen, stack = set(), [lin]
        while stack:
            n = stack.pop()
            for u in n.users:
                name = op_name(u)
                if name == "sdpa":
                    if n in u.args[:2] or n in (u.kwargs.get("query"), u.kwargs.get("key")):
                        return True
                    continue
                if name == "softmax":
                    return True
                if u in seen or _is_linear(u) or u.op == "output":
                    continue
                seen.add(u)
                stack.append(u)
        return False

    @torch.no_grad()
    def _fold_into_linear(self, fold: _Fold, s_src: torch.Tensor):
        mod = fold.producer
        if mod.bias is not None:
            self.touch(mod.bias)
            mod.bias.copy_((mod.bias.float() / s_src.to(mod.bias.device)).to(mod.bias.dtype))
        for t in self.targets.values():
            if t.module is mod and t.result is not None:
                # already quantized: an output-row scale is a change of its per-row scales, codes unchanged
                pk = t.result.packed
                scales = (pk.scales.float() / s_src[None, :].to(pk.scales.device)).to(pk.scales.dtype)
                pk = PackedW4(pk.qweight, scales, pk.zeros, pk.group_size, pk.perm)
                w = dequantize(pk.qweight, pk.scales, pk.zeros, pk.group_size, torch.float32)
                if pk.perm is not None:
                    w = w[:, torch.argsort(pk.perm)]
                t.result = QuantResult(pk, w)
                self.set_weight(mod, w)
                return
        self.touch(mod.weight)
        mod.weight.copy_((mod.weight.float() / s_src[:, None].to(mod.weight.device)).to(mod.weight.dtype))

    @torch.no_grad()
    def install(self, QuantLinear):
        from .linear import _set_submodule

        for t in self.targets.values():
            mod = t.module
            if QuantLinear is None:
                self.set_weight(mod, t.result.weight)
            else:
                new = QuantLinear.from_packed(t.result.packed, None if mod.bias is None else mod.bias.detach())
                _set_submodule(self.model, t.name, new.to(mod.weight.device))
        self.saved.clear()


def _float_target_weight(W: torch.Tensor, C: torch.Tensor, H: torch.Tensor, damp: float) -> torch.Tensor:
    """argmin_V ||W X - V X̃||² + λ||V - W||²  =  (W C + λ W)(H + λ I)^-1, with C = X Xᵀ-cross (Σ x x̃ᵀ) and
    H = Σ x̃ x̃ᵀ on the same scale, λ = damp * mean(diag H). Equal to W when x̃ = x. GPTQ on this weight with H
    minimises the error against the float model's output."""
    lam = damp * float(torch.diagonal(H).mean().clamp_min(1e-12))
    Wf = W.to(H.dtype)
    C = C.to(H.dtype)
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    L = torch.linalg.cholesky(H + lam * eye)
    rhs = (Wf @ C + lam * Wf).T  # (H + λI) Vᵀ = (W C + λ W)ᵀ, H symmetric
    return torch.cholesky_solve(rhs, L).T.to(W.dtype)


def _split_rows(res: QuantResult, rows: list[int]) -> list[QuantResult]:
    """A quantized stack of linears' weights (along N) back into one result per linear of ``rows`` outputs."""
    out, a, p = [], 0, res.packed
    for n in rows:  # N is the fast axis of every packed tensor
        b = a + n
        packed = PackedW4(p.qweight[:, a:b].contiguous(), p.scales[:, a:b].contiguous(), p.zeros[:, a:b].contiguous(),
                          p.group_size, None if p.perm is None else p.perm.clone())
        out.append(QuantResult(packed, res.weight[a:b]))
        a = b
    return out
