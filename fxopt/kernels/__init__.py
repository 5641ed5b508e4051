"""Triton kernels, each reached only through its ``torch.ops.fxopt.*`` custom op; each kernel module registers its
ops when imported (``fxopt.kernels.ops`` imports them all).
"""
import functools
import threading


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (``triton.cdiv`` costs about 1.6 us per call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see :func:`cdiv`)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def outside_graph_pools(fn):
    """``fn()`` with its CUDA allocations from the ordinary caching allocator, never from a CUDA-graph pool: run in a
    short-lived thread after a sync of the caller's stream (CUDA-graph trees route the calling thread's allocations
    to their pool during a warm-up run). Not for use while capturing."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return fn()
    torch.cuda.current_stream().synchronize()
    device = torch.cuda.current_device()
    box = {}

    def run():
        try:
            torch.cuda.set_device(device)
            box["value"] = fn()
            torch.cuda.synchronize(device)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="fxopt-outside-graph-pools")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


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


from ._common import kernel_config, use_kernels  # noqa: E402,F401  (the kernel choices in force)
