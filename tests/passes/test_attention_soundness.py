"""The attention pass never changes a result: each known way to fool a matcher (fills, casts, mutations, fully
masked rows, strides, empty dims, layouts, dropout, symbolic sizes) as a named regression test.

Every test compiles a function with the passes only (``Backend(inductor=False)``) and compares with eager on the same
inputs, NaN where eager gives NaN. Where the pass must still fuse, the test says so; where it must leave the region,
the test checks that a reason is recorded. Each test runs twice: on CPU (the op's float32 reference) and, marked
``gpu``, under ``torch.device("cuda")`` (the Triton / Gluon kernels), with tolerances floored for the kernels'
reassociated sums.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.backends import Backend

S, D = 8, 16


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def on_device(request):
    """Every test on CPU and on CUDA: tensors made without a device land on ``request.param``."""
    with torch.device(request.param):
        yield request.param


def _randn(*shape, g):
    """Seeded normal values drawn on the CPU (generators are per device), then moved to the default device."""
    return torch.randn(*shape, generator=g, device="cpu").to(torch.get_default_device())


def _qkv(B=2, H=2, Sq=S, Sk=S, d=D, seed=0, dtype=torch.float32, Hkv=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = _randn(B, H, Sq, d, g=g).to(dtype)
    k = _randn(B, Hkv or H, Sk, d, g=g).to(dtype)
    v = _randn(B, Hkv or H, Sk, d, g=g).to(dtype)
    return q, k, v


def _tolkw(atol, rtol):
    a, r = _tol(atol, rtol)
    return {"atol": a, "rtol": r}


def _tol(atol, rtol):
    """The kernels sum in another order than eager's matmul: on CUDA, tolerances of at least 1e-4 / 1e-3 (the
    errors this file guards against are 0.1 and more)."""
    if torch.get_default_device().type == "cuda":
        return max(atol, 1e-4), max(rtol, 1e-3)
    return atol, rtol


class _Run:
    """``fn`` compiled through fxopt's passes (no Inductor); ``rewrites`` / ``reasons`` of the attention pass."""

    def __init__(self, fn, dynamic=None):
        torch._dynamo.reset()
        self.backend = Backend(inductor=False)
        self.compiled = torch.compile(fn, backend=self.backend, dynamic=dynamic)

    def __call__(self, *args):
        return self.compiled(*args)

    def _attn(self):
        return [r for res in self.backend.results for r in res if r.name == "attention"]

    @property
    def rewrites(self):
        return sum(r.rewrites for r in self._attn())

    @property
    def reasons(self):
        return [s.reason for r in self._attn() for s in r.skipped]


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def same_as_eager(fn, *args, rewrites=None, atol=1e-5, rtol=1e-4):
    """Run ``fn`` eagerly and compiled on copies of ``args``; outputs equal (NaN in the same places)."""
    ref = fn(*_clone(args))
    run = _Run(fn)
    out = run(*_clone(args))
    atol, rtol = _tol(atol, rtol)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    if rewrites is not None:
        assert run.rewrites == rewrites, run.reasons
    if run.rewrites == 0:
        assert run.reasons, "a candidate left alone must say why"
    return run


def _scores(q, k):
    return q @ k.transpose(-1, -2) / 4


# ---------------------------------------------------------------------------------------------------------------
# 1. fill values: only -inf or <= finfo(score dtype).min mask a score
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [0.0, 1.0, -1.0, 5.0, -1e4, float("inf"), float("nan"), -1e30])
def test_row1_masked_fill_finite_fill_is_not_a_mask(fill):
    def fn(q, k, v):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        s = q @ k.transpose(-1, -2) * 1e4 if fill == -1e4 else _scores(q, k)
        return s.masked_fill(j > i, fill).softmax(-1) @ v

    run = same_as_eager(fn, *_qkv())
    if not (fill == -math.inf or fill <= torch.finfo(torch.float32).min):
        assert run.rewrites == 0 or not any("is_causal" in str(r) for r in run.reasons)


@pytest.mark.parametrize("fill", [float("-inf"), "min"])
def test_row1_real_mask_fills_still_fuse(fill):
    def fn(q, k, v):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        s = _scores(q, k)
        f = torch.finfo(s.dtype).min if fill == "min" else fill
        return s.masked_fill(j > i, f).softmax(-1) @ v

    same_as_eager(fn, *_qkv(), rewrites=1)


