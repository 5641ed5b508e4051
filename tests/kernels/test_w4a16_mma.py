"""The mma.sync W4A16 kernel (fxopt/kernels/w4a16/mma.py, method "mma").

CPU: host checks and config rules; the lane mapping against the PTX m16n8k16 fragment tables through Triton's own
linear layouts (``to_linear_layout`` runs on the CPU); a float64 emulation of the kernel's tile arithmetic in the
documented K / n order; the tuner hook. GPU (``@pytest.mark.gpu``, sm_80+): against the float64 dequantized
reference.
"""
import numpy as np
import pytest
import torch

from fxopt.kernels import cdiv
from fxopt.kernels.w4a16 import common, mma as KM, routing, tuner

from w4a16_helpers import assert_close_to_ref, make_packed, reference

needs_gluon = pytest.mark.skipif(not KM.HAS_GLUON, reason="Triton Gluon not importable")


# ------------------------------------------------------------------------------------------------ host logic
def test_rejects_bad_inputs_and_configs():
    qweight, scales, zeros, _ = make_packed(256, 64, 128, torch.float16, seed=1)
    x = torch.randn(2, 256).half()
    with pytest.raises(ValueError, match="2-D"):
        KM.w4a16_mma(x[None], qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="M <= 16"):
        KM.w4a16_mma(torch.randn(17, 256).half(), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        KM.w4a16_mma(x.float(), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="input features"):
        KM.w4a16_mma(x[:, :128], qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="group size"):
        KM.w4a16_mma(x, qweight, scales, zeros, 96)
    with pytest.raises(ValueError, match="bias"):
        KM.w4a16_mma(x, qweight, scales, zeros, 128, bias=torch.randn(63).half())
    for bad, what in ((KM.MmaConfig(warps=3), "warps"), (KM.MmaConfig(cols_per_warp=48), "cols_per_warp"),
                      (KM.MmaConfig(prefetch=3), "prefetch"), (KM.MmaConfig(block_k=256), "block_k"),
                      (KM.MmaConfig(split_k=-1), "split_k")):
        with pytest.raises(ValueError, match=what):
            KM.w4a16_mma(x, qweight, scales, zeros, 128, config=bad)
    with pytest.raises(ValueError, match="CUDA device|gluon"):  # valid arguments, but CPU tensors
        KM.w4a16_mma(x, qweight, scales, zeros, 128)


def test_geometry_follows_group_and_m():
    cfg = KM.MmaConfig()
    assert KM._geometry(1, 4096, 128, cfg) == (8, 128, 2, 4)
    assert KM._geometry(8, 4096, 64, cfg) == (8, 64, 2, 4)
    assert KM._geometry(9, 4096, 32, cfg) == (16, 32, 2, 4)
    assert KM._geometry(3, 200, 200, KM.MmaConfig(cols_per_warp=64, warps=8)) == (8, 128, 4, 8)  # per channel
    # a K tile may not straddle a group: BK = min(block_k, group)
    with pytest.raises(ValueError, match="multiple of 32"):
        KM._geometry(1, 48, 16, cfg)


def test_split_is_one_wave_and_balanced():
    """gemv1's rule: the split minimizing waves x (K tiles per CTA + 1.5), balanced (equal K tiles per split)."""
    def cost(n_tiles, k_tiles, slots, s):
        tps = cdiv(k_tiles, s)
        return cdiv(n_tiles * cdiv(k_tiles, tps), slots) * (tps + 1.5)

    # 8192^2, BN 128: 64 column tiles x 64 K tiles on 4 x 132 slots: split 8 = 512 CTAs, one wave of 8 tiles each
    assert KM.choose_split(64, 64, 4, 132) == 8
    for n_tiles, k_tiles, res in ((1, 1, 4), (86, 32, 4), (32, 86, 3), (224, 64, 3), (7, 3, 1)):
        s = KM.choose_split(n_tiles, k_tiles, res, 132)
        assert 1 <= s <= k_tiles and cdiv(k_tiles, cdiv(k_tiles, s)) == s
        assert cost(n_tiles, k_tiles, res * 132, s) == min(cost(n_tiles, k_tiles, res * 132, t)
                                                            for t in range(1, k_tiles + 1))
    assert common.balanced_split(cdiv(4200, 128), 5) == (5, 7)  # 33 tiles, 7 per split
    assert common.balanced_split(cdiv(4096, 128), 0) == (1, 32)


def test_candidate_configs():
    for M in (1, 2, 4, 8, 9, 12, 16):
        tiles, bm = (KM._TILES, 8) if M <= 8 else (KM._TILES16, 16)
        cs = KM.mma_configs(M, 8192, 8192, 128)
        assert len(cs) == len(tiles) and all(c.method == "mma" for c in cs)
        for c, (cpw, warps, prefetch, pdl) in zip(cs, tiles):
            mc = KM.to_mma_config(c)
            assert (mc.cols_per_warp, mc.warps, mc.prefetch, mc.pdl) == (cpw, warps, prefetch, pdl)
            assert c.prefetch == prefetch and c.label() == mc.label()
            assert mc.block_n == c.block_n and c.block_m == bm and c.block_k == 128
            assert KM._geometry(M, 8192, 128, mc)[0] == bm
            # one wave: column tiles x splits fit the resident CTA slots of this BM's register count
            assert cdiv(8192, c.block_n) * c.split_k <= KM._resident(bm, cpw, warps, prefetch) * 132
            assert c.label().startswith(f"mma bn{c.block_n} bk128 sk{c.split_k}")
    # M = 9..16: R = 4 only (64 columns per warp), with BM 16's residency (255 registers: 8 warps per SM)
    assert {KM.to_mma_config(c).cols_per_warp for c in KM.mma_configs(16, 8192, 8192, 128)} == {64}
    assert KM._resident(16, 64, 4, 1) == 2 and KM._resident(8, 64, 4, 1) == 3
    assert KM.mma_configs(17, 8192, 8192, 128) == [] and KM.mma_configs(0, 8192, 8192, 128) == []
    assert {c.block_k for c in KM.mma_configs(1, 4096, 4096, 32)} == {32}
    assert {c.block_k for c in KM.mma_configs(16, 4096, 4096, 64)} == {64}
    assert {c.block_k for c in KM.mma_configs(1, 200, 4096, -1)} == {128}
    # M = 9..16: tiles needing masked loads spill at R = 4 and are not listed (M <= 8 lists them all)
    assert [c.block_n for c in KM.mma_configs(16, 4096 + 128, 4096, 128)] == [128, 64, 128]
    assert KM.mma_configs(16, 2200, 4096, 128) == [] and KM.mma_configs(16, 4096, 4200, -1) == []
    # ... plus, on this small grid (18 column tiles x 17 of 528 slots), the PDL tile with twice the split (capped at
    # the 33 K tiles)
    cs8 = KM.mma_configs(8, 2200, 4200, -1)
    assert len(cs8) == len(KM._TILES) + 1
    assert [c.split_k for c in cs8 if c.pdl] == [17, 33]


def test_tuner_hook_switch():
    """Listed by default (``Routes.mma`` off takes it off), for M buckets <= 16 on CUDA devices (sm_80+), after every
    other candidate; with the switch off the candidate list is the one without it."""
    def cands(M, r, capability=(9, 0)):
        return tuner.candidate_configs(M, 8192, 8192, 128, dtype=torch.bfloat16, capability=capability, routes=r)

    off, on = routing.Routes(gluon=False, mma=False), routing.Routes(gluon=False)
    for M in (1, 4, 8, 9, 16, 17, 32):
        before, after = cands(M, off), cands(M, on)
        mma = [c for c in after if c.method == "mma"]
        assert not any(c.method == "mma" for c in before)
        assert after[:len(before)] == before and after[len(before):] == mma
        assert bool(mma) == (M <= 16 and KM.HAS_GLUON), M
        if mma:
            assert mma == KM.mma_configs(M, 8192, 8192, 128, 132), M
    assert not any(c.method == "mma" for c in tuner.candidate_configs(1, 8192, 8192, 128, device="cpu"))
    assert not any(c.method == "mma" for c in cands(1, on, capability=(7, 5)))


def test_tuner_checks_mma_against_default(interpret_device, monkeypatch):
    """The tuner's safety net covers "mma": its output must match the default config's before it is timed. The mma
    launch is replaced by the float reference (agrees) and by a 10% wrong result (dropped)."""
    K, N = 256, 128
    qweight, scales, zeros, G = make_packed(K, N, 128, torch.float16, interpret_device, seed=3)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4)).half().to(interpret_device)
    default = tuner.interpreter_config(2, K, 128)
    cfg = KM.mma_configs(2, N, K, 128)[0]

    def fake(scale):
        return lambda x2d, q, s, z, g, b, c: (reference(x2d, q, s, z, G, b) * scale).to(x2d.dtype).to(x2d.device)

    monkeypatch.setattr(KM, "launch_mma", fake(1.0))
    assert tuner._agrees_with_default(x, qweight, scales, zeros, 128, None, cfg, default)
    monkeypatch.setattr(KM, "launch_mma", fake(1.1))
    assert not tuner._agrees_with_default(x, qweight, scales, zeros, 128, None, cfg, default)


