"""Launch plans: an entry point's kernel launches replayed without Triton's per-call Python.

``@plan_cached`` keys each call on its tensors' metadata (16-byte alignment included), its other arguments, the
current device and the entry point's ``state``; the second call of a key is recorded and kept if it only allocated,
took views and launched kernels; later calls replay those kernels bit for bit. Python state outside the key may change
only between ``clear_plans()`` calls; ``FXOPT_LAUNCH_PLANS=0`` turns plans off. ``docs/kernels.md`` ("Launch plans").
"""
from __future__ import annotations

import functools
import logging
import math
import threading
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxopt import env

log = logging.getLogger(__name__)

ENABLED = env.launch_plans()
MAX_PLANS = 512  # keys per process; past it the table is cleared (e.g. a dropout seed in every key)

_ALLOW_CPU = False  # tests: key CPU tensors too (the plan logic with fake kernels)
_PLANS: dict = {}
_SEEN, _NOT_REPLAYABLE = "seen", "not replayable"
NO_PLAN = object()  # returned by a ``state`` function: this call keeps the ordinary path and adds no key
_TLS = threading.local()
stats = {"replayed": 0, "recorded": 0, "not_replayable": 0, "ordinary": 0}

_ALLOC_OPS = None  # filled lazily (torch.ops lookups)


def clear_plans() -> None:
    """Forget every plan (after changing Python state the entry points read: a module global, a patched function)."""
    _PLANS.clear()


def _alloc_ops():
    global _ALLOC_OPS
    if _ALLOC_OPS is None:
        a = torch.ops.aten
        _ALLOC_OPS = frozenset((a.empty.memory_format, a.empty_strided.default, a.empty_like.default,
                                a.new_empty.default, a.new_empty_strided.default))
    return _ALLOC_OPS


# Keys

_SCALARS = frozenset((bool, int, float, str))


def _call_key(fn, args, kwargs, allow_cpu=False):
    """(key, tensors in argument order) or (None, None) when the call is not keyable (a CPU tensor, an argument
    that is not hashable, a tensor inside a container)."""
    parts = [fn]
    tensors = []
    for a in (*args, *kwargs.values()):
        if a is None or a.__class__ in _SCALARS:
            parts.append(a)
        elif isinstance(a, torch.Tensor):
            if not (a.is_cuda or allow_cpu) or a.numel() == 0:
                return None, None
            tensors.append(a)
            parts.append((a.dtype, a.shape, a.stride(), a.get_device(), a.data_ptr() & 15))
        else:
            try:
                hash(a)
            except TypeError:
                return None, None
            if isinstance(a, (tuple, frozenset)) and any(isinstance(x, torch.Tensor) for x in a):
                return None, None
            parts.append(a)
    if not tensors:
        return None, None
    if kwargs:
        parts.append(tuple(kwargs))
    if tensors[0].is_cuda:
        parts.append(torch.cuda.current_device())
    return tuple(parts), tensors


# Recording

class NotReplayable(Exception):
    pass


