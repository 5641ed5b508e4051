"""Gluon attention backward at d = 128 (and d = 64) with dQ through shared memory and a reducer warp
(``attention_gluon_bwd_dqw.gluon_attention_bwd_dqw``; the op's backward at d = 128; variant 5 of
``attention_gluon_bwd``, the constexpr ``DQW`` of ``_fa3_bwd_kernel_v1``; d = 64 not routed).

CPU: the protocol model of the new barriers (random interleavings; six planted bugs must each be caught; d = 64 uses
the same buffers and phases), the host checks (variant 5 at d = 64 / 128, refusals of other head dims and of
ablations), one offline sm_90 build per head dim (skipped without Triton's bundled ptxas / cuobjdump) with its
per-step census and cycle model. GPU (``-m gpu``, sm_90 only): against the float64 backward on the cases of
tests/test_attention_gluon_bwd_v4.py at d = 128 and d = 64, and dK / dV bit-identical to variant 3."""

import pytest
import torch

from fxopt.testing import GLUON_BWD_CASES, assert_gluon_bwd_variant

DQW = pytest.importorskip("fxopt.kernels.attention_gluon_bwd_dqw")
GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")


def test_dqw_protocol_random_interleavings():
    assert "without deadlock" in DQW.check_dqw_protocol(trials=300)
    for n, stages, nb in ((0, 2, 2), (1, 1, 2), (1, 2, 1), (2, 2, 2), (12, 1, 2), (12, 3, 1), (13, 2, 2),
                          (0, 4, 2), (3, 4, 2), (13, 4, 2), (17, 4, 1)):   # 4 stages: the d = 64 ring
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


def test_dqw_host_checks(monkeypatch):
    for d in (64, 128):
        q = torch.randn(1, 2, 8, d)
        reason = DQW.gluon_dqw_supported(q, q, q, q, q, torch.zeros(1, 2, 8))
        assert reason is not None     # CPU tensors (or no Gluon): a reason, never None
        with pytest.raises(ValueError, match="gluon_attention_bwd_dqw"):
            DQW.gluon_attention_bwd_dqw(q, q, q, q, q, torch.zeros(1, 2, 8))
    assert DQW.DQ_BUFFERS == 2 and DQW.HEAD_DIM == 128 and DQW.HEAD_DIMS == (64, 128)
    # the head-dim rule of the dqw entry on its own (the generic checks pass): d = 64 / 128 yes, 256 / 32 no
    monkeypatch.setattr(DQW, "gluon_bwd_supported", lambda *a, **k: None)
    for d, ok in ((64, True), (128, True), (256, False), (32, False)):
        q = torch.randn(1, 2, 8, d)
        reason = DQW.gluon_dqw_supported(q, q, q, q, q, torch.zeros(1, 2, 8))
        assert (reason is None) == ok, (d, reason)
        if not ok:
            assert f"head dim {d}" in reason, reason


