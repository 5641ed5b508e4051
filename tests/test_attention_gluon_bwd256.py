"""The d = 256 Gluon FA3-style attention backward (``attention_gluon_bwd._fa3_bwd_kernel_d256``).

CPU: the offline sm_90 builds (Triton's bundled ptxas, no GPU; skipped without it), the CPU model of the kernel's
barrier protocol, and the host wrapper's input checks. GPU (``-m gpu``, sm_90 only): dQ / dK / dV against the exact
float64 backward on random inputs (causal or not, GQA / MQA, Sq != Sk, lengths not multiples of the 64-row blocks,
rows with no visible key)."""
import math

import pytest
import torch

from fxopt.testing import attention_bwd_reference64

GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")

SMEM_LIMIT = 232448  # sm_90: 227 KB of shared memory per CTA


def test_d256_offline_builds_fit_sm90_without_spills():
    """bf16 / fp16, causal or not: no spills (STACK 0, ptxas spill bytes 0), shared memory within 227 KB, no wgmma
    serialisation warning, no register hazard on an in-flight wgmma (``wgmma_sass_hazards``), and the HGMMA mix of
    the design (per step and warpgroup 32 x m64n32k16 for S^T / dP^T, 12 x m64n128k16 for dV / dK / dQ)."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
rep = {}
for dt in ("bf16", "fp16"):
    for causal in (False, True):
        c = GB.compile_offline(256, causal, dt)
        use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
        ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
        sass = sass_of(c)
        rep[f"{dt}_{causal}"] = dict(
            stack=int(re.search(r"STACK:(\\d+)", use).group(1)),
            spill=sum(int(a) + int(b) for a, b in re.findall(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", ptxas)),
            smem=c.metadata.shared, c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))),
            hazards=len(wgmma_sass_hazards(sass)),
            n32=len(re.findall(r"HGMMA\\.64x32x16", sass)), n128=len(re.findall(r"HGMMA\\.64x128x16", sass)),
            ex2=len(re.findall(r"MUFU\\.EX2", sass)), red=len(re.findall(r"REDG\\.E\\.ADD\\.F32x2", sass)))
print(json.dumps(rep))
"""
    rep = offline_build_json(code)
    assert len(rep) == 4
    for tag, r in rep.items():
        loops = 2 if tag.endswith("True") else 1   # causal: a masked and an unmasked step loop
        assert r["stack"] == 0 and r["spill"] == 0, (tag, r)
        assert r["smem"] <= SMEM_LIMIT, (tag, r)
        assert not r["c75"], (tag, r)
        assert r["hazards"] == 0, (tag, r)
        # two consumer warpgroups x loops x (16 S^T + 16 dP^T) / (4 dV + 4 dK + 4 dQ)
        assert (r["n32"], r["n128"]) == (2 * loops * 32, 2 * loops * 12), (tag, r)
        assert r["red"] == 2 * loops * 32, (tag, r)     # 64 x 128 fp32 of dQ per warpgroup: 32 x v2 per thread


def test_d256_shared_memory_budget_matches_design():
    """The shared-memory arithmetic of the module docstring (K, V, Q and dO ring, lse / delta, P^T / dS^T double
    buffers): what the offline build must stay at or above, and under the 227 KB limit."""
    stages = GB.config_for(256)["STAGES"]
    tiles = 2 * (64 * 256 * 2) + stages * 2 * (64 * 256 * 2)  # K, V; Q and dO per stage
    vectors = stages * 2 * 64 * 4                              # lse2, delta
    exchange = 2 * 2 * 64 * 64 * 2                             # P^T, dS^T x 2 buffers
    total = tiles + vectors + exchange
    assert total == 230400 and total <= SMEM_LIMIT
    # registers per consumer thread: dK_w + dV_w ([64, 128] fp32 each) + dQ [64, 128] over 128 threads
    assert 3 * 64 * 128 // 128 == 192 <= GB._CONSUMER_REGS


def test_d256_protocol_model_passes_and_catches_broken_protocols():
    assert "without deadlock" in GB.check_d256_protocol(trials=150)
    for bug in ("single_x", "early_release", "no_end_bar"):
        caught = 0
        for k in range(40):
            try:
                GB.d256_protocol_model(2 + k % 7, 1 + k % 3, seed=k, tma_delay=k % 7, bug=bug)
            except AssertionError:
                caught += 1
        assert caught > 0, bug