class _Watch(TorchDispatchMode):
    """Allocations are recorded, views pass, anything else makes the call not replayable."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _alloc_ops():
            if out.device.type != "meta":  # meta tensors (layout queries) hold no memory a kernel could use
                self.rec.allocs.append(out)
        elif not func.is_view:
            self.rec.bad(f"aten op {func}")
        return out


def _span_bytes(t: torch.Tensor) -> int:
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


class _Recorder:
    def __init__(self, inputs):
        self.inputs = inputs
        self.allocs = []
        self.launches = []     # (kernel, grid, values)
        self.reason = None
        self.autotune_depth = 0
        self.autotune_launches = []

    def bad(self, why):
        if self.reason is None:
            self.reason = why

    def holds_address(self, p: int) -> bool:
        """Whether p points into an input or an allocation (a raw pointer passed as an int would be replayed stale)."""
        for x in (*self.inputs, *self.allocs):
            base = x.data_ptr()
            if base <= p < base + _span_bytes(x):
                return True
        return False

    def place(self, t: torch.Tensor):
        """(kind, index, byte offset): kind 0 = input, 1 = allocation; ('const', t) for a tensor from before the
        call (a module-level buffer)."""
        for kind, pool in ((0, self.inputs), (1, self.allocs)):
            for i, x in enumerate(pool):
                if x is t:
                    return kind, i, 0
        ptr = t.data_ptr()
        hits = set()
        for kind, pool in ((0, self.inputs), (1, self.allocs)):
            for i, x in enumerate(pool):
                base = x.data_ptr()
                if base == ptr or base < ptr < base + _span_bytes(x):
                    hits.add((kind, i, ptr - base))
        exact = {h for h in hits if h[2] == 0}
        if len(exact) == 1:
            return exact.pop()
        if len(exact) > 1:
            raise NotReplayable(f"a pointer argument is the start of {len(exact)} distinct inputs")
        if len(hits) == 1:
            return hits.pop()
        if hits:
            raise NotReplayable(f"a pointer argument lies inside {len(hits)} inputs / allocations")
        return ("const", t)


class _Ptr:
    """A pointer for a TMA descriptor's base (``make_tensordesc_arg`` reads ``base.data_ptr()``)."""
    __slots__ = ("p",)

    def __init__(self, p):
        self.p = p

    def data_ptr(self):
        return self.p


