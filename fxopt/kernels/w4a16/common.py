"""What every W4A16 build shares: the launch config, input checks, the integer-zeros fact, buffers kept across
calls, grid arithmetic. ``MAGIC``: ``code | 0x4300`` read as bf16 is 128 + q (``| 0x6400`` as fp16: 1024 + q).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fxopt.kernels import cdiv, next_pow2
from fxopt.kernels._common import INTERPRET, kept_zeros, num_sms  # noqa: F401  (re-exported)
from fxopt.quant.format import PACK

MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
NUM_SMS_DEFAULT = 132  # the candidate lists' SM count when no device is given


@dataclass(frozen=True)
class W4A16Config:
    """One launch configuration of ``fxopt::w4a16_linear``: ``method`` ("swapx", "swapd", "gemv1", "mma", "gluon",
    "dequant_matmul"), the tile, ``split_k`` (gluon: 0 = about one CTA per SM), launch options (gluon: num_stages =
    ring slots), ``pdl`` (programmatic dependent launch); gluon's ``kc`` (K per wgmma chunk), ``regs`` ("async"),
    ``deq`` ("xsum"), ``ws`` ("regmajor"); mma's ``prefetch`` (K tiles of loads in flight)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    method: str = "swapx"
    pdl: bool = False
    kc: int = 0
    regs: str = ""
    deq: str = ""
    prefetch: int = 1
    ws: str = ""

    def label(self) -> str:
        """Short printable name (the "config" column of benchmarks/w4a16.py; the tuner's digests hash it)."""
        if self.method == "dequant_matmul":
            return self.method
        if self.method in ("mma", "gemv1"):
            return (f"{self.method} bn{self.block_n} bk{self.block_k} sk{self.split_k} w{self.num_warps}"
                    + (" pdl" if self.pdl else "") + (f" p{self.prefetch}" if self.prefetch != 1 else ""))
        if self.method == "gluon":
            return (f"gluon bm{self.block_m} bn{self.block_n} s{self.num_stages} kc{self.kc}"
                    + (f" {self.regs}" if self.regs else "") + (f" deq={self.deq}" if self.deq else "")
                    + (f" sk{self.split_k}" if self.split_k else "") + (f" ws={self.ws}" if self.ws else "")
                    + (" pdl" if self.pdl else ""))
        return (f"{self.method} bm{self.block_m} bn{self.block_n} bk{self.block_k} sk{self.split_k} "
                f"code w{self.num_warps} s{self.num_stages}")


# Fields that configs in tuner files may still carry, with the only value today's builds have.
_RETIRED_FIELDS = {"code_dot": True, "group_m": 8, "l2_ahead": 0}
_FIELDS = {f.name for f in fields(W4A16Config)}


def config_from_dict(d: dict):
    """A W4A16Config from its stored dict, or None when it names a field or value no build has."""
    kept = {k: v for k, v in d.items() if k in _FIELDS}
    for k, v in d.items():
        if k not in _FIELDS and _RETIRED_FIELDS.get(k, object()) != v:
            return None
    return W4A16Config(**kept)


def m_bucket(M: int) -> int:
    """The tuner caches one pick per power-of-two bucket of M (capped at 4096)."""
    return min(next_pow2(max(M, 1)), 4096)


def fit_block_k(block_k: int, K: int, group_size: int) -> int:
    """Largest power-of-two block_k' <= block_k dividing the group size (hence K)."""
    bk = block_k
    while bk > 8 and (group_size % bk or K % bk):
        bk //= 2
    return bk


def balanced_split(k_tiles: int, split_k: int) -> tuple[int, int]:
    """(splits, K tiles per split): at most ``split_k`` splits, every one with the same number of K tiles."""
    split = max(1, min(split_k, k_tiles))
    per = cdiv(k_tiles, split)
    return cdiv(k_tiles, per), per


def split_for(n_tiles_mn: int, k_tiles: int, target_ctas: int) -> int:
    """K split that brings a grid of ``n_tiles_mn`` output tiles near ``target_ctas`` programs."""
    split = min(max(1, round(target_ctas / max(n_tiles_mn, 1))), k_tiles)
    return balanced_split(k_tiles, split)[0]


