"""Gluon attention backward at d = 128 with dQ through shared memory and a reducer warp
(``attention_gluon_bwd_dqw.gluon_attention_bwd_dqw``; the op's backward at d = 128 since session 11; since session 12
variant 5 of ``attention_gluon_bwd``, the constexpr ``DQW`` of ``_fa3_bwd_kernel_v1``).

CPU: the protocol model of the new barriers (random interleavings; six planted bugs must each be caught), the host
checks (including variant 5's d = 128 / ablation refusals), one offline sm_90 build (skipped without Triton's bundled
ptxas / cuobjdump) with its per-step census and cycle model. GPU (``-m gpu``, sm_90 only): against the float64 backward on the cases of
tests/test_attention_gluon_bwd_v4.py, and dK / dV bit-identical to variant 3."""
import math

import pytest
import torch

from fxopt.testing import attention_bwd_reference64

DQW = pytest.importorskip("fxopt.kernels.attention_gluon_bwd_dqw")
GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")


def test_dqw_protocol_random_interleavings():
    assert "without deadlock" in DQW.check_dqw_protocol(trials=300)
    for n, stages, nb in ((0, 2, 2), (1, 1, 2), (1, 2, 1), (2, 2, 2), (12, 1, 2), (12, 3, 1), (13, 2, 2)):
        for seed in range(8):
            DQW.dqw_protocol_model(n, stages, nb=nb, seed=seed, tma_delay=seed % 5)


@pytest.mark.parametrize("bug", DQW.DQW_BUGS)
def test_dqw_protocol_catches_planted_bugs(bug):
    """reducer not waiting dq_full, consumer not waiting dq_empty, the NB = 1 parity with 2 buffers, dq_full
    count 1, reducer releasing before its reads, reducer stopping a step early: each caught on some interleaving."""
    caught = []
    for k in range(40):
        try:
            DQW.dqw_protocol_model(1 + k % 8, 1 + k % 3, nb=2, seed=k, tma_delay=k % 7, bug=bug)
        except AssertionError as e:
            caught.append(str(e))
    assert caught, bug
    if bug == "reducer_stops_early":
        assert all("lost" in m for m in caught), caught[:2]
    if bug in ("consumer_no_empty_wait", "reducer_early_release"):
        # a buffer hazard, or the reducer's parity wait passing over a skipped dq_full phase
        assert all(any(t in m for t in ("while ['reducer'] read it", "overwritten", "holds step", "phase"))
                   for m in caught), caught[:2]


def test_dqw_host_checks():
    q = torch.randn(1, 2, 8, 128)
    reason = DQW.gluon_dqw_supported(q, q, q, q, q, torch.zeros(1, 2, 8))
    assert reason is not None     # CPU tensors (or no Gluon): a reason, never None
    with pytest.raises(ValueError, match="gluon_attention_bwd_dqw"):
        DQW.gluon_attention_bwd_dqw(q, q, q, q, q, torch.zeros(1, 2, 8))
    assert DQW.DQ_BUFFERS == 2 and DQW.HEAD_DIM == 128


def test_dqw_is_variant5(monkeypatch):
    """The dQ-through-smem kernel is ``gluon_attention_bwd(..., variant=5)``: d = 128 only (ValueError naming the head
    dim at d = 64, on the host and offline), never an ablation base, and its config is variant 3's plus NB /
    REDUCER_WARPS."""
    assert GB.DQW_VARIANT == 5 and 5 in GB.VARIANTS
    cfg3, cfg5 = GB.config_for(128, 3), DQW.config_dqw()
    assert cfg5 == dict(cfg3, NB=2, REDUCER_WARPS=1) and cfg5["PRODUCER_REGS"] == DQW.REDUCER_REGS == 24
    q64 = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="head dim 128, got 64"):
        GB.gluon_attention_bwd(q64, q64, q64, q64, q64, torch.zeros(1, 2, 8), variant=5)
    with pytest.raises(ValueError, match="head dim 128, got 64"):
        GB.compile_offline(64, False, "bf16", variant=5)
    monkeypatch.setenv(GB.ABLATE_ENV, "1")
    q = torch.randn(1, 2, 8, 128)
    with pytest.raises(ValueError, match="split-dQ kernel"):
        GB.gluon_attention_bwd(q, q, q, q, q, torch.zeros(1, 2, 8), variant=5, ablate=1)


