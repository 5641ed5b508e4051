"""variant="persistent3" of the Gluon FA3-style forward (offline only so far): the persistent kernel with
THREE consumer warpgroups, i.e. a 192-row query tile per work item, at head dim 64 only.

CPU: the config and its validation (other head dims refused with the reason), the schedule over 192-row tiles (every
(head, query block) item once, every query row in exactly one warpgroup of one item, the key-block plan covering
every visible key and the unmasked prefix needing no mask), the mbarrier protocol model with 3 consumer warpgroups
(clean over random interleavings; the planted bugs caught), one offline sm_90 build (Triton's bundled ptxas, skipped
without it). GPU (``-m gpu``, sm_90 only): out / lse against the float64 reference at ragged shapes, Sq != Sk, GQA,
rows with no visible key, ``num_sms`` 1 / 3 (many items per CTA) and ``write_lse=False``."""
import math
import random

import pytest
import torch

from fxopt.testing import GLUON_FWD_CASES, assert_gluon_fwd_close, gluon_fwd_inputs, gluon_fwd_reference

G = pytest.importorskip("fxopt.kernels.attention_gluon")


# ---------------------------------------------------------------- CPU: config and validation


def test_config_three_consumers_d64_only():
    cfg = G.config_for(64, "persistent3")
    assert "persistent3" in G.VARIANTS and G._PERSISTENT_SCHED["persistent3"] == 1  # zigzag pairs when causal
    assert cfg["NUM_WG"] == 3 and cfg["PERSISTENT"] and cfg["SCHED_CAUSAL"] == 1
    assert G.rows_per_item("persistent3") == 3 * G.WG_ROWS == 192
    assert G.rows_per_item("persistent") == G.rows_per_item("overlap") == 128
    # register budget: 16 warps (13 rounded to warpgroups) x 32 threads x maxnreg <= 64K; after setmaxnreg the
    # producer warpgroup, two consumer warpgroups at CONSUMER_REGS and the default partition with the rest
    assert 16 * 32 * cfg["maxnreg"] <= 65536
    rest = 65536 // 128 - cfg["PRODUCER_REGS"] - 2 * cfg["CONSUMER_REGS"]
    assert rest >= cfg["CONSUMER_REGS"] and cfg["CONSUMER_REGS"] % 8 == 0 and cfg["PRODUCER_REGS"] >= 24
    assert 3 * 128 * (cfg["CONSUMER_REGS"] + 8) + 128 * 24 > 65536  # 8 more per consumer would not fit
    # shared memory: 2 Q buffers per warpgroup + the K / V ring (16-bit) within sm_90's 227 KB
    d, bn, st = 64, cfg["BLOCK_N"], cfg["STAGES"]
    assert 2 * 3 * 64 * d * 2 + 2 * st * bn * d * 2 + 1024 <= 232448
    # every other variant keeps its two warpgroups and its registers
    for v in ("default", "overlap", "persistent", "persistent_pingpong"):
        for D in (64, 128):
            c = G.config_for(D, v)
            assert "NUM_WG" not in c and c["maxnreg"] == G._MAXNREG and c["CONSUMER_REGS"] == G._CONSUMER_REGS


@pytest.mark.parametrize("D", [128, 256])
def test_other_head_dims_refused_with_reason(D):
    with pytest.raises(ValueError, match="head dim 64 only.*registers"):
        G.config_for(D, "persistent3")
    if G._GLUON_IMPORT_ERROR is None:  # the wrapper refuses before touching the device (CPU tensors here)
        q = torch.randn(1, 2, 8, D, dtype=torch.float16)
        with pytest.raises(ValueError, match="persistent3|CUDA"):
            G.gluon_attention_fwd(q, q, q, variant="persistent3", checked=True)


def test_unknown_variant_and_pingpong_not_mixed():
    with pytest.raises(ValueError, match="unknown variant"):
        G.config_for(64, "persistent4")
    assert not G.config_for(64, "persistent3").get("PINGPONG")


# ---------------------------------------------------------------- CPU: schedule over 192-row tiles


