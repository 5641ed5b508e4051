"""Pipeline pass: a cost model per node and a balanced split of the graph into pipeline stages.

The pass prices every node from the shapes in ``meta["val"]`` (:class:`DeviceProfile`, :func:`graph_costs`; the
formulas and their checks against measured stages are in docs/architecture.md, "Pipeline parallel") and cuts the
graph into ``PipelineConfig.stages`` stages: least bottleneck stage first, then the fewest bytes across boundaries.
It rewrites nothing: each node's stage goes to ``node.meta[STAGE_KEY]``, the :class:`PipelinePlan` to
``gm.meta[PLAN_KEY]`` and, as text, to ``result.notes``. :func:`fxopt.pipeline` then cuts the graph into one module
per stage (:func:`fxopt.parallel.pipeline.build_stage_modules`); through ``torch.compile`` or :func:`fxopt.explain`
the pass only reports the plan.

The partition (docs/architecture.md, "Pipeline parallel"): nodes computed from parameters/buffers alone are
replicated into the stages that use them, :func:`partition_order` cuts the program order by dynamic programming, and
pinned ``split_points`` force a boundary. A graph that cannot be cut is a ``result.skip`` reason, which
:func:`fxopt.pipeline` raises as :class:`PipelineError`.
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
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class PipelineError(ValueError):
    """A model or setting that the pipeline split cannot handle (the message says why)."""


def default_device(device: Any = None) -> torch.device:
    """``device``, or CUDA when there is one, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class DeviceProfile:
    """Throughputs and fixed times of the cost model (formulas in docs/architecture.md, "Pipeline parallel").

    ``matmul_flops`` / ``attention_flops``: dtype → FLOP/s of a large GEMM / of fused attention (on the FLOPs after
    the causal halving); ``mem_bw``: bytes/s of a memory-bound kernel (read + written); ``op_overhead_s``: the least
    time one kernel takes in a stage (the host's launch interval); ``link_bw`` / ``link_latency_s``: between
    neighbouring stages; ``matmul_latency_s``: device-side fixed time of one GEMM.
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
        """Fraction of the peak a compute-bound GEMM of ``flops`` FLOPs reaches (1/2 at peak · matmul_latency_s)."""
        fixed = self.matmul_peak(dtype) * self.matmul_latency_s
        return flops / (flops + fixed) if flops + fixed > 0 else 1.0

    def matmul_seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        return max(flops / self.matmul_peak(dtype), nbytes / self.mem_bw) + self.matmul_latency_s

    @classmethod
    def h200(cls) -> "DeviceProfile":
        # Sources of the constants: docs/architecture.md, "Pipeline parallel" (H200 anchors, fxopt's attention
        # benchmark, the 30 us per-kernel floor fitted on compiled graphs; 4 us per GEMM until measure() replaces it).
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
        device = default_device(device)
        if device.type == "cuda":
            prof = cls.h200()
            if torch.cuda.is_available():
                prof.name = torch.cuda.get_device_name(device)
            return prof
        return cls.cpu()

    @classmethod
    def measure(cls, device: Any = None, dtype: torch.dtype = torch.bfloat16) -> "DeviceProfile":
        """The preset for ``device`` with the GEMM peak (4096³ on GPU), the GEMM latency (a 1024³ GEMM) and the copy
        bandwidth measured; attention scales with the peak, the per-kernel floor stays the preset's."""
        import time

        prof = cls.for_device(device)
        dev = default_device(device)
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
    """Device time of one ``fn()``: on CUDA replayed from one CUDA graph (a 1024³ GEMM is shorter than its launch);
    elsewhere, or if capture fails, a timed loop."""
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
    """``kind``: "free", "matmul", "attention" or "memory" (what Inductor fuses); ``kernel_seconds``: device time."""

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


def _input_bytes(src: fx.Node, name: str, out_bytes: float) -> float:
    b = float(value_bytes(src))
    if name in _GATHER_OPS and b > out_bytes:  # the table: only the rows looked up are read
        return out_bytes
    return b


