"""The Gluon W4A16 kernel with two or three wgmma groups in flight per consumer (``inflight``)."""
from __future__ import annotations

import pytest
import torch

from fxopt.testing import offline_build_json
from test_w4a16_kernels import _gluon_or_skip, _is_sm90, assert_close_to_ref, make_packed, reference


def test_inflight_rules():
    """Only the builds checked offline are accepted; anything else is a ValueError naming the parameter."""
    kg = _gluon_or_skip()
    kg._inflight_ok(1, 256, 256, 64, None, True)  # depth 1: always (the measured builds)
    for bm in (16, 32, 64):
        for depth in (2, 3):
            kg._inflight_ok(depth, bm, 128, 32, "async", False)
    kg._inflight_ok(2, 128, 128, 32, "async", False)
    bad = [(3, 128, 128, 32, "async", False),  # ptxas serializes (C7512)
           (2, 64, 256, 32, "async", False),  # C7512
           (2, 64, 128, 64, "async", False),  # two chunks per K tile: register hazards in the SASS
           (2, 64, 128, 32, None, False),  # default register split: wgmma serialized anyway
           (2, 64, 128, 32, "async", True),  # small-M / stream-K kernels do not take it
           (4, 64, 128, 32, "async", False)]
    for args in bad:
        with pytest.raises(ValueError, match="inflight"):
            kg._inflight_ok(*args)


def test_inflight_offline_sm90_builds():
    """Offline sm_90 builds (no GPU) of depth 2 and 3 at BM 64 x BN 128 KC 32, split-K on and off, with bias: the
    main loop waits with DEPBAR.LE gsb0 0x2 / 0x3 (and never 0x1), ptxas does not serialize, no spill, no register
    hazard of in-flight groups; depth 1 keeps its 0x1 waits."""
    _gluon_or_skip()
    code = ("import json, re, collections\n"
            "from fxopt.kernels import w4a16_gluon as g\n"
            "out = []\n"
            "for depth in (1, 2, 3):\n"
            "    for split in (True, False):\n"
            "        c = dict(block_m=64, block_n=128, stages=8, kc=32, split_k=None, regs='async', inflight=depth)\n"
            "        r = g.offline_report(64, 4096, 4096, c, 'bf16', split=split, bias=True)\n"
            "        sass = g.sass_of(g.compile_offline(64, 4096, 4096, c, 'bf16', split=split, bias=True))\n"
            "        r['waits'] = dict(collections.Counter(re.findall(r'DEPBAR.LE gsb0, (0x[0-9a-f])', sass)))\n"
            "        r['depth'] = depth\n"
            "        out.append(r)\n"
            "print(json.dumps(out))\n")
    rows = offline_build_json(code)
    assert len(rows) == 6
    for r in rows:
        assert r["stack"] == 0 and r["local"] == 0 and r["reg"] <= 168, r
        assert r["serialized"] == [] and r["hazards"] == 0, r
        key = f"0x{r['depth']}"
        assert r["waits"].get(key, 0) > 0, r
        assert set(r["waits"]) <= {key, "0x0"}, r


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("M", [16, 33, 64, 128])
def test_gpu_gluon_inflight(M, use_bias):
    """Depths 2 and 3 against the float reference, split-K on (fills the SMs) and off, twice each (the split-K
    counters must come back to zero); rows past M in the last M tile exercise the masks."""
    kg = _gluon_or_skip()
    dtype = torch.bfloat16
    for K, N in ((1024, 2048), (2048, 1024)):
        qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=47)
        zeros = zeros.round()
        gen = torch.Generator().manual_seed(M + K)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda() if use_bias else None
        ref = reference(x, qweight, scales, zeros, G, bias)
        bm = kg._block_m_for(M)
        for depth in ((2, 3) if bm <= 64 else (2, )):
            for split in (None, 1):
                for _ in range(2):
                    y = kg.gluon_w4a16_mm(x, qweight, scales, zeros, 128, bias, block_m=bm, block_n=128,
                                          stages=kg._max_stages(bm, 128), kc=32, split_k=split, regs="async",
                                          inflight=depth)
                    torch.cuda.synchronize()
                    assert y.dtype == dtype and y.shape == (M, N)
                    assert_close_to_ref(y, ref, dtype)


