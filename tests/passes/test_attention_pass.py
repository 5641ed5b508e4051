"""Unit tests of the attention pass on small captured graphs (CPU reference path of the op, fp32)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.config import Config
from fxopt.passes import run_passes

FLASH = torch.ops.fxopt.flash_attention.default if hasattr(torch.ops.fxopt, "flash_attention") else None


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


class Captured:
    """Compile ``fn`` with the passes only (no Inductor) and keep the rewritten graphs and pass results."""

    def __init__(self, fn, cfg=None, dynamic=None):
        self.cfg = cfg or Config()
        self.graphs, self.results = [], []
        torch._dynamo.reset()

        def backend(gm, example_inputs):
            gm, res = run_passes(gm, example_inputs, self.cfg)
            self.graphs.append(gm)
            self.results.append(res)
            return gm.forward

        self.compiled = torch.compile(fn, backend=backend, dynamic=dynamic)

    def __call__(self, *args):
        return self.compiled(*args)

    def flash_nodes(self):
        import fxopt.kernels.ops  # noqa: F401

        return [n for gm in self.graphs for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (torch.ops.fxopt.flash_attention.default, torch.ops.fxopt.flash_attention_fwd.default)]

    def attn(self):
        return [r for res in self.results for r in res if r.name == "attention"]

    @property
    def rewrites(self):
        return sum(r.rewrites for r in self.attn())

    @property
    def skipped(self):
        return [s for r in self.attn() for s in r.skipped]

    def has(self, pred):
        return any(pred(n) for gm in self.graphs for n in gm.graph.nodes)


def _ref64(fn, *args):
    return fn(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])


def _check(fn, *args, rewrites=1, atol=1e-5, cfg=None):
    cap = Captured(fn, cfg)
    out = cap(*args)
    ref = _ref64(fn, *args)
    assert cap.rewrites == rewrites, [s.reason for s in cap.skipped]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-4)
    return cap


def _kw(cap, i=0):
    return cap.flash_nodes()[i].kwargs


# ---------------------------------------------------------------------------------------------------------------
# hand-written forms
# ---------------------------------------------------------------------------------------------------------------


def causal_tril(q, k, v):  # fxopt/models.py's hand-written form
    S = q.shape[2]
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def test_causal_tril_is_lowered():
    q, k, v = _rand(2, 4, 8, 16, seed=1), _rand(2, 4, 8, 16, seed=2), _rand(2, 4, 8, 16, seed=3)
    cap = _check(causal_tril, q, k, v)
    kw = _kw(cap)
    assert kw.get("is_causal") is True and kw.get("attn_mask") is None
    assert not cap.has(lambda n: n.target in (torch.tril, torch.softmax, torch.matmul) or n.target == "tril")


@pytest.mark.parametrize("form", ["div_sqrt", "mul_number", "q_scaled", "k_scaled", "torch_sqrt", "div_number"])
def test_scale_forms(form):
    D = 16

    def fn(q, k, v):
        if form == "div_sqrt":
            s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        elif form == "mul_number":
            s = (q @ k.transpose(-2, -1)) * 0.3
        elif form == "q_scaled":
            s = (q * D ** -0.5) @ k.transpose(-2, -1)
        elif form == "k_scaled":
            s = q @ (k.transpose(-2, -1) / 3.0)
        elif form == "torch_sqrt":
            s = (q @ k.transpose(-2, -1)) / torch.sqrt(torch.tensor(float(D)))
        else:
            s = (q @ k.transpose(-2, -1)).div(2.5)
        return s.softmax(dim=-1) @ v

    q, k, v = _rand(1, 2, 6, D, seed=4), _rand(1, 2, 6, D, seed=5), _rand(1, 2, 6, D, seed=6)
    cap = _check(fn, q, k, v)
    expect = {"div_sqrt": 1 / math.sqrt(D), "mul_number": 0.3, "q_scaled": D ** -0.5, "k_scaled": 1 / 3.0,
              "torch_sqrt": 1 / math.sqrt(D), "div_number": 1 / 2.5}[form]
    assert math.isclose(_kw(cap)["scale"], expect, rel_tol=1e-6)


def test_bmm_three_d():
    def fn(q, k, v):
        return torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25, dim=-1), v)

    q, k, v = _rand(6, 5, 16, seed=7), _rand(6, 7, 16, seed=8), _rand(6, 7, 16, seed=9)
    _check(fn, q, k, v)


def test_einsum_bshd():
    def fn(q, k, v):  # q, k, v: [B, S, H, D]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    q, k, v = _rand(2, 6, 3, 16, seed=10), _rand(2, 7, 3, 16, seed=11), _rand(2, 7, 3, 16, seed=12)
    _check(fn, q, k, v)


def test_permute_bshd_matmul():
    def fn(q, k, v):  # [B, S, H, D] → [B, H, S, D] via permute / transpose
        q, k, v = q.permute(0, 2, 1, 3), k.transpose(1, 2), v.transpose(1, 2)
        s = torch.matmul(q, k.permute(0, 1, 3, 2)) * 0.25
        out = torch.matmul(torch.softmax(s, -1), v)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    q, k, v = _rand(2, 6, 3, 16, seed=13), _rand(2, 6, 3, 16, seed=14), _rand(2, 6, 3, 16, seed=15)
    _check(fn, q, k, v)


def test_additive_float_mask_passed():
    def fn(q, k, v, m):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + m, -1) @ v

    q, k, v = _rand(2, 2, 5, 16, seed=16), _rand(2, 2, 5, 16, seed=17), _rand(2, 2, 5, 16, seed=18)
    m = _rand(2, 1, 5, 5, seed=19)
    cap = _check(fn, q, k, v, m)
    assert _kw(cap)["attn_mask"].op == "placeholder"


def test_masked_fill_finfo_min_causal_lowered():
    def fn(q, k, v):
        S = q.shape[-2]
        s = q @ k.transpose(-1, -2) * 0.25
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
        return F.softmax(s, dim=-1, dtype=torch.float32).type_as(q) @ v

    q, k, v = _rand(1, 2, 7, 16, seed=20), _rand(1, 2, 7, 16, seed=21), _rand(1, 2, 7, 16, seed=22)
    cap = _check(fn, q, k, v)
    assert _kw(cap).get("is_causal") is True and _kw(cap).get("attn_mask") is None


def test_data_mask_not_lowered_bool_masked_fill():
    def fn(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
        return s.softmax(-1) @ v

    q, k, v = _rand(1, 2, 6, 16, seed=23), _rand(1, 2, 6, 16, seed=24), _rand(1, 2, 6, 16, seed=25)
    keep = _rand(1, 1, 6, 6, seed=26) > -0.5
    keep[..., 0] = True
    cap = _check(fn, q, k, v, keep)
    assert _kw(cap)["attn_mask"] is not None and not _kw(cap).get("is_causal", False)


def test_lower_masks_off_keeps_tensor():
    cfg = Config.from_options({"attention.lower_masks": False})
    q, k, v = _rand(1, 2, 8, 16, seed=27), _rand(1, 2, 8, 16, seed=28), _rand(1, 2, 8, 16, seed=29)
    cap = _check(causal_tril, q, k, v, cfg=cfg)
    assert _kw(cap)["attn_mask"] is not None and not _kw(cap).get("is_causal", False)


class NanoGPTAttn(nn.Module):
    def __init__(self, C=32, H=2, T=16):
        super().__init__()
        self.H = H
        self.c_attn = nn.Linear(C, 3 * C)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.H, C // self.H).transpose(1, 2)
        k = k.view(B, T, self.H, C // self.H).transpose(1, 2)
        v = v.view(B, T, self.H, C // self.H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = torch.where(self.bias[:, :, :T, :T] == 0, float("-inf"), att)
        att = F.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).contiguous().view(B, T, C)


def test_where_on_causal_buffer_slice():
    torch.manual_seed(0)
    m = NanoGPTAttn().double().float()
    x = _rand(2, 10, 32, seed=30)
    cap = Captured(m)
    out = cap(x)
    assert cap.rewrites == 1
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-4)
    # the buffer is data (it may be changed in place), so the mask stays a tensor
    assert _kw(cap)["attn_mask"] is not None


def test_dropout_eval_removed_and_training_kept():
    def fn(q, k, v, training: bool):
        p = F.dropout(torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1), p=0.3, training=training)
        return p @ v

    q, k, v = _rand(1, 2, 6, 16, seed=31), _rand(1, 2, 6, 16, seed=32), _rand(1, 2, 6, 16, seed=33)
    cap = _check(lambda q, k, v: fn(q, k, v, False), q, k, v)
    assert "dropout_p" not in _kw(cap)
    cap = Captured(lambda q, k, v: fn(q, k, v, True))
    out = cap(q, k, v)
    assert cap.rewrites == 1 and _kw(cap)["dropout_p"] == pytest.approx(0.3)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert not cap.has(lambda n: n.target is F.dropout)


def repeat_kv(x, rep):
    B, H, S, D = x.shape
    return x[:, :, None, :, :].expand(B, H, rep, S, D).reshape(B, H * rep, S, D)


def test_repeat_kv_becomes_native_gqa():
    def fn(q, k, v):
        k, v = repeat_kv(k, 3), repeat_kv(v, 3)
        return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25, dim=-1) @ v

    q, k, v = _rand(2, 6, 5, 16, seed=34), _rand(2, 2, 5, 16, seed=35), _rand(2, 2, 5, 16, seed=36)
    cap = _check(fn, q, k, v)
    node = cap.flash_nodes()[0]
    assert node.args[1].meta["val"].shape[1] == 2 and node.args[2].meta["val"].shape[1] == 2
    assert not cap.has(lambda n: n.target in ("expand", "reshape"))


def test_softcap():
    def fn(q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.25
        s = torch.tanh(s / 5.0) * 5.0
        return torch.softmax(s, -1) @ v

    q, k, v = (_rand(1, 2, 6, 16, seed=s) * 3 for s in (37, 38, 39))
    cap = _check(fn, q, k, v)
    assert _kw(cap)["softcap"] == pytest.approx(5.0)


# ---------------------------------------------------------------------------------------------------------------
# SDPA
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Sq,Sk", [(8, 8), (5, 8), (8, 5)])
def test_sdpa_causal_alignment(Sq, Sk):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = _rand(1, 2, Sq, 16, seed=40), _rand(1, 2, Sk, 16, seed=41), _rand(1, 2, Sk, 16, seed=42)
    cap = _check(fn, q, k, v)
    if Sq == Sk:
        assert _kw(cap).get("is_causal") is True
    else:  # SDPA is top-left aligned, the kernel bottom-right: an explicit mask
        assert _kw(cap)["attn_mask"] is not None and not _kw(cap).get("is_causal", False)


def test_sdpa_gqa_scale_and_bool_mask():
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.2, enable_gqa=True)

    q, k, v = _rand(2, 4, 6, 16, seed=43), _rand(2, 2, 6, 16, seed=44), _rand(2, 2, 6, 16, seed=45)
    m = _rand(2, 1, 6, 6, seed=46) > 0
    cap = _check(fn, q, k, v, m)
    assert _kw(cap)["scale"] == pytest.approx(0.2) and _kw(cap)["attn_mask"].op == "placeholder"


def test_sdpa_float_mask_values_match():
    """SDPA with an additive float mask (broadcast over heads, -inf entries) is rewritten and matches eager."""
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    q, k, v = _rand(2, 4, 6, 16, seed=47), _rand(2, 4, 9, 16, seed=48), _rand(2, 4, 9, 16, seed=49)
    m = _rand(2, 1, 6, 9, seed=50)
    m[:, :, :, :2] = float("-inf")
    cap = _check(fn, q, k, v, m)
    assert _kw(cap)["attn_mask"].op == "placeholder" and not _kw(cap).get("is_causal", False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_fp32_softmax_cast_back(dtype):
    """The usual half-precision form: scores and softmax in fp32, probabilities cast back to q's dtype before the
    value product. The casts are real here (half inputs), the chain is matched and the result matches eager."""
    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        S = q.shape[-2]
        s = s.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1), float("-inf"))
        return torch.softmax(s, dim=-1).to(q.dtype) @ v

    q, k, v = (_rand(1, 2, 7, 16, seed=s).to(dtype) for s in (64, 65, 66))
    cap = Captured(fn)
    out = cap(q, k, v)
    assert cap.rewrites == 1, [s.reason for s in cap.skipped]
    assert _kw(cap).get("is_causal") is True and out.dtype == dtype
    ref = fn(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)


def test_sdpa_repeat_kv_and_dropout():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), dropout_p=0.1)

    q, k, v = _rand(1, 4, 6, 16, seed=47), _rand(1, 2, 6, 16, seed=48), _rand(1, 2, 6, 16, seed=49)
    cap = Captured(fn)
    out = cap(q, k, v)
    assert cap.rewrites == 1 and _kw(cap)["dropout_p"] == pytest.approx(0.1)
    assert cap.flash_nodes()[0].args[1].meta["val"].shape[1] == 2
    assert out.shape == q.shape


# ---------------------------------------------------------------------------------------------------------------
# left alone, with a reason
# ---------------------------------------------------------------------------------------------------------------


def test_unsupported_left_alone():
    def big_head(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    q = _rand(1, 1, 4, 300, seed=50)
    cap = _check(big_head, q, q, q, rewrites=0)
    assert any("head dim" in s.reason for s in cap.skipped)

    def other_dim(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), 2) @ v

    q = _rand(1, 1, 4, 16, seed=51)
    cap = _check(other_dim, q, q, q, rewrites=0)
    assert any("last dim" in s.reason for s in cap.skipped)

    def weights_returned(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), -1)
        return p @ v, p

    cap = Captured(weights_returned)
    out, p = cap(q, q, q)
    assert cap.rewrites == 0 and any("used elsewhere" in s.reason for s in cap.skipped)

    def fp64(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    qd = q.double()
    cap = _check(fp64, qd, qd, qd, rewrites=0)
    assert any("dtype" in s.reason for s in cap.skipped)


@pytest.mark.parametrize("form", ["sdpa", "hand_written"])
def test_learned_bias_left_alone_and_its_gradient_kept(form):
    """An additive mask that requires grad (T5-style learned position bias) stays on the original subgraph, with
    the reason; its gradient matches eager. The same bias without grad is rewritten."""
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(_rand(1, 2, 6, 6, seed=60) * 0.5)

        def forward(self, q, k, v):
            if form == "sdpa":
                return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
            return torch.softmax(q @ k.transpose(-1, -2) / 4.0 + self.bias, -1) @ v

    m = Biased()
    q, k, v = (_rand(1, 2, 6, 16, seed=s).requires_grad_() for s in (61, 62, 63))
    m(q, k, v).square().sum().backward()
    want = m.bias.grad.clone()
    m.bias.grad = None
    cap = Captured(m)
    cap(q, k, v).square().sum().backward()
    assert cap.rewrites == 0 and any("learned bias" in s.reason for s in cap.skipped), cap.skipped
    torch.testing.assert_close(m.bias.grad, want, atol=1e-5, rtol=1e-4)
    m.bias.requires_grad_(False)
    cap = Captured(m)
    cap(q, k, v)
    assert cap.rewrites == 1, [s.reason for s in cap.skipped]


def test_explain_reports_rewrite():
    q, k, v = _rand(2, 4, 8, 16, seed=52), _rand(2, 4, 8, 16, seed=53), _rand(2, 4, 8, 16, seed=54)
    rep = fxopt.explain(causal_tril, q, k, v)
    assert rep.rewrites["attention"] == 1 and rep.graph_breaks == 0


def test_gradients_match():
    q, k, v = (_rand(1, 2, 6, 16, seed=s).requires_grad_() for s in (55, 56, 57))
    cap = Captured(causal_tril)
    cap(q, k, v).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    causal_tril(q, k, v).square().sum().backward()
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-4)
    assert cap.rewrites == 1


def test_fp8_routing_for_inference_and_fallback_with_reason(monkeypatch):
    """attention.fp8 routes eligible inference attention to fxopt::fp8_attention and says why it does not elsewhere."""
    import torch.nn.functional as F

    import fxopt
    import fxopt.passes.attention.rewrite as attention_rewrite

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = [torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3)]
    cfg = fxopt.Config.from_options({"attention.fp8": True})
    # On CPU without the reference allowed: bf16/fp16 kernel, with the reason in the notes.
    report = fxopt.explain(f, q, k, v, config=cfg)
    assert report.rewrites["attention"] == 1
    assert any("fp8 not used" in n and "CUDA" in n for n in report.notes), report.notes
    # With the CPU reference allowed, the FP8 op is used and matches float attention within FP8 error.
    monkeypatch.setattr(attention_rewrite, "FP8_ALLOW_CPU_REFERENCE", True)
    backend = fxopt.Backend(cfg, inductor=False)
    graphs = []

    def recording(gm, example_inputs):
        fn = backend(gm, example_inputs)
        graphs.append(gm)
        return fn

    with torch.no_grad():
        out = torch.compile(f, backend=recording)(q, k, v)
    torch._dynamo.reset()
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.fxopt.fp8_attention.default in targets, targets
    assert torch.ops.fxopt.flash_attention.default not in targets
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    rmse = ((out.double() - ref) ** 2).mean().sqrt().item()
    assert rmse < 3e-2, rmse


# --- dynamic shapes -----------------------------------------------------------------------------------------------
class _SdpaBlock(nn.Module):
    """[B, S, 4*D] -> SDPA over 4 heads (GQA 4:2 through enable_gqa), causal."""

    def __init__(self, head_dim=8):
        super().__init__()
        self.d = head_dim
        self.q = nn.Linear(4 * head_dim, 4 * head_dim)
        self.kv = nn.Linear(4 * head_dim, 4 * head_dim)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, 4, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, 2, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, S, 4 * self.d)


def test_dynamic_batch_and_length_are_rewritten_and_match_eager():
    """Dynamo's dynamic shapes (symbolic B and S): the kernel takes them at run time, so the pass rewrites anyway."""
    torch.manual_seed(0)
    model = _SdpaBlock().eval()
    cap = Captured(model, dynamic=True)
    with torch.no_grad():
        for shape in [(2, 12, 32), (3, 5, 32), (1, 17, 32)]:
            x = _rand(*shape, seed=shape[1])
            torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)
    assert cap.graphs and all(any(isinstance(d, torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder"
                                  for d in getattr(n.meta.get("val"), "shape", ())) for gm in cap.graphs)
    assert len(cap.flash_nodes()) == len(cap.graphs) and not cap.skipped


def test_dynamic_shapes_pass_masks_as_tensors_and_keep_dynamic_heads_as_they_were():
    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (_rand(1, 2, 6, 8, seed=i) for i in range(3))
    mask = _rand(1, 1, 6, 6, seed=5) > 0
    mask[..., 0] = True
    # symbolic sequence lengths (heads and head dim static) with a mask: the mask goes to the kernel as a tensor
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 2)
    torch._dynamo.mark_dynamic(mask, 2)
    torch._dynamo.mark_dynamic(mask, 3)
    cap = Captured(f)
    torch.testing.assert_close(cap(q, k, v, mask), f(q, k, v, mask))
    (node,) = cap.flash_nodes()
    assert node.kwargs.get("attn_mask") is not None and not cap.skipped
    # everything symbolic: the head count and head dim pick the kernel's configuration
    cap = Captured(f, dynamic=True)
    q, k, v = (_rand(1, 2, 6, 8, seed=i) for i in range(3))
    torch.testing.assert_close(cap(q, k, v, None), f(q, k, v, None))
    assert not cap.flash_nodes()
    assert any("dynamic head count or head dim" in s.reason for s in cap.skipped), cap.skipped


