"""ABLATE (timing-only builds) of the Gluon fp8 attention forward (fxopt/kernels/fp8_attention_gluon.py, module
docstring "ablate"; timing only, see docs/kernels.md).

* Host gate: ``resolve_ablate`` (0 / None = off without any environment; a nonzero mask only with
  $FXOPT_FP8_GLUON_ABLATE_OK=1, ValueError "timing-only ablation, results are wrong" otherwise; bad masks and the
  unsupported combinations refused), and the wrappers refuse before touching a GPU.
* Offline sm_90 builds (``offline_build_json``; skipped without the bundled ptxas / cuobjdump): the default build is
  byte-identical (.text) to one compiled with ABLATE = 0 passed explicitly (with every other optional constexpr),
  bit 1 removes every MUFU.EX2 of the step, bit 8 halves its QGMMAs (the P tile goes to 4 STSM instead), no spills,
  no C75xx, no wgmma hazards.
* GPU (sm_90): ablate 0 is bit-identical to the default launch; every single bit and 8|16 launch and finish.
"""
from __future__ import annotations

import pytest
import torch

from fxopt.kernels import fp8_attention_gluon as G

GATE = "timing-only ablation, results are wrong"


def test_resolve_ablate_gate(monkeypatch):
    monkeypatch.delenv(G.ABLATE_ENV, raising=False)
    assert G.resolve_ablate(None) == 0 and G.resolve_ablate(0) == 0  # off needs no environment
    for m in (1, 8, 24, G.ABLATE_ALL):
        with pytest.raises(ValueError, match=GATE):
            G.resolve_ablate(m)
    monkeypatch.setenv(G.ABLATE_ENV, "0")
    with pytest.raises(ValueError, match=GATE):
        G.resolve_ablate(2)
    monkeypatch.setenv(G.ABLATE_ENV, "1")
    for m in (1, 2, 4, 8, 16, 32, 64, 7, 24, 71):
        assert G.resolve_ablate(m) == m
    assert G.resolve_ablate(3, check_env=False) == 3
    for bad in (True, -1, 128, 256 | 1, 1.0, "1", [1]):
        with pytest.raises(ValueError, match="is not a bit mask"):
            G.resolve_ablate(bad)
    monkeypatch.delenv(G.ABLATE_ENV)
    for bad in (128, "x"):  # a bad mask is named even without the environment
        with pytest.raises(ValueError, match="is not a bit mask"):
            G.resolve_ablate(bad)


def test_resolve_ablate_combinations(monkeypatch):
    monkeypatch.setenv(G.ABLATE_ENV, "1")
    for kw, word in ((dict(persistent=True), "persistent"), (dict(overlap=True), "overlap"),
                     (dict(pingpong=True), "pingpong"), (dict(poly_exp=2), "poly_exp"),
                     (dict(mma_rowsum=True), "mma_rowsum"), (dict(lazy_rescale=True), "lazy_rescale"),
                     (dict(cast_late=False), "cast_late=False")):
        with pytest.raises(ValueError, match=f"not with {word}"):
            G.resolve_ablate(1, **kw)
    assert G.resolve_ablate(1, overlap=False, pingpong=False, cast_late=True) == 1
    assert G.resolve_ablate(0, persistent=True, overlap=True) == 0  # off: nothing to refuse


def test_wrappers_refuse_before_launch(monkeypatch):
    """The gate and the combinations are checked before any tensor is looked at (CPU tensors here)."""
    monkeypatch.delenv(G.ABLATE_ENV, raising=False)
    x = torch.zeros(1, 1, 128, 128)
    with pytest.raises(ValueError, match=GATE):
        G.fp8_gluon_attention(x, x, x, ablate=1)
    s = torch.zeros(1, 1)
    kw = dict(shape_q=(1, 1, 128, 128), seq_k=128, n_kv_heads=1, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=GATE):
        G.fp8_gluon_attention_quantized(x, s, x, s, x, s, ablate=16, **kw)
    monkeypatch.setenv(G.ABLATE_ENV, "1")
    with pytest.raises(ValueError, match="not with persistent"):
        G.fp8_gluon_attention_quantized(x, s, x, s, x, s, ablate=16, persistent=True, **kw)
    with pytest.raises(ValueError, match="not with overlap"):
        G.fp8_gluon_attention_quantized(x, s, x, s, x, s, ablate=4, overlap=True, **kw)
    with pytest.raises(ValueError, match="not with pingpong"):
        G.fp8_gluon_attention_quantized(x, s, x, s, x, s, ablate=4, pingpong=True, **kw)