# ------------------------------------------------------------------------------------------------ lane mapping
# The PTX ISA fragment tables of mma.m16n8k16 (16-bit inputs, fp32 accumulators) and the kernel's relabeling.
def fragment_owner(operand: str, row: int, col: int) -> tuple[int, int]:
    """(lane, register index within the thread's fragment) of element (row, col) of operand "a" (16 x 16, 8
    halves), "b" (16 x 8, 4 halves) or "c" (16 x 8 fp32, 4 registers)."""
    if operand == "a":
        g, h, hk, e = row % 8, row // 8, col // 8, col % 2
        t = (col % 8) // 2
        return 4 * g + t, 2 * (2 * hk + h) + e
    if operand == "b":
        hk, e, t = row // 8, row % 2, (row % 8) // 2
        return 4 * col + t, 2 * hk + e
    if operand == "c":
        return 4 * (row % 8) + col // 2, 2 * (row // 8) + col % 2
    raise ValueError(f"operand must be 'a', 'b' or 'c', got {operand!r}")


def tile_k_of(p: int) -> int:
    """K offset that tile column / B row p = 32 c + 16 kb + 8 hk + 2 t + e holds: 8 (4 c + t) + 2 kb + hk + 4 e."""
    c, kb, hk, t, e = p // 32, (p // 16) % 2, (p // 8) % 2, (p // 2) % 4, p % 2
    return 8 * (4 * c + t) + 2 * kb + hk + 4 * e


