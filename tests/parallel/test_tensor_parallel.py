"""Tensor parallelism found in the graph (``fxopt.parallelize`` + the ``tensor_parallel`` pass).

* gloo, 2 ranks: outputs and gradients of the demo decoder, a transformers Llama (GQA), GPT-2 (fused c_attn Conv1D)
  and an MLP equal the single-device model's; all_reduce count = Megatron's prediction; each rank holds 1/2 of
  every sharded weight. Vocab-parallel embedding/lm_head; int4 QuantLinear shards; ``torch.compile`` of the result.
* gloo, 2 ranks, KV cache: greedy decoding with the default DynamicCache (a manual loop passing the cache back, and
  ``generate()`` through the module) gives the single-process tokens and logits; each rank's cache holds its heads
  (Llama, Qwen2, Mistral with a sliding window).
* fake process group, world size 2, 4 and 8 (one process): plans, local shapes, GQA kv replication, refusals, the
  KV-cache plan and its errors.
"""
import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.testing import run_on_ranks

transformers = pytest.importorskip("transformers")


def _cfg():
    cfg = fxopt.Config()
    cfg.attention.enabled = False  # keep these tests about sharding (flash attention has its own tests)
    cfg.tensor_parallel.sequence_parallel_min_bytes = 0  # the test models' activations are a few KB
    return cfg


def _demo(seed=0, layers=2):
    from fxopt.models import TinyLlamaConfig, build_demo_model

    torch.manual_seed(seed)
    cfg = TinyLlamaConfig(vocab_size=64, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=96,
                          max_seq_len=16)
    return build_demo_model(seed, cfg).train()


