"""Sibling linears (q/k/v, gate/up) in one W4A16 call: the storage layout made by ``share_sibling_storage``, the
``w4a16_linear_cat`` op, and the pass's grouping (proven from the graph, left as separate calls when not)."""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn

import fxopt
from fxopt.config import Config
from fxopt.kernels.w4a16 import column_span
from fxopt.quant.linear import QuantLinear, share_sibling_storage

from test_w4a16_pass import W4A16, capture, count, qlinear, w4_result

CAT = (torch.ops.fxopt.w4a16_linear_cat.default, torch.ops.fxopt.w4a16_linear_cat)


class Block(nn.Module):
    """q/k/v read one input; o reads their combination (not a sibling)."""

    def __init__(self, bias=False, dtype=torch.float16):
        super().__init__()
        self.q_proj = qlinear(64, 32, 32, dtype, bias=bias, seed=1)
        self.k_proj = qlinear(64, 16, 32, dtype, bias=bias, seed=2)
        self.v_proj = qlinear(64, 16, 32, dtype, bias=bias, seed=3)
        self.o_proj = qlinear(64, 64, 32, dtype, bias=False, seed=4)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(torch.cat([q * 2, k - 1, v.view(*v.shape[:-1], 4, 4).flip(-1).flatten(-2)], -1))


def _shared(model):
    return {n: m.qweight.untyped_storage().data_ptr() for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("bias", [False, True])
def test_share_sibling_storage_keeps_values_and_state_dict(bias):
    model = Block(bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 64).half()
    ref = model(x)
    assert share_sibling_storage(model) == [("q_proj", "k_proj", "v_proj")]
    ptr = _shared(model)
    assert ptr["q_proj"] == ptr["k_proj"] == ptr["v_proj"] != ptr["o_proj"]
    assert not model.k_proj.qweight.is_contiguous() and model.k_proj.qweight.stride() == (64, 1)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model(x), ref)


def test_siblings_must_agree_to_share():
    model = Block()
    model.v_proj = qlinear(64, 16, 64, seed=3)  # another group size: not a sibling of q / k
    assert share_sibling_storage(model) == []
    ptr = _shared(model)
    assert len(set(ptr.values())) == 4


def test_save_and_load_keep_the_layout_and_values():
    from fxopt.quant.checkpoint import load_quantized, save_quantized

    model = Block(bias=True)
    share_sibling_storage(model)
    x = torch.randn(2, 64).half()
    ref = model(x)

    class Float(nn.Module):
        def __init__(self):
            super().__init__()
            for n, o in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
                setattr(self, n, nn.Linear(64, o, bias=True).half())
            self.o_proj = nn.Linear(64, 64, bias=False).half()

        forward = Block.forward

    with tempfile.TemporaryDirectory() as d:
        save_quantized(model, d, format="gptq_v2")  # zero points 0..15
        fresh = load_quantized(Float(), d)
    ptr = _shared(fresh)
    assert ptr["q_proj"] == ptr["k_proj"] == ptr["v_proj"]
    assert torch.equal(fresh(x), ref)


