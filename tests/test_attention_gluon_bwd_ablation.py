"""Timing-only ablation builds of the Gluon attention backward (``ABLATE`` constexpr of ``_fa3_bwd_kernel_v1``,
``gluon_attention_bwd(..., ablate=mask)``). The ablations leave results WRONG on purpose, so there is no
GPU correctness test here: the GPU side is timing only (docs/kernels.md, "Timing ablations").

CPU: the gate (no ablation without ``FXOPT_ATTN_GLUON_BWD_ABLATE_OK=1``, only known bits, only the split-dQ kernel),
ABLATE = 0 as every entry point's default, and the offline sm_90 builds (Triton's bundled ptxas; skipped without
it): each bit builds without new spills, serialisation warnings or wgmma hazards, and removes exactly the
instruction class it names from the step loops. d = 256: the same gate and bits for
``_fa3_bwd_kernel_d256`` (any variant: every variant runs it), and its offline builds (bit 1 jumps over every
REDG, bit 4 removes them with the dQ HGMMA, bit 8 the MUFU.EX2)."""
import inspect

import pytest
import torch

GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")


def _cpu_inputs(d: int = 128):
    q, k, v, dout, out = (torch.randn(1, 2, 64, d) for _ in range(5))
    return dout, q, k, v, out, torch.randn(1, 2, 64)


def test_ablate_gate(monkeypatch):
    monkeypatch.delenv(GB.ABLATE_ENV, raising=False)
    for mask in (1, 16, 17):
        with pytest.raises(ValueError, match="timing-only ablation, results are wrong"):
            GB.gluon_attention_bwd(*_cpu_inputs(), variant=3, ablate=mask)
    monkeypatch.setenv(GB.ABLATE_ENV, "0")
    with pytest.raises(ValueError, match="timing-only ablation, results are wrong"):
        GB.gluon_attention_bwd(*_cpu_inputs(), variant=3, ablate=1)
    monkeypatch.setenv(GB.ABLATE_ENV, "1")
    with pytest.raises(ValueError, match="bit mask"):
        GB.gluon_attention_bwd(*_cpu_inputs(), variant=3, ablate=32)
    with pytest.raises(ValueError, match="split-dQ kernel"):
        GB.gluon_attention_bwd(*_cpu_inputs(), variant=0, ablate=1)
    # with the gate open, a valid mask passes the ablation check and fails later on the inputs (CPU tensors), and
    # ablate=0 never mentions the ablation
    for mask in (0, 1):
        with pytest.raises(ValueError) as e:
            GB.gluon_attention_bwd(*_cpu_inputs(), variant=3, ablate=mask)
        assert "ablation" not in str(e.value) and "bit mask" not in str(e.value), e.value
    monkeypatch.delenv(GB.ABLATE_ENV)
    with pytest.raises(ValueError, match="timing-only"):
        GB.compile_offline(128, False, "bf16", variant=3, ablate=4)


def test_ablate_gate_d256(monkeypatch):
    """d = 256: the same gate and bits; every variant (the op runs the d = 256 kernel for all) takes a mask."""
    monkeypatch.delenv(GB.ABLATE_ENV, raising=False)
    for variant in (0, 3, 5):
        with pytest.raises(ValueError, match="timing-only ablation, results are wrong"):
            GB.gluon_attention_bwd(*_cpu_inputs(256), variant=variant, ablate=1)
    with pytest.raises(ValueError, match="timing-only"):
        GB.compile_offline(256, False, "bf16", ablate=1)
    monkeypatch.setenv(GB.ABLATE_ENV, "1")
    for bad in (32, -1, 1.0):
        with pytest.raises(ValueError, match="bit mask"):
            GB.gluon_attention_bwd(*_cpu_inputs(256), ablate=bad)
    with pytest.raises(ValueError, match="split-dQ kernel"):   # d = 96: no kernel with an ablation
        GB.gluon_attention_bwd(*_cpu_inputs(96), variant=3, ablate=1)
    for variant in (0, 3, 5):
        for mask in (0, 1, 31):  # passes the ablation check, fails later on the CPU inputs
            with pytest.raises(ValueError) as e:
                GB.gluon_attention_bwd(*_cpu_inputs(256), variant=variant, ablate=mask)
            assert "ablation" not in str(e.value) and "bit mask" not in str(e.value), e.value
            assert "CUDA" in str(e.value), e.value