def test_four_consumers_rules():
    """consumers=4: only BN 256, BM <= 64, the "four" register split and the main kernel; the launch register limit
    keeps the 20-warp pool within 64K registers."""
    kg = _gluon_or_skip()
    kg._consumers_ok(2, 256, 128, None, True)
    kg._consumers_ok(4, 64, 256, "four", False)
    kg._consumers_ok(4, 64, 128, "four", False)  # K pairs
    for args in ((4, 128, 256, "four", False), (4, 64, 512, "four", False), (4, 64, 256, "async", False),
                 (4, 64, 256, "four", True), (3, 64, 256, "four", False)):
        with pytest.raises(ValueError, match="consumers"):
            kg._consumers_ok(*args)
    c, p = kg._REGS["four"]
    assert kg._maxnreg(c, p, 4) == 96 and 20 * 32 * 96 <= 65536 and 16 * c + 4 * p <= 20 * 96
    with pytest.raises(ValueError, match="register pool"):
        kg._maxnreg(128, 24, 4)


def test_four_consumers_offline_sm90_builds():
    """Offline sm_90 builds of the four-consumer kernel (BM 16 / 64 x BN 256, split-K on, bias): 96 registers at
    launch, no wgmma register hazard; four consumer loops of the same length."""
    _gluon_or_skip()
    code = ("import json\n"
            "from fxopt.kernels import w4a16_gluon as g\n"
            "out = []\n"
            "for bm in (16, 64):\n"
            "    c = dict(block_m=bm, block_n=256, stages=g._max_stages(bm, 256), kc=32, split_k=None,\n"
            "             consumers=4)\n"
            "    sass = g.sass_of(g.compile_offline(bm, 4096, 4096, c, 'bf16', split=True, bias=True))\n"
            "    out.append(dict(bm=bm, hazards=len(g.wgmma_sass_hazards(sass)),\n"
            "                    loops=[lp['dynamic'] for lp in g.loop_profile(sass)]))\n"
            "print(json.dumps(out))\n")
    rows = offline_build_json(code)
    assert len(rows) == 2
    for r in rows:
        assert r["hazards"] == 0, r
        assert len(r["loops"]) >= 4, r


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("M", [1, 16, 33, 64])
def test_gpu_gluon_four_consumers(M, use_bias):
    """consumers=4 against the float reference, BN 256 (four column slices) and BN 128 (K pairs), split-K on and
    off, twice each (counters reset per consumer); K = 256 / 1152 give the K pairs 2 / 9 K tiles (an odd tile
    count: the slices must keep >= 2 tiles each)."""
    kg = _gluon_or_skip()
    dtype = torch.bfloat16
    for K, N in ((1024, 2048), (2048, 1024), (256, 1024), (1152, 1024)):
        qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=53)
        zeros = zeros.round()
        gen = torch.Generator().manual_seed(M + K + 1)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda() if use_bias else None
        ref = reference(x, qweight, scales, zeros, G, bias)
        bm = kg._block_m_for(M)
        for bn in (128, 256):
            for split in (None, 1, 4):
                for _ in range(2):
                    y = kg.gluon_w4a16_mm(x, qweight, scales, zeros, 128, bias, block_m=bm, block_n=bn,
                                          stages=kg._max_stages(bm, bn), kc=32, split_k=split, consumers=4)
                    torch.cuda.synchronize()
                    assert y.dtype == dtype and y.shape == (M, N)
                    assert_close_to_ref(y, ref, dtype)



@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("M", [16, 64])
def test_gpu_gluon_main_pdl(M):
    """pdl=True on the main kernel (programmatic dependent launch after the x prep): against the float reference,
    split-K on and off, bias on, three calls in a row (each waits for its prep before touching the counters)."""
    kg = _gluon_or_skip()
    dtype, K, N = torch.bfloat16, 2048, 2048
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=61)
    zeros = zeros.round()
    gen = torch.Generator().manual_seed(M + 7)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda()
    ref = reference(x, qweight, scales, zeros, G, bias)
    bm = kg._block_m_for(M)
    for split in (None, 1):
        ys = [kg.gluon_w4a16_mm(x, qweight, scales, zeros, 128, bias, block_m=bm, block_n=128,
                                stages=kg._max_stages(bm, 128), kc=32, split_k=split, regs="async", pdl=True)
              for _ in range(3)]
        torch.cuda.synchronize()
        for y in ys:
            assert_close_to_ref(y, ref, dtype)


