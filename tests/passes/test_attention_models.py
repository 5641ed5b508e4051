"""Model-level tests of the attention pass: outputs and gradients equal eager, masks lowered, no graph break added.

transformers models from tiny configs (hidden 64, 2 layers, seq 16), eager and sdpa attention, a padded batch;
a nanoGPT block written here; fxopt's TinyLlama (sdpa True/False). ``fxopt_eager``-style capture (no Inductor)
except one Inductor test.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.config import Config
from fxopt.passes import run_passes

transformers = pytest.importorskip("transformers")

B, S, V = 2, 16, 128


def _model(kind, impl):
    common = dict(vocab_size=V, num_hidden_layers=2, attn_implementation=impl)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, **common)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "mistral":
        cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=5, **common)
        return transformers.MistralForCausalLM(cfg)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, attn_implementation=impl,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        return transformers.BertModel(cfg)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, sliding_window=5,
                                        attn_logit_softcapping=5.0, **common)
        return transformers.Gemma2ForCausalLM(cfg)
    raise ValueError(kind)


def _capturing_backend():
    """A Dynamo backend that runs fxopt's passes only (no Inductor), with the attention pass results and the
    rewritten graphs it saw."""
    results, graphs = [], []

    def backend(gm, example_inputs):
        gm, res = run_passes(gm, example_inputs, Config())
        results.extend(r for r in res if r.name == "attention")
        graphs.append(gm)
        return gm.forward

    return backend, results, graphs


def _compile_and_compare(model, args, kwargs, expect_rewrites):
    """Forward + backward through the pass-rewritten graph vs eager; returns the flash_attention nodes.

    Outputs are compared everywhere, padded positions included. The loss counts valid positions only: a query row
    with no visible key has a forward that does not depend on q/k (eager's finite fill makes every score equal),
    yet eager's autograd returns a nonzero gradient through the rounded-away scores, where the rewrite returns the
    exact zero; valid positions never see padded ones, so their gradients are the same in both.
    """
    backend, results, graphs = _capturing_backend()

    def loss_of(out):
        if isinstance(out, (tuple, list)):
            out = out[0]
        elif not isinstance(out, torch.Tensor):
            out = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        w = torch.linspace(-1, 1, out.shape[-1])
        valid = kwargs.get("attention_mask")
        weight = w if valid is None else w * valid[..., None]
        return out, (out * weight).sum()

    torch._dynamo.reset()
    model.zero_grad()
    ref, ref_loss = loss_of(model(*args, **kwargs))
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out, loss = loss_of(torch.compile(model, backend=backend)(*args, **kwargs))
    loss.backward()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], atol=5e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}")
    assert sum(r.rewrites for r in results) == expect_rewrites, [s.reason for r in results for s in r.skipped]
    flash = [n for gm in graphs for n in gm.graph.nodes if n.target in (torch.ops.fxopt.flash_attention.default, torch.ops.fxopt.flash_attention_fwd.default)]
    assert len(flash) == expect_rewrites
    torch._dynamo.reset()
    return flash


CASES = [("llama", "eager"), ("llama", "sdpa"), ("mistral", "eager"), ("mistral", "sdpa"), ("gpt2", "eager"),
         ("gpt2", "sdpa"), ("bert", "eager"), ("bert", "sdpa"), ("gemma2", "eager")]


@pytest.mark.parametrize("kind,impl", CASES)
def test_transformers_padded_batch(kind, impl):
    torch.manual_seed(0)
    model = _model(kind, impl).train()
    ids = torch.randint(0, V, (B, S))
    pad = torch.ones(B, S, dtype=torch.long)
    if kind == "bert":
        pad[1, -4:] = 0  # right padding
    else:
        pad[1, :3] = 0  # left padding: rows 0..2 of batch 1 see no key
    kwargs = {"attention_mask": pad}
    if kind != "bert":
        kwargs["use_cache"] = False
    # gemma2 (softcap) in training: a fully masked row's gradient reaches the scores through tanh' at every key,
    # which the rewrite cannot give without an S x S pass, so the region stays (with its reason)
    soft_train = kind == "gemma2"
    flash = _compile_and_compare(model, (ids,), kwargs, expect_rewrites=0 if soft_train else 2)
    if soft_train:
        return
    for node in flash:  # every mask proven: no S x S tensor reaches the kernel
        kw = node.kwargs
        assert kw.get("attn_mask") is None, node.format_node()
        assert kw.get("key_padding_mask") is not None
        assert kw.get("is_causal", False) == (kind != "bert")
        if kind in ("llama", "mistral", "gemma2"):
            assert node.args[1].meta["val"].shape[1] == 2  # native GQA: repeat_kv removed
    if kind == "mistral":
        assert all(n.kwargs.get("window") == 5 for n in flash)
    if kind == "gemma2":
        assert sorted(n.kwargs.get("window", -1) for n in flash) == [-1, 5]
        assert all(n.kwargs.get("softcap") == pytest.approx(5.0) for n in flash)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_no_padding_is_causal_and_no_new_graph_breaks(impl):
    torch.manual_seed(0)
    model = _model("llama", impl).eval()
    ids = torch.randint(0, V, (B, S))
    with torch.no_grad():
        flash = _compile_and_compare_nograd(model, ids)
    assert all(n.kwargs.get("is_causal") and n.kwargs.get("attn_mask") is None
               and n.kwargs.get("key_padding_mask") is None for n in flash)
    torch._dynamo.reset()
    plain = torch._dynamo.explain(model)(ids, use_cache=False)
    rep = fxopt.explain(model, ids, use_cache=False)
    assert rep.graph_breaks == plain.graph_break_count and rep.rewrites["attention"] == 2


def _compile_and_compare_nograd(model, ids):
    graphs = []

    def backend(gm, example_inputs):
        gm, _ = run_passes(gm, example_inputs, Config())
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ref = model(ids, use_cache=False).logits
    out = torch.compile(model, backend=backend)(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    return [n for gm in graphs for n in gm.graph.nodes if n.target in (torch.ops.fxopt.flash_attention.default, torch.ops.fxopt.flash_attention_fwd.default)]


class NanoGPTBlock(nn.Module):
    def __init__(self, C=64, H=4, T=32):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.attn_dropout = nn.Dropout(0.0)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def attn(self, x):
        Bz, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(Bz, T, self.H, C // self.H).transpose(1, 2)
        q = q.view(Bz, T, self.H, C // self.H).transpose(1, 2)
        v = v.view(Bz, T, self.H, C // self.H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(Bz, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def test_nanogpt_block():
    torch.manual_seed(0)
    block = NanoGPTBlock().train()
    x = torch.randn(B, S, 64)
    flash = _compile_and_compare(block, (x,), {}, expect_rewrites=1)
    assert flash[0].kwargs.get("attn_mask") is not None  # mask from a buffer (data): kept as a tensor


@pytest.mark.parametrize("sdpa", [True, False])
def test_fxopt_tiny_llama(sdpa):
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32,
                          sdpa=sdpa)
    model = build_demo_model(cfg=cfg).train()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    flash = _compile_and_compare(model, (ids,), {}, expect_rewrites=2)
    for n in flash:
        assert n.kwargs.get("is_causal") is True and n.kwargs.get("attn_mask") is None
        assert n.args[1].meta["val"].shape[1] == 2


@pytest.mark.slow
def test_inductor_tiny_llama_handwritten():
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=V, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32,
                          sdpa=False)
    model = build_demo_model(cfg=cfg)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    backend = fxopt.Backend(Config())
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids)
        ref = model(ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert sum(r.rewrites for res in backend.results for r in res if r.name == "attention") == 1
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_tiny_llama_training_step_under_cuda_graphs():
    """``torch.compile(model, backend="fxopt", mode="reduce-overhead")`` (Inductor's CUDA graphs) around a training
    step of a tiny Llama (bf16, GQA 4:2, d = 64, S = 512): three steps replayed, loss and gradients against eager.
    CUDA graphs take the op's host launch path away (below S = 4096 the eager fwd+bwd is host-bound),
    so short-sequence training should run this way; the custom ops must be capturable (no host sync)."""
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=V, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512,
                          max_seq_len=512, sdpa=True)
    torch.manual_seed(0)
    model = build_demo_model(cfg=cfg).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, V, (2, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def step(m):
        m.zero_grad(set_to_none=True)
        logits = m(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in m.parameters()]

    ref_loss, ref_grads = step(model)
    backend = fxopt.Backend(Config())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        loss, grads = step(compiled)
    assert sum(r.rewrites for res in backend.results for r in res if r.name == "attention") >= 2
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert (g.float() - r.float()).norm() <= 0.05 * r.float().norm() + 1e-3


def _t5_encoder():
    cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                dropout_rate=0.0, relative_attention_num_buckets=8)
    return transformers.T5EncoderModel(cfg)


def test_t5_learned_position_bias():
    """T5 adds a learned relative position bias (plus the padding mask) to unscaled scores. Training: the bias
    requires grad, so both layers stay as they were (reason "learned bias"), gradients equal to eager; inference:
    the same bias is a plain additive mask and both layers are rewritten, outputs equal to eager."""
    torch.manual_seed(0)
    model = _t5_encoder().train()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, -4:] = 0
    _compile_and_compare(model, (ids,), {"attention_mask": pad}, expect_rewrites=0)
    rep = fxopt.explain(model, ids, attention_mask=pad)
    assert rep.rewrites["attention"] == 0 and "learned bias" in str(rep), str(rep)
    model.eval()
    results = []

    def backend(gm, example_inputs):
        gm, res = run_passes(gm, example_inputs, Config())
        results.extend(r for r in res if r.name == "attention")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids, attention_mask=pad).last_hidden_state
        out = torch.compile(model, backend=backend)(ids, attention_mask=pad).last_hidden_state
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert sum(r.rewrites for r in results) == 2, [s.reason for r in results for s in r.skipped]
    torch._dynamo.reset()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_kv_cache_step_masks_lowered(impl):
    """A decode-style step on a KV cache (Sq = 2 new tokens, Sk = 10 = 8 cached + 2), left-padded batch: the mask
    transformers builds from cache positions and padding is proven causal (bottom-right aligned) + key padding and
    lowered to kernel arguments, and the logits equal eager's."""
    import copy

    torch.manual_seed(0)
    model = _model("llama", impl).eval()
    prompt = torch.randint(0, V, (B, 8))
    pad = torch.ones(B, 8, dtype=torch.long)
    pad[1, :3] = 0
    with torch.no_grad():
        cache = model(prompt, attention_mask=pad, use_cache=True).past_key_values
    new = torch.randint(0, V, (B, 2))
    mask = torch.cat([pad, torch.ones(B, 2, dtype=torch.long)], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -2:]
    step = dict(attention_mask=mask, position_ids=pos, use_cache=True)
    backend, results, graphs = _capturing_backend()

    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(new, past_key_values=copy.deepcopy(cache), **step).logits
        out = torch.compile(model, backend=backend)(new, past_key_values=copy.deepcopy(cache), **step).logits
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert sum(r.rewrites for r in results) == 2, [s.reason for r in results for s in r.skipped]
    flash = [n for gm in graphs for n in gm.graph.nodes if n.target in (torch.ops.fxopt.flash_attention.default, torch.ops.fxopt.flash_attention_fwd.default)]
    assert len(flash) == 2
    for node in flash:
        q_val, k_val = node.args[0].meta["val"], node.args[1].meta["val"]
        assert q_val.shape[2] == 2 and k_val.shape[2] == 10 and k_val.shape[1] == 2  # Sq < Sk, native GQA
        assert node.kwargs.get("attn_mask") is None, node.format_node()
        assert node.kwargs.get("is_causal") is True and node.kwargs.get("key_padding_mask") is not None


@pytest.mark.parametrize("kind", ["mistral", "gpt2", "bert", "gemma2"])
def test_no_new_graph_breaks_on_padded_batches(kind):
    """The rewrites add no graph break on the other model families either (padded batch, masks lowered)."""
    torch.manual_seed(0)
    model = _model(kind, "eager").eval()
    ids = torch.randint(0, V, (B, S))
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, -4:] = 0
    kwargs = {"attention_mask": pad}
    if kind != "bert":
        kwargs["use_cache"] = False
    torch._dynamo.reset()
    plain = torch._dynamo.explain(model)(ids, **kwargs)
    torch._dynamo.reset()
    with torch.no_grad():  # inference: fully masked rows need no gradient (gemma2's softcap has none in training)
        rep = fxopt.explain(model, ids, **kwargs)
    torch._dynamo.reset()
    assert rep.rewrites["attention"] == 2 and rep.graph_breaks == plain.graph_break_count