def test_dynamic_shapes_hand_written_causal_mask_is_not_lowered_but_matches():
    """nanoGPT-style causal buffer slice under dynamic lengths: passed as a tensor (lowering needs static sizes)."""
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32,
                          sdpa=False)
    model = build_demo_model(0, cfg).eval()
    cap = Captured(model, dynamic=True)
    with torch.no_grad():
        for shape in [(2, 9), (1, 16), (3, 1)]:
            ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(shape[1]))
            torch.testing.assert_close(cap(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert len(cap.flash_nodes()) == len(cap.graphs) >= 1 and not cap.skipped
    notes = [n for r in cap.attn() for n in r.notes]
    assert any("proven at static sizes only" in n for n in notes), notes


@pytest.mark.gpu
def test_gpu_dynamic_shapes_through_inductor():
    """fxopt::flash_attention inside an Inductor graph with symbolic B and S, on the GPU kernel."""
    torch.manual_seed(0)
    model = _SdpaBlock(head_dim=64).cuda().half().eval()
    compiled = torch.compile(model, backend="fxopt", dynamic=True)
    with torch.no_grad():
        for shape in [(2, 128, 256), (3, 77, 256), (1, 300, 256)]:
            x = torch.randn(shape, device="cuda", dtype=torch.float16)
            torch.testing.assert_close(compiled(x).float(), model(x).float(), rtol=2e-3, atol=2e-3)
    # hand-written attention with a causal buffer: the mask reaches the kernel as a tensor
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512,
                          sdpa=False)
    demo = build_demo_model(0, cfg).cuda().half().eval()
    compiled = torch.compile(demo, backend="fxopt", dynamic=True)
    with torch.no_grad():
        for shape in [(2, 100), (1, 257)]:
            ids = torch.randint(0, 64, shape, device="cuda")
            torch.testing.assert_close(compiled(ids).float(), demo(ids).float(), rtol=1e-2, atol=1e-2)
