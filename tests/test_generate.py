"""Hugging Face ``generate()`` through fxopt, the user's own path: the static cache with the generation compile hook
(``CompileConfig``), float and W4A16, greedy tokens and scores against the same model run eagerly."""
import pytest
import torch

import fxopt

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            num_hidden_layers=2, max_position_embeddings=256)


def tiny_model(family: str, dtype=torch.float32, device="cpu"):
    spec = dict(TINY)
    if family == "llama":
        cfg = transformers.LlamaConfig(**spec)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **spec)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=16, sliding_window=8, **spec)
    else:
        raise ValueError(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    # a wider init than HF's 0.02 so that greedy choices are well separated (no near-ties to flip)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def run_generate(model, ids, backend=None, new_tokens=8, options=None, mode=None):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    if backend is None:
        model.generation_config.compile_config = None
        kw["disable_compile"] = True
    else:
        cc = transformers.CompileConfig(backend=backend, mode=mode, options=options)
        cc._compile_all_devices = True  # the hook compiles on CPU too
        model.generation_config.compile_config = cc
    torch._dynamo.reset()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    torch._dynamo.reset()
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_generate_static_cache_fxopt_eager_matches_eager(family):
    model = tiny_model(family)
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_tokens, ref_scores = run_generate(model, ids)
    backend = fxopt.Backend(inductor=False)
    tokens, scores = run_generate(model, ids, backend=backend)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
    # the decode step's attention went through the fused op (one per layer)
    assert backend.results, "the compile hook did not compile"
    fused = sum(r.rewrites for results in backend.results for r in results if r.name == "attention")
    assert fused >= model.config.num_hidden_layers


@pytest.mark.slow
def test_generate_static_cache_fxopt_inductor_matches_eager():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    ref_tokens, ref_scores = run_generate(model, ids)
    tokens, scores = run_generate(model, ids, backend="fxopt", options={"cudagraphs": False})
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_generate_static_cache_fxopt_inductor_other_families(family):
    model = tiny_model(family)
    ids = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    ref_tokens, ref_scores = run_generate(model, ids)
    tokens, scores = run_generate(model, ids, backend="fxopt")
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-3, atol=1e-3)


def test_generate_w4a16_fxopt_matches_the_quantized_model_run_eagerly():
    model = tiny_model("llama", dtype=torch.float16)
    ids = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    fxopt.quantize(model, [ids], method="rtn", group_size=32, progress=False)
    ref_tokens, ref_scores = run_generate(model, ids)
    backend = fxopt.Backend(inductor=False)
    tokens, scores = run_generate(model, ids, backend=backend)
    fused = sum(r.rewrites for results in backend.results for r in results if r.name == "w4a16")
    assert fused >= 7 * model.config.num_hidden_layers  # q k v o gate up down in every layer
    # fp16 activations: the fused op and the eager layer round differently; same greedy tokens, close scores
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores.float(), ref_scores.float(), rtol=2e-2, atol=2e-2)


def test_compile_config_cudagraphs_option_is_validated():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    with pytest.raises(Exception, match="cudagraphs"):
        run_generate(model, ids, backend="fxopt", options={"cudagraphs": "on"})


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True])
def test_gpu_generate_reduce_overhead(quant):
    """mode="reduce-overhead" (CUDA-graph trees) around the fused ops, bf16 and W4A16: no crash (no allocation
    of a kernel's persistent buffer or of the W4A16 tuner inside the graph pool), logits as eager's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_model("llama", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(5)).cuda()
    if quant:
        fxopt.quantize(model, [ids], method="rtn", group_size=32, progress=False)
    ref_tokens, ref_scores = run_generate(model, ids)
    for options, mode in (({"cudagraphs": True}, None), (None, "reduce-overhead")):
        tokens, scores = run_generate(model, ids, backend="fxopt", options=options, mode=mode)
        torch.testing.assert_close(scores[:, :2].float(), ref_scores[:, :2].float(), rtol=5e-2, atol=5e-2)
        assert (tokens == ref_tokens).float().mean() > 0.9
