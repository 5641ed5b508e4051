"""Shared inputs and checks of the W4A16 kernel tests."""
import torch

from fxopt.quant.format import dequantize, pack_int4


def make_packed(K, N, group_size, dtype, device="cpu", seed=0):
    """Random codes, scales and (non-integer as well as integer) zeros; never all-zero."""
    g = torch.Generator().manual_seed(seed)
    G = K if group_size == -1 else group_size
    codes = torch.randint(0, 16, (K, N), generator=g)
    qweight = pack_int4(codes)
    scales = (torch.rand(K // G, N, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(4, 12, (K // G, N), generator=g).float()
    zeros[0] += 0.5  # a non-integer zero row (float zero points must work too)
    return qweight.to(device), scales.to(device), zeros.to(dtype).to(device), G


def reference(x, qweight, scales, zeros, G, bias=None):
    w = dequantize(qweight.cpu(), scales.cpu(), zeros.cpu(), G, dtype=torch.float64)
    y = x.cpu().double() @ w.T
    if bias is not None:
        y = y + bias.cpu().double()
    return y


def assert_close_to_ref(y, ref, dtype):
    y = y.cpu().double()
    assert y.shape == ref.shape
    scale = ref.abs().max().item()
    assert scale > 0
    tol = (2e-3 if dtype == torch.float16 else 1.6e-2) * scale + 1e-3
    err = (y - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g} (|ref| max {scale:.3g})"


def is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def fake_cuda(monkeypatch, capability=(9, 0)):
    """Make candidate lists believe a CUDA device of ``capability`` is there (no kernel runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
