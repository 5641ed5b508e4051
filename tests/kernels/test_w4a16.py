"""W4A16 kernels and ops (fxopt/kernels/w4a16/) against a float64 dequantized reference.

CPU: the Triton tiles (swapx / swapd), gemv1 and the dequant kernel run through the interpreter (fp16, tiny shapes);
the ops run their reference path. GPU (``@pytest.mark.gpu``): every build the tuner may pick, bf16 and fp16 at
realistic shapes. The mma kernel has its own file (test_w4a16_mma.py); the tuner too (test_w4a16_tuner.py).
"""
from dataclasses import replace

import pytest
import torch

from fxopt.kernels import w4a16 as K4
from fxopt.kernels.w4a16 import W4A16Config, common, dequantize_w4_triton, tuner, w4a16_matmul
from fxopt.quant.format import dequantize

from w4a16_helpers import assert_close_to_ref, is_sm90, make_packed, reference

SWAPX = W4A16Config(block_m=16, block_n=32, block_k=32, split_k=2, method="swapx")  # x permuted + summed first
SWAPX_NOSPLIT = W4A16Config(block_m=16, block_n=64, block_k=32, split_k=1, method="swapx")
SWAPX_BK64 = W4A16Config(block_m=16, block_n=64, block_k=64, split_k=1, method="swapx")  # two 32-column chunks
SWAPX_M32 = W4A16Config(block_m=32, block_n=32, block_k=32, split_k=3, method="swapx")
SWAPD = W4A16Config(block_m=16, block_n=32, block_k=32, split_k=2, method="swapd")  # dequantized before the dot
SWAPD_BK64 = W4A16Config(block_m=32, block_n=64, block_k=64, split_k=1, method="swapd")


@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("cfg,M", [(SWAPX, 5), (SWAPX_NOSPLIT, 17), (SWAPX_BK64, 2), (SWAPX_M32, 40)])
def test_swapx_matches_reference(interpret_device, group_size, cfg, M):
    K, N = 128, 48  # N not a multiple of block_n: exercises the column masks
    qweight, scales, zeros, G = make_packed(K, N, group_size, torch.float16, interpret_device)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).half().to(interpret_device)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, config=cfg)
    assert y.dtype == torch.float16 and y.shape == (M, N) and y.is_contiguous()
    assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.float16)


@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("cfg,M", [(SWAPD, 5), (SWAPD_BK64, 33)])
def test_swapd_matches_reference_with_integer_zeros(interpret_device, group_size, cfg, M):
    K, N = 128, 48
    qweight, scales, zeros, G = make_packed(K, N, group_size, torch.float16, interpret_device, seed=5)
    zeros = zeros.round()  # swapd's exact dequantization needs integer zeros
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6)).half().to(interpret_device)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, config=cfg)
    assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.float16)


def test_swapd_falls_back_on_fractional_zeros(interpret_device):
    """(OFFSET + z) in fp16 is not exact for a fractional z: swapd must run swapx instead, never round the zero."""
    K, N = 128, 48
    qweight, scales, zeros, G = make_packed(K, N, 32, torch.float16, interpret_device, seed=7)
    assert not torch.equal(zeros, zeros.round())
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(8)).half().to(interpret_device)
    y = w4a16_matmul(x, qweight, scales, zeros, 32, config=SWAPD)
    assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.float16)
    assert not common.integer_zeros(zeros)
    zeros.round_()  # an in-place change is seen (the cached answer is per tensor version)
    assert common.integer_zeros(zeros)


@pytest.mark.parametrize("cfg", [SWAPX, SWAPX_M32])
def test_swapx_bias_and_3d(interpret_device, cfg):
    K, N = 128, 64
    qweight, scales, zeros, G = make_packed(K, N, 128, torch.float16, interpret_device, seed=3)
    gen = torch.Generator().manual_seed(2)
    B, S = (1, 4) if cfg is SWAPX else (2, 17)
    x = torch.randn(B, S, K, generator=gen).half().to(interpret_device)
    bias = torch.randn(N, generator=gen).half().to(interpret_device)
    y = w4a16_matmul(x, qweight, scales, zeros, 128, bias=bias, config=cfg)
    assert y.shape == (B, S, N) and y.is_contiguous()
    ref = reference(x.reshape(-1, K), qweight, scales, zeros, G, bias).reshape(B, S, N)
    assert_close_to_ref(y, ref, torch.float16)


