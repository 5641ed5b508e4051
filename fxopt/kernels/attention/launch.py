"""Launch paths of the attention family: ``flash_attention_triton`` (forward) and ``flash_attention_triton_bwd``.

Each call is routed on the host: decode shapes to the split-KV kernels, others to the Gluon build ``routing.select``
names where one applies, else to the autotuned Triton kernels. A Gluon build that fails is remembered per (device,
dtype, head dim, causal) and not tried again. Both entry points replay launch plans.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import triton

from fxopt.kernels import cdiv, next_pow2
from fxopt.kernels._common import (INTERPRET, block_configs, is_sm90, keep_rows, kernel_config, kernel_config_key,
                                   quick_bench, remember_failure)
from fxopt.kernels.launch_plan import NO_PLAN, plan_cached

from . import routing
from .checks import block_d, check_inputs, last_contig, mask_args
from .decode import launch_split, use_split
from .gluon_bwd import gluon_attention_bwd, gluon_bwd_supported, grad_strides_ok
from .gluon_common import tma_stride_reason
from .gluon_fwd import gluon_attention_fwd, gluon_supported
from .triton_kernels import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, _attn_fwd

log = logging.getLogger(__name__)

# Autotune lists: (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class; fp32 takes the "f32" list.
FWD_CONFIGS = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
    "f32": [(64, 32, 4, 2), (32, 32, 4, 2)],
}
# The last entries of each dK/dV list are the configs whose sm_90 build does not spill (bf16, no mask).
DKDV_CONFIGS = {
    64: [(64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 8, 2)],
    128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
    256: [(32, 64, 8, 2), (64, 64, 8, 2), (16, 64, 8, 2), (32, 32, 8, 2)],
    "f32": [(32, 32, 4, 2), (16, 32, 4, 2)],
}
DQ_CONFIGS = {
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)],
    128: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3)],
    256: [(64, 32, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2)],
    "f32": [(32, 32, 4, 2), (32, 16, 4, 2)],
}


def _pruner(table):
    def prune(configs, named_args, **kwargs):
        if INTERPRET:
            return configs
        bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        cls = "f32" if named_args["Q"].dtype == torch.float32 else (64 if bd <= 64 else 128 if bd <= 128 else 256)
        return keep_rows(configs, set(table[cls]))
    return prune


# TUNE_SEQ = power-of-two bucket of (Sq, Sk) (an unused kernel argument): one tuning per bucket, not per length.
_TUNE_KEY = ["HEAD_DIM", "IS_CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP", "MASK_KIND", "HAS_KPM", "HAS_DROPOUT", "PREC",
             "TUNE_SEQ"]


def _tune_bucket(Sq, Sk):
    """(Sq, Sk) -> one int, each rounded up to a power of two in [16, 16384]; always a multiple of 16."""
    qb = min(max(16, next_pow2(Sq)), 16384)
    kb = min(max(16, next_pow2(Sk)), 16384)
    return qb * 32768 + kb


def _tuned(kernel, table, extra_key=()):
    rows = (r for rows in table.values() for r in rows)
    return triton.autotune(block_configs(rows), key=_TUNE_KEY + list(extra_key),
                           prune_configs_by={"early_config_prune": _pruner(table)}, do_bench=quick_bench(20))(kernel)


_attn_fwd_tuned = _tuned(_attn_fwd, FWD_CONFIGS, ["USE_TMA"])
_attn_bwd_dkdv_tuned = _tuned(_attn_bwd_dkdv, DKDV_CONFIGS, ["GROUP"])
_attn_bwd_dq_tuned = _tuned(_attn_bwd_dq, DQ_CONFIGS)

# (device, dtype, head dim, causal) of Gluon builds / TMA forwards that failed in this process: not tried again
_GLUON_FAILED: set = set()
_GLUON_BWD_FAILED: set = set()
_TMA_FAILED: set = set()


def _tma_ok(*tensors) -> bool:
    """TMA tiles in the Triton forward: ``attention_tma="auto"`` uses them at BLOCK_D = 256 only (faster there)."""
    mode = kernel_config().attention_tma
    if INTERPRET or mode == "off":
        return False
    if mode == "auto" and block_d(tensors[0].shape[-1]) < 256:
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(tma_stride_reason("", t) is None for t in tensors)


_ALLOCATOR_SET = False


def _ensure_allocator():
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        _ALLOCATOR_SET = True


def _plain_16bit_sm90(q, attn_mask, key_padding_mask, dropout_p, window, softcap) -> bool:
    """What every Gluon build needs: no mask, dropout, window or softcap; 16-bit inputs on sm_90."""
    return (attn_mask is None and key_padding_mask is None and dropout_p == 0 and window < 0 and softcap == 0
            and q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cuda" and is_sm90(q.device))


def gluon_forward_build(q, k, v, attn_mask=None, key_padding_mask=None, dropout_p=0.0, window=-1, softcap=0.0,
                        is_causal=False, scale=None) -> Optional[str]:
    """The Gluon forward build (``routing.ROUTES``) this call runs, or None for the Triton kernel."""
    D = q.shape[-1]
    if not (kernel_config().attention_gluon and _plain_16bit_sm90(q, attn_mask, key_padding_mask, dropout_p, window,
                                                                  softcap)):
        return None
    if (q.device, q.dtype, D, bool(is_causal)) in _GLUON_FAILED:
        return None
    build = routing.select("forward", (9, 0), D, is_causal, q.shape[2], k.shape[2])
    if build == routing.TRITON or gluon_supported(q, k, v, bool(is_causal), scale) is not None:
        return None
    return build


def gluon_backward_build(dout, q, k, v, out, lse, attn_mask=None, key_padding_mask=None, dropout_p=0.0, window=-1,
                         softcap=0.0, is_causal=False, scale=None) -> Optional[str]:
    """The Gluon backward build (``routing.ROUTES``) this call runs, or None for the Triton kernels. Strided q, k,
    v go there when ``torch.empty_like`` of each suits TMA (the gradients are laid out like the inputs)."""
    D = q.shape[-1]
    if not (kernel_config().attention_gluon_backward
            and _plain_16bit_sm90(q, attn_mask, key_padding_mask, dropout_p, window, softcap)):
        return None
    if (q.device, q.dtype, D, bool(is_causal)) in _GLUON_BWD_FAILED:
        return None
    build = routing.select("backward", (9, 0), D, is_causal, q.shape[2], k.shape[2])
    if build == routing.TRITON:
        return None
    if not all(t.is_contiguous() for t in (q, k, v)) and not grad_strides_ok(q, k, v):
        return None
    return build if gluon_bwd_supported(dout, q, k, v, out, lse, bool(is_causal), scale) is None else None


def _kernel_setup(q, k, attn_mask, key_padding_mask, is_causal, scale, window, softcap):
    """(sm_scale, mask, mask strides, kpm, kpm strides, constexpr flags): what the forward and backward share."""
    B, Hq, Sq, D = q.shape
    mask, kind, mstr, kpm, has_kpm, kstr = mask_args(attn_mask, key_padding_mask, q, B, Hq, Sq, k.shape[2])
    flags = dict(HEAD_DIM=D, BLOCK_D=block_d(D), IS_CAUSAL=bool(is_causal), HAS_WINDOW=window >= 0,
                 HAS_SOFTCAP=softcap > 0, MASK_KIND=kind, HAS_KPM=has_kpm,
                 PREC="ieee" if q.dtype == torch.float32 else "tf32")
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    return sm_scale, mask, mstr, kpm, kstr, flags


def _plan_state(dropout_p) -> tuple:
    """The launch plans' key beyond the arguments: the table, the kernel choices, the builds failed so far."""
    if dropout_p:  # a fresh seed in every call would only fill the plan table
        return NO_PLAN
    return (routing.ROUTES_DIGEST, kernel_config_key(), len(_GLUON_FAILED), len(_GLUON_BWD_FAILED), len(_TMA_FAILED))


