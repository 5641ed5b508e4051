"""``mma_rowsum`` of the Gluon FA3-style forward (opt-in, persistent variants only): the softmax row sum of
P by a small wgmma (P [64, BLOCK_N] x a constant [BLOCK_N, 8] tile, ones in column 0) issued with PV, instead of ~64
FADD per thread and step (``mma_rowsum`` in docs/kernels.md).

CPU: how the switch resolves (argument, ``FXOPT_ATTN_GLUON_MMA_ROWSUM``, module default) and what is refused (a
non-persistent variant with mma_rowsum=True, non-boolean values), one offline sm_90 pair of builds (Triton's bundled
ptxas; skipped without it): no spills, no C75xx, no register hazard on an in-flight wgmma, the row-sum FADDs gone and
the extra HGMMA there. GPU (``-m gpu``, sm_90 only): out / lse against the float64 reference (bf16 / fp16, d 64 / 128,
causal or not, ragged Sq / Sk, GQA, rows with no visible key, num_sms 1 / 3 / all; persistent and persistent3)."""
import pytest
import torch

from fxopt.testing import GLUON_FWD_CASES, assert_gluon_fwd_close, gluon_fwd_inputs, gluon_fwd_reference

G = pytest.importorskip("fxopt.kernels.attention_gluon")

ENV = "FXOPT_ATTN_GLUON_MMA_ROWSUM"


# ---------------------------------------------------------------- CPU: switch resolution and refusals


def test_default_is_off_and_env_applies_to_persistent_only(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert G.MMA_ROWSUM is False
    for v in G.VARIANTS:
        assert G.resolve_mma_rowsum(None, v) == 0
    persistent = tuple(G._PERSISTENT_SCHED)
    assert {"persistent", "persistent_lpt", "persistent3"} <= set(persistent)
    for val, want in (("1", 1), ("true", 1), ("ON", 1), ("0", 0), ("false", 0), ("", 0), ("nopin", 2)):
        monkeypatch.setenv(ENV, val)
        for v in G.VARIANTS:
            assert G.resolve_mma_rowsum(None, v) == (want if v in persistent else 0), (val, v)
    monkeypatch.setenv(ENV, "1")  # the argument wins over the environment
    assert G.resolve_mma_rowsum(False, "persistent") == 0
    monkeypatch.setenv(ENV, "0")
    assert G.resolve_mma_rowsum(True, "persistent3") == 1 and G.resolve_mma_rowsum("nopin", "persistent") == 2


def test_module_default_used_without_argument_or_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(G, "MMA_ROWSUM", True)
    assert G.resolve_mma_rowsum(None, "persistent") == 1
    assert G.resolve_mma_rowsum(None, "overlap") == 0  # never for a variant without the code path


@pytest.mark.parametrize("variant", ["default", "overlap", "overlap2", "pingpong"])
def test_non_persistent_variants_refuse_mma_rowsum(variant, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    for on in (True, "1", "nopin"):
        with pytest.raises(ValueError, match="needs a persistent variant"):
            G.resolve_mma_rowsum(on, variant)
    # the wrapper refuses before it looks at the tensors (CPU tensors here)
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"mma_rowsum=True .*needs a persistent variant.*{variant}"):
        G.gluon_attention_fwd(q, q, q, variant=variant, mma_rowsum=True)
    with pytest.raises(ValueError, match="needs a persistent variant"):
        G.compile_offline(64, False, "bf16", variant=variant, mma_rowsum=True)
    monkeypatch.setenv(ENV, "1")  # the environment switch is ignored there (like FXOPT_ATTN_GLUON_POLY_EXP)
    assert G.resolve_mma_rowsum(None, variant) == 0
    assert G.resolve_mma_rowsum(False, variant) == 0


@pytest.mark.parametrize("bad", ["2", "maybe", 2, 0.5, [1]])
def test_non_boolean_values_refused(bad, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match="is not a boolean or 'nopin'"):
        G.resolve_mma_rowsum(bad, "persistent")
    if isinstance(bad, str):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"{ENV}=.*is not a boolean or 'nopin'"):
            G.resolve_mma_rowsum(None, "persistent")


# ---------------------------------------------------------------- offline sm_90 build (one pair, to keep CI short)


