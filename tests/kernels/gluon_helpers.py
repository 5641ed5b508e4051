"""Float64 references, cases and tolerances of the Gluon attention kernels' GPU tests."""
import math

import torch

from fxopt.kernels.attention import attention_reference


def attention_bwd_reference64(q, k, v, dout, causal: bool, scale: float):
    """Exact attention forward and backward in float64, for the Gluon backward's GPU tests: q [B, Hq, Sq, D], k / v
    [B, Hkv, Sk, D] (GQA by repeating k / v), causal aligned bottom-right. Returns (out, lse, dq, dk, dv, empty):
    lse in natural log with +inf on rows with no visible key (``empty``), whose out and dq are 0."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf, kf, vf, dof = (t.double() for t in (q, k, v, dout))
    kr, vr = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    s = qf @ kr.transpose(-1, -2) * scale
    if causal:  # bottom-right aligned
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    p = torch.where(empty[..., None], torch.zeros_like(p), p)
    out = p @ vr
    ds = p * (dof @ vr.transpose(-1, -2) - (dof * out).sum(-1, keepdim=True))
    dq = ds @ kr * scale
    dk = (ds.transpose(-1, -2) @ qf).reshape(B, Hkv, g, Sk, D).sum(2) * scale
    dv = (p.transpose(-1, -2) @ dof).reshape(B, Hkv, g, Sk, D).sum(2)
    return out, torch.where(empty, torch.full_like(lse, float("inf")), lse), dq, dk, dv, empty


# The Gluon backward's GPU cases (B, Hq, Hkv, Sq, Sk, causal, dtype) and tolerance (times 2 for gradients, scaled by
# max(1, max |reference|)).
GLUON_BWD_TOL = {torch.bfloat16: 2.5e-2, torch.float16: 3e-3}
GLUON_BWD_CASES = {
    "S200_nc_bf16": (2, 2, 2, 200, 200, False, torch.bfloat16),
    "S200_c_fp16": (2, 2, 2, 200, 200, True, torch.float16),
    "S2048_nc_bf16": (1, 4, 4, 2048, 2048, False, torch.bfloat16),
    "S2048_c_bf16": (1, 4, 4, 2048, 2048, True, torch.bfloat16),
    "S4096_c_bf16_gqa4:2": (1, 4, 2, 4096, 4096, True, torch.bfloat16),
    "gqa8:1_S333_nc_fp16": (1, 8, 1, 333, 333, False, torch.float16),
    "ragged_S2100_c_gqa4:2": (1, 4, 2, 2100, 2100, True, torch.bfloat16),
    "causal_Sq100_Sk300": (1, 2, 2, 100, 300, True, torch.bfloat16),
    "causal_Sq300_Sk100_empty_rows": (1, 2, 2, 300, 100, True, torch.float16),
    "Sq1_Sk50": (2, 2, 2, 1, 50, False, torch.bfloat16),
    "S64_c": (1, 2, 2, 64, 64, True, torch.bfloat16),
}


def assert_gluon_bwd_close(run, case, head_dim: int, tag=""):
    """A Gluon backward build ``run(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` on ``case`` (an entry of
    ``GLUON_BWD_CASES``) against the float64 backward: shape, dtype, contiguous, no NaN, within ``GLUON_BWD_TOL``
    (times 2, scaled by max(1, max |reference|)), and exactly zero dq on rows with no visible key."""
    B, Hq, Hkv, Sq, Sk, causal, dtype = case
    gen = torch.Generator(device="cuda").manual_seed(4321)
    q, dout = (torch.randn(B, Hq, Sq, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    out, lse, rdq, rdk, rdv, empty = attention_bwd_reference64(q, k, v, dout, causal, 1.0 / math.sqrt(head_dim))
    out, lse = out.to(dtype), lse.float()
    dq, dk, dv = run(dout, q, k, v, out, lse, causal)
    torch.cuda.synchronize()
    tol = GLUON_BWD_TOL[dtype]
    for got, want, t in ((dq, rdq, q), (dk, rdk, k), (dv, rdv, v)):
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        assert not torch.isnan(got).any()
        lim = tol * 2 * max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item()
        assert err <= lim, (tag, err, lim)
    if empty.any():  # rows with no visible key get exactly zero dq
        assert (dq[empty.unsqueeze(-1).expand_as(dq)] == 0).all()


GLUON_FWD_TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
GLUON_FWD_CASES = {  # name: ((B, Hq, Hkv, Sq, Sk), causal)
    "ragged_1000": ((1, 2, 2, 1000, 1000), False),
    "ragged_1000_causal": ((1, 2, 2, 1000, 1000), True),
    "sq77_sk333": ((1, 2, 2, 77, 333), False),
    "sq77_sk333_causal": ((1, 2, 2, 77, 333), True),
    "sq300_sk100_causal_empty_rows": ((1, 2, 2, 300, 100), True),
    "gqa_4_2_causal": ((2, 4, 2, 256, 256), True),
    "gqa_4_2": ((2, 4, 2, 200, 520), False),
}


def gluon_fwd_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, s, D, generator=g).to(device, dtype) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))


def gluon_fwd_reference(q, k, v, causal: bool):
    """The float64 forward of q / k / v: (out, lse, finite-lse row mask, error bound ``GLUON_FWD_TOL`` x max(1,
    max |out|))."""
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), compute_dtype=torch.float64,
                                       is_causal=causal, return_lse=True)
    return ref, ref_lse, torch.isfinite(ref_lse), GLUON_FWD_TOL[q.dtype] * max(1.0, ref.abs().max().item())


def assert_gluon_fwd_close(out, lse, ref, ref_lse, fin, lim, tag="", lse_tol=1e-3):
    """A Gluon forward's (out, lse) against ``gluon_fwd_reference``: no NaN, max error within ``lim``, lse finite on
    exactly the rows with a visible key (+inf elsewhere, where out is 0), lse within ``lse_tol``."""
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    assert err <= lim, f"{tag}: max abs error {err:.3e} > {lim:.3e}"
    assert torch.equal(torch.isfinite(lse), fin)
    assert bool(torch.isposinf(lse[~fin]).all())  # rows with no visible key: +inf, never NaN
    assert (out[~fin] == 0).all()
    if fin.any():
        lse_err = (lse.double() - ref_lse)[fin].abs().max().item()
        assert lse_err < lse_tol, f"{tag}: lse error {lse_err:.3e} >= {lse_tol:.3e}"
