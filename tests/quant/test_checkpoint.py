"""Checkpoint I/O: GPTQ v1 / v2 and AWQ GEMM checkpoints, written here from each format's own definition (packing
loops over numpy uint32, independent of fxopt's code), are loaded into a small model and must reproduce a float64
reference; act-order; sharded files; save -> load round trips bit for bit; every bad input raises a ValueError naming
the problem and leaves the model as it was."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from fxopt.quant.checkpoint import load_quantized, save_quantized
from fxopt.quant.format import PackedW4, pack_int4
from fxopt.quant.linear import QuantLinear, replace_linears

K_UP, N_UP, N_DOWN, N_HEAD = 64, 32, 16, 8
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.norm = nn.LayerNorm(K_UP)
        self.up = nn.Linear(K_UP, N_UP)
        self.down = nn.Linear(N_UP, N_DOWN, bias=False)
        self.head = nn.Linear(N_DOWN, N_HEAD)  # stays float
        self.to(dtype)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


# ---------------------------------------------------------------------------------------------------------------
# The formats, as their writers define them
# ---------------------------------------------------------------------------------------------------------------
class Layer:
    """Random integer codes [N, K], per-group zeros/scales [K/G, N] and g_idx [K] of one quantized linear."""

    def __init__(self, K, N, G, seed, act_order=False, zero_range=(1, 16), bias=True):
        g = torch.Generator().manual_seed(seed)
        self.K, self.N, self.G = K, N, G
        self.codes = torch.randint(0, 16, (N, K), generator=g)
        self.zeros = torch.randint(zero_range[0], zero_range[1], (K // G, N), generator=g)
        self.scales = (torch.rand(K // G, N, generator=g) * 0.02 + 0.005).half()
        if act_order:  # GPTQ desc_act: g_idx[perm[i]] = i // G
            perm = torch.randperm(K, generator=g)
            self.g_idx = torch.empty(K, dtype=torch.int32)
            self.g_idx[perm] = (torch.arange(K) // G).int()
        else:
            self.g_idx = (torch.arange(K) // G).int()
        self.bias = torch.randn(N, generator=g).half() if bias else None

    def weight64(self):
        gi = self.g_idx.long()
        z = self.zeros.double()[gi].T  # [N, K]
        s = self.scales.double()[gi].T
        return (self.codes.double() - z) * s


def gptq_tensors(layer, v2):
    intweight = layer.codes.T.numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((layer.K // 8, layer.N), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    z = (layer.zeros.numpy() - (0 if v2 else 1)).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], layer.N // 8), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= z[:, col * 8 + j] << (4 * j)
    out = {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
           "scales": layer.scales.clone(), "g_idx": layer.g_idx.clone()}
    if layer.bias is not None:
        out["bias"] = layer.bias.clone()
    return out


def awq_tensors(layer):
    intweight = layer.codes.T.numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((layer.K, layer.N // 8), dtype=np.uint32)
    for col in range(layer.N // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]] << (4 * i)
    z = layer.zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], layer.N // 8), dtype=np.uint32)
    for col in range(layer.N // 8):
        for i in range(8):
            qzeros[:, col] |= z[:, col * 8 + AWQ_ORDER_MAP[i]] << (4 * i)
    out = {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
           "scales": layer.scales.clone()}
    if layer.bias is not None:
        out["bias"] = layer.bias.clone()
    return out


def float_tensors(seed=7):
    g = torch.Generator().manual_seed(seed)
    return {"norm.weight": torch.rand(K_UP, generator=g) + 0.5, "norm.bias": torch.randn(K_UP, generator=g) * 0.1,
            "head.weight": torch.randn(N_HEAD, N_DOWN, generator=g) * 0.2,
            "head.bias": torch.randn(N_HEAD, generator=g)}


def make_checkpoint(tmp_path, fmt, G=32, act_order=False, config_file="config.json", extra_cfg=None, shards=1,
                    zero_range=None):
    zr = zero_range or ((0, 16) if fmt != "gptq" else (1, 16))
    layers = {"up": Layer(K_UP, N_UP, G, 1, act_order, zr, bias=True),
              "down": Layer(N_UP, N_DOWN, min(G, N_UP), 2, act_order, zr, bias=False)}
    tensors = dict(float_tensors())
    for name, layer in layers.items():
        t = awq_tensors(layer) if fmt == "awq" else gptq_tensors(layer, v2=fmt == "gptq_v2")
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": act_order, "sym": False,
              "checkpoint_format": fmt}
    qc.update(extra_cfg or {})
    d = tmp_path / f"ckpt_{fmt}"
    d.mkdir(exist_ok=True)
    write_files(d, tensors, shards)
    if config_file == "config.json":
        (d / "config.json").write_text(json.dumps({"model_type": "tiny", "quantization_config": qc}))
    elif config_file is not None:
        (d / config_file).write_text(json.dumps(qc))
    return d, layers, tensors


def write_files(d, tensors, shards=1):
    for f in list(d.glob("*.safetensors")) + list(d.glob("*.index.json")):
        f.unlink()
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(d / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def reference_output(x, layers, floats):
    x = x.double()
    x = torch.nn.functional.layer_norm(x, (K_UP,), floats["norm.weight"].double(), floats["norm.bias"].double())
    up = layers["up"]
    h = torch.relu(x @ up.weight64().T + up.bias.double())
    h = h @ layers["down"].weight64().T
    return h @ floats["head.weight"].double().T + floats["head.bias"].double()


def snapshot(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: type(m) for n, m in model.named_modules()})


def assert_same(model, snap):
    state, types = snap
    assert {n: type(m) for n, m in model.named_modules()} == types
    now = model.state_dict()
    assert now.keys() == state.keys()
    assert all(torch.equal(now[k], state[k]) for k in state)


# ---------------------------------------------------------------------------------------------------------------
# Loading each format
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("G", [32, -1])
def test_load_each_format_matches_reference(tmp_path, fmt, G):
    d, layers, tensors = make_checkpoint(tmp_path, fmt, G=G if G != -1 else K_UP)  # K_UP: one group per layer
    if G == -1:
        _edit_cfg(d, group_size=-1)
    model = Tiny()
    out = load_quantized(model, str(d))
    assert out is model
    assert isinstance(model.up, QuantLinear) and isinstance(model.down, QuantLinear)
    assert isinstance(model.head, nn.Linear)
    assert model.up.perm is None and model.up.scales.dtype == torch.float16 and model.down.bias is None
    x = torch.randn(3, 5, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_act_order_gptq(tmp_path, fmt):
    d, layers, tensors = make_checkpoint(tmp_path, fmt, G=16, act_order=True)
    assert not torch.equal(layers["up"].g_idx, (torch.arange(K_UP) // 16).int())
    model = Tiny()
    load_quantized(model, d)
    assert model.up.perm is not None and model.up.perm.dtype == torch.int64
    # groups are contiguous after the permutation
    assert torch.equal(layers["up"].g_idx[model.up.perm].long(), torch.arange(K_UP) // 16)
    x = torch.randn(4, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config_file", ["quantize_config.json", "quant_config.json"])
def test_config_from_side_files(tmp_path, config_file):
    fmt = "gptq" if config_file == "quantize_config.json" else "awq"
    d, layers, tensors = make_checkpoint(tmp_path, fmt, config_file=config_file)
    if fmt == "awq":  # AutoAWQ's legacy file: w_bit / q_group_size / "GEMM", no quant_method
        (d / config_file).write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                 "version": "GEMM"}))
    else:  # AutoGPTQ's older file: no quant_method / checkpoint_format
        (d / config_file).write_text(json.dumps({"bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                                                 "damp_percent": 0.01}))
    model = Tiny()
    load_quantized(model, d)
    x = torch.randn(2, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_and_single_file_path(tmp_path):
    d, layers, tensors = make_checkpoint(tmp_path, "gptq_v2", shards=3)
    assert len(list(d.glob("*.safetensors"))) == 3
    model = Tiny()
    load_quantized(model, d)
    x = torch.randn(2, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)
    d2, layers2, tensors2 = make_checkpoint(tmp_path, "awq")
    model2 = Tiny()
    load_quantized(model2, str(d2 / "model.safetensors"))
    torch.testing.assert_close(model2(x).double(), reference_output(x, layers2, tensors2), atol=1e-4, rtol=1e-4)


def test_v1_zero_sixteen_nibble(tmp_path):
    """A v1 nibble of 15 means zero 16 (AutoGPTQ reads nibble + 1)."""
    d, layers, tensors = make_checkpoint(tmp_path, "gptq", zero_range=(16, 17))
    model = Tiny()
    load_quantized(model, d)
    assert bool((model.up.zeros == 16).all())
    x = torch.randn(2, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_dtype,expected", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float16)])
def test_scales_dtype_follows_model(tmp_path, model_dtype, expected):
    d, layers, tensors = make_checkpoint(tmp_path, "gptq")
    model = Tiny(model_dtype)
    load_quantized(model, d)
    assert model.up.scales.dtype == expected and model.up.zeros.dtype == expected
    assert model.up.bias.dtype == expected and model.head.weight.dtype == model_dtype
    model32 = Tiny()
    load_quantized(model32, d, dtype=torch.bfloat16)
    assert model32.up.scales.dtype == torch.bfloat16


def test_load_into_model_with_quant_linears(tmp_path):
    d, layers, tensors = make_checkpoint(tmp_path, "gptq")
    model = Tiny()
    replace_linears(model, ["up", "down"], group_size=32)
    load_quantized(model, d)
    x = torch.randn(2, K_UP)
    torch.testing.assert_close(model(x).double(), reference_output(x, layers, tensors), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Saving and round trips
# ---------------------------------------------------------------------------------------------------------------
def quantized_model(act_order=True, seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    replace_linears(model, ["up", "down"], group_size=16)
    if act_order:
        p = model.up.packed()
        perm = torch.randperm(K_UP, generator=torch.Generator().manual_seed(5))
        model.up = QuantLinear.from_packed(PackedW4(p.qweight, p.scales, p.zeros, 16, perm), model.up.bias)
        assert model.up.perm is not None
    zeros = model.up.zeros  # keep every zero in 1..15 so that both v1 and v2 can store it
    model.up.zeros.copy_(zeros.clamp(1, 15))
    model.down.zeros.copy_(model.down.zeros.clamp(1, 15))
    return model


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_save_load_round_trip_is_exact(tmp_path, fmt, act_order):
    model = quantized_model(act_order)
    save_quantized(model, tmp_path / "out", format=fmt)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": act_order, "sym": False,
                   "checkpoint_format": fmt, "pack_dtype": "int32"}
    assert json.loads((tmp_path / "out" / "quantize_config.json").read_text()) == cfg
    loaded = load_quantized(Tiny(), tmp_path / "out")
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    x = torch.randn(3, K_UP)
    assert torch.equal(model(x), loaded(x))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_saved_file_follows_gptq_definition(tmp_path, fmt):
    """Decode the saved tensors with the format's definition (not fxopt's code): same weights as the model."""
    model = quantized_model(act_order=True)
    save_quantized(model, tmp_path / "out", format=fmt)
    t = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name in ("up", "down"):
        m = getattr(model, name)
        qw, qz = t[f"{name}.qweight"].numpy().astype(np.uint32), t[f"{name}.qzeros"].numpy().astype(np.uint32)
        K, N = m.in_features, m.out_features
        codes = np.zeros((K, N), dtype=np.int64)
        for k in range(K):
            codes[k] = (qw[k // 8] >> (4 * (k % 8))) & 0xF
        zeros = np.zeros((qz.shape[0], N), dtype=np.int64)
        for n in range(N):
            zeros[:, n] = ((qz[:, n // 8] >> (4 * (n % 8))) & 0xF) + (0 if fmt == "gptq_v2" else 1)
        g = t[f"{name}.g_idx"].long().numpy()
        s = t[f"{name}.scales"].double().numpy()
        w = torch.from_numpy((codes - zeros[g]) * s[g]).T
        assert torch.equal(w.to(m.scales.dtype), m.dequantized_weight())  # both: exact product, one rounding
    assert not torch.equal(t["up.g_idx"], (torch.arange(K_UP) // 16).int())
    assert torch.equal(t["down.g_idx"], (torch.arange(N_UP) // 16).int())
    assert torch.equal(t["head.weight"], model.head.weight)


def test_save_zero_range_errors(tmp_path):
    model = quantized_model(act_order=False)
    model.up.zeros[0, 0] = 0
    with pytest.raises(ValueError, match=r"up: format 'gptq' stores zero points 1..16.*format='gptq_v2'"):
        save_quantized(model, tmp_path / "a")
    save_quantized(model, tmp_path / "b", format="gptq_v2")
    model.up.zeros[0, 0] = 16
    with pytest.raises(ValueError, match=r"format 'gptq_v2' stores zero points 0..15.*format='gptq'"):
        save_quantized(model, tmp_path / "c", format="gptq_v2")
    model.up.zeros[0, 0] = 3.5
    with pytest.raises(ValueError, match="zeros are not integers"):
        save_quantized(model, tmp_path / "d")
    with pytest.raises(ValueError, match="unknown format 'awq'"):
        save_quantized(model, tmp_path / "e", format="awq")
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_quantized(Tiny(), tmp_path / "f")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.q = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.q(self.a(x)))


def test_tied_weights_saved_once(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    replace_linears(model, ["q"], group_size=16)
    save_quantized(model, tmp_path / "t")
    keys = set(load_file(str(tmp_path / "t" / "model.safetensors")))
    assert "a.weight" in keys and "b.weight" not in keys
    loaded = load_quantized(Tied(), tmp_path / "t")
    x = torch.randn(2, 16)
    assert torch.equal(model(x), loaded(x))
    assert loaded.b.weight is loaded.a.weight


def test_save_refuses_dir_with_other_shards(tmp_path):
    d, _, _ = make_checkpoint(tmp_path, "gptq", shards=2)
    with pytest.raises(ValueError, match="already holds other checkpoint files"):
        save_quantized(quantized_model(False), d)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear error, model untouched
# ---------------------------------------------------------------------------------------------------------------
def _edit_cfg(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, tensors, drop=(), add=None):
    t = {k: v for k, v in tensors.items() if k not in drop}
    t.update(add or {})
    write_files(d, t)


def _damage(d, how):
    (f,) = d.glob("*.safetensors")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100] if how == "truncate" else b"\x13garbage, not a safetensors file" * 4)


def _bad_value(t, key, value):
    v = t[key].clone()
    v.view(-1)[3] = value
    return v


BAD = {
    "truncated file": (lambda d, t: _damage(d, "truncate"), r"model.*\.safetensors.*(truncated or corrupt)"),
    "garbage file": (lambda d, t: _damage(d, "garbage"), r"model.*\.safetensors: not a readable"),
    "nan scale": (lambda d, t: _edit_tensors(d, t, add={"up.scales": _bad_value(t, "up.scales", float("nan"))}),
                  r"up.scales holds 1 NaN/inf"),
    "inf scale": (lambda d, t: _edit_tensors(d, t, add={"down.scales": _bad_value(t, "down.scales", float("inf"))}),
                  r"down.scales holds 1 NaN/inf"),
    "float stored as int32": (lambda d, t: _edit_tensors(d, t, add={"head.weight": t["head.weight"].int()}),
                              r"head.weight: dtype torch.int32 in the file, but the model's tensor is torch.float32"),
    "missing quantized key": (lambda d, t: _edit_tensors(d, t, drop=["up.qzeros"]), "missing key 'up.qzeros'"),
    "missing bias": (lambda d, t: _edit_tensors(d, t, drop=["up.bias"]), "missing key 'up.bias'"),
    "missing float key": (lambda d, t: _edit_tensors(d, t, drop=["head.weight"]), "missing key 'head.weight'"),
    "extra key": (lambda d, t: _edit_tensors(d, t, add={"extra.weight": torch.zeros(2)}),
                  "unexpected key 'extra.weight'"),
    "extra key in layer": (lambda d, t: _edit_tensors(d, t, add={"down.bias": torch.zeros(N_DOWN).half()}),
                           "unexpected key 'down.bias'"),
    "scales shape": (lambda d, t: _edit_tensors(d, t, add={"up.scales": torch.ones(1, N_UP).half()}),
                     r"up.scales: shape \[1, 32\] disagrees"),
    "qweight shape": (lambda d, t: _edit_tensors(d, t, add={"up.qweight": torch.zeros(K_UP // 8, 40,
                                                                                      dtype=torch.int32)}),
                      r"up.qweight: shape \[8, 40\] disagrees"),
    "qweight dtype": (lambda d, t: _edit_tensors(d, t, add={"up.qweight": t["up.qweight"].float()}),
                      "up.qweight: dtype torch.float32, expected int32"),
    "float shape": (lambda d, t: _edit_tensors(d, t, add={"head.weight": torch.zeros(N_HEAD, 3)}),
                    r"head.weight: shape \[8, 3\] disagrees"),
    "not a linear": (lambda d, t: _edit_tensors(d, t, add={"norm.qweight": torch.zeros(8, 8, dtype=torch.int32)}),
                     "no nn.Linear named 'norm'"),
    "bits": (lambda d, t: _edit_cfg(d, bits=8), "bits = 8; only 4-bit"),
    "group size": (lambda d, t: _edit_cfg(d, group_size=48), "group size 48 does not divide in_features 64"),
    "unknown format": (lambda d, t: _edit_cfg(d, checkpoint_format="marlin"),
                       "unknown GPTQ checkpoint_format 'marlin'"),
    "unknown method": (lambda d, t: _edit_cfg(d, quant_method="bitsandbytes"), "unknown quant_method 'bitsandbytes'"),
    "awq gemv": (lambda d, t: _edit_cfg(d, quant_method="awq", version="gemv"), "AWQ version 'gemv' is not supported"),
    "no config": (lambda d, t: (d / "config.json").unlink(), "no quantization settings found"),
    "no safetensors": (lambda d, t: [f.unlink() for f in d.glob("*.safetensors")], "no .safetensors files"),
    "bad g_idx": (lambda d, t: _edit_tensors(d, t, add={"up.g_idx": torch.zeros(K_UP, dtype=torch.int32)}),
                  "layer up: g_idx does not put exactly group_size=32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_and_leaves_model_untouched(tmp_path, case):
    d, layers, tensors = make_checkpoint(tmp_path, "gptq")
    edit, message = BAD[case]
    edit(d, tensors)
    model = Tiny()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=message):
        load_quantized(model, d)
    assert_same(model, snap)


def test_bad_paths(tmp_path):
    model = Tiny()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="not a directory or a .safetensors file"):
        load_quantized(model, tmp_path / "nope")
    d, _, _ = make_checkpoint(tmp_path, "gptq", shards=2)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match=r"shard\(s\) missing"):
        load_quantized(model, d)
    assert_same(model, snap)


def test_non_strict_ignores_extra_and_missing_float_keys(tmp_path):
    d, layers, tensors = make_checkpoint(tmp_path, "gptq")
    _edit_tensors(d, tensors, drop=["norm.weight"], add={"rotary.inv_freq": torch.ones(4)})
    model = Tiny()
    load_quantized(model, d, strict=False)
    assert isinstance(model.up, QuantLinear) and torch.equal(model.norm.weight, torch.ones(K_UP))
    assert torch.equal(model.head.weight, tensors["head.weight"])


def test_pack_int4_matches_gptq_qweight_layout():
    """fxopt's qweight is GPTQ's: the test's own GPTQ packing equals pack_int4 of the same codes."""
    layer = Layer(64, 16, 32, 9)
    assert torch.equal(gptq_tensors(layer, v2=True)["qweight"], pack_int4(layer.codes.T.contiguous()))


def test_hf_llama_round_trip_with_tied_embeddings(tmp_path):
    """A tiny Hugging Face Llama (tied lm_head): quantize every linear but lm_head, save, load into a fresh model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    names = replace_linears(model, lambda n, lin: QuantLinear.from_linear(lin, group_size=32)
                            if n != "lm_head" else None)
    assert len(names) == 7
    save_quantized(model, tmp_path / "llama", format="gptq_v2")
    saved = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["quantization_config"]["checkpoint_format"] == "gptq_v2"
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    load_quantized(fresh, tmp_path / "llama")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
