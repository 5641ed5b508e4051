"""Persistent stream-K decode attention (fxopt/kernels/attention_decode.py) against a float64 reference.

CPU: the kernels run through the Triton interpreter (fp32 / fp16, tiny shapes). The program counts are chosen so
that items are split across programs AND programs span several items (``decode_plan`` asserts which case each
test hits). GPU (``-m gpu``): bf16 at decode shapes against SDPA's math backend.
"""
import math

import pytest
import torch

from fxopt.kernels import attention_decode as AD

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0, bshd=False, device=DEV):
    g = torch.Generator().manual_seed(seed)
    if bshd:  # [B, S, H, D] storage seen as [B, H, S, D]: non-contiguous strides, last dim contiguous
        mk = lambda H, S: torch.randn(B, S, H, D, generator=g).to(device, dtype).transpose(1, 2)  # noqa: E731
    else:
        mk = lambda H, S: torch.randn(B, H, S, D, generator=g).to(device, dtype)  # noqa: E731
    return mk(Hq, Sq), mk(Hkv, Sk), mk(Hkv, Sk)


def _ref64(q, k, v, scale=None, is_causal=False):
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    grp = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    s = q @ k.transpose(-1, -2) * scale
    Sq, Sk = s.shape[-2:]
    if is_causal:  # bottom-right aligned
        i, j = torch.arange(Sq, device=s.device)[:, None], torch.arange(Sk, device=s.device)[None]
        s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no visible key: 0
    return p @ v, lse.masked_fill(lse == float("-inf"), float("inf"))


def _check(out, lse, ref_o, ref_lse, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref_o).abs().max().item()
    assert err <= tol * max(1.0, ref_o.abs().max().item()), f"out error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin.to(lse.device))
    lerr = (lse.double() - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
    assert lerr <= 5 * tol, f"lse error {lerr:.3e}"


# (B, Hq, Hkv, Sq, Sk, D, block_n, programs)
CASES = [
    (2, 4, 2, 1, 1, 16, 16, 3),      # one key: 2 items of one block each, P capped at 2
    (2, 4, 4, 1, 7, 16, 16, 3),      # 8 one-block items on 3 programs: each program spans several items
    (2, 4, 2, 1, 64, 64, 16, 5),     # 4 blocks per item, 4 items on 5 programs: every item split
    (2, 4, 2, 1, 100, 16, 32, 3),    # masked last block; programs start / end mid-item
    (2, 4, 4, 1, 257, 16, 32, 5),    # 9 blocks x 8 items over 5 programs: both splits and spans
    (2, 4, 2, 3, 100, 16, 16, 5),    # 3 query tokens x GQA 2 = 6 packed rows
    (1, 4, 2, 1, 257, 64, 32, 3),    # d = 64
    (2, 4, 4, 1, 33, 40, 16, 7),     # head dim 40 padded to 64
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}kv{c[2]}q{c[3]}k{c[4]}d{c[5]}bn{c[6]}P{c[7]}"
                                             for c in CASES])
def test_matches_float64(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, bn, P = case
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=Sk + D)
    out, lse = AD.decode_attention_persistent(q, k, v, block_n=bn, num_programs=P)
    assert out.shape == q.shape and lse.shape == (B, Hq, Sq)
    _check(out, lse, *_ref64(q, k, v), dtype)


@pytest.mark.parametrize("case", [CASES[4], CASES[5]], ids=["splits_spans", "gqa_3q"])
def test_q_per_item_build(case):
    """The Q-in-registers build (Q loaded once per segment) gives the same results."""
    B, Hq, Hkv, Sq, Sk, D, bn, P = case
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, torch.float32, seed=11)
    out, lse = AD.decode_attention_persistent(q, k, v, block_n=bn, num_programs=P, q_per_item=True)
    _check(out, lse, *_ref64(q, k, v), torch.float32)


