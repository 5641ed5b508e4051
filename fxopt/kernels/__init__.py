"""Triton kernels, each reached only through its ``torch.ops.fxopt.*`` custom op.

Each kernel module registers its own ops when imported; ``fxopt.kernels.ops`` imports them all (passes import that).
"""
import functools
import threading


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code. ``triton.cdiv`` is a ``ConstexprFunction``: about 1.6 us per call from Python,
    and a launch computes several of these."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see :func:`cdiv`)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def outside_graph_pools(fn):
    """``fn()`` with its CUDA allocations taken from the ordinary caching allocator, never from a CUDA-graph pool.

    Inductor's CUDA-graph trees route every allocation of the calling thread to their private pool during a graph's
    warm-up run, and then refuse a pool tensor that is not an output of the graph ("tensor(s) in the cudagraph pool
    not tracked as outputs"). A buffer that a kernel keeps across calls (split-K workspaces, tile counters) or memory
    that the W4A16 tuner times with must therefore be allocated outside that routing: the pool is bound to a thread,
    so ``fn`` runs in a short-lived thread of its own. The caller's stream is synchronised first (``fn`` may read the
    caller's tensors on its own stream) and ``fn``'s work is finished before this returns. Not for use while the
    calling stream is being captured.
    """
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


def jit_like_source(kernel, ptrs: dict, ints: dict, floats: tuple, meta: dict):
    """``triton.compiler.ASTSource`` of ``kernel`` specialized the way the JIT would for these arguments, for
    offline sm_90 builds: pointers 16-byte aligned, an int equal to 1 a constant, other ints i32 with the
    divisibility-by-16 hint when they are multiples of 16, ``floats`` fp32, every other parameter a constexpr from
    ``meta``. Without the hints the build is not the one the GPU runs (a decode build went from 107 to 255
    registers without them)."""
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
