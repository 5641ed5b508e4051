"""Registers every fxopt custom op (``torch.ops.fxopt.*``) by importing the kernel modules; passes import this."""
from . import attention  # noqa: F401  fxopt::flash_attention
from . import w4a16  # noqa: F401  fxopt::w4a16_linear, fxopt::dequantize_w4
from . import fp8  # noqa: F401  fxopt::fp8_attention, fxopt::int8_attention, fxopt::hadamard_transform
