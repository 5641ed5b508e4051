"""Pipeline pass: a cost model per node and a balanced split of the graph into pipeline stages.

What it does. The pass prices every node from the shapes in ``meta["val"]`` and cuts the graph into
``PipelineConfig.stages`` stages so that the slowest stage is as fast as possible and, among the splits with that
bottleneck, the fewest bytes cross stage boundaries. It rewrites nothing in the graph it is given: it writes the stage
of every node into ``node.meta["fxopt_pipeline_stage"]`` and the :class:`PipelinePlan` into
``gm.meta["fxopt_pipeline_plan"]`` (and the plan, as text, into ``result.notes``). :func:`fxopt.pipeline` then cuts
the graph into one ``GraphModule`` per stage (:func:`fxopt.parallel.pipeline.build_stage_modules`) and runs them
with PyTorch's pipeline schedules. Run through ``torch.compile(..., options={"pipeline": {...}})`` or
:func:`fxopt.explain`, the pass only reports the plan.

Cost model (:class:`DeviceProfile`, :func:`graph_costs`; checks against measured stages in ``docs/architecture.md``, Parallel).
A stage's time is the sum of its kernels' times, each ``max(device time, op_overhead_s)``: the per-kernel floor is
the host's launch interval (a compiled stage launches Inductor's kernels, cuBLAS and fxopt's custom ops from Python
one by one; when a kernel is shorter than that, the GPU waits). Device time by kind:

* matmul (linear, mm, bmm, conv, einsum, w4a16, ...; FLOPs from ``torch.utils.flop_counter`` on meta tensors):
  ``max(F / peak, B / mem_bw) + matmul_latency_s``. The fixed GEMM latency makes the efficiency depend on the size:
  a GEMM of ``F`` FLOPs reaches ``F / (F + peak · matmul_latency_s)`` of the peak (H200 bf16: 8192³ 99.5%,
  2048×1024×1024 60%, 2048×256×1024 27%); small M or N make it memory-bound through ``B``.
* attention (SDPA, ``fxopt.flash_attention``): ``F' / attention_flops`` with ``F'`` the FLOPs halved when
  ``is_causal``.
* memory-bound nodes (elementwise, reductions, casts, cat, embedding): fused as Inductor fuses them. Nodes connected
  through values (seen through views) that come after the same number of matmul/attention kernels form one kernel
  that moves the bytes it reads from outside and the values used outside (``B / mem_bw``); its time is split over its
  nodes. A gather (embedding) reads the rows it writes, not its whole table.
* views and same-dtype casts cost nothing.

Constants of ``DeviceProfile.h200()`` come from the H200 anchors (``/work/shared/anchors/README.md``: cuBLAS bf16
716 TFLOP/s, copy 4.23 TB/s), fxopt's attention benchmark (~200 TFLOP/s causal at S = 512) and a 30 us per-kernel
floor fitted on compiled graphs timed on that machine (a pipeline stage and the tensor-parallel benchmark's prefill and
decode, all within 5%). :meth:`DeviceProfile.measure` calibrates the GEMM peak (4096³), the GEMM
latency (a 1024³ GEMM replayed from a CUDA graph) and the copy bandwidth on the current device.
:func:`node_cost` prices one node as its own kernel (no fusion). The split uses the costs only relatively; the
absolute numbers are the prediction the benchmark checks.

Partition. The graph becomes a networkx ``DiGraph`` of its values. Parameters and buffers are not values that flow:
each stage owns the ones it uses. Nodes computed from parameters/buffers alone (rotary tables, constant masks, with no
random op) are *replicated* into every stage that uses them rather than sent. Inputs live in stage 0 and the output in
the last stage. A split is valid when no value flows backwards (every edge goes from a stage to the same or a later
one); a value produced in stage ``a`` and used in stage ``b > a`` crosses ``b - a`` boundaries (it is passed through
the stages between, as PyTorch's stages talk only to their neighbours). Only tensors can cross.

* :func:`partition_order` — cuts of one topological order (the program order, which keeps modules contiguous) into
  contiguous segments, by dynamic programming: first the least bottleneck ``T*`` (min over cuts of the max segment
  cost), then the least total boundary bytes among the splits whose every segment costs at most ``T*``. Exact for
  chains and for every split of that order; ``O(stages · n²)`` numpy work.
* :func:`partition_exact` — every valid split of a small DAG (downsets enumerated with ``nx.antichains``), same
  two objectives; used when the graph has few downsets (small graphs, tests) and as the reference in tests.

Pinned split points (``split_points=["layers.2"]``, module names) force a boundary right before the first node of
that module; the rest is balanced around them. Parameters used by several stages (a tied embedding / lm_head, or a
replicated node that reads a parameter) are listed in the plan as *shared*: :func:`fxopt.pipeline` keeps them in sync
by summing their gradients over the ranks that hold them after every backward.

Errors are reported, not raised, here: when the graph cannot be cut into the requested number of stages (too few
valid boundaries, or pins that leave a stage empty), the pass records the reason with ``result.skip`` and leaves no
plan; :func:`fxopt.pipeline` turns that into a :class:`PipelineError`.
"""
from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx

from ..config import PipelineConfig
from . import match
from .manager import PassContext, PassResult, register_pass

log = logging.getLogger(__name__)

STAGE_KEY = "fxopt_pipeline_stage"
PLAN_KEY = "fxopt_pipeline_plan"


class PipelineError(ValueError):
    """A model or setting that the pipeline split cannot handle (the message says which and why)."""