def test_row1_where_fill_other_value():
    def fn(q, k, v):
        Sq = q.shape[2]
        keep = torch.ones(Sq, Sq, dtype=torch.bool).tril()
        return torch.where(keep, _scores(q, k), -1.0).softmax(-1) @ v

    same_as_eager(fn, *_qkv())


def test_row1_additive_where_small_fill():
    def fn(q, k, v):
        Sq = q.shape[2]
        keep = torch.ones(Sq, Sq, dtype=torch.bool).tril()
        return (_scores(q, k) + torch.where(keep, 0.0, -3.0)).softmax(-1) @ v

    same_as_eager(fn, *_qkv())


# ---------------------------------------------------------------------------------------------------------------
# 2. casts: every cast's target dtype is checked
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cast", ["bool", "int32", "int64", "bf16_roundtrip", "fp16_roundtrip", "scores_bf16"])
def test_row2_casts_of_probabilities(cast):
    def fn(q, k, v):
        s = _scores(q, k)
        if cast == "scores_bf16":
            return s.to(torch.bfloat16).float().softmax(-1) @ v
        p = s.softmax(-1)
        if cast == "bool":
            p = p.to(torch.bool).to(torch.float32)
        elif cast in ("int32", "int64"):
            p = (p * 3).to(getattr(torch, cast)).to(torch.float32)
        elif cast == "bf16_roundtrip":
            p = p.to(torch.bfloat16).to(torch.float32)
        else:
            p = p.half().float()
        return p @ v

    same_as_eager(fn, *_qkv(), rewrites=0)


def test_row2_upcast_softmax_still_fuses():
    def fn(q, k, v):
        return _scores(q, k).float().softmax(-1).to(q.dtype) @ v

    same_as_eager(fn, *_qkv(), rewrites=1)


# ---------------------------------------------------------------------------------------------------------------
# 3. constants are evaluated as the graph runs them, mutations included (or not at all)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["tril_", "setitem", "fill_", "logical_not_"])
def test_row3_mask_mutated_in_place(how):
    def fn(q, k, v):
        Sq = q.shape[2]
        keep = torch.ones(Sq, Sq, dtype=torch.bool)
        if how == "tril_":
            keep.tril_()
        elif how == "setitem":
            keep[:, 0] = False
            keep[0, 0] = True
        elif how == "fill_":
            keep[1:].fill_(False)
            keep[:, 0] = True
        else:
            keep = keep.tril()
            keep.logical_not_()
            keep[:, 0] = True
        return _scores(q, k).masked_fill(~keep, float("-inf")).softmax(-1) @ v

    same_as_eager(fn, *_qkv())


# ---------------------------------------------------------------------------------------------------------------
# 4. no mutation of an input, mask or intermediate inside the region
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["k_mul_", "q_add_", "v_mul_", "mask_zero_"])
def test_row4_mutation_inside_region(what):
    def fn(q, k, v, m):
        s = q @ k.transpose(-1, -2) / 4
        if what == "k_mul_":
            k.mul_(2)
        elif what == "q_add_":
            q.add_(1)
        s = s + m
        if what == "mask_zero_":
            m.zero_()
        p = s.softmax(-1)
        if what == "v_mul_":
            v.mul_(3)  # the matmul below reads the mutated v: that one is fine, but only if the op reads it too
        return p @ v

    q, k, v = _qkv()
    m = torch.randn(1, 1, S, S)
    same_as_eager(fn, q, k, v, m)


# ---------------------------------------------------------------------------------------------------------------
# 5. rows where every key is masked: eager's result (NaN stays NaN, a finite fill averages)
# ---------------------------------------------------------------------------------------------------------------


def _left_pad(B=2, Sk=S, n=3):
    pad = torch.ones(B, Sk, dtype=torch.bool)
    pad[0, :n] = False
    return pad


def test_row5_two_additive_finfo_min_masks_left_padding():
    def fn(q, k, v, pad):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        s = _scores(q, k)
        mn = torch.finfo(s.dtype).min
        s = s + torch.where(j <= i, 0.0, mn) + torch.where(pad[:, None, None, :], 0.0, mn)
        return s.softmax(-1) @ v

    same_as_eager(fn, *_qkv(), _left_pad())