def test_dqw_is_variant5(monkeypatch):
    """The dQ-through-smem kernel is ``gluon_attention_bwd(..., variant=5)``: d = 64 or 128 (ValueError naming the
    head dim otherwise, on the host and offline; d = 256 runs the d = 256 kernel for every variant, as before, but the
    dqw entry refuses it), never an ablation base, and its config is variant 3's (d = 64: 4 ring stages) plus NB /
    REDUCER_WARPS."""
    assert GB.DQW_VARIANT == 5 and 5 in GB.VARIANTS
    for d, stages in ((128, 2), (64, 4)):
        cfg3, cfg5 = GB.config_for(d, 3), DQW.config_dqw(d)
        assert cfg5 == dict(cfg3, NB=2, REDUCER_WARPS=1) and cfg5["PRODUCER_REGS"] == DQW.REDUCER_REGS == 24
        assert cfg5["STAGES"] == stages, cfg5
    assert DQW.config_dqw() == GB.config_for(128, 5)
    assert "NB" not in GB.config_for(256, 5)     # d = 256: its own kernel, no dQ tiles
    GB._check_variant(5, 64)                      # no refusal at d = 64 any more
    GB._check_variant(5, 256)
    q32 = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="head dim 64 or 128, got 32"):
        GB.gluon_attention_bwd(q32, q32, q32, q32, q32, torch.zeros(1, 2, 8), variant=5)
    with pytest.raises(ValueError, match="head dim 64 or 128, got 32"):
        GB.compile_offline(32, False, "bf16", variant=5)
    q64 = torch.randn(1, 2, 8, 64)   # d = 64 passes the variant check and fails on the CPU tensors
    with pytest.raises(ValueError) as exc:
        GB.gluon_attention_bwd(q64, q64, q64, q64, q64, torch.zeros(1, 2, 8), variant=5)
    assert "head dim" not in str(exc.value) and ("CUDA" in str(exc.value) or "unavailable" in str(exc.value))
    for bad in (256, 32):
        with pytest.raises(ValueError, match=f"head dim {bad}"):
            DQW.config_dqw(bad)
        with pytest.raises(ValueError, match=f"head dim {bad}"):
            DQW.compile_offline(False, "bf16", head_dim=bad)
    monkeypatch.setenv(GB.ABLATE_ENV, "1")
    for d in (64, 128):
        q = torch.randn(1, 2, 8, d)
        with pytest.raises(ValueError, match="split-dQ kernel"):
            GB.gluon_attention_bwd(q, q, q, q, q, torch.zeros(1, 2, 8), variant=5, ablate=1)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_dqw_offline_build_census(head_dim):
    """One offline build per head dim (bf16, non-causal) and variant 3's at the same head dim: no wgmma serialisation
    (C75xx), no wgmma register hazard, shared memory = variant 3's + the 2 x 2 dQ tiles [64, d / 2] fp32 (+ 4
    mbarriers), within 232,448 B; stack 8 B (d = 128, as variant 3) / 16 B (d = 64: 12 B of spills outside the
    step loops, consumer 0's prologue and the reducer's loop-invariant address; variant 3: 0). The consumer step loops
    have no REDG and no local memory, variant 3's HGMMA / MUFU / LDS / MEMBAR counts, d / 8 STS.64 more (the dQ tile),
    1 BAR.SYNC and 2 SYNCS more; the reducer loop has d / 2 LDS.128 + d / 2 REDG.F32x4 per step; setmaxnreg 240 for
    the consumers and 24 for warpgroup 2 as variant 3; the cycle model at variant 3's d = 128 447 TFLOP/s: tensor as
    variant 3's (2560 / 1280 cycles per CTA step), smem port variant 3's + the STS.64 and LDS.128 bytes."""
    from fxopt.testing import offline_build_json

    code = f"""
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
import fxopt.kernels.attention_gluon_bwd_dqw as DQW
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
c = DQW.compile_offline(False, "bf16", head_dim={head_dim})
assert c.metadata.name == "_fa3_bwd_kernel_v1", c.metadata.name   # the folded kernel (DQW switch on)
use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
sass = sass_of(c)
r = DQW.dqw_step_model(sass, tflops=447.0)
c3 = GB.compile_offline({head_dim}, False, "bf16", variant=3)
loops3 = [lp for lp in GB.sass_step_loops(sass_of(c3)) if lp["hgmma"]]
m3 = GB.bwd_step_model(loops3, 0)
print(json.dumps(dict(stack=int(re.search(r"STACK:(\\d+)", use).group(1)), smem=c.metadata.shared,
                      smem3=c3.metadata.shared,
                      c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))), hazards=len(wgmma_sass_hazards(sass)),
                      f32x4=len(re.findall(r"REDG\\.E\\.ADD\\.F32x4", sass)),
                      f32x2=len(re.findall(r"REDG\\.E\\.ADD\\.F32x2", sass)),
                      maxreg=sorted(set(re.findall(r"USETMAXREG\\S* (?:UP\\d, )?(0x[0-9a-f]+)", sass))),
                      consumer=r["consumer"], reducer=r["reducer"], model=r["model"], consumer3=loops3,
                      model3=dict(tensor=m3["tensor"], smem=m3["smem"]))))
"""
    rep = offline_build_json(code)
    half = head_dim // 2
    assert not rep["c75"] and rep["hazards"] == 0, rep
    dq_tiles = 2 * 2 * 64 * half * 4
    assert rep["smem3"] + dq_tiles <= rep["smem"] <= rep["smem3"] + dq_tiles + 128, (rep["smem"], rep["smem3"])
    assert rep["smem"] <= DQW.SMEM_LIMIT, rep["smem"]
    assert rep["stack"] <= {128: 8, 64: 16}[head_dim], rep["stack"]
    assert rep["f32x2"] == 0 and rep["f32x4"] == half, rep
    assert "0xf0" in rep["maxreg"] and "0x18" in rep["maxreg"] and "0xe8" not in rep["maxreg"], rep["maxreg"]
    assert len(rep["consumer"]) == 2 and len(rep["consumer3"]) == 2
    for lp, lp3 in zip(rep["consumer"], rep["consumer3"]):
        c, c3 = lp["classes"], lp3["classes"]
        assert lp["hgmma"] == lp3["hgmma"], (lp["hgmma"], lp3["hgmma"])
        assert lp["hgmma"] == ({"64x64x16": 24, "64x128x16": 8} if head_dim == 128
                               else {"64x64x16": 16, "64x32x16": 8}), lp["hgmma"]
        assert not c.get("redg") and not c.get("local"), c
        assert c3.get("redg") == half // 4, c3          # variant 3: d / 8 REDG.F32x2 per thread and step
        for name in ("mufu_ex2", "lds", "fence_membar"):
            assert c.get(name) == c3.get(name), (name, c, c3)
        assert c["mufu_ex2"] == 32 and c["lds"] == 16 and c["fence_membar"] == 2, c
        assert c.get("sts") == c3.get("sts") + half // 4, (c, c3)   # + the dQ tile's STS.64
        assert c.get("bar") == c3.get("bar") + 1 and c.get("syncs") == c3.get("syncs") + 2, (c, c3)
        assert abs(lp["n"] - lp3["n"]) <= 24, (lp["n"], lp3["n"])
    rc = rep["reducer"]["classes"]
    assert rc.get("lds") == half and rc.get("redg") == half and not rc.get("hgmma") and rc.get("local", 0) <= 2, rc
    m, m3 = rep["model"], rep["model3"]
    assert m["tensor"] == m3["tensor"] == 2560 * head_dim // 128, (m, m3)
    extra = 2 * 4 * (half // 4) * 256 / 128 + half * 512 / 128    # consumers' STS.64 + the reducer's LDS.128
    assert abs(m["smem"] - (m3["smem"] + extra)) <= 64, (m["smem"], m3["smem"], extra)
    assert m["red_bytes"] == 64 * head_dim * 4, m
    if head_dim == 128:   # shares of the measured d = 128 step (447 TFLOP/s is a d = 128 figure)
        assert m["issue_share"] < 0.25 and m["smem_share"] < 0.6, m


def test_dqw_builds_with_the_launchers_constexpr_ones():
    """At run time Triton's launcher turns an int argument equal to 1 into the constexpr 1; GROUP = 1 (no GQA) and
    H = 1 are the common case. On the H200 variant 5 failed to compile there ('int' object has no attribute
    '_flatten_ir': a partition list built with "+" unwrapped the constexpr), while its offline builds, all-i32,
    passed. Variant 5 builds at d = 64 and 128 with H and GROUP as constexpr 1, and with GROUP alone."""
    from fxopt.testing import offline_build_json

    code = """
import json
import fxopt.kernels.attention_gluon_bwd as GB
names = []
for d, causal, ones in ((128, False, ("H", "GROUP")), (64, True, ("GROUP",))):
    c = GB.compile_offline(d, causal, "bf16", variant=5, ones=ones)
    names.append(c.metadata.name)
print(json.dumps(dict(names=names)))
"""
    assert offline_build_json(code)["names"] == ["_fa3_bwd_kernel_v1"] * 2
    with pytest.raises(ValueError, match="not an i32 argument"):
        GB.compile_offline(128, False, "bf16", variant=5, ones=("HEAD_DIM",))


# ----------------------------------------------------------------------------------------------------------------
# GPU: against the float64 backward and variant 3
# ----------------------------------------------------------------------------------------------------------------

GPU_CASES = {**GLUON_BWD_CASES, "S2048_nc_fp16": (1, 4, 4, 2048, 2048, False, torch.float16)}


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["v5", "v6_tma"])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_dqw_matches_float64_and_v3(name, head_dim, tma):
    """dQ against the float64 backward (and variant 3 at the same head dim, same bound: both use fp32 reductions in a
    run-dependent order); dK / dV bit-identical to variant 3 (the consumer's arithmetic up to the dQ wgmma is
    variant 3's). d = 64: variant 3 is the split-dQ kernel at d = 64 (64-byte-swizzle K tile, 4 ring stages).
    ``tma``: variant 6, the reducer's reductions done by the TMA unit."""
    if DQW._GLUON_IMPORT_ERROR is not None:
        pytest.skip(DQW._GLUON_IMPORT_ERROR)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    fn = (lambda *a, **kw: DQW.gluon_attention_bwd_dqw(*a, tma=True, **kw)) if tma else DQW.gluon_attention_bwd_dqw
    assert_gluon_bwd_variant(fn, GPU_CASES[name], head_dim, (name, head_dim, tma))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dq_tma_box_is_the_chunk_transposed_tile(head_dim):
    """The layout arithmetic of variant 6, in plain torch: the workspace [rows, d] viewed with ``_dq_tma_desc``'s shape
    and strides ([rows / 8, d / 8, 8, 8], [8 d, 8, d, 1]); the box at (row8, chunk) of shape [8, d / 16, 8, 8], read in
    its row-major (shared-memory) order, is exactly the consumers' tile ``permute(reshape(dq, [8, 8, d / 16, 8]),
    (0, 2, 1, 3))`` of the [64, d / 2] half starting at row 8 row8, column 8 chunk; and adding the boxes of both
    halves of every query block writes each workspace element exactly once."""
    D, rows = head_dim, 3 * 64
    ws = torch.arange(rows * D, dtype=torch.float64)          # distinct values: any mix-up shows
    view = torch.as_strided(ws, (rows // 8, D // 8, 8, 8), (8 * D, 8, D, 1))
    half = D // 2
    hit = torch.zeros(rows, D)
    for mb in range(rows // 64):
        for w in range(2):
            row8, chunk = mb * 8, w * (D // 16)
            box = view[row8:row8 + 8, chunk:chunk + D // 16]    # [8, d / 16, 8, 8], TMA's box
            tile = ws.view(rows, D)[mb * 64:mb * 64 + 64, w * half:w * half + half]
            smem = tile.reshape(8, 8, half // 8, 8).permute(0, 2, 1, 3)   # the consumers' store order
            assert torch.equal(box.contiguous(), smem.contiguous()), (D, mb, w)
            hit[mb * 64:mb * 64 + 64, w * half:w * half + half] += 1
    assert torch.equal(hit, torch.ones(rows, D))


def test_dq_tma_offline_builds():
    """Variant 6 (dQ by TMA reduce-add) builds offline at d = 64 / 128, causal or not, with the launcher's constexpr
    ones: per build two ``cp.reduce.async.bulk.tensor.4d ... add`` in the PTX (one per warpgroup's dQ half-tile;
    SASS UTMAREDG.4D.ADD), no REDG (variant 5 has d / 2), variant 5's shared memory and HGMMA count, no local memory,
    no wgmma serialisation; the host descriptor's box is the smem tile (one [8, d / 16, 8, 8] fp32 box)."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
rows = []
for d, causal, ones in ((128, False, ("GROUP",)), (64, True, ("H", "GROUP"))):
    for v in (5, 6):
        c = GB.compile_offline(d, causal, "bf16", variant=v, ones=ones)
        sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
        sm = GB.sass_summary(c)
        rows.append(dict(d=d, v=v, tmared=c.asm["ptx"].count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add"),
                         utmaredg=len(re.findall(r"UTMAREDG\\.4D\\.ADD", sass)), redg=sm["redg_f32"],
                         hgmma=sm["hgmma"], ser=sm["wgmma_serialized"], shared=c.metadata.shared,
                         local=len(re.findall(r"\\b(?:LDL|STL)\\b", sass))))
print(json.dumps(rows))
"""
    rows = offline_build_json(code)
    by = {(r["d"], r["v"]): r for r in rows}
    for d in (128, 64):
        v5, v6 = by[(d, 5)], by[(d, 6)]
        assert v6["tmared"] == 2 and v6["utmaredg"] >= 1 and v6["redg"] == 0, v6
        assert v5["tmared"] == 0 and v5["redg"] > 0, v5
        assert v6["hgmma"] == v5["hgmma"] and v6["shared"] == v5["shared"], (v5, v6)
        assert v6["local"] == 0 and not v6["ser"], v6
    layout = GB._dq_tma_layout()
    assert layout.swizzle_byte_width == 0 and GB._dq_tma_signature(128).startswith("tensordesc<fp32[8, 8, 8, 8]")
    assert GB._dq_tma_signature(64).startswith("tensordesc<fp32[8, 4, 8, 8]")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bwd_grads_like_strided_inputs(head_dim, causal):
    """``grads_like_inputs=True`` on [B, S, H, D] views (q / k / v / out / dout as a model's transposes give them;
    GQA 4:2, ragged S): gradients laid out like ``torch.empty_like`` of q / k / v, dK / dV bit-identical to the
    same build on contiguous copies (same per-CTA arithmetic; only the addresses differ), dQ within the fp32
    reduction-order tolerance of it. The op routes strided inputs here since this passed on the H200
    (FXOPT_ATTN_GLUON_BWD_STRIDED=0 turns that off)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from fxopt.testing import GLUON_BWD_TOL

    variant = 5 if head_dim in DQW.HEAD_DIMS else 0
    B, Hq, Hkv, S = 2, 4, 2, 1100
    gen = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda H: torch.randn(B, S, H, head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=gen).transpose(1, 2)
    q, k, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    import fxopt.kernels.attention as A

    out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
    assert not out.is_contiguous()
    got = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, variant=variant, grads_like_inputs=True)
    ref = GB.gluon_attention_bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                 out.contiguous(), lse, causal=causal, variant=variant)
    torch.cuda.synchronize()
    for g, t in zip(got, (q, k, v)):
        assert g.stride() == torch.empty_like(t).stride() and not g.is_contiguous()
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    lim = GLUON_BWD_TOL[torch.bfloat16] * 2 * max(1.0, ref[0].abs().max().item())
    assert (got[0].float() - ref[0].float()).abs().max().item() <= lim
