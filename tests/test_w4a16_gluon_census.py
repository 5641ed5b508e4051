"""Instruction census and per-tile cycle model of the Gluon W4A16 GEMM (``fxopt.kernels.w4a16_gluon``:
``sass_census``, ``tile_cycle_model``, ``offline_census``; see docs/kernels.md).

CPU: the census on hand-made SASS and the model's arithmetic. Offline build (no GPU; skipped without Triton's bundled
ptxas / cuobjdump): the census of the config the tuner picks at M = 64 on 8192 x 8192."""
import math

import pytest

from fxopt.testing import offline_build_json

g = pytest.importorskip("fxopt.kernels.w4a16_gluon")

# a consumer loop (dequant, two HGMMA, a last-tile drain region skipped by a predicated branch) and a producer loop
_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13+0x310e0], R9 ;
        /*0020*/                   LDS.64 R14, [R10+UR13+0x21000] ;
        /*0030*/                   SHF.R.U32.HI R17, RZ, 0x4, R14 ;
        /*0040*/                   LOP3.LUT R17, R2, 0xf000f, R17, 0xf8, !PT ;
        /*0050*/                   HADD2.BF16_V2 R64, R17, -R20 ;
        /*0060*/                   HMUL2.BF16_V2 R64, R64, R89 ;
        /*0070*/                   IMAD.U32 R12, R9, 0x10000, RZ ;
        /*0080*/                   F2F.BF16.F32 R13, R13 ;
        /*0090*/                   USHF.R.U32.HI UR12, URZ, 0x4, UR17 ;
        /*00a0*/                   WARPGROUP.ARRIVE ;
        /*00b0*/                   HGMMA.64x64x16.F32.BF16 R24, R64, gdesc[UR12], R24 ;
        /*00c0*/                   HGMMA.64x64x16.F32.BF16 R24, R68, gdesc[UR16], R24, gsb0 ;
        /*00d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*00e0*/               @P0 BRA 0x110 ;
        /*00f0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0100*/                   FADD R3, R3, R4 ;
        /*0110*/                   ISETP.NE.U32.AND P0, PT, R5, UR4, PT ;
        /*0120*/               @P0 BRA 0x10 ;
        /*0130*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16+0x31120], R2 ;
        /*0140*/                   UIADD3 UR16, UR12, 0x2000, URZ ;
        /*0150*/                   UTMALDG.2D [UR12], [UR50] ;
        /*0160*/                   UTMALDG.2D [UR16], [UR52] ;
        /*0170*/                   ISETP.NE.U32.AND P0, PT, R4, UR4, PT ;
        /*0180*/               @P0 BRA 0x130 ;
        /*0190*/                   EXIT ;
