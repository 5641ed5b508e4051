"""Which W4A16 builds the tuner may list: the user's kernel choices, from ``fxopt.Config.kernels`` to the op.

The op runs long after the compile that inserted it (and eager code calls it with no config at all), so the choices
are one process-wide value, :class:`Routes`, read by the tuner when it lists a shape's candidates:

* the W4A16 pass sets it from the compiling ``Config.kernels`` (``use_config``): the last compile wins;
* ``with routes(gluon=False): ...`` holds other routes for a block (tests, benchmarks, eager code), compiles inside
  it included, and restores the configured ones after.

The active value is part of the tuner's cache keys and of the launch-plan state, so a change of routes never reuses
a pick or a recorded launch made under other routes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Literal

DequantMatmul = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class Routes:
    """The W4A16 builds a tuner list may hold.

    Args:
        dequant_matmul: "dequantize to a 16-bit W, then cuBLAS" (a temporary copy of one linear's weight): "auto"
            lists it above M = 256 (where it won every shape measured), "on" from M = 33, "off" never.
        gluon: the Gluon kernel (sm_90, bf16).
        mma: the mma.sync kernel (M <= 16).
        gemv1: the one-launch CUDA-core kernel (M <= 4).
    """

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