def test_triton_wrapper_default_config_paths(interpret_device):
    """No config given: the interpreter's fixed small-M (split-K) or larger-M tile."""
    K, N = 64, 32
    qweight, scales, zeros, G = make_packed(K, N, 64, torch.float16, interpret_device, seed=4)
    for M in (2, 20):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).half().to(interpret_device)
        y = w4a16_matmul(x, qweight, scales, zeros, 64)
        assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.float16)


def test_split_k_counters_reset(interpret_device):
    """The split-K fixup leaves its tile counters at zero, so repeated launches stay correct."""
    K, N = 128, 32
    qweight, scales, zeros, G = make_packed(K, N, 32, torch.float16, interpret_device, seed=5)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(5)).half().to(interpret_device)
    cfg = W4A16Config(block_m=16, block_n=32, block_k=32, split_k=4)
    y1 = w4a16_matmul(x, qweight, scales, zeros, 32, config=cfg)
    y2 = w4a16_matmul(x, qweight, scales, zeros, 32, config=cfg)
    assert torch.equal(y1, y2)
    assert int(common._COUNTERS[x.device].abs().sum()) == 0
    assert_close_to_ref(y2, reference(x, qweight, scales, zeros, G), torch.float16)


@pytest.mark.parametrize("group_size", [32, -1])
def test_triton_dequant_kernel(interpret_device, group_size):
    qweight, scales, zeros, G = make_packed(64, 40, group_size, torch.float16, interpret_device, seed=6)
    w = dequantize_w4_triton(qweight, scales, zeros, group_size)
    ref = dequantize(qweight.cpu(), scales.cpu(), zeros.cpu(), G, dtype=torch.float64)
    assert w.shape == (40, 64) and w.is_contiguous() and w.dtype == torch.float16
    torch.testing.assert_close(w.cpu().double(), ref, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- ops (CPU path)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_op_cpu_reference(dtype, shape):
    qweight, scales, zeros, G = make_packed(64, 24, 32, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(*shape, generator=gen).to(dtype)
    bias = torch.randn(24, generator=gen).to(dtype)
    y = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 32, bias)
    assert y.shape == (*shape[:-1], 24) and y.dtype == dtype and y.is_contiguous()
    ref = reference(x.reshape(-1, 64), qweight, scales, zeros, G, bias).reshape(*shape[:-1], 24)
    assert_close_to_ref(y, ref, dtype)


def test_op_dequantize_w4_cpu():
    qweight, scales, zeros, G = make_packed(128, 16, 64, torch.bfloat16, seed=9)
    w = torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, 64)
    assert w.shape == (16, 128) and w.dtype == torch.bfloat16 and w.is_contiguous()
    ref = dequantize(qweight, scales, zeros, G, dtype=torch.float64)
    torch.testing.assert_close(w.double(), ref, rtol=8e-3, atol=1e-5)
    w_pc = torch.ops.fxopt.dequantize_w4(*make_packed(128, 16, -1, torch.bfloat16, seed=9)[:3], -1)
    assert w_pc.shape == (16, 128)


def test_fake_impl_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    qweight, scales, zeros, _ = make_packed(64, 24, 32, torch.float16, seed=10)
    x = torch.randn(2, 3, 64).half()
    real = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 32)
    real_w = torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, 32)
    with FakeTensorMode() as mode:
        fx, fq, fs, fz = (mode.from_tensor(t) for t in (x, qweight, scales, zeros))
        fake = torch.ops.fxopt.w4a16_linear(fx, fq, fs, fz, 32)
        fake_w = torch.ops.fxopt.dequantize_w4(fq, fs, fz, 32)
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype
    assert fake_w.shape == real_w.shape and fake_w.stride() == real_w.stride() and fake_w.dtype == real_w.dtype


def test_opcheck():
    qweight, scales, zeros, _ = make_packed(64, 16, 32, torch.float16, seed=11)
    x = torch.randn(3, 64).half().requires_grad_()
    bias = torch.randn(16).half()
    torch.library.opcheck(torch.ops.fxopt.w4a16_linear.default, (x, qweight, scales, zeros, 32, bias))
    torch.library.opcheck(torch.ops.fxopt.w4a16_linear.default, (x.detach(), qweight, scales, zeros, 32, None))
    torch.library.opcheck(torch.ops.fxopt.dequantize_w4.default, (qweight, scales, zeros, 32))


