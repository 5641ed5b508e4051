"""persistent=True: the persistent Gluon fp8 attention forward (fxopt/kernels/fp8_attention_gluon.py,
``_fp8_fa3_fwd_persistent_kernel``; module docstring "persistent").

* CPU: host-argument checks (clear ValueErrors for unsupported head dims, ring depths that do not fit 227 KB, and
  combinations the persistent kernel does not implement: overlap, pingpong; num_sms / stages without persistent),
  the schedule it reuses from attention_gluon.py covers every work item once, and the CPU model of its barrier
  protocol (random interleavings; broken variants of the protocol are caught).
* Offline sm_90 builds (``offline_build_json``; skipped without the bundled ptxas / cuobjdump): no spills, STACK 0,
  no C75xx, zero wgmma hazards, registers within the consumer budget, shared memory within 227 KB, the same QGMMA
  count and about the same main-loop instruction counts as the default (non-persistent) build.
* GPU (``@pytest.mark.gpu``): out and lse bit-identical (torch.equal) to the default build on the fp8 tests' cases
  (GQA, Sq != Sk with bottom-right causal alignment, rows with no visible key, lse on / off, fp16), with num_sms
  1 / 3 (many items per CTA) and the device's SM count.
"""
from __future__ import annotations

import random

import pytest
import torch

from fxopt.kernels import fp8_attention_gluon as G

pytestmark = pytest.mark.skipif(G._GLUON_IMPORT_ERROR is not None, reason="triton gluon unavailable")


# ---------------------------------------------------------------- CPU: host arguments


