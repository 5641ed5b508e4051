"""FlashAttention for fxopt: the ``fxopt::flash_attention`` ops (``ops``, registered on import) and their kernels.

``ops`` -> ``launch`` (host routing) -> {``routing``, ``decode``, ``gluon_fwd`` / ``gluon_bwd``, ``triton_kernels``};
``reference`` is the float path on CPU. ``docs/kernels.md``.
"""
from .checks import check_qkv  # noqa: F401
from .launch import flash_attention_triton, flash_attention_triton_bwd, kernel_routes  # noqa: F401
from .ops import flash_attention, flash_attention_bwd, flash_attention_fwd, flash_attention_mask_grad  # noqa: F401
from .reference import attention_reference  # noqa: F401
from .routing import ROUTES, ROUTES_DIGEST  # noqa: F401