def test_plan_covers_splits_and_spans():
    """The cases above exercise both situations the kernel must get right."""
    split = span = False
    for B, Hq, Hkv, Sq, Sk, D, bn, P in CASES:
        plan = AD.decode_plan(B, Hkv, Sk, bn, P)
        split |= plan["max_pieces"] > 1
        span |= any(plan["item_programs"][i][1] == plan["item_programs"][i + 1][0]
                    for i in range(len(plan["item_programs"]) - 1))
        # every item's programs are contiguous and cover [0, P)
        assert plan["item_programs"][0][0] == 0 and plan["item_programs"][-1][1] == plan["programs"] - 1
    assert split and span
    # at most ceil(P / items) + 1 programs touch one item
    plan = AD.decode_plan(8, 32, 4096, 64, 264)
    assert plan["max_pieces"] <= -(-264 // 256) + 1


def test_program_count_extremes():
    q, k, v = _inputs(2, 4, 2, 1, 70, 16, torch.float32, seed=3)
    ref = _ref64(q, k, v, scale=0.3)
    for P in (1, 2, 1000):  # one program for everything; one per item; more programs than blocks (capped)
        _check(*AD.decode_attention_persistent(q, k, v, scale=0.3, block_n=16, num_programs=P), *ref,
               torch.float32)


def test_strided_inputs():
    """[B, S, H, D] storage viewed as [B, H, S, D] (transposed): read in place."""
    q, k, v = _inputs(2, 4, 2, 2, 45, 16, torch.float16, seed=5, bshd=True)
    assert not k.is_contiguous()
    out, lse = AD.decode_attention_persistent(q, k, v, block_n=16, num_programs=5)
    _check(out, lse, *_ref64(q, k, v), torch.float16)
    # a last dim that is not contiguous is copied
    kt = k.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert kt.stride(-1) != 1
    out2, _ = AD.decode_attention_persistent(q, kt, v, block_n=16, num_programs=5)
    assert torch.equal(out2, out)


def test_causal_bottom_right():
    # Sq = 4 < Sk: rows see Sk - 3 .. Sk keys; Sq > Sk: the first rows see nothing (0, lse = +inf)
    for Sq, Sk in ((4, 37), (5, 3)):
        q, k, v = _inputs(1, 4, 2, Sq, Sk, 16, torch.float32, seed=Sq)
        out, lse = AD.decode_attention_persistent(q, k, v, is_causal=True, block_n=16, num_programs=3)
        _check(out, lse, *_ref64(q, k, v, is_causal=True), torch.float32)


def test_preallocated_outputs_and_empty_keys():
    q, k, v = _inputs(1, 2, 2, 1, 20, 16, torch.float32, seed=7)
    o, l = torch.empty_like(q), torch.empty(1, 2, 1)
    out, lse = AD.decode_attention_persistent(q, k, v, block_n=16, num_programs=3, out=o, lse=l)
    assert out is o and lse is l
    _check(out, lse, *_ref64(q, k, v), torch.float32)
    out, lse = AD.decode_attention_persistent(q, k[:, :, :0], v[:, :, :0])
    assert (out == 0).all() and torch.isinf(lse).all() and (lse > 0).all()


def test_bad_inputs():
    q, k, v = _inputs(1, 4, 2, 1, 8, 16, torch.float32)
    f = AD.decode_attention_persistent
    with pytest.raises(ValueError, match="dtype mismatch"):
        f(q.half(), k, v)
    with pytest.raises(ValueError, match="4-D"):
        f(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        f(q[:, :3], k, v)
    with pytest.raises(ValueError, match="same shape"):
        f(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="query tokens"):
        f(torch.randn(1, 4, 17, 16), k, v)
    with pytest.raises(ValueError, match="packed rows"):
        f(torch.randn(1, 256, 1, 16), k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="head dim"):
        f(torch.randn(1, 4, 1, 300), torch.randn(1, 2, 8, 300), torch.randn(1, 2, 8, 300))
    with pytest.raises(ValueError, match="unsupported"):
        f(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="attn_mask"):
        f(q, k, v, attn_mask=torch.ones(1, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        f(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="window"):
        f(q, k, v, window=4)
    with pytest.raises(ValueError, match="softcap"):
        f(q, k, v, softcap=5.0)
    with pytest.raises(ValueError, match="key_padding_mask"):
        f(q, k, v, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_n"):
        f(q, k, v, block_n=24)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        f(q, k, v, ctas_per_sm=0)


@pytest.mark.slow
def test_offline_sm90_build_fits_two_ctas_per_sm():
    """The default build (bf16, d = 128) compiled for sm_90 with Triton's bundled ptxas: K/V through cp.async,
    no spills, shared memory for at least two resident CTAs per SM (the reason for the small tiles)."""
    from fxopt.testing import offline_build_json

    rep = offline_build_json("import json, fxopt.kernels.attention_decode as M; "
                             "print(json.dumps(M.offline_report()))")
    assert rep["stack"] == 0, rep
    assert rep["ldgsts"] > 0, rep
    assert rep["resident_ctas_per_sm"] >= AD.DEFAULT_CONFIG["ctas_per_sm"] >= 2, rep


@pytest.mark.gpu
@pytest.mark.parametrize("hkv,S", [(32, 4096), (8, 4096), (32, 1000)])
def test_gpu_bf16_matches_math(hkv, S):
    q, k, v = _inputs(4, 32, hkv, 1, S, 128, torch.bfloat16, seed=S)
    out, lse = AD.decode_attention_persistent(q, k, v)
    _check(out, lse, *_ref64(q, k, v), torch.bfloat16)


def test_op_route_behind_env_switch(monkeypatch):
    """``FXOPT_ATTN_DECODE_PERSISTENT=1`` (``attention._DECODE_PERSISTENT``) sends the op's split-KV decode calls
    here, and a shape this kernel refuses (more packed query rows than it takes) still gets the split kernel."""
    from fxopt.kernels import attention as A

    monkeypatch.setattr(A, "_DECODE_PERSISTENT", True)
    calls = []
    real = AD.decode_attention_persistent

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)
    monkeypatch.setattr(AD, "decode_attention_persistent", spy)
    q, k, v = _inputs(2, 4, 2, 1, 100, 16, torch.float16, seed=3)
    out, lse = A.flash_attention_triton(q, k, v, decode=True, return_lse=True)
    assert calls == [q.shape]
    _check(out, lse, *_ref64(q, k, v), torch.float16)
    q, k, v = _inputs(1, 8, 1, 20, 64, 16, torch.float16, seed=4)  # 8 x 20 = 160 packed rows: refused
    out, lse = A.flash_attention_triton(q, k, v, decode=True, return_lse=True)
    assert len(calls) == 2
    _check(out, lse, *_ref64(q, k, v), torch.float16)