def test_offline_refuses_combinations():
    if G._GLUON_IMPORT_ERROR is not None:
        pytest.skip("triton gluon unavailable")
    with pytest.raises(ValueError, match="not with persistent"):
        G.compile_offline(128, False, ablate=1, persistent=True)
    with pytest.raises(ValueError, match="not with mma_rowsum"):
        G.compile_offline(128, False, ablate=1, mma_rowsum=True)


# --------------------------------------------------------------------------------------- offline sm_90 build


_BUILD_CODE = r'''
import hashlib, json, re, struct
import triton.experimental.gluon._runtime as R
from fxopt.kernels import fp8_attention_gluon as G
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import wgmma_sass_hazards

OPTIONAL = dict(OVERLAP=False, PINGPONG=False, POLY_EXP=0, MMA_ROWSUM=False, LAZY_RESCALE=False, ABLATE=0)

from fxopt.testing import cubin_text_sha as text_sha

def build(ablate, explicit_zero=False):
    if explicit_zero:  # ABLATE = 0 (and every other optional constexpr at its off value) passed explicitly
        orig = R.GluonASTSource
        class Src(orig):
            def __init__(self, fn, signature, constexprs=None, attrs=None):
                constexprs = dict(constexprs, **OPTIONAL)
                signature = dict(signature, **{k: "constexpr" for k in OPTIONAL})
                signature = {k: signature[k] for k in fn.arg_names if k in signature}
                super().__init__(fn, signature, constexprs, attrs)
        R.GluonASTSource = Src
        try:
            c = G.compile_offline(128, False)
        finally:
            R.GluonASTSource = orig
    else:
        c = G.compile_offline(128, False, ablate=ablate)
    use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    return dict(stack=int(m.group(2)), local=int(m.group(4)), sha=text_sha(c.asm["cubin"]),
                spill=sorted(set(re.findall(r"(\d+) bytes spill", ptxas))),
                max_reg=G.sass_summary(c)["max_reg_index"], c75=sorted(set(re.findall(r"C75[0-9][0-9]", ptxas))),
                hazards=len(wgmma_sass_hazards(sass)), census=G.ablate_census(sass))

out = {"default": build(None), "explicit0": build(0, True)}
for ab in ABLATIONS:
    out[str(ab)] = build(ab)
print(json.dumps(out))
'''


def test_offline_sm90_ablation_builds():
    if G._GLUON_IMPORT_ERROR is not None:
        pytest.skip("triton gluon unavailable")
    from fxopt.testing import offline_build_json

    res = offline_build_json("ABLATIONS = [1, 8]\n" + _BUILD_CODE)
    base = res["default"]
    assert res["explicit0"]["sha"] == base["sha"]  # ABLATE = 0 changes nothing in the default build
    assert len(base["census"]) == 4  # wg 0 / 1 x unmasked / masked step
    for lp in base["census"]:
        assert lp["MUFU.EX2"] == 66 and lp["QGMMA"] == 8 and lp["STSM"] == 0
    for key in ("1", "8"):
        r = res[key]
        assert r["sha"] != base["sha"]
        assert r["stack"] == 0 and r["local"] == 0 and r["spill"] in ([], ["0"]), r  # no spills
        assert r["c75"] == [] and r["hazards"] == 0, r
        assert r["max_reg"] < G._CONSUMER_REGS
        assert len(r["census"]) == 4
    for lp, lb in zip(res["1"]["census"], base["census"]):
        assert lp["MUFU.EX2"] == 0  # bit 1: no exp2 left in the step
        assert lp["QGMMA"] == lb["QGMMA"] and lp["F2FP"] == lb["F2FP"]  # the rest stays (MMAs, the cast)
        assert lp["FFMA"] >= lb["FFMA"] - 2  # s c - m is still computed per score
        assert lp["n"] < lb["n"]
    for lp, lb in zip(res["8"]["census"], base["census"]):
        assert lp["QGMMA"] * 2 == lb["QGMMA"]  # bit 8: the PV wgmma is gone, QK^T stays
        assert lp["STSM"] == 4 and lp["F2FP"] == lb["F2FP"]  # the e4m3 cast stays alive (stored to the sink)
        assert lp["MUFU.EX2"] == lb["MUFU.EX2"]


# ---------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_ablation_launches_gpu(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if G._GLUON_IMPORT_ERROR is not None or G.device_capability(torch.device("cuda"))[0] != 9:
        pytest.skip("needs sm_90 and gluon")
    monkeypatch.setenv(G.ABLATE_ENV, "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1000, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        base = G.fp8_gluon_attention(q, k, v, causal)
        assert torch.equal(G.fp8_gluon_attention(q, k, v, causal, ablate=0), base)
        for m in (1, 2, 4, 8, 16, 32, 64, 24):
            out = G.fp8_gluon_attention(q, k, v, causal, ablate=m)
            torch.cuda.synchronize()
            assert out.shape == base.shape and out.dtype == base.dtype
