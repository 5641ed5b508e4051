"""The w4a16 pass: ``dequantize_w4 -> linear`` (every spelling) becomes ``torch.ops.fxopt.w4a16_linear``; outputs
equal eager (CPU reference path of the ops); what it cannot take stays, with a reason."""
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxopt
from fxopt.config import Config
from fxopt.passes import run_passes
from fxopt.quant.format import PackedW4, pack_int4
from fxopt.quant.linear import QuantLinear

HAS_CUDA = torch.cuda.is_available()


def packed(K, N, G, dtype=torch.float16, seed=0, perm=None):
    g = torch.Generator().manual_seed(seed)
    return PackedW4(pack_int4(torch.randint(0, 16, (K, N), generator=g)),
                    (torch.rand(K // G, N, generator=g) * 0.02 + 0.005).to(dtype),
                    torch.randint(0, 16, (K // G, N), generator=g).to(dtype), G, perm)


def qlinear(K, N, G=32, dtype=torch.float16, bias=True, seed=0, perm=None):
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed + 100)).to(dtype) if bias else None
    return QuantLinear.from_packed(packed(K, N, G, dtype, seed, perm), b)


class MLP(nn.Module):
    def __init__(self, dtype=torch.float16, act_order=False):
        super().__init__()
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)) if act_order else None
        self.up = qlinear(64, 96, 32, dtype, bias=True, seed=1, perm=perm)
        self.down = qlinear(96, 32, 32, dtype, bias=False, seed=2)
        self.head = nn.Linear(32, 16).to(dtype)  # a float linear: not a candidate

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def capture(model, *args, config=None):
    """Compile with a backend that runs fxopt's passes and keeps the rewritten graphs."""
    graphs = []

    def backend(gm, example_inputs):
        gm, results = run_passes(gm, example_inputs, config or Config())
        graphs.append((gm, results))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(*args)
    torch._dynamo.reset()
    return out, graphs


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in target)


W4A16 = (torch.ops.fxopt.w4a16_linear.default, torch.ops.fxopt.w4a16_linear)
DEQUANT = (torch.ops.fxopt.dequantize_w4.default, torch.ops.fxopt.dequantize_w4)


