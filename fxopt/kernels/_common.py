"""Helpers every kernel family shares: the SM count, kept buffers, autotune lists, and the kernel choices in force.

Custom ops take no config, so the choices are process-wide: :func:`set_backend_kernels` (each compile; the last one
wins), :func:`use_kernels` (a ``with`` block that overrides them), :func:`kernel_config` / :func:`kernel_config_key`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, Optional

import torch

from fxopt.config import ConfigError, KernelConfig

# Triton's own variable (set by the tests without CUDA): kernels run on the CPU interpreter, GPU-only paths are off.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for CPU tensors: the interpreter's grids stay small)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:  # a device-properties query costs microseconds: once per device
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def is_sm90(device) -> bool:
    """Hopper (sm_90 exactly): the Gluon builds use its wgmma and TMA."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def remember_failure(log, failed: set, key, what: str, e: Exception) -> None:
    """A build or launch this machine rejected: ``key`` joins ``failed`` (not tried again), one warning says why and
    what runs instead (``what``: "<op>: <build> failed ... <fallback>")."""
    failed.add(key)
    log.warning(what, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", key)


def kept_zeros(cache: dict, key, n: int, dtype, device, floor: int) -> torch.Tensor:
    """A zeroed buffer of at least ``n`` elements kept in ``cache[key]`` across calls (kernels leave it at zero),
    never from a CUDA-graph pool; ``floor`` elements at least, so that captured graphs never see it replaced."""
    from fxopt.kernels import outside_graph_pools

    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = outside_graph_pools(lambda: torch.zeros(max(n, floor), dtype=dtype, device=device))
        cache[key] = buf
    return buf


def block_configs(rows, pre_hook=None) -> list:
    """``triton.Config`` of each distinct (BLOCK_M, BLOCK_N, num_warps, num_stages) row, in order (under the
    interpreter: one small config)."""
    import triton

    rows = [(16, 16, 4, 1)] if INTERPRET else dict.fromkeys(rows)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st, pre_hook=pre_hook)
            for bm, bn, w, st in rows]


def keep_rows(configs, wanted, ordered: bool = False) -> list:
    """An autotune prune: the configs whose row is in ``wanted`` (in ``wanted``'s order when ``ordered``), the
    first config when none is, only the first one under ``FXOPT_NO_TUNE``."""
    from fxopt import env

    def row(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages

    kept = [c for c in configs if row(c) in wanted]
    if ordered:
        kept.sort(key=lambda c: wanted.index(row(c)))
    kept = kept or configs[:1]
    return kept[:1] if env.no_tune() else kept


def quick_bench(rep: int):
    """The ``do_bench`` of the autotuners: a short warm-up and ``rep`` ms of timing."""
    def bench(fn, quantiles=None):
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=rep, quantiles=quantiles)
    return bench


_backend_kernels = KernelConfig()
_override: Optional[KernelConfig] = None
_key = dataclasses.astuple(_backend_kernels)


def kernel_config() -> KernelConfig:
    """The kernel choices in force (do not modify the returned object)."""
    return _override if _override is not None else _backend_kernels


def kernel_config_key() -> tuple:
    """:func:`kernel_config` as a tuple of its field values (cached: read on every kernel call)."""
    return _key


def _refresh_key() -> None:
    global _key
    _key = dataclasses.astuple(kernel_config())


def set_backend_kernels(cfg: KernelConfig) -> None:
    """The choices of the backend that compiles a graph (``fxopt.Backend``); a :func:`use_kernels` block wins."""
    global _backend_kernels
    _backend_kernels = dataclasses.replace(cfg)
    _refresh_key()


@contextlib.contextmanager
def use_kernels(cfg: Optional[KernelConfig] = None, **changes) -> Iterator[KernelConfig]:
    """Run a block with other kernel choices: ``with use_kernels(attention_gluon=False): ...`` (fields of
    :class:`KernelConfig`, applied on top of ``cfg`` or of the choices in force). Nests; restores on exit."""
    global _override
    names = {f.name for f in dataclasses.fields(KernelConfig)}
    bad = sorted(set(changes) - names)
    if bad:
        raise ConfigError(f"use_kernels: unknown kernel option(s) {bad}; valid: {sorted(names)}")
    new = dataclasses.replace(cfg if cfg is not None else kernel_config(), **changes)
    new.validate()
    saved = _override
    _override = new
    _refresh_key()
    try:
        yield new
    finally:
        _override = saved
        _refresh_key()