def _llama(seed=0, arch="Llama", **extra):
    """A tiny transformers decoder with GQA (4 query heads, 2 kv heads): ``arch`` "Llama", "Qwen2", "Mistral"."""
    torch.manual_seed(seed)
    c = getattr(transformers, f"{arch}Config")(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", **extra)
    return getattr(transformers, f"{arch}ForCausalLM")(c).train()


def _bert(seed=0):
    torch.manual_seed(seed)
    c = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.BertModel(c).train()


def _gpt2(seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    c = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn, bos_token_id=0,
                                eos_token_id=0)
    m = transformers.GPT2LMHeadModel(c).train()
    with torch.no_grad():  # GPT-2 initializes biases to zero: make them count
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    return m


class MLP(nn.Module):
    def __init__(self, d=32, h=64, blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(self.norm(x))
        return x


def _quant_mlp(seed: int, blocks: int = 1) -> nn.Module:
    """An MLP whose linears are int4 QuantLinears (dequantize_w4 -> linear), fp16 as the w4a16 kernels take it."""
    from fxopt.quant.linear import QuantLinear

    torch.manual_seed(seed)
    mlp = MLP(d=64, h=128, blocks=blocks)
    for blk in mlp.blocks:
        blk[0] = QuantLinear.from_linear(blk[0], group_size=32)
        blk[2] = QuantLinear.from_linear(blk[2], group_size=32)
    return mlp.half().eval().requires_grad_(False)


def _count(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _check_model(rank, ws, model, args, kwargs, expected_ar, expected_ag=0, **kw):
    from fxopt.parallel.tensor_parallel import parallelize

    tpm = parallelize(model, args, kwargs, tp=ws, config=_cfg(), **kw)
    gm = tpm.graph_module
    assert _count(gm, "_c10d_functional.all_reduce") == expected_ar == tpm.plan.all_reduces, str(tpm.plan)
    assert _count(gm, "_c10d_functional.all_gather_into_tensor") == expected_ag
    assert _count(gm, "wait_tensor") == expected_ar + expected_ag
    # each rank holds 1/ws of every sharded weight
    assert tpm.plan.shards
    for ts in tpm.plan.shards.values():
        local = tpm.get_parameter(ts.name) if ts.name in dict(tpm.named_parameters()) else tpm.get_buffer(ts.name)
        assert local.numel() * ws == torch.Size(ts.global_shape).numel(), ts
    gen = torch.Generator().manual_seed(123)
    ref = _logits(model(*args, **kwargs))
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(ref.dtype)
    (ref.double() * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    out = _logits(tpm(*args, **kwargs))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (out.double() * w).sum().backward()
    checked = 0
    for n, p in tpm.named_parameters():
        if n not in ref_grads:
            continue
        exp = ref_grads[n]
        ts = tpm._cuts.get(n)
        if ts is not None:
            exp = ts.cut(exp, rank, ws)
        torch.testing.assert_close(p.grad, exp, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {n}: {m}")
        checked += 1
    assert checked >= len(tpm.plan.shards)
    return tpm


def _worker_models(rank, ws):
    torch.use_deterministic_algorithms(False)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    _check_model(rank, ws, _demo(), (ids,), {}, expected_ar=2 * 2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    tpm = _check_model(rank, ws, _llama(), (), {"input_ids": ids, "use_cache": False}, expected_ar=2 * 2)
    assert tpm.get_parameter("model.layers.0.self_attn.k_proj.weight").shape == (16, 64)  # 1 of 2 kv heads
    tpm = _check_model(rank, ws, _gpt2(), (), {"input_ids": ids, "use_cache": False}, expected_ar=2 * 2)
    text = str(tpm.plan)
    assert "sections [64, 64, 64]" in text and "c_attn" in text, text
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(2))
    _check_model(rank, ws, MLP(), (x,), {}, expected_ar=2)


def _worker_vocab_quant_compile(rank, ws):
    from fxopt.parallel.tensor_parallel import parallelize

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    # vocab-parallel lm_head: one all_gather of the logits; the untied embedding stays replicated by default
    tpm = _check_model(rank, ws, _demo(), (ids,), {}, expected_ar=2 * 2, expected_ag=1, vocab_parallel=True)
    assert tpm.get_parameter("embed.weight").shape == (64, 64)
    assert "vocab_parallel_embedding=False" in str(tpm.plan), str(tpm.plan)
    # ... and cut by rows on request: one more all_reduce
    tpm = _check_model(rank, ws, _demo(), (ids,), {}, expected_ar=2 * 2 + 1, expected_ag=1, vocab_parallel=True,
                       vocab_parallel_embedding=True)
    assert tpm.get_parameter("embed.weight").shape == (32, 64)
    # tied GPT-2 embedding / lm_head cut together by vocabulary rows
    ids2 = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    _check_model(rank, ws, _gpt2(), (), {"input_ids": ids2, "use_cache": False}, expected_ar=2 * 2 + 1,
                 expected_ag=1, vocab_parallel=True)
    # int4 QuantLinear (dequantize_w4 -> linear; fp16 activations as the w4a16 kernels take them)
    mlp = _quant_mlp(3)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4)).half()
    q = parallelize(mlp, (x,), tp=ws, config=_cfg())
    assert q.plan.all_reduces == 1, str(q.plan)
    assert q.get_buffer("blocks.0.0.qweight").shape == (8, 64)  # column: N cut
    assert q.get_buffer("blocks.0.2.qweight").shape == (8, 64)  # row: K/8 cut (128 / 8 / 2)
    assert q.get_buffer("blocks.0.2.scales").shape == (2, 64)
    torch.testing.assert_close(q(x).float(), mlp(x).float(), rtol=2e-3, atol=2e-3)
    # default config: the attention pass runs first, so heads are split in fxopt::flash_attention; the returned
    # module compiles (Dynamo retraces it; fxopt passes, no Inductor) and runs a new shape (re-captured)
    model = _demo().eval().requires_grad_(False)
    tpm = parallelize(model, (ids,), tp=ws)
    assert _count(tpm.graph_module, "fxopt.flash_attention") == 2 and tpm.plan.all_reduces == 4
    compiled = torch.compile(tpm, backend="fxopt_eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    ids3 = ids[:1, :5]
    torch.testing.assert_close(tpm(ids3), model(ids3), rtol=1e-5, atol=1e-5)
    assert len(tpm._graphs) == 2
    _check_overlap_chunks(ws, model, ids)


def _check_overlap_chunks(ws, model, ids):
    """overlap_chunks=4: each row-parallel linear runs as 4 token chunks, each chunk's all-reduce issued before the
    next chunk's matmul and every wait after the last one; same outputs. Lengths 4 does not divide stay whole."""
    from fxopt.parallel.tensor_parallel import parallelize

    tpo = parallelize(model, (ids,), tp=ws, config=_cfg(), overlap_chunks=4)
    gm = tpo.graph_module
    assert tpo.plan.all_reduces == 4 * 2 * 2 == _count(gm, "_c10d_functional.all_reduce"), str(tpo.plan)
    assert tpo.plan.overlap_chunks == 4 and "in 4 token chunks" in str(tpo.plan)
    torch.testing.assert_close(tpo(ids), model(ids), rtol=1e-5, atol=1e-5)
    kinds = []
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op == "call_function" and ("all_reduce" in name or "wait_tensor" in name or "linear" in name):
            kinds.append("ar" if "all_reduce" in name else "wait" if "wait_tensor" in name else "mm")
    first = kinds.index("ar") - 1  # the first row-parallel chunk's matmul
    assert kinds[first:first + 12] == ["mm", "ar"] * 4 + ["wait"] * 4, kinds
    odd = ids[:, :7]  # 7 tokens: not cut, one all-reduce per row linear
    tpo7 = parallelize(model, (odd,), tp=ws, config=_cfg(), overlap_chunks=4)
    assert tpo7.plan.all_reduces == 2 * 2 and tpo7.plan.overlap_chunks == 1
    torch.testing.assert_close(tpo7(odd), model(odd), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="overlap_chunks"):
        parallelize(model, (ids,), tp=ws, overlap_chunks=0)
    # GPT-2's Conv1D row linears (addmm on [B*S, K]) and int4 row linears (dequantize -> linear) chunk the same way
    gpt2 = _gpt2().eval().requires_grad_(False)
    ids2 = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    g2 = parallelize(gpt2, (), {"input_ids": ids2, "use_cache": False}, tp=ws, config=_cfg(), overlap_chunks=2)
    assert g2.plan.all_reduces == 2 * 2 * 2, str(g2.plan)
    torch.testing.assert_close(_logits(g2(input_ids=ids2, use_cache=False)),
                               _logits(gpt2(input_ids=ids2, use_cache=False)), rtol=1e-5, atol=1e-5)
    mlp = _quant_mlp(5)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(6)).half()
    q = parallelize(mlp, (x,), tp=ws, config=_cfg(), overlap_chunks=2)
    assert q.plan.all_reduces == 2 and q.plan.overlap_chunks == 2, str(q.plan)
    torch.testing.assert_close(q(x).float(), mlp(x).float(), rtol=2e-3, atol=2e-3)


def _check_sequence_parallel(ws):
    """sequence_parallel: every row-parallel all-reduce becomes a reduce-scatter over the tokens, token-wise ops
    (residual adds, RMSNorm / LayerNorm, casts, eval dropout, views) run on the local tokens and one all-gather
    feeds each column-parallel block; outputs equal the full model's."""
    from fxopt.parallel.tensor_parallel import parallelize

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for model, args, kwargs in ((_demo(), (ids,), {}),
                                    (_llama(), (), {"input_ids": ids, "use_cache": False}),
                                    (_gpt2(), (), {"input_ids": ids, "use_cache": False})):
            model = model.eval().requires_grad_(False)
            tpm = parallelize(model, args, kwargs, tp=ws, config=_cfg(), sequence_parallel=True)
            gm = tpm.graph_module
            assert tpm.plan.all_reduces == 0 == _count(gm, "_c10d_functional.all_reduce"), str(tpm.plan)
            assert tpm.plan.reduce_scatters == 4 == _count(gm, "reduce_scatter_tensor"), str(tpm.plan)
            # one gather before each attention / MLP block's column linears (the last one feeds the lm_head)
            assert tpm.plan.all_gathers == 4 == _count(gm, "all_gather_into_tensor"), str(tpm.plan)
            assert "reduce_scatter" in str(tpm.plan) and "sequence_parallel" in str(tpm.plan)
            torch.testing.assert_close(_logits(tpm(*args, **kwargs)), _logits(model(*args, **kwargs)),
                                       rtol=1e-5, atol=1e-5)
        # BERT: post-norm (LayerNorm after each residual add) and a key-padding mask
        bert = _bert().eval().requires_grad_(False)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0
        bkw = {"input_ids": ids, "attention_mask": mask}
        tpb = parallelize(bert, (), bkw, tp=ws, config=_cfg(), sequence_parallel=True)
        assert tpb.plan.reduce_scatters == 4 and tpb.plan.all_reduces == 0, str(tpb.plan)
        torch.testing.assert_close(tpb(**bkw).last_hidden_state, bert(**bkw).last_hidden_state, rtol=1e-5,
                                   atol=1e-5)
        # GPT-2 with its tied embedding cut by vocabulary: the embedding's all-reduce is reduce-scattered too, and
        # the position embeddings [1, S, H] are expanded and sliced locally
        gpt2 = _gpt2().eval().requires_grad_(False)
        kw = {"input_ids": ids, "use_cache": False}
        tpv = parallelize(gpt2, (), kw, tp=ws, config=_cfg(), sequence_parallel=True, vocab_parallel=True)
        assert tpv.plan.all_reduces == 0 and tpv.plan.reduce_scatters == 5, str(tpv.plan)
        torch.testing.assert_close(_logits(tpv(**kw)), _logits(gpt2(**kw)), rtol=1e-5, atol=1e-5)
        # 7 tokens do not split over 2 ranks: the all-reduces stay, with a note
        demo = _demo().eval().requires_grad_(False)
        odd = ids[:1, :7]
        t7 = parallelize(demo, (odd,), tp=ws, config=_cfg(), sequence_parallel=True)
        assert t7.plan.all_reduces == 4 and t7.plan.reduce_scatters == 0, str(t7.plan)
        assert "no all-reduce with a token count divisible" in str(t7.plan)
        # the default config keeps decode-sized all-reduces (under 1 MB) as they are
        small = parallelize(demo, (ids,), tp=ws, sequence_parallel=True, config=fxopt.Config())
        assert small.plan.reduce_scatters == 0 and small.plan.all_reduces == 4, str(small.plan)
        assert "sequence_parallel_min_bytes" in str(small.plan)
        torch.testing.assert_close(t7(odd), demo(odd), rtol=1e-5, atol=1e-5)
        # int4 linears (dequantize -> linear) in an MLP whose residual stream starts at the graph input
        mlp = _quant_mlp(8, blocks=2)
        x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(9)).half()
        q = parallelize(mlp, (x,), tp=ws, config=_cfg(), sequence_parallel=True)
        assert q.plan.reduce_scatters == 2 and q.plan.all_reduces == 0, str(q.plan)
        torch.testing.assert_close(q(x).float(), mlp(x).float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="sequence_parallel and overlap_chunks"):
        parallelize(demo, (ids,), tp=ws, sequence_parallel=True, overlap_chunks=2)
    # a training graph keeps its all-reduces (the note says why)
    tr = parallelize(_demo(), (ids,), tp=ws, config=_cfg(), sequence_parallel=True, training=True)
    assert tr.plan.reduce_scatters == 0 and tr.plan.all_reduces == 4
    assert "inference graphs" in str(tr.plan)


def _check_async_tp_patterns(ws):
    """The sequence-parallel graph, compiled by Inductor, offers every all-gather to a consumer matmul and every
    reduce-scatter to a producer matmul, as Inductor's micro-pipeline TP (async TP) needs to fuse them."""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp as mptp

    from fxopt.parallel.tensor_parallel import parallelize

    found = []

    def probe(graph):
        ags = [len(mptp._find_consumer_matmuls(m.res_node)) for m in mptp.find_all_gather_patterns(graph)]
        rss = [mptp._find_producer_matmul(m.input_node) is not None for m in mptp.find_reduce_scatter_patterns(graph)]
        found.append((ags, rss))

    model = _demo().eval().requires_grad_(False)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=probe):
        tpm = parallelize(model, (ids,), tp=ws, config=_cfg(), sequence_parallel=True)
        out = torch.compile(tpm, backend="fxopt")(ids)
    torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-4)
    ags, rss = found[-1]
    # layer 0's MLP (gate + up share one gather), layer 1's q/k/v and MLP, the lm_head
    assert ags == [2, 3, 2, 1], found
    assert len(rss) == 4 and all(rss), found


