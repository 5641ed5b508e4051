"""Translation validation of the attention pass: random attention-like functions, compiled vs eager.

Each seed draws one function from a small grammar: positive forms (scale spellings, q/k/v layouts, GQA repeats,
causal / padding / tensor masks with fills that mask, casts that keep precision, dropout off) and near-misses (the
softmax over another dim, a mask applied after the softmax, fills that do not mask, rounding casts, an in-place write
inside the region, empty and size-1 dims, fully masked rows, fp16 / bf16 scores). The compiled function
(``fxopt_eager``: the passes, no Inductor) must give eager's outputs and gradients, NaN where eager gives NaN. A
small seed count runs always; ``-m slow`` runs thousands.
"""
import math
import random

import pytest
import torch

from fxopt.backends import Backend


def _case(seed: int):
    r = random.Random(seed)
    c = {
        "dtype": r.choice([torch.float32] * 4 + [torch.float16, torch.bfloat16]),
        "layout": r.choice(["bhsd", "bshd", "einsum"]),
        "gqa": r.random() < 0.3,
        "scale": r.choice(["div", "mul", "q", "none"]),
        "mask": r.choice(["none", "causal", "pad", "causal_pad", "tensor_bool", "tensor_add", "window"]),
        "how": r.choice(["masked_fill", "where", "add_where", "iadd_where"]),
        "fill": r.choice(["-inf", "min", "min", "0", "-1", "5"]),
        "near": r.choice([None] * 6 + ["dim", "after", "cast", "mutate", "prob_cast_up"]),
        "Sq": r.choice([1, 3, 5, 8]),
        "Sk": None,
        "B": r.choice([1, 2]),
        "train": r.random() < 0.4,
        "fp32_softmax": r.random() < 0.5,
    }
    c["Sk"] = c["Sq"] if c["mask"] in ("causal", "causal_pad", "window") or r.random() < 0.6 else r.choice([1, 4, 9])
    if r.random() < 0.03:
        c["Sq" if r.random() < 0.5 else "Sk"] = 0
    return c


def _build(c):
    dt = c["dtype"]

    def fn(q, k, v, pad, m):
        if c["layout"] == "bshd":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if c["gqa"]:
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        Sq, Sk = q.shape[2], k.shape[2]
        if c["scale"] == "q":
            q = q * 0.25
        if c["layout"] == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        else:
            s = q @ k.transpose(-1, -2)
        if c["scale"] == "div":
            s = s / 4.0
        elif c["scale"] == "mul":
            s = s * 0.25
        if c["near"] == "mutate":
            k.mul_(2)
        i = torch.arange(Sq)[:, None] + (Sk - Sq)
        j = torch.arange(Sk)[None, :]
        keep = None
        if c["mask"] in ("causal", "causal_pad"):
            keep = j <= i
        if c["mask"] == "window":
            keep = (j <= i) & (i - j < 3)
        if c["mask"] in ("pad", "causal_pad"):
            kp = pad[:, None, None, :Sk]
            keep = kp if keep is None else keep & kp
        if c["mask"] == "tensor_bool":
            keep = m[..., :Sq, :Sk] > -0.8
        if c["mask"] == "tensor_add":
            s = s + m[..., :Sq, :Sk].to(s.dtype)
        if keep is not None and c["near"] != "after":
            f = {"-inf": -math.inf, "min": torch.finfo(s.dtype).min, "0": 0.0, "-1": -1.0, "5": 5.0}[c["fill"]]
            if c["how"] == "masked_fill":
                s = s.masked_fill(~keep, f)
            elif c["how"] == "where":
                s = torch.where(keep, s, f)
            elif c["how"] == "add_where":
                s = s + torch.where(keep, 0.0, f).to(s.dtype)
            else:
                s += torch.where(keep, 0.0, f).to(s.dtype)
        if c["fp32_softmax"]:
            s = s.float()
        p = s.softmax(-2 if c["near"] == "dim" else -1)
        if keep is not None and c["near"] == "after":
            p = p * keep
        if c["near"] == "cast":
            p = p.to(torch.bfloat16 if dt != torch.bfloat16 else torch.float16)
        if c["near"] == "prob_cast_up":
            p = p.double()
        p = p.to(v.dtype)
        if c["layout"] == "einsum":
            return torch.einsum("bhqk,bhkd->bhqd", p, v)
        return p @ v

    return fn