def tile_n_of(r: int, R: int, W: int) -> int:
    """Weight column of accumulator / A row r = 16 W rep + 16 warp + 8 h + g: 2R (8 warp + g) + 2 rep + h."""
    rep, warp, h, g = r // (16 * W), (r // 16) % W, (r // 8) % 2, r % 8
    return 2 * R * (8 * warp + g) + 2 * rep + h


def _coords(ll, reg, lane, warp):
    """Element coordinates of (register, lane, warp) in a DistributedLinearLayout: XOR of the bases of set bits."""
    out = [0] * len(ll.shape)
    for bases, v in ((ll.reg_bases, reg), (ll.lane_bases, lane), (ll.warp_bases, warp)):
        for i, b in enumerate(bases):
            if v >> i & 1:
                out = [o ^ x for o, x in zip(out, b)]
    return tuple(out)


def _owners(ll):
    """{element: set of (lane, warp)} over every register of a linear layout."""
    own = {}
    for warp in range(1 << len(ll.warp_bases)):
        for lane in range(32):
            for reg in range(1 << len(ll.reg_bases)):
                own.setdefault(_coords(ll, reg, lane, warp), set()).add((lane, warp))
    return own


def _linear(layout, shape):
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    return gluon_ir.GluonOpBuilder(ctx).to_linear_layout(layout._to_ir(gluon_ir.GluonOpBuilder(ctx)), list(shape))