# --------------------------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class DeviceProfile:
    """Throughputs and fixed times the cost model uses (see the module docstring for the formulas).

    Args:
        name: label printed in the plan.
        matmul_flops: dtype → FLOP/s a *large* GEMM reaches (cuBLAS at 8192³ on GPUs; tensor cores).
        vector_flops: FLOP/s of elementwise and reduction ops (rarely the limit: they are bandwidth-bound).
        mem_bw: bytes/s that a memory-bound kernel reaches (read + written).
        op_overhead_s: the least time one kernel takes in a stage, launch included: when kernels are shorter than
            this, the GPU waits for the host (each kernel of a compiled graph is launched from Python, one by one).
        link_bw: bytes/s between neighbouring stages (NVLink for GPUs).
        link_latency_s: fixed time per send.
        matmul_latency_s: device-side fixed time of one GEMM (prologue, epilogue, the last partial wave of tiles):
            a GEMM of ``F`` FLOPs reaches ``F / (F + peak · matmul_latency_s)`` of the peak (see
            :meth:`matmul_efficiency`).
        attention_flops: dtype → FLOP/s of fused attention, on its FLOPs after the causal halving.
    """

    name: str
    matmul_flops: dict
    vector_flops: float
    mem_bw: float
    op_overhead_s: float
    link_bw: float
    link_latency_s: float
    matmul_latency_s: float = 0.0
    attention_flops: dict = field(default_factory=dict)

    def matmul_peak(self, dtype: torch.dtype) -> float:
        return self.matmul_flops.get(dtype, self.matmul_flops.get(torch.float32, self.vector_flops))

    def attention_peak(self, dtype: torch.dtype) -> float:
        if dtype in self.attention_flops:
            return self.attention_flops[dtype]
        return self.attention_flops.get(torch.float32, 0.5 * self.matmul_peak(dtype))

    def matmul_efficiency(self, flops: float, dtype: torch.dtype = torch.bfloat16) -> float:
        """Fraction of :meth:`matmul_peak` a GEMM of ``flops`` FLOPs reaches when compute-bound (1 for huge GEMMs,
        1/2 at ``flops = peak · matmul_latency_s``; 8192³ bf16 on the H200: 0.995, 2048×1024×1024: 0.60)."""
        fixed = self.matmul_peak(dtype) * self.matmul_latency_s
        return flops / (flops + fixed) if flops + fixed > 0 else 1.0

    def matmul_seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """Device time of one GEMM: roofline on the large-GEMM peak plus the fixed GEMM latency."""
        return max(flops / self.matmul_peak(dtype), nbytes / self.mem_bw) + self.matmul_latency_s

    @classmethod
    def h200(cls) -> "DeviceProfile":
        # Anchors measured on our H200 (/work/shared/anchors/README.md, torch 2.11, Triton 3.6): cuBLAS bf16 GEMM
        # 8192³ 716 TFLOP/s, fp8 1327; device copy 4.23 TB/s (fused elementwise kernels reach ~85% of it); fxopt's
        # flash attention at S = 512, d = 128: 194 TFLOP/s causal (halved FLOPs), 312 non-causal
        # (benchmarks/results/attention.md). fp32 (no TF32) runs on CUDA cores: 67 TFLOP/s dense, ~50 reached.
        # Fixed times: 4 us per GEMM on the device (prologue, epilogue, partial last wave: an estimate typical of
        # cuBLAS on Hopper, which measure() replaces by a measured 1024³ GEMM), and a 30 us floor per kernel, fitted
        # to compiled graphs timed on this machine (Inductor's wrapper, cuBLAS and fxopt's
        # custom ops launched from Python one after the other, without CUDA graphs).
        return cls("H200", {torch.bfloat16: 716e12, torch.float16: 716e12, torch.float8_e4m3fn: 1327e12,
                            torch.float32: 50e12, torch.float64: 50e12},
                   vector_flops=50e12, mem_bw=3.6e12, op_overhead_s=30e-6, link_bw=300e9, link_latency_s=15e-6,
                   matmul_latency_s=4e-6,
                   attention_flops={torch.bfloat16: 200e12, torch.float16: 200e12, torch.float32: 25e12})

    @classmethod
    def cpu(cls) -> "DeviceProfile":
        return cls("CPU", {torch.float32: 50e9, torch.float64: 25e9, torch.bfloat16: 20e9, torch.float16: 10e9},
                   vector_flops=5e9, mem_bw=10e9, op_overhead_s=5e-6, link_bw=5e9, link_latency_s=50e-6,
                   matmul_latency_s=2e-6,
                   attention_flops={torch.float32: 25e9, torch.float64: 12e9, torch.bfloat16: 10e9,
                                    torch.float16: 5e9})

    @classmethod
    def for_device(cls, device: Any = None) -> "DeviceProfile":
        """The preset for ``device`` (CUDA → H200 numbers, named after the actual GPU; otherwise CPU)."""
        device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        if device.type == "cuda":
            prof = cls.h200()
            if torch.cuda.is_available():
                prof.name = torch.cuda.get_device_name(device)
            return prof
        return cls.cpu()

    @classmethod
    def measure(cls, device: Any = None, dtype: torch.dtype = torch.bfloat16) -> "DeviceProfile":
        """Calibrate the preset for ``device``, measured: the large-GEMM peak (4096³ on GPU), the fixed GEMM
        latency (from a 1024³ GEMM: its time minus its FLOPs at that peak) and the copy bandwidth. The attention
        throughput is scaled by the same factor as the GEMM peak; the per-kernel floor stays the preset's (it is a
        property of the host and of how the stage is launched, not of one kernel timed in a loop)."""
        import time

        prof = cls.for_device(device)
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        n = 4096 if dev.type == "cuda" else 512
        n_small = 1024 if dev.type == "cuda" else 128
        dt = dtype if dev.type == "cuda" else torch.float32
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        a_s, b_s = a[:n_small, :n_small].contiguous(), b[:n_small, :n_small].contiguous()
        x = torch.randn(64 * 2**20 // 4 if dev.type == "cuda" else 2**22, device=dev)

        def timed(fn, reps):
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = float("inf")
            for _ in range(3):  # best of three batches: the GPU's clocks ramp up during the first
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                best = min(best, (time.perf_counter() - t0) / reps)
            return best

        t_mm = timed(lambda: a @ b, 20)
        t_small = _device_seconds(lambda: a_s @ b_s, dev, timed)
        t_cp = timed(lambda: x.clone(), 20)
        old_peak = prof.matmul_peak(dt)
        peak = 2 * n**3 / t_mm
        prof.matmul_flops = dict(prof.matmul_flops)
        prof.matmul_flops[dt] = peak
        prof.matmul_latency_s = max(0.0, t_small - 2 * n_small**3 / peak)
        prof.attention_flops = {k: v * peak / old_peak for k, v in prof.attention_flops.items()}
        prof.mem_bw = 2 * x.numel() * x.element_size() / t_cp
        prof.name += " (measured)"
        return prof


def _device_seconds(fn, dev: torch.device, timed, reps: int = 50) -> float:
    """Device time of one ``fn()``: on CUDA, ``reps`` calls replayed from one CUDA graph (no host launch in the
    figure: a 1024³ GEMM is shorter than its launch from Python); elsewhere (or if capture fails) a timed loop."""
    if dev.type == "cuda":
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
            return timed(graph.replay, 5) / reps
        except Exception as e:  # capture unsupported here: the loop includes the launches (an upper bound)
            log.info("CUDA graph timing failed (%s); timing a loop", e)
    return timed(fn, 200)


# Ops whose output aliases an input: no FLOPs, no bytes.
_VIEW_OPS = {"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "getitem", "t", "detach",
             "flatten", "unflatten", "chunk", "split", "narrow", "select", "size", "dim", "view_as", "expand_as",
             "unbind", "as_strided", "movedim", "swapaxes", "unfold", "real", "imag"}
# Casts: free when the dtype does not change.
_CAST_OPS = {"to", "float", "half", "bfloat16", "type_as", "type", "contiguous", "double", "int", "long", "bool"}
_MATMUL_HINT = ("mm", "matmul", "linear", "bmm", "conv", "einsum", "w4a16", "baddbmm", "addmm")
_ATTENTION_HINT = ("sdpa", "scaled_dot_product", "flash_attention", "attention")
# Ops that read a few rows of their table input (bytes: as many as they write, not the whole table).
_GATHER_OPS = {"embedding", "index_select", "gather", "take", "take_along_dim"}
_RANDOM_OPS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "dropout",
               "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
               "bernoulli", "bernoulli_", "normal", "normal_", "multinomial", "uniform_", "poisson", "exponential_",
               "geometric_", "cauchy_", "log_normal_", "random_"}


