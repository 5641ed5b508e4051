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