def test_grad_wrt_x_and_bias():
    qweight, scales, zeros, G = make_packed(64, 16, 32, torch.float32 if False else torch.float16, seed=12)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 3, 64, generator=gen).half().requires_grad_()
    bias = torch.randn(16, generator=gen).half().requires_grad_()
    gy = torch.randn(2, 3, 16, generator=gen).half()
    torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 32, bias).backward(gy)
    w = dequantize(qweight, scales, zeros, G, dtype=torch.float64)
    torch.testing.assert_close(x.grad.double(), gy.double() @ w, rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(bias.grad.double(), gy.double().sum((0, 1)), rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("bad,match", [
    ("dtype", "must equal scales/zeros dtype"),
    ("kmismatch", "input features"),
    ("group", "group size"),
    ("qdtype", "qweight must be int32"),
    ("xdtype", "float16 or bfloat16"),
    ("bias", "bias must be"),
])
def test_clear_errors(bad, match):
    qweight, scales, zeros, _ = make_packed(64, 16, 32, torch.float16, seed=14)
    x = torch.randn(2, 64).half()
    args = dict(x=x, qweight=qweight, scales=scales, zeros=zeros, group_size=32, bias=None)
    if bad == "dtype":
        args["x"] = x.bfloat16()
    elif bad == "kmismatch":
        args["x"] = torch.randn(2, 72).half()
    elif bad == "group":
        args["group_size"] = 48
    elif bad == "qdtype":
        args["qweight"] = qweight.to(torch.int64)
    elif bad == "xdtype":
        args["x"], args["scales"], args["zeros"] = x.float(), scales.float(), zeros.float()
    elif bad == "bias":
        args["bias"] = torch.randn(15).half()
    with pytest.raises(ValueError, match=match):
        torch.ops.fxopt.w4a16_linear(**args)
    with pytest.raises(ValueError, match=match):
        w4a16_matmul(**args)


# ---------------------------------------------------------------------------------------------------- gemv1
def gemv1(block_n=256, block_k=128, split_k=2, num_warps=4, pdl=False):
    return W4A16Config(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps, method="gemv1",
                       pdl=pdl)


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("group_size,K,N,cfg", [
    (128, 256, 256, gemv1()),  # exact tiles, 2 K tiles split 2 ways
    (128, 384, 200, gemv1(split_k=3)),  # N not a multiple of block_n: column masks
    (-1, 200, 136, gemv1(block_n=128, split_k=2)),  # per-channel, K = 200: the last K tile is partial
    (32, 128, 48, gemv1(block_n=128, split_k=1)),  # group 32 (K tile 32, 4 warps of one packed row), no split
    (64, 512, 520, gemv1(block_n=512, num_warps=2, split_k=3)),  # 4 chunks of 128 columns, 4 rows per warp
])
def test_gemv1_matches_reference(interpret_device, M, use_bias, group_size, K, N, cfg):
    qweight, scales, zeros, G = make_packed(K, N, group_size, torch.float16, interpret_device, seed=K + N + M)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).half().to(interpret_device)
    bias = torch.randn(N, generator=gen).half().to(interpret_device) if use_bias else None
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, bias=bias, config=cfg)
    assert y.dtype == torch.float16 and y.shape == (M, N) and y.is_contiguous()
    assert_close_to_ref(y, reference(x, qweight, scales, zeros, G, bias), torch.float16)


def test_gemv1_bf16_3d_and_strided_rows(interpret_device):
    """bf16 (its activations are converted by bit operations, not by casts), 3-D input, and x rows taken from a wider
    tensor (row stride != K). The interpreter truncates when it converts to bf16, within the bf16 tolerance."""
    K, N = 256, 200
    qweight, scales, zeros, G = make_packed(K, N, 128, torch.bfloat16, interpret_device, seed=51)
    gen = torch.Generator().manual_seed(52)
    x = torch.randn(1, 3, K, generator=gen).bfloat16().to(interpret_device)
    bias = torch.randn(N, generator=gen).bfloat16().to(interpret_device)
    y = w4a16_matmul(x, qweight, scales, zeros, 128, bias=bias, config=gemv1(split_k=2))
    assert y.shape == (1, 3, N) and y.dtype == torch.bfloat16
    assert_close_to_ref(y.reshape(3, N), reference(x.reshape(3, K), qweight, scales, zeros, G, bias), torch.bfloat16)
    wide = torch.randn(2, K + 8, generator=gen).half().to(interpret_device)
    qh, sh, zh, Gh = make_packed(K, N, 128, torch.float16, interpret_device, seed=53)
    xs = wide[:, 8:]  # row stride K + 8, 16-byte aligned rows
    y = w4a16_matmul(xs, qh, sh, zh, 128, config=gemv1(split_k=2))
    assert_close_to_ref(y, reference(xs, qh, sh, zh, Gh), torch.float16)