def test_row5_one_additive_finfo_min_mask_left_padding_fuses():
    def fn(q, k, v, pad):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        s = _scores(q, k)
        keep = (j <= i) & pad[:, None, None, :]
        return (s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)).softmax(-1) @ v

    same_as_eager(fn, *_qkv(), _left_pad(), rewrites=1)


@pytest.mark.parametrize("kind", ["lowered", "tensor"])
def test_row5_neg_inf_fully_masked_rows_give_nan(kind):
    def fn(q, k, v, pad):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        s = _scores(q, k)
        if kind == "lowered":
            keep = (j <= i) & pad[:, None, None, :]
        else:
            keep = (q.sum(-1, keepdim=True) > -1e9) & (j <= i) & pad[:, None, None, :]
        return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v

    out = same_as_eager(fn, *_qkv(), _left_pad())
    assert out is not None


def test_row5_fp16_additive_min_fully_masked_gqa_permuted():
    def fn(q, k, v, pad):  # q/k/v [B, S, H, D], fp16; scores fp16 += where(keep, 0, finfo(fp16).min)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(2, dim=1)
        v = v.repeat_interleave(2, dim=1)
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        keep = (j <= i) & pad[:, None, None, :]
        s = q @ k.transpose(-1, -2) * 0.25
        s += torch.where(keep, 0.0, torch.finfo(torch.float16).min).to(torch.float16)
        return s.float().softmax(-1).half() @ v

    g = torch.Generator(device="cpu").manual_seed(3)
    q = _randn(2, S, 4, D, g=g).half()
    k = _randn(2, S, 2, D, g=g).half()
    v = _randn(2, S, 2, D, g=g).half()
    same_as_eager(fn, q, k, v, _left_pad(), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------------------------
# 6. operand strides: any layout reaches the kernel / CPU reference right
# ---------------------------------------------------------------------------------------------------------------


def test_row6_einsum_v_stored_bhds():
    def fn(q, k, vt):  # vt: [B, H, D, S]
        p = torch.einsum("bhqd,bhkd->bhqk", q, k).mul(0.25).softmax(-1)
        return torch.einsum("bhqk,bhdk->bhqd", p, vt)

    q, k, v = _qkv()
    same_as_eager(fn, q, k, v.transpose(-1, -2).contiguous(), rewrites=1)


def test_row6_qkv_unbound_from_permute():
    def fn(qkv):  # [B, S, 3, H, D] permuted to [3, B, H, D, S]: q, k, v have last stride != 1
        q, k, v = qkv.permute(2, 0, 3, 4, 1).transpose(-1, -2).unbind(0)
        return (q @ k.transpose(-1, -2) * 0.25).softmax(-1) @ v

    qkv = torch.randn(2, S, 3, 2, D)
    same_as_eager(fn, qkv, rewrites=1)


def test_row6_permute_10243():
    def fn(qkv):  # qkv [B, 3, S, H, D]... permute(1, 0, 2, 4, 3) gives [3, B, S, D, H]
        q, k, v = qkv.permute(1, 0, 3, 2, 4).unbind(0)
        return (q @ k.transpose(-1, -2) * 0.25).softmax(-1) @ v

    qkv = torch.randn(2, 3, 2, S, D).transpose(-1, -2).contiguous().transpose(-1, -2)
    same_as_eager(fn, qkv, rewrites=1)


# ---------------------------------------------------------------------------------------------------------------
# 7. empty dims stay out of the kernels
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Sq,Sk", [(0, S), (S, 0), (0, 0)])
def test_row7_empty_sequence(Sq, Sk):
    def fn(q, k, v):
        return (_scores(q, k)).softmax(-1) @ v

    same_as_eager(fn, *_qkv(Sq=Sq, Sk=Sk))


def test_row7_empty_batch():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    same_as_eager(fn, *_qkv(B=0))


# ---------------------------------------------------------------------------------------------------------------
# 8. the output has the layout eager's matmul gives
# ---------------------------------------------------------------------------------------------------------------


def test_row8_output_layout_then_view():
    def fn(x):  # x [B, S, H, D]; q a transposed view; (p @ v).view(B, H, -1) needs a contiguous [B, H, S, D]
        q = x.transpose(1, 2)
        out = (q @ q.transpose(-1, -2) * 0.25).softmax(-1) @ q
        return out.view(out.shape[0], out.shape[1], -1)

    same_as_eager(fn, torch.randn(2, S, 2, D), rewrites=1)


# ---------------------------------------------------------------------------------------------------------------
# 9. a node is built only after its checks pass
# ---------------------------------------------------------------------------------------------------------------


def test_row9_dropout_one():
    def fn(q, k, v):
        return F.dropout(_scores(q, k).softmax(-1), 1.0, training=True) @ v

    same_as_eager(fn, *_qkv(), rewrites=0)


def test_row9_sdpa_dropout_one():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)

    same_as_eager(fn, *_qkv(), rewrites=0)


