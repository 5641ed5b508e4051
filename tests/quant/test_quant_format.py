"""fxopt's packed int4 format and QuantLinear: exact pack/unpack round trips, eager correctness against a float64
reference written here from the format's definition, act-order canonicalization, replace_linears."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.quant.checkpoint import AWQ_ORDER, GPTQ_ORDER, pack_along_n, unpack_along_n
from fxopt.quant.format import PackedW4, pack_int4, quantize_rtn, unpack_int4
from fxopt.quant.linear import QuantLinear, canonical_perm, replace_linears


def _codes(draw_seed, K, N):
    g = torch.Generator().manual_seed(draw_seed)
    return torch.randint(0, 16, (K, N), generator=g)


def ref_weight(qweight, scales, zeros, group_size, perm=None):
    """float64 W [N, K] in the original feature order, read bit by bit from the format's definition."""
    Kp, N = qweight.shape
    K = Kp * 8
    q = torch.empty(K, N, dtype=torch.float64)
    for k in range(K):
        q[k] = ((qweight[k // 8].to(torch.int64) >> (4 * (k % 8))) & 0xF).double()
    g = torch.arange(K) // group_size
    w_stored = (q - zeros.double()[g]) * scales.double()[g]  # [K, N], stored order
    w = torch.empty_like(w_stored)
    if perm is None:
        w = w_stored
    else:
        w[perm] = w_stored
    return w.T


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kp=st.integers(1, 6), n=st.integers(1, 9))
def test_pack_unpack_int4_round_trip(seed, kp, n):
    codes = _codes(seed, kp * 8, n)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (kp, n)
    assert torch.equal(unpack_int4(packed).long(), codes)
    # bit-level definition: nibble j of row i is codes[8i + j]
    i, j, c = kp - 1, 7, n - 1
    assert (int(packed[i, c]) >> (4 * j)) & 0xF == int(codes[8 * i + j, c])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), r=st.integers(1, 5), c=st.integers(1, 4),
       order=st.sampled_from([GPTQ_ORDER, AWQ_ORDER]))
def test_pack_along_n_round_trip_and_definition(seed, r, c, order):
    codes = _codes(seed, r, c * 8)
    packed = pack_along_n(codes, order)
    assert packed.dtype == torch.int32 and packed.shape == (r, c)
    assert torch.equal(unpack_along_n(packed, order), codes)
    for col in range(c):
        for i in range(8):
            assert (int(packed[0, col]) >> (4 * i)) & 0xF == int(codes[0, 8 * col + order[i]])


def test_packed_all_ones_wraps_to_int32():
    packed = pack_int4(torch.full((8, 3), 15))
    assert torch.equal(packed, torch.full((1, 3), -1, dtype=torch.int32))
    assert torch.equal(pack_along_n(torch.full((2, 8), 15)), torch.full((2, 1), -1, dtype=torch.int32))