def one_wave_split(n_tiles: int, k_tiles: int, slots: int, cta_cost: float = 1.5) -> int:
    """K split of a grid of ``n_tiles`` x split CTAs with ``slots`` resident at once: the one whose critical path,
    waves x (K tiles per CTA + ``cta_cost``, a CTA's fixed cost in K tiles), is shortest (ties: the smaller)."""
    best_cost, best = None, 1
    for s in range(1, k_tiles + 1):
        s_eff, tps = balanced_split(k_tiles, s)
        cost = cdiv(n_tiles * s_eff, slots) * (tps + cta_cost)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, s_eff
    return best


def check_inputs(x, qweight, scales, zeros, group_size, bias):
    """(K, N, group size with -1 resolved); ValueError naming the first problem."""
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"w4a16: qweight must be int32 [K // 8, N], got "
                         f"{getattr(qweight, 'dtype', type(qweight))} {tuple(getattr(qweight, 'shape', ()))}")
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"w4a16: x must be float16 or bfloat16, got {x.dtype}")
    if scales.dtype != x.dtype or zeros.dtype != x.dtype:
        raise ValueError(f"w4a16: x dtype {x.dtype} must equal scales/zeros dtype ({scales.dtype}, {zeros.dtype})")
    if x.dim() not in (2, 3):
        raise ValueError(f"w4a16: x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"w4a16: x has {x.shape[-1]} input features but qweight packs K = {K}")
    if group_size == -1:
        group_size = K
    if group_size not in (32, 64, 128, K) or K % group_size:
        raise ValueError(f"w4a16: group size {group_size} not supported for K = {K} (32, 64, 128 or K)")
    G = K // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (G, N):
            raise ValueError(f"w4a16: {name} must be [{G}, {N}] (K={K}, group {group_size}), got {tuple(t.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"w4a16: bias must be [{N}], got {tuple(bias.shape)}")
    devs = {t.device for t in (x, qweight, scales, zeros) + ((bias,) if bias is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"w4a16: all tensors must be on one device, got {sorted(map(str, devs))}")
    return K, N, group_size


_COUNTERS: dict = {}
_ZEROED_WS: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """int32 tile counters, all zero between calls."""
    return kept_zeros(_COUNTERS, device, n, torch.int32, device, 4096)


def zeroed_workspace(device, n: int) -> torch.Tensor:
    """The fp32 split-K workspace of gemv1 and mma, all zeros between calls (each call's last CTA per column tile
    zeroes what it read); 4 MB at least, so that captured CUDA graphs never see it replaced."""
    return kept_zeros(_ZEROED_WS, device, n, torch.float32, device, 1 << 20)


# Answers of ``integer_zeros`` by storage place, for views made afresh on every call (the sibling spans of
# ``w4a16_linear_cat``): (weak ref to the storage, version, answer).
_INTEGER_ZEROS: dict = {}


def integer_zeros(zeros: torch.Tensor) -> bool:
    """Whether every zero point is an integer ("swapd" and "gluon" are exact only then): one device sync per storage
    place and in-place version, the answer kept on the tensor and by storage; unchecked under capture: False."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = getattr(zeros, "_fxopt_integer_zeros", None)
    if seen is not None and seen[0] == zeros._version:
        return seen[1]
    storage = StorageWeakRef(zeros.untyped_storage())
    place = (zeros.untyped_storage().data_ptr(), zeros.storage_offset(), tuple(zeros.shape), tuple(zeros.stride()))
    known = _INTEGER_ZEROS.get(place)
    if known is not None and not known[0].expired() and known[0] == storage and known[1] == zeros._version:
        return known[2]
    if zeros.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool(torch.equal(zeros, zeros.round()))
    mark_integer_zeros(zeros, ok)
    if len(_INTEGER_ZEROS) > 4096:
        for k in [k for k, v in _INTEGER_ZEROS.items() if v[0].expired()]:
            del _INTEGER_ZEROS[k]
    _INTEGER_ZEROS[place] = (storage, zeros._version, ok)
    return ok


def mark_integer_zeros(zeros: torch.Tensor, ok: bool) -> None:
    """Keep the integer-zeros answer on the tensor (a copy of checked zeros inherits the check, no sync)."""
    try:
        zeros._fxopt_integer_zeros = (zeros._version, ok)
    except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes
        pass
