"""Variant 4 of the Gluon FA3-style attention backward at d = 128 (``gluon_attention_bwd(..., variant=4)``: variant 3
plus named-barrier turns between the two consumer warpgroups; offline only).

CPU: the CPU model of the protocol (random interleavings) and its mutation check, and the offline sm_90 builds
(Triton's bundled ptxas, no GPU; skipped without it): variant 4 as variant 3 plus exactly the turn instructions, and
variant 3 unchanged. GPU (``-m gpu``, sm_90 only): dK / dV bit-identical to variant 3, dQ against the float64
backward (its fp32 atomics make it run-to-run non-deterministic in the last bits, in variant 3 as well)."""

import pytest
import torch

from fxopt.testing import GLUON_BWD_CASES, assert_gluon_bwd_variant

GB = pytest.importorskip("fxopt.kernels.attention_gluon_bwd")


def test_variant4_is_listed():
    assert 4 in GB.VARIANTS and 128 in GB._VARIANT_DIMS


def test_v4_protocol_model_random_interleavings():
    assert "without deadlock" in GB.check_v4_protocol(trials=300)
    # the long and the degenerate cases explicitly: no query block (the turn handed over and taken back only),
    # one block, a single ring stage
    for n, stages in ((0, 2), (1, 1), (1, 2), (12, 1), (12, 3)):
        for seed in range(10):
            GB.v4_protocol_model(n, stages, seed=seed, tma_delay=seed % 5)


@pytest.mark.parametrize("bug", GB.V4_BUGS)
def test_v4_protocol_model_catches_broken_rules(bug):
    """Each mutation of the protocol (see ``v4_protocol_model``) must be caught on some interleaving; "hold_turn"
    (one turn per step, held from the S^T issue to the dQ issue) is the deadlock against the ds_bar exchange."""
    caught = []
    for k in range(40):
        try:
            GB.v4_protocol_model(1 + k % 8, 1 + k % 3, seed=k, tma_delay=k % 7, bug=bug)
        except AssertionError as e:
            caught.append(str(e))
    assert caught, bug
    if bug in ("no_prearrive", "hold_turn"):
        assert all("deadlock" in m for m in caught), caught[:2]
    if bug == "no_final_sync":
        assert all("pending arrivals" in m for m in caught), caught[:2]