class _Desc:
    """What Triton's launcher reads of a host tensor descriptor: base, shape, strides, padding."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def _is_desc(v) -> bool:
    return hasattr(v, "block_shape") and hasattr(v, "base") and hasattr(v, "strides")


class Plan:
    """The launches of one key, ready to replay."""

    def __init__(self, rec: _Recorder, result, stream_fn):
        self.stream_fn = stream_fn
        allocs = [[tuple(a.shape), a.stride(), a.dtype, a.device] for a in rec.allocs]
        self.launches = []
        for kernel, grid, values in rec.launches:
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            template = list(values)
            ptr_slots, desc_slots = [], []
            for pos, v in enumerate(values):
                if v.__class__ is int and v > 1 << 32 and rec.holds_address(v):
                    raise NotReplayable("an integer argument is an address inside an input or allocation")
                if isinstance(v, torch.Tensor):
                    where = rec.place(v)
                    if where[0] != "const":
                        ptr_slots.append((pos, *where))
                        template[pos] = None  # the plan must not keep the recorded call's tensors alive
                elif _is_desc(v):
                    where = rec.place(v.base)
                    if where[0] != "const":
                        desc_slots.append((pos, *where, tuple(v.shape), tuple(v.strides),
                                           getattr(v, "padding", "zero")))
                        template[pos] = None
            g = tuple(grid) + (1, 1)
            kernel._init_handles()
            self.launches.append((kernel.run, g[0], g[1], g[2], kernel.function, kernel.packed_metadata, template,
                                  tuple(ptr_slots), tuple(desc_slots), kernel))
        self.result = self._place_result(rec, result)
        self._layout_allocations(rec, allocs)

    def _layout_allocations(self, rec, allocs):
        """Allocations a result is (or views whole) get their own, in the result's shape and strides; the
        workspaces only kernels see are carved from one byte buffer at 256-byte offsets (one allocator call)."""
        owners = {}

        def walk(spec):
            if spec[0] in ("t", "v") and spec[1] == 1:
                owners.setdefault(spec[2], []).append(spec)
            elif spec[0] == "seq":
                for x in spec[2]:
                    walk(x)

        walk(self.result)
        for i, specs in owners.items():
            a = rec.allocs[i]
            if len(specs) == 1 and specs[0][0] == "v" and specs[0][5] == 0:
                _, _, _, shape, stride, _ = specs[0]
                numel = math.prod(shape)
                view_span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if numel else 0
                if numel == a.numel() and view_span == numel and _span_bytes(a) == a.numel() * a.element_size():
                    allocs[i][0], allocs[i][1] = shape, stride
                    self._retag(specs[0], ("t", 1, i))
        self.device = rec.inputs[0].device
        own = set(owners)
        own.update(i for i, a in enumerate(allocs) if a[3] != self.device)  # another device: on its own
        self.owned = [(i, *allocs[i]) for i in sorted(own)]
        self.scratch, off = [], 0
        for i in range(len(allocs)):
            if i not in own:
                self.scratch.append((i, off))
                off += -(-max(_span_bytes(rec.allocs[i]), 1) // 256) * 256
        self.scratch_bytes = off
        self.n_allocs = len(allocs)

    def _retag(self, old, new):
        def sub(spec):
            if spec is old:
                return new
            if spec[0] == "seq":
                return ("seq", spec[1], tuple(sub(x) for x in spec[2]))
            return spec
        self.result = sub(self.result)

    def _place_result(self, rec, r):
        if isinstance(r, torch.Tensor):
            where = rec.place(r)
            if where[0] == "const":
                raise NotReplayable("the result is a tensor from before the call")
            kind, i, off = where
            pool = rec.inputs if kind == 0 else rec.allocs
            if pool[i] is r:
                return ("t", kind, i)
            if r.dtype != pool[i].dtype or off % r.element_size():
                raise NotReplayable("the result views its base with another dtype")
            return ("v", kind, i, tuple(r.shape), r.stride(), off // r.element_size())
        if isinstance(r, (tuple, list)):
            return ("seq", type(r), tuple(self._place_result(rec, x) for x in r))
        if r is None or isinstance(r, (bool, int, float, str)):
            return ("c", r)
        raise NotReplayable(f"a result of type {type(r).__name__}")

    def _build(self, spec, inputs, allocs):
        tag = spec[0]
        if tag == "t":
            return (inputs if spec[1] == 0 else allocs)[spec[2]]
        if tag == "v":
            base = (inputs if spec[1] == 0 else allocs)[spec[2]]
            return base.as_strided(spec[3], spec[4], base.storage_offset() + spec[5])
        if tag == "seq":
            return spec[1](self._build(s, inputs, allocs) for s in spec[2])
        return spec[1]

    def replay(self, inputs):
        allocs = [None] * self.n_allocs
        aptrs = [0] * self.n_allocs
        for i, s, st, dt, dv in self.owned:
            a = allocs[i] = torch.empty_strided(s, st, dtype=dt, device=dv)
            aptrs[i] = a.data_ptr()
        if self.scratch:
            ws = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.device)  # noqa: F841 (kept to the end)
            base = ws.data_ptr()
            for i, off in self.scratch:
                aptrs[i] = base + off
        ptrs = ([t.data_ptr() for t in inputs], aptrs)
        stream = self.stream_fn(self.device)
        for launcher, g0, g1, g2, function, packed, template, ptr_slots, desc_slots, _ in self.launches:
            vals = list(template)
            for pos, kind, i, off in ptr_slots:
                vals[pos] = ptrs[kind][i] + off
            for pos, kind, i, off, shape, strides, padding in desc_slots:
                vals[pos] = _Desc(_Ptr(ptrs[kind][i] + off), shape, strides, padding)
            launcher(g0, g1, g2, stream, function, packed, None, None, None, *vals)
        return self._build(self.result, inputs, allocs)


def _cuda_stream(device):
    # Triton launches on the current device's current stream (not the tensors' device): the key holds that device
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


_RUNTIME_KNOBS = None


def _hooks_active() -> bool:
    """Whether a Triton launch hook is installed (a profiler such as proton): replays do not call hooks."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # Triton 3.6: an always-present, empty HookChain
            return True
    return False


_PATCHED = False
_PATCH_LOCK = threading.Lock()


def _patch_triton():
    """Wrap JITFunction.run and Autotuner.run once: they record only on a thread that is recording."""
    global _PATCHED
    with _PATCH_LOCK:  # two threads patching at once would wrap twice and record every launch twice
        if not _PATCHED:
            _do_patch_triton()
            _PATCHED = True


