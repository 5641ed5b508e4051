"""``fxopt.distribute``: data × pipeline × tensor parallelism on one device mesh (gloo, ranks as processes).

* 4 ranks: every bad input raises the same DistributeError on every rank (bounded by the process-group timeout);
  pp2×tp2 and dp2×tp2 inference equal the single-process model on a transformers Llama (GQA).
* slow: dp2×pp2 on GPT-2 (tied embeddings); training (DDP, FSDP2, pp×tp, dp×tp, dp×pp): gradients and the
  parameters after two SGD steps equal single-process training on the global batch; 8 ranks dp2×pp2×tp2.
* fake process group: the plan of a 2×4×8 mesh without running it.
"""
import copy
import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

TIMEOUT_S = 240  # a whole spawned run; the process group itself times out after 60 s


def _worker(rank, world, port, fn, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _run(fn, world):
    """``fn(rank, world)`` on ``world`` gloo processes; every process is ended after TIMEOUT_S."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    for p in procs:
        p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    assert not hung, f"ranks {hung} still running after {TIMEOUT_S} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


class Logits(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids).logits


def _llama(layers=4, heads=4, kv=2, ffn=96, seed=0):
    torch.manual_seed(seed)
    c = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=ffn, num_hidden_layers=layers,
                                 num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                                 use_cache=False, attn_implementation="sdpa")
    return Logits(transformers.LlamaForCausalLM(c)).double()


def _gpt2(seed=0):
    torch.manual_seed(seed)
    c = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", use_cache=False)
    m = transformers.GPT2LMHeadModel(c)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    return Logits(m).double()


def _cfg():
    import fxopt

    cfg = fxopt.Config()
    cfg.attention.enabled = False
    return cfg


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _ids(b=4, s=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (b, s), generator=g), torch.randint(0, 128, (b, s), generator=g)


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _check_forward(model, x, mesh, **kw):
    from fxopt.parallel.distribute import distribute

    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        expect = ref(x)
    r = distribute(model.eval(), (x,), mesh=mesh, config=_cfg(), training=False, **kw)
    out = r.forward(x)
    if r.is_last:
        torch.testing.assert_close(out, r.local_batch(expect), rtol=1e-9, atol=1e-9)
    else:
        assert out is None
    return r


def _bad_inputs(rank, world):
    from fxopt.parallel.distribute import DistributeError, distribute

    x, _ = _ids()
    cases = [
        (dict(dp=3, tp=1), _llama(2), x, "has 3 ranks but the world has 4"),
        (dict(tp=4), _llama(2, heads=2, kv=2), x, "does not divide the model's 2 attention heads"),
        (dict(tp=4), _llama(2, ffn=90), x, "does not divide the model's 90 FFN"),
        (dict(pp=4), _llama(2), x, "4 pipeline stages but the model has only 2 layers"),
        (dict(dp=2, pp=2, microbatches=4), _llama(2), x, "not divisible by dp x microbatches = 2 x 4"),
        (dict(dp=4, schedule="ZigZag"), _llama(2), x, "unknown schedule"),
        # rank 1 called with another batch: caught before any collective but the agreement check
        (dict(dp=4), _llama(2), x if rank != 1 else x[:4, :4], "different models or example inputs"),
    ]
    for kw, model, xi, msg in cases:
        with pytest.raises(DistributeError, match=msg):
            distribute(model, (xi,), **kw)
    # a rank-local error names the rank on every rank
    with pytest.raises(DistributeError, match="rank 2: .*not divisible"):
        distribute(_llama(2), (x if rank != 2 else x[:3],), dp=4)


def _four_fast(rank, world):
    _bad_inputs(rank, world)
    x, _ = _ids()
    r = _check_forward(_llama(), x, _mesh((2, 2), ("pp", "tp")), microbatches=2, schedule="GPipe")
    assert r.plan.tp_plan.shards and r.plan.pipeline_plan is not None
    text = str(r.plan)
    assert "dp=1 x pp=2 x tp=2" in text and "predicted bubble 0.333" in text
    assert "column" in text and "row" in text and "per layer" in text
    _check_forward(_llama(), x, _mesh((2, 2), ("dp", "tp")))


def test_four_ranks_bad_inputs_pp_tp_dp_tp_inference():
    _run(_four_fast, 4)


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def _check_training(model, x, y, mesh, steps=2, lr=0.5, **kw):
    """Two SGD steps of distribute(model) vs the single-process model on the global batch."""
    from fxopt.parallel.distribute import distribute

    ref = copy.deepcopy(model).train()
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    r = distribute(model.train(), (x,), mesh=mesh, config=_cfg(), training=True, loss_fn=_lm_loss, **kw)
    opt = torch.optim.SGD(list(r.parameters()), lr=lr)
    tpm = r._tp_module
    for step in range(steps):
        ropt.zero_grad()
        ref_loss = _lm_loss(ref(x), y)
        ref_loss.backward()
        opt.zero_grad()
        r.step(x, target=y)
        if step == 0:  # gradients of the global mean loss
            _compare(r, tpm, {n: p.grad for n, p in ref.named_parameters()}, grads=True)
        ropt.step()
        opt.step()
    _compare(r, tpm, dict(ref.named_parameters()), grads=False)
    return r


def _compare(r, tpm, ref: dict, grads: bool):
    n = 0
    for name, p in r.named_parameters():
        name = name.removeprefix("module.")
        t = p.grad if grads else p
        if t is None:
            continue
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        e = ref[name]
        if tpm is not None and name in tpm._cuts:
            ts = tpm._cuts[name]
            e = ts.cut(e.detach(), tpm._rank, tpm._tp)
        torch.testing.assert_close(t.detach(), e.detach(), rtol=1e-7, atol=1e-9, msg=f"{name} (grad={grads})")
        n += 1
    assert n > 0


def _four_training(rank, world):
    x, y = _ids()
    _check_training(_llama(), x, y, _mesh((4,), ("dp",)), data_parallel="ddp")
    _check_training(_llama(), x, y, _mesh((4,), ("dp",)), data_parallel="fsdp")
    _check_training(_llama(), x, y, _mesh((2, 2), ("dp", "tp")))
    _check_training(_llama(), x, y, _mesh((2, 2), ("pp", "tp")), microbatches=2, schedule="1F1B")
    _check_training(_gpt2(), x, y, _mesh((2, 2), ("dp", "pp")), microbatches=2, schedule="GPipe")
    _check_forward(_gpt2(), x, _mesh((2, 2), ("dp", "pp")), microbatches=2, schedule="GPipe")


@pytest.mark.slow
def test_four_ranks_training_matches_single_process():
    _run(_four_training, 4)


def _zero_bubble(rank, world):
    from fxopt.parallel.distribute import DistributeError

    x, y = _ids()
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):  # 4 stages on 2 ranks
        r = _check_training(_llama(), x, y, _mesh((2,), ("pp",)), microbatches=4, schedule=schedule)
        assert len(r.plan.pipeline_plan.stages) == 4
    _check_forward(_llama(), x, _mesh((2,), ("pp",)), microbatches=4, schedule="InterleavedZeroBubble")
    with pytest.raises(DistributeError, match="ZBVZeroBubble is a training schedule"):
        _check_forward(_llama(), x, _mesh((2,), ("pp",)), microbatches=4, schedule="ZBVZeroBubble")


@pytest.mark.slow
def test_two_ranks_zero_bubble_schedules_train_like_one_process():
    _run(_zero_bubble, 2)


def _eight(rank, world):
    x, y = _ids(b=8)
    mesh = _mesh((2, 2, 2), ("dp", "pp", "tp"))
    _check_forward(_llama(), x, mesh, microbatches=2, schedule="GPipe")
    _check_training(_llama(), x, y, _mesh((2, 2, 2), ("dp", "pp", "tp")), microbatches=2, schedule="1F1B")
    _check_forward(_gpt2(), x, _mesh((2, 2, 2), ("dp", "pp", "tp")), microbatches=2, schedule="GPipe")


@pytest.mark.slow
def test_eight_ranks_dp_pp_tp():
    _run(_eight, 8)


# --------------------------------------------------------------------------------------------------------------------
# The plan of a large mesh, on the fake process group
# --------------------------------------------------------------------------------------------------------------------


def test_plan_2x4x8_on_fake_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fxopt.parallel.distribute import distribute

    dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=64)
    try:
        mesh = _mesh((2, 4, 8), ("dp", "pp", "tp"))
        model = _llama(layers=8, heads=16, kv=8, ffn=128)  # GQA, tp = kv heads
        x, _ = _ids(b=16)
        r = distribute(model.eval(), (x,), mesh=mesh, microbatches=4, schedule="1F1B", config=_cfg(),
                       training=False, plan_only=True)
        p = r.plan
        assert p.mesh == {"dp": 2, "pp": 4, "tp": 8} and p.coords == {"dp": 0, "pp": 1, "tp": 5}
        assert len(p.pipeline_plan.stages) == 4
        assert p.bubble == pytest.approx(3 / 7)
        # Megatron: 2 all-reduces per layer (attention out, MLP down) on the tp group
        assert p.tp_plan.all_reduces == 2 * 8
        # a boundary between layers: one micro-batch (16 / 2 / 4 = 2 sequences) of hidden states in float64
        assert len(p.pp_bytes) == 3 and p.pp_bytes[0] == p.pp_bytes[1] == 2 * 8 * 64 * 8
        b = p.bytes_per_step()
        assert b["tp"] > 0 and b["pp"] == 4 * p.pp_bytes[1] and b["dp"] == 0
        text = str(p)
        assert "dp=2 x pp=4 x tp=8 = 64 ranks" in text and "2.00 per layer" in text
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (4, 16)])
def test_replayed_interleaved_bubble_matches_its_formula(pp, m):
    from fxopt.parallel.schedules import predicted_bubble

    for training in (True, False):
        assert predicted_bubble("Interleaved1F1B", pp, m, 2, training) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    assert predicted_bubble("GPipe", pp, m) == pytest.approx((pp - 1) / (m + pp - 1))


def test_zero_bubble_schedules_predicted_below_interleaved_in_training_only():
    from fxopt.parallel.schedules import predicted_bubble

    inter = predicted_bubble("Interleaved1F1B", 4, 8, 2)
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert predicted_bubble(name, 4, 8, 2, training=True) < inter, name
    # forward only, the split backward buys nothing
    assert predicted_bubble("InterleavedZeroBubble", 4, 8, 2, training=False) == pytest.approx(inter)


def test_replay_refuses_an_order_that_waits_forever():
    from fxopt.parallel.schedules import replay

    with pytest.raises(ValueError, match="never runs"):  # stage 1's forward before stage 0's on the other rank
        replay({0: [("F", 0, 0), ("B", 0, 0)], 1: [("B", 1, 0), ("F", 1, 0)]}, 2, 1)


def test_choose_schedule_by_mode_and_sizes():
    from fxopt.parallel.schedules import choose_schedule

    best, table = choose_schedule(4, 8, training=True)
    assert best in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV") and table[best] == min(
        v for v in table.values() if isinstance(v, float))
    best, table = choose_schedule(4, 8, training=False)
    assert best == "Interleaved1F1B" and table["DualPipeV"] == "training only"
    best, table = choose_schedule(4, 8, training=True, layers=4)  # two stages per rank do not fit 4 layers
    assert best == "1F1B" and "8 stages > 4 layers" in table["Interleaved1F1B"]


def test_schedule_auto_plan_on_fake_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fxopt.parallel.distribute import distribute

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = _llama(layers=8, heads=4, kv=2, ffn=128)
        x, _ = _ids(b=8)
        r = distribute(model.eval(), (x,), mesh=_mesh((1, 4, 1), ("dp", "pp", "tp")), microbatches=8,
                       schedule="auto", config=_cfg(), training=False, plan_only=True)
        assert r.plan.schedule == "Interleaved1F1B" and len(r.plan.pipeline_plan.stages) == 8
        assert r.plan.bubble == pytest.approx(3 / 19)
        assert "schedule auto: predicted bubble of each: 1F1B 0.273" in str(r.plan)
    finally:
        dist.destroy_process_group()


def _rank_fails_mid_step(rank, world):
    import time

    from fxopt.parallel.distribute import DistributeError, distribute

    x, y = _ids()
    r = distribute(_llama(2), (x,), tp=2, config=_cfg(), training=True, loss_fn=_lm_loss)
    if rank == 1:  # the forward's collectives run on both ranks; rank 1's loss then fails, rank 0 waits in backward
        with pytest.raises(ValueError, match="batch_size"):
            r.step(x, target=y[:, :3])
        return
    t0 = time.monotonic()
    with pytest.raises(DistributeError, match=r"step on rank 0 stopped: rank 1 failed with (RuntimeError|ValueError)"):
        r.step(x, target=y)
    assert time.monotonic() - t0 < 60 + 15  # within the process group's timeout


def test_two_ranks_a_failing_rank_is_named_on_the_others():
    _run(_rank_fails_mid_step, 2)