def _cpu_inputs(D=256, dtype=torch.bfloat16, Hq=2, Hkv=2, Sq=70, Sk=90):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(1, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, Sk, D, generator=g).to(dtype)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(1, Hq, Sq, generator=g)
    return dout, q, k, v, out, lse


def test_host_checks_refuse_cpu_and_bad_variant():
    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)
    args = _cpu_inputs()
    assert "CUDA" in GB.gluon_bwd_supported(*args)
    with pytest.raises(ValueError, match="not a CUDA tensor"):
        GB.gluon_attention_bwd(*args)
    with pytest.raises(ValueError, match="variant"):
        GB.gluon_attention_bwd(*args, variant=7)


def test_host_checks_for_d256_shapes(monkeypatch):
    """The wrapper's shape / dtype / stride checks, run on CPU tensors by pretending they are on an sm_90 device:
    d = 256 is accepted (GQA, Sq != Sk, ragged lengths), other head dims, fp32, mismatched heads / dims, a
    non-contiguous last dim and a bad lse are refused with a reason that names the problem."""
    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(GB, "device_capability", lambda device: (9, 0))
    assert GB.gluon_bwd_supported(*_cpu_inputs()) is None
    assert GB.gluon_bwd_supported(*_cpu_inputs(Hq=8, Hkv=2, Sq=333, Sk=100), causal=True) is None
    assert GB.gluon_bwd_supported(*_cpu_inputs(dtype=torch.float16, Hq=4, Hkv=1, Sq=1, Sk=50)) is None
    assert "head dim 192" in GB.gluon_bwd_supported(*_cpu_inputs(D=192))
    assert "dtype" in GB.gluon_bwd_supported(*_cpu_inputs(dtype=torch.float32))
    assert "not a multiple" in GB.gluon_bwd_supported(*_cpu_inputs(Hq=3, Hkv=2))
    dout, q, k, v, out, lse = _cpu_inputs()
    assert "does not match" in GB.gluon_bwd_supported(dout, q, k[..., :128], v[..., :128], out, lse)
    assert "lse" in GB.gluon_bwd_supported(dout, q, k, v, out, lse[..., :-1])
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, last dim strided
    assert "contiguous" in GB.gluon_bwd_supported(dout, qt, k, v, out, lse)
    with pytest.raises(ValueError, match="head dim 192"):
        GB.gluon_attention_bwd(*_cpu_inputs(D=192))


# ----------------------------------------------------------------------------------------------------------------
# GPU: correctness against the exact float64 backward
# ----------------------------------------------------------------------------------------------------------------

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}  # tests/test_attention_kernels.py, times 2 for gradients