def _random_packed(K, N, G, dtype=torch.float16, perm=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (K, N), generator=g))
    scales = (torch.rand(K // G, N, generator=g) * 0.05 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (K // G, N), generator=g).to(dtype)
    return PackedW4(qweight, scales, zeros, G, perm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_eager_matches_reference(dtype, bias):
    K, N, G = 64, 24, 32
    p = _random_packed(K, N, G, dtype)
    b = torch.randn(N).to(dtype) if bias else None
    m = QuantLinear.from_packed(p, b)
    x = torch.randn(2, 3, K).to(dtype)
    w = ref_weight(p.qweight, p.scales, p.zeros, G)
    ref = x.double() @ w.T + (b.double() if bias else 0)
    y = m(x)
    assert y.dtype == dtype and y.shape == (2, 3, N)
    tol = {torch.float16: 2e-2, torch.bfloat16: 1.5e-1, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_quant_linear_fp32_activations_with_fp16_scales():
    p = _random_packed(32, 16, 32)
    m = QuantLinear.from_packed(p, torch.randn(16))
    x = torch.randn(4, 32)
    y = m(x)
    assert y.dtype == torch.float32
    ref = x.double() @ ref_weight(p.qweight, p.scales, p.zeros, 32).T + m.bias.double()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)


def test_act_order_linear_matches_reference_and_is_canonical():
    K, N, G = 64, 16, 16
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(3))
    p = _random_packed(K, N, G, torch.float32, perm=perm)
    w = ref_weight(p.qweight, p.scales, p.zeros, G, perm)  # defined by the given (non-canonical) perm
    m = QuantLinear.from_packed(p)
    assert m.perm is not None and m.perm.dtype == torch.int64
    # canonical: each group's features ascending, same set of features per group as before
    for gi in range(K // G):
        grp = m.perm[gi * G:(gi + 1) * G]
        assert torch.equal(grp, grp.sort().values)
        assert torch.equal(grp, perm[gi * G:(gi + 1) * G].sort().values)
    x = torch.randn(5, K)
    torch.testing.assert_close(m(x).double(), x.double() @ w.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(m.dequantized_weight().double(), w, atol=1e-6, rtol=1e-6)


def test_canonical_perm_identity_and_errors():
    p = _random_packed(32, 8, 8)
    q, perm = canonical_perm(p.qweight, torch.arange(32), 8)
    assert perm is None and torch.equal(q, p.qweight)
    # permuting only inside groups is the identity too (rows are reordered accordingly)
    within = torch.arange(32).view(4, 8).flip(1).reshape(-1)
    q, perm = canonical_perm(p.qweight, within, 8)
    assert perm is None
    assert torch.equal(unpack_int4(q), unpack_int4(p.qweight)[within.argsort()])
    with pytest.raises(ValueError, match="not a permutation"):
        canonical_perm(p.qweight, torch.zeros(32, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="perm must be"):
        canonical_perm(p.qweight, torch.arange(16), 8)


@pytest.mark.parametrize("sym", [False, True])
def test_from_linear_rtn(sym):
    torch.manual_seed(0)
    lin = nn.Linear(64, 16).half()
    m = QuantLinear.from_linear(lin, group_size=32, sym=sym)
    assert (m.in_features, m.out_features, m.group_size) == (64, 16, 32)
    assert m.scales.dtype == torch.float16 and m.bias.dtype == torch.float16
    if sym:
        assert bool((m.zeros == 8).all())
    w = ref_weight(m.qweight, m.scales, m.zeros, 32)
    # RTN error is at most half a step (plus clamping at the range ends, where the step bounds it)
    step = m.scales.double().repeat_interleave(32, 0).T
    assert bool(((w - lin.weight.double()).abs() <= step * 0.5 + 1e-3).all())
    p = quantize_rtn(lin.weight, 32, sym)
    assert torch.equal(m.qweight, p.qweight) and torch.equal(m.scales, p.scales)


def test_quant_linear_state_dict_and_errors():
    m = QuantLinear(64, 16, group_size=-1, bias=True)
    assert m.group_size == 64 and set(m.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    with pytest.raises(ValueError, match="group size 48 does not divide"):
        QuantLinear(64, 16, group_size=48)
    with pytest.raises(ValueError, match="bias must be"):
        QuantLinear.from_packed(_random_packed(32, 8, 32), torch.zeros(9))


def test_replace_linears_forms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not nn.Linear"):
        replace_linears(model, ["0", "1"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    names = replace_linears(model, ["0", "2.0"], group_size=16)
    assert names == ["0", "2.0"]
    assert isinstance(model[0], QuantLinear) and isinstance(model[2][0], QuantLinear)
    assert isinstance(model[2][1], nn.Linear)
    names = replace_linears(model, lambda n, m: QuantLinear.from_linear(m, group_size=8) if n == "2.1" else None)
    assert names == ["2.1"] and isinstance(model[2][1], QuantLinear)
    model2 = nn.Sequential(nn.Linear(8, 8))
    q = QuantLinear.from_linear(model2[0], group_size=8)
    assert replace_linears(model2, {"0": q}) == ["0"] and model2[0] is q