def node_cost(node: fx.Node, profile: DeviceProfile) -> NodeCost:
    """FLOPs, bytes (read + written) and seconds of ``node`` run as its own kernel (no fusion)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return NodeCost()
    name = _node_name(node)
    if _is_free(node, name):
        return NodeCost()
    outs = _tensors(match.val(node))
    out_bytes = float(sum(_nbytes(t) for t in outs))
    nbytes = out_bytes + sum(_input_bytes(a, name, out_bytes) for a in node.all_input_nodes)
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
    """:class:`NodeCost` of every compute node, memory-bound nodes fused as Inductor does: connected (through views)
    and after the same number of matmul/attention kernels; a group's time is split evenly over its nodes."""
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
            nbytes += _input_bytes(a, names[users[0]] if gather else "", out_b)
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


# Partition on an abstract DAG: nodes carry "cost" (seconds), "bytes" (size of the value) and "sendable".
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
    idx = np.arange(n + 1)
    INF = np.inf

    def allowed_starts(j):  # positions i where a segment [i, j) may start
        return valid & (idx < j) & (idx >= last_pin[j])

    # Step 1: least bottleneck.
    best = np.full((stages + 1, n + 1), INF)
    best[0, 0] = 0.0
    # (k, j): the first k segments end just before position j (valid cuts; only the last segment ends at n)
    ends = [(k, j) for k in range(1, stages + 1) for j in range(1, n + 1) if valid[j] and (k == stages or j < n)]
    for k, j in ends:
        best[k, j] = np.where(allowed_starts(j), np.maximum(best[k - 1], prefix[j] - prefix), INF).min()
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
    for k, j in ends:
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
    cuts, j = [], n
    for k in range(stages, 0, -1):
        j = int(arg[k, j])
        cuts.append(j)
    cuts = sorted(cuts)[1:]  # drop position 0
    assert all(p in cuts for p in pins)
    stage = {v: int(np.searchsorted(cuts, i, side="right")) for i, v in enumerate(order)}
    for v, data in dag.nodes(data=True):
        if v not in pos:
            stage[v] = 0 if data.get("pinned_stage", 0) == 0 else stages - 1
    part = evaluate(dag, stage, stages)
    if part is None:  # cannot happen for a topological order; kept as a guard against a wrong graph
        raise PipelineError("internal error: the split of a topological order is invalid")
    return part


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
    def balance(self) -> float:
        """Slowest stage over the mean stage (1.0 is perfect balance)."""
        t = [s.seconds for s in self.stages]
        return max(t) / (sum(t) / len(t)) if sum(t) > 0 else 1.0

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
    return isinstance(match.val(node), torch.Tensor)


