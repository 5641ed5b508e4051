"""Launch plans (fxopt.kernels.launch_plan) on CPU: keys, recording, pointer placement and replay, with a fake
compiled kernel standing in for Triton's (the real launches are checked on the GPU: test_launch_plan_gpu.py)."""
import os

import pytest
import torch

from fxopt.kernels import launch_plan as LP


class FakeKernel:
    """What a Plan uses of a Triton CompiledKernel: _init_handles, run (the launcher), function, packed_metadata."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.calls = []

    def _init_handles(self):
        pass

    @property
    def run(self):
        return self.launch

    def launch(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *vals):
        self.calls.append(((g0, g1, g2), stream, vals))


class Desc:
    """A host tensor descriptor as the recorder sees one (base, shape, strides, block_shape, padding)."""

    def __init__(self, base, block):
        self.base, self.shape, self.strides = base, list(base.shape), list(base.stride())
        self.block_shape, self.padding = block, "zero"


GLOBAL_BUF = torch.zeros(4)


def _launch(kernel, grid, values):
    LP._TLS.rec.launches.append((kernel, grid, values))


def test_key_separates_what_the_launch_path_can_branch_on():
    x = torch.randn(4, 8)
    key = lambda *a, **kw: LP._call_key(len, a, kw, allow_cpu=True)[0]  # noqa: E731
    base = key(x, 1.5, True)
    assert base == key(torch.randn(4, 8), 1.5, True)             # new data, same key
    assert base != key(x.half(), 1.5, True)                      # dtype
    assert base != key(torch.randn(8, 4).t(), 1.5, True)         # strides
    assert base != key(torch.randn(4, 9)[:, :8], 1.5, True)      # strides again (a view of a wider tensor)
    assert base != key(torch.randn(33)[1:].view(4, 8), 1.5, True)  # 16-byte alignment of the pointer
    assert base != key(x, 2.0, True) and base != key(x, 1.5, False)
    assert base != key(x, 1.5, True, out=None)                   # keyword names
    assert LP._call_key(len, (x,), {})[0] is None                # CPU tensors: no plans outside tests
    assert key(x, [1, 2]) is None                                # unhashable argument
    assert key(x, (x,)) is None                                  # tensor inside a container
    assert key(torch.empty(0, 8)) is None                        # empty tensor


def test_attention_plan_state_holds_the_routing_table_and_the_kernel_choices():
    """The attention entry points key their plans on the routing table's digest and the kernel choices in force, so
    a plan recorded with the Gluon route on never replays inside ``use_kernels(attention_gluon=False)``; calls with
    dropout (a fresh seed each call) keep the ordinary path."""
    from fxopt.kernels import use_kernels
    from fxopt.kernels.attention import launch, routing

    state = launch._fwd_plan_state()
    assert routing.ROUTES_DIGEST in state
    with use_kernels(attention_gluon=False):
        assert launch._fwd_plan_state() != state
    with use_kernels(attention_gluon_backward=False):
        assert launch._bwd_plan_state() != state
    assert launch._fwd_plan_state() == state
    assert launch._fwd_plan_state(None, None, None, None, 0.1) is LP.NO_PLAN
    assert launch._bwd_plan_state(*([None] * 7), 0.1) is LP.NO_PLAN


def test_replay_places_pointers_descriptors_and_results():
    kern = FakeKernel()

    def fn(x, y, n):
        out = torch.empty(4, 8)
        ws = torch.empty(16)
        _launch(kern, (2, 3), [x, y[1:], out, n, 1.5, "CONSTEXPR", Desc(ws, [4]), GLOBAL_BUF, None])
        return out, out.view(8, 4)[2:], n

    x, y = torch.randn(4, 8), torch.randn(10)
    result, plan = LP.record(fn, (x, y, 3), {}, [x, y], stream_fn=lambda d: 7)
    assert isinstance(plan, LP.Plan), plan
    assert len(kern.calls) == 0  # recording does not launch through the fake (the real path launches itself)
    x2, y2 = torch.randn(4, 8), torch.randn(10)
    out, view, n = plan.replay([x2, y2])
    (grid, stream, vals), = kern.calls
    assert grid == (2, 3, 1) and stream == 7 and n == 3
    assert vals[0] == x2.data_ptr() and vals[1] == y2.data_ptr() + 4
    assert vals[2] == out.data_ptr() and out.shape == (4, 8) and out.dtype == torch.float32
    assert vals[3:6] == (3, 1.5, "CONSTEXPR") and vals[7] is GLOBAL_BUF and vals[8] is None
    d = vals[6]
    assert d.base.data_ptr() not in (x2.data_ptr(), y2.data_ptr(), out.data_ptr())
    assert d.shape == (16,) and d.strides == (1,) and d.padding == "zero"
    assert view.shape == (6, 4) and view.data_ptr() == out.data_ptr() + 8 * 4 and view.stride() == (4, 1)
    assert view.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    # a second replay allocates afresh
    out2, _, _ = plan.replay([x2, y2])
    assert out2.data_ptr() != out.data_ptr() or out2 is not out


@pytest.mark.parametrize("body, why", [
    (lambda x: x.add(1), "aten op"),
    (lambda x: bool((x > 0).any()), "aten op"),
    (lambda x: torch.zeros(3), "aten op"),
    (lambda x: x.t().contiguous(), "aten op"),
])
def test_any_op_but_allocations_and_views_is_not_replayable(body, why):
    kern = FakeKernel()

    def fn(x):
        body(x)
        _launch(kern, (1,), [x])
        return x

    x = torch.randn(4, 8)
    _, plan = LP.record(fn, (x,), {}, [x], stream_fn=lambda d: 0)
    assert isinstance(plan, str) and why in plan


def test_ambiguous_or_foreign_pointers_are_not_replayable():
    kern = FakeKernel()
    base = torch.randn(100)
    x, y = base[:60], base[40:]

    def inside_both(x, y):
        _launch(kern, (1,), [base[50:]])

    _, plan = LP.record(inside_both, (x, y), {}, [x, y], stream_fn=lambda d: 0)
    assert isinstance(plan, str) and "inside 2" in plan

    def no_launch(x, y):
        return torch.empty(3)

    _, plan = LP.record(no_launch, (x, y), {}, [x, y], stream_fn=lambda d: 0)
    assert plan == "no kernel launched"

    def returns_old_tensor(x, y):
        _launch(kern, (1,), [x])
        return GLOBAL_BUF

    _, plan = LP.record(returns_old_tensor, (x, y), {}, [x, y], stream_fn=lambda d: 0)
    assert isinstance(plan, str) and "before the call" in plan


def test_decorator_runs_ordinary_then_records_then_replays(monkeypatch):
    monkeypatch.setattr(LP, "_ALLOW_CPU", True)
    monkeypatch.setattr(LP, "_cuda_stream", lambda d: 5)
    LP.clear_plans()
    kern = FakeKernel()
    ran = []

    @LP.plan_cached
    def entry(x, scale=1.0):
        ran.append(scale)
        out = torch.empty_like(x)
        _launch(kern, (1,), [x, out, scale]) if LP._TLS.__dict__.get("rec") else None
        return out

    x = torch.randn(3, 5)
    entry(x)                      # ordinary
    assert LP.plan_for(entry, x) == LP._SEEN
    entry(x)                      # recorded
    assert isinstance(LP.plan_for(entry, x), LP.Plan)
    before = LP.stats["replayed"]
    x2 = torch.randn(3, 5)
    out = entry(x2, )             # replayed: the Python body does not run
    assert len(ran) == 2 and LP.stats["replayed"] == before + 1
    assert kern.calls[-1][2][0] == x2.data_ptr() and kern.calls[-1][2][1] == out.data_ptr()
    entry(x2, scale=2.0)          # another key: ordinary
    assert ran[-1] == 2.0
    monkeypatch.setattr(LP, "ENABLED", False)
    entry(x2)                     # plans off: the body runs
    assert len(ran) == 4
    LP.clear_plans()
    assert LP.plan_for(entry, x) is None


def test_plan_keeps_no_tensor_of_the_recorded_call_alive():
    """A plan recorded inside a CUDA-graph capture must not pin the graph pool's memory (cudagraph trees refuse
    untracked live tensors), nor leak the recorded call's inputs and allocations."""
    import gc
    import weakref

    kern = FakeKernel()

    def fn(x):
        out = torch.empty(4)
        _launch(kern, (1,), [x, out, Desc(torch.empty(8), [2])])
        return out

    x = torch.randn(4)
    result, plan = LP.record(fn, (x,), {}, [x], stream_fn=lambda d: 0)
    assert isinstance(plan, LP.Plan)
    refs = [weakref.ref(x), weakref.ref(result)]
    del x, result
    gc.collect()
    assert all(r() is None for r in refs)