GPU_CASES = {  # (B, Hq, Hkv, Sq, Sk, causal, dtype)
    "S200_nc_bf16": (2, 2, 2, 200, 200, False, torch.bfloat16),
    "S200_c_bf16": (2, 2, 2, 200, 200, True, torch.bfloat16),
    "S1024_c_bf16": (1, 2, 2, 1024, 1024, True, torch.bfloat16),
    "gqa4:2_S256_c": (2, 4, 2, 256, 256, True, torch.bfloat16),
    "mqa8:1_S333_nc_fp16": (1, 8, 1, 333, 333, False, torch.float16),
    "causal_Sq100_Sk300": (1, 2, 2, 100, 300, True, torch.bfloat16),
    "causal_Sq300_Sk100_empty_rows": (1, 2, 2, 300, 100, True, torch.float16),
    "noncausal_Sq77_Sk333_fp16": (1, 2, 2, 77, 333, False, torch.float16),
    "Sq1_Sk50": (2, 2, 2, 1, 50, False, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_d256_backward_matches_float64(name):
    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    B, Hq, Hkv, Sq, Sk, causal, dtype = GPU_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, dout = (torch.randn(B, Hq, Sq, 256, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, 256, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    scale = 1.0 / math.sqrt(256)
    out, lse, rdq, rdk, rdv, empty = attention_bwd_reference64(q, k, v, dout, causal, scale)
    out, lse = out.to(dtype), lse.float()
    dq, dk, dv = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    for got, want, t in ((dq, rdq, q), (dk, rdk, k), (dv, rdv, v)):
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        assert not torch.isnan(got).any()
        lim = TOL[dtype] * 2 * max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item()
        assert err <= lim, (name, err, lim)
    if empty.any():  # rows with no visible key get exactly zero dq
        assert (dq[empty.unsqueeze(-1).expand_as(dq)] == 0).all()
    # the variant argument does not matter at d = 256 (one kernel): same shapes, same tolerance
    dq3, dk3, dv3 = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=3)
    for got, want in ((dq3, rdq), (dk3, rdk), (dv3, rdv)):
        assert (got.double() - want).abs().max().item() <= TOL[dtype] * 2 * max(1.0, want.abs().max().item())
    # except variant 6: dQ tiles in the slot's dead Q / dO bytes, reduced by TMA (issued by the
    # producer warp); dK / dV bit-identical to the REDG build
    for var in (GB.DQ_TMA_VARIANT,):
        dq6, dk6, dv6 = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=var)
        torch.cuda.synchronize()
        assert torch.equal(dk6, dk) and torch.equal(dv6, dv), (name, var)
        assert not torch.isnan(dq6).any()
        lim = TOL[dtype] * 2 * max(1.0, rdq.abs().max().item())
        assert (dq6.double() - rdq).abs().max().item() <= lim, (name, var)
        if empty.any():
            assert (dq6[empty.unsqueeze(-1).expand_as(dq6)] == 0).all()


def test_d256_dq_tma_offline_build():
    """Variant 6 at d = 256 builds offline (bf16, causal or not): no REDG, four TMA reduce-adds (UTMAREDG.4D.ADD),
    all in the producer (two in its loop, two in its tail), the REDG build's HGMMA count, no local memory, no wgmma
    serialisation or register hazard, shared memory = the REDG build's + the STAGES x_free barriers (the dQ tiles reuse the slot's Q / dO;
    + 32 B with alignment)."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
rows = []
for causal in (False, True):
    for v in (0, 6):
        c = GB.compile_offline(256, causal, "bf16", variant=v, ones=("GROUP",))
        sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
        sm = GB.sass_summary(c)
        rows.append(dict(causal=causal, v=v, utmaredg=len(re.findall(r"UTMAREDG\\.4D\\.ADD", sass)),
                         redg=sm["redg_f32"], hgmma=sm["hgmma"], ser=sm["wgmma_serialized"], shared=c.metadata.shared,
                         local=len(re.findall(r"\\b(?:LDL|STL)\\b", sass)), hazards=len(wgmma_sass_hazards(sass_of(c)))))
print(json.dumps(rows))
"""
    by = {(r["causal"], r["v"]): r for r in offline_build_json(code)}
    for causal in (False, True):
        r0 = by[(causal, 0)]
        assert r0["redg"] > 0, r0
        # the producer's two reduces in its loop and two in its tail, none in the consumers' step loops
        for v, n in ((6, 4),):
            r = by[(causal, v)]
            assert r["utmaredg"] == n and r["redg"] == 0, (v, r)
            assert r["hgmma"] == r0["hgmma"] and r["local"] == 0 and not r["ser"] and r["hazards"] == 0, (v, r)
            # + the barriers (8 B each) and their alignment padding, within sm_90's 232,448 B
            assert r0["shared"] < r["shared"] <= min(r0["shared"] + 64, 232_448), (r0, r)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_d256_route_through_the_op_from_s512(causal):
    """``flash_attention_triton_bwd`` routes d = 256 to the Gluon kernel from S = 512 (``_GLUON_BWD_MIN_SEQ_BY_DIM``)
    and keeps S = 256 on the Triton backward; both agree with the float64
    backward."""
    import fxopt.kernels.attention as A

    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    if 256 not in A._GLUON_BWD_HEAD_DIMS or "FXOPT_ATTN_GLUON_BWD_MIN_SEQ" in __import__("os").environ:
        pytest.skip("d = 256 routing changed by the environment")
    for S, routed in ((512, True), (256, False)):
        gen = torch.Generator(device="cuda").manual_seed(S)
        q, k, v, dout = (torch.randn(1, 2, S, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        assert A._gluon_bwd_route(dout, q, k, v, out, lse, None, None, 0.0, -1, 0.0, causal, None) is routed
        _, _, rdq, rdk, rdv, _ = attention_bwd_reference64(q, k, v, dout, causal, 1.0 / math.sqrt(256))
        grads = A.flash_attention_triton_bwd(dout, q, k, v, out, lse, is_causal=causal)
        assert not A._GLUON_BWD_FAILED
        for got, want in zip(grads, (rdq, rdk, rdv)):
            lim = TOL[torch.bfloat16] * 2 * max(1.0, want.abs().max().item())
            assert (got.double() - want).abs().max().item() <= lim, (S, causal)
