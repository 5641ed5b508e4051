"""The attention routing table and the Gluon Hopper builds it routes to (fxopt/kernels/attention).

CPU: the routing table's rows, the kernel-choice switches (``use_kernels``), the eligibility checks, the persistent
schedule. GPU (``-m gpu``, sm_90): every routed Gluon build against the float64 reference, directly and through the
op, and the op's routes.
"""
import math

import pytest
import torch

from fxopt.config import ConfigError, KernelConfig
from fxopt.kernels import kernel_config, use_kernels
from fxopt.kernels import attention as A
from fxopt.kernels._common import kernel_config_key
from fxopt.kernels.attention import gluon_bwd as GB
from fxopt.kernels.attention import gluon_fwd as G
from fxopt.kernels.attention import launch, routing

from gluon_helpers import (
    GLUON_BWD_CASES,
    GLUON_BWD_TOL,
    GLUON_FWD_CASES,
    assert_gluon_bwd_close,
    assert_gluon_fwd_close,
    attention_bwd_reference64,
    gluon_fwd_inputs,
    gluon_fwd_reference,
)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon builds run on sm_90 only")


# ---------------------------------------------------------------------------------------------------------------
# The routing table (CPU)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D,causal,Sq,Sk,build", [
    (64, True, 512, 512, "triton"),              # short causal d = 64 stays on Triton
    (64, True, 1024, 1024, "gluon persistent"),
    (64, True, 4096, 4096, "gluon persistent"),
    (64, True, 8192, 8192, "gluon persistent3"),
    (64, False, 1024, 1024, "gluon persistent"),
    (64, False, 2048, 2048, "gluon persistent3"),
    (128, False, 16384, 16384, "gluon persistent"),
    (128, True, 256, 256, "gluon persistent"),
    (256, True, 4096, 4096, "gluon default"),
    (96, False, 4096, 4096, "triton"),           # no Gluon build at other head dims
])
def test_forward_routes(D, causal, Sq, Sk, build):
    assert routing.select("forward", (9, 0), D, causal, Sq, Sk) == build
    assert routing.select("forward", (8, 0), D, causal, Sq, Sk) == "triton"  # other GPUs: Triton


@pytest.mark.parametrize("D,S,build", [
    (128, 511, "triton"), (128, 512, "gluon dq-reducer"), (64, 1023, "triton"), (64, 1024, "gluon dq-reducer"),
    (256, 511, "triton"), (256, 512, "gluon d256"), (80, 4096, "triton")])
def test_backward_routes_from_their_length_floors(D, S, build):
    for causal in (False, True):
        assert routing.select("backward", (9, 0), D, causal, S, S) == build
    # both lengths must reach the floor
    assert routing.select("backward", (9, 0), D, False, S, 16) == "triton"


def test_fp8_routes_and_table_is_frozen_with_a_stable_digest():
    assert routing.select("fp8_forward", (9, 0), 128, True, 77, 300) == "gluon"
    assert routing.select("fp8_forward", (9, 0), 256, False, 4096, 4096) == "triton"
    assert isinstance(routing.ROUTES, tuple)
    with pytest.raises(AttributeError):  # frozen rows
        routing.ROUTES[0].build = "x"
    import hashlib

    assert routing.ROUTES_DIGEST == hashlib.sha1(repr(routing.ROUTES).encode()).hexdigest()[:16]


def test_use_kernels_switches_restore_and_validate():
    default = kernel_config()
    key = kernel_config_key()
    with use_kernels(attention_gluon=False) as cfg:
        assert kernel_config() is cfg and not cfg.attention_gluon and cfg.attention_gluon_backward
        assert kernel_config_key() != key
        with use_kernels(attention_tma="off"):
            assert kernel_config().attention_tma == "off" and not kernel_config().attention_gluon
        assert kernel_config().attention_tma == "auto"
    assert kernel_config() == default and kernel_config_key() == key
    with pytest.raises(ConfigError, match="attention_tma"):
        with use_kernels(attention_tma="sometimes"):
            pass
    with pytest.raises(ConfigError, match="unknown kernel option"):
        with use_kernels(attention_gluon_dims=(64,)):
            pass
    assert KernelConfig() == default


def test_config_option_reaches_the_backend_choices():
    """``options={"kernels.attention_gluon": False}`` is a typed option; the backend makes it the choices in force."""
    import fxopt
    from fxopt.kernels import _common

    cfg = fxopt.Config.from_options({"kernels.attention_gluon": False, "kernels.fp8_gluon": False})
    assert not cfg.kernels.attention_gluon and not cfg.kernels.fp8_gluon
    with pytest.raises(ValueError, match="attention_tma"):
        fxopt.Config.from_options({"kernels.attention_tma": "maybe"})
    saved = kernel_config()
    try:
        _common.set_backend_kernels(cfg.kernels)
        assert not kernel_config().attention_gluon
        with use_kernels(attention_gluon=True):  # an override wins over the backend's choices
            assert kernel_config().attention_gluon
    finally:
        _common.set_backend_kernels(saved)