@pytest.mark.parametrize("causal", [False, True])
def test_schedule_covers_every_192_row_item_and_row_once(causal):
    n = 0
    for Sq, Sk, bh in ((1, 1, 1), (77, 333, 2), (191, 191, 3), (192, 192, 1), (193, 50, 2), (300, 100, 2),
                       (1000, 1000, 3), (4096, 4096, 2), (16384, 16384, 1)):
        num_m = -(-Sq // G.rows_per_item("persistent3"))
        for sms in (1, 2, 3, 7, 132):
            sched, P = G.persistent_schedule(num_m, bh, causal, sms, "persistent3")
            assert 1 <= P <= sms and sched in ((0, 1) if causal else (0,))
            items = [x for p in range(P) for x in G.persistent_items(p, P, num_m, bh, sched, causal)]
            assert sorted(items) == [(b, m) for b in range(bh) for m in range(num_m)]
            n += 1
        # every query row of a head lies in exactly one warpgroup of one item; rows >= Sq only in the last tile
        rows = []
        for m in range(num_m):
            for w in range(3):
                first = G.persistent_tile_blocks(m, w, Sq, Sk, causal, "persistent3")[0]
                assert first == 192 * m + 64 * w
                rows += [r for r in range(first, first + 64) if r < Sq]
        assert sorted(rows) == list(range(Sq))
    assert n == 45


@pytest.mark.parametrize("causal", [False, True])
def test_key_block_plan_of_192_row_tiles(causal):
    """The item's key blocks cover every key any of its 192 rows may see (bottom-right causal), and each warpgroup's
    unmasked prefix (n_full) holds only keys every one of its 64 rows sees."""
    bn = G.config_for(64, "persistent3")["BLOCK_N"]
    rng = random.Random(0)
    shapes = [(1, 1), (77, 333), (300, 100), (192, 192), (1000, 1000), (333, 77), (640, 1111)]
    shapes += [(rng.randint(1, 900), rng.randint(1, 900)) for _ in range(20)]
    for Sq, Sk in shapes:
        for m in range(-(-Sq // 192)):
            n_blocks = None
            for w in range(3):
                first, nb, n_full = G.persistent_tile_blocks(m, w, Sq, Sk, causal, "persistent3")
                assert n_blocks in (None, nb)  # the same per item for every warpgroup (shared K / V ring)
                n_blocks = nb
                assert 1 <= nb and 0 <= n_full <= nb
                for r in range(first, first + 64):
                    last = min(Sk - 1, r + Sk - Sq) if causal else Sk - 1  # last visible key of row r
                    if r < Sq and last >= 0:
                        assert last < nb * bn, (Sq, Sk, m, w, r)
                    assert n_full * bn <= max(last + 1, 0), (Sq, Sk, m, w, r)  # unmasked blocks: all visible
            assert (n_blocks - 1) * bn < max(Sk, 1)  # never a block wholly past Sk


# ---------------------------------------------------------------- CPU: barrier protocol with 3 consumers


def test_protocol_model_three_consumers_clean():
    rng = random.Random(7)
    for k in range(300):
        G.persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(1, 9))], 1 + k % 3, seed=k,
                                    n_consumers=3)
    for k in range(30):  # long CTAs through a shallow ring
        G.persistent_protocol_model([rng.randint(1, 8) for _ in range(rng.randint(8, 16))], 2 + k % 2,
                                    seed=1000 + k, n_consumers=3)
    msg = G.check_persistent_schedules_and_protocol(trials=60, n_consumers=(3,))
    assert "3 consumer warpgroups" in msg


@pytest.mark.parametrize("mutation,patterns", [
    ("empty_count_2", ("TMA write into k", "TMA write into v", "wanted", "deadlock")),
    ("q_stride_2", ("TMA write into q", "more arrivals", "wanted")),
    ("no_store_wait", ("under an O store", "overwritten")),
])
def test_protocol_model_catches_planted_bugs_with_three_consumers(mutation, patterns):
    caught = []
    for k in range(200):
        rng = random.Random(k)
        try:
            G.persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(2, 9))], 1 + k % 3, seed=k,
                                        n_consumers=3, mutation=mutation, max_steps=10 ** 5)
        except AssertionError as e:
            caught.append(str(e))
    assert caught and all(any(p in m for p in patterns) for m in caught), caught[:3]
    if mutation != "no_store_wait":  # with two consumers these two are the kernel's correct formulas
        rng = random.Random(1)
        for k in range(50):
            G.persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(2, 9))], 1 + k % 3, seed=k,
                                        n_consumers=2, mutation=mutation)


# ---------------------------------------------------------------- offline sm_90 build (one, to keep CI short)