def test_dqw_offline_build_census():
    """One offline build (bf16, non-causal): no wgmma serialisation (C75xx), no wgmma register hazard, shared memory
    within 232,448 B, variant 3's stack (8 B); the consumer step loops have no REDG and no local memory, the same
    HGMMA / MUFU / MEMBAR counts as variant 3 and 16 STS.64 more; the reducer loop has 64 LDS.128 + 64 REDG.F32x4 per
    step; setmaxnreg 240 for the consumers and 24 for warpgroup 2 as variant 3; the cycle model at variant 3's
    measured 447 TFLOP/s: tensor 2560, smem port 2564 + 512 cycles."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd_dqw as DQW
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
c = DQW.compile_offline(False, "bf16")
assert c.metadata.name == "_fa3_bwd_kernel_v1", c.metadata.name   # the folded kernel (DQW switch on)
use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
sass = sass_of(c)
r = DQW.dqw_step_model(sass, tflops=447.0)
print(json.dumps(dict(stack=int(re.search(r"STACK:(\\d+)", use).group(1)), smem=c.metadata.shared,
                      c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))), hazards=len(wgmma_sass_hazards(sass)),
                      f32x4=len(re.findall(r"REDG\\.E\\.ADD\\.F32x4", sass)),
                      f32x2=len(re.findall(r"REDG\\.E\\.ADD\\.F32x2", sass)),
                      sts64=len(re.findall(r"\\bSTS\\.64\\b", sass)),
                      maxreg=sorted(set(re.findall(r"USETMAXREG\\S* (?:UP\\d, )?(0x[0-9a-f]+)", sass))),
                      consumer=r["consumer"], reducer=r["reducer"], model=r["model"])))
"""
    rep = offline_build_json(code)
    assert not rep["c75"] and rep["hazards"] == 0, rep
    assert rep["smem"] <= DQW.SMEM_LIMIT and rep["smem"] >= 165_328 + 4 * 16384, rep["smem"]
    assert rep["stack"] <= 8, rep["stack"]
    assert rep["f32x2"] == 0 and rep["f32x4"] == 64, rep
    assert "0xf0" in rep["maxreg"] and "0x18" in rep["maxreg"] and "0xe8" not in rep["maxreg"], rep["maxreg"]
    assert len(rep["consumer"]) == 2
    for lp in rep["consumer"]:
        c = lp["classes"]
        assert lp["hgmma"] == {"64x64x16": 24, "64x128x16": 8}, lp["hgmma"]
        assert not c.get("redg") and not c.get("local"), c
        for name, want in (("mufu_ex2", 32), ("lds", 16), ("sts", 20), ("fence_membar", 2), ("bar", 6),
                           ("syncs", 8)):
            assert c.get(name) == want, (name, c)
        assert 380 <= lp["n"] <= 440, lp["n"]
    rc = rep["reducer"]["classes"]
    assert rc.get("lds") == 64 and rc.get("redg") == 64 and not rc.get("hgmma") and rc.get("local", 0) <= 2, rc
    m = rep["model"]
    assert m["tensor"] == 2560 and abs(m["smem"] - (2564 + 512)) <= 64 and m["red_bytes"] == 64 * 128 * 4, m
    assert m["issue_share"] < 0.25 and m["smem_share"] < 0.6, m


# ----------------------------------------------------------------------------------------------------------------
# GPU: against the float64 backward and variant 3
# ----------------------------------------------------------------------------------------------------------------

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}  # tests/test_attention_gluon_bwd_v4.py

GPU_CASES = {  # (B, Hq, Hkv, Sq, Sk, causal, dtype): the cases of tests/test_attention_gluon_bwd_v4.py
    "S200_nc_bf16": (2, 2, 2, 200, 200, False, torch.bfloat16),
    "S200_c_fp16": (2, 2, 2, 200, 200, True, torch.float16),
    "S2048_nc_bf16": (1, 4, 4, 2048, 2048, False, torch.bfloat16),
    "S2048_c_bf16": (1, 4, 4, 2048, 2048, True, torch.bfloat16),
    "S2048_nc_fp16": (1, 4, 4, 2048, 2048, False, torch.float16),
    "S4096_c_bf16_gqa4:2": (1, 4, 2, 4096, 4096, True, torch.bfloat16),
    "gqa8:1_S333_nc_fp16": (1, 8, 1, 333, 333, False, torch.float16),
    "ragged_S2100_c_gqa4:2": (1, 4, 2, 2100, 2100, True, torch.bfloat16),
    "causal_Sq100_Sk300": (1, 2, 2, 100, 300, True, torch.bfloat16),
    "causal_Sq300_Sk100_empty_rows": (1, 2, 2, 300, 100, True, torch.float16),
    "Sq1_Sk50": (2, 2, 2, 1, 50, False, torch.bfloat16),
    "S64_c": (1, 2, 2, 64, 64, True, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_dqw_matches_float64_and_v3(name):
    """dQ against the float64 backward (and variant 3, same bound: both use fp32 reductions in a run-dependent
    order); dK / dV bit-identical to variant 3 (the consumer's arithmetic up to the dQ wgmma is variant 3's)."""
    if DQW._GLUON_IMPORT_ERROR is not None:
        pytest.skip(DQW._GLUON_IMPORT_ERROR)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    B, Hq, Hkv, Sq, Sk, causal, dtype = GPU_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(4321)
    q, dout = (torch.randn(B, Hq, Sq, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, 128, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    scale = 1.0 / math.sqrt(128)
    out, lse, rdq, rdk, rdv, empty = attention_bwd_reference64(q, k, v, dout, causal, scale)
    out, lse = out.to(dtype), lse.float()
    dq3, dk3, dv3 = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=3)
    dq, dk, dv = DQW.gluon_attention_bwd_dqw(dout, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(dk, dk3) and torch.equal(dv, dv3), name
    for got, want, t in ((dq, rdq, q), (dk, rdk, k), (dv, rdv, v)):
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        assert not torch.isnan(got).any()
        lim = TOL[dtype] * 2 * max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item()
        assert err <= lim, (name, err, lim)
    lim = TOL[dtype] * 2 * max(1.0, rdq.abs().max().item())
    assert (dq.double() - dq3.double()).abs().max().item() <= lim, name
    if empty.any():  # rows with no visible key get exactly zero dq
        assert (dq[empty.unsqueeze(-1).expand_as(dq)] == 0).all()
