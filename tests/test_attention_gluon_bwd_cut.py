"""Issue-slot model of the Gluon attention backward at d = 128, variant 3 (the split-dQ kernel).

``attention_gluon_bwd.sass_step_loops`` counts the instructions of each innermost step loop of the offline sm_90
SASS, ``bwd_step_model`` turns the counts into cycles per CTA step for each SM resource. The model said the kernel is
not issue-bound (docs/kernels.md, ``attention_gluon_bwd.py``), so no kernel change was built and there is no GPU test
here. CPU: the census and the model on hand-made SASS (exact numbers), and on the real offline build (skipped without
Triton's bundled ptxas / cuobjdump): the counts the model rests on, and its verdict at the measured speed."""
import pytest

GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")

# A made-up sm_90 SASS fragment: a step loop (0x0100 .. 0x01c0, conditional back edge) with one SS and one RS HGMMA,
# an out-of-line mbarrier retry block that jumps back unconditionally (not a loop), and a short spin loop.
TOY_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+UR12+0x28560], R10 ;
        /*0110*/              @!P0 BRA 0x300 ;
        /*0120*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR12], RZ, !UPT ;
        /*0130*/                   HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR20].tnspB, R88, gsb0 ;
        /*0140*/                   FFMA R13, R184, UR8, -R16 ;
        /*0150*/                   MUFU.EX2 R13, R13 ;
        /*0160*/                   F2FP.BF16.F32.PACK_AB R184, R14, R13 ;
        /*0170*/                   STSM.16.M88.4 [R11], R152 ;
        /*0180*/                   LDS.64 R16, [R11+UR42+0x28000] ;
        /*0190*/                   REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR30][R10.64+0x100], R152 ;
        /*01a0*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*01b0*/                   ISETP.NE.U32.AND P0, PT, RZ, UR7, PT ;
        /*01c0*/               @P0 BRA 0x100 ;
        /*01d0*/                   EXIT ;
        /*0300*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+UR12+0x28560], R10 ;
        /*0310*/              @!P0 BRA 0x300 ;
        /*0320*/                   BRA 0x120 ;
"""


def test_sass_step_loops_on_toy_sass():
    loops = GB.sass_step_loops(TOY_SASS, min_len=3)
    assert len(loops) == 1, loops          # the retry block (unconditional BRA back) and the 2-instruction spin are not
    lp = loops[0]
    assert (lp["start"], lp["end"], lp["n"]) == (0x100, 0x1C0, 13)
    assert lp["hgmma"] == {"64x64x16": 1, "64x128x16": 1} and (lp["hgmma_ss"], lp["hgmma_rs"]) == (1, 1)
    c = lp["classes"]
    for name, want in (("syncs", 1), ("control", 2), ("hgmma", 2), ("ffma", 1), ("mufu_ex2", 1), ("f2fp", 1),
                       ("sts", 1), ("lds", 1), ("redg", 1), ("uniform_int", 1), ("int_addr", 1)):
        assert c.get(name) == want, (name, c)
    assert sum(c.values()) == lp["n"]


def test_bwd_step_model_arithmetic():
    """Two warpgroups' copies of the toy loop: 1 SS m64n64k16 (131,072 FLOP, A 2 KB + B 2 KB) and 1 RS m64n128k16
    (262,144 FLOP, B 4 KB) each; 4 warps per warpgroup; a measured rate chosen so that a step takes 1000 cycles."""
    lp = GB.sass_step_loops(TOY_SASS, min_len=3)[0]
    flop = 2 * (64 * 64 * 16 * 2 + 64 * 128 * 16 * 2)
    tflops = flop / (1000 / 1.83e9) * 132 / 1e12
    r = GB.bwd_step_model([lp, lp], producer_n=7, tflops=tflops, tma_bytes_per_step=1280)
    assert r["step_flop"] == flop and r["tensor"] == flop / 4096
    smem = 2 * (2048 + 2048 + 4096) + 2 * 4 * 512 + 2 * 4 * 128 + 1280   # wgmma, STSM, LDS wavefronts, TMA
    assert r["smem"] == smem / 128
    assert r["mufu"] == 2 * 4 * 32 / 16
    assert (r["issue"], r["issue_consumers"], r["fp32"]) == (2 * 13 + 7, 26, 2)
    assert r["red_bytes"] == 2 * 4 * 32 * 8
    assert r["measured"] == pytest.approx(1000)
    assert r["tensor_share"] == pytest.approx(r["tensor"] / 1000)
    assert r["red_tb_per_s"] == pytest.approx(r["red_bytes"] * 132 / (1000 / 1.83e9) / 1e12)
    with pytest.raises(AssertionError):
        GB.bwd_step_model([lp])


def test_variant3_d128_step_census_and_verdict():
    """The routed kernel (variant 3, d = 128, bf16), full and causal: the per-step counts the model uses, and the
    model's verdict at the measured 447 TFLOP/s (S = 4096, non-causal): tensor 2560 and shared-memory
    port ~2564 cycles per CTA step, issue ~15% of the step, nothing above ~50%, i.e. not issue-bound. Also checks
    the "already minimal" claims of docs/kernels.md: the 16-bit conversions are all packed pairs (F2FP.PACK_AB, 32 per
    warp = 64 values of P^T and dS^T), exp2 is one FFMA + one MUFU per element (lse2 is pre-scaled), dQ goes out as
    16 REDG.F32x2 per warp, no SHFL and no local memory in the step loops."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.w4a16_gluon import sass_of
