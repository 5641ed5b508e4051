"""The attention forms Inductor's ``fuse_attention`` pass recognizes (its ``_sfdp_pattern_*`` shapes and the cases of
its test file), written as small functions and run through fxopt.

Each case is compiled with fxopt's passes (``Backend(inductor=False)``: the graph the passes return, run as is; the
``slow`` variants go through Inductor as ``backend="fxopt"`` does) and checked against eager: outputs, and gradients of
q, k, v where the case is differentiable. Whether fxopt fused the region is read from the attention pass's result;
each case says whether it must fuse, and the summary test keeps the count from dropping.
"""
import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fxopt.backends import Backend

B, H, S, D = 4, 2, 16, 32


def _t(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(shape=(B, H, S, D), dtype=torch.float32):
    return [_t(*shape, dtype=dtype, seed=i) for i in range(3)]


# ---------------------------------------------------------------------------------------------------------------
# the forms (numbers: Inductor's _sfdp_pattern_N / _test_sdpa_rewriter_N)
# ---------------------------------------------------------------------------------------------------------------


def p1_div_sqrt(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def p2_mul_inv_sqrt(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def p3_div_dropout_eval(q, k, v):
    p = torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1)
    return F.dropout(p, p=0.4, training=False, inplace=False).matmul(v)


def p4_mul_dropout_p0(q, k, v):
    p = torch.matmul(q, k.transpose(-2, -1)).mul(0.4).softmax(dim=-1)
    return F.dropout(p, p=0.0, training=True).matmul(v)


def p5_causal_additive(q, k, v):
    m = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril(diagonal=0)
    m = m.masked_fill(torch.logical_not(m), -float("inf"))
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + m, dim=-1) @ v


def p5_bool_zeros_added(q, k, v):
    m = torch.zeros(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).bool()
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + m, dim=-1) @ v


def p6_causal_additive_dropout_eval(q, k, v):
    m = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril(diagonal=0)
    m = m.masked_fill(torch.logical_not(m), -float("inf"))
    p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + m, dim=-1)
    return torch.dropout(p, 0.5, False) @ v


def p7_permute_fp32_softmax_dropout(q, k, v):
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    p = torch.dropout(torch.softmax(s, dim=-1), 0.0, True).to(torch.float16)
    return p @ v.to(p.dtype)


def p8_permute_fp32_softmax(q, k, v):
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).to(torch.float32)
    return torch.softmax(s, dim=-1).to(torch.float16) @ v


def p9_scaled_q_dropout(q, k, v):
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    q = q / math.sqrt(q.size(-1))
    s = (q @ k.transpose(-2, -1)).to(torch.float32)
    p = torch.dropout(torch.softmax(s, dim=-1), 0.0, True).to(torch.float16)
    return p @ v.to(p.dtype)


def p10_scaled_q(q, k, v):
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    q = q / math.sqrt(q.size(-1))
    s = (q @ k.transpose(-2, -1)).to(torch.float32)
    return torch.softmax(s, dim=-1).to(torch.float16) @ v


def p11_transposed_inputs(q, k, v):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def p12_transposed_inputs_output_dropout(q, k, v):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)
    return F.dropout(out, p=0.4, training=False)


def p13_bmm_dropout_eval(q, k, v):
    p = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(p, p=0.5, training=False), v)


def prev13_clone_probs(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def prev14_mul_clone_probs(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def p14_bert_causal_additive(q, k, v):
    m = torch.ones(q.size(1), k.size(1), dtype=torch.bool, device=q.device).tril(diagonal=0)
    m = m.masked_fill(torch.logical_not(m), -float("inf"))
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    return (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + m).softmax(dim=-1).matmul(v)


def p15_distilbert_padding(q, k, v, pad):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    bs, k_len = q.size(0), k.size(-2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    m = (pad == 0).view((bs, 1, 1, k_len)).expand_as(scores)
    return torch.matmul(F.softmax(scores.masked_fill(m, -float("inf")), dim=-1), v)


def p16_bert_causal_dropout_eval(q, k, v):
    m = torch.ones(q.size(1), k.size(1), dtype=torch.bool, device=q.device).tril(diagonal=0)
    m = m.masked_fill(torch.logical_not(m), -float("inf"))
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    p = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + m).softmax(dim=-1)
    return F.dropout(p, p=0.4, training=False).matmul(v)


def p16_float_mask(q, k, v, m):
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    p = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + m).softmax(dim=-1)
    return F.dropout(p, p=0.4, training=False).to(dtype=q.dtype).matmul(v)


def p17_distilbert_padding_dropout_eval(q, k, v, pad):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    bs, k_len = q.size(0), k.size(-2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    m = (pad == 0).view((bs, 1, 1, k_len)).expand_as(scores)
    w = F.dropout(F.softmax(scores.masked_fill(m, -float("inf")), dim=-1), p=0.4, training=False)
    return torch.matmul(w, v)


def p18_gpt2_where(q, k, v, causal):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    w = torch.matmul(q, k.permute(0, 1, 3, 2))
    w = w.div(torch.full((), math.sqrt(v.size(-1)), dtype=q.dtype, device=q.device))
    w = torch.where(causal, w, torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device))
    return F.dropout(w.softmax(dim=-1), 0.0).matmul(v), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])


