"""FP8 (e4m3) and INT8 attention forward for inference: ``fxopt::fp8_attention`` and its kernels.

* ``quant``: Hadamard transform and block quantization of Q, K, V (one fused launch on sm_90).
* ``gluon_fwd``: the Gluon FP8 forward for sm_90 (permuted K view, late cast of P); ``triton_fwd``: the Triton
  FP8 / INT8 forward (every other GPU, and the fallback).
* ``reference``: the emulations (the CPU path, the accuracy yardstick); ``ops``: the custom ops and
  ``fp8_attention_supported`` (for the attention pass). Importing the package registers the ops.

Design notes and measurements: ``docs/kernels.md`` ("FP8 attention").
"""
from .ops import fp8_attention, fp8_attention_supported, hadamard_transform, int8_attention  # noqa: F401
from .quant import (  # noqa: F401
    QUANT_BLOCK,
    hadamard_matrix,
    hadamard_reference,
    hadamard_signs,
    hadamard_triton,
    quantize_blocks,
    quantize_qkv,
)
from .reference import (  # noqa: F401
    attention_float64,
    fp8_attention_reference,
    int8_attention_reference,
    quantize_reference,
)
from .triton_fwd import fp8_attention_quantized, fp8_attention_triton, int8_attention_triton  # noqa: F401
