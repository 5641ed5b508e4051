"""What the Gluon (``triton.experimental.gluon``) attention builds share: the Hopper imports, host-side descriptor
layouts, the TMA stride rules and the device helper that views a shared-memory slot as a TMA box.

Gluon ships with Triton >= 3.5. Without it the modules stay importable (``GLUON_IMPORT_ERROR`` says why, the
``*_supported`` checks refuse every call, the ops run the Triton kernels): ``gluon.jit`` is then a stub decorator.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from fxopt.kernels import device_capability

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 (re-exported to the builds)
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    GLUON_IMPORT_ERROR: Optional[str] = None
except Exception as _e:  # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

    class _Stub:  # lets the decorated definitions evaluate; the kernels are never launched
        @staticmethod
        def jit(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def constexpr_function(fn):
            return fn

    gluon = _Stub()
    gl = None
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

LOG2E = 1.4426950408889634


@gluon.jit
def as_tma_box(buf, desc):
    # [rows, d] slot -> the [1, 1, rows, d] box of the 4-D descriptor (same bytes, leading dims of size 1).
    return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def unmasked_blocks(row_first, diag_off, SEQ_K, n_blocks, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    # Leading key blocks that need no mask for any row of the warpgroup whose first row is row_first: fully inside
    # Sk and (causal) left of the diagonal for that row. The rest (diagonal blocks, ragged last block) are masked.
    n_full = SEQ_K // BLOCK_N
    if CAUSAL:
        n_full = gl.minimum(n_full, gl.maximum(row_first + diag_off + 1, 0) // BLOCK_N)
    return gl.minimum(n_full, n_blocks)


_TORCH_TO_GL: dict = {}


def gl_dtype(dt: torch.dtype):
    """The Gluon element type of a torch dtype (bf16, fp16, e4m3)."""
    if not _TORCH_TO_GL:
        _TORCH_TO_GL.update({torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                             torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32})
    return _TORCH_TO_GL[dt]


@functools.lru_cache(maxsize=None)
def host_layout(block: tuple, dtype: torch.dtype):
    """``NVMMASharedLayout.get_default_for(block, dtype)`` of a host-side TensorDescriptor, cached: building it was
    most of a descriptor's host cost, and a launch builds four to eight descriptors."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype(dtype))


def tma_desc(t: torch.Tensor, rows: int, cols: Optional[int] = None, layout=None):
    """Host TensorDescriptor of a 4-D tensor with box [1, 1, rows, cols] (default: the last dim whole)."""
    block = [1, 1, rows, t.shape[-1] if cols is None else cols]
    if layout is None:
        layout = host_layout(tuple(block), t.dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def tma_stride_reason(name: str, t: torch.Tensor) -> Optional[str]:
    """None if TMA can address ``t`` (last dim contiguous, other strides and the base 16-byte aligned), else why."""
    if t.stride(-1) != 1:
        return f"{name}: last dim must be contiguous for TMA (stride {t.stride(-1)})"
    esz = t.element_size()
    for i, st in enumerate(t.stride()[:-1]):
        if (st * esz) % 16:
            return f"{name}: stride {st} of dim {i} is not 16-byte aligned (TMA)"
    if t.data_ptr() % 16:
        return f"{name}: base pointer not 16-byte aligned (TMA)"
    return None


def common_reason(tensors: tuple, dtypes: tuple, arch_major: int) -> Optional[str]:
    """The checks every Gluon build makes: Gluon importable, real 4-D CUDA tensors of one allowed dtype and device,
    a device of compute capability ``arch_major``.x. None, or a one-line reason."""
    if GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon unavailable ({GLUON_IMPORT_ERROR})"
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
        if t.dim() != 4:
            return f"{name} must be 4-D [B, H, S, D], got {tuple(t.shape)}"
        if t.dtype not in dtypes:
            return f"{name}: dtype {t.dtype} not supported (bf16 / fp16 only)"
    if len({t.dtype for _, t in tensors}) != 1:
        return "dtype mismatch between " + ", ".join(n for n, _ in tensors)
    if len({t.device for _, t in tensors}) != 1:
        return "inputs on different devices"
    cap = device_capability(tensors[0][1].device)
    if cap[0] != arch_major:
        return f"needs sm_{arch_major}0 (TMA / wgmma), device is sm_{cap[0]}{cap[1]}"
    return None


def qkv_reason(q, k, v, head_dims, scale) -> Optional[str]:
    """The shape checks every Gluon attention build makes after ``common_reason``: k / v alike and matching q in
    batch and head dim, a head dim in ``head_dims``, GQA, scale > 0 (folded into exp2), int32 TMA coordinates."""
    B, Hq, Sq, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    if k.shape[0] != B or k.shape[3] != D:
        return f"k / v shape {tuple(k.shape)} does not match q {tuple(q.shape)}"
    if D not in head_dims:
        return f"head dim {D} not supported (only {sorted(head_dims)})"
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        return f"query heads {Hq} not a multiple of kv heads {Hkv}"
    if scale is not None and not (float(scale) > 0.0):
        return f"scale must be > 0 (got {scale}); it is folded into exp2"
    if max(Sq, k.shape[2]) >= 2 ** 30:
        return "sequence too long for int32 TMA coordinates"
    return None
