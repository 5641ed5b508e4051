"""Triton kernels, each reached only through its ``torch.ops.fxopt.*`` custom op.

Each kernel module registers its own ops when imported; ``fxopt.kernels.ops`` imports them all (passes import that).
"""
import functools


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code. ``triton.cdiv`` is a ``ConstexprFunction``: about 1.6 us per call from Python,
    and a launch computes several of these."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see :func:`cdiv`)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def has_pdl(device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``, Triton's ``launch_pdl``) needs sm_90 or newer. ``device``:
    a CUDA ``torch.device``."""
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def device_capability(device) -> tuple:
    """``torch.cuda.get_device_capability``, queried once per device: the support checks run on every call."""
    import torch

    return torch.cuda.get_device_capability(device)


def jit_like_source(kernel, ptrs: dict, ints: dict, floats: tuple, meta: dict):
    """``triton.compiler.ASTSource`` of ``kernel`` specialized the way the JIT would for these arguments, for
    offline sm_90 builds: pointers 16-byte aligned, an int equal to 1 a constant, other ints i32 with the
    divisibility-by-16 hint when they are multiples of 16, ``floats`` fp32, every other parameter a constexpr from
    ``meta``. Without the hints the build is not the one the GPU runs (a decode build went from 107 to 255
    registers without them, session 8)."""
    from triton.compiler import ASTSource

    sig, consts, attrs = {}, {}, {}
    for i, prm in enumerate(kernel.params):
        n = prm.name
        if n in ptrs:
            sig[n], attrs[(i,)] = ptrs[n], [["tt.divisibility", 16]]
        elif n in floats:
            sig[n] = "fp32"
        elif n in ints:
            if ints[n] == 1:
                sig[n], consts[(i,)] = "constexpr", 1
            else:
                sig[n] = "i32"
                if ints[n] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n], consts[(i,)] = "constexpr", meta[n]
    return ASTSource(kernel, sig, consts, attrs)