def test_gemv1_workspace_and_counters_reset(interpret_device):
    """The split-K workspace (fp32, kept at zero between calls) and the tile counters are back at zero after each
    call, so that repeated calls, and calls of other shapes, stay correct."""
    K, N = 512, 256
    qweight, scales, zeros, G = make_packed(K, N, 128, torch.float16, interpret_device, seed=61)
    for M, split in ((1, 4), (3, 2), (1, 4)):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + split)).half().to(interpret_device)
        y = w4a16_matmul(x, qweight, scales, zeros, 128, config=gemv1(split_k=split))
        assert_close_to_ref(y, reference(x, qweight, scales, zeros, G), torch.float16)
        assert float(common._ZEROED_WS[x.device].abs().sum()) == 0.0
        assert int(common._COUNTERS[x.device].abs().sum()) == 0


def test_gemv1_rejects_bad_configs(interpret_device):
    qweight, scales, zeros, _ = make_packed(128, 64, 128, torch.float16, interpret_device, seed=62)
    x = torch.randn(5, 128).half().to(interpret_device)
    with pytest.raises(ValueError, match="M <= 4"):
        w4a16_matmul(x, qweight, scales, zeros, 128, config=gemv1())
    with pytest.raises(ValueError, match="block_n"):
        w4a16_matmul(x[:2], qweight, scales, zeros, 128, config=gemv1(block_n=64))


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 7, 16, 64, 200, 1024])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_gpu_op_realistic(dtype, M, group_size):
    K, N = 4096, 2048 + 64
    qweight, scales, zeros, G = make_packed(K, N, group_size, dtype, "cuda", seed=M)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda()
    y = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, group_size, bias)
    assert y.dtype == dtype and y.shape == (M, N)
    ref = reference(x, qweight, scales, zeros, G, bias)
    assert_close_to_ref(y, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 16, 48, 128, 200, 512])
def test_gpu_every_candidate_config(dtype, M):
    """Each config the tuner may choose is correct (not only the winner), for integer zeros (swapd listed) and
    fractional ones (swapd not listed)."""
    K, N = 1024, 1024
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=21)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype).cuda()
    for z, integer in ((zeros.round(), True), (zeros + 0.25, False)):
        ref = reference(x, qweight, scales, z, G)
        cands = K4.candidate_configs(M, N, K, 128, integer_zeros=integer, dtype=dtype, device=x.device)
        assert integer or not any(c.method == "swapd" for c in cands)
        for cfg in cands:
            y = w4a16_matmul(x, qweight, scales, z, 128, config=cfg)
            assert_close_to_ref(y, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_swapd(dtype):
    """The experimental "swapd" method (packed bf16x2/f16x2 dequantization in PTX) against the float reference."""
    K, N = 2048, 1024 + 64
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=31)
    zeros = zeros.round()
    for M in (1, 16, 40, 64, 128):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype).cuda()
        ref = reference(x, qweight, scales, zeros, G)
        for bm, bn, split in ((16, 64, 4), (16, 128, 2), (64, 64, 2), (64, 128, 1), (128, 64, 1)):
            if bm < M and bm < 64:
                continue
            cfg = W4A16Config(bm, bn, 128, split, 4, 3, "swapd", pdl=True)
            y = w4a16_matmul(x, qweight, scales, zeros, 128, config=cfg)
            assert_close_to_ref(y, ref, dtype)


@pytest.mark.gpu
def test_gpu_3d_group32_and_grad():
    K, N = 2048, 1024
    qweight, scales, zeros, G = make_packed(K, N, 32, torch.bfloat16, "cuda", seed=22)
    x = torch.randn(2, 9, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 32)
    assert_close_to_ref(y.detach().reshape(-1, N), reference(x.detach().reshape(-1, K), qweight, scales, zeros, G),
                        torch.bfloat16)
    gy = torch.randn_like(y)
    y.backward(gy)
    w = dequantize(qweight.cpu(), scales.cpu(), zeros.cpu(), G, dtype=torch.float64)
    ref_g = gy.cpu().double().reshape(-1, N) @ w
    assert_close_to_ref(x.grad.reshape(-1, K), ref_g, torch.bfloat16)
    w_gpu = torch.ops.fxopt.dequantize_w4(qweight, scales, zeros, 32)
    torch.testing.assert_close(w_gpu.cpu().double(), w, rtol=8e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("M", [1, 5, 16, 32, 64, 128, 256])
def test_gpu_gluon(M, use_bias):
    """Every "gluon" config the tuner may choose, through the op's wrapper, against the float reference (bf16,
    integer zeros); then the op with the tuner free to pick it."""
    dtype, K, N = torch.bfloat16, 1024, 2048
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=41)
    zeros = zeros.round()
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda() if use_bias else None
    ref = reference(x, qweight, scales, zeros, G, bias)
    cands = [c for c in K4.candidate_configs(M, N, K, 128, integer_zeros=True, dtype=dtype, device=x.device)
             if c.method == "gluon"]
    assert cands
    for cfg in cands:
        y = w4a16_matmul(x, qweight, scales, zeros, 128, bias=bias, config=cfg)
        assert y.dtype == dtype and y.shape == (M, N)
        assert_close_to_ref(y, ref, dtype)
    assert_close_to_ref(torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 128, bias), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, -1])