def test_routing_state_is_part_of_the_key(monkeypatch):
    """A benchmark that reassigns a routing global must not replay the plan of another route."""
    monkeypatch.setattr(LP, "_ALLOW_CPU", True)
    monkeypatch.setattr(LP, "_cuda_stream", lambda d: 0)
    kern = FakeKernel()
    route, ran = ["gluon"], []

    @LP.plan_cached(state=lambda *a, **kw: (route[0],))
    def entry(x):
        ran.append(route[0])
        if LP._TLS.__dict__.get("rec"):
            _launch(kern, (1,), [x])
        return x

    x = torch.randn(3)
    for _ in range(3):
        entry(x)
    assert ran == ["gluon", "gluon"] and isinstance(LP.plan_for(entry, x), LP.Plan)
    route[0] = "triton"
    entry(x)
    assert ran[-1] == "triton" and LP.plan_for(entry, x) == LP._SEEN


def test_whole_views_become_allocations_and_workspaces_share_one_buffer():
    kern = FakeKernel()

    def fn(x):
        flat = torch.empty(32)             # returned as a whole [4, 8] view: allocated in that shape at replay
        ws1, ws2 = torch.empty(10), torch.empty(3, 70)   # workspaces: carved from one byte buffer
        _launch(kern, (1,), [x, flat, ws1, Desc(ws2, [1, 8])])
        return flat.view(4, 8)

    x = torch.randn(5)
    _, plan = LP.record(fn, (x,), {}, [x], stream_fn=lambda d: 0)
    assert isinstance(plan, LP.Plan)
    assert plan.result == ("t", 1, 0) and plan.owned[0][1:3] == ((4, 8), (8, 1))
    assert [off for _, off in plan.scratch] == [0, 256] and plan.scratch_bytes == 256 + 1024
    out = plan.replay([x])
    (_, _, vals), = kern.calls
    assert out.shape == (4, 8) and out.stride() == (8, 1) and out._base is None
    assert vals[1] == out.data_ptr()
    assert vals[3].base.data_ptr() - vals[2] == 256 and vals[3].shape == (3, 70)