def test_ablate_default_is_the_real_kernel():
    """Every JIT function on the path takes ABLATE = 0 by default (what the op's launch binds: it never passes it),
    and the offline compile passes 0 explicitly (an offline compile does not bind defaults); the bits are the five
    of the brief."""
    assert sorted(GB.ABLATE_BITS) == [1, 2, 4, 8, 16] == sorted(GB.ABLATE_BITS_D256)
    for f in (GB._fa3_bwd_kernel_v1, GB._bwd_consumer_v1_wg0, GB._bwd_consumer_v1_wg1, GB._bwd_consumer_v1,
              GB._bwd_step_v1, GB._fa3_bwd_kernel_d256, GB._bwd_consumer_d256_wg0, GB._bwd_consumer_d256_wg1,
              GB._bwd_consumer_d256, GB._bwd_step_d256):
        fn = getattr(f, "fn", f)
        assert inspect.signature(fn).parameters["ABLATE"].default == 0, fn.__name__
    import fxopt.kernels.attention as A

    assert "ablate" not in inspect.getsource(A), "the op route must never reach an ablation"


# The offline census of timing-only ablation builds, run in a subprocess (``offline_build_json``): per mask, stack,
# C75xx warnings, wgmma hazards, REDG count, REDGs inside a short predicated forward branch (jumped over when the
# predicate holds; HOP = the longest branch counted) and the step loops (``sass_step_loops``).
_ABLATION_CENSUS = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
rep = {}
for mask in MASKS:
    c = BUILD
    sass = sass_of(c)
    use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
    ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
    ins = re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+([^;]*);", sass)
    # REDG inside the span of a short predicated forward branch (jumped over when the predicate holds)
    spans = []
    for a, t in ins:
        m = re.match(r"@!?P\\d\\s+BRA\\s+(?:`\\(\\S+\\)\\s*)?(0x[0-9a-f]+)", t.strip())
        if m and 0 < int(m.group(1), 16) - int(a, 16) <= HOP:  # short hops only
            spans.append((int(a, 16), int(m.group(1), 16)))
    skipped = sum(1 for a, t in ins if "REDG" in t and any(lo < int(a, 16) < hi for lo, hi in spans))
    loops = [lp for lp in GB.sass_step_loops(sass) if lp["hgmma"]]
    rep[mask] = dict(stack=int(re.search(r"STACK:(\\d+)", use).group(1)),
                     c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))), hazards=len(wgmma_sass_hazards(sass)),
                     redg=len(re.findall(r"REDG", sass)), redg_skipped=skipped, loops=loops)