def test_gluon_builds_refused_on_cpu_and_for_unsupported_arguments():
    q = torch.randn(1, 2, 8, 128, dtype=torch.float16)
    out, lse = torch.randn_like(q), torch.randn(1, 2, 8)
    assert launch.gluon_forward_build(q, q, q) is None  # CPU
    assert launch.gluon_backward_build(q, q, q, q, out, lse) is None
    assert "CUDA" in G.gluon_supported(q, q, q)
    assert "CUDA" in GB.gluon_bwd_supported(q, q, q, q, out, lse)
    for kw in (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), dict(dropout_p=0.1), dict(window=4),
               dict(softcap=1.0)):
        assert launch.gluon_forward_build(q, q, q, **kw) is None
    with pytest.raises(ValueError, match="unknown variant"):
        G.gluon_attention_fwd(q, q, q, variant="overlap")
    with pytest.raises(ValueError, match="head dim 64 only"):
        G.config_for(128, "persistent3")
    with pytest.raises(ValueError, match="head dims"):
        G.config_for(256, "persistent")


def test_grad_strides_ok_and_grads_like_inputs_refusal():
    """``grad_strides_ok``: torch.empty_like's layout of [B, S, H, D] views, contiguous tensors and stride-0 expands
    suits TMA; a head dim of 4 fp16 (8-byte rows) does not, and ``grads_like_inputs=True`` refuses it."""
    q = torch.randn(1, 16, 4, 64, dtype=torch.float16).transpose(1, 2)
    assert not q.is_contiguous() and GB.grad_strides_ok(q)
    assert GB.grad_strides_ok(q.contiguous(), torch.randn(1, 1, 24, 64).expand(1, 2, 24, 64))
    bad = torch.randn(1, 24, 2, 4, dtype=torch.float16).transpose(1, 2)
    assert not GB.grad_strides_ok(bad)
    with pytest.raises(ValueError, match="grads_like_inputs"):
        GB.gluon_attention_bwd(bad, bad, bad, bad, bad, torch.zeros(1, 2, 24), checked=True, grads_like_inputs=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_m,num_bh,sms", [(7, 5, 4), (1, 3, 132), (16, 32, 132), (3, 1, 2)])
def test_persistent_schedule(num_m, num_bh, sms, causal):
    sched, P = G.persistent_schedule(num_m, num_bh, causal, sms)
    assert sched == (1 if causal and num_m * num_bh > sms else 0) and 1 <= P <= sms


def test_kernel_routes_on_cpu_and_fallbacks(monkeypatch):
    """``kernel_routes`` (the benchmark's fwd_kernel / bwd_kernel columns): Triton on CPU and for decode shapes; a
    failed Gluon build reads "fell back to triton", so that a table's "fxopt" column never silently times Triton."""
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    assert A.kernel_routes(q, k, v, is_causal=True) == {"forward": "triton", "backward": "triton"}
    kd = torch.randn(1, 2, 1024, 64)
    assert A.kernel_routes(q[:, :, :1], kd, torch.randn_like(kd))["forward"] == "triton split-kv"
    monkeypatch.setattr(launch, "_GLUON_FAILED", {(q.device, q.dtype, 64, False)})
    monkeypatch.setattr(launch, "_GLUON_BWD_FAILED", {(q.device, q.dtype, 64, False)})
    assert A.kernel_routes(q, k, v) == {"forward": "gluon (fell back to triton)",
                                        "backward": "gluon (fell back to triton)"}


# ---------------------------------------------------------------------------------------------------------------
# GPU: the forward builds
# ---------------------------------------------------------------------------------------------------------------

FWD_BUILDS = [("default", 64), ("default", 128), ("default", 256), ("persistent", 64), ("persistent", 128),
              ("persistent3", 64)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("variant,D", FWD_BUILDS, ids=[f"{v}_d{d}" for v, d in FWD_BUILDS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(GLUON_FWD_CASES))
def test_gpu_gluon_forward_builds(name, dtype, variant, D):
    """Each routed forward build against float64 (out, lse, empty rows); the persistent builds also on 1 and 3 SMs
    (many items per CTA: both Q buffers, many ring phases), bit-identical whatever CTA runs a tile."""
    (B, Hq, Hkv, Sq, Sk), causal = GLUON_FWD_CASES[name]
    q, k, v = gluon_fwd_inputs(B, Hq, Hkv, Sq, Sk, D, dtype)
    ref, ref_lse, fin, lim = gluon_fwd_reference(q, k, v, causal)
    out, lse = G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant)
    torch.cuda.synchronize()
    assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, f"{name} {variant}")
    if variant != "default":
        for n in (3, 1):
            o, s = G.gluon_attention_fwd(q, k, v, causal=causal, variant=variant, num_sms=n)
            assert torch.equal(o, out) and torch.equal(s, lse), n


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D,S,causal,want", [
    (128, 1000, True, "gluon persistent"), (64, 2100, False, "gluon persistent3"), (64, 512, True, "triton"),
    (256, 640, True, "gluon default")])