@pytest.mark.parametrize("bias", [False, True])
def test_cat_op_matches_separate_linears_and_falls_back_when_not_adjacent(bias):
    model = Block(bias)
    x = torch.randn(2, 3, 64).half()
    mods = [model.q_proj, model.k_proj, model.v_proj]
    ref = torch.cat([m(x) for m in mods], -1)

    def call(ms):
        return torch.ops.fxopt.w4a16_linear_cat(x, [m.qweight for m in ms], [m.scales for m in ms],
                                                [m.zeros for m in ms], 32, [m.bias for m in ms] if bias else [])

    separate = call(mods)  # three storages: one call each
    assert column_span([m.qweight for m in mods]) is None
    share_sibling_storage(model)
    joint = call(mods)  # one storage: one call over the joint columns
    assert column_span([m.qweight for m in mods]) is not None
    assert column_span([model.k_proj.qweight, model.q_proj.qweight]) is None  # out of order
    assert column_span([model.q_proj.qweight, model.v_proj.qweight]) is None  # a gap
    for y in (separate, joint):
        assert y.shape == (2, 3, 64) and y.is_contiguous()
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_cat_op_gradient_matches_separate_linears():
    model = Block(bias=True)
    share_sibling_storage(model)
    mods = [model.q_proj, model.k_proj, model.v_proj]
    x = torch.randn(4, 64, dtype=torch.float16, requires_grad=True)
    g = torch.randn(4, 64, dtype=torch.float16)
    y = torch.ops.fxopt.w4a16_linear_cat(x, [m.qweight for m in mods], [m.scales for m in mods],
                                         [m.zeros for m in mods], 32, [m.bias for m in mods])
    (gx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.cat([torch.ops.fxopt.w4a16_linear(x2, m.qweight, m.scales, m.zeros, 32, m.bias) for m in mods], -1)
    (gx2,) = torch.autograd.grad(y2, x2, g)
    torch.testing.assert_close(gx.float(), gx2.float(), atol=2e-2, rtol=2e-2)


def test_pass_groups_siblings_and_matches_eager():
    model = Block(bias=True)
    share_sibling_storage(model)
    x = torch.randn(2, 5, 64).half()
    ref = copy.deepcopy(model)(x)
    out, graphs = capture(model, x)
    (gm, _), = graphs
    res = w4_result(graphs)
    assert count(gm, CAT) == 1 and count(gm, W4A16) == 1  # q/k/v joint, o alone
    assert any("3 sibling linears in one call (N = 32 + 16 + 16)" in n for n in res.notes), res.notes
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_pass_keeps_separate_calls_without_the_shared_layout():
    model = Block()
    x = torch.randn(2, 64).half()
    out, graphs = capture(model, x)
    (gm, _), = graphs
    res = w4_result(graphs)
    assert count(gm, CAT) == 0 and count(gm, W4A16) == 4
    assert any("sit in separate storages" in s.reason for s in res.skipped)


class WritesInput(Block):
    """x is written in place between k_proj and v_proj: v reads other values than q and k."""

    def forward(self, x):
        q, k = self.q_proj(x), self.k_proj(x)
        x.mul_(3)
        return torch.cat([q, k, self.v_proj(x)], -1)


def test_pass_does_not_group_across_an_in_place_write_to_the_input():
    model = WritesInput()
    share_sibling_storage(model)
    x = torch.randn(2, 64).half()
    ref = copy.deepcopy(model)(x.clone())
    out, graphs = capture(model, x.clone())
    (gm, _), = graphs
    assert count(gm, CAT) == 0
    assert any("writes in place" in s.reason for s in w4_result(graphs).skipped)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_group_siblings_off_by_config():
    model = Block()
    share_sibling_storage(model)
    x = torch.randn(2, 64).half()
    _, graphs = capture(model, x, config=Config.from_options({"w4a16.group_siblings": False}))
    (gm, _), = graphs
    assert count(gm, CAT) == 0 and count(gm, W4A16) == 4


def test_quantize_lays_out_hf_siblings():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, num_hidden_layers=1)
    model = transformers.LlamaForCausalLM(cfg).half().eval()
    ids = torch.randint(1, 128, (1, 8))
    fxopt.quantize(model, [ids], method="rtn", group_size=32, progress=False)
    ptr = _shared(model)
    layer = "model.layers.0."
    assert ptr[layer + "self_attn.q_proj"] == ptr[layer + "self_attn.k_proj"] == ptr[layer + "self_attn.v_proj"]
    assert ptr[layer + "mlp.gate_proj"] == ptr[layer + "mlp.up_proj"] != ptr[layer + "mlp.down_proj"]
    rep = fxopt.explain(model, ids)
    assert sum("sibling linears in one call" in n for n in rep.notes) == 2, rep.notes


def test_pass_groups_only_small_row_counts():
    from fxopt.passes import w4a16

    model = Block()
    share_sibling_storage(model)
    x = torch.randn(w4a16.GROUP_MAX_ROWS + 1, 64).half()
    _, graphs = capture(model, x)
    (gm, _), = graphs
    assert count(gm, CAT) == 0 and count(gm, W4A16) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_ungrouped_sibling_slices_match_copies_and_are_read_in_place(bias, monkeypatch):
    """Above GROUP_MAX_ROWS each sibling is its own call on a column slice: once the tuner picked "dequant_matmul"
    for the shape, the op reads the slice where it lies (no copy of the packed tensors per call), with the values of
    the contiguous copy; any other pick gets a contiguous copy."""
    from fxopt.kernels.w4a16 import tuner
    from fxopt.kernels.w4a16.common import W4A16Config

    monkeypatch.delenv("FXOPT_NO_TUNE", raising=False)  # the slice route follows a timed pick
    model = Block(bias=bias, dtype=torch.bfloat16).cuda()
    k = model.k_proj
    qw, s, z, b = (k.qweight.clone(), k.scales.clone(), k.zeros.clone(), None if k.bias is None else k.bias.clone())
    share_sibling_storage(model)
    assert not k.qweight.is_contiguous()
    x = torch.randn(1024, 64, device="cuda", dtype=torch.bfloat16)
    expect = torch.ops.fxopt.w4a16_linear(x, qw, s, z, 32, b)
    real = torch.ops.fxopt.w4a16_linear(x, k.qweight, k.scales, k.zeros, 32, k.bias)  # tunes the shape
    assert tuner.tuned_config(x, 16, k.zeros, 32, bias) is not None
    torch.testing.assert_close(real, expect, rtol=0, atol=0)
    for pick in (W4A16Config(method="dequant_matmul"), None):
        monkeypatch.setattr(tuner, "tuned_config", lambda *a, pick=pick: pick)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = torch.ops.fxopt.w4a16_linear(x, k.qweight, k.scales, k.zeros, 32, k.bias)
        copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::contiguous", "aten::copy_")]
        assert bool(copies) == (pick is None), copies
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
