"""The W4A16 tuner (fxopt/kernels/w4a16/tuner.py): candidate lists, routes, the tuner's file and the shipped picks.

CPU: the lists are computed for a faked CUDA device (``capability`` or a patched ``torch.cuda``); timing rounds on
fake timers. GPU (``@pytest.mark.gpu``): a real tuning run, its file, and back-to-back timing.
"""
import json
from dataclasses import asdict

import pytest
import torch

import fxopt
from fxopt.kernels import w4a16 as K4
from fxopt.kernels.w4a16 import W4A16Config, common, gemv1, routing, tuner

from w4a16_helpers import assert_close_to_ref, fake_cuda, make_packed, reference


def cands(M, K=1024, N=2048, G=128, dtype=torch.bfloat16, integer_zeros=True, capability=(9, 0), **kw):
    return tuner.candidate_configs(M, N, K, G, 132, integer_zeros=integer_zeros, dtype=dtype,
                                   capability=capability, **kw)


# ------------------------------------------------------------------------------------------------ candidate lists
def test_triton_tiles_respect_group_size_and_zeros():
    for M in (1, 16, 64, 256, 4096):
        for G in (32, 128, 4096):
            for c in tuner.candidate_configs(M, 4096, 4096, G):
                if c.method in ("swapx", "swapd"):
                    assert G % c.block_k == 0 and c.split_k >= 1 and c.pdl
    for M in (16, 32, 64, 128, 256, 4096):
        assert any(c.method == "swapd" for c in tuner.candidate_configs(M, 8192, 8192, 128, integer_zeros=True)), M
        without = tuner.candidate_configs(M, 8192, 8192, 128, integer_zeros=False, routes=routing.Routes(
            dequant_matmul="off"))
        assert without and not any(c.method in ("swapd", "dequant_matmul") for c in without), M
    # swapd needs block_k % 32 == 0: group 16 would force smaller tiles, so no swapd is listed
    assert not any(c.method == "swapd" for c in tuner.candidate_configs(64, 4096, 4096, 16))


def test_gpu_builds_listed_after_the_triton_tiles():
    """On a CUDA device the Triton tiles come first (the default does not change), then Gluon, gemv1, mma; without a
    device (or on the CPU) only the Triton tiles."""
    order = {"swapx": 0, "swapd": 0, "dequant_matmul": 0, "gluon": 1, "gemv1": 2, "mma": 3}
    for M in (1, 2, 4, 8, 16, 32, 64, 128, 256, 4096):
        cpu = tuner.candidate_configs(M, 2048, 1024, 128, dtype=torch.bfloat16, device="cpu")
        assert cpu == tuner.candidate_configs(M, 2048, 1024, 128)
        cs = cands(M)
        assert cs[:len(cpu)] == cpu and [order[c.method] for c in cs] == sorted(order[c.method] for c in cs)
        assert any(c.method == "gluon" for c in cs), M
        assert any(c.method == "gemv1" for c in cs) == (M <= 4), M
        assert any(c.method == "mma" for c in cs) == (M <= 16 and K4.mma.HAS_GLUON), M


def test_gluon_rules():
    """Gluon only on sm_90, bf16, integer zeros, group 128, K and N multiples of 128; main tiles with the
    register-major split workspace where their split epilogue does not spill; the small-M consumer (BN 256,
    deq="xsum") only in the buckets up to 16."""
    from fxopt.kernels.w4a16 import gluon

    for M in (1, 16, 17, 64, 256, 1024):
        g = [c for c in cands(M) if c.method == "gluon"]
        assert g and any(c.regs == "async" for c in g) and any(not c.regs for c in g), M
        for c in g:
            assert c.block_k == 128 and c.kc in (32, 64) and c.split_k == 0 and not c.pdl
            spills = gluon._split_epilogue_spills(c.block_m, c.block_n, *gluon._REGS[c.regs or "default"])
            assert c.ws == ("" if (c.deq or spills) else "regmajor"), c.label()
        small = [c for c in g if c.deq]
        assert (len(small) == 1) == (M <= 16) and all(
            (c.block_m, c.block_n, c.regs, c.deq) == (16, 256, "async", "xsum") for c in small)
    for kw in (dict(dtype=torch.float16), dict(integer_zeros=False), dict(G=64), dict(N=2048 + 64),
               dict(capability=(8, 9)), dict(capability=(10, 0))):
        assert not any(c.method == "gluon" for c in cands(64, **kw)), kw