@dataclass
class NodeCost:
    """``kind``: "free" (views, same-dtype casts), "matmul", "attention" or "memory" (elementwise, reductions,
    copies: what Inductor fuses); ``kernel_seconds``: the device time of the node as its own kernel."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    kind: str = "free"
    kernel_seconds: float = 0.0


def _tensors(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # symbolic sizes
        return 0


def value_bytes(node: fx.Node) -> int:
    return sum(_nbytes(t) for t in _tensors(match.val(node)))


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v) if not hasattr(v, "_fields") else type(v)(*[_to_meta(x) for x in v])
    return v


def _counted_flops(node: fx.Node) -> Optional[float]:
    """FLOPs of ``node`` by torch's flop counter on meta tensors shaped like its inputs (None if it cannot run)."""
    from torch.utils.flop_counter import FlopCounterMode

    if node.op not in ("call_function", "call_method"):
        return None
    try:
        args = fx.node.map_arg(node.args, lambda a: _to_meta(match.val(a)))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: _to_meta(match.val(a)))
        with FlopCounterMode(display=False) as fc:
            if node.op == "call_function":
                node.target(*args, **kwargs)
            else:
                getattr(args[0], node.target)(*args[1:], **kwargs)
        return float(fc.get_total_flops())
    except Exception:
        return None


def _custom_op_flops(node: fx.Node) -> Optional[float]:
    """FLOPs of fxopt's own ops (the flop counter does not know them)."""
    name = str(node.target)
    ins = [match.tensor_val(a) for a in node.args]
    if "flash_attention" in name and all(t is not None for t in ins[:3]):
        q, k = ins[0], ins[1]
        return 4.0 * q.numel() * k.shape[-2]
    if "w4a16_linear" in name and ins and ins[0] is not None:
        out = match.tensor_val(node)
        return 2.0 * out.numel() * ins[0].shape[-1] if out is not None else None
    return None