rep = {}
for causal in (False, True):
    sass = sass_of(GB.compile_offline(128, causal, "bf16", variant=3))
    rep[str(causal)] = dict(loops=GB.sass_step_loops(sass), pack=len(re.findall(r"F2FP\\.BF16\\.F32\\.PACK_AB", sass)),
                            f2fp=len(re.findall(r"F2FP", sass)))
print(json.dumps(rep))
"""
    rep = offline_build_json(code)
    for causal in ("False", "True"):
        loops = rep[causal]["loops"]
        cons = [lp for lp in loops if lp["hgmma"]]
        prod = [lp for lp in loops if not lp["hgmma"]]
        assert len(cons) == (4 if causal == "True" else 2) and len(prod) == 1, (causal, [lp["n"] for lp in loops])
        assert rep[causal]["pack"] == rep[causal]["f2fp"], causal   # every conversion packs two values
        for lp in cons:
            c = lp["classes"]
            assert lp["hgmma"] == {"64x64x16": 24, "64x128x16": 8} and (lp["hgmma_ss"], lp["hgmma_rs"]) == (24, 8)
            for name, want in (("mufu_ex2", 32), ("ffma", 32), ("fadd", 32), ("fmul", 32), ("f2fp", 32),
                               ("redg", 16), ("lds", 16), ("sts", 4), ("bar", 5)):
                assert c.get(name) == want, (causal, name, c)
            assert not c.get("shfl") and not c.get("local") and not c.get("mufu_other"), (causal, c)
            masked = c.get("fsel_fsetp", 0) > 0
            assert masked == (c.get("fsel_fsetp", 0) == 32), c
            assert (560 <= lp["n"] <= 620) if masked else (380 <= lp["n"] <= 440), (causal, lp["n"])
        assert 60 <= prod[0]["n"] <= 100, prod[0]["n"]
        unmasked = [lp for lp in cons if not lp["classes"].get("fsel_fsetp")]
        assert len(unmasked) == 2
        r = GB.bwd_step_model(unmasked, prod[0]["n"], tflops=447.0)
        assert r["tensor"] == 2560 and abs(r["smem"] - 2564) <= 64 and r["mufu"] == 512, r
        assert 0.42 <= r["tensor_share"] <= 0.48 and r["issue_share"] < 0.2, r
        assert max(r[f"{k}_share"] for k in ("tensor", "smem", "mufu", "issue", "fp32")) < 0.5, r
        assert r["red_bytes"] == 64 * 128 * 4   # one fp32 64 x 128 dQ tile per CTA step