def build_plan(gm: fx.GraphModule, stages: int, *, state: dict, profile: DeviceProfile,
               split_points: Sequence[str] = (), slack: float = 0.05,
               trainable: Optional[set] = None) -> PipelinePlan:
    """Price ``gm``'s nodes, split it into ``stages`` stages, annotate ``node.meta[STAGE_KEY]`` and return the plan.

    ``state``: placeholder name → qualified name of the parameters/buffers (owned by stages, never sent).
    ``trainable``: qualified names of the parameters that get gradients (default: recognised from the graph).
    ``slack``: a stage may be up to ``slack`` slower than the best bottleneck if that sends fewer bytes.
    """
    import networkx as nx

    nodes = list(gm.graph.nodes)
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

    part = partition_order(dag, order, stages, cut_before=pinned_nodes, slack=slack)

    by_name = {n.name: n for n in nodes}
    stage_of = {by_name[v]: s for v, s in part.stage.items() if v in by_name}
    readers: dict = {}  # replicated and state node -> the stages that read it, directly or through replicated nodes

    def use_stages(n):
        st = set()
        for u in n.users:
            if u.op == "output":
                st.add(stages - 1)
            elif u in replicated:
                st |= readers.get(u, set())
            elif u in stage_of:
                st.add(stage_of[u])
        return st

    for n in reversed(nodes):  # a replicated node's users come after it; state nodes have no inputs
        if n in replicated or is_state[n]:
            readers[n] = use_stages(n)
    for n in nodes:
        n.meta.pop(STAGE_KEY, None)
        if n in stage_of:
            n.meta[STAGE_KEY] = stage_of[n]
        elif n in readers:
            n.meta[STAGE_KEY] = sorted(readers[n])

    def qual(n):
        return state.get(n.name, n.target if n.op == "get_attr" else n.name)

    stage_plans = []
    for s in range(stages):
        own = [n for n in compute if stage_of.get(n) == s]
        rep = [n for n in nodes if n in replicated and s in readers[n]]
        members = [n for n in nodes if n in own or n in rep]
        ms = [mods.get(n.name, "") for n in own if mods.get(n.name)]
        stage_plans.append(StagePlan(
            index=s, nodes=[n.name for n in members],
            seconds=sum(costs[n].seconds for n in members), flops=sum(costs[n].flops for n in members),
            bytes=sum(costs[n].bytes for n in members),
            params=sorted(qual(n) for n in nodes if is_state[n] and s in readers[n]),
            modules=(ms[0], ms[-1]) if ms else ("", ""), replicated=[n.name for n in rep]))
    # a value crosses every boundary between its stage and the last stage that reads it
    last_use = {v: max((part.stage[u] for u in dag.successors(v)), default=s)
                for v, s in part.stage.items() if v != "__output__"}
    boundaries = []
    for b in range(stages - 1):
        vals = []
        for v, s in part.stage.items():
            if v in last_use and s <= b < last_use[v]:
                t = match.tensor_val(by_name[v])
                vals.append((v, tuple(t.shape) if t is not None else (), t.dtype if t is not None else None))
        nbytes = int(part.boundary_bytes[b])
        boundaries.append(BoundaryPlan(b, vals, nbytes, send_seconds(nbytes, profile)))
    # A parameter may reach the graph through several placeholders (tied weights read through two module paths):
    # group by qualified name.
    by_qual: dict = {}
    for n in [n for n in nodes if is_state[n]]:
        v = match.val(n)
        is_param = (qual(n) in trainable) if trainable is not None else (
            isinstance(v, torch.Tensor) and (v.requires_grad or "_parameters_" in n.name))
        if is_param:
            by_qual.setdefault(qual(n), set()).update(readers[n])
    shared = {q: sorted(st) for q, st in by_qual.items() if len(st) > 1}
    return PipelinePlan(stage_plans, boundaries, shared, profile.name, pins, "order-DP")


@register_pass("pipeline")
def pipeline_pass(gm: fx.GraphModule, cfg: PipelineConfig, ctx: PassContext) -> PassResult:
    """Plan the pipeline split of ``gm`` (annotates nodes, stores the plan in ``gm.meta``; rewrites nothing)."""
    result = PassResult("pipeline")
    gm.meta.pop(PLAN_KEY, None)
    if cfg.stages <= 1:
        result.skip("graph", f"stages={cfg.stages}: nothing to split")
        return result
    if cfg.schedule not in SCHEDULES:
        result.skip("graph", f"unknown schedule {cfg.schedule!r} ({', '.join(SCHEDULES)})")
        return result
    profile = ctx.extras.get("pipeline_profile") or DeviceProfile.for_device(_graph_device(gm))
    try:
        plan = build_plan(gm, cfg.stages, state=state_placeholders(gm, ctx), profile=profile,
                          split_points=cfg.split_points, slack=float(ctx.extras.get("pipeline_slack", 0.05)),
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


__all__ = ["DeviceProfile", "NodeCost", "node_cost", "graph_costs", "Partition", "partition_order", "evaluate",
           "PipelinePlan", "StagePlan", "BoundaryPlan", "PipelineError", "build_plan", "pipeline_pass", "STAGE_KEY",
           "PLAN_KEY", "SCHEDULES"]