def _node_name(node: fx.Node) -> str:
    name = match.op_name(node) or (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", ""))
    return str(name)


def _is_causal(node: fx.Node) -> bool:
    """``is_causal=True`` on an SDPA / fxopt attention call (positional argument 5 in both signatures)."""
    v = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    return v is True


def _is_free(node: fx.Node, name: str) -> bool:
    if name in _VIEW_OPS:
        return True
    if name in _CAST_OPS:
        outs = _tensors(match.val(node))
        ins = [t for a in node.all_input_nodes for t in _tensors(match.val(a))]
        return bool(outs and ins and outs[0].dtype == ins[0].dtype and (name != "contiguous" or ins[0].is_contiguous()))
    return False


def _input_bytes(node: fx.Node, src: fx.Node, name: str, out_bytes: float) -> float:
    b = float(sum(_nbytes(t) for t in _tensors(match.val(src))))
    if name in _GATHER_OPS and b > out_bytes:  # the table: only the rows looked up are read
        return out_bytes
    return b


def node_cost(node: fx.Node, profile: DeviceProfile) -> NodeCost:
    """FLOPs, bytes (inputs read + outputs written) and seconds of ``node`` run as its own kernel:
    matmul ``max(F / peak, B / bw) + matmul_latency``, attention ``F' / attention_peak`` (``F'``: FLOPs halved when
    causal), the rest ``max(F / vector_flops, B / bw)``; every kernel takes at least ``op_overhead_s``.
    :func:`graph_costs` prices a whole graph with Inductor's fusion of the memory-bound nodes."""
    if node.op in ("placeholder", "get_attr", "output"):
        return NodeCost()
    name = _node_name(node)
    if _is_free(node, name):
        return NodeCost()
    outs = _tensors(match.val(node))
    out_bytes = float(sum(_nbytes(t) for t in outs))
    nbytes = out_bytes + sum(_input_bytes(node, a, name, out_bytes) for a in node.all_input_nodes)
    ins = [t for a in node.all_input_nodes for t in _tensors(match.val(a))]
    dtype = (ins or outs)[0].dtype if (ins or outs) else torch.float32
    flops = _custom_op_flops(node) if node.op == "call_function" and isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else None
    if flops is None:
        flops = _counted_flops(node) or 0.0
    low = name.lower()
    if any(h in low for h in _ATTENTION_HINT):
        kind = "attention"
        eff_flops = flops * (0.5 if _is_causal(node) else 1.0)
        dev = max(eff_flops / profile.attention_peak(dtype), nbytes / profile.mem_bw)
    elif flops > 0 or any(h in low for h in _MATMUL_HINT):
        kind = "matmul"
        dev = profile.matmul_seconds(flops, nbytes, dtype)
    else:
        kind = "memory"
        flops = float(sum(t.numel() for t in outs))
        dev = max(flops / profile.vector_flops, nbytes / profile.mem_bw)
    return NodeCost(flops, nbytes, max(dev, profile.op_overhead_s), kind, dev)


def graph_costs(nodes: Sequence[fx.Node], profile: DeviceProfile) -> dict:
    """:class:`NodeCost` of every compute node of a graph, with the memory-bound nodes fused as Inductor does.

    Matmul and attention nodes are kernels of their own (:func:`node_cost`). Memory-bound nodes are grouped into
    fused kernels: two of them (seen through views) share a kernel when one reads the other and both come after the
    same number of matmul/attention kernels on their longest input path (a matmul in between forces two kernels).
    A fused kernel moves only the bytes it reads from outside the group and the values used outside it; its time,
    ``max(B / bw, op_overhead_s)``, is split evenly over its nodes, so that stage costs stay sums over nodes."""
    nodes = list(nodes)
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    single = {n: node_cost(n, profile) for n in compute}
    names = {n: _node_name(n) for n in compute}
    base: dict = {}  # view / free node → the node whose storage it shows (itself for real values)

    def root(n):
        return base.get(n, n)

    level: dict = {}
    for n in nodes:
        ins = [a for a in n.all_input_nodes]
        lv = 0
        for a in ins:
            la = level.get(a, 0)
            if a in single and single[a].kind in ("matmul", "attention"):
                la += 1
            lv = max(lv, la)
        level[n] = lv
        if n in single and single[n].kind == "free" and ins:
            base[n] = root(ins[0])
    parent: dict = {n: n for n in compute if single[n].kind == "memory"}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in parent:
        for a in n.all_input_nodes:
            r = root(a)
            if r in parent and level[r] == level[n]:
                ra, rb = find(r), find(n)
                if ra is not rb:
                    parent[rb] = ra
    groups: dict = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)

    out = dict(single)
    for members in groups.values():
        mset = set(members)
        read, written = set(), set()
        flops = 0.0
        for n in members:
            flops += single[n].flops
            for a in n.all_input_nodes:
                if root(a) not in mset:
                    read.add(a)
            if any(_escapes(u, mset, root) for u in n.users):
                written.add(n)
        out_b = float(sum(value_bytes(n) for n in written))
        nbytes = out_b
        for a in read:
            users = [u for u in a.users if u in mset]
            gather = users and all(names[u] in _GATHER_OPS for u in users)
            nbytes += _input_bytes(users[0] if users else a, a, names[users[0]] if gather else "", out_b)
        dev = max(flops / profile.vector_flops, nbytes / profile.mem_bw)
        t = max(dev, profile.op_overhead_s)
        for n in members:
            out[n] = NodeCost(single[n].flops, nbytes / len(members), t / len(members), "memory", dev / len(members))
    return out


def _escapes(user: fx.Node, group: set, root) -> bool:
    """Whether ``user`` (directly or through views) reads the value outside ``group``."""
    if user.op == "output":
        return True
    if root(user) is not user:  # a view: look at its users
        return any(_escapes(u, group, root) for u in user.users)
    return user not in group


def send_seconds(nbytes: float, profile: DeviceProfile) -> float:
    return 0.0 if nbytes == 0 else profile.link_latency_s + nbytes / profile.link_bw