def test_gemv1_rules():
    """gemv1 for the M buckets up to 4 on CUDA devices, last but mma, with a one-wave split; the K tile follows the
    group, warps <= packed rows per tile."""
    for M in (1, 2, 3, 4):
        g = [c for c in cands(M, 8192, 8192) if c.method == "gemv1"]
        assert g and any(c.pdl for c in g) == (M == 1)
        for c in g:
            assert c.block_n in (128, 256) and c.block_k == 128 and 1 <= c.split_k <= 64 and c.prefetch == 1
            assert -(-8192 // c.block_n) * c.split_k <= 2 * 132 * 6  # about one wave
    for G in (32, 64, 4096):
        for c in cands(1, 4096, 4096, G):
            if c.method == "gemv1":
                assert c.block_k == min(128, G) and c.num_warps <= c.block_k // 8


def test_one_wave_split():
    # 8192 x 28672, BN 256: 112 column tiles x 64 K tiles on 132 SMs x 4 CTAs: one wave of 16 tiles (split 4)
    assert common.one_wave_split(112, 64, 528) == 4
    assert common.one_wave_split(32, 64, 528) == 16
    for n_tiles, k_tiles, slots in ((1, 1, 528), (43, 32, 528), (16, 86, 396), (7, 3, 10)):
        s = common.one_wave_split(n_tiles, k_tiles, slots)
        assert 1 <= s <= k_tiles and common.balanced_split(k_tiles, s)[0] == s


def test_dequant_matmul_routes():
    """"auto": no candidate up to M = 256 writes a 16-bit copy of the weight and a fused kernel is always listed;
    above 256 dequant + cuBLAS comes first (the untuned default). "off": fused kernels only; "on": from M = 33."""
    auto, off, on = (routing.Routes(dequant_matmul=v) for v in ("auto", "off", "on"))
    for M in (1, 16, 64, 128, 256, 1024, 4096):
        for iz in (True, False):
            cs = tuner.candidate_configs(M, 2048, 1024, 128, integer_zeros=iz, routes=auto)
            assert any(c.method != "dequant_matmul" for c in cs), (M, iz)
            assert (cs[0].method == "dequant_matmul") == (M > 256), (M, iz)
            assert all(c.method != "dequant_matmul" for c in cs[1:]), (M, iz)
            cs = tuner.candidate_configs(M, 2048, 1024, 128, integer_zeros=iz, routes=off)
            assert cs and all(c.method != "dequant_matmul" for c in cs), (M, iz)
    assert tuner.candidate_configs(4096, 2048, 1024, 128, routes=on)[0].method == "dequant_matmul"
    assert any(c.method == "dequant_matmul" for c in tuner.candidate_configs(64, 2048, 1024, 128, routes=on))
    assert all(c.method != "dequant_matmul" for c in tuner.candidate_configs(16, 2048, 1024, 128, routes=on))
    with pytest.raises(ValueError, match="dequant_matmul"):
        routing.Routes(dequant_matmul="1")


def test_routes_switch_builds_and_restore(monkeypatch):
    """``routes()`` changes the active routes for a block and restores them; each switch takes its build off the
    list and leaves the others as they were."""
    fake_cuda(monkeypatch)
    full = tuner.candidate_configs(1, 8192, 8192, 128, dtype=torch.bfloat16, device="cuda")
    for name, method in (("gluon", "gluon"), ("mma", "mma"), ("gemv1", "gemv1")):
        with K4.routes(**{name: False}) as r:
            assert routing.active() == r and getattr(r, name) is False
            cut = tuner.candidate_configs(1, 8192, 8192, 128, dtype=torch.bfloat16, device="cuda")
        assert cut == [c for c in full if c.method != method]
        assert routing.active() == routing.Routes()
    with pytest.raises(TypeError):
        with K4.routes(nonsense=True):
            pass
    assert routing.active() == routing.Routes()


def test_config_options_reach_the_routes():
    """``fxopt.Config.kernels`` fields are validated options; the W4A16 pass makes them the active routes."""
    cfg = fxopt.Config.from_options({"kernels.w4a16_dequant_matmul": "off", "kernels": {"w4a16_mma": False}})
    assert cfg.kernels.w4a16_dequant_matmul == "off" and cfg.kernels.w4a16_mma is False
    with pytest.raises(ValueError, match="valid choices"):
        fxopt.Config.from_options({"kernels.w4a16_dequant_matmul": "1"})
    before = routing.active()
    try:
        routing.use_config(cfg.kernels)
        assert routing.active() == routing.Routes(dequant_matmul="off", mma=False)
        with K4.routes(mma=True) as r:  # a block holds its routes, also across a compile's configuration
            routing.use_config(fxopt.Config().kernels)
            assert routing.active() == r == routing.Routes(dequant_matmul="off")
        assert routing.active() == routing.Routes()
    finally:
        routing._CONFIGURED[0] = before


def test_interpreter_and_retired_config_fields():
    assert tuner.interpreter_config(2, 128, 128).method == "swapx"
    cfg = W4A16Config(method="mma", block_m=8, block_n=128, split_k=4, num_stages=1, pdl=True)
    d = asdict(cfg)
    assert common.config_from_dict(d) == cfg
    assert common.config_from_dict(dict(d, code_dot=True, group_m=8, l2_ahead=0)) == cfg  # fields no build uses
    assert common.config_from_dict(dict(d, l2_ahead=4)) is None  # a build that is gone


# ------------------------------------------------------------------------------------------------ the tuner
def test_tuner_drops_a_build_that_disagrees(interpret_device, monkeypatch):
    """The tuner's safety net: a gemv1 config must match the default config's output before it is timed."""
    K, N = 256, 128
    qweight, scales, zeros, _ = make_packed(K, N, 128, torch.float16, interpret_device, seed=63)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(64)).half().to(interpret_device)
    default = tuner.interpreter_config(2, K, 128)
    cfg = W4A16Config(block_n=256, block_k=128, split_k=2, method="gemv1")
    assert tuner._agrees_with_default(x, qweight, scales, zeros, 128, None, cfg, default)
    real = gemv1.launch_gemv1
    monkeypatch.setattr(tuner, "launch_gemv1", lambda *a: real(*a) * 1.1)
    assert not tuner._agrees_with_default(x, qweight, scales, zeros, 128, None, cfg, default)