def p19_gpt2_where_and_additive(q, k, v, causal, m):
    w = torch.matmul(q, k.permute(0, 1, 3, 2))
    w = w.div(torch.full([], math.sqrt(v.size(-1)), dtype=w.dtype, device=w.device))
    w = torch.where(causal, w, torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device))
    w = (w + m).softmax(dim=-1).type(v.dtype)
    return F.dropout(w, 0.0).matmul(v)


def p20_distilbert_scaled_q(q, k, v, pad):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    bs, k_len = q.size(0), k.size(-2)
    q = q.div(math.sqrt(q.size(-1)))
    scores = q @ k.transpose(-2, -1)
    fill = torch.full((), -float("inf"), dtype=q.dtype, device=q.device)
    m = (pad == 0).view((bs, 1, 1, k_len)).expand_as(scores)
    return F.dropout(torch.softmax(scores.masked_fill(m, fill), dim=-1), 0.0) @ v


def p21_t5(q, k, v, m):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    score = torch.matmul(q, k.permute(0, 1, 3, 2))
    score = (score + m).type_as(q)
    return score.float().softmax(dim=-1).type_as(q).matmul(v)


def p22_t5_returns_kv(q, k, v, m):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    score = (torch.matmul(q, k.permute(0, 1, 3, 2)) + m).type_as(q)
    return score.float().softmax(dim=-1).type_as(q).matmul(v), k, v


def p23_t5_float_roundtrip(q, k, v):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    score = torch.matmul(q, k.permute(0, 1, 3, 2)).float().type_as(q)
    return score.float().softmax(dim=-1).type_as(q).matmul(v), k, v


def p24_mbart_bmm_views(q, k, v, m):
    bs, n_head, seq_len, head_size = q.shape
    q3 = q.view(bs * n_head, -1, head_size)
    k3 = k.reshape(bs * n_head, -1, head_size)
    v3 = v.reshape(bs * n_head, -1, head_size)
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = w.view(bs, n_head, seq_len, -1) + m
    w = F.softmax(w.view(bs * n_head, seq_len, -1), dim=-1)
    if q.dtype == torch.half:
        w = w.to(torch.half)
    return torch.bmm(w, v3).view(bs, n_head, seq_len, head_size)


def p25_t5_dropout(q, k, v, m):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    s = torch.matmul(q, k.permute(0, 1, 3, 2)) + m
    return F.dropout(s.float().softmax(dim=-1).type_as(q), 0.0).matmul(v)


def p27_t5_no_mask_dropout(q, k, v):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    s = torch.matmul(q, k.permute(0, 1, 3, 2))
    return F.dropout(s.float().softmax(dim=-1).type_as(q), 0.0).matmul(v), k, v


def p28_noncontiguous(q, k, v):
    p = torch.matmul(q, k.transpose(-2, -1)).mul(0.35).softmax(dim=-1)
    return F.dropout(p, p=0.0).matmul(v)


def p29_aten_mul_scalar_safe_softmax(q, k, v, m):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    c = 1.0 / math.sqrt(math.sqrt(q.size(-1)))
    q = torch.ops.aten.mul.Scalar(q, c)
    k = torch.ops.aten.mul.Scalar(k.transpose(-2, -1), c)
    return torch.ops.aten._safe_softmax(q @ k + m, -1) @ v


def p30_aten_mul_scalar_safe_softmax_no_mask(q, k, v):
    q, k, v = q.permute([0, 2, 1, 3]), k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])
    c = 1.0 / math.sqrt(math.sqrt(q.size(-1)))
    q = torch.ops.aten.mul.Scalar(q, c)
    k = torch.ops.aten.mul.Scalar(k.transpose(-2, -1), c)
    return torch.ops.aten._safe_softmax(q @ k, -1) @ v


