"""The eager fast path of ``fxopt::flash_attention`` (``attention.ops._EagerFlashAttention``): the same bodies as the
custom ops under a plain autograd.Function, taken only by real tensors outside any tracing (the custom
op's Python autograd layer costs ~0.5 ms of host time per fwd+bwd on the H200 box)."""
import pytest
import torch

import fxopt.kernels.attention as A
from fxopt.kernels.attention.ops import _eager_fast_path_ok

CASES = {  # name: (B, Hq, Hkv, Sq, Sk, D), op kwargs
    "plain": ((1, 2, 2, 24, 24, 16), {}),
    "causal_gqa_ragged": ((2, 4, 2, 20, 28, 16), dict(is_causal=True)),
    "float_mask_scale": ((1, 2, 2, 16, 24, 8), dict(attn_mask="float", scale=0.3)),
    "bool_mask_window_softcap": ((1, 2, 1, 24, 24, 16), dict(attn_mask="bool", window=5, softcap=20.0)),
    "dropout": ((1, 2, 2, 16, 16, 16), dict(dropout_p=0.3)),
}


def _args(name, dtype=torch.float32):
    (B, Hq, Hkv, Sq, Sk, D), kw = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    q, k, v = (torch.randn(B, h, s, D, generator=g, dtype=dtype).requires_grad_()
               for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    kw = dict(kw)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, 1, Sq, Sk, generator=g)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    return q, k, v, kw


def _op(q, k, v, fast=True, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, window=-1, softcap=0.0,
        key_padding_mask=None):
    """The public op (eager: the fast path), or (``fast=False``) the custom-op path it takes under tracing."""
    if fast:
        return torch.ops.fxopt.flash_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                               key_padding_mask)
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64) if dropout_p > 0 else None  # as the public op
    return torch.ops.fxopt.flash_attention_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, window, softcap,
                                               key_padding_mask, seed)[0]