def test_gpu_op_forward_routes(D, S, causal, want):
    """The op runs the build the table names (GQA 2:1, a [B, S, H, D] view), correct against float64, never fallen
    back; with ``attention_gluon=False`` the Triton kernel, also correct; gradients through the op."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in gluon_fwd_inputs(1, 4, 2, S, S, D, torch.bfloat16))
    assert (launch.gluon_forward_build(q, k, v, is_causal=causal) or "triton") == want
    ref, ref_lse, fin, lim = gluon_fwd_reference(q, k, v, causal)
    out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
    assert out.stride() == torch.empty_like(q).stride() and not launch._GLUON_FAILED
    assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, want)
    with use_kernels(attention_gluon=False):
        assert launch.gluon_forward_build(q, k, v, is_causal=causal) is None
        assert_gluon_fwd_close(*A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True), ref, ref_lse,
                               fin, lim, "triton")
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = torch.ops.fxopt.flash_attention(qg, kg, vg, is_causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    A.attention_reference(q64, k64, v64, compute_dtype=torch.float64, is_causal=causal).backward(do.double())
    for got, want_g in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        err = (got.double() - want_g).abs().max().item()
        assert err <= 5e-2 * max(1.0, want_g.abs().max().item()), err


# ---------------------------------------------------------------------------------------------------------------
# GPU: the backward builds
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [128, 64, 256])
@pytest.mark.parametrize("name", list(GLUON_BWD_CASES))
def test_gpu_gluon_backward_builds(name, head_dim):
    """"dq-reducer" (d = 64 / 128) and "d256" against the float64 backward (exact zero dQ on rows with no visible
    key)."""
    def run(dout, q, k, v, out, lse, causal):
        return GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal)

    assert_gluon_bwd_close(run, GLUON_BWD_CASES[name], head_dim, name)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [128, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_backward_grads_like_strided_inputs(head_dim, causal):
    """``grads_like_inputs=True`` on [B, S, H, D] views (GQA 4:2, ragged S): gradients laid out like
    ``torch.empty_like`` of q / k / v, dK / dV bit-identical to the same build on contiguous copies, dQ within the
    fp32 reduction-order tolerance."""
    B, Hq, Hkv, S = 2, 4, 2, 1100
    gen = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda H: torch.randn(B, S, H, head_dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=gen).transpose(1, 2)
    q, k, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
    got = GB.gluon_attention_bwd(dout, q, k, v, out, lse, causal=causal, grads_like_inputs=True)
    ref = GB.gluon_attention_bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                 out.contiguous(), lse, causal=causal)
    torch.cuda.synchronize()
    for g, t in zip(got, (q, k, v)):
        assert g.stride() == torch.empty_like(t).stride() and not g.is_contiguous()
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    lim = GLUON_BWD_TOL[torch.bfloat16] * 2 * max(1.0, ref[0].abs().max().item())
    assert (got[0].float() - ref[0].float()).abs().max().item() <= lim


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D,S,want", [(128, 512, "gluon dq-reducer"), (128, 256, None), (64, 1024, "gluon dq-reducer"),
                                      (256, 512, "gluon d256"), (256, 256, None)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_op_backward_routes(D, S, want, causal):
    """The op's backward runs the build the table names from its length floor (a [B, S, H, D] view: gradients laid
    out like the inputs), never fallen back; with ``attention_gluon_backward=False`` the Triton kernels; both
    against the float64 backward."""
    gen = torch.Generator(device="cuda").manual_seed(S + D)
    q, k, v, dout = (torch.randn(1, S, 2, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                     for _ in range(4))
    out, lse = A.flash_attention_triton(q, k, v, is_causal=causal, return_lse=True)
    assert launch.gluon_backward_build(dout, q, k, v, out, lse, is_causal=causal) == want
    _, _, rdq, rdk, rdv, _ = attention_bwd_reference64(q, k, v, dout, causal, 1.0 / math.sqrt(D))
    for switch in (True, False):
        with use_kernels(attention_gluon_backward=switch):
            grads = A.flash_attention_triton_bwd(dout, q, k, v, out, lse, is_causal=causal)
        assert not launch._GLUON_BWD_FAILED
        for got, ref, t in zip(grads, (rdq, rdk, rdv), (q, k, v)):
            assert got.stride() == torch.empty_like(t).stride()
            lim = GLUON_BWD_TOL[torch.bfloat16] * 2 * max(1.0, ref.abs().max().item())
            assert (got.double() - ref).abs().max().item() <= lim, (switch, D, S)
