"""Pipeline parallelism: the partitioner against brute force, the cost model, and fxopt.pipeline on gloo ranks
(outputs, losses and gradients equal to the single-device model, in float64)."""
import copy
import itertools
import random

import networkx as nx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.parallel.pipeline import PipelineError, build_stage_modules, capture, _state_names
from fxopt.passes.manager import ensure_meta_val
from fxopt.passes.pipeline import DeviceProfile, build_plan, evaluate, graph_costs, node_cost, partition_order
from fxopt.testing import run_on_ranks


# ---------------------------------------------------------------------------------------------------------------------
# Partitioner against brute force
# ---------------------------------------------------------------------------------------------------------------------


def _dag(costs, edges, nbytes, unsendable=()):
    g = nx.DiGraph()
    g.add_node("in", cost=0.0, bytes=nbytes.get("in", 1.0), pinned_stage=0, counts=False)
    for v, c in costs.items():
        g.add_node(v, cost=float(c), bytes=float(nbytes.get(v, 1.0)), sendable=v not in unsendable)
    g.add_node("out", cost=0.0, bytes=0.0, pinned_stage=-1, counts=False)
    g.add_edges_from(edges)
    return g


def _chain(costs, nbytes=None, skips=()):
    names = [f"n{i}" for i in range(len(costs))]
    edges = [("in", names[0])] + list(zip(names, names[1:])) + [(names[-1], "out")]
    edges += [(names[a], names[b]) for a, b in skips]
    nb = {n: (nbytes[i] if nbytes else 1.0) for i, n in enumerate(names)}
    return _dag(dict(zip(names, costs)), edges, nb), names


def _brute(g, stages, slack=0.0):
    """All assignments of the free nodes to stages; the best valid one by the partitioner's objectives."""
    free = [v for v, d in g.nodes(data=True) if d.get("pinned_stage") is None]
    parts = []
    for labels in itertools.product(range(stages), repeat=len(free)):
        st = dict(zip(free, labels))
        for v, d in g.nodes(data=True):
            if d.get("pinned_stage") is not None:
                st[v] = d["pinned_stage"] if d["pinned_stage"] >= 0 else stages - 1
        p = evaluate(g, st, stages)
        if p is not None:
            parts.append(p)
    return _best(parts, slack)


def _best(parts, slack=0.0):
    t = min(p.bottleneck for p in parts)
    ok = [p for p in parts if p.bottleneck <= t * (1 + slack + 1e-9)]
    b = min(p.total_bytes for p in ok)
    best = min((p for p in ok if p.total_bytes <= b + 1e-9), key=lambda p: p.bottleneck)
    return best.bottleneck, best.total_bytes


def test_balanced_chain_splits_evenly():
    g, names = _chain([3.0] * 8)
    part = partition_order(g, names, 4)
    assert part.stage_costs == [6.0] * 4
    assert part.boundary_bytes == [1.0] * 3
    assert (part.bottleneck, part.total_bytes) == _brute(g, 4)


def test_one_huge_layer_gets_its_own_stage():
    g, names = _chain([1, 1, 1, 20, 1, 1, 1])
    part = partition_order(g, names, 3)
    assert part.bottleneck == 20.0
    assert part.stage["n3"] not in (part.stage["n2"], part.stage["n4"])  # alone
    assert (part.bottleneck, part.total_bytes) == _brute(g, 3)


@pytest.mark.parametrize("seed", range(6))
def test_random_chains_with_skips_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(5, 8)
    costs = [rng.choice([1, 2, 3, 5, 8]) for _ in range(n)]
    nbytes = [rng.choice([1, 4, 16]) for _ in range(n)]
    skips = [(a, a + rng.randint(2, 3)) for a in range(n - 3) if rng.random() < 0.4]
    g, names = _chain(costs, nbytes, skips)
    for stages in (2, 3):
        for slack in (0.0, 0.3):
            part = partition_order(g, names, stages, slack=slack)
            assert (part.bottleneck, part.total_bytes) == pytest.approx(_brute(g, stages, slack)), (stages, slack)


