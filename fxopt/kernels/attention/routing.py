"""The one routing table of the attention family: (arch, op, head dim, causal, lengths) -> build.

``ROUTES`` is read top to bottom; the first matching row names the build, no match runs the Triton kernel. The
eligibility checks come first (``launch``). ``ROUTES_DIGEST`` is part of every attention launch plan's key.
``docs/kernels.md`` ("What runs by default").
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

TRITON = "triton"


@dataclass(frozen=True)
class Route:
    """One row: ``op`` ("forward", "backward", "fp8_forward") on ``arch`` at ``head_dims`` runs ``build`` for causal
    or non-causal calls (``causal`` None: both) with Sq >= ``min_q``, Sk >= ``min_k`` and Sk < ``max_k``."""

    op: str
    build: str
    arch: tuple = (9, 0)
    head_dims: tuple = ()
    causal: Optional[bool] = None
    min_q: int = 0
    min_k: int = 0
    max_k: Optional[int] = None

    def matches(self, op: str, arch: tuple, head_dim: int, causal: bool, seq_q: int, seq_k: int) -> bool:
        return (op == self.op and arch == self.arch and head_dim in self.head_dims
                and (self.causal is None or self.causal == causal) and seq_q >= self.min_q and seq_k >= self.min_k
                and (self.max_k is None or seq_k < self.max_k))


ROUTES = (
    # forward, sm_90. d = 64 causal below 1k keys: 4 of 10 key blocks are diagonal and the exp-bound d = 64 consumer
    # pays about two unmasked blocks for each, so the Triton kernel stays.
    Route("forward", TRITON, head_dims=(64,), causal=True, max_k=1024),
    # d = 64 with long queries: three consumer warpgroups (192-row work items) overlap the exp2 work better.
    Route("forward", "gluon persistent3", head_dims=(64,), causal=False, min_q=2048),
    Route("forward", "gluon persistent3", head_dims=(64,), causal=True, min_q=8192),
    Route("forward", "gluon persistent", head_dims=(64, 128)),
    # d = 256: two Q buffers per warpgroup do not fit next to the K / V ring, so no persistent build.
    Route("forward", "gluon default", head_dims=(256,)),
    # backward, sm_90, from the lengths where the Gluon kernel beats the Triton one (GPU time, fwd+bwd).
    Route("backward", "gluon dq-reducer", head_dims=(128,), min_q=512, min_k=512),
    Route("backward", "gluon dq-reducer", head_dims=(64,), min_q=1024, min_k=1024),
    Route("backward", "gluon d256", head_dims=(256,), min_q=512, min_k=512),
    # fp8 forward, sm_90 (quantization is the same for both builds).
    Route("fp8_forward", "gluon", head_dims=(64, 128)),
)

ROUTES_DIGEST = hashlib.sha1(repr(ROUTES).encode()).hexdigest()[:16]


def select(op: str, arch: tuple, head_dim: int, causal: bool, seq_q: int, seq_k: int) -> str:
    """The build ``ROUTES`` names for a call ("triton" when no row matches)."""
    for r in ROUTES:
        if r.matches(op, arch, head_dim, bool(causal), seq_q, seq_k):
            return r.build
    return TRITON