def _inputs(c, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)  # drawn on the CPU, then moved: same values on every device
    H, Hkv, D = 4, 2 if c["gqa"] else 4, 16
    B, Sq, Sk = c["B"], c["Sq"], c["Sk"]

    def t(h, s):
        shape = (B, s, h, D) if c["layout"] == "bshd" else (B, h, s, D)
        return torch.randn(shape, generator=g, device="cpu").to(torch.get_default_device(), c["dtype"])

    q, k, v = t(H, Sq), t(Hkv, Sk), t(Hkv, Sk)
    pad = torch.ones(B, max(Sk, 1), dtype=torch.bool)
    if B > 1 and Sk > 1:
        pad[1, : min(Sk - 1, 2 + seed % 3)] = False  # left padding: some rows may see no key at all
    if seed % 7 == 0 and Sk:
        pad[0] = False  # every key of one batch row masked
    m = torch.randn(1, 1, max(Sq, 1), max(Sk, 1), generator=g, device="cpu").to(torch.get_default_device())
    if c["mask"] == "tensor_add" and seed % 2:
        m = torch.where(m > 0.9, -math.inf, m)
    return q, k, v, pad, m


def _tol(c):
    if c["dtype"] == torch.float32:  # on CUDA the kernels sum in another order than eager's matmul
        cuda = torch.get_default_device().type == "cuda"
        return dict(atol=1e-4, rtol=1e-3) if cuda else dict(atol=1e-5, rtol=1e-4)
    return dict(atol=5e-2, rtol=2e-2)


def _run_case(seed):
    c = _case(seed)
    fn = _build(c)
    args = _inputs(c, seed)
    results = []
    torch._dynamo.reset()
    backend = Backend(inductor=False)
    for f in (fn, torch.compile(fn, backend=backend)):
        a = [x.clone() for x in args]
        if c["train"]:
            for x in a[:3]:
                x.requires_grad_(c["near"] != "mutate")
        try:
            out = f(*a)
        except Exception as e:  # eager itself may reject the form (a near-miss); compiled must reject it too
            results.append(("error", type(e).__name__))
            continue
        grads = []
        if c["train"] and out.requires_grad and out.numel():
            w = torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)
            (out * w).sum().backward()
            grads = [x.grad for x in a[:3]]
        results.append((out.detach(), grads))
    (ref, rg), (got, gg) = results
    if ref == "error" or got == "error":
        assert results[0] == results[1], (seed, c, results)
        return backend
    torch.testing.assert_close(got, ref, equal_nan=True, **_tol(c), msg=lambda m: f"seed {seed} {c}: {m}")
    for a, b in zip(rg, gg):
        if a is None or b is None:
            assert a is b, (seed, c)
            continue
        torch.testing.assert_close(b, a, equal_nan=True, **_tol(c), msg=lambda m: f"seed {seed} {c} grad: {m}")
    return backend


@pytest.mark.parametrize("seed", range(40))
def test_generated_attention(seed):
    _run_case(seed)


@pytest.mark.slow
def test_generated_attention_many():
    rewritten = 0
    for seed in range(40, 2040):
        backend = _run_case(seed)
        rewritten += sum(r.rewrites for res in backend.results for r in res if r.name == "attention")
    assert rewritten > 200  # the grammar's positive forms are fused, not only left alone


@pytest.mark.gpu
def test_generated_attention_cuda():
    """The same cases on CUDA (the Triton / Gluon kernels instead of the CPU reference): zero wrong."""
    with torch.device("cuda"):
        for seed in range(150):
            _run_case(seed)