# ---------------------------------------------------------------------------------------------------------------
# 10. fake values kept symbolic: no re-propagation, no added guards
# ---------------------------------------------------------------------------------------------------------------


def test_row10_node_without_example_value():
    def fn(q, k, v):
        torch._C._log_api_usage_once("fxopt.test")
        return _scores(q, k).softmax(-1) @ v

    run = _Run(fn)
    for Sq in (5, 6, 7, 9):
        q, k, v = _qkv(Sq=Sq, Sk=Sq)
        torch.testing.assert_close(run(q, k, v), fn(q, k, v), **_tolkw(1e-5, 1.3e-6))
    assert run.rewrites == len(run.backend.results) >= 1
    assert len(run.backend.results) <= 2  # static, then one dynamic graph (Dynamo's automatic dynamic)


def test_row10_symbolic_scale_is_a_scale():
    def fn(q, k, v):  # the scale depends on a dynamic size: a SymFloat, not a tensor
        return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-2])).softmax(-1) @ v

    run = _Run(fn)
    q, k, v = _qkv()
    for t in (q, k, v):
        torch._dynamo.mark_dynamic(t, 2)
    torch.testing.assert_close(run(q, k, v), fn(q, k, v), **_tolkw(1e-5, 1.3e-6))
    q, k, v = _qkv(Sq=11, Sk=11)
    torch.testing.assert_close(run(q, k, v), fn(q, k, v), **_tolkw(1e-5, 1.3e-6))
    assert run.rewrites == 1 == len(run.backend.results), run.reasons
    assert not any("tensor" in r for r in run.reasons)


@pytest.mark.parametrize("gqa", [False, True])
def test_row5_additive_min_fully_masked_rows_gradients(gqa):
    """transformers' eager form with left padding, in training: dead rows average v, and their gradient reaches
    q and k through the softmax at p = 1/n, as in eager."""
    def fn(q, k, v, pad):
        if gqa:
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        keep = (j <= i) & pad[:, None, None, :]
        s = q @ k.transpose(-1, -2) * 0.25
        s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)
        return s.softmax(-1) @ v

    q, k, v = _qkv(H=4, Hkv=2 if gqa else 4, seed=5)
    pad = _left_pad()
    grads, run = [], _Run(fn)
    for f in (fn, run):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*args, pad)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach()] + [a.grad for a in args])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **_tolkw(1e-5, 1e-4))
    assert run.rewrites == 1, run.reasons


def test_row5_neg_inf_fully_masked_rows_nan_gradients():
    """-inf fills, a fully masked row: eager's NaN output and NaN gradients (dq on the row, dk / dv on the head)."""
    def fn(q, k, v, pad):
        Sq = q.shape[2]
        i, j = torch.arange(Sq)[:, None], torch.arange(Sq)[None, :]
        keep = (j <= i) & pad[:, None, None, :]
        return (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf")).softmax(-1) @ v

    q, k, v = _qkv(seed=6)
    grads, run = [], _Run(fn)
    for f in (fn, run):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        f(*args, _left_pad()).sum().backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **_tolkw(1e-5, 1e-4), equal_nan=True)
    assert run.rewrites == 1, run.reasons


# ---------------------------------------------------------------------------------------------------------------
# transformers models under dynamic=True, fullgraph=True
# ---------------------------------------------------------------------------------------------------------------