def w4_result(graphs):
    return [r for _, results in graphs for r in results if r.name == "w4a16"][0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
@pytest.mark.parametrize("act_order", [False, True])
def test_mlp_rewritten_and_equal_to_eager(dtype, shape, act_order):
    torch.manual_seed(0)
    model = MLP(dtype, act_order)
    assert (model.up.perm is not None) == act_order
    x = torch.randn(*shape).to(dtype)
    ref = model(x)
    out, graphs = capture(model, x)
    (gm, _), = graphs
    res = w4_result(graphs)
    assert res.rewrites == 2 and res.skipped == []
    assert count(gm, W4A16) == 2 and count(gm, DEQUANT) == 0
    for n in gm.graph.nodes:
        if n.target in W4A16:
            assert n.meta["val"].dtype == dtype and n.meta["val"].shape[:-1] == torch.Size(shape[:-1])
            assert "nn_module_stack" in n.meta
    # same computation in float32 inside the op's CPU path vs dequantize + F.linear eagerly: close, not bitwise
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    w = model.up.dequantized_weight().double()
    ref64 = x.double() @ w.T + model.up.bias.double()
    torch.testing.assert_close(model.up(x).double(), ref64, atol=tol, rtol=tol)


def test_explain_reports_rewrites_and_notes():
    model = MLP()
    rep = fxopt.explain(model, torch.randn(4, 64).half())
    assert rep.rewrites["w4a16"] == 2
    assert sum("int4 [K=64, N=96], group 32, bias" in n for n in rep.notes) == 1
    assert sum("int4 [K=96, N=32], group 32" in n and "bias" not in n for n in rep.notes) == 1


class Spellings(nn.Module):
    """Each product of x with a transposed dequantized weight, one dequantize per product."""

    def __init__(self):
        super().__init__()
        self.q = nn.ModuleList(qlinear(64, 32, 32, seed=i) for i in range(7))

    def w(self, i):
        q = self.q[i]
        return torch.ops.fxopt.dequantize_w4(q.qweight, q.scales, q.zeros, q.group_size)

    def forward(self, x):
        return (x @ self.w(0).T + torch.matmul(x, self.w(1).t()) + x.matmul(self.w(2).transpose(0, 1))
                + torch.mm(x, self.w(3).permute(1, 0)) + x @ self.w(4).mT
                + torch.addmm(self.q[5].bias, x, self.w(5).transpose(-1, -2))
                + torch.nn.functional.linear(x, self.w(6), self.q[6].bias))


def test_every_spelling_is_fused():
    model = Spellings()
    x = torch.randn(3, 64).half()
    ref = model(x)
    out, graphs = capture(model, x)
    (gm, _), = graphs
    assert w4_result(graphs).rewrites == 7
    assert count(gm, W4A16) == 7 and count(gm, DEQUANT) == 0
    assert not any(n.op == "call_method" and n.target in ("t", "transpose", "permute") for n in gm.graph.nodes)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = qlinear(64, 32, 32)

    def forward(self, x):
        w = torch.ops.fxopt.dequantize_w4(self.q.qweight, self.q.scales, self.q.zeros, 32)
        return torch.nn.functional.linear(x, w) + w.sum()


class SharedByTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = qlinear(64, 32, 32)

    def forward(self, x, y):
        w = torch.ops.fxopt.dequantize_w4(self.q.qweight, self.q.scales, self.q.zeros, 32)
        return torch.nn.functional.linear(x, w) + y @ w.t()


class FourD(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = qlinear(64, 32, 32)

    def forward(self, x):
        return self.q(x)


@pytest.mark.parametrize("case,args,reason", [
    ("fp32", lambda: (MLP(torch.float32), torch.randn(2, 64)), "activations are torch.float32"),
    ("fp32 x, fp16 scales", lambda: (FourD(), torch.randn(2, 64)), "activations are torch.float32"),
    ("reused", lambda: (Reused(), torch.randn(2, 64).half()), "used elsewhere.*sum"),
    ("bf16 x, fp16 scales", lambda: (FourD(), torch.randn(2, 64).bfloat16()), "cast before use"),
    ("4-D", lambda: (FourD(), torch.randn(2, 2, 2, 64).half()), "input is 4-D"),
    ("group 16", lambda: (nn.Sequential(qlinear(64, 32, 16)), torch.randn(2, 64).half()),
     "group size 16 not supported"),
])
def test_skips_with_reason(case, args, reason):
    model, x = args()
    ref = model(x)
    out, graphs = capture(model, x)
    (gm, _), = graphs
    res = w4_result(graphs)
    assert res.rewrites == 0 and res.skipped
    assert all(re.search(reason, s.reason) for s in res.skipped), [s.reason for s in res.skipped]
    assert count(gm, W4A16) == 0 and count(gm, DEQUANT) >= 1
    assert torch.equal(out, ref)  # graph left as it was: same ops, same result


def test_weight_shared_by_two_linears_fuses_both():
    model = SharedByTwo()
    x, y = torch.randn(2, 64).half(), torch.randn(2, 64).half()
    ref = model(x, y)
    out, graphs = capture(model, x, y)
    (gm, _), = graphs
    assert w4_result(graphs).rewrites == 2 and count(gm, DEQUANT) == 0
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)


def test_disabled_by_config():
    model = MLP()
    x = torch.randn(2, 64).half()
    out, graphs = capture(model, x, config=Config.from_options({"w4a16.enabled": False}))
    (gm, results), = graphs
    assert not [r for r in results if r.name == "w4a16"]
    assert count(gm, DEQUANT) == 2 and count(gm, W4A16) == 0
    assert torch.equal(out, model(x))


def test_hand_made_graph_through_run_passes():
    """A graph that is not Dynamo's (built by hand, no meta): the manager propagates fake values, the pass fuses."""
    root = qlinear(64, 32, 32)
    g = fx.Graph()
    x = g.placeholder("x")
    qw, sc, z, b = (g.get_attr(n) for n in ("qweight", "scales", "zeros", "bias"))
    dq = g.call_function(torch.ops.fxopt.dequantize_w4.default, (qw, sc, z, 32))
    g.output(g.call_function(torch._C._nn.linear, (x, dq, b)))
    gm = fx.GraphModule(root, g)
    x = torch.randn(3, 64).half()
    ref = root(x)
    gm, results = run_passes(gm, [x], Config())
    res = [r for r in results if r.name == "w4a16"][0]
    assert res.rewrites == 1 and count(gm, W4A16) == 1 and count(gm, DEQUANT) == 0
    torch.testing.assert_close(gm(x).float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_fxopt_backend_with_inductor_cpu():
    """The full path (passes, then Inductor) once: the custom op runs inside Inductor's code."""
    model = nn.Sequential(qlinear(64, 32, 32, seed=3))
    x = torch.randn(4, 64).half()
    ref = model(x)
    backend = fxopt.Backend()
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    assert [r.rewrites for results in backend.results for r in results if r.name == "w4a16"] == [1]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_fused_matches_eager(dtype):
    model = MLP(dtype, act_order=True).cuda()
    x = torch.randn(2, 7, 64, device="cuda", dtype=dtype)
    ref = model(x)
    backend = fxopt.Backend()
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    assert [r.rewrites for results in backend.results for r in results if r.name == "w4a16"] == [2]
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)


# --- rewritten only when proven: one named test per rejection -----------------------------------------------------

class MutatedBetween(nn.Module):
    """The packed weight is written in place after the dequantize and before the product."""

    def __init__(self, view: bool):
        super().__init__()
        self.q, self.view = qlinear(64, 32, 32), view

    def forward(self, x):
        w = torch.ops.fxopt.dequantize_w4(self.q.qweight, self.q.scales, self.q.zeros, 32)
        if self.view:
            self.q.zeros[0].add_(1.0)
        else:
            self.q.scales.mul_(2.0)
        return torch.nn.functional.linear(x, w, self.q.bias)


def _assert_left_alone(model, x, reason):
    import copy

    ref = copy.deepcopy(model)(x)
    out, graphs = capture(model, x)
    (gm, _), = graphs
    res = w4_result(graphs)
    assert res.rewrites == 0 and count(gm, W4A16) == 0 and count(gm, DEQUANT) == 1
    assert res.skipped and all(re.search(reason, s.reason) for s in res.skipped), [s.reason for s in res.skipped]
    assert torch.equal(out, ref)  # the original ops, the original result


@pytest.mark.parametrize("view", [False, True], ids=["scales.mul_", "zeros[0].add_"])
def test_rejects_in_place_write_to_packed_weight_between_dequant_and_use(view):
    _assert_left_alone(MutatedBetween(view), torch.randn(2, 64).half(), r"writes in place to the packed weight")


def test_in_place_write_after_the_use_does_not_block_the_rewrite():
    class After(MutatedBetween):
        def forward(self, x):
            w = torch.ops.fxopt.dequantize_w4(self.q.qweight, self.q.scales, self.q.zeros, 32)
            y = torch.nn.functional.linear(x, w, self.q.bias)
            self.q.scales.mul_(1.0)
            return y

    out, graphs = capture(After(False), torch.randn(2, 64).half())
    assert w4_result(graphs).rewrites == 1


class Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = qlinear(64, 32, 32)

    def forward(self, x):
        return self.q(x.transpose(0, 1))


def test_rejects_input_with_non_unit_stride_along_k():
    _assert_left_alone(Strided(), torch.randn(64, 5).half(), r"input layout .* stride \(1, 5\)")


def test_rejects_3d_input_whose_rows_do_not_collapse():
    _assert_left_alone(Strided(), torch.randn(3, 2, 64).half(), r"input layout size \(2, 3, 64\)")


def test_accepts_3d_input_sliced_to_one_position():
    class LastToken(Strided):
        def forward(self, x):
            return self.q(x[:, -1:, :])

    x = torch.randn(2, 5, 64).half()
    model = LastToken()
    ref = model(x)
    out, graphs = capture(model, x)
    assert w4_result(graphs).rewrites == 1
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


class TransposedScales(nn.Module):
    """scales kept as [N, K // G] and handed over as a transposed (non-contiguous) view."""

    def __init__(self):
        super().__init__()
        q = qlinear(64, 32, 32)
        self.qweight, self.zeros = q.qweight, q.zeros
        self.register_buffer("scales_nk", q.scales.t().contiguous())

    def forward(self, x):
        w = torch.ops.fxopt.dequantize_w4(self.qweight, self.scales_nk.t(), self.zeros, 32)
        return torch.nn.functional.linear(x, w)


def test_rejects_non_contiguous_packed_tensor():
    _assert_left_alone(TransposedScales(), torch.randn(2, 64).half(), r"scales is not contiguous")


def _fake_graph(x, qweight, scales, zeros, group_size, bias=None):
    """``linear(x, dequantize_w4(...), bias)`` with hand-set fake ``meta["val"]`` (values eager would refuse)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g = fx.Graph()
    names = ["x", "qweight", "scales", "zeros"] + (["bias"] if bias is not None else [])
    nodes = {}
    for name, t in zip(names, (x, qweight, scales, zeros, bias)):
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = mode.from_tensor(t)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    dq = g.call_function(torch.ops.fxopt.dequantize_w4.default,
                         (nodes["qweight"], nodes["scales"], nodes["zeros"], group_size))
    dq.meta["val"] = mode.from_tensor(torch.empty(N, K, dtype=scales.dtype))
    lin = g.call_function(torch._C._nn.linear, (nodes["x"], dq, nodes.get("bias")))
    lin.meta["val"] = mode.from_tensor(torch.empty(*x.shape[:-1], N, dtype=x.dtype))
    g.output(lin)
    gm = fx.GraphModule(nn.Module(), g)
    gm, results = run_passes(gm, [], Config())
    res = [r for r in results if r.name == "w4a16"][0]
    assert res.rewrites == 0 and count(gm, W4A16) == 0 and count(gm, DEQUANT) == 1
    return [s.reason for s in res.skipped]


def _parts(K=64, N=32, G=32, dtype=torch.float16):
    p = packed(K, N, G, dtype)
    return p.qweight, p.scales, p.zeros


def test_rejects_bias_in_another_dtype():
    qw, s, z = _parts()
    reasons = _fake_graph(torch.randn(2, 64).half(), qw, s, z, 32, bias=torch.randn(32))
    assert reasons == ["bias dtype torch.float32 differs from activation dtype torch.float16"]


def test_rejects_group_size_that_does_not_divide_k():
    qw = pack_int4(torch.randint(0, 16, (96, 32)))
    s, z = torch.ones(1, 32).half(), torch.full((1, 32), 8.0).half()
    assert _fake_graph(torch.randn(2, 96).half(), qw, s, z, 64) == ["group size 64 does not divide K = 96"]


def test_rejects_scales_of_the_wrong_shape():
    qw, s, z = _parts()
    reasons = _fake_graph(torch.randn(2, 64).half(), qw, s[:1], z, 32)
    assert reasons == ["scales shape (1, 32) is not [K // G, N] = [2, 32] (K=64, group 32)"]


def test_rejects_packed_weight_that_is_not_int32():
    qw, s, z = _parts()
    reasons = _fake_graph(torch.randn(2, 64).half(), qw.to(torch.int64), s, z, 32)
    assert reasons == ["qweight is torch.int64 2-D; the packed weight is int32 [K // 8, N]"]


def test_rejects_input_features_other_than_k():
    qw, s, z = _parts()
    reasons = _fake_graph(torch.randn(2, 72).half(), qw, s, z, 32)
    assert reasons == ["input has 72 features, not provably the packed weight's K = 64"]


def test_dynamic_shapes_still_fuse():
    """dynamic=True: batch and sequence are symbolic; K is known equal to the packed weight's, the rows collapse for
    every size, so both quantized linears fuse in the one graph, and outputs match eager at two shapes."""
    graphs = []

    def backend(gm, example_inputs):
        gm, results = run_passes(gm, example_inputs, Config())
        graphs.append(results)
        return gm.forward

    model = MLP()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for shape in [(2, 3, 64), (4, 5, 64)]:
        x = torch.randn(*shape).half()
        torch.testing.assert_close(compiled(x).float(), model(x).float(), atol=5e-2, rtol=2e-2)
    assert [r.rewrites for results in graphs for r in results if r.name == "w4a16"] == [2]


@pytest.mark.parametrize("rows,dequant_matmul,fused", [(1023, "auto", True), (1024, "auto", False),
                                                        (2048, "auto", False), (2048, "off", True),
                                                        (2048, "on", True)])
def test_prefill_rows_left_as_dequantize_and_cublas(rows, dequant_matmul, fused):
    """From DEQUANT_MATMUL_MIN_ROWS static rows (``auto``) the graph keeps dequantize_w4 -> linear, with the reason;
    other settings (or fewer rows) fuse. Values equal eager's either way."""
    from fxopt.passes import w4a16

    assert w4a16.DEQUANT_MATMUL_MIN_ROWS == 1024
    lin = qlinear(64, 32, 32, torch.float16, bias=True, seed=5)
    x = torch.randn(rows, 64).half()
    cfg = Config()
    cfg.kernels.w4a16_dequant_matmul = dequant_matmul
    out, graphs = capture(lin, x, config=cfg)
    (gm, _), = graphs
    assert count(gm, W4A16) == int(fused) and count(gm, DEQUANT) == int(not fused)
    if not fused:
        assert any("left as dequantize_w4 -> linear" in s.reason for s in w4_result(graphs).skipped)
    # unfused: the same ops as eager; fused: the reference accumulates in float32
    tol = dict(rtol=2e-3, atol=2e-3) if fused else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, lin(x), **tol)