def test_persistent_default_off_and_combinations():
    assert G.PERSISTENT_DEFAULT is False
    assert G.resolve_persistent() is False and G.resolve_persistent(True) is True
    with pytest.raises(ValueError, match="overlap"):
        G.resolve_persistent(True, overlap=True)
    with pytest.raises(ValueError, match="pingpong"):
        G.resolve_persistent(True, pingpong=True)
    with pytest.raises(ValueError, match="num_sms"):
        G.resolve_persistent(False, num_sms=4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_sms"):
            G.resolve_persistent(True, num_sms=bad)
    with pytest.raises(ValueError, match="stages"):
        G.resolve_persistent(None, stages=4)
    assert G.resolve_persistent(True, overlap=False, pingpong=False, num_sms=3, stages=3) is True


def test_persistent_config_and_shared_memory_budget():
    for d in (64, 128):
        cfg = G.persistent_config_for(d)
        assert cfg["STAGES"] == G._PERSISTENT_STAGES[d] and cfg["BLOCK_N"] == G.QBLOCK
        assert G.persistent_smem_bytes(d, cfg["STAGES"]) <= G._SMEM_LIMIT
        # every field but the ring depth is the default build's
        assert {k: v for k, v in cfg.items() if k != "STAGES"} == \
            {k: v for k, v in G.config_for(d).items() if k != "STAGES"}
    # d = 128: 4 Q (8 KB) + STAGES x (16 KB K + 16 KB V^T) + 2 O tiles (16 KB, bf16) + barriers
    assert G.persistent_smem_bytes(128, 4) == 4 * 8192 + 4 * 32768 + 2 * 16384 + 24 * 8
    assert G.persistent_config_for(128, 5)["STAGES"] == 5  # 229,536 B: still fits
    with pytest.raises(ValueError, match="shared memory"):
        G.persistent_config_for(128, 6)
    with pytest.raises(ValueError, match="head dim 96"):
        G.persistent_config_for(96)
    for bad in (1, 0, 3.0, True):
        with pytest.raises(ValueError, match="stages"):
            G.persistent_config_for(128, bad)


def _cpu_quantized(B=1, Hq=2, Hkv=1, Sq=100, Sk=130, D=128):
    pad = lambda s: (s + 127) // 128 * 128  # noqa: E731
    f8 = torch.float8_e4m3fn
    qq = torch.zeros(B, Hq, pad(Sq), D, dtype=f8)
    kq = torch.zeros(B, Hkv, pad(Sk), D, dtype=f8)
    vt = torch.zeros(B, Hkv, D, pad(Sk), dtype=f8)
    qs = torch.ones(B * Hq, pad(Sq) // 128)
    ks = torch.ones(B * Hkv, pad(Sk) // 128)
    return qq, qs, kq, ks, vt, ks.clone()


@pytest.mark.parametrize("kw,match", [
    (dict(persistent=True, overlap=True), "overlap"),
    (dict(persistent=True, pingpong=True), "pingpong"),
    (dict(num_sms=2), "num_sms"),
    (dict(persistent=False, stages=3), "stages"),
    (dict(persistent=True, stages=6), "shared memory"),
    (dict(persistent=True, num_sms=0), "num_sms"),
])
def test_quantized_wrapper_refuses_unsupported_combinations(kw, match):
    qq, qs, kq, ks, vt, vs = _cpu_quantized()
    with pytest.raises(ValueError, match=match):
        G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(1, 2, 100, 128), seq_k=130, n_kv_heads=1,
                                        out_dtype=torch.bfloat16, **kw)


def test_quantized_wrapper_refuses_head_dim_with_persistent():
    qq, qs, kq, ks, vt, vs = _cpu_quantized(D=96)
    with pytest.raises(ValueError, match="head dim 96"):
        G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, shape_q=(1, 2, 100, 96), seq_k=130, n_kv_heads=1,
                                        out_dtype=torch.bfloat16, persistent=True)


def test_compile_offline_refuses_persistent_combinations():
    with pytest.raises(ValueError, match="overlap"):
        G.compile_offline(128, False, persistent=True, overlap=True)
    with pytest.raises(ValueError, match="pingpong"):
        G.compile_offline(128, True, persistent=True, pingpong=True)
    with pytest.raises(ValueError, match="shared memory"):
        G.compile_offline(128, True, persistent=True, stages=7)


# ---------------------------------------------------------------- CPU: schedule and protocol


def test_schedule_covers_every_item_once():
    """The launch's (SCHED, P) from ``persistent_schedule`` and the items ``_fa_sched_item`` hands each CTA (CPU
    mirror ``persistent_items``) cover every (batch * head, query block) exactly once, for the grids the GPU tests
    use (num_sms 1 / 3 / 132) and a sweep."""
    n = 0
    for num_m in (1, 2, 3, 7, 32):
        for num_bh in (1, 2, 5, 8, 16):
            for causal in (False, True):
                for sms in (1, 2, 3, 132):
                    sched, P = G.persistent_schedule(num_m, num_bh, causal, sms)
                    assert 1 <= P <= sms and sched in ((0, 1) if causal else (0,))
                    seen = [x for p in range(P) for x in G.persistent_items(p, P, num_m, num_bh, sched, causal)]
                    assert sorted(seen) == [(b, m) for b in range(num_bh) for m in range(num_m)]
                    n += 1
    assert n == 200


def test_protocol_model_random_interleavings():
    msg = G.check_persistent_protocol(trials=400, seed=3)
    assert "400 random interleavings" in msg
    rng = random.Random(5)
    for k in range(40):  # long CTAs: many items through a shallow ring
        G.persistent_protocol_model([rng.randint(1, 8) for _ in range(rng.randint(8, 16))], 2 + k % 2, seed=100 + k)


@pytest.mark.parametrize("mutation,match", [("early_q_release", "Q of item"), ("no_store_wait", "O tile"),
                                            ("no_scale_shift", "scale index")])
def test_protocol_model_catches_broken_protocols(mutation, match):
    caught = []
    for k in range(300):
        rng = random.Random(k)
        try:
            G.persistent_protocol_model([rng.randint(1, 6) for _ in range(rng.randint(2, 9))], 2 + k % 4, seed=k,
                                        mutation=mutation)
        except AssertionError as e:
            caught.append(str(e))
    assert caught and all(match in m for m in caught), caught[:3]


# ---------------------------------------------------------------- offline sm_90 builds

_BUILD_CODE = r'''
import json, re
from fxopt.kernels import fp8_attention_gluon as G
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import wgmma_sass_hazards

def build(D, causal, ot, wl, persistent, stages=None):
    c = G.compile_offline(D, causal, ot, wl, persistent=persistent, stages=stages)
    use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", use)
    sass = _tool("nvdisasm", c.asm["cubin"], ".cubin")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    ss = G.sass_summary(c)
    return dict(reg=int(m.group(1)), stack=int(m.group(2)), local=int(m.group(4)), smem=c.metadata.shared,
                spill=sum(int(x) for x in re.findall(r"(\d+) bytes spill", ptxas)),
                c75=sorted(set(re.findall(r"C75[0-9][0-9]", ptxas))), hazards=len(wgmma_sass_hazards(sass)),
                max_reg=ss["max_reg_index"], qgmma=ss["qgmma"], loops=[lp["n"] for lp in G.main_loops(sass)],
                ex2=[e["ex2"] for e in G.ex2_under_pv(sass)])

out = {}
for D, causal, ot, wl, stages in CASES:
    out[f"{D}_{int(causal)}_{ot}_{int(wl)}_default"] = build(D, causal, ot, wl, False)
    out[f"{D}_{int(causal)}_{ot}_{int(wl)}_persistent"] = build(D, causal, ot, wl, True, stages)
print(json.dumps(out))
'''


@pytest.mark.parametrize("D,causal,ot,wl,stages", [(128, True, "bf16", True, None), (64, True, "fp16", False, None)])
def test_offline_sm90_persistent_builds(D, causal, ot, wl, stages):
    from fxopt.testing import offline_build_json

    res = offline_build_json(f"CASES = [({D}, {causal}, {ot!r}, {wl}, {stages})]\n" + _BUILD_CODE)
    base = res[f"{D}_{int(causal)}_{ot}_{int(wl)}_default"]
    r = res[f"{D}_{int(causal)}_{ot}_{int(wl)}_persistent"]
    assert r["stack"] == 0 and r["local"] == 0 and r["spill"] == 0, r
    assert r["c75"] == [] and r["hazards"] == 0, r
    assert r["reg"] == base["reg"] and r["max_reg"] < G._CONSUMER_REGS, r
    st = stages or G._PERSISTENT_STAGES[D]
    assert G.persistent_smem_bytes(D, st, 2) <= r["smem"] <= G._SMEM_LIMIT, r
    assert r["qgmma"] == base["qgmma"]
    # consumer 0 / 1 x unmasked / masked loops, each about the default build's size, the same exp2s per step
    assert len(r["loops"]) == len(base["loops"]) == 4, (r["loops"], base["loops"])
    # (causal masked loops: 759 / 761 against 767 / 790 at d 128, the shifted mask bounds are hoisted differently)
    for n, nb in zip(r["loops"], base["loops"]):
        assert abs(n - nb) <= max(16, 0.05 * nb), (r["loops"], base["loops"])
    assert r["ex2"] == base["ex2"]


# ---------------------------------------------------------------- GPU: bit-identical to the default build


def _rand(*shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale, hadamard): the fp8 tests' cases (tests/test_fp8_attention.py)
GPU_CASES = [
    (2, 8, 2, 300, 333, 128, torch.bfloat16, False, None, True),
    (2, 8, 2, 300, 300, 128, torch.bfloat16, True, None, True),
    (2, 8, 2, 300, 333, 64, torch.bfloat16, False, None, True),
    (2, 8, 2, 300, 300, 64, torch.bfloat16, True, None, True),
    (2, 4, 2, 260, 300, 128, torch.bfloat16, True, None, True),   # Sq < Sk causal: bottom-right aligned
    (2, 4, 2, 260, 300, 64, torch.bfloat16, False, None, True),
    (1, 4, 4, 77, 130, 128, torch.float16, False, 0.1, False),
    (1, 4, 4, 77, 130, 128, torch.float16, True, 0.1, False),
    (1, 4, 4, 200, 130, 128, torch.float16, True, None, False),   # Sq > Sk causal: rows with no visible key
    (1, 2, 1, 1000, 1000, 128, torch.bfloat16, True, None, True),  # several key blocks per item
    (1, 3, 1, 640, 1100, 64, torch.bfloat16, True, None, True),
]


def _gpu_ok():
    if not torch.cuda.is_available() or G.device_capability(torch.device("cuda"))[0] != 9:
        pytest.skip("needs sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"_c{int(c[7])}")
def test_persistent_bit_identical_gpu(case):
    _gpu_ok()
    B, Hq, Hkv, Sq, Sk, D, dtype, causal, scale, hadamard = case
    q = _rand(B, Hq, Sq, D, seed=Sq + D, dtype=dtype)
    k = _rand(B, Hkv, Sk, D, seed=Sk + 1, dtype=dtype)
    v = _rand(B, Hkv, Sk, D, seed=Sk + 2, dtype=dtype)
    qq, qs, kq, ks, vt, vs = G.fp8_gluon_quantize(q, k, v, hadamard, 3)
    kw = dict(shape_q=(B, Hq, Sq, D), seq_k=Sk, n_kv_heads=Hkv, out_dtype=dtype, is_causal=causal, scale=scale)
    ref, ref_lse = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, return_lse=True, **kw)
    ref_nolse = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, **kw)
    assert torch.equal(ref, ref_nolse)
    if causal and Sq > Sk:
        assert (ref[:, :, :Sq - Sk] == 0).all() and torch.isinf(ref_lse[:, :, :Sq - Sk]).all()
    exact = G._fp8.attention_float64(q, k, v, is_causal=causal, scale=scale)
    assert ((ref.double() - exact).norm() / exact.norm()).item() < 0.08  # the reference build is sane
    for num_sms in (1, 3, None):
        out, lse = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, return_lse=True, persistent=True,
                                                   num_sms=num_sms, **kw)
        assert torch.equal(out, ref), (num_sms, (out.float() - ref.float()).abs().max().item())
        assert torch.equal(lse, ref_lse), num_sms
        out2 = G.fp8_gluon_attention_quantized(qq, qs, kq, ks, vt, vs, persistent=True, num_sms=num_sms, **kw)
        assert torch.equal(out2, ref), num_sms


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_persistent_ring_depths_bit_identical_gpu(stages):
    _gpu_ok()
    q = _rand(1, 4, 900, 128, seed=1)
    k = _rand(1, 2, 1000, 128, seed=2)
    v = _rand(1, 2, 1000, 128, seed=3)
    for causal in (False, True):
        ref = G.fp8_gluon_attention(q, k, v, causal)
        out = G.fp8_gluon_attention(q, k, v, causal, persistent=True, num_sms=3, stages=stages)
        assert torch.equal(out, ref), (stages, causal)