def _fwd_plan_state(*args, **kwargs):
    return _plan_state(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))  # dropout_p: the fifth


def _bwd_plan_state(*args, **kwargs):
    return _plan_state(args[7] if len(args) > 7 else kwargs.get("dropout_p", 0.0))  # dropout_p: the eighth


@plan_cached(state=_fwd_plan_state)
def flash_attention_triton(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, window=-1,
                           softcap=0.0, key_padding_mask=None, seed=0, *, return_lse=False, decode=None,
                           decode_combine=None, use_tma=None):
    """Launch the forward -> out (and the natural-log lse [B, Hq, Sq] fp32 with return_lse). ``decode`` /
    ``decode_combine``: force the split-KV path / its fused combine on or off (None: automatic); ``use_tma`` given:
    the Triton kernel with / without TMA tiles, never a Gluon build."""
    check_inputs(q, k, v, attn_mask, dropout_p, window, softcap, key_padding_mask)
    q, k, v = last_contig(q), last_contig(k), last_contig(v)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale, mask, mstr, kpm, kstr, flags = _kernel_setup(q, k, attn_mask, key_padding_mask, is_causal, scale,
                                                           window, softcap)
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if B * Hq * Sq == 0 or Sk == 0:  # no visible key anywhere: out 0, lse +inf
        o.zero_()
        lse.fill_(float("inf"))
        return (o, lse) if return_lse else o
    if decode is None:
        decode = use_split(q, k, dropout_p)
    if decode:
        if dropout_p > 0:
            raise ValueError("flash_attention: the split-KV decode path does not support dropout")
        launch_split(q, k, v, o, lse, mask, mstr, kpm, kstr, group, sm_scale, softcap, window, flags,
                     fused=decode_combine)
        return (o, lse) if return_lse else o
    build = None if use_tma is not None else gluon_forward_build(
        q, k, v, attn_mask, key_padding_mask, dropout_p, window, softcap, is_causal, scale)
    if build is not None:
        try:
            gluon_attention_fwd(q, k, v, causal=bool(is_causal), scale=sm_scale, out=o, lse=lse, checked=True,
                                variant=build.split(" ", 1)[1])
            return (o, lse) if return_lse else o
        except Exception as e:  # a build or launch this machine rejects: the Triton kernel runs
            remember_failure(log, _GLUON_FAILED, (q.device, q.dtype, D, bool(is_causal)),
                             "flash_attention: Gluon forward failed (%s: %s); using the Triton kernel for %s", e)
    auto_tma = use_tma is None
    if auto_tma:
        use_tma = _tma_ok(q, k, v, o) and (q.dtype, D, bool(is_causal)) not in _TMA_FAILED
    if use_tma:
        _ensure_allocator()
    args = (q, k, v, o, lse, mask, kpm, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            *mstr, *kstr, Hq, group, Sq, Sk, sm_scale, float(softcap), int(window), float(dropout_p), int(seed),
            _tune_bucket(Sq, Sk))
    flags.update(HAS_DROPOUT=dropout_p > 0, USE_TMA=bool(use_tma), FOLD_SCALE=sm_scale > 0)
    grid = lambda META: (cdiv(Sq, META["BLOCK_M"]), B * Hq)  # noqa: E731
    try:
        _attn_fwd_tuned[grid](*args, **flags)
    except Exception as e:  # a TMA build the compiler rejects: remember it and use plain pointers
        if not (auto_tma and use_tma):
            raise
        remember_failure(log, _TMA_FAILED, (q.dtype, D, bool(is_causal)),
                         "flash_attention: TMA forward failed (%s: %s); using pointer loads for %s", e)
        flags["USE_TMA"] = False
        _attn_fwd_tuned[grid](*args, **flags)
    return (o, lse) if return_lse else o