"""


def test_sass_census_hand_made():
    c = g.sass_census(_SASS)
    assert len(c["consumers"]) == 1
    k = c["consumers"][0]
    # body 0x10..0x120 = 18 instructions, of which DEPBAR 0x0 and FADD are the skipped drain region
    assert k["static"] == 18 and k["total"] == 16
    assert k["hgmma"] == 2 and k["hgmma_shapes"] == {"64x64x16": 2}
    assert k["alu"] == 3  # SHF, LOP3, ISETP
    assert k["half2"] == 2 and k["imad"] == 1 and k["cvt"] == 1 and k["smem"] == 1 and k["uniform"] == 1
    assert k["fp32"] == 0  # the FADD is in the skipped region
    assert k["sync"] == 3 and k["branch"] == 2  # TRYWAIT, ARRIVE, DEPBAR 0x1 / the two BRA
    assert sum(k[x] for x in list(g._CENSUS_CLASSES) + ["uniform", "other"]) == k["total"]
    p = c["producer"]
    assert p["total"] == 6 and p["tma"] == 2 and p["sync"] == 1 and p["uniform"] == 1 and p["hgmma"] == 0


def test_tile_cycle_model_arithmetic():
    cons = dict(total=215, alu=64, imad=9, half2=64, fp32=2, smem=6)
    census = dict(consumers=[cons, dict(cons, total=217)], producer=dict(total=77, alu=3))
    cfg = dict(block_m=64, block_n=128, stages=8, kc=32, split_k=None, regs="async")
    m = g.tile_cycle_model(census, 64, 8192, 8192, cfg, us=28.9)
    # 64 output tiles of 64 x 128 on 132 SMs: split 2 (128 CTAs, one wave), 32 K tiles each
    assert (m["split_k"], m["ctas"], m["waves"], m["tiles_per_cta"]) == (2, 128, 1, 32)
    assert m["clk"]["tensor"] == 2 * 64 * 128 * 128 / 4096
    assert m["clk"]["issue"] == 2 * 216 + 77
    assert m["clk"]["alu"] == 4 * 64 + 2 * 3
    stage = 64 * 128 * 2 + 16 * 128 * 4 + 2 * 128 * 2
    assert m["stage_bytes"] == stage and m["clk"]["l2"] == round(stage / 27.5, 1)
    w = 16 * 128 * 4 + 2 * 128 * 2
    assert math.isclose(m["clk"]["dram"], w / (4.2e12 / 128 / 1.83e9), abs_tol=0.06)
    tile = (28.9 - 3.5) * 1.83e3 / 32  # t0 = 2.5 us + 1 us split-K tail
    assert math.isclose(m["tile_clk"], tile, abs_tol=0.06)
    assert math.isclose(m["frac"]["tensor"], 512 / tile, abs_tol=1e-3)
    assert m["bound_model"] == max(m["clk"], key=m["clk"].get)
    # BM > 64 with the async split runs without split-K (the wrapper's rule); two waves when CTAs > SMs
    big = g.tile_cycle_model(census, 256, 8192, 28672, dict(cfg, block_m=128, block_n=128), us=100.0)
    assert big["split_k"] == 1 and big["ctas"] == 2 * 224 and big["waves"] == 4 and "frac" in big
    assert "frac" not in g.tile_cycle_model(census, 64, 8192, 8192, cfg)


def test_census_offline_sm90_m64_pick():
    """The build the tuner picks at M = 64 on 8192 x 8192 (measured: "gluon bm64 bn128 s8
    kc32 async", 28.9 us): per K tile and consumer warp, 8 HGMMA 64x64x16 (4 KC chunks x 2 k-steps), 2 half2
    instructions per packed pair (sub + mul), 6 shared loads, wgmma kept asynchronous; the producer issues 8 TMA
    copies. Model verdict: issue and integer ALU stay below half of the measured tile time (not the bound)."""
    pytest.importorskip("triton.experimental.gluon")
    code = ("import json\n"
            "from fxopt.kernels import w4a16_gluon as g\n"
            "cfg = dict(block_m=64, block_n=128, stages=8, kc=32, split_k=None, regs='async')\n"
            "c = g.offline_census(64, 8192, 8192, cfg, 'bf16', split=True)\n"
            "c['model'] = g.tile_cycle_model(c, 64, 8192, 8192, cfg, us=28.9)\n"
            "print(json.dumps(c))\n")
    c = offline_build_json(code)
    assert len(c["consumers"]) == 2 and c["maxnreg"] == 168 and c["depbar_le1"] > 0
    pairs = 64 * 128 // 128 // 2  # BN_C x BK weights over 128 threads, two per bf16x2 word
    for k in c["consumers"]:
        assert k["hgmma_shapes"] == {"64x64x16": 8}, k
        assert k["half2"] == 2 * pairs and k["smem"] == 6 and k["fp32"] <= 4, k
        assert pairs <= k["alu"] <= 3 * pairs and k["total"] <= 240, k
    assert c["producer"]["tma"] == 8 and c["producer"]["hgmma"] == 0
    fr = c["model"]["frac"]
    assert fr["issue"] < 0.5 and fr["alu"] < 0.5 and fr["tensor"] < 0.5, c["model"]