def test_v4_offline_builds():
    """bf16 / fp16, causal or not: variant 4 = variant 3 plus the turn instructions and nothing else of note:
    same HGMMA / wgmma wait / reduction counts and shared memory, no wgmma serialisation warning, no register hazard
    on an in-flight wgmma, no local-memory access added inside the step loops, and exactly the expected named-barrier
    instructions: per step loop and warpgroup one ``BAR.SYNC 0xe / 0xf, 0x100`` (own turn) before the first HGMMA of
    S^T and of dQ and one ``BAR.ARV`` right after the last HGMMA of each; plus warpgroup 1's first pass and
    warpgroup 0's last turn wait."""
    from fxopt.testing import offline_build_json

    code = """
import json, re
import fxopt.kernels.attention_gluon_bwd as GB
from fxopt.kernels.attention_gluon import _tool
from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards
rep = {}
for v in (3, 4):
    for dt in ("bf16", "fp16"):
        for causal in (False, True):
            c = GB.compile_offline(128, causal, dt, variant=v)
            use = _tool("cuobjdump", c.asm["cubin"], ".cubin", "--dump-resource-usage")
            ptxas = _tool("ptxas", c.asm["ptx"], ".ptx", "-arch=sm_90a", "-v", "-o", "/dev/null")
            sass = sass_of(c)
            ins = [l.split(";")[0] for l in sass.splitlines() if re.search(r"/\\*[0-9a-f]{4}\\*/", l)]
            # order check: the nearest synchronising / memory instruction (HGMMA, any BAR incl. WARPGROUP.DEPBAR and
            # MEMBAR, SYNCS, REDG, EXIT; not the address / descriptor arithmetic ptxas interleaves) after each turn
            # wait and before each pass
            rel = [i for i, l in enumerate(ins) if re.search(r"HGMMA|BAR|SYNCS|REDG|EXIT", l)]
            after_sync, before_arv = [], []
            for j, i in enumerate(rel):
                if re.search(r"BAR\\.SYNC\\S* 0x[ef], 0x100", ins[i]):
                    nxt = ins[rel[j + 1]] if j + 1 < len(rel) else ""
                    after_sync.append("HGMMA" if "HGMMA" in nxt else nxt.strip())
                if re.search(r"BAR\\.ARV 0x[ef], 0x100", ins[i]):
                    prv = ins[rel[j - 1]] if j else ""
                    before_arv.append("HGMMA" if "HGMMA" in prv else prv.strip())
            rep[f"v{v}_{dt}_{causal}"] = dict(
                stack=int(re.search(r"STACK:(\\d+)", use).group(1)),
                c75=sorted(set(re.findall(r"C75\\d\\d", ptxas))), smem=c.metadata.shared,
                hazards=len(wgmma_sass_hazards(sass)), hgmma=len(re.findall(r"HGMMA", sass)),
                le=[len(re.findall(r"WARPGROUP\\.DEPBAR\\.LE gsb0, 0x%d" % i, sass)) for i in (0, 1)],
                red=len(re.findall(r"REDG\\.E\\.ADD\\.F32x2", sass)),
                local=len(re.findall(r"\\b(?:LDL|STL)\\b", sass)),
                sync=[len(re.findall(r"BAR\\.SYNC\\S* 0x%s, 0x100" % x, sass)) for x in "ef"],
                arv=[len(re.findall(r"BAR\\.ARV 0x%s, 0x100" % x, sass)) for x in "ef"],
                after_sync=after_sync, before_arv=before_arv)
print(json.dumps(rep))
"""
    rep = offline_build_json(code)
    assert len(rep) == 8
    for dt in ("bf16", "fp16"):
        for causal in (False, True):
            v3, v4 = rep[f"v3_{dt}_{causal}"], rep[f"v4_{dt}_{causal}"]
            tag = (dt, causal)
            loops = 2 if causal else 1      # causal: a masked and an unmasked step loop
            assert not v4["c75"] and v4["hazards"] == 0, (tag, v4)
            for key in ("hgmma", "le", "red", "smem"):
                assert v4[key] == v3[key], (tag, key, v3[key], v4[key])
            assert v3["sync"] == [0, 0] and v3["arv"] == [0, 0], (tag, v3)
            # warpgroup 0 syncs on 14 (0xe) at 2 points per step + its final wait; warpgroup 1 on 15 at 2 points;
            # warpgroup 1 arrives on 14 after its 2 points + its first pass; warpgroup 0 on 15 after its 2
            assert v4["sync"] == [2 * loops + 1, 2 * loops] and v4["arv"] == [2 * loops + 1, 2 * loops], (tag, v4)
            # every turn wait in a loop is followed by HGMMA (the final one of warpgroup 0 is not: 1 of them);
            # every pass in a loop follows the last HGMMA of its issue point (warpgroup 1's first pass does not)
            assert v4["after_sync"].count("HGMMA") == 4 * loops, (tag, v4["after_sync"])
            assert v4["before_arv"].count("HGMMA") == 4 * loops, (tag, v4["before_arv"])
            # spills: the step loops have none in either variant; variant 4 adds at most one spill slot (4 B, in
            # warpgroup 0's prologue of the causal build) outside them
            assert v4["stack"] <= v3["stack"] + 8 and v4["local"] <= v3["local"] + 2, (tag, v3, v4)


# ----------------------------------------------------------------------------------------------------------------
# GPU: variant 4 against variant 3 and the float64 backward
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GLUON_BWD_CASES))
def test_gpu_v4_matches_v3_and_float64(name):
    """dK / dV: bit-identical to variant 3 (only the wgmma issue order between the warpgroups changes; each
    warpgroup's dK_w / dV_w is accumulated in its registers in the same order). dQ: both variants' fp32 atomics
    add the per-CTA partials in a run-dependent order, so dQ is checked against the float64 backward with the
    tolerance of the other GPU tests, and against variant 3 with the same bound."""
    if GB._GLUON_IMPORT_ERROR is not None:
        pytest.skip(GB._GLUON_IMPORT_ERROR)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward needs sm_90")
    assert_gluon_bwd_variant(lambda *a, **kw: GB.gluon_attention_bwd(*a, variant=4, **kw), GLUON_BWD_CASES[name],
                             128, name)
