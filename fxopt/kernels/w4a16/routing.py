"""Which W4A16 builds the tuner may list: one process-wide :class:`Routes` set by the W4A16 pass from the compiling
``Config.kernels`` (the last compile wins), overridden by ``with routes(...)`` blocks; part of the tuner's and the
launch plans' keys.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Literal

DequantMatmul = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class Routes:
    """The W4A16 builds a tuner list may hold: ``dequant_matmul`` ("auto": above M = 256, "on": from M = 33,
    "off"), the ``gluon`` (sm_90, bf16), ``mma`` (M <= 16) and ``gemv1`` (M <= 4) kernels."""

    dequant_matmul: DequantMatmul = "auto"
    gluon: bool = True
    mma: bool = True
    gemv1: bool = True

    def __post_init__(self):
        if self.dequant_matmul not in ("auto", "on", "off"):
            raise ValueError(f"w4a16 routes: dequant_matmul must be 'auto', 'on' or 'off', got {self.dequant_matmul!r}")


_CONFIGURED = [Routes()]  # from the last compile's config
_BLOCKS: list = []  # the routes of the enclosing ``routes()`` blocks, innermost last


def active() -> Routes:
    return _BLOCKS[-1] if _BLOCKS else _CONFIGURED[0]


def use_config(kernels) -> None:
    """Make the W4A16 fields of a ``fxopt.config.KernelConfig`` the configured routes."""
    _CONFIGURED[0] = Routes(dequant_matmul=kernels.w4a16_dequant_matmul, gluon=kernels.w4a16_gluon,
                            mma=kernels.w4a16_mma, gemv1=kernels.w4a16_gemv1)


@contextlib.contextmanager
def routes(**changes) -> Iterator[Routes]:
    """The active routes with ``changes`` (fields of :class:`Routes`) for the block, then the previous ones."""
    r = replace(active(), **changes)
    _BLOCKS.append(r)
    try:
        yield r
    finally:
        _BLOCKS.pop()