def sdpa_call(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _ckpt(fn):
    def inner(*args):
        return checkpoint(fn, *args, use_reentrant=False)

    inner.__name__ = fn.__name__ + "_checkpoint"
    return inner


# ---------------------------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    fn: Callable
    make: Callable  # () -> list of inputs (q, k, v first)
    fuses: int  # rewrites fxopt must make (per compiled graph)
    train: bool = True  # also check gradients of q, k, v
    dynamic_batch: bool = False
    atol: float = 1e-5
    rtol: float = 1e-4
    extra: dict = field(default_factory=dict)


_HALF = dict(atol=2e-3, rtol=1e-2)


def _bshd(dtype=torch.float32, shape=(B, S, H, D)):
    return lambda: _qkv(shape, dtype)


def _bhsd(dtype=torch.float32, shape=(B, H, S, D)):
    return lambda: _qkv(shape, dtype)


def _with(*extra):
    def wrap(make):
        return lambda: make() + [e() for e in extra]

    return wrap


def _pad():  # [B, S] key padding: row b keeps keys j <= b + 3 (never a fully masked row)
    return (torch.arange(S)[None, :] <= torch.arange(B)[:, None] + 3).float()


def _causal_bool(Sq=S):
    return torch.ones(Sq, Sq, dtype=torch.bool).tril().view(1, 1, Sq, Sq)


def _float_mask(shape=(B, 1, 1, S), dtype=torch.float32):
    return lambda: _t(*shape, seed=7).to(dtype)


def _noncontiguous():
    return [torch.randn(B, 6, 32, 16, generator=torch.Generator().manual_seed(i)).transpose(1, 2) for i in range(3)]


CASES = [
    Case("p1_div_sqrt", p1_div_sqrt, _bhsd(), 1),
    Case("p1_div_sqrt_half", p1_div_sqrt, _bhsd(torch.half), 1, **_HALF),
    Case("p1_div_sqrt_checkpoint", _ckpt(p1_div_sqrt), _bhsd(), 1),
    Case("p1_div_sqrt_dynamic_batch", p1_div_sqrt, _bhsd(), 1, dynamic_batch=True),
    Case("p2_mul_inv_sqrt", p2_mul_inv_sqrt, _bhsd(), 1),
    Case("p2_mul_inv_sqrt_checkpoint", _ckpt(p2_mul_inv_sqrt), _bhsd(), 1),
    Case("p3_div_dropout_eval", p3_div_dropout_eval, _bhsd(), 1),
    Case("p4_mul_dropout_p0", p4_mul_dropout_p0, _bhsd(), 1),
    Case("p5_causal_additive", p5_causal_additive, _bhsd(), 1),
    Case("p5_causal_additive_checkpoint", _ckpt(p5_causal_additive), _bhsd(), 1),
    Case("p5_bool_zeros_added", p5_bool_zeros_added, _bhsd(), 1),
    Case("p6_causal_additive_dropout_eval", p6_causal_additive_dropout_eval, _bhsd(), 1),
    Case("p7_permute_fp32_softmax_dropout", p7_permute_fp32_softmax_dropout, _bshd(torch.half, (2, 4, 8, 16)), 1,
         **_HALF),
    Case("p8_permute_fp32_softmax", p8_permute_fp32_softmax, _bshd(torch.half, (2, 4, 8, 16)), 1, **_HALF),
    Case("p8_permute_fp32_softmax_checkpoint", _ckpt(p8_permute_fp32_softmax), _bshd(torch.half, (2, 4, 8, 16)), 1,
         **_HALF),
    Case("p9_scaled_q_dropout", p9_scaled_q_dropout, _bshd(torch.half, (2, 4, 8, 16)), 1, **_HALF),
    Case("p10_scaled_q", p10_scaled_q, _bshd(torch.half, (2, 4, 8, 16)), 1, **_HALF),
    Case("p11_transposed_inputs", p11_transposed_inputs, _bshd(), 1),
    Case("p12_transposed_inputs_output_dropout", p12_transposed_inputs_output_dropout, _bshd(), 1),
    Case("p13_bmm_dropout_eval", p13_bmm_dropout_eval, _bhsd(shape=(B * H, S, D)), 1),
    Case("prev13_clone_probs", prev13_clone_probs, _bhsd(), 1),
    Case("prev14_mul_clone_probs", prev14_mul_clone_probs, _bhsd(), 1),
    Case("p14_bert_causal_additive", p14_bert_causal_additive, _bshd(), 1),
    Case("p15_distilbert_padding", p15_distilbert_padding, _with(_pad)(_bshd()), 1),
    Case("p16_bert_causal_dropout_eval", p16_bert_causal_dropout_eval, _bshd(), 1),
    Case("p16_bert_causal_dropout_eval_bs1", p16_bert_causal_dropout_eval, _bshd(shape=(1, S, H, D)), 1),
    Case("p16_float_mask", p16_float_mask, _with(_float_mask((1, 1, S, S)))(_bshd()), 1),
    Case("p16_float_mask_half_q", p16_float_mask, _with(_float_mask((1, 1, S, S)))(_bshd(torch.half)),
         1, **_HALF),
    Case("p17_distilbert_padding_dropout_eval", p17_distilbert_padding_dropout_eval, _with(_pad)(_bshd()), 1),
    Case("p18_gpt2_where", p18_gpt2_where, _with(_causal_bool)(_bshd()), 1),
    Case("p19_gpt2_where_and_additive", p19_gpt2_where_and_additive,
         _with(_causal_bool, _float_mask((B, 1, 1, S)))(_bhsd()), 1),
    Case("p20_distilbert_scaled_q", p20_distilbert_scaled_q, _with(_pad)(_bshd()), 1),
    Case("p21_t5", p21_t5, _with(_float_mask((B, 1, 1, S)))(_bshd()), 1),
    Case("p21_t5_bs1", p21_t5, _with(_float_mask((1, 1, 1, S)))(_bshd(shape=(1, S, H, D))), 1),
    Case("p22_t5_returns_kv", p22_t5_returns_kv, _with(_float_mask((B, 1, 1, S)))(_bshd()), 1),
    Case("p23_t5_float_roundtrip", p23_t5_float_roundtrip, _bshd(), 1),
    Case("p24_mbart_bmm_views", p24_mbart_bmm_views, _with(_float_mask((B, 1, S, S)))(_bhsd()), 1),
    Case("p24_mbart_bmm_views_half", p24_mbart_bmm_views,
         _with(_float_mask((B, 1, S, S)))(_bhsd(torch.half)), 1, atol=5e-3, rtol=1e-2),  # unscaled fp16 scores
    Case("p25_t5_dropout", p25_t5_dropout, _with(_float_mask((B, 1, 1, S)))(_bshd()), 1),
    Case("p27_t5_no_mask_dropout", p27_t5_no_mask_dropout, _bshd(), 1),
    Case("p28_noncontiguous", p28_noncontiguous, _noncontiguous, 1),
    Case("p29_aten_mul_scalar_safe_softmax", p29_aten_mul_scalar_safe_softmax,
         _with(_float_mask((B, 1, 1, S)))(_bshd()), 1),
    Case("p30_aten_mul_scalar_safe_softmax_no_mask", p30_aten_mul_scalar_safe_softmax_no_mask, _bshd(), 1),
    Case("sdpa_call", sdpa_call, _bhsd(), 1),
]


def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def run_case(c: Case, backend: Backend, training: bool):
    """Eager and compiled outputs (and q, k, v gradients when ``training``) of case ``c``, compared; the number of
    attention rewrites of the compiled graphs."""
    torch._dynamo.reset()
    base = c.make()
    results = []
    compiled = torch.compile(c.fn, backend=backend, fullgraph=True)
    for f in (c.fn, compiled):
        args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in base]
        if training:
            for a in args[:3]:
                a.requires_grad_()
        if c.dynamic_batch and f is compiled:
            for a in args[:3]:
                torch._dynamo.mark_dynamic(a, 0)
        with torch.set_grad_enabled(training):
            outs = _leaves(f(*args))
        got = [o.detach() for o in outs]
        if training:
            w = torch.linspace(-1, 1, outs[0].numel()).view_as(outs[0]).to(outs[0].dtype)
            (outs[0] * w).sum().backward()
            got += [a.grad for a in args[:3]]
        results.append(got)
    for ref, out in zip(*results):
        torch.testing.assert_close(out, ref, atol=c.atol, rtol=c.rtol, equal_nan=True)
    attn = [r for res in backend.results for r in res if r.name == "attention"]
    return sum(r.rewrites for r in attn), [s.reason for r in attn for s in r.skipped]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_inductor_form(case, training):
    if training and not case.train:
        pytest.skip("inference-only case")
    backend = Backend(inductor=False)
    rewrites, reasons = run_case(case, backend, training)
    assert rewrites == case.fuses * len(backend.results), reasons


def test_inductor_forms_fused_count():
    """How many of the forms fxopt fuses, in inference, over every case."""
    fused = 0
    for c in CASES:
        backend = Backend(inductor=False)
        rewrites, _ = run_case(c, backend, training=False)
        fused += rewrites == len(backend.results) >= 1
    assert fused >= FUSED_AT_LEAST, f"{fused} of {len(CASES)} forms fused"


FUSED_AT_LEAST = len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["p1_div_sqrt_checkpoint", "p15_distilbert_padding", "p24_mbart_bmm_views",
                                  "p29_aten_mul_scalar_safe_softmax"])
def test_inductor_form_through_inductor(name):
    (case,) = [c for c in CASES if c.name == name]
    backend = Backend()
    rewrites, reasons = run_case(case, backend, training=True)
    assert rewrites == case.fuses * len(backend.results), reasons