def _do_patch_triton():
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    jit_run, tune_run = JITFunction.run, Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        rec = getattr(_TLS, "rec", None)
        if rec is not None and not warmup and kernel is not None:
            device = driver.active.get_current_device()
            binder = self.device_caches[device][4]
            bound, _, _ = binder(*args, **kwargs)
            g = grid(bound) if callable(grid) else grid
            rec.launches.append((kernel, g, list(bound.values())))
            if rec.autotune_depth:
                rec.autotune_launches[-1] += 1
        return kernel

    def autotuned(self, *args, **kwargs):
        rec = getattr(_TLS, "rec", None)
        if rec is None:
            return tune_run(self, *args, **kwargs)
        rec.autotune_depth += 1
        rec.autotune_launches.append(0)
        try:
            return tune_run(self, *args, **kwargs)
        finally:
            rec.autotune_depth -= 1
            if rec.autotune_launches.pop() != 1:
                rec.bad("an autotuned kernel launched more than once (it was tuning)")

    JITFunction.run, Autotuner.run = run, autotuned


def record(fn, args, kwargs, inputs, stream_fn=None):
    """Run ``fn`` once, recorded -> (result, Plan or the reason it is not replayable)."""
    _patch_triton()
    rec = _Recorder(inputs)
    _TLS.rec = rec
    try:
        with _Watch(rec):
            result = fn(*args, **kwargs)
    finally:
        _TLS.rec = None
    if _hooks_active():
        rec.bad("a Triton launch hook is set")
    if not rec.launches:
        rec.bad("no kernel launched")
    if rec.reason is not None:
        return result, rec.reason
    try:
        return result, Plan(rec, result, stream_fn or _cuda_stream)
    except NotReplayable as e:
        return result, str(e)


def plan_cached(fn: Optional[Callable] = None, *, state: Optional[Callable[..., Any]] = None,
                enabled: Optional[Callable[[], bool]] = None):
    """Decorator: replay ``fn``'s launches for keys seen before. ``state(*args, **kwargs)``: the hashable routing
    state beyond the arguments (``NO_PLAN``: not this call); ``enabled()``: the entry point's switch, read per call."""
    if fn is None:
        return functools.partial(plan_cached, state=state, enabled=enabled)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not ENABLED or getattr(_TLS, "rec", None) is not None or _hooks_active() or \
                (enabled is not None and not enabled()):
            return fn(*args, **kwargs)
        key, inputs = _call_key(fn, args, kwargs, _ALLOW_CPU)
        if key is None:
            return fn(*args, **kwargs)
        if state is not None:
            st = state(*args, **kwargs)
            if st is NO_PLAN:
                return fn(*args, **kwargs)
            key = (key, st)
        entry = _PLANS.get(key)
        if entry.__class__ is Plan:
            stats["replayed"] += 1
            return entry.replay(inputs)
        if entry is None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = _SEEN
            stats["ordinary"] += 1
            return fn(*args, **kwargs)
        if entry is _SEEN:
            result, plan = record(fn, args, kwargs, inputs)
            if isinstance(plan, Plan):
                stats["recorded"] += 1
                _PLANS[key] = plan
            else:
                stats["not_replayable"] += 1
                log.debug("%s: no launch plan for this key: %s", fn.__name__, plan)
                _PLANS[key] = _NOT_REPLAYABLE
            return result
        stats["ordinary"] += 1
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    wrapper.plan_state = state
    return wrapper


def plan_for(fn, *args, **kwargs) -> Optional[Any]:
    """The plan (or the string why there is none, or None before the second call) of ``fn`` (the decorated entry
    point) for these arguments."""
    key, _ = _call_key(getattr(fn, "__wrapped__", fn), args, kwargs, _ALLOW_CPU)
    state = getattr(fn, "plan_state", None)
    if key is not None and state is not None:
        key = (key, state(*args, **kwargs))
    return None if key is None else _PLANS.get(key)