def test_persistent3_offline_sm90_build():
    """d = 64 causal bf16 (the zigzag schedule): no spills, no C75xx, no register hazard on an in-flight wgmma,
    16 warps, 3 x (S, PV) wgmma groups per step: 1.5x the HGMMA of the 2-warpgroup persistent build, the three
    register counts of the budget (setmaxnreg 24 / 160 / 168), shared memory for 6 Q buffers + the ring."""
    from fxopt.testing import offline_build_json

    rep = offline_build_json(
        "import json, re, fxopt.kernels.attention_gluon as G\n"
        "from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards\n"
        "c = G.compile_offline(64, True, 'bf16', variant='persistent3')\n"
        "s = G.sass_summary(c)\n"
        "use = G._tool('cuobjdump', c.asm['cubin'], '.cubin', '--dump-resource-usage')\n"
        "m = re.search(r'STACK:(\\d+) SHARED:(\\d+) LOCAL:(\\d+)', use)\n"
        "print(json.dumps(dict(spill=s['spill_bytes'], c75=s['c75xx'], hgmma=s['hgmma'], maxreg=s['max_reg_index'],\n"
        "    setmaxnreg=s['setmaxnreg'], stack=int(m.group(1)), local=int(m.group(3)), smem=c.metadata.shared,\n"
        "    warps=c.metadata.num_warps, hazards=len(wgmma_sass_hazards(sass_of(c))))))\n")
    assert rep["spill"] == 0 and rep["stack"] == 0 and rep["local"] == 0 and not rep["c75"], rep
    assert rep["hazards"] == 0 and rep["warps"] == 16 and rep["maxreg"] < 168, rep
    assert {"0x18", "0xa0", "0xa8"} <= set(rep["setmaxnreg"]), rep
    assert rep["hgmma"] == 108, rep  # persistent (2 warpgroups) has 72
    q_ring = 2 * 3 * 64 * 64 * 2 + 2 * 3 * 128 * 64 * 2
    assert q_ring <= rep["smem"] <= q_ring + 2048, rep


# ---------------------------------------------------------------- GPU: against the float64 reference


_inputs = gluon_fwd_inputs


GPU_CASES = {**GLUON_FWD_CASES,  # name: ((B, Hq, Hkv, Sq, Sk), causal)
             "s4096_causal": ((1, 2, 2, 4096, 4096), True),
             "s4096": ((1, 1, 1, 4096, 4096), False)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_persistent3_matches_float64(name, dtype):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")
    (B, Hq, Hkv, Sq, Sk), causal = GPU_CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, 64, dtype)
    ref, ref_lse, fin, lim = gluon_fwd_reference(q, k, v, causal)
    outs = {}
    for num_sms in (None, 3, 1):  # 1 / 3 SMs: many items per CTA (both Q buffers, many ring phases)
        out, lse = outs[num_sms] = G.gluon_attention_fwd(q, k, v, causal=causal, variant="persistent3",
                                                         num_sms=num_sms)
        torch.cuda.synchronize()
        assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, f"num_sms={num_sms}")
    # a tile's arithmetic does not depend on which CTA runs it (the masks' ring shift is exact): bit-identical
    for n in (3, 1):
        assert torch.equal(outs[n][0], outs[None][0]) and torch.equal(outs[n][1], outs[None][1]), n
    out2, none = G.gluon_attention_fwd(q, k, v, causal=causal, variant="persistent3", num_sms=3, write_lse=False)
    assert none is None and torch.equal(out2, outs[3][0])  # lse stores off, the same out


@pytest.mark.gpu
def test_gpu_persistent3_refuses_other_head_dims():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")
    q, k, v = _inputs(1, 2, 2, 64, 64, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 64 only"):
        G.gluon_attention_fwd(q, k, v, variant="persistent3")
    assert math.isfinite(G.gluon_attention_fwd(q[..., :64].contiguous(), k[..., :64].contiguous(),
                                                v[..., :64].contiguous(), variant="persistent3")[1].sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,causal", [(2100, False), (8200, True)])
def test_gpu_op_routes_persistent3(Sq, causal, monkeypatch):
    """The op (``flash_attention_triton``) at d = 64 from the routed lengths runs persistent3 (``_gluon_fwd_variant``)
    and matches the float64 reference; with FXOPT_ATTN_GLUON_PERSISTENT3=0 it runs "persistent", also correct."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")
    from fxopt.kernels import attention as A

    if 64 not in A._GLUON_HEAD_DIMS:
        pytest.skip("d = 64 is not routed to the Gluon forward here (FXOPT_ATTN_GLUON_DIMS)")
    q, k, v = _inputs(1, 2, 1, Sq, Sq, 64, torch.bfloat16)  # GQA 2:1, ragged against 192-row items
    ref, ref_lse, fin, lim = gluon_fwd_reference(q, k, v, causal)
    seen = []
    real = G.gluon_attention_fwd
    monkeypatch.setattr(G, "gluon_attention_fwd", lambda *a, **kw: seen.append(kw["variant"]) or real(*a, **kw))
    for switch, want in (("1", "persistent3"), ("0", "persistent")):
        monkeypatch.setenv("FXOPT_ATTN_GLUON_PERSISTENT3", switch)
        out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
        torch.cuda.synchronize()
        assert seen[-1] == want and not A._GLUON_FAILED
        assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, want)