def test_tuner_confirms_near_equal_candidates():
    """Two rounds: every candidate once, then those within 8% of the best (at most four) again with more repetitions;
    the second round decides. A candidate that raises is skipped; none timed -> (first, inf)."""
    names = ["a", "b", "c", "d", "e", "f"]
    first = {"a": 10.0, "b": 10.5, "c": 10.7, "d": 20.0, "e": 10.2, "f": None}
    final = {"a": 10.4, "b": 9.9, "c": 10.1, "e": 10.3}
    calls = []

    def time_us(c, reps):
        calls.append((c, reps))
        if first[c] is None:
            raise RuntimeError("out of shared memory")
        return first[c] if reps == tuner._FIRST_ROUND_REPS else final[c]

    assert tuner._pick_fastest(names, time_us) == ("b", 9.9)
    assert sorted(c for c, r in calls if r == tuner._FINAL_ROUND_REPS) == ["a", "b", "c", "e"]
    calls.clear()
    assert tuner._pick_fastest(["a", "d"], time_us) == ("a", 10.0)
    assert all(r == tuner._FIRST_ROUND_REPS for _, r in calls)
    assert tuner._pick_fastest(["f"], time_us) == ("f", float("inf"))


def test_weight_copies_and_timing_in_the_key():
    qweight, scales, zeros, _ = make_packed(256, 128, 128, torch.float16, seed=70)
    copies = tuner._weight_copies(qweight, scales, zeros, 1 << 30)
    assert 2 <= len(copies) <= 8 and copies[0][0] is qweight
    for q, s, z in copies[1:]:
        assert q.data_ptr() != qweight.data_ptr() and torch.equal(q, qweight)
        assert torch.equal(s, scales) and torch.equal(z, zeros)
    assert tuner._weight_copies(qweight, scales, zeros, 0) == []
    cs = tuner.candidate_configs(1, 8192, 8192, 128)
    # the timing method is hashed with the labels: a bucket timed back to back never shares a digest with a flushed one
    assert (tuner.shape_key(torch.bfloat16, 16, 8192, 8192, 128, False, True, cs).split("|")[1]
            != tuner.shape_key(torch.bfloat16, 32, 8192, 8192, 128, False, True, cs).split("|")[1])


