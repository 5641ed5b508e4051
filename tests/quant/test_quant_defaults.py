"""Defaults of ``fxopt.quantize`` and what a quantized 16-bit model must survive: AWQ in float16/bfloat16 folds every
scale (the fold probe computes in float64) and round-trips through ``save_quantized`` / ``load_quantized``; where no
fold exists the linear gets no scale instead of an extra module; a float32 model gets a warning to cast it."""
import logging

import pytest
import torch
import torch.nn as nn

from fxopt.quant.calibrate import QuantizeReport, quantize
from fxopt.quant.checkpoint import load_quantized, save_quantized
from fxopt.quant.linear import QuantLinear

from test_calibration import tiny_demo


def _cal():
    torch.manual_seed(0)
    return [torch.randint(0, 96, (2, 16)) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_16bit_folds_every_scale_and_round_trips(tmp_path, dtype):
    rep = QuantizeReport()
    real = quantize(tiny_demo().to(dtype), _cal(), method="awq", group_size=32, progress=False, report=rep)
    # o_proj / down_proj: folded into v_proj / up_proj, found by the probe despite 16-bit rounding
    assert sum("output rows" in line for line in rep.folds) == 4, rep.folds
    assert sum(isinstance(m, QuantLinear) for m in real.modules()) == 14
    assert not [n for n, m in real.named_modules() if n.endswith(".linear")]
    x = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        out = real(x)
    save_quantized(real, str(tmp_path / "ckpt"))
    fresh = tiny_demo(seed=5).to(dtype)
    load_quantized(fresh, str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), out, rtol=0, atol=0)


class NoFold(nn.Module):
    """fc2's input comes through a GELU: no norm or linear can absorb an AWQ scale there."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 16)  # the last linear stays float (quantize's default)

    def forward(self, x):
        return self.head(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


def test_awq_without_fold_leaves_no_scale_module_and_round_trips(tmp_path):
    torch.manual_seed(0)
    cal = [torch.randn(4, 8, 64) * torch.linspace(0.1, 5, 64) for _ in range(2)]
    rep = QuantizeReport()
    model = quantize(NoFold().half(), [c.half() for c in cal], method="awq", group_size=32, progress=False,
                     report=rep)
    line = next(l for l in rep.folds if l.startswith("fc2"))
    assert "no AWQ scale" in line, rep.folds
    assert isinstance(model.fc1, QuantLinear) and isinstance(model.fc2, QuantLinear)
    x = cal[0][:1].half()
    with torch.no_grad():
        out = model(x)
    save_quantized(model, str(tmp_path / "ckpt"))
    fresh = NoFold().half()
    load_quantized(fresh, str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), out, rtol=0, atol=0)


def _outputs(method, variants):
    """Logits of tiny_demo quantized with each of ``variants`` (name -> extra quantize arguments)."""
    cal, x, outs = _cal(), torch.randint(0, 96, (1, 16)), {}
    for name, kw in variants.items():
        m = quantize(tiny_demo(), cal, method=method, group_size=32, pack=False, progress=False, **kw)
        with torch.no_grad():
            outs[name] = m(x)
    return outs


def test_signature_defaults_are_the_documented_ones():
    import inspect

    params = inspect.signature(quantize).parameters
    expected = {"method": "gptq", "group_size": 128, "sym": False, "act_order": True, "static_groups": False,
                "damp": 0.01, "mse": False, "float_target": None, "awq_rounding": None, "clip": True}
    assert {k: params[k].default for k in expected} == expected
    doc = inspect.getdoc(quantize)
    # the docstring names what None resolves to and how to get the plain algorithms
    assert "float_target=False" in doc and 'awq_rounding="nearest"' in doc
    assert "on for GPTQ and AWQ" in doc and '(``None``, the default, is ``"gptq"``)' in doc


def test_gptq_default_is_float_target_and_plain_is_reachable():
    outs = _outputs("gptq", {"default": {}, "ft": {"float_target": True}, "plain": {"float_target": False}})
    torch.testing.assert_close(outs["default"], outs["ft"], rtol=0, atol=0)
    assert not torch.equal(outs["default"], outs["plain"])


def test_awq_default_is_float_target_with_gptq_rounding_and_plain_is_reachable():
    outs = _outputs("awq", {"default": {}, "explicit": {"float_target": True, "awq_rounding": "gptq"},
                            "nearest": {"awq_rounding": "nearest"},
                            "plain": {"float_target": False, "awq_rounding": "nearest"}})
    torch.testing.assert_close(outs["default"], outs["explicit"], rtol=0, atol=0)
    for other in ("nearest", "plain"):
        assert not torch.equal(outs["default"], outs[other]), other
    assert not torch.equal(outs["nearest"], outs["plain"])


@pytest.mark.parametrize("bad, match", [
    (dict(method="awq", awq_rounding="round"), "awq_rounding must be one of"),
    (dict(method="gptq", awq_rounding="gptq"), "awq_rounding applies to method='awq'"),
    (dict(method="rtn", awq_rounding="nearest"), "awq_rounding applies to method='awq'"),
    (dict(method="rtn", float_target=True), "float_target"),
    (dict(method="gptq", damp=-0.1), "damp must be >= 0"),
])
def test_invalid_arguments_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize(tiny_demo(), _cal(), group_size=32, pack=False, progress=False, **bad)


def test_float32_model_warns_to_cast(caplog):
    with caplog.at_level(logging.WARNING, logger="fxopt.quant.calibrate"):
        quantize(tiny_demo(), _cal(), method="rtn", group_size=32, progress=False)
    assert any("float32" in r.message and "model.to(torch.float16)" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxopt.quant.calibrate"):
        quantize(tiny_demo().half(), _cal(), method="rtn", group_size=32, progress=False)
    assert not [r for r in caplog.records if "float32" in r.message]
