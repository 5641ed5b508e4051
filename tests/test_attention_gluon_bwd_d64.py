"""The split-dQ variants (1-4) of the Gluon FA3-style attention backward at head dim 64 (offline only so
far: ``gluon_attention_bwd(..., variant=1 | 3)`` at d = 64 runs ``_fa3_bwd_kernel_v1``; before, d = 64 fell back to
the default kernel).

At d = 64 warpgroup w's dQ column half is K[:, 32 w : 32 w + 32]; the kernel keeps K in a 64-byte-swizzle tile (two
[64, 32] blocks, ``_split_k_layout``) so that half is a whole block, as the [64, 64] half of the 128-byte-swizzle tile
is at d = 128. CPU: the layout / config choices, the shared-memory budget and two offline sm_90 builds (Triton's
bundled ptxas, skipped without it). GPU (``-m gpu``, sm_90 only): dq / dk / dv of variants 1, 3 (and 4) against the
float64 backward: causal or not, GQA / MQA, ragged lengths, Sq != Sk with rows that see no key."""
import math

import pytest
import torch

from fxopt.testing import GLUON_BWD_CASES, GLUON_BWD_TOL, attention_bwd_reference64

GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")

SMEM_LIMIT = 232448  # sm_90: 227 KB of shared memory per CTA


def _need_gluon():
    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)


def test_d64_split_variants_are_listed_and_configured():
    assert 64 in GB._VARIANT_DIMS and 128 in GB._VARIANT_DIMS
    # the split-dQ kernel's ring depth is its own; the default kernel's d = 64 config is unchanged (3 stages)
    assert GB.config_for(64)["STAGES"] == 3 and GB.config_for(64, 0)["STAGES"] == 3
    for v in (1, 2, 3, 4):
        assert GB.config_for(64, v)["STAGES"] == GB._SPLIT_STAGES[64]
        assert GB.config_for(128, v)["STAGES"] == GB.config_for(128)["STAGES"] == 2   # d = 128 builds unchanged
        assert GB.config_for(256, v)["STAGES"] == 2


def test_d64_k_layout_makes_the_dq_half_a_whole_swizzle_block():
    """d = 64: 64-byte swizzle (a [64, 64] 16-bit tile = two [64, 32] blocks, one per dQ column half); d = 128: the
    default layout, byte for byte what the d = 128 kernels used before (their SASS is unchanged)."""
    _need_gluon()
    gl = GB.gl
    for dt in (gl.bfloat16, gl.float16):
        for rank in (2, 4):
            lay = GB._split_k_layout(64, dt, rank)
            assert lay.swizzle_byte_width == 64 and lay.element_bitwidth == 16 and lay.rank == rank
            assert 32 * 2 == lay.swizzle_byte_width  # the dQ half (32 columns of 2 bytes) spans one swizzle row
            assert GB._split_k_layout(128, dt, rank) == gl.NVMMASharedLayout.get_default_for(
                [1] * (rank - 2) + [64, 128], dt)


def test_d64_shared_memory_budget():
    """K, V (two [64, 64] tiles each), the Q / dO ring with lse2 / delta, the dS^T double buffer of both warpgroups:
    well under 227 KB at the chosen depth (registers, not shared memory, limit the CTA to one per SM)."""
    stages = GB._SPLIT_STAGES[64]
    fixed = 2 * 2 * (64 * 64 * 2) + 4 * (64 * 64 * 2)          # K, V; dS^T [2 buffers x 2 warpgroups]
    per_stage = 2 * (64 * 64 * 2) + 2 * 64 * 4                  # Q, dO; lse2, delta
    assert fixed == 65536 and per_stage == 16896
    assert fixed + stages * per_stage <= SMEM_LIMIT
    assert (SMEM_LIMIT - fixed) // per_stage == 9                # deepest ring that would fit
    # 12 warps x 32 threads x maxnreg 168 registers: one CTA per SM whatever the shared memory
    assert 2 * 12 * 32 * GB._MAXNREG > 65536