def _hf(kind, impl):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, num_hidden_layers=2, attn_implementation=impl)
    tiny = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **tiny))
    if kind == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(head_dim=16, sliding_window=5, **tiny))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, attn_implementation=impl, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "bert":
        return transformers.BertModel(transformers.BertConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **common))
    raise ValueError(kind)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama"] + [pytest.param(k, marks=pytest.mark.slow)
                                             for k in ("qwen3", "gemma3", "gpt2", "bert")])
def test_hf_dynamic_fullgraph_rewrites_attention(kind, impl):
    torch.manual_seed(0)
    model = _hf(kind, impl).eval()
    kwargs = {} if kind == "bert" else {"use_cache": False}
    backend = Backend(inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for Bsz, Sq in ((2, 7), (3, 12)):  # sizes 0 / 1 are specialised by Dynamo itself
            ids = torch.randint(0, 128, (Bsz, Sq))
            out = compiled(ids, **kwargs)
            ref = model(ids, **kwargs)
            key = "last_hidden_state" if kind == "bert" else "logits"
            torch.testing.assert_close(out[key], ref[key], **_tolkw(2e-5, 1e-4))
    rewrites = sum(r.rewrites for res in backend.results for r in res if r.name == "attention")
    reasons = [s.reason for res in backend.results for r in res if r.name == "attention" for s in r.skipped]
    assert len(backend.results) == 1, "one dynamic graph for every shape"
    assert rewrites == 2, reasons


@pytest.mark.slow
def test_hf_llama_compile_counts_not_above_dynamo():
    """LlamaForCausalLM at S = 5..40, B = 1..4: fxopt compiles no more graphs than Dynamo's own guards ask for
    (the ``eager`` backend, a lower bound of Inductor's count), and every graph has its attention rewritten."""
    torch.manual_seed(0)
    model = _hf("llama", "sdpa").eval()
    shapes = [(b, s) for s in (5, 9, 17, 40) for b in (1, 2, 4)]
    counts = {}
    for name in ("eager", "fxopt"):
        torch._dynamo.reset()
        backend = Backend(inductor=False)
        graphs = []

        def count(gm, ex, backend=backend, name=name):
            graphs.append(gm)
            return gm.forward if name == "eager" else backend(gm, ex)

        compiled = torch.compile(model, backend=count)
        with torch.no_grad():
            for b, s in shapes:
                ids = torch.randint(0, 128, (b, s))
                out = compiled(ids, use_cache=False).logits
                if name == "fxopt":
                    torch.testing.assert_close(out, model(ids, use_cache=False).logits, **_tolkw(2e-5, 1e-4))
        counts[name] = len(graphs)
        if name == "fxopt":
            per_graph = [sum(r.rewrites for r in res if r.name == "attention") for res in backend.results]
            assert per_graph and all(n == 2 for n in per_graph), per_graph
    assert counts["fxopt"] <= counts["eager"], counts


# ---------------------------------------------------------------------------------------------------------------
# coverage: forms Inductor's fuse_attention recognizes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["iadd_mask", "bool_added", "clone_probs", "expand_as_mask"])
def test_inductor_forms_fuse(form):
    def fn(q, k, v, m):
        s = q @ k.transpose(-1, -2) / 4
        if form == "iadd_mask":
            s += m
        elif form == "bool_added":
            s = s + (m > 0)
        elif form == "expand_as_mask":
            s = s.masked_fill(m.expand_as(s) > 0.5, float("-inf"))
        elif form == "clone_probs":
            s = s + m
        p = s.softmax(-1)
        if form == "clone_probs":
            p = p.clone()
        return p @ v

    q, k, v = _qkv()
    m = torch.randn(1, 1, S, S)
    m[..., 0] = -1.0  # every row keeps key 0
    same_as_eager(fn, q, k, v, m, rewrites=1)


@pytest.mark.parametrize("backend", ["fxopt_eager", "fxopt"])
def test_attention_inside_activation_checkpoint(backend):
    from torch.utils.checkpoint import checkpoint

    def attn(q, k, v):
        return (q @ k.transpose(-1, -2) * 0.25).softmax(-1) @ v

    def fn(q, k, v):
        return checkpoint(attn, q, k, v, use_reentrant=False).sum(-1)

    q, k, v = _qkv(seed=9)
    grads = []
    be = Backend(inductor=backend == "fxopt")
    for f in (fn, torch.compile(fn, backend=be)):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*args)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach()] + [a.grad for a in args])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **_tolkw(1e-5, 1e-4))
    assert sum(r.rewrites for res in be.results for r in res if r.name == "attention") == 1


