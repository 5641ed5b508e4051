"""FlashAttention for fxopt: the ``fxopt::flash_attention`` ops and every kernel behind them.

Modules (imports point one way: ops -> launch -> {routing, decode, gluon_*, triton_kernels} -> checks / common):

* ``ops``: the custom ops (fake implementations, autograd, the eager fast path); importing the package registers
  them.
* ``launch``: ``flash_attention_triton`` / ``flash_attention_triton_bwd``, the host routing of each call,
  ``kernel_routes``.
* ``routing``: the routing table (arch, op, head dim, causal, lengths -> build) and its digest.
* ``triton_kernels``: the Triton forward (FA2), split-KV decode and backward kernels; ``decode``: their decode
  host side.
* ``gluon_fwd`` / ``gluon_bwd``: the Gluon Hopper builds the table routes to; ``gluon_common``: what they share.
* ``reference`` / ``checks``: the float reference (the CPU path) and the input checks.

Design notes and measurements: ``docs/kernels.md``.
"""
from .checks import check_qkv  # noqa: F401
from .launch import (  # noqa: F401
    dropout_keep_mask_triton,
    flash_attention_triton,
    flash_attention_triton_bwd,
    kernel_routes,
)
from .ops import flash_attention, flash_attention_bwd, flash_attention_fwd, flash_attention_mask_grad  # noqa: F401
from .reference import attention_reference  # noqa: F401
from .routing import ROUTES, ROUTES_DIGEST  # noqa: F401
