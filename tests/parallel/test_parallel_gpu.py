"""Tensor and pipeline parallelism on one GPU: 2 gloo ranks, both on ``cuda:0``, CUDA tensors.

What the CPU tests (``test_tensor_parallel.py``, ``test_pipeline.py``) cannot show: fxopt's GPU kernels running inside
sharded graphs and pipeline stages, and gloo carrying CUDA tensors.

* TP, bf16: ``fxopt.parallelize(demo, tp=2)`` (the attention pass puts ``fxopt::flash_attention`` in the sharded
  graph), then ``torch.compile(module, backend="fxopt")`` (Inductor): the graph handed to the backend holds the
  flash-attention op and the all-reduces; logits within bf16 error of a float64 reference, like the single-device
  bf16 model's.
* TP, W4A16: the demo's linears (not the lm_head) as int4 ``QuantLinear`` (group 32, every local K a multiple of it);
  ``fxopt::w4a16_linear`` runs sharded (column: N cut; row: K cut by whole groups), against a float64 model holding
  the dequantized weights.
* TP, KV cache: the transformers Llama (fp32, default config) with its DynamicCache: prefill and decode graphs
  hold ``fxopt::flash_attention`` over the local heads, the cache stays sharded, and ``generate()`` through the
  module gives the single-device model's greedy tokens.
* TP, fp32 training: outputs and every gradient (flash-attention backward included) against float64, cut per rank.
* PP: ``fxopt.pipeline`` 2 stages on ``cuda:0`` for both ranks: outputs, loss and gradients (fp32) against a float64
  single-device model; the transformers Llama with stages compiled by the ``fxopt`` backend; the uneven MLP stack,
  interleaved 1F1B, eager. Note: gloo's send/recv take host pointers only (``ProcessGroupGloo::send`` hands
  ``tensor.data_ptr()`` to the TCP transport, no CUDA staging, unlike its all_reduce/broadcast/all_gather), so the
  pipeline test needs the runner to stage p2p traffic through CPU when the group is gloo and the device is CUDA.

``FXOPT_PARALLEL_TEST_PG=nccl`` runs the same tests on two GPUs, one rank each, with NCCL: rank ``r`` on
``cuda:r``, p2p and collectives straight from GPU memory (no host staging). Skipped with fewer than two GPUs.

``FXOPT_PARALLEL_TEST_DEVICE=cpu`` runs the same bodies on CPU (fp32/fp16, backend ``fxopt_eager`` unless
``FXOPT_PARALLEL_TEST_BACKEND`` says otherwise) without the ``gpu`` mark: everything but the CUDA specifics.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.testing import run_on_ranks

pytest.importorskip("transformers")

from tests.parallel.test_pipeline import MLPStack, _lm_loss  # noqa: E402
from tests.parallel.test_pipeline import _llama as _pp_llama  # noqa: E402
from tests.parallel.test_tensor_parallel import _cfg, _count, _llama  # noqa: E402

DEVICE = os.environ.get("FXOPT_PARALLEL_TEST_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
# Inductor on the GPU; on CPU the passes alone (Inductor's C++ compile is minutes on 2 cores) unless asked.
BACKEND = os.environ.get("FXOPT_PARALLEL_TEST_BACKEND", "fxopt" if ON_GPU else "fxopt_eager")
LOW = torch.bfloat16 if ON_GPU else torch.float32  # the Triton interpreter computes bf16 wrongly
LOW_QUANT = torch.bfloat16 if ON_GPU else torch.float16  # w4a16 takes fp16/bf16 activations

PG = os.environ.get("FXOPT_PARALLEL_TEST_PG", "gloo")  # "nccl": one GPU per rank
assert PG in ("gloo", "nccl"), PG
assert ON_GPU or PG == "gloo", "FXOPT_PARALLEL_TEST_PG=nccl needs FXOPT_PARALLEL_TEST_DEVICE=cuda"

pytestmark = [pytest.mark.gpu if ON_GPU else pytest.mark.slow]
if PG == "nccl":
    pytestmark.append(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL run needs two GPUs"))


def _ranks(fn):
    run_on_ranks(fn, 2, backend=PG)


def _dev():
    if not ON_GPU:
        return torch.device("cpu")
    return torch.device(DEVICE, int(os.environ.get("LOCAL_RANK", 0)) if PG == "nccl" else 0)


def _setup():
    """In each spawned rank: fast kernel selection (no autotuning sweeps), fixed seeds."""
    os.environ["FXOPT_NO_TUNE"] = "1"
    if ON_GPU:
        torch.cuda.set_device(_dev())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)


def _demo(dim=64, ffn=96, layers=2, seed=0):
    from fxopt.models import TinyLlamaConfig, build_demo_model

    cfg = TinyLlamaConfig(vocab_size=64, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=ffn,
                          max_seq_len=16)
    return build_demo_model(seed, cfg)


def _ids(vocab=64, shape=(2, 8), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(out, ref):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def _recording(backend):
    """A backend that keeps the Dynamo graph it is handed (counted before fxopt's passes touch it)."""
    import fxopt

    seen = []

    def rec(gm, example_inputs, **kw):
        seen.append({"flash": _count(gm, "fxopt.flash_attention"), "w4a16": _count(gm, "fxopt.w4a16_linear"),
                     "all_reduce": _count(gm, "_c10d_functional.all_reduce")})
        return fxopt.Backend(inductor=backend == "fxopt")(gm, example_inputs, **kw)

    return rec, seen


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallel
# ----------------------------------------------------------------------------------------------------------------
def _worker_tp_inference(rank, ws):
    """bf16 demo: flash attention inside the sharded, Inductor-compiled graph; then W4A16 linears sharded."""
    from fxopt.parallel.tensor_parallel import parallelize
    from fxopt.quant.linear import QuantLinear, replace_linears

    _setup()
    dev, layers = _dev(), 2
    ids = _ids().to(dev)

    # 1. bf16, default config: attention -> flash_attention, then the tensor_parallel cut.
    base = _demo(layers=layers)
    with torch.no_grad():
        ref64 = copy.deepcopy(base).double()(ids.cpu())  # float64 reference on CPU
    model = base.to(dev, LOW).eval().requires_grad_(False)
    single = model(ids)  # the single-device model, same dtype
    tpm = parallelize(model, (ids,), tp=ws)
    assert _count(tpm.graph_module, "fxopt.flash_attention") == layers, tpm.graph_module.graph
    assert tpm.plan.all_reduces == 2 * layers, str(tpm.plan)
    assert tpm.get_parameter("layers.0.attn.q_proj.weight").shape == (32, 64)  # 2 of 4 heads
    assert tpm.get_parameter("layers.0.mlp.down_proj.weight").device.type == dev.type
    rec, seen = _recording(BACKEND)
    compiled = torch.compile(tpm, backend=rec, fullgraph=True)
    out = compiled(ids)
    assert seen and seen[0]["flash"] == layers and seen[0]["all_reduce"] == 2 * layers, seen
    assert out.dtype == LOW and out.device.type == dev.type
    tol = 2e-2 if LOW == torch.bfloat16 else 1e-5
    e_tp, e_single = _rel_err(out, ref64), _rel_err(single, ref64)
    assert e_tp < tol and e_single < tol, (e_tp, e_single)
    assert e_tp < 3 * e_single + 1e-6, (e_tp, e_single)  # sharding adds no error beyond the dtype's
    # eager run of the same module (no compile) agrees with the compiled one to the dtype's rounding
    assert _rel_err(tpm(ids), out) < tol

    # 2. W4A16: every linear but the lm_head as int4 (group 32). Local K: o_proj 128/2 = 64, down_proj 256/2 = 128,
    #    both multiples of the group size, so row-parallel shards cut whole groups.
    G = 32
    qbase = _demo(dim=128, ffn=256, layers=layers, seed=1)
    replace_linears(qbase, lambda n, lin: QuantLinear.from_linear(lin, group_size=G, dtype=LOW_QUANT)
                    if n != "lm_head" else None)
    for name, mod in qbase.named_modules():
        if isinstance(mod, QuantLinear) and name.endswith(("o_proj", "down_proj")):
            assert (mod.in_features // ws) % G == 0, (name, mod.in_features)
    ref_model = _dequantized_float64(qbase)
    with torch.no_grad():
        qref = ref_model(ids.cpu())
    qmodel = qbase.to(dev, LOW_QUANT).eval().requires_grad_(False)
    qsingle = qmodel(ids)
    q = parallelize(qmodel, (ids,), tp=ws)
    n_quant = 7 * layers
    assert _count(q.graph_module, "fxopt.w4a16_linear") == n_quant, q.graph_module.graph
    assert _count(q.graph_module, "fxopt.dequantize_w4") == 0
    assert q.plan.all_reduces == 2 * layers, str(q.plan)
    assert q.get_buffer("layers.0.mlp.down_proj.qweight").shape == (256 // 8 // ws, 128)  # K/8 cut
    assert q.get_buffer("layers.0.mlp.down_proj.scales").shape == (256 // G // ws, 128)
    assert q.get_buffer("layers.0.mlp.up_proj.qweight").shape == (128 // 8, 256 // ws)  # N cut
    rec, seen = _recording(BACKEND)
    qout = torch.compile(q, backend=rec, fullgraph=True)(ids)
    assert seen and seen[0]["w4a16"] == n_quant and seen[0]["flash"] == layers, seen
    qtol = 2e-2 if LOW_QUANT == torch.bfloat16 else 5e-3
    e_q, e_qsingle = _rel_err(qout, qref), _rel_err(qsingle, qref)
    assert e_q < qtol and e_qsingle < qtol, (e_q, e_qsingle)


def _dequantized_float64(model):
    """A float64 copy of ``model`` whose QuantLinears are nn.Linears holding the dequantized weights."""
    from fxopt.quant.linear import QuantLinear

    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, QuantLinear):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(mod.dequantized_weight().float())
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, lin)
    return ref.double().eval()


def _worker_tp_training(rank, ws):
    """fp32 on the device: outputs and gradients (flash-attention backward inside the shards) against float64."""
    from fxopt.parallel.tensor_parallel import parallelize

    _setup()
    dev, layers = _dev(), 2
    ids = _ids(seed=3).to(dev)
    base = _demo(layers=layers, seed=2).train()
    ref = copy.deepcopy(base).double()
    model = base.to(dev).train()
    tpm = parallelize(model, (ids,), tp=ws)  # default config: flash attention in training form
    assert _count(tpm.graph_module, "fxopt.flash_attention") == layers
    assert tpm.plan.all_reduces == 2 * layers
    out = tpm(ids)
    expect = ref(ids.cpu())
    torch.testing.assert_close(out.double().cpu(), expect, rtol=1e-4, atol=1e-5)
    w = torch.randn(expect.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (expect * w).sum().backward()
    (out.double() * w.to(dev)).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    checked = 0
    for n, p in tpm.named_parameters():
        exp = ref_grads[n]
        ts = tpm._cuts.get(n)
        if ts is not None:
            exp = ts.cut(exp, rank, ws)
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad.double().cpu(), exp, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")
        checked += 1
    assert checked >= len(tpm.plan.shards) > 0


def _worker_tp_kv_cache(rank, ws):
    from fxopt.parallel.tensor_parallel import parallelize

    _setup()
    dev = _dev()
    model = _llama(seed=4).to(dev).eval().requires_grad_(False)
    ids = _ids(vocab=128, shape=(1, 6), seed=4).to(dev)
    tpm = parallelize(model, (), {"input_ids": ids}, tp=ws)
    assert _count(tpm.graph_module, "fxopt.flash_attention") == 2, tpm.graph_module.graph
    assert tpm.plan.all_reduces == 4 and len(tpm.plan.outputs) == 4, str(tpm.plan)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    got = tpm.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected), (got, expected)
    decode = list(tpm._graphs.values())[-1]
    skips = [(s.node, s.reason) for r in decode.results if r.name == "attention" for s in r.skipped]
    assert _count(decode.gm, "fxopt.flash_attention") == 2, skips
    assert len(decode.plan.inputs) == 4, str(decode.plan)


def test_tp_two_ranks_one_gpu_flash_attention_and_w4a16():
    _ranks(_worker_tp_inference)


def test_tp_two_ranks_one_gpu_training_grads():
    _ranks(_worker_tp_training)


def test_tp_two_ranks_one_gpu_kv_cache_generate():
    _ranks(_worker_tp_kv_cache)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------------------------------------------
def _check_pipeline(rank, model, x, y, loss_fn, tol, **kw):
    """fxopt.pipeline(model) on the device vs a float64 single-device copy on CPU: output, loss, gradients."""
    from fxopt.parallel.pipeline import pipeline

    ref = copy.deepcopy(model).double()
    x64 = x.double() if x.is_floating_point() else x
    y64 = y.double() if y.is_floating_point() else y
    runner = pipeline(model, (x,), device=_dev(), **kw)
    for _, p in runner.named_parameters():
        assert p.device.type == _dev().type
    with torch.no_grad():
        expect = ref(x64)
    out = runner.forward(x)
    if runner.is_last:
        assert out.device.type == _dev().type
        torch.testing.assert_close(out.double().cpu(), expect, rtol=tol, atol=tol)
    else:
        assert out is None
    ref_loss = loss_fn(ref(x64), y64)
    ref_loss.backward()
    loss = runner.step(x, target=y, loss_fn=loss_fn)
    if runner.is_last:
        torch.testing.assert_close(loss.double().cpu(), ref_loss.detach(), rtol=tol, atol=tol)
    ref_params = dict(ref.named_parameters())
    n = 0
    for name, p in runner.named_parameters():
        torch.testing.assert_close(p.grad.double().cpu(), ref_params[name].grad, rtol=10 * tol, atol=tol, msg=name)
        n += 1
    assert n > 0
    return runner


def _worker_pipeline(rank, world):
    _setup()
    torch.manual_seed(1)
    # transformers Llama in fp32, 1F1B, 2 micro-batches; stages compiled with fxopt (flash attention, Inductor)
    x = torch.randint(0, 128, (4, 8))
    y = torch.randint(0, 128, (4, 8))
    runner = _check_pipeline(rank, _pp_llama(False).float(), x, y, _lm_loss, 1e-4, microbatches=2,
                             schedule="1F1B", compile=BACKEND)
    assert all(hasattr(m, "_orig_mod") for m in runner._compiled.values())
    # uneven MLP stack, 4 stages on 2 ranks (Interleaved1F1B), eager stages
    xm = torch.randn(8, 16)
    ym = torch.randn(8, 8)
    _check_pipeline(rank, MLPStack().float(), xm, ym, F.mse_loss, 1e-5, stages=4, microbatches=4,
                    schedule="Interleaved1F1B", compile=False)


def test_pipeline_two_ranks_one_gpu():
    _ranks(_worker_pipeline)


def _worker_pipeline_cuda_graphs(rank, world):
    """cuda_graphs=True: the first step runs eagerly, later steps replay captured graphs; every step's loss and
    gradients match the float64 reference (new inputs each step, so a replay on stale static buffers fails)."""
    from fxopt.parallel.pipeline import pipeline

    _setup()
    if not ON_GPU:
        return
    for schedule, m in (("1F1B", 2), ("GPipe", 3)):
        model = _pp_llama(False).float()  # fresh: pipeline() moved the previous one to the device
        ref = copy.deepcopy(model).double()
        ref_params = dict(ref.named_parameters())
        x0 = torch.randint(0, 128, (2 * m, 8), generator=torch.Generator().manual_seed(0))
        runner = pipeline(model, (x0,), device=_dev(), microbatches=m, schedule=schedule, compile=BACKEND,
                          cuda_graphs=True)
        assert all(v == "eager until the second step" for v in runner.cuda_graphs.values()), runner.cuda_graphs
        for step in range(3):
            g = torch.Generator().manual_seed(10 + step)
            x = torch.randint(0, 128, (2 * m, 8), generator=g)
            y = torch.randint(0, 128, (2 * m, 8), generator=g)
            for p in list(runner.parameters()) + list(ref.parameters()):
                p.grad = None
            loss = runner.step(x, target=y, loss_fn=_lm_loss)
            ref_loss = _lm_loss(ref(x), y)
            ref_loss.backward()
            if runner.is_last:
                torch.testing.assert_close(loss.double().cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-4)
            for name, p in runner.named_parameters():
                torch.testing.assert_close(p.grad.double().cpu(), ref_params[name].grad, rtol=1e-3, atol=1e-4,
                                           msg=f"{schedule} step {step} {name}")
            if step >= 1:
                state = runner.cuda_graphs
                assert all(v.startswith("captured") for v in state.values()), state


def test_pipeline_cuda_graphs_two_ranks():
    _ranks(_worker_pipeline_cuda_graphs)