# ---------------------------------------------------------------------------------------------------------------
# views of the batch dims in the score chain ([B*H, Sq, Sk] <-> [B, H, Sq, Sk])
# ---------------------------------------------------------------------------------------------------------------


def _bmm_viewed(split, mask_at="4d"):
    """bmm on [B*H, S, D]; the scores viewed with ``split`` (the 4-D shape) around a mask add."""
    def fn(q, k, v, m):
        Bsz, Hn, Sq, d = q.shape
        q3, k3, v3 = q.reshape(Bsz * Hn, Sq, d), k.reshape(Bsz * Hn, -1, d), v.reshape(Bsz * Hn, -1, d)
        s = torch.bmm(q3, k3.transpose(1, 2)) * 0.25
        if mask_at == "4d":
            s = (s.view(*split(Bsz, Hn), Sq, -1) + m).view(Bsz * Hn, Sq, -1)
        else:
            s = s + m
        return torch.bmm(s.softmax(-1), v3).view(Bsz, Hn, Sq, d)

    return fn


def test_views_of_the_scores_fuse_with_the_mask_in_the_viewed_layout():
    q, k, v = _qkv(B=2, H=3, seed=11)
    m = torch.randn(2, 1, S, S)
    same_as_eager(_bmm_viewed(lambda b, h: (b, h)), q, k, v, m, rewrites=1)


def test_views_of_the_scores_split_other_than_b_h_are_exact():
    """[B*H] viewed as [H, B]: the mask [H, 1, S, S] indexes n // B, which the op's [H, B] layout reproduces."""
    q, k, v = _qkv(B=2, H=3, seed=12)
    m = torch.randn(3, 1, S, S)
    same_as_eager(_bmm_viewed(lambda b, h: (h, b)), q, k, v, m, rewrites=1)


def test_view_of_the_scores_moving_query_rows_into_keys_is_left():
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.25  # [B, H, S, S]
        p = s.reshape(s.shape[0], s.shape[1], S // 2, 2 * S).softmax(-1).reshape(s.shape)  # rows of 2 queries
        return p @ v

    run = same_as_eager(fn, *_qkv(seed=13), rewrites=0)
    assert any("moves the query or key dims" in r for r in run.reasons), run.reasons


def test_mask_over_the_merged_dim_of_a_viewed_chain_is_left():
    def fn(q, k, v, m):  # m [B*H, S, S] added to the 3-D scores, then viewed as [B, H, S, S]
        Bsz, Hn, Sq, d = q.shape
        q3, k3, v3 = q.reshape(Bsz * Hn, Sq, d), k.reshape(Bsz * Hn, Sq, d), v.reshape(Bsz * Hn, Sq, d)
        s = (torch.bmm(q3, k3.transpose(1, 2)) * 0.25 + m).view(Bsz, Hn, Sq, Sq)
        return torch.bmm(s.view(Bsz * Hn, Sq, Sq).softmax(-1), v3)

    q, k, v = _qkv(B=2, H=3, seed=14)
    run = same_as_eager(fn, q, k, v, torch.randn(6, S, S), rewrites=0)
    assert any("merged batch*heads" in r for r in run.reasons), run.reasons


def test_views_of_the_scores_in_training_and_dynamic_batch():
    fn = _bmm_viewed(lambda b, h: (b, h))
    q, k, v = _qkv(B=2, H=3, seed=15)
    m = torch.randn(2, 1, 1, S)
    run = _Run(fn)
    outs = []
    for f in (fn, run):
        for Bsz in (2, 3):
            args = [torch.cat([t] * 2)[:Bsz].clone().requires_grad_() for t in (q, k, v)]
            out = f(*args, torch.cat([m] * 2)[:Bsz])
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append([out.detach()] + [a.grad for a in args])
    for a, b in zip(outs[:2], outs[2:]):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, **_tolkw(1e-5, 1e-4))
    assert run.rewrites == len(run.backend.results) >= 1, run.reasons


# ---------------------------------------------------------------------------------------------------------------
# ATen ops written in the model (torch.ops.aten.*): mul.Scalar, _safe_softmax, bmm
# ---------------------------------------------------------------------------------------------------------------