def test_mma_rowsum_offline_sm90_build():
    """persistent d = 64 causal bf16 with and without MMA_ROWSUM: 0 spills, no C75xx, no wgmma register hazard in
    both; the rowsum build has no FADD left in its step loops (the baseline: one per score, 64 + 2 per step), one
    m64n8k16 wgmma group more per PV (8 HGMMA per group: K = BLOCK_N = 128), the pin still keeps (nearly) every exp2
    of a step under the own PV, and 8 x 128 x 2 B more shared memory for the constant tile."""
    from fxopt.testing import offline_build_json

    rep = offline_build_json(
        "import json, re, fxopt.kernels.attention_gluon as G\n"
        "from fxopt.kernels.w4a16_gluon import sass_of, wgmma_sass_hazards\n"
        "out = {}\n"
        "for rs in (False, True):\n"
        "    c = G.compile_offline(64, True, 'bf16', variant='persistent', mma_rowsum=rs)\n"
        "    s = G.sass_summary(c)\n"
        "    sass = G._tool('nvdisasm', c.asm['cubin'], '.cubin')\n"
        "    use = G._tool('cuobjdump', c.asm['cubin'], '.cubin', '--dump-resource-usage')\n"
        "    m = re.search(r'STACK:(\\d+) SHARED:(\\d+) LOCAL:(\\d+)', use)\n"
        "    out[str(int(rs))] = dict(spill=s['spill_bytes'], c75=s['c75xx'], hgmma=s['hgmma'],\n"
        "        maxreg=s['max_reg_index'], stack=int(m.group(1)), local=int(m.group(3)), smem=c.metadata.shared,\n"
        "        hazards=len(wgmma_sass_hazards(sass_of(c))), fadd=len(re.findall(r'\\bFADD', sass)),\n"
        "        ex2=len(re.findall(r'MUFU\\.EX2', sass)), under=s['ex2_under_pv'])\n"
        "print(json.dumps(out))\n")
    base, rs = rep["0"], rep["1"]
    for r in (base, rs):
        assert r["spill"] == 0 and r["stack"] == 0 and r["local"] == 0 and not r["c75"], r
        assert r["hazards"] == 0 and r["maxreg"] < 240, r
    # 2 consumer warpgroups x 3 PV issue sites (unmasked loop, masked loop, tail) x 8 HGMMA
    assert rs["hgmma"] == base["hgmma"] + 2 * 3 * 8, (base, rs)
    # the baseline sums 64 scores per thread and step in each of 4 step loops (+ block 0 and the reduction shuffles);
    # what the rowsum build keeps is outside the loops (block 0 / epilogue / address arithmetic): >= 4 x 64 fewer
    assert base["fadd"] - rs["fadd"] >= 4 * 64, (base["fadd"], rs["fadd"])
    assert rs["ex2"] <= base["ex2"]
    # the pin (OR of P's bits) keeps the step's exp2s under the own PV: per loop step 64 scores + alpha(s)
    assert max(rs["under"]) >= 64 and max(base["under"]) >= 64, (base["under"], rs["under"])
    assert rs["smem"] - base["smem"] >= 8 * 128 * 2, (base["smem"], rs["smem"])


# ---------------------------------------------------------------- GPU: against the float64 reference


_inputs = gluon_fwd_inputs


GPU_CASES = {**GLUON_FWD_CASES,  # name: ((B, Hq, Hkv, Sq, Sk), causal)
             "s2048_causal": ((1, 2, 2, 2048, 2048), True)}
GPU_VARIANTS = [("persistent", 64), ("persistent", 128), ("persistent3", 64)]


def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant,D", GPU_VARIANTS, ids=[f"{v}_d{d}" for v, d in GPU_VARIANTS])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_mma_rowsum_matches_float64(name, variant, D, dtype, monkeypatch):
    _skip_unless_sm90()
    monkeypatch.delenv(ENV, raising=False)
    (B, Hq, Hkv, Sq, Sk), causal = GPU_CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype)
    ref, ref_lse, fin, lim = gluon_fwd_reference(q, k, v, causal)
    outs = {}
    for num_sms in (None, 3, 1):  # 1 / 3 SMs: many items per CTA (the accumulator re-zeroed per item)
        out, lse = outs[num_sms] = G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant, num_sms=num_sms,
                                                         mma_rowsum=True)
        torch.cuda.synchronize()
        # the tensor cores sum P rounded to the input dtype: a sum of rounded positive terms is within the unit
        # roundoff u of the exact one, so lse within -log(1 - u) (u = 2^-8 bf16, 2^-11 fp16). Rows with a few visible keys
        # (causal) do not average the roundings away: 8 causal bf16 cases exceeded the 1e-3 of the FADD build on
        # the H200 (a run of the whole GPU suite)
        u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, f"num_sms={num_sms}", lse_tol=1.1 * u)
    for n in (3, 1):  # the arithmetic of a tile does not depend on the CTA that runs it
        assert torch.equal(outs[n][0], outs[None][0]) and torch.equal(outs[n][1], outs[None][1]), n
    # "nopin" only moves ptxas's PV wait (no pin store): the same arithmetic, bit for bit
    nopin = G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant, num_sms=3, mma_rowsum="nopin")
    assert torch.equal(nopin[0], outs[None][0]) and torch.equal(nopin[1], outs[None][1])
    # the FADD row sum (default build) stays within the same bound; the two differ (rounded vs fp32 P summed)
    base, _ = G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant, mma_rowsum=False)
    assert (base.double() - ref).abs().max().item() <= lim


@pytest.mark.gpu
def test_gpu_env_switch_and_write_lse_off(monkeypatch):
    _skip_unless_sm90()
    q, k, v = _inputs(1, 2, 2, 300, 300, 64, torch.bfloat16, seed=1)
    monkeypatch.delenv(ENV, raising=False)
    on, lse_on = G.gluon_attention_fwd(q, k, v, causal=True, variant="persistent", mma_rowsum=True)
    off, _ = G.gluon_attention_fwd(q, k, v, causal=True, variant="persistent")
    monkeypatch.setenv(ENV, "1")
    env_on, env_lse = G.gluon_attention_fwd(q, k, v, causal=True, variant="persistent")
    assert torch.equal(env_on, on) and torch.equal(env_lse, lse_on)  # the env switch builds the same kernel
    assert torch.equal(G.gluon_attention_fwd(q, k, v, causal=True, variant="persistent", mma_rowsum=False)[0], off)
    ovl, _ = G.gluon_attention_fwd(q, k, v, causal=True, variant="overlap")  # env ignored by other variants
    monkeypatch.delenv(ENV)
    assert torch.equal(ovl, G.gluon_attention_fwd(q, k, v, causal=True, variant="overlap")[0])
    out2, none = G.gluon_attention_fwd(q, k, v, causal=True, variant="persistent", mma_rowsum=True,
                                       write_lse=False)
    assert none is None and torch.equal(out2, on)