# --------------------------------------------------------------------------------------------------------------------
# Partition on an abstract DAG: nodes carry "cost" (seconds), "bytes" (size of the value) and "sendable"
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Partition:
    """A split: ``stage`` maps node → stage; per-stage cost; bytes crossing each boundary (``stages - 1`` entries)."""

    stage: dict
    stage_costs: list
    boundary_bytes: list

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.boundary_bytes))


def evaluate(dag, stage: dict, stages: int) -> Optional[Partition]:
    """Costs of an assignment, or None when it is invalid (an edge going backwards, an empty stage, a non-tensor
    value crossing a boundary). Nodes with ``pinned_stage`` must sit in that stage."""
    costs = [0.0] * stages
    used = [False] * stages
    crossing = [0.0] * max(stages - 1, 0)
    for n, data in dag.nodes(data=True):
        s = stage[n]
        pin = data.get("pinned_stage")
        if pin is not None and (pin if pin >= 0 else stages - 1) != s:
            return None
        costs[s] += data.get("cost", 0.0)
        used[s] = used[s] or data.get("counts", True)
        last = s
        for u in dag.successors(n):
            if stage[u] < s:
                return None
            last = max(last, stage[u])
        if last > s and not data.get("sendable", True):
            return None
        for b in range(s, last):
            crossing[b] += data.get("bytes", 0.0)
    if not all(used):
        return None
    return Partition(dict(stage), costs, crossing)


def _better(a: tuple, b: Optional[tuple], rel: float = 1e-9) -> bool:
    """Lexicographic (bottleneck, bytes) comparison, with a relative tolerance on the float bottleneck."""
    if b is None:
        return True
    if a[0] < b[0] * (1 - rel) - 1e-30:
        return True
    if a[0] > b[0] * (1 + rel) + 1e-30:
        return False
    return a[1] < b[1]


