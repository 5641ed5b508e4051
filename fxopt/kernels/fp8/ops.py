"""The FP8 / INT8 attention ops (inference only) and the support check the attention pass uses.

``fxopt::fp8_attention(q, k, v, is_causal=False, scale=None, hadamard=True, seed=0)`` runs the build
``attention.routing.ROUTES`` names for "fp8_forward" (Gluon on sm_90, else Triton); ``fxopt::int8_attention`` and
``fxopt::hadamard_transform`` the Triton kernels. On CPU the ops run their references.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from fxopt.kernels._common import is_sm90, kernel_config, remember_failure
from fxopt.kernels.attention import routing

from .gluon_fwd import fp8_gluon_attention, fp8_gluon_supported
from .quant import _check_hadamard_input, check_attn_inputs, hadamard_reference, hadamard_triton
from .reference import fp8_attention_reference, int8_attention_reference
from .triton_fwd import fp8_attention_triton, int8_attention_triton

log = logging.getLogger(__name__)


def fp8_attention_supported(q, k, v, training: bool = False, *, allow_cpu_reference: bool = False):
    """(ok, reason) for routing this attention to ``fxopt::fp8_attention`` (reason '' when ok); reads only shapes,
    dtypes and devices (fake tensors too)."""
    if training:
        return False, "fp8 attention is forward-only (inference); training mode keeps bf16/fp16 attention"
    try:
        check_attn_inputs(q, k, v, None)
    except ValueError as e:
        return False, str(e)
    dev = q.device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device available for the fp8 kernel"
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 9):
            return False, f"fp8 tensor cores need sm_89+ (Ada/Hopper); this GPU is sm_{cap[0]}{cap[1]}"
        return True, ""
    if dev.type == "cpu" and allow_cpu_reference:
        return True, ""
    return False, f"inputs on {dev.type}: the fp8 kernel needs a CUDA sm_89+/sm_90 GPU"


@torch.library.custom_op("fxopt::hadamard_transform", mutates_args=())
def hadamard_transform(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x @ (H diag(signs(seed)) / sqrt(D)) along the last dim (D a power of two in 16..256)."""
    _check_hadamard_input(x)
    if x.device.type == "cuda":
        return hadamard_triton(x, seed)
    return hadamard_reference(x, seed).contiguous()


@hadamard_transform.register_fake
def _(x, seed=0):
    _check_hadamard_input(x)
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


@torch.library.custom_op("fxopt::fp8_attention", mutates_args=())
def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                  scale: Optional[float] = None, hadamard: bool = True, seed: int = 0) -> torch.Tensor:
    """FP8 e4m3 attention forward (block-quantized Q/K/V, optional Hadamard incoherent processing)."""
    check_attn_inputs(q, k, v, scale)
    out = torch.empty_like(q)  # same strides as the fake impl
    if q.device.type == "cuda" and _gluon_fp8(q, k, v, is_causal, scale, hadamard, seed, out):
        return out
    return _run_into(q, fp8_attention_triton, fp8_attention_reference, q, k, v, is_causal, scale, hadamard, seed)


_GLUON_FP8_FAILED: set = set()


def fp8_build(q, k, v, is_causal, scale, out) -> str:
    """The build ``fxopt::fp8_attention`` runs for these (CUDA) inputs: "gluon" or "triton"."""
    key = (q.device, q.dtype, q.shape[-1], bool(is_causal))
    if not kernel_config().fp8_gluon or key in _GLUON_FP8_FAILED or not out.is_contiguous() or not is_sm90(q.device):
        return routing.TRITON
    build = routing.select("fp8_forward", (9, 0), q.shape[-1], is_causal, q.shape[2], k.shape[2])
    if build != routing.TRITON:
        reason = fp8_gluon_supported(q, k, v, is_causal, scale)
        if reason is not None:
            log.debug("fp8_attention: Triton kernel (%s)", reason)
            return routing.TRITON
    return build


def _run_into(q, kernel, reference, *args) -> torch.Tensor:
    """The op's body: ``kernel`` on CUDA (writing into an ``empty_like(q)`` output, as the fake impl lays it out),
    ``reference`` on CPU."""
    out = torch.empty_like(q)
    if q.device.type == "cuda" and out.stride(-1) == 1:
        return kernel(*args, out=out)
    return out.copy_(kernel(*args) if q.device.type == "cuda" else reference(*args))


def _gluon_fp8(q, k, v, is_causal, scale, hadamard, seed, out) -> bool:
    """Run the op on the Gluon fp8 kernel where ``fp8_build`` names it; False leaves the call to the Triton kernel
    (same quantization). A build or launch that fails is remembered and not retried."""
    if fp8_build(q, k, v, is_causal, scale, out) != "gluon":
        return False
    try:
        fp8_gluon_attention(q, k, v, is_causal, scale, hadamard, seed, out=out)
        return True
    except Exception as e:  # noqa: BLE001 -- a build or launch this machine rejects: the Triton kernel runs
        remember_failure(log, _GLUON_FP8_FAILED, (q.device, q.dtype, q.shape[-1], bool(is_causal)),
                         "fp8_attention: Gluon kernel failed (%s: %s); using the Triton kernel for %s", e)
        return False


@fp8_attention.register_fake
def _(q, k, v, is_causal=False, scale=None, hadamard=True, seed=0):
    check_attn_inputs(q, k, v, scale)
    return torch.empty_like(q)


@torch.library.custom_op("fxopt::int8_attention", mutates_args=())
def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                   scale: Optional[float] = None, seed: int = 0) -> torch.Tensor:
    """INT8 attention forward: Q, K, V Hadamard-transformed and int8 block-quantized, P at 255 levels
    (:func:`int8_attention_reference` is the design and the CPU path; :func:`int8_attention_triton` the kernel)."""
    check_attn_inputs(q, k, v, scale)
    return _run_into(q, int8_attention_triton, int8_attention_reference, q, k, v, is_causal, scale, seed)


@int8_attention.register_fake
def _(q, k, v, is_causal=False, scale=None, seed=0):
    check_attn_inputs(q, k, v, scale)
    return torch.empty_like(q)