def test_tuner_file_round_trip_and_guards(tmp_path, monkeypatch):
    """A stored pick comes back for the same key and candidate list; another GPU model, another candidate list, a
    pick no longer listed or a corrupt file give None (the tuner times again); "0" turns the file off."""
    path = str(tmp_path / "sub" / "tuned.json")
    key = (0, torch.bfloat16, 64, 8192, 8192, 128, False, True, routing.Routes())
    cs = tuner.candidate_configs(64, 8192, 8192, 128)
    pick = cs[2]
    dkey = tuner._tune_disk_key("NVIDIA H200", key, cs)
    assert tuner._tune_disk_load(path, dkey, cs) is None
    tuner._tune_disk_store(path, dkey, pick, 27.0)
    assert tuner._tune_disk_load(path, dkey, cs) == pick
    assert tuner._tune_disk_load(path, tuner._tune_disk_key("NVIDIA H100", key, cs), cs) is None
    assert tuner._tune_disk_key("NVIDIA H200", key, cs[:-1]) != dkey
    assert tuner._tune_disk_load(path, dkey, [c for c in cs if c != pick]) is None
    dkey2 = tuner._tune_disk_key("NVIDIA H200", (0, torch.bfloat16, 128) + key[3:], cs)
    tuner._tune_disk_store(path, dkey2, cs[0], 40.0)  # merged, not overwritten
    assert tuner._tune_disk_load(path, dkey, cs) == pick and tuner._tune_disk_load(path, dkey2, cs) == cs[0]
    with open(path, "w") as f:
        f.write("{not json")
    assert tuner._tune_disk_load(path, dkey, cs) is None
    tuner._tune_disk_store(path, dkey, pick, 27.0)  # a corrupt file is rewritten
    assert tuner._tune_disk_load(path, dkey, cs) == pick
    monkeypatch.setenv("FXOPT_W4A16_TUNE_CACHE", "0")
    assert fxopt.env.w4a16_tune_cache() is None


def test_shipped_picks_export_round_trip(tmp_path, monkeypatch):
    cs = tuner.candidate_configs(1, 4096, 4096, 128, dtype=torch.bfloat16)
    dkey = tuner._tune_disk_key("NVIDIA H200", (0, torch.bfloat16, 1, 4096, 4096, 128, False, True), cs)
    skey = tuner._shipped_key(dkey)
    assert "torch " in dkey and "triton " in dkey
    assert skey.startswith("NVIDIA H200|") and not any(v in skey for v in ("torch ", "triton ", "fxopt "))
    assert skey.split("|")[-2:] == dkey.split("|")[-2:]
    monkeypatch.setattr(tuner, "_TIMED_HERE", {skey: (cs[-1], 12.5)})
    path = str(tmp_path / "picks.json")
    assert K4.export_picks(path) == 1
    assert tuner._tune_disk_load(path, skey, cs) == cs[-1]
    assert tuner._tune_disk_load(path, skey, cs[:-1]) is None