def _run(q, k, v, kw, seed=0, fast=True):
    torch.manual_seed(seed)  # the dropout seed is drawn from torch's default generator
    out = _op(q, k, v, fast, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("name", list(CASES))
def test_eager_function_matches_the_custom_ops_bit_for_bit(name):
    q, k, v, kw = _args(name)
    assert _eager_fast_path_ok(q, k, v, kw.get("attn_mask"))
    fast = _run(q, k, v, kw)
    slow = _run(q, k, v, kw, fast=False)
    for a, b in zip(fast, slow):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    if "dropout_p" not in kw:  # and both agree with the float64 reference
        ref = A.attention_reference(q.detach(), k.detach(), v.detach(), **kw, compute_dtype=torch.float64)
        assert (fast[0].double() - ref.double()).abs().max().item() < 1e-4


def test_eager_function_not_taken_under_tracing_or_transforms():
    """Fake tensors, make_fx and vmap keep the custom ops: the traced graph holds ``flash_attention_fwd`` (opaque to
    Inductor) and its autograd, never the Python Function."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, _ = _args("plain")
    qd = q.detach()
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(qd)
        assert not _eager_fast_path_ok(fq)
        assert torch.ops.fxopt.flash_attention(fq, fq, fq).shape == q.shape
    gm = make_fx(lambda a, b, c: torch.ops.fxopt.flash_attention(a, b, c, is_causal=True))(
        q.detach(), k.detach(), v.detach())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("flash_attention_fwd" in t for t in targets), targets
    seen = []
    torch.vmap(lambda a: seen.append(_eager_fast_path_ok(a)) or a.sum())(torch.ones(3, 2))
    assert seen == [False]


def _recording_aot_backend(graphs: list):
    """aot_eager that appends every forward / backward graph it compiles to ``graphs``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler

    def record(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=make_boxed_compiler(record), bw_compiler=make_boxed_compiler(record))


def test_eager_function_under_torch_compile_keeps_custom_op():
    """torch.compile (aot_eager) of a function calling the op: same output and gradients as eager, and the
    compiled forward graph calls the custom op."""
    graphs = []
    backend = _recording_aot_backend(graphs)
    q, k, v, kw = _args("causal_gqa_ragged")
    fn = lambda a, b, c: torch.ops.fxopt.flash_attention(a, b, c, **kw)  # noqa: E731
    eager = _run(q, k, v, kw)
    torch._dynamo.reset()
    cfn = torch.compile(fn, backend=backend, fullgraph=True)
    out = cfn(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    compiled = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    fw_targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("flash_attention_fwd" in t for t in fw_targets), fw_targets


@pytest.mark.parametrize("fast", [True, False])
def test_double_backward_raises_on_both_paths(fast):
    """The backward is not differentiable: create_graph=True followed by a second grad raises on both paths, never a
    silent zero second derivative."""
    q, k, v, kw = _args("plain")
    out = _op(q, k, v, fast, **kw)
    with pytest.raises(RuntimeError):
        dq, = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
        torch.autograd.grad(dq.sum(), (q,))


MASK_GRAD_CASES = {  # name: (B, Hq, Hkv, Sq, Sk, D), mask shape, op kwargs
    "full": ((2, 4, 2, 12, 20, 16), (2, 4, 12, 20), {}),
    "per_head_causal": ((1, 2, 2, 16, 16, 8), (1, 2, 16, 16), dict(is_causal=True)),
    "2d_softcap_scale": ((2, 2, 1, 10, 14, 16), (10, 14), dict(softcap=5.0, scale=0.4)),
    "key_bias_window": ((2, 2, 2, 16, 16, 8), (2, 1, 1, 16), dict(window=4)),
}


@pytest.mark.parametrize("fast", [True, False], ids=["function", "custom_op"])
@pytest.mark.parametrize("name", list(MASK_GRAD_CASES))
def test_learned_additive_mask_gets_its_gradient(name, fast):
    """An additive float attn_mask that requires grad (a learned bias) gets dL/dmask, summed over the dims it
    broadcasts along, on both eager paths; with None the bias would silently stop learning."""
    (B, Hq, Hkv, Sq, Sk, D), mshape, kw = MASK_GRAD_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    q, k, v = (torch.randn(B, h, s, D, generator=g).requires_grad_() for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    bias = (torch.randn(mshape, generator=g) * 0.7).requires_grad_()
    dout = torch.randn(B, Hq, Sq, D, generator=g)
    out = _op(q, k, v, fast, attn_mask=bias, **kw)
    got = torch.autograd.grad(out, (q, k, v, bias), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = A.attention_reference(*ref_in[:3], attn_mask=ref_in[3], compute_dtype=torch.float64, **kw)
    want = torch.autograd.grad(ref, ref_in, dout.double())
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a.double() - b).abs().max().item() < 1e-4
    # a mask that does not require grad: no mask gradient computed, the others unchanged
    out2 = _op(q, k, v, fast, attn_mask=bias.detach(), **kw)
    for a, b in zip(torch.autograd.grad(out2, (q, k, v), dout), got[:3]):
        assert torch.equal(a, b)


def test_learned_mask_gradient_through_aot_autograd():
    """The compiled backward (AOTAutograd) calls ``fxopt::flash_attention_mask_grad``: same gradients as eager."""
    graphs = []
    backend = _recording_aot_backend(graphs)
    (B, Hq, Hkv, Sq, Sk, D), mshape, kw = MASK_GRAD_CASES["full"]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, s, D, generator=g).requires_grad_() for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
    bias = torch.randn(mshape, generator=g).requires_grad_()
    fn = lambda a, b, c, m: torch.ops.fxopt.flash_attention(a, b, c, attn_mask=m, **kw)  # noqa: E731
    eager = torch.autograd.grad(fn(q, k, v, bias).sum(), (q, k, v, bias))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, bias).sum(),
                                   (q, k, v, bias))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    bw_targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("flash_attention_mask_grad" in t for t in bw_targets), bw_targets