@plan_cached(state=_bwd_plan_state)
def flash_attention_triton_bwd(dout, q, k, v, out, lse, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               window=-1, softcap=0.0, key_padding_mask=None, seed=0, *, dkdv_config=None):
    """Launch the backward -> (dq, dk, dv) allocated like q, k, v: the Gluon build the table names, else the Triton
    kernels. ``dkdv_config`` (BLOCK_M, BLOCK_N, num_warps, num_stages): the Triton kernels, dK / dV untuned."""
    check_inputs(q, k, v, attn_mask, dropout_p, window, softcap, key_padding_mask)
    q, k, v, out, dout = (last_contig(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    if dkdv_config is None and gluon_backward_build(
            dout, q, k, v, out, lse, attn_mask, key_padding_mask, dropout_p, window, softcap, is_causal, scale):
        try:
            return gluon_attention_bwd(dout, q, k, v, out, lse, causal=bool(is_causal), scale=scale, checked=True,
                                       grads_like_inputs=True)
        except Exception as e:  # a build or launch this machine rejects: the Triton kernels run
            remember_failure(log, _GLUON_BWD_FAILED, (q.device, q.dtype, q.shape[-1], bool(is_causal)),
                             "flash_attention: Gluon backward failed (%s: %s); using the Triton kernels for %s", e)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale, mask, mstr, kpm, kstr, flags = _kernel_setup(q, k, attn_mask, key_padding_mask, is_causal, scale,
                                                           window, softcap)
    flags["HAS_DROPOUT"] = dropout_p > 0
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if B * Hq * Sq == 0 or Sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    pre_bm = 16 if INTERPRET else 64
    _attn_bwd_preprocess[(cdiv(Sq, pre_bm), B * Hq)](
        out, dout, delta, *out.stride()[:3], *dout.stride()[:3], Hq, Sq, HEAD_DIM=D, BLOCK_D=flags["BLOCK_D"],
        BLOCK_M=pre_bm)
    common = (Hq, group, Sq, Sk, sm_scale, float(softcap), int(window), float(dropout_p), int(seed),
              _tune_bucket(Sq, Sk))
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, mask, kpm, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                 *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *mstr, *kstr, *common)
    dq_args = (q, k, v, dout, lse, delta, dq, mask, kpm, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
               *dout.stride()[:3], *dq.stride()[:3], *mstr, *kstr, *common)
    if dkdv_config is not None:
        c = dict(dkdv_config)
        bm, bn = c.pop("BLOCK_M"), c.pop("BLOCK_N")
        _attn_bwd_dkdv[(cdiv(Sk, bn), B * Hkv)](*dkdv_args, **flags, BLOCK_M=bm, BLOCK_N=bn, **c)
    else:
        _attn_bwd_dkdv_tuned[lambda META: (cdiv(Sk, META["BLOCK_N"]), B * Hkv)](*dkdv_args, **flags)
    _attn_bwd_dq_tuned[lambda META: (cdiv(Sq, META["BLOCK_M"]), B * Hq)](*dq_args, **flags)
    return dq, dk, dv


def kernel_routes(q, k, v, is_causal: bool = False, scale=None) -> dict:
    """{"forward": ..., "backward": ...}: the builds these inputs run with no mask, dropout, window or softcap, for
    benchmark tables ("gluon <build>", "triton", "triton split-kv", "gluon (fell back to triton)"); runs the forward."""
    D = q.shape[-1]
    key = (q.device, q.dtype, D, bool(is_causal))
    if use_split(q, k, 0.0):
        fwd = "triton split-kv"
    elif key in _GLUON_FAILED:
        fwd = "gluon (fell back to triton)"
    else:
        fwd = gluon_forward_build(q, k, v, is_causal=is_causal, scale=scale) or "triton"
    out, lse = flash_attention_triton(q, k, v, is_causal=is_causal, scale=scale, return_lse=True)
    if key in _GLUON_BWD_FAILED:
        bwd = "gluon (fell back to triton)"
    else:
        bwd = gluon_backward_build(torch.empty_like(out), q, k, v, out, lse, is_causal=is_causal,
                                   scale=scale) or "triton"
    return {"forward": fwd, "backward": bwd}