def _check_ranks_disagree(rank, ws):
    """Ranks called with different example shapes: the same clear error on both, before the first collective."""
    from fxopt.parallel.distribute import DistributeError
    from fxopt.parallel.tensor_parallel import parallelize

    x = torch.randn(2, 4 if rank == 0 else 6, 32)
    with pytest.raises(DistributeError, match=r"different models or example inputs(.|\n)*ranks \[1\]"):
        parallelize(MLP(), (x,), tp=ws, config=_cfg())


def _worker_all(rank, ws):
    import time

    _check_ranks_disagree(rank, ws)
    t0 = time.perf_counter()
    _worker_models(rank, ws)
    t1 = time.perf_counter()
    _worker_vocab_quant_compile(rank, ws)
    _check_sequence_parallel(ws)
    _check_async_tp_patterns(ws)
    if rank == 0:
        print(f"models {t1 - t0:.1f}s, vocab/quant/compile {time.perf_counter() - t1:.1f}s")


@pytest.mark.slow
def test_gloo_two_ranks():
    """One spawn for every gloo check (process start-up and imports dominate on 2 cores)."""
    run_on_ranks(_worker_all, 2)


# ----------------------------------------------------------------------------------------------------------------
# fake process group: plans and shapes at world size 4 and 8, in this process
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_pg(request):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ws = request.param
    dist.init_process_group("fake", rank=0, world_size=ws, store=FakeStore())
    try:
        yield ws
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_fake_pg_world4_gqa_kv_replicated(fake_pg):
    from fxopt.parallel.tensor_parallel import parallelize

    model = _demo().eval().requires_grad_(False)
    ids = torch.randint(0, 64, (2, 8))
    tpm = parallelize(model, (ids,), tp=4, config=_cfg())
    text = str(tpm.plan)
    assert "kv projections replicated over 2 ranks" in text, text
    assert tpm.get_parameter("layers.0.attn.q_proj.weight").shape == (16, 64)  # 1 of 4 q heads
    assert tpm.get_parameter("layers.0.attn.k_proj.weight").shape == (16, 64)  # the 1 kv head rank 0 reads
    assert tpm.get_parameter("layers.0.attn.o_proj.weight").shape == (64, 16)
    assert tpm.get_parameter("layers.0.mlp.down_proj.weight").shape == (64, 24)
    assert tpm.plan.all_reduces == 4
    assert tpm(ids).shape == (2, 8, 64)
    report_notes = [l for r in tpm.pass_results if r.name == "tensor_parallel" for l in r.notes]
    assert any("tp=4" in l for l in report_notes)
    # a transformers Llama with its default cache: each rank's cache holds the one kv head its query heads read
    llama = _llama().eval().requires_grad_(False)
    tpm = parallelize(llama, (), {"input_ids": ids[:1]}, tp=4, config=_cfg())
    assert "DynamicCache.layers[0].keys  dim 1, sections [2 (x2 replicated)] (2 -> 1)" in str(tpm.plan)
    cache = _cache_of(tpm(input_ids=ids[:1]))
    out = tpm(input_ids=ids[:1, :1], **{_cache_kw(llama): cache})
    assert out.logits.shape == (1, 1, 128) and [tuple(l.keys.shape) for l in cache.layers] == [(1, 1, 9, 16)] * 2


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_fake_pg_world4_sequence_parallel_graph(fake_pg):
    """The sequence-parallel graph at world size 4: the residual stream and the norms hold 16 / 4 tokens, every
    column-parallel block reads an all-gathered input, the embeddings are sliced locally (no communication)."""
    from fxopt.parallel.tensor_parallel import parallelize

    model = _demo().eval().requires_grad_(False)
    ids = torch.randint(0, 64, (2, 8))
    tpm = parallelize(model, (ids,), tp=4, config=_cfg(), sequence_parallel=True)
    gm = tpm.graph_module
    assert tpm.plan.reduce_scatters == 4 and tpm.plan.all_reduces == 0 and tpm.plan.all_gathers == 4
    rs = [n for n in gm.graph.nodes if "reduce_scatter" in str(n.target)]
    assert all(tuple(n.meta["val"].shape) == (4, 64) for n in rs)  # 16 tokens / 4 ranks
    narrows = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "narrow"]
    assert len(narrows) == 1 and narrows[0].args[1:] == (0, 0, 4)  # the embeddings, rank 0's first 4 tokens
    for ag in (n for n in gm.graph.nodes if "all_gather" in str(n.target)):
        assert tuple(ag.meta["val"].shape) == (16, 64)
    assert tpm(ids).shape == (2, 8, 64)