def test_regmajor_workspace_offline_sm90_builds():
    """ws_layout="regmajor" (the split-K partials in a register-major tile workspace): the offline sm_90 build
    takes that path (it reads %nctaid for the workspace stride, the default split-K build does not), has no stack
    and no wgmma hazard, keeps the K loop, and is shorter than the default split-K build (per-element 64-bit
    workspace addresses gone)."""
    _gluon_or_skip()
    code = ("import json\n"
            "from fxopt.kernels import w4a16_gluon as g\n"
            "out = []\n"
            "for ws in (None, 'regmajor'):\n"
            "    c = dict(block_m=64, block_n=128, stages=8, kc=32, split_k=None, regs='async', ws_layout=ws)\n"
            "    r = g.offline_report(64, 4096, 4096, c, 'bf16', split=True, bias=True)\n"
            "    k = g.compile_offline(64, 4096, 4096, c, 'bf16', split=True, bias=True)\n"
            "    sass = g.sass_of(k)\n"
            "    r.update(ws=ws, nctaid='nctaid' in k.asm['ptx'], n_instr=sass.count(';'))\n"
            "    out.append(r)\n"
            "print(json.dumps(out))\n")
    base, reg = offline_build_json(code)
    assert not base["nctaid"] and reg["nctaid"]
    for r in (base, reg):
        assert r["stack"] == 0 and r["local"] == 0 and r["hazards"] == 0 and r["serialized"] == [], r
    assert len(reg["loops"]) == len(base["loops"]) == 2
    assert all(abs(a["dynamic"] - b["dynamic"]) <= 4 for a, b in zip(reg["loops"], base["loops"]))
    assert reg["n_instr"] < base["n_instr"], (reg["n_instr"], base["n_instr"])


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("M", [16, 33, 64])
def test_gpu_gluon_regmajor_workspace(M, use_bias):
    """ws_layout="regmajor" against the float reference, split-K from the SM count and an explicit 4, twice each
    (the counters must come back to zero); rows past M in the last M tile exercise the masks."""
    kg = _gluon_or_skip()
    dtype = torch.bfloat16
    for K, N in ((1024, 2048), (2048, 1024)):
        qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=67)
        zeros = zeros.round()
        gen = torch.Generator().manual_seed(M + K + 3)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda() if use_bias else None
        ref = reference(x, qweight, scales, zeros, G, bias)
        bm = kg._block_m_for(M)
        for split in (None, 4):
            for _ in range(2):
                y = kg.gluon_w4a16_mm(x, qweight, scales, zeros, 128, bias, block_m=bm, block_n=128,
                                      stages=kg._max_stages(bm, 128), kc=32, split_k=split, regs="async",
                                      ws_layout="regmajor")
                torch.cuda.synchronize()
                assert_close_to_ref(y, ref, dtype)


@pytest.mark.parametrize("BM,BN_C", [(16, 64), (64, 64), (32, 128), (64, 128)])
def test_regmajor_owner_formula_matches_wgmma_accumulator(BM, BN_C):
    """The register-major workspace's offset (``_epilogue``, SPLIT_REGMAJOR) is slot(r, m) * 128 + owner(r, m) with
    owner = 32 ((r // 16) % 4) + 4 (r % 8) + (m // 2) % 4 and slot = (((r // 64) (BM / 8) + m // 8) 2 + (r // 8) % 2)
    2 + m % 2. Through Triton's own linear layout of the consumer's wgmma accumulator (CPU): owner is the thread
    that holds (r, m), so a warp's store of one slot writes 32 consecutive floats; and (slot, owner) is a bijection
    onto the BM x BN_C block (each thread's slots are exactly 0 .. BM BN_C / 128 - 1)."""
    from test_w4a16_mma import _linear, _owners

    _gluon_or_skip()
    from triton.experimental.gluon import language as gl

    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    owners = _owners(_linear(acc, [BN_C, BM]))
    per_thread = BM * BN_C // 128
    seen = {}
    for (r, m), who in owners.items():
        assert len(who) == 1, (r, m, who)
        lane, warp = next(iter(who))
        owner = 32 * ((r // 16) % 4) + 4 * (r % 8) + (m // 2) % 4
        slot = (((r // 64) * (BM // 8) + m // 8) * 2 + (r // 8) % 2) * 2 + m % 2
        assert owner == 32 * warp + lane, (r, m)
        assert 0 <= slot < per_thread
        seen.setdefault(owner, set()).add(slot)
    assert len(owners) == BM * BN_C and len(seen) == 128
    assert all(v == set(range(per_thread)) for v in seen.values())