def test_aten_safe_softmax_fully_masked_rows_give_zero():
    """_safe_softmax gives 0 (not NaN) on a row of -inf, and a zero gradient there."""
    def fn(q, k, v, pad):
        keep = pad[:, None, None, :]
        s = torch.ops.aten.mul.Scalar(q, 0.5) @ torch.ops.aten.mul.Scalar(k.transpose(-1, -2), 0.5)
        s = s.masked_fill(~keep, float("-inf"))
        return torch.ops.aten._safe_softmax(s, -1) @ v

    pad = torch.ones(2, S, dtype=torch.bool)
    pad[1] = False  # batch 1: every key masked
    q, k, v = _qkv(seed=16)
    grads, run = [], _Run(fn)
    for f in (fn, run):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*args, pad)
        out.sum().backward()
        grads.append([out.detach()] + [a.grad for a in args])
    assert grads[0][0][1].abs().max() == 0 and not grads[0][0].isnan().any()
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **_tolkw(1e-5, 1e-4), equal_nan=True)
    assert run.rewrites == 1, run.reasons


def test_aten_div_with_rounding_is_not_a_scale():
    def fn(q, k, v):
        s = torch.ops.aten.div(q @ k.transpose(-1, -2), 4.0, rounding_mode="floor")
        return torch.ops.aten._safe_softmax(s, -1) @ v

    same_as_eager(fn, *_qkv(seed=17), rewrites=0)


def test_aten_bmm_and_views_fuse():
    def fn(q, k, v):
        n, d = q.shape[0] * q.shape[1], q.shape[-1]
        q3 = torch.ops.aten.view.default(q, [n, S, d])
        kt3 = torch.ops.aten.reshape.default(torch.ops.aten.transpose.int(k, -1, -2), [n, d, S])
        s = torch.ops.aten.view.default(torch.ops.aten.bmm.default(q3, kt3), [q.shape[0], q.shape[1], S, S])
        p = torch.ops.aten._softmax.default(torch.ops.aten.div.Tensor(s, 4.0), -1, False)
        return torch.ops.aten.matmul.default(p, v)

    same_as_eager(fn, *_qkv(seed=18), rewrites=1)


# ---------------------------------------------------------------------------------------------------------------
# a 0-d tensor scale known only at run time
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["full_sqrt", "tensor_pow", "learned"])
def test_zero_dim_tensor_scale_from_a_dynamic_size_fuses(form):
    def fn(q, k, v, t):
        s = q @ k.transpose(-1, -2)
        if form == "full_sqrt":
            s = s / torch.full((), math.sqrt(q.size(-2)), dtype=q.dtype)
        elif form == "tensor_pow":
            s = s * torch.tensor(q.size(-2)) ** -0.5
        else:
            s = s * t.exp()
        return s.softmax(-1) @ v

    run = _Run(fn)
    t = torch.tensor(-1.5, requires_grad=True)
    for Sq in (8, 11):
        q, k, v = _qkv(Sq=Sq, Sk=Sq, seed=Sq)
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 2)
        grads = []
        for f in (fn, run):
            args = [x.clone().requires_grad_() for x in (q, k, v)] + [t]
            t.grad = None
            out = f(*args)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            grads.append([out.detach()] + [a.grad.clone() for a in args if a.grad is not None])
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, **_tolkw(1e-5, 1e-4))
    assert run.rewrites == len(run.backend.results) >= 1, run.reasons


def test_zero_dim_tensor_scale_written_after_its_use_is_left():
    def fn(q, k, v):
        t = torch.full((), 4.0)
        s = q @ k.transpose(-1, -2) / t
        t.mul_(2)  # eager divided by 4; the op, reading t later, would divide by 8
        return s.softmax(-1) @ v

    run = same_as_eager(fn, *_qkv(seed=19), rewrites=0)
    assert any("in-place write" in r for r in run.reasons), run.reasons


def test_tensor_factor_that_is_not_a_scalar_is_left():
    def fn(q, k, v, f):  # Inductor's tensor-factor case: a [B, 1, 1] factor, one per batch
        return (q @ k.transpose(-1, -2) * f).softmax(-1) @ v

    same_as_eager(fn, *_qkv(seed=20), torch.rand(2, 1, 1, 1) + 0.5, rewrites=0)