class _InplaceMLP(MLP):
    def forward(self, x):
        x = x.clone()
        x.mul_(0.5)  # an in-place op anywhere in the graph: sequence parallel is not applied
        return super().forward(x)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_fake_pg_sequence_parallel_refuses_inplace_graphs(fake_pg):
    from fxopt.parallel.tensor_parallel import parallelize

    model = _InplaceMLP().eval().requires_grad_(False)
    x = torch.randn(4, 6, 32)
    tpm = parallelize(model, (x,), tp=4, config=_cfg(), sequence_parallel=True)
    assert tpm.plan.reduce_scatters == 0 and tpm.plan.all_reduces == 2, str(tpm.plan)
    assert "mutates tensors in place" in str(tpm.plan)


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_fake_pg_world8_heads_not_divisible(fake_pg):
    from fxopt.parallel.tensor_parallel import parallelize

    model = _llama().eval().requires_grad_(False)
    ids = torch.randint(0, 128, (2, 8))
    tpm = parallelize(model, (), {"input_ids": ids, "use_cache": False}, tp=8, config=_cfg())
    text = str(tpm.plan)
    # 4 q heads cannot be split 8 ways: attention stays replicated, with the reason; the MLP (96 = 8 x 12) is cut
    assert "replicated model.layers.0.self_attn.q_proj" in text and "splits the sharded dim" in text, text
    assert tpm.get_parameter("model.layers.0.self_attn.q_proj.weight").shape == (64, 64)
    assert tpm.get_parameter("model.layers.0.mlp.up_proj.weight").shape == (12, 64)
    assert tpm.plan.all_reduces == 2
    assert tpm(input_ids=ids, use_cache=False).logits.shape == (2, 8, 128)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_fake_pg_refusals(fake_pg):
    from fxopt.parallel.tensor_parallel import parallelize
    from fxopt.quant.linear import QuantLinear

    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="tp=2 but the process group has 4 ranks"):
        parallelize(MLP(), (x,), tp=2)
    # nothing provable: a single linear whose output is the model's output -> replicated, with the reason
    lin = nn.Linear(32, 16)
    tpm = parallelize(lin, (x,), tp=4)
    assert not tpm.plan.shards and "reaches the graph output" in str(tpm.plan)
    torch.testing.assert_close(tpm(x), lin(x))
    with pytest.raises(TypeError, match="has no generate"):
        tpm.generate(x)
    # act-order int4 row-parallel linear: the permutation mixes features across ranks -> refused
    torch.manual_seed(0)
    mlp = MLP(d=64, h=256, blocks=1)
    from fxopt.quant.format import quantize_rtn
    packed = quantize_rtn(mlp.blocks[0][2].weight.detach(), group_size=32)
    packed.perm = torch.randperm(256)
    mlp.blocks[0][2] = QuantLinear.from_packed(packed)
    mlp = mlp.half().eval().requires_grad_(False)
    tpm = parallelize(mlp, (x.half().repeat(1, 1, 2),), tp=4, config=_cfg())
    text = str(tpm.plan)
    assert tpm.plan.all_reduces == 0 and "index_select" in text, text


