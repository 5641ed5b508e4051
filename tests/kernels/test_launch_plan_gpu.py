"""Launch plans on the GPU: a replayed call of the attention entry points gives what the ordinary path gives, on
fresh inputs, for each route (Gluon forward / backward at d = 64 / 128 / 256, the Triton kernels, masks, GQA,
[B, S, H, D] views, split-KV decode)."""
import pytest
import torch

from fxopt.kernels import attention as A
from fxopt.kernels import launch_plan as LP

pytestmark = pytest.mark.gpu

# name: (B, Hq, Hkv, Sq, Sk, D, causal, extra); extra: "bshd" | "mask" | "kpm" | "window" | "softcap" | ""
CASES = {
    "gluon_d128": (2, 4, 4, 1024, 1024, 128, False, ""),
    "gluon_d128_causal": (2, 4, 4, 1024, 1024, 128, True, ""),
    "gluon_d64_gqa": (2, 8, 2, 1024, 1024, 64, True, ""),
    "gluon_d256": (1, 4, 4, 640, 640, 256, False, ""),
    "gluon_d128_bshd": (2, 4, 4, 768, 768, 128, True, "bshd"),
    "triton_small": (2, 3, 3, 128, 128, 128, False, ""),
    "triton_ragged": (1, 2, 2, 200, 333, 96, True, ""),
    "float_mask": (2, 2, 2, 256, 256, 64, False, "mask"),
    "key_padding": (2, 2, 2, 256, 256, 64, False, "kpm"),
    "window": (1, 2, 2, 512, 512, 128, True, "window"),
    "softcap": (1, 2, 2, 256, 256, 128, False, "softcap"),
    "decode": (2, 8, 2, 1, 4096, 128, False, ""),
}


def _inputs(case, seed):
    B, Hq, Hkv, Sq, Sk, D, causal, extra = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    if extra == "bshd":
        q, k, v = (r(B, S, H, D).transpose(1, 2) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    else:
        q, k, v = r(B, Hq, Sq, D), r(B, Hkv, Sk, D), r(B, Hkv, Sk, D)
    kw = dict(is_causal=causal)
    if extra == "mask":
        kw["attn_mask"] = r(B, 1, Sq, Sk)
    if extra == "kpm":
        kpm = torch.ones(B, Sk, dtype=torch.bool, device="cuda")
        kpm[0, Sk // 2:] = False
        kw["key_padding_mask"] = kpm
    if extra == "window":
        kw["window"] = 100
    if extra == "softcap":
        kw["softcap"] = 30.0
    return q, k, v, kw


def _close(a, b, what):
    # dQ is summed with atomics / TMA reduce-adds: its order, so its last bits, differ from run to run
    if what == "dq":
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * b.float().abs().max().item() + 1e-3, (what, err)
    else:
        assert torch.equal(a, b), (what, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_forward_and_backward_match_the_ordinary_path(case):
    LP.clear_plans()
    fwd, bwd = A.flash_attention_triton, A.flash_attention_triton_bwd
    for seed in (0, 1):  # ordinary, then recorded
        q, k, v, kw = _inputs(case, seed)
        out, lse = fwd(q, k, v, return_lse=True, **kw)
        bwd(torch.randn_like(out), q, k, v, out, lse, **kw)
    q, k, v, kw = _inputs(case, 2)
    do = torch.randn_like(q)
    before = LP.stats["replayed"]
    out, lse = fwd(q, k, v, return_lse=True, **kw)
    dq, dk, dv = bwd(do, q, k, v, out, lse, **kw)
    replayed = LP.stats["replayed"] - before
    ref_out, ref_lse = fwd.__wrapped__(q, k, v, return_lse=True, **kw)
    ref = bwd.__wrapped__(do, q, k, v, ref_out, ref_lse, **kw)
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        _close(a, b, name)
        assert a.stride() == b.stride() and a.dtype == b.dtype, name
    assert out.stride() == ref_out.stride()
    fplan = LP.plan_for(fwd, q, k, v, return_lse=True, **kw)
    bplan = LP.plan_for(bwd, do, q, k, v, out, lse, **kw)
    if case.startswith("gluon") or case.startswith("triton"):
        # the unmasked routes must replay: that is where the eager op's host time was
        assert isinstance(fplan, LP.Plan), fplan
        assert isinstance(bplan, LP.Plan), bplan
        assert replayed == 2
    print(case, "forward plan:", type(fplan).__name__ if fplan.__class__ is LP.Plan else fplan,
          "backward plan:", type(bplan).__name__ if bplan.__class__ is LP.Plan else bplan)


def test_replay_on_a_side_stream_and_under_cuda_graph_capture():
    LP.clear_plans()
    q, k, v, kw = _inputs("gluon_d128_causal", 0)
    for _ in range(2):
        A.flash_attention_triton(q, k, v, return_lse=True, **kw)
    ref, _ = A.flash_attention_triton.__wrapped__(q, k, v, return_lse=True, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, _ = A.flash_attention_triton(q, k, v, return_lse=True, **kw)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout, _ = A.flash_attention_triton(q, k, v, return_lse=True, **kw)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref2, _ = A.flash_attention_triton.__wrapped__(q, k, v, return_lse=True, **kw)
    assert torch.equal(gout, ref2)


def test_op_training_step_replays_and_matches_plans_off(monkeypatch):
    """The eager op (autograd through _EagerFlashAttention): gradients with plans equal those without."""
    q, k, v, _ = _inputs("gluon_d128_causal", 3)
    do = torch.randn_like(q)

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = torch.ops.fxopt.flash_attention(qq, kk, vv, is_causal=True)
        return (o, *torch.autograd.grad(o, (qq, kk, vv), do))

    LP.clear_plans()
    before = LP.stats["replayed"]
    got = [step() for _ in range(3)][-1]
    assert LP.stats["replayed"] - before == 2
    monkeypatch.setattr(LP, "ENABLED", False)
    want = step()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        _close(a, b, name)