@pytest.mark.parametrize("seed", range(4))
def test_random_dags_order_split_matches_brute_force(seed):
    rng = random.Random(100 + seed)
    n = 7
    names = [f"v{i}" for i in range(n)]
    edges = [("in", names[0])]
    for j in range(1, n):
        for i in rng.sample(range(j), k=min(j, rng.randint(1, 2))):
            edges.append((names[i], names[j]))
    sinks = [v for v in names if not any(e[0] == v for e in edges)]
    edges += [(v, "out") for v in sinks]
    g = _dag({v: rng.choice([1, 2, 4, 7]) for v in names}, edges, {v: rng.choice([1, 3, 9]) for v in names})
    order = list(nx.lexicographical_topological_sort(g.subgraph(names)))
    for stages in (2, 3):
        part = partition_order(g, order, stages)
        splits = []  # every cut of the order into contiguous segments
        for cuts in itertools.combinations(range(1, n), stages - 1):
            st = {v: sum(i >= c for c in cuts) for i, v in enumerate(order)}
            p = evaluate(g, {**st, "in": 0, "out": stages - 1}, stages)
            if p is not None:
                splits.append(p)
        assert (part.bottleneck, part.total_bytes) == pytest.approx(_best(splits))
        assert part.bottleneck >= _brute(g, stages)[0] - 1e-9  # one order's cuts never beat all valid splits


def test_unsendable_value_and_pins_and_too_many_stages():
    g, names = _chain([1, 1, 1, 1])
    g.nodes["n1"]["sendable"] = False  # e.g. a tuple: no cut right after n1
    part = partition_order(g, names, 2)
    assert part.stage["n1"] == part.stage["n2"]
    assert (part.bottleneck, part.total_bytes) == _brute(g, 2)
    part = partition_order(g, names, 2, cut_before=["n3"])
    assert part.stage["n2"] == 0 and part.stage["n3"] == 1
    with pytest.raises(PipelineError, match="cannot be cut into 5 stages"):
        partition_order(g, names, 5)
    with pytest.raises(PipelineError, match="cannot be cut into 4 stages"):
        partition_order(g, names, 4)  # 4 nodes, but the boundary after n1 is invalid


# ---------------------------------------------------------------------------------------------------------------------
# Cost model and plan on captured graphs (no process group)
# ---------------------------------------------------------------------------------------------------------------------