def test_gpu_gemv1(dtype, group_size):
    """Every "gemv1" candidate the tuner may time (M = 1..4, bias on and off, PDL included), plus a partial column
    tile, against the float reference on CUDA; three launches each (the workspace and counters must come back to
    zero); then 3-D input."""
    K, N = 4096, 2048 + 64
    qweight, scales, zeros, G = make_packed(K, N, group_size, dtype, "cuda", seed=71)
    gs = K if group_size == -1 else group_size
    for M in (1, 2, 3, 4):
        gen = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=gen).to(dtype).cuda()
        bias = torch.randn(N, generator=gen).to(dtype).cuda()
        cands = [c for c in K4.candidate_configs(M, N, K, gs, device=x.device) if c.method == "gemv1"]
        assert cands
        refs = {id(b): reference(x, qweight, scales, zeros, G, b) for b in (None, bias)}
        for cfg in cands + [replace(cands[0], block_n=512, split_k=3)]:
            for b in (None, bias):
                ref = refs[id(b)]
                for _ in range(3):
                    y = w4a16_matmul(x, qweight, scales, zeros, group_size, bias=b, config=cfg)
                    assert y.dtype == dtype and y.shape == (M, N)
                    assert_close_to_ref(y, ref, dtype)
        torch.cuda.synchronize()
        assert float(common._ZEROED_WS[x.device].abs().sum()) == 0.0
    x3 = torch.randn(1, 3, K, device="cuda").to(dtype)
    y3 = w4a16_matmul(x3, qweight, scales, zeros, group_size, config=cands[0])
    assert_close_to_ref(y3.reshape(3, N), reference(x3.reshape(3, K), qweight, scales, zeros, G), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not is_sm90(), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize("M", [300, 1024])
def test_gpu_gluon_large_m_and_fused_only(M):
    """Every fused candidate listed above M = 256 (``dequant_matmul="off"``: the Gluon tiles among them) against the
    float reference, bias on."""
    dtype, K, N = torch.bfloat16, 1024, 2048
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=43)
    zeros = zeros.round()
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda()
    ref = reference(x, qweight, scales, zeros, G, bias)
    cands = K4.candidate_configs(M, N, K, 128, integer_zeros=True, dtype=dtype, device=x.device,
                                 routes=K4.Routes(dequant_matmul="off"))
    assert any(c.method == "gluon" for c in cands) and all(c.method != "dequant_matmul" for c in cands)
    for cfg in cands:
        y = w4a16_matmul(x, qweight, scales, zeros, 128, bias=bias, config=cfg)
        assert_close_to_ref(y, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 8192])
def test_gpu_output_head_shape_writes_nothing_outside_its_output(M):
    """An output head (K = 4096, N = 128256: Llama-3's vocabulary) through the op: the result as the reference's and
    no byte of a guard buffer around the output changed (an end-to-end run with the head quantized ended in a
    device-side assert in a later kernel, as an out-of-bounds write would)."""
    K, N = 4096, 128256
    dtype = torch.bfloat16
    qweight, scales, zeros, G = make_packed(K, N, 128, dtype, "cuda", seed=3)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype).cuda()
    guard = torch.full((4 << 20,), 7, dtype=torch.int32, device="cuda")
    y = torch.ops.fxopt.w4a16_linear(x, qweight, scales, zeros, 128, None)
    torch.cuda.synchronize()
    assert bool((guard == 7).all()), "a W4A16 kernel wrote outside its output"
    rows = slice(0, M) if M <= 64 else slice(M - 64, M)  # the last rows: where a large-M offset overflow lands
    ref = reference(x[rows], qweight, scales, zeros, G)
    assert_close_to_ref(y[rows], ref, dtype)