# ----------------------------------------------------------------------------------------------------------------
# KV cache: sharded by heads, passed back, generate()
# ----------------------------------------------------------------------------------------------------------------
def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def _cache_kw(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_decode(rank, ws, model, steps=6):
    """Greedy decoding: the tp module's logits, tokens and local cache heads against the single-process model's."""
    from fxopt.parallel.tensor_parallel import parallelize

    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    tpm = parallelize(model, (), {"input_ids": ids}, tp=ws, config=_cfg())
    text = str(tpm.plan)
    assert tpm.plan.all_reduces == 2 * 2 and "cat of sharded" not in text, text
    kw = _cache_kw(model)
    ref, got = model(input_ids=ids), tpm(input_ids=ids)
    tokens = []
    for step in range(steps):
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        ref_cache, tp_cache = _cache_of(ref), _cache_of(got)
        for lr, lt in zip(ref_cache.layers, tp_cache.layers):  # 2 kv heads, tp=2: rank r holds head r
            torch.testing.assert_close(lt.keys, lr.keys[:, rank:rank + 1])
            torch.testing.assert_close(lt.values, lr.values[:, rank:rank + 1])
        nxt = ref.logits[:, -1:].argmax(-1)
        assert torch.equal(got.logits[:, -1:].argmax(-1), nxt)
        tokens.append(nxt)
        if step + 1 < steps:
            ref, got = model(input_ids=nxt, **{kw: ref_cache}), tpm(input_ids=nxt, **{kw: tp_cache})
    assert len(tpm._graphs) == steps  # prefill + one re-capture per new cache length
    expected = model.generate(ids, max_new_tokens=steps, do_sample=False)
    assert torch.equal(expected[:, ids.shape[1]:], torch.cat(tokens, 1))
    assert torch.equal(tpm.generate(ids, max_new_tokens=steps, do_sample=False), expected)


def _worker_kv_cache(rank, ws):
    torch.use_deterministic_algorithms(False)
    _check_decode(rank, ws, _llama().eval().requires_grad_(False))
    _check_decode(rank, ws, _llama(1, "Qwen2").eval().requires_grad_(False))
    # a sliding window shorter than the text: the cache layers drop their oldest entries (and keep a window tensor)
    _check_decode(rank, ws, _llama(2, "Mistral", sliding_window=7).eval().requires_grad_(False), steps=4)


@pytest.mark.slow
def test_gloo_two_ranks_kv_cache():
    run_on_ranks(_worker_kv_cache, 2)


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_fake_pg_default_cache_shards_attention(fake_pg):
    """The default DynamicCache: q/k/v/o shard by heads (torch.cat skips the layer's empty start tensor), the cache
    tensors leave the graph local, and the decode graph takes them back as sharded inputs."""
    from fxopt.parallel.tensor_parallel import parallelize

    model = _llama().eval().requires_grad_(False)
    ids = torch.randint(0, 128, (1, 8))
    tpm = parallelize(model, (), {"input_ids": ids}, tp=2, config=_cfg())
    text = str(tpm.plan)
    assert "cat of sharded and replicated" not in text, text
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{proj}" in text and f"replicated model.layers.0.self_attn.{proj}" not in text
    assert len(tpm.plan.outputs) == 4 and "local output DynamicCache.layers[1].keys  dim 1 (2 -> 1)" in text, text
    assert "replicated lm_head: reaches the graph output" in text  # the logits keep the default rule
    out = tpm(input_ids=ids)
    cache = _cache_of(out)
    assert out.logits.shape == (1, 8, 128)
    assert [tuple(l.keys.shape) for l in cache.layers] == [(1, 1, 8, 16)] * 2  # 1 of 2 kv heads
    nxt = out.logits[:, -1:].argmax(-1)
    out2 = tpm(input_ids=nxt, **{_cache_kw(model): cache})
    assert _cache_of(out2) is cache and [tuple(l.values.shape) for l in cache.layers] == [(1, 1, 9, 16)] * 2
    decode = list(tpm._graphs.values())[-1].plan
    assert len(decode.inputs) == 4 and decode.all_reduces == 4, str(decode)
    assert {ts.name: ts.shard for ts in decode.shards.values()} == {n: ts.shard for n, ts in tpm._cuts.items()}


class _CacheAttention(nn.Module):
    """One attention block on a transformers DynamicCache; with ``mix_heads`` the decode step reads the cached keys
    summed over every head (not per shard)."""

    def __init__(self, d=32, heads=4, mix_heads=False):
        super().__init__()
        self.heads, self.mix_heads = heads, mix_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cache):
        b, s, d = x.shape

        def heads(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        k, v = cache.update(heads(self.k(x)), heads(self.v(x)), 0)
        y = torch.nn.functional.scaled_dot_product_attention(heads(self.q(x)), k, v)
        y = self.o(y.transpose(1, 2).reshape(b, s, d))
        if self.mix_heads and k.shape[2] > s:
            y = y * k.sum().sigmoid()
        return y, cache


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_fake_pg_kv_cache_errors(fake_pg):
    from fxopt.parallel.distribute import DistributeError
    from fxopt.parallel.kv_cache import CacheError
    from fxopt.parallel.tensor_parallel import parallelize
    from fxopt.passes.tensor_parallel import ShardedInputError

    model = _llama().eval().requires_grad_(False)
    ids = torch.randint(0, 128, (1, 6))
    kw = _cache_kw(model)
    a = parallelize(model, (), {"input_ids": ids}, tp=2, config=_cfg())
    b = parallelize(model, (), {"input_ids": ids}, tp=2, config=_cfg())
    nxt = ids[:, :1]
    with pytest.raises(CacheError, match="returned by another TensorParallelModule"):
        b(input_ids=nxt, **{kw: _cache_of(a(input_ids=ids))})
    with pytest.raises(CacheError, match="this module did not return"):  # the single-process model's cache
        a(input_ids=nxt, **{kw: _cache_of(model(input_ids=ids))})
    with pytest.raises(DistributeError, match="example inputs hold a filled KV cache"):
        parallelize(model, (), {"input_ids": nxt, kw: _cache_of(model(input_ids=ids))}, tp=2, config=_cfg())
    # a decode graph that needs the whole cached keys: a clear error, never a wrong local result
    torch.manual_seed(0)
    attn = _CacheAttention(mix_heads=True).eval().requires_grad_(False)
    x = torch.randn(1, 5, 32)
    tpm = parallelize(attn, (x, transformers.DynamicCache()), tp=2, config=_cfg())
    assert len(tpm.plan.outputs) == 2 and tpm.plan.all_reduces == 1, str(tpm.plan)
    _, cache = tpm(x, transformers.DynamicCache())
    with pytest.raises(ShardedInputError, match="holds this rank's part"):
        tpm(x[:, :1], cache)


@pytest.mark.parametrize("fake_pg", [8], indirect=True)
def test_fake_pg_world8_cache_heads_not_divisible(fake_pg):
    """4 query heads over 8 ranks: attention and its cache stay replicated (with the reason) and decoding runs."""
    from fxopt.parallel.tensor_parallel import parallelize

    model = _llama().eval().requires_grad_(False)
    ids = torch.randint(0, 128, (1, 8))
    tpm = parallelize(model, (), {"input_ids": ids}, tp=8, config=_cfg())
    text = str(tpm.plan)
    assert "replicated model.layers.0.self_attn.k_proj" in text and not tpm.plan.outputs, text
    cache = _cache_of(tpm(input_ids=ids))
    assert [tuple(l.keys.shape) for l in cache.layers] == [(1, 2, 8, 16)] * 2
    out = tpm(input_ids=ids[:, :1], **{_cache_kw(model): cache})
    assert out.logits.shape == (1, 1, 128) and tuple(cache.layers[0].keys.shape) == (1, 2, 9, 16)


def test_pass_outside_parallelize_leaves_graph():
    cfg = fxopt.Config()
    cfg.tensor_parallel.enabled = True
    cfg.tensor_parallel.tp = 2
    rep = fxopt.explain(MLP(), torch.randn(2, 32), config=cfg)
    assert rep.rewrites["tensor_parallel"] == 0
    assert any("fxopt.parallelize" in s.reason for s in rep.skipped if s.pass_name == "tensor_parallel")


def test_reshape_map_rules():
    from fxopt.passes.tensor_parallel import Shard
    from fxopt.passes.tensor_parallel.plan import _Conflict
    from fxopt.passes.tensor_parallel.rules import _reshape_map

    s = Shard(2, ((64, 1),))
    assert _reshape_map((2, 8, 64), (2, 8, 4, 16), s, 2) == Shard(2, ((4, 1),))  # heads
    assert _reshape_map((2, 8, 4, 16), (2, 8, 64), Shard(2, ((4, 1),)), 2) == Shard(2, ((64, 1),))
    # fused qkv viewed as (3, H, D): the shard moves to H
    assert _reshape_map((2, 8, 192), (2, 8, 3, 4, 16), Shard(2, ((64, 1),) * 3), 2) == Shard(3, ((4, 1),))
    # merging (B, S) keeps a feature shard
    assert _reshape_map((2, 8, 64), (16, 64), s, 2) == Shard(1, ((64, 1),))
    with pytest.raises(_Conflict):  # 4 heads over 8 ranks
        _reshape_map((2, 8, 64), (2, 8, 4, 16), s, 8)
    with pytest.raises(_Conflict):  # head_dim first: would cut inside heads
        _reshape_map((2, 8, 64), (2, 8, 16, 4), Shard(2, ((64, 1),) * 1), 32)
    # indices: sections and replication
    assert Shard(0, ((4, 1), (4, 1))).indices(1, 2) == [2, 3, 6, 7]
    assert Shard(0, ((2, 2),)).indices(3, 4) == [1]