class MLPStack(nn.Module):
    """Uneven layer sizes: the balanced split is not the middle layer."""

    def __init__(self, sizes=(16, 64, 16, 96, 24, 8)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class TiedLM(nn.Module):
    def __init__(self, vocab=32, dim=16, n=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.lm_head(x)


class GraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def _plan(model, args, stages, **kw):
    gm, ex = capture(model, args, {})
    ensure_meta_val(gm, ex)
    names = _state_names(model)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {n.name: names[id(v)] for n, v in zip(phs, ex) if id(v) in names}
    tensors = {names[id(v)]: v for v in ex if id(v) in names}
    plan = build_plan(gm, stages, state=state, profile=DeviceProfile.cpu(), **kw)
    mods = build_stage_modules(gm, plan, state, tensors, [n.name for n in phs if n.name not in state])
    return gm, plan, mods


def test_cost_model_counts_linear_flops():
    torch.manual_seed(0)
    gm, ex = capture(nn.Linear(64, 32), [torch.randn(8, 64)], {})
    ensure_meta_val(gm, ex)
    lin = next(n for n in gm.graph.nodes if n.op == "call_function")
    c = node_cost(lin, DeviceProfile.cpu())
    assert c.flops == 2 * 8 * 64 * 32
    assert c.bytes == 4 * (8 * 64 + 32 * 64 + 32 + 8 * 32)


def _graph(fn, *args):
    gm, ex = capture(fn, list(args), {})
    ensure_meta_val(gm, ex)
    return gm


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_gemm_efficiency_grows_with_size():
    """Documented behaviour: a GEMM of F FLOPs reaches F / (F + peak * matmul_latency) of the peak, so a tiny GEMM
    costs more device time per FLOP than a large one, and a large one approaches the peak."""
    prof = DeviceProfile.h200()
    peak = prof.matmul_peak(torch.bfloat16)
    half = peak * prof.matmul_latency_s
    assert prof.matmul_efficiency(half) == pytest.approx(0.5)
    sizes = [2 * n**3 for n in (64, 256, 1024, 4096, 8192)]
    effs = [prof.matmul_efficiency(f) for f in sizes]
    assert all(a < b for a, b in zip(effs, effs[1:]))
    assert effs[0] < 0.01 and effs[-1] > 0.99
    # Through node_cost on real linear nodes (captured on the meta device, bf16): per-FLOP device time.
    per_flop = []
    for m, k, n in ((16, 64, 64), (512, 1024, 1024), (4096, 8192, 8192)):
        x = torch.empty(m, k, device="meta", dtype=torch.bfloat16)
        w = torch.empty(n, k, device="meta", dtype=torch.bfloat16)
        gm = _graph(_Fn(F.linear), x, w)
        lin = next(nd for nd in gm.graph.nodes if nd.op == "call_function")
        c = node_cost(lin, prof)
        assert c.kind == "matmul" and c.flops == 2 * m * k * n
        assert c.seconds >= prof.op_overhead_s and c.seconds >= c.kernel_seconds
        per_flop.append(c.kernel_seconds / c.flops)
    assert per_flop[0] > per_flop[1] > per_flop[2]
    assert per_flop[2] * peak == pytest.approx(1.0, rel=0.02)  # the large GEMM runs at the peak


def test_causal_attention_costs_half_and_embedding_reads_rows():
    prof = DeviceProfile.h200()
    q = torch.empty(4, 8, 2048, 128, device="meta", dtype=torch.bfloat16)
    secs = {}
    for causal in (False, True):
        gm = _graph(_Fn(lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)), q, q, q)
        node = next(nd for nd in gm.graph.nodes if nd.op == "call_function")
        c = node_cost(node, prof)
        assert c.kind == "attention" and c.flops == 4 * 4 * 8 * 2048 * 2048 * 128
        secs[causal] = c.kernel_seconds
    assert secs[True] == pytest.approx(secs[False] / 2)
    assert secs[False] == pytest.approx(4 * 4 * 8 * 2048**2 * 128 / prof.attention_peak(torch.bfloat16))
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    table = torch.empty(50000, 1024, device="meta", dtype=torch.bfloat16)
    gm = _graph(_Fn(F.embedding), ids, table)
    node = next(nd for nd in gm.graph.nodes if nd.op == "call_function")
    out_bytes = 2 * 16 * 1024 * 2
    assert node_cost(node, prof).bytes == 2 * out_bytes + ids.numel() * 8  # rows read + written, not the table


def _rms_mlp(x, w1, w2):
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    h = F.linear(h, w1)
    h = F.silu(h) * 2.0 + 1.0
    return F.linear(h, w2) + x


def test_graph_costs_fuse_elementwise_between_matmuls():
    """Elementwise nodes between two matmuls are one fused kernel whose bytes are what enters and leaves the group;
    a matmul in between splits groups (the residual add after linear 2 is not fused with the norm before linear 1,
    though both read x)."""
    prof = DeviceProfile.h200()
    x = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    w1 = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    w2 = torch.empty(1024, 4096, device="meta", dtype=torch.bfloat16)
    gm = _graph(_Fn(_rms_mlp), x, w1, w2)
    costs = graph_costs(list(gm.graph.nodes), prof)
    mem = [nd for nd, c in costs.items() if c.kind == "memory"]
    assert sum(c.kind == "matmul" for c in costs.values()) == 2
    small, big = 4096 * 1024 * 2, 4096 * 4096 * 2  # bytes of x-shaped and of linear-1-shaped bf16 values
    # norm: reads x, writes its bf16 output; middle: reads linear 1's output, writes silu(.)*2+1; last: reads
    # linear 2's output and x, writes the result. The fp32 intermediates of the norm never reach memory.
    assert sum(costs[nd].bytes for nd in mem) == pytest.approx(2 * small + 2 * big + 3 * small)
    assert sum(node_cost(nd, prof).bytes for nd in mem) > 3 * (5 * small + 2 * big)  # unfused: every node's I/O
    # Three kernels, each shorter than the per-kernel floor: the memory nodes cost three floors in all.
    assert sum(costs[nd].seconds for nd in mem) == pytest.approx(3 * prof.op_overhead_s)
    # With no floor, the fused kernels cost their bytes at the bandwidth.
    prof.op_overhead_s = 0.0
    costs = graph_costs(list(gm.graph.nodes), prof)
    assert sum(costs[nd].seconds for nd in mem) == pytest.approx((5 * small + 2 * big) / prof.mem_bw)


def test_plan_on_uneven_mlp_and_stage_modules_compose():
    torch.manual_seed(0)
    model = MLPStack().double()
    x = torch.randn(4, 16, dtype=torch.float64)
    gm, plan, mods = _plan(model, [x], 3)
    text = str(plan)
    assert "3 stages" in text and "boundary 0->1" in text and "balance" in text
    assert len(plan.boundaries) == 2 and all(b.bytes > 0 for b in plan.boundaries)
    out = x
    for s in range(3):
        out = mods[s](*(out if isinstance(out, tuple) else (out,)))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    # Every parameter belongs to exactly one stage; they are the model's own Parameter objects.
    owned = [p for m in mods.values() for p in m.parameters()]
    assert len(owned) == len(list(model.parameters()))
    assert {id(p) for p in owned} == {id(p) for p in model.parameters()}


def test_plan_pins_split_point_and_reports_tied_weight():
    torch.manual_seed(0)
    model = TiedLM().double()
    ids = torch.randint(0, 32, (2, 5))
    _, plan, mods = _plan(model, [ids], 2, split_points=["layers.3"])
    assert plan.pinned == ["layers.3"]
    assert plan.stages[1].modules[0].startswith("layers.3")
    assert plan.shared == {"embed.weight": [0, 1]}
    assert "shared parameter embed.weight" in str(plan)
    torch.testing.assert_close(mods[1](mods[0](ids)), model(ids), rtol=0, atol=0)
    with pytest.raises(PipelineError, match="matches no module"):
        _plan(model, [ids], 2, split_points=["decoder.7"])
    with pytest.raises(PipelineError, match="cannot be cut into 200 stages"):
        _plan(model, [ids], 200)


def test_graph_break_is_a_clear_error():
    with pytest.raises(PipelineError, match="one graph"):
        capture(GraphBreak(), [torch.randn(2, 4)], {})


def test_pass_reports_plan_through_explain():
    import fxopt

    cfg = fxopt.Config()
    cfg.attention.enabled = cfg.w4a16.enabled = False
    cfg.pipeline = fxopt.PipelineConfig(enabled=True, stages=2)
    rep = fxopt.explain(MLPStack(), torch.randn(4, 16), config=cfg)
    assert any("pipeline plan: 2 stages" in line for line in rep.notes)
    cfg.pipeline = fxopt.PipelineConfig(enabled=True, stages=50)
    rep = fxopt.explain(MLPStack(), torch.randn(4, 16), config=cfg)
    assert any("cannot be cut into 50 stages" in s.reason for s in rep.skipped)


# ---------------------------------------------------------------------------------------------------------------------
# fxopt.pipeline on gloo ranks
# ---------------------------------------------------------------------------------------------------------------------


def _llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=tied,
                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = LlamaForCausalLM(cfg)

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    return Logits().double()


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _check_training(rank, model, x, y, loss_fn, **kw):
    """fxopt.pipeline(model) vs the single-device model: forward output, loss, gradients (float64)."""
    from fxopt.parallel.pipeline import pipeline

    ref = copy.deepcopy(model)
    kw.setdefault("compile", False)
    runner = pipeline(model, (x,), **kw)
    with torch.no_grad():
        expect = ref(x)
    out = runner.forward(x)
    if runner.is_last:
        torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)
    else:
        assert out is None
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    for _ in range(2):  # the second step checks that gradients accumulate
        loss = runner.step(x, target=y, loss_fn=loss_fn)
        if runner.is_last:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-10)
    ref_params = dict(ref.named_parameters())
    n = 0
    for name, p in runner.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref_params[name].grad, rtol=1e-9, atol=1e-12, msg=name)
        n += 1
    assert n > 0
    return runner