def test_shipped_picks_match_todays_candidate_lists():
    """Every shipped pick's key is the digest of the candidate list an H200 (132 SMs, sm_90) lists today for its
    shape under the default routes, and its config is one of those candidates: a change of a default list that
    does not re-key the file fails here instead of silently retiming every shape."""
    with open(tuner.SHIPPED_PICKS) as f:
        table = json.load(f)
    assert table
    for key, entry in table.items():
        device, shape, _ = key.split("|")
        assert device == "NVIDIA H200" and not any(v in key for v in ("torch ", "triton ", "fxopt ")), key
        dtype, m, k, n, g, bias, intz = shape.split()
        M, K, N, G = (int(v[1:]) for v in (m, k, n, g))
        cs = tuner.candidate_configs(M, N, K, G, 132, integer_zeros=intz == "intz1", dtype=getattr(torch, dtype),
                                     capability=(9, 0), routes=routing.Routes())
        want = tuner.shape_key(getattr(torch, dtype), common.m_bucket(M), K, N, G, bias == "bias1", intz == "intz1",
                               cs)
        assert key == f"{device}|{want}", (key, want)
        cfg = common.config_from_dict(entry["config"])
        assert cfg in cs and cfg.label() == entry["label"], key


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_tuner_file_reused_by_a_fresh_process_table(monkeypatch, tmp_path):
    """Tune once (writes the file), forget the in-process table, then the same shape is served from the file without
    timing a single candidate, also under CUDA-graph capture."""
    monkeypatch.setenv("FXOPT_W4A16_TUNE_CACHE", str(tmp_path / "tuned.json"))
    monkeypatch.delenv("FXOPT_NO_TUNE", raising=False)
    qweight, scales, zeros, G = make_packed(1024, 2048, 128, torch.bfloat16, "cuda", seed=5)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(tuner, "_TUNED", {})
    first = tuner.choose_config(x, qweight, scales, zeros, 128)
    assert (tmp_path / "tuned.json").exists()
    monkeypatch.setattr(tuner, "_TUNED", {})

    def no_timing(*a, **k):
        raise AssertionError("timed a candidate although the file holds the pick")

    monkeypatch.setattr(tuner, "_bench_us", no_timing)
    assert tuner.choose_config(x, qweight, scales, zeros, 128) == first
    monkeypatch.setattr(tuner, "_TUNED", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuner.choose_config(x, qweight, scales, zeros, 128) == first


@pytest.mark.gpu
def test_gpu_tuner_streamed_small_m(monkeypatch, tmp_path):
    """At M <= 16 the tuner times candidates back to back over weight copies; its pick computes the reference result
    and the back-to-back timer gives a positive per-call time; other routes tune their own pick."""
    monkeypatch.setenv("FXOPT_W4A16_TUNE_CACHE", str(tmp_path / "tuned.json"))
    monkeypatch.delenv("FXOPT_NO_TUNE", raising=False)
    monkeypatch.setattr(tuner, "_TUNED", {})
    dtype = torch.bfloat16
    qweight, scales, zeros, G = make_packed(1024, 2048, 128, dtype, "cuda", seed=71)
    zeros = zeros.round()
    x = torch.randn(2, 1024, device="cuda", dtype=dtype)
    copies = tuner._weight_copies(qweight, scales, zeros, 1 << 30)
    assert len(copies) >= 2
    cfg = tuner.choose_config(x, qweight, scales, zeros, G)
    t = tuner.bench_streamed_us(lambda w: tuner.launch(x, *w, G, None, cfg), copies, 3)
    assert 0 < t < 1e4
    assert_close_to_ref(K4.w4a16_matmul(x, qweight, scales, zeros, G, config=cfg),
                        reference(x, qweight, scales, zeros, G), dtype)
    with K4.routes(mma=False, gemv1=False, gluon=False):
        other = tuner.choose_config(x, qweight, scales, zeros, G)
    assert other.method in ("swapx", "swapd")