def test_entry_switch_and_argument_state(monkeypatch):
    """``enabled``: an entry point's own opt-in; ``state`` sees the call's arguments (a fact about a tensor's values
    cached on it, such as W4A16's integer zero points, must split keys that share all metadata)."""
    monkeypatch.setattr(LP, "_ALLOW_CPU", True)
    monkeypatch.setattr(LP, "_cuda_stream", lambda d: 0)
    kern = FakeKernel()
    on, ran = [False], []

    @LP.plan_cached(state=lambda x, flag: bool(flag.item()), enabled=lambda: on[0])
    def entry(x, flag):
        ran.append(1)
        if LP._TLS.__dict__.get("rec"):
            _launch(kern, (1,), [x])
        return x

    x, t, f = torch.randn(3), torch.tensor(True), torch.tensor(False)
    for _ in range(3):
        entry(x, t)
    assert len(ran) == 3 and LP.plan_for(entry, x, t) is None      # switched off: no plans at all
    on[0] = True
    for _ in range(3):
        entry(x, t)
    assert len(ran) == 5 and isinstance(LP.plan_for(entry, x, t), LP.Plan)
    entry(x, f)                                                     # same metadata, other state: not replayed
    assert len(ran) == 6 and LP.plan_for(entry, x, f) == LP._SEEN


def test_w4a16_plans_default_and_switch():
    """On by default (GPU tests passed on the H200); FXOPT_LAUNCH_PLANS=0 turns them off."""
    import subprocess
    import sys

    from fxopt.kernels.w4a16 import ops

    assert ops.w4a16_matmul.plan_state is ops._plan_state
    code = "from fxopt.kernels.w4a16 import ops as K; print(K._LAUNCH_PLANS)"
    for env, want in (({}, "True"), ({"FXOPT_LAUNCH_PLANS": "0"}, "False")):
        e = {k: v for k, v in os.environ.items() if k != "FXOPT_LAUNCH_PLANS"}
        out = subprocess.run([sys.executable, "-c", code], env={**e, **env}, capture_output=True, text=True,
                             check=True).stdout.split()[-1]
        assert out == want, (env, out)


def test_no_plan_state_adds_no_key(monkeypatch):
    """Dropout draws a new seed per call: such calls keep the ordinary path without filling the table."""
    from fxopt.kernels.attention import launch

    monkeypatch.setattr(LP, "_ALLOW_CPU", True)
    q = torch.randn(1, 1, 4, 8)
    assert launch._fwd_plan_state(q, q, q, None, 0.1, False, None, -1, 0.0, None, 123) is LP.NO_PLAN
    assert launch._fwd_plan_state(q, q, q, dropout_p=0.0) == launch._plan_state(0.0)
    assert launch._bwd_plan_state(q, q, q, q, q, q, None, 0.2) is LP.NO_PLAN
    assert launch._bwd_plan_state(q, q, q, q, q, q, dropout_p=0.0) == launch._plan_state(0.0)
    ran = []

    @LP.plan_cached(state=lambda x, seed: LP.NO_PLAN if seed else ())
    def entry(x, seed):
        ran.append(seed)
        return x

    LP.clear_plans()
    for seed in range(1, 6):
        entry(q, seed)
    assert len(ran) == 5 and not LP._PLANS
    entry(q, 0)
    assert len(LP._PLANS) == 1


def test_a_raw_pointer_argument_is_not_replayable():
    kern = FakeKernel()

    def fn(x):
        _launch(kern, (1,), [x, x.data_ptr() + 4, 1 << 40])  # the second would be baked in, stale at replay
        return x

    x = torch.randn(8)
    _, plan = LP.record(fn, (x,), {}, [x], stream_fn=lambda d: 0)
    assert isinstance(plan, str) and "address" in plan