def _ranks_main(rank, world):
    torch.manual_seed(1)
    # Llama (transformers), 1F1B, 4 micro-batches.
    x = torch.randint(0, 128, (4, 8))
    y = torch.randint(0, 128, (4, 8))
    runner = _check_training(rank, _llama(False), x, y, _lm_loss, microbatches=4, schedule="1F1B")
    if rank == 0:
        print(runner.plan)
    # Tied embedding / lm_head: gradients summed over both ranks; copies equal.
    model = _llama(True)
    runner = _check_training(rank, model, x, y, _lm_loss, microbatches=2, schedule="GPipe")
    w = model.m.model.embed_tokens.weight
    assert any(p is w for p in runner.parameters())
    ws = [torch.empty_like(w) for _ in range(world)]
    torch.distributed.all_gather(ws, w.grad.contiguous())
    torch.testing.assert_close(ws[0], ws[1], rtol=0, atol=0)
    # Uneven MLP stack, interleaved: 4 stages on 2 ranks.
    xm = torch.randn(8, 16, dtype=torch.float64)
    ym = torch.randn(8, 8, dtype=torch.float64)
    _check_training(rank, MLPStack().double(), xm, ym, F.mse_loss, stages=4, microbatches=4,
                    schedule="Interleaved1F1B")
    # Errors.
    from fxopt.parallel.pipeline import pipeline

    with pytest.raises(PipelineError, match="does not divide the batch"):
        pipeline(MLPStack(), (torch.randn(6, 16),), microbatches=4, compile=False)
    with pytest.raises(PipelineError, match="one graph"):
        pipeline(GraphBreak(), (torch.randn(4, 4),), microbatches=2, compile=False)
    with pytest.raises(PipelineError, match="stages must equal the world size"):
        pipeline(MLPStack(), (torch.randn(4, 16),), stages=3, compile=False)
    with pytest.raises(PipelineError, match="cuda_graphs needs CUDA stages"):
        pipeline(MLPStack(), (torch.randn(4, 16),), microbatches=2, compile=False, device="cpu", cuda_graphs=True)
    with pytest.raises(PipelineError, match="not Interleaved1F1B"):
        pipeline(MLPStack(), (torch.randn(4, 16),), stages=4, microbatches=4, schedule="Interleaved1F1B",
                 compile=False, cuda_graphs=True)