@needs_gluon
@pytest.mark.parametrize("BM,BK,R,W", [(8, 128, 2, 4), (8, 32, 4, 2), (16, 64, 1, 8)])
def test_lane_mapping_matches_ptx_fragments(BM, BK, R, W):
    """(1) Triton's mma v2 dot-operand / accumulator layouts are the PTX m16n8k16 fragments (``fragment_owner``) with
    rows r = 16 W rep + 16 warp + 8 h + g; (2) the kernel's load layouts put every element in the registers of the
    lane and warp that own it in those fragments under the documented relabeling (``tile_k_of`` / ``tile_n_of``),
    so the join / reshape / permute chain before each ``convert_layout(assert_trivial=True)`` moves no data."""
    from triton.experimental.gluon import language as gl

    BN = 16 * R * W
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a = _owners(_linear(gl.DotOperandLayout(0, mma, 2), [BN, BK]))
    b = _owners(_linear(gl.DotOperandLayout(1, mma, 2), [BK, BM]))
    c = _owners(_linear(mma, [BN, BM]))

    def warp_of(r):
        return (r // 16) % W

    for (r, p), who in a.items():
        assert who == {(fragment_owner("a", r % 16, p % 16)[0], warp_of(r))}, (r, p)
    for (p, m), who in b.items():
        assert who == {(fragment_owner("b", p % 16, m % 8)[0], w) for w in range(W)}, (p, m)
    for (r, m), who in c.items():
        assert who == {(fragment_owner("c", r % 16, m % 8)[0], warp_of(r))}, (r, m)

    lay = KM._layouts(BM, BK, R, W)
    p_of = {tile_k_of(p): p for p in range(BK)}
    assert sorted(p_of) == list(range(BK))  # a permutation of the tile's K
    r_of = {tile_n_of(r, R, W): r for r in range(BN)}
    assert sorted(r_of) == list(range(BN))
    words = _owners(lay["w_layout"])
    assert set(words) == {(kp, n) for kp in range(BK // 8) for n in range(BN)}
    for (kp, n), who in words.items():
        for j in range(8):  # every nibble of the word lands in the loading thread's A registers
            assert who == a[(r_of[n], p_of[8 * kp + j])], (kp, n, j)
    xs = _owners(lay["x_layout"])
    for (m, kp, jj), who in xs.items():
        assert who == b[(p_of[8 * kp + jj], m)], (m, kp, jj)
    sz = _owners(lay["sz_layout"])
    for (n,), who in sz.items():  # the scale / zero of column n: exactly the threads owning accumulator row n
        assert who == {lw for m in range(BM) for lw in c[(r_of[n], m)]}, n


@needs_gluon
@pytest.mark.parametrize("C,R,W", [(4, 2, 4), (1, 4, 2), (2, 1, 8)])
def test_relabel_chains_match_documented_order(C, R, W):
    """numpy replay of the kernel's join / reshape / permute chains (``_A_PERM`` / ``_B_PERM``, row-major reshapes
    as Gluon's) on index tensors: A[r, p] comes from packed word row (tile_k_of(p) // 8), column tile_n_of(r), nibble
    tile_k_of(p) % 8, and B[p, m] from x[m, tile_k_of(p)]: the documented order, the same K order for A and B."""
    BN, BK = 16 * R * W, 32 * C
    kp, n = np.meshgrid(np.arange(4 * C), np.arange(BN), indexing="ij")
    # d_j holds nibbles j (e = 0) and j + 4 (e = 1): joined as [4C, BN, hk, kb, e] with j = 2 kb + hk
    j = np.arange(2)[:, None] + 2 * np.arange(2)[None, :]  # [hk, kb]
    nib = j[None, None, :, :, None] + 4 * np.arange(2)[None, None, None, None, :]
    k_src = np.broadcast_to(8 * kp[:, :, None, None, None] + nib, (4 * C, BN, 2, 2, 2))
    n_src = np.broadcast_to(n[:, :, None, None, None], k_src.shape)
    perm = tuple(KM._A_PERM.value)
    a_k = k_src.reshape(C, 4, W, 8, R, 2, 2, 2, 2).transpose(perm).reshape(BN, BK)
    a_n = n_src.reshape(C, 4, W, 8, R, 2, 2, 2, 2).transpose(perm).reshape(BN, BK)
    assert (a_k == np.array([tile_k_of(p) for p in range(BK)])[None, :]).all()
    assert (a_n == np.array([tile_n_of(r, R, W) for r in range(BN)])[:, None]).all()
    m, kpx, jj = np.meshgrid(np.arange(8), np.arange(4 * C), np.arange(8), indexing="ij")
    bperm = tuple(KM._B_PERM.value)
    b_k = (8 * kpx + jj).reshape(8, C, 4, 2, 2, 2).transpose(bperm).reshape(BK, 8)
    b_m = m.reshape(8, C, 4, 2, 2, 2).transpose(bperm).reshape(BK, 8)
    assert (b_k == a_k[0][:, None]).all() and (b_m == np.arange(8)[None, :]).all()


def test_fragment_owner_is_a_bijection():
    for op, rows, cols, regs in (("a", 16, 16, 8), ("b", 16, 8, 4), ("c", 16, 8, 4)):
        seen = {fragment_owner(op, r, k) for r in range(rows) for k in range(cols)}
        assert seen == {(lane, i) for lane in range(32) for i in range(regs)}
    with pytest.raises(ValueError, match="operand"):
        fragment_owner("d", 0, 0)


@pytest.mark.parametrize("dtype,group", [(torch.bfloat16, 128), (torch.float16, 32), (torch.float16, -1)])
def test_tile_arithmetic_emulation(dtype, group):
    """float64 emulation of what one CTA computes, in the kernel's order: A[r, p] = OFFSET + q of weight column
    tile_n_of(r) at K tile_k_of(p), B[p, m] = x[m, tile_k_of(p)], P = A B and xsum = ones B per K tile, acc += s (P -
    (OFFSET + z) xsum); against the float64 dequantized reference (catches a wrong permutation, offset or fold)."""
    R, W = 2, 2
    BN = 16 * R * W
    K, N, M = 256, BN, 3
    BK = min(64, K if group == -1 else group)  # a K tile never straddles a group (as ``_geometry``)
    qweight, scales, zeros, G = make_packed(K, N, group, dtype, seed=11)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(12)).to(dtype)
    codes = np.stack([(qweight.numpy() >> (4 * j)) & 0xF for j in range(8)], axis=1).reshape(K, N)  # [K, N]
    off = common.MAGIC[dtype][1]
    s, z, xd = scales.double().numpy(), zeros.double().numpy(), x.double().numpy()
    perm_k = np.array([tile_k_of(p) for p in range(BK)])
    perm_n = np.array([tile_n_of(r, R, W) for r in range(BN)])
    acc = np.zeros((BN, 8))
    gsz = K if group == -1 else group
    for t in range(K // BK):
        ks = t * BK + perm_k
        A = off + codes[ks][:, perm_n].T  # [BN, BK]
        B = np.zeros((BK, 8))
        B[:, :M] = xd[:, ks].T
        P, xsum = A @ B, np.ones((16 * W, BK)) @ B
        g = t * BK // gsz
        acc += s[g, perm_n][:, None] * (P - (off + z[g, perm_n])[:, None] * np.tile(xsum, (R, 1)))
    y = np.zeros((M, N))
    y[:, perm_n] = acc[:, :M].T
    assert_close_to_ref(torch.from_numpy(y).to(dtype), reference(x, qweight, scales, zeros, G), dtype)


# ------------------------------------------------------------------------------------------------ GPU
def _assert_configs_match(x, packed, group_size, bias, cfgs, repeats):
    """Every config, without and with bias, ``repeats`` launches each (split-K workspace reuse): dtype, shape and
    the float64 dequantized reference; afterwards the split-K workspace and counters are back at zero."""
    qweight, scales, zeros, G = packed
    M, N = x.shape[0], bias.shape[0]
    for cfg in cfgs:
        for b in (None, bias):
            ref = reference(x, qweight, scales, zeros, G, b)
            for _ in range(repeats):
                y = KM.w4a16_mma(x, qweight, scales, zeros, group_size, bias=b, config=cfg)
                assert y.dtype == x.dtype and y.shape == (M, N)
                assert_close_to_ref(y, ref, x.dtype)
    torch.cuda.synchronize()
    assert float(common._ZEROED_WS[x.device].abs().sum()) == 0.0
    assert int(common._COUNTERS[x.device].abs().sum()) == 0


def _gpu_mma_or_skip():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs a CUDA device of compute capability >= 8.0")
    if not KM.HAS_GLUON:
        pytest.skip("Triton Gluon not importable")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, -1])
def test_gpu_mma_matches_reference(dtype, group_size):
    """Every listed candidate of M's bucket (none at M > 8 on this ragged shape: see
    ``test_gpu_mma_m16_listed_candidates``), the default tile (R = 2; at M > 8 it runs BM = 16) with split 1 and,
    for M > 8, an R = 4 tile with split 1 (masked loads); M = 1, 2, 4, 8 and 9, 12, 16 (BM = 16: two n8 tiles; 9 and
    12 with clamped B rows), bias off and on, a partial column tile (N = 2112 + 24 + 64: also partial for the
    256-column tiles) and, per channel, a partial K tile (K = 4200); three launches each; the split-K workspace and
    counters are back at zero afterwards."""
    _gpu_mma_or_skip()
    K = 4096 if group_size == 128 else 4200
    N = 2112 + 24 + 64
    qweight, scales, zeros, G = make_packed(K, N, group_size, dtype, "cuda", seed=21)
    gs = K if group_size == -1 else group_size
    for M in (1, 2, 4, 8, 9, 12, 16):
        gen = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda()
        cfgs = [KM.to_mma_config(c) for c in KM.mma_configs(M, N, K, gs)]
        cfgs.append(KM.MmaConfig(split_k=1))
        if M > 8:
            cfgs.append(KM.MmaConfig(cols_per_warp=64, warps=2, split_k=1))
        _assert_configs_match(x, (qweight, scales, zeros, G), group_size, bias, cfgs, repeats=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mma_m16_listed_candidates(dtype):
    """M = 9, 12, 16 with every listed BM = 16 candidate (R = 4, automatic split-K) on a shape they divide (the
    ragged shapes of ``test_gpu_mma_matches_reference`` list none at M > 8), bias off and on, three launches each;
    the split-K workspace and counters are back at zero afterwards."""
    _gpu_mma_or_skip()
    K, N = 4096, 2048
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=51)
    for M in (9, 12, 16):
        gen = torch.Generator().manual_seed(50 + M)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda()
        cands = KM.mma_configs(M, N, K, 128)
        assert len(cands) == len(KM._TILES16) and all(c.split_k > 1 for c in cands)
        for c in cands:
            for b in (None, bias):
                ref = reference(x, qweight, scales, zeros, G, b)
                for _ in range(3):
                    y = KM.launch_mma(x, qweight, scales, zeros, 128, b, c)
                    assert y.shape == (M, N)
                    assert_close_to_ref(y, ref, dtype)
        torch.cuda.synchronize()
        assert float(common._ZEROED_WS[x.device].abs().sum()) == 0.0
        assert int(common._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [32, 64])
def test_gpu_mma_small_groups_and_strided_x(group_size):
    _gpu_mma_or_skip()
    K, N = 2048, 1024
    qweight, scales, zeros, G = make_packed(K, N, group_size, torch.bfloat16, "cuda", seed=31)
    xf = torch.randn(4, K + 8, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16).cuda()
    x = xf[:, 3:K + 3]  # rows not 16-byte aligned: the wrapper copies
    y = KM.w4a16_mma(x, qweight, scales, zeros, group_size)
    assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_mma_through_the_tuner():
    """The op's tuner lists, checks and may pick "mma" (M = 1 and M = 16); the op stays correct."""
    _gpu_mma_or_skip()
    K, N = 4096, 4096
    qweight, scales, zeros, G = make_packed(K, N, 128, torch.bfloat16, "cuda", seed=41)
    for M in (1, 16):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16).cuda()
        cands = tuner.candidate_configs(M, N, K, 128, device=x.device, dtype=x.dtype)
        assert any(c.method == "mma" for c in cands)
        y = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 128)
        assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.bfloat16)


def test_candidates_list_twice_the_split_when_one_wave_leaves_slots_idle():
    """The PDL tile is listed a second time, with twice the
    one-wave split, only where that wave fills less than 90% of the CTA slots (8192 x 28672: 224 tiles x 2 of 528),
    not where it fills them (8192²: 64 x 8 of 528), and never at BM = 16."""
    def pdl_splits(M, K, N):
        return [c.split_k for c in KM.mma_configs(M, N, K, 128) if c.pdl]

    one, two = pdl_splits(1, 8192, 28672)
    assert two == 2 * one
    n_tiles, slots = 28672 // 128, 4 * 132
    assert n_tiles * one < KM._FILL_FOR_SECOND_SPLIT * slots <= n_tiles * two, (n_tiles, one, slots)
    assert len(pdl_splits(1, 8192, 8192)) == 1 and len(pdl_splits(8, 4096, 11008)) == 1
    assert len(pdl_splits(16, 8192, 28672)) == 1
    cands = KM.mma_configs(1, 28672, 8192, 128)
    assert len({(c.block_n, c.num_warps, c.prefetch, c.pdl, c.split_k) for c in cands}) == len(cands)