print(json.dumps(rep))
"""


def _ablation_census(build: str, masks: tuple, hop: int) -> dict:
    from fxopt.testing import offline_build_json

    code = _ABLATION_CENSUS.replace("BUILD", build).replace("MASKS", repr(masks)).replace("HOP", hex(hop))
    return offline_build_json(code, FXOPT_ATTN_GLUON_BWD_ABLATE_OK="1")


def test_ablation_offline_builds():
    """bf16, d = 128, variant 3, non-causal: the real kernel (ABLATE = 0) and each bit alone. Per step loop of each
    consumer warpgroup (``sass_step_loops``): bit 1 keeps the dQ wgmma (24 SS + 8 RS HGMMA) and the 16 REDG, but
    each REDG is jumped over by a predicated branch (the reductions are predicated on an opaque zero: a sink that
    ignores the values let ptxas delete the dQ wgmma); bit 2 removes MEMBAR + FENCE; bit 4 the 8 dQ HGMMA and the
    REDG; bit 8 the 32 MUFU.EX2 (the FFMA stays); bit 16 one mbarrier wait. No new spills beyond 8 B of stack, no
    local memory in the step loops, no C75xx, no wgmma hazard."""
    rep = _ablation_census('GB.compile_offline(128, False, "bf16", variant=3, ablate=mask)', (0, 1, 2, 4, 8, 16),
                           0x40)   # short hops only (not the mbarrier retry blocks)
    base = rep["0"]
    assert len(base["loops"]) == 2 and base["redg_skipped"] == 0 and base["redg"] == 32, base
    for mask, r in rep.items():
        assert not r["c75"] and r["hazards"] == 0, (mask, r)
        assert r["stack"] <= base["stack"] + 8, (mask, r["stack"])
        assert len(r["loops"]) == 2, (mask, [lp["n"] for lp in r["loops"]])
        for lp, lp0 in zip(r["loops"], base["loops"]):
            c, c0 = lp["classes"], lp0["classes"]
            assert not c.get("local"), (mask, c)
            want = dict(c0)
            hg = {"64x64x16": 24, "64x128x16": 8}
            if mask == "1":
                assert r["redg"] == 32 and r["redg_skipped"] == 32, r      # every REDG jumped over
                assert c["control"] == c0["control"] + 15, (c, c0)        # the branches (one pair merged)
                for k in ("control", "int_addr", "move", "uniform_int", "other:PLOP3"):
                    want.pop(k, None)
                    c.pop(k, None)
            elif mask == "2":
                assert c0["fence_membar"] == 2 and not c.get("fence_membar"), c
                want.pop("fence_membar")
            elif mask == "4":
                hg = {"64x64x16": 16, "64x128x16": 8}
                assert not c.get("redg") and c["hgmma"] == 24 and c["bar"] == c0["bar"] - 1, c
                for k in ("redg", "hgmma", "bar", "warpgroup", "int_addr", "move", "uniform_int", "control"):
                    want.pop(k, None)
                    c.pop(k, None)
            elif mask == "8":
                assert not c.get("mufu_ex2") and c["ffma"] == c0["ffma"] == 32, c
                for k in ("mufu_ex2", "int_addr", "move", "uniform_int"):
                    want.pop(k, None)
                    c.pop(k, None)
            elif mask == "16":
                assert c["syncs"] == c0["syncs"] - 1, (c, c0)                # one TRYWAIT fewer
                for k in ("syncs", "control", "int_addr", "move", "uniform_int"):
                    want.pop(k, None)
                    c.pop(k, None)
            assert lp["hgmma"] == hg, (mask, lp["hgmma"])
            # the arithmetic and memory classes the bit does not name are unchanged
            for k in ("hgmma", "mufu_ex2", "ffma", "fadd", "fmul", "f2fp", "redg", "lds", "sts", "bar",
                      "fence_membar", "syncs"):
                if k in want:
                    assert c.get(k) == want.get(k), (mask, k, c.get(k), want.get(k))


def test_ablation_offline_builds_d256():
    """bf16, d = 256, non-causal: the real kernel and bits 1, 4, 8. Per step loop of each consumer warpgroup: the real
    kernel has 44 HGMMA (32 m64n32k16 = S^T, dP^T; 12 m64n128k16 = dV, dK, dQ), 16 MUFU.EX2 and 32 REDG.F32x2; bit 1
    keeps every HGMMA and REDG instruction but each REDG lies inside a short predicated forward branch (jumped over:
    no reduction reaches memory); bit 4 drops the 4 dQ HGMMA and every REDG; bit 8 every MUFU.EX2 (the FFMA stays).
    No stack, no local memory in the loops, no C75xx, no wgmma hazard."""
    rep = _ablation_census('GB.compile_offline(256, False, "bf16", ablate=mask)', (0, 1, 4, 8),
                           0x100)  # short hops (interleaved pairs here)
    base = rep["0"]
    assert base["redg"] == 64 and base["redg_skipped"] == 0, (base["redg"], base["redg_skipped"])
    assert rep["1"]["redg"] == 64 and rep["1"]["redg_skipped"] == 64, rep["1"]["redg_skipped"]
    assert rep["4"]["redg"] == 0 and rep["8"]["redg"] == 64
    for mask, r in rep.items():
        assert not r["c75"] and r["hazards"] == 0 and r["stack"] == 0, (mask, r["c75"], r["hazards"], r["stack"])
        assert len(r["loops"]) == 2, (mask, [lp["n"] for lp in r["loops"]])
        for lp, lp0 in zip(r["loops"], base["loops"]):
            c, c0 = lp["classes"], lp0["classes"]
            assert not c.get("local"), (mask, c)
            assert lp["hgmma"] == ({"64x32x16": 32, "64x128x16": 8} if mask == "4"
                                   else {"64x32x16": 32, "64x128x16": 12}), (mask, lp["hgmma"])
            assert c.get("redg", 0) == (0 if mask == "4" else 32), (mask, c.get("redg"))
            assert c.get("mufu_ex2", 0) == (0 if mask == "8" else 16), (mask, c.get("mufu_ex2"))
            assert c["ffma"] == c0["ffma"] and c["f2fp"] == c0["f2fp"], (mask, c, c0)
            if mask == "1":
                assert c["control"] >= c0["control"] + 16, (c["control"], c0["control"])  # the branches
            elif mask != "0":
                assert lp["n"] < lp0["n"], (mask, lp["n"], lp0["n"])