@pytest.mark.slow
def test_pipeline_two_ranks_matches_single_device():
    run_on_ranks(_ranks_main, 2)


def _ranks_four(rank, world):
    torch.manual_seed(2)
    model = MLPStack(sizes=(16, 48, 16, 80, 24, 32, 8)).double()
    fresh = copy.deepcopy(model)
    xm = torch.randn(8, 16, dtype=torch.float64)
    ym = torch.randn(8, 8, dtype=torch.float64)
    runner = _check_training(rank, model, xm, ym, F.mse_loss, microbatches=8, schedule="1F1B",
                             compile="fxopt_eager")  # stages go through torch.compile with fxopt's passes
    assert all(hasattr(m, "_orig_mod") for m in runner._compiled.values())
    # 1F1B with fewer micro-batches than stages (PyTorch's Schedule1F1B refuses it; GPipe's order is the same)
    runner = _check_training(rank, fresh, xm, ym, F.mse_loss, microbatches=2, schedule="1F1B")
    assert type(runner._train).__name__ == "ScheduleGPipe"


@pytest.mark.slow
def test_pipeline_four_ranks_matches_single_device():
    run_on_ranks(_ranks_four, 4)


def test_retarget_devices_rewrites_device_literals():
    """A graph captured on the host names ``device=cpu`` in its factories; stages on another device need it moved."""
    from fxopt.parallel.pipeline import retarget_devices

    def f(x):
        return x + torch.arange(x.shape[-1], device=x.device) + torch.zeros(x.shape[-1], device="cpu")

    gm = torch.fx.symbolic_trace(f)
    for n in gm.graph.nodes:  # symbolic_trace keeps device=x.device symbolic: make it a literal like Dynamo does
        if n.target is torch.arange:
            n.kwargs = {"device": torch.device("cpu")}
    gm.recompile()
    assert retarget_devices(gm, torch.device("cpu"), torch.device("meta")) == 2
    devices = [v for n in gm.graph.nodes for v in n.kwargs.values() if n.op == "call_function" and "device" in n.kwargs]
    assert all(torch.device(d).type == "meta" for d in devices) and len(devices) == 2
    assert retarget_devices(gm, torch.device("cpu"), torch.device("cpu")) == 0