def test_d64_offline_builds():
    """Variant 3 causal (bf16) and variant 1 non-causal (fp16) at d = 64: no spills at all (STACK 0, ptxas spill
    bytes 0, no LDL / STL), no C75xx warning, no register hazard on an in-flight wgmma, shared memory as the budget,
    the HGMMA / reduction mix of the design (per step and warpgroup 4 S^T + 4 dP^T + 4 dV + 4 dK m64n64k16 and
    8 dQ m64n32k16; 8 ``REDG.E.ADD.F32x2``), and the K / dK descriptors moved as two [64, 32] TMA boxes with the
    64-byte swizzle (the V / Q / dO ones keep the 128-byte [64, 64] boxes)."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
rep = {}
for v, causal, dt in ((3, True, "bf16"), (1, False, "fp16")):
    c = GB.compile_offline(64, causal, dt, variant=v)
    use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    sass = sass_of(c)
    rep[f"v{v}_{causal}_{dt}"] = dict(
        stack=int(re.search(r"STACK:(\\d+)", use).group(1)),
        spill=sum(int(a) + int(b)
                  for a, b in re.findall(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", ptxas)),
        c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))), smem=c.metadata.shared,
        hazards=len(wgmma_sass_hazards(sass)), local=len(re.findall(r"\\b(?:LDL|STL)\\b", sass)),
        n32=len(re.findall(r"HGMMA\\.64x32x16", sass)), n64=len(re.findall(r"HGMMA\\.64x64x16", sass)),
        nother=len(re.findall(r"HGMMA\\.64x(?!32x|64x)", sass)),
        red2=len(re.findall(r"REDG\\.E\\.ADD\\.F32x2", sass)),
        red1=len(re.findall(r"REDG\\.E\\.ADD\\.F32(?!x2)", sass)),
        tma=[(m["swizzle"], m["block_size"]) for m in c.metadata.tensordesc_meta])
print(json.dumps(rep))
"""
    rep = offline_build_json(code)
    assert len(rep) == 2
    stages = GB._SPLIT_STAGES[64]
    budget = 65536 + stages * 16896
    for tag, r in rep.items():
        loops = 2 if "_True_" in tag else 1   # causal: a masked and an unmasked step loop
        assert r["stack"] == 0 and r["spill"] == 0 and r["local"] == 0, (tag, r)
        assert not r["c75"] and r["hazards"] == 0, (tag, r)
        assert budget <= r["smem"] <= budget + 1024 and r["smem"] <= SMEM_LIMIT, (tag, r)
        assert (r["n64"], r["n32"], r["nother"]) == (2 * loops * 16, 2 * loops * 8, 0), (tag, r)
        assert (r["red2"], r["red1"]) == (2 * loops * 8, 0), (tag, r)
        # descriptor order: q, k, v, do, dk, dv, lse, delta; swizzle enum 2 = 64 B, 3 = 128 B
        q, k, v, do, dk, dv = r["tma"][:6]
        assert k == dk == [2, [1, 1, 64, 32]], (tag, r["tma"])
        assert q == v == do == dv == [3, [1, 1, 64, 64]], (tag, r["tma"])


# ----------------------------------------------------------------------------------------------------------------
# GPU: variants 1 / 3 / 4 at d = 64 against the float64 backward
# ----------------------------------------------------------------------------------------------------------------

TOL = GLUON_BWD_TOL  # the d = 128 variant tests' tolerance (times 2 below)
GPU_CASES = {}
for _name, _case in GLUON_BWD_CASES.items():  # the shared cases, with the S = 2048 causal case in fp16
    if _name == "S2048_c_bf16":
        _name, _case = "S2048_c_fp16", _case[:-1] + (torch.float16,)
    GPU_CASES[_name] = _case


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [1, 3, 4], ids=["v1", "v3", "v4"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_d64_split_variants_match_float64(name, variant):
    """dq / dk / dv of the split-dQ kernel at d = 64 against the float64 backward (tolerance of the d = 128 variant
    tests); rows with no visible key get exactly zero dq; outputs contiguous, dtypes of q / k / v."""
    _need_gluon()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    B, Hq, Hkv, Sq, Sk, causal, dtype = GPU_CASES[name]
    D = 64
    gen = torch.Generator(device="cuda").manual_seed(6464)
    q, dout = (torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    scale = 1.0 / math.sqrt(D)
    out, lse, rdq, rdk, rdv, empty = attention_bwd_reference64(q, k, v, dout, causal, scale)
    out, lse = out.to(dtype), lse.float()
    dq, dk, dv = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=variant)
    torch.cuda.synchronize()
    for got, want, t in ((dq, rdq, q), (dk, rdk, k), (dv, rdv, v)):
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        assert not torch.isnan(got).any()
        lim = TOL[dtype] * 2 * max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item()
        assert err <= lim, (name, variant, err, lim)
    if empty.any():  # rows with no visible key get exactly zero dq
        assert (dq[empty.unsqueeze(-1).expand_as(dq)] == 0).all()