def partition_order(dag, order: Sequence, stages: int, cut_before: Sequence = (), slack: float = 0.0) -> Partition:
    """Best split of ``order`` (a topological order of ``dag``) into ``stages`` contiguous segments.

    Objectives: least bottleneck ``T*`` (max segment cost), then least total boundary bytes among the splits whose
    segments all cost at most ``T* * (1 + slack)`` (then the least bottleneck among those). ``cut_before``: nodes that
    must start a segment (pinned split points). Nodes of the dag not in ``order`` must carry ``pinned_stage`` 0 or -1
    (graph inputs and the output; -1 means the last stage). Raises :class:`PipelineError` when no valid split exists.
    """
    n = len(order)
    pos = {v: i for i, v in enumerate(order)}
    if stages < 1:
        raise PipelineError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise PipelineError(f"the graph has {n} compute node(s): it cannot be cut into {stages} stages")

    def where(v):
        if v in pos:
            return pos[v]
        return -1 if dag.nodes[v].get("pinned_stage", 0) == 0 else n  # inputs before position 0, output after n-1

    cost = np.array([dag.nodes[v].get("cost", 0.0) for v in order], dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    live = np.zeros(n + 1)  # live[i]: bytes crossing a cut just before order[i]
    bad = np.zeros(n + 1, dtype=bool)  # a non-sendable value would cross
    for v, data in dag.nodes(data=True):
        d = where(v)
        last = max([where(u) for u in dag.successors(v)], default=d)
        if last > d:
            lo, hi = d + 1, min(last, n)  # cuts at positions d+1 .. last
            live[max(lo, 0):hi + 1] += data.get("bytes", 0.0)
            if not data.get("sendable", True):
                bad[max(lo, 0):hi + 1] = True
        for u in dag.successors(v):
            if where(u) < d:
                raise PipelineError(f"order is not topological: {v!r} comes after its user {u!r}")
    valid = ~bad
    valid[0] = valid[n] = True
    pins = sorted({pos[v] for v in cut_before if v in pos and pos[v] > 0})
    if len(pins) > stages - 1:
        raise PipelineError(f"{len(pins)} pinned split point(s) need at least {len(pins) + 1} stages, got {stages}")
    for p in pins:
        if not valid[p]:
            raise PipelineError(f"pinned split before {order[p]!r} is invalid: a non-tensor value crosses it")
    last_pin = np.zeros(n + 1, dtype=np.int64)  # last_pin[j]: largest pinned position < j (0 if none)
    for p in pins:
        last_pin[p + 1:] = p
    pin_mask = np.zeros(n + 1, dtype=bool)
    pin_mask[pins] = True
    idx = np.arange(n + 1)
    INF = np.inf

    def allowed_starts(j):  # positions i where a segment [i, j) may start
        ok = valid.copy()
        ok &= idx < j
        ok &= idx >= last_pin[j]
        return ok

    # Step 1: least bottleneck.
    best = np.full((stages + 1, n + 1), INF)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        for j in range(1, n + 1):
            if not valid[j] or (k < stages and j == n):
                continue
            ok = allowed_starts(j)
            cand = np.where(ok, np.maximum(best[k - 1], prefix[j] - prefix), INF)
            best[k, j] = cand.min()
    t_star = best[stages, n]
    if not np.isfinite(t_star):
        raise PipelineError(
            f"the graph cannot be cut into {stages} stages: only {int(valid[1:n].sum())} valid boundaries"
            + (f" with the pinned split points at positions {pins}" if pins else "")
            + " (a boundary is valid where only tensors cross it)")
    limit = t_star * (1 + max(slack, 0.0) + 1e-9) + 1e-30
    # Step 2: least bytes among splits with every segment <= limit; ties broken by the lower bottleneck
    # (lexicographic (bytes, bottleneck) is exact for this DP: of two prefixes with equal bytes, the one with the
    # lower max is never worse).
    comm = np.full((stages + 1, n + 1), INF)
    peak = np.full((stages + 1, n + 1), INF)
    comm[0, 0] = peak[0, 0] = 0.0
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for k in range(1, stages + 1):
        for j in range(1, n + 1):
            if not valid[j] or (k < stages and j == n):
                continue
            seg = prefix[j] - prefix
            ok = allowed_starts(j) & (seg <= limit) & np.isfinite(comm[k - 1])
            if not ok.any():
                continue
            c = np.where(ok, comm[k - 1] + np.where(idx > 0, live, 0.0), INF)
            cmin = c.min()
            tie = ok & (c <= cmin + 1e-9 * max(cmin, 1.0))
            m = np.where(tie, np.maximum(peak[k - 1], seg), INF)
            i = int(m.argmin())
            comm[k, j], peak[k, j], arg[k, j] = c[i], m[i], i
    cuts = []
    j = n
    for k in range(stages, 0, -1):
        i = int(arg[k, j])
        cuts.append(i)
        j = i
    cuts = sorted(cuts)[1:]  # drop position 0
    assert all(p in cuts for p in pins)
    stage = {}
    for i, v in enumerate(order):
        stage[v] = int(np.searchsorted(cuts, i, side="right"))
    for v, data in dag.nodes(data=True):
        if v not in pos:
            stage[v] = 0 if data.get("pinned_stage", 0) == 0 else stages - 1
    part = evaluate(dag, stage, stages)
    if part is None:  # cannot happen for a topological order; kept as a guard against a wrong graph
        raise PipelineError("internal error: the split of a topological order is invalid")
    return part


def partition_exact(dag, stages: int, max_downsets: int = 4096, slack: float = 0.0) -> Partition:
    """Optimal split of a small DAG over all valid splits (chains of downsets), same objectives as
    :func:`partition_order`. Raises :class:`PipelineError` when the DAG has more than ``max_downsets`` downsets or
    no valid split exists."""
    import networkx as nx

    free = [v for v, d in dag.nodes(data=True) if d.get("pinned_stage") is None]
    sub = dag.subgraph(free)
    bit = {v: 1 << i for i, v in enumerate(free)}
    anc = {v: 0 for v in free}
    for v in nx.topological_sort(sub):
        for p in sub.predecessors(v):
            anc[v] |= anc[p] | bit[p]
    downs = set()
    for a in nx.antichains(sub):
        m = 0
        for v in a:
            m |= bit[v] | anc[v]
        downs.add(m)
        if len(downs) > max_downsets:
            raise PipelineError(f"more than {max_downsets} downsets: use partition_order")
    downs = sorted(downs, key=lambda m: bin(m).count("1"))
    cost = {m: sum(dag.nodes[v].get("cost", 0.0) for v in free if m & bit[v]) for m in downs}

    def assignment(chain):
        st = {}
        for v in free:
            st[v] = next(k for k, m in enumerate(chain) if m & bit[v])
        for v, d in dag.nodes(data=True):
            if d.get("pinned_stage") is not None:
                st[v] = d["pinned_stage"] if d["pinned_stage"] >= 0 else stages - 1
        return st

    full = downs[-1]
    found: list = []

    def rec(prev, chain):
        if len(chain) == stages - 1:
            if full != prev:
                part = evaluate(dag, assignment(chain + [full]), stages)
                if part is not None:
                    found.append(part)
            return
        for m in downs:
            if m != prev and (m & prev) == prev and m != full:
                rec(m, chain + [m])

    rec(0, [])
    if not found:
        raise PipelineError(f"the graph cannot be cut into {stages} stages")
    t_star = min(p.bottleneck for p in found)
    limit = t_star * (1 + max(slack, 0.0) + 1e-9) + 1e-30
    ok = [p for p in found if p.bottleneck <= limit]
    b_min = min(p.total_bytes for p in ok)
    ok = [p for p in ok if p.total_bytes <= b_min + 1e-9 * max(b_min, 1.0)]
    return min(ok, key=lambda p: p.bottleneck)


# --------------------------------------------------------------------------------------------------------------------
# From an FX graph to a plan
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    index: int
    nodes: list  # node names, in graph order (including replicated ones)
    seconds: float
    flops: float
    bytes: float
    params: list  # qualified names of the parameters/buffers it owns
    modules: tuple  # (first, last) module names it covers
    replicated: list = field(default_factory=list)


@dataclass
class BoundaryPlan:
    index: int  # between stage index and index + 1
    values: list  # (node name, shape, dtype)
    bytes: int
    seconds: float


@dataclass
class PipelinePlan:
    """The split :func:`fxopt.pipeline` runs: printable (``print(plan)``)."""

    stages: list
    boundaries: list
    shared: dict  # qualified param name → stages that use it
    profile: str
    pinned: list
    method: str

    @property
    def stage_seconds(self) -> list:
        return [s.seconds for s in self.stages]

    @property
    def balance(self) -> float:
        """Slowest stage over the mean stage (1.0 is perfect balance)."""
        t = self.stage_seconds
        return max(t) / (sum(t) / len(t)) if sum(t) > 0 else 1.0

    def predicted_bubble(self, microbatches: int) -> float:
        p = len(self.stages)
        return (p - 1) / (microbatches + p - 1)

    def lines(self) -> list:
        out = [f"pipeline plan: {len(self.stages)} stages ({self.method}, cost model {self.profile}); "
               f"predicted balance {self.balance:.3f} (slowest / mean stage)"]
        if self.pinned:
            out.append(f"  pinned split points: {', '.join(self.pinned)}")
        for s in self.stages:
            mods = f"{s.modules[0]} .. {s.modules[1]}" if s.modules[0] else "-"
            out.append(f"  stage {s.index}: {s.seconds * 1e6:10.1f} us fwd  {s.flops / 1e9:9.3g} GFLOP  "
                       f"{len(s.nodes):4d} nodes  {len(s.params):3d} params  [{mods}]")
        for b in self.boundaries:
            vals = ", ".join(f"{n}{list(shape)}:{str(dt).replace('torch.', '')}" for n, shape, dt in b.values)
            out.append(f"  boundary {b.index}->{b.index + 1}: {b.bytes} bytes ({b.seconds * 1e6:.1f} us): {vals}")
        for name, st in self.shared.items():
            out.append(f"  shared parameter {name}: used by stages {st} (gradients summed across them)")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def module_name_of(node: fx.Node) -> str:
    """The innermost module ``node`` was traced in, as a qualified name (``layers.2.attn``); '' at top level."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else str(path)
    return normalize_module_name(path)


def normalize_module_name(path: str) -> str:
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"^self\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\._modules\.", ".", path)
    return path.strip(".")


_STATE_NAME = re.compile(r"^[lL]_self_.*(_parameters_|_buffers_)")


def state_placeholders(gm: fx.GraphModule, ctx: Optional[PassContext]) -> dict:
    """placeholder name → qualified parameter/buffer name (from ``ctx.extras['pipeline_state']`` when the entry point
    gave it, else recognised from Dynamo's placeholder names and the example inputs)."""
    given = (ctx.extras.get("pipeline_state") if ctx is not None else None)
    if given is not None:
        return dict(given)
    out = {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ex = list(ctx.example_inputs) if ctx is not None else []
    for i, n in enumerate(phs):
        is_param = i < len(ex) and isinstance(ex[i], torch.nn.Parameter)
        if is_param or _STATE_NAME.match(n.name):
            name = re.sub(r"^[lL]_self_", "", n.name).rstrip("_")
            name = name.replace("_modules_", ".").replace("_parameters_", ".").replace("_buffers_", ".")
            out[n.name] = name.replace("modules_", "", 1) if name.startswith("modules_") else name
    return out


def _is_random(node: fx.Node) -> bool:
    names = {str(match.op_name(node)), str(getattr(node.target, "__name__", node.target))}
    if isinstance(node.target, torch._ops.OpOverload):
        names.add(node.target._schema.name.split("::")[-1])
    return bool(names & _RANDOM_OPS)


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem}


def _is_inplace(node: fx.Node) -> bool:
    if node.target in _INPLACE_OPERATORS:
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_, operator.or_ ... are not in-place
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _sendable(node: fx.Node) -> bool:
    v = match.val(node)
    return isinstance(v, torch.Tensor)


def build_plan(gm: fx.GraphModule, stages: int, *, state: dict, profile: DeviceProfile,
               split_points: Sequence[str] = (), exact_limit: int = 0, slack: float = 0.05,
               trainable: Optional[set] = None) -> PipelinePlan:
    """Price ``gm``'s nodes, split it into ``stages`` stages, annotate ``node.meta[STAGE_KEY]`` and return the plan.

    ``state``: placeholder name → qualified name of the parameters/buffers (owned by stages, never sent).
    ``exact_limit``: use :func:`partition_exact` when the graph has at most this many compute nodes.
    ``trainable``: qualified names of the parameters that get gradients (default: recognised from the graph).
    ``slack``: a stage may be up to ``slack`` slower than the best bottleneck if that sends fewer bytes.
    """
    import networkx as nx

    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    is_state = {n: (n.op == "get_attr" or (n.op == "placeholder" and n.name in state)) for n in nodes}
    # Nodes computed from parameters/buffers alone (and no random / in-place op) are replicated, not sent.
    replicated = set()
    for n in nodes:
        if n.op in ("call_function", "call_method", "call_module") and not _is_random(n) and not _is_inplace(n):
            if all(is_state[a] or a in replicated for a in n.all_input_nodes):
                replicated.add(n)
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module") and n not in replicated]
    inputs = [n for n in nodes if n.op == "placeholder" and not is_state[n]]
    costs = graph_costs(nodes, profile)

    dag = nx.DiGraph()
    for n in inputs:
        dag.add_node(n.name, cost=0.0, bytes=value_bytes(n), sendable=_sendable(n), pinned_stage=0, counts=False)
    for n in compute:
        dag.add_node(n.name, cost=costs[n].seconds, bytes=value_bytes(n), sendable=_sendable(n))
    dag.add_node("__output__", cost=0.0, bytes=0, pinned_stage=-1, counts=False)
    for n in inputs + compute:
        for u in n.users:
            if u.op == "output":
                dag.add_edge(n.name, "__output__")
            elif u.name in dag:
                dag.add_edge(n.name, u.name)
    if not nx.is_directed_acyclic_graph(dag):
        raise PipelineError("the graph's dependencies have a cycle")

    # Pinned split points: the first compute node traced inside each named module starts a stage.
    order = [n.name for n in compute]
    pinned_nodes, pins = [], []
    mods = {n.name: module_name_of(n) for n in compute}
    for sp in split_points:
        sp_norm = normalize_module_name(str(sp))
        first = next((v for v in order if mods[v] == sp_norm or mods[v].startswith(sp_norm + ".")), None)
        if first is None:
            known = sorted({m.split(".")[0] + ("." + m.split(".")[1] if m.count(".") >= 1 and m.split(".")[1].isdigit()
                                                 else "") for m in mods.values() if m})
            raise PipelineError(f"split point {sp!r} matches no module in the graph; modules seen: {', '.join(known)}")
        if first == order[0]:
            raise PipelineError(f"split point {sp!r} is the start of the graph: stage 0 would be empty")
        pinned_nodes.append(first)
        pins.append(str(sp))

    use_exact = len(compute) <= exact_limit and not pinned_nodes
    method = "order-DP"
    part = None
    if use_exact:
        try:
            part = partition_exact(dag, stages, slack=slack)
            method = "exact"
        except PipelineError:
            part = None
    if part is None:
        part = partition_order(dag, order, stages, cut_before=pinned_nodes, slack=slack)

    by_name = {n.name: n for n in nodes}
    stage_of = {by_name[v]: s for v, s in part.stage.items() if v in by_name}
    # Replicated nodes: every stage that uses them (directly or through other replicated nodes).
    rep_stages: dict = {}
    for n in reversed(nodes):
        if n in replicated:
            st = set()
            for u in n.users:
                if u.op == "output":
                    st.add(stages - 1)
                elif u in replicated:
                    st |= rep_stages.get(u, set())
                elif u in stage_of:
                    st.add(stage_of[u])
            rep_stages[n] = st
    # Parameters/buffers: the stages whose nodes read them.
    state_stages: dict = {}
    for n in nodes:
        if is_state[n]:
            st = set()
            for u in n.users:
                if u in replicated:
                    st |= rep_stages.get(u, set())
                elif u in stage_of:
                    st.add(stage_of[u])
                elif u.op == "output":
                    st.add(stages - 1)
            state_stages[n] = st

    for n in nodes:
        n.meta.pop(STAGE_KEY, None)
        if n in stage_of:
            n.meta[STAGE_KEY] = stage_of[n]
        elif n in replicated:
            n.meta[STAGE_KEY] = sorted(rep_stages[n])
        elif is_state[n]:
            n.meta[STAGE_KEY] = sorted(state_stages[n])

    def qual(n):
        return state.get(n.name, n.target if n.op == "get_attr" else n.name)

    stage_plans = []
    for s in range(stages):
        own = [n for n in compute if stage_of.get(n) == s]
        rep = [n for n in nodes if n in replicated and s in rep_stages.get(n, ())]
        members = [n for n in nodes if n in own or n in rep]
        ms = [mods.get(n.name, "") for n in own if mods.get(n.name)]
        stage_plans.append(StagePlan(
            index=s, nodes=[n.name for n in members],
            seconds=sum(costs[n].seconds for n in members), flops=sum(costs[n].flops for n in members),
            bytes=sum(costs[n].bytes for n in members),
            params=sorted(qual(n) for n in nodes if is_state[n] and s in state_stages.get(n, ())),
            modules=(ms[0], ms[-1]) if ms else ("", ""), replicated=[n.name for n in rep]))
    boundaries = []
    for b in range(stages - 1):
        vals = []
        for v, s in part.stage.items():
            if v == "__output__" or s > b:
                continue
            last = max((part.stage[u] for u in dag.successors(v)), default=s)
            if last > b:
                t = match.tensor_val(by_name[v])
                vals.append((v, tuple(t.shape) if t is not None else (), t.dtype if t is not None else None))
        nbytes = int(part.boundary_bytes[b])
        boundaries.append(BoundaryPlan(b, vals, nbytes, send_seconds(nbytes, profile)))
    # A parameter may reach the graph through several placeholders (tied weights read through two module paths):
    # group by qualified name.
    by_qual: dict = {}
    for n, st in state_stages.items():
        v = match.val(n)
        is_param = (qual(n) in trainable) if trainable is not None else (
            isinstance(v, torch.Tensor) and (v.requires_grad or "_parameters_" in n.name))
        if is_param:
            by_qual.setdefault(qual(n), set()).update(st)
    shared = {q: sorted(st) for q, st in by_qual.items() if len(st) > 1}
    return PipelinePlan(stage_plans, boundaries, shared, profile.name, pins, method)


@register_pass("pipeline")
def pipeline_pass(gm: fx.GraphModule, cfg: PipelineConfig, ctx: PassContext) -> PassResult:
    """Plan the pipeline split of ``gm`` (annotates nodes, stores the plan in ``gm.meta``; rewrites nothing)."""
    result = PassResult("pipeline")
    gm.meta.pop(PLAN_KEY, None)
    if cfg.stages <= 1:
        result.skip("graph", f"stages={cfg.stages}: nothing to split")
        return result
    known = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    if cfg.schedule not in known:
        result.skip("graph", f"unknown schedule {cfg.schedule!r} ({', '.join(known)})")
        return result
    profile = ctx.extras.get("pipeline_profile") or DeviceProfile.for_device(_graph_device(gm))
    try:
        plan = build_plan(gm, cfg.stages, state=state_placeholders(gm, ctx), profile=profile,
                          split_points=cfg.split_points, exact_limit=int(ctx.extras.get("pipeline_exact_limit", 0)),
                          slack=float(ctx.extras.get("pipeline_slack", 0.05)),
                          trainable=ctx.extras.get("pipeline_trainable"))
    except PipelineError as e:
        result.skip("graph", str(e))
        return result
    gm.meta[PLAN_KEY] = plan
    result.notes.extend(plan.lines())
    return result


def _graph_device(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        t = match.tensor_val(n)
        if t is not None and t.device.type != "meta":
            return t.device
    return None


__all__ = ["DeviceProfile", "NodeCost", "node_cost", "graph_costs", "Partition", "partition_order", "partition_exact",
           "evaluate",
           "PipelinePlan", "StagePlan", "BoundaryPlan", "PipelineError", "build_plan", "pipeline_pass", "STAGE_KEY",
           "PLAN_KEY"]
