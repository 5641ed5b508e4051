"""FP8 (e4m3) and INT8 attention forward for inference: ``quant`` (Hadamard transform, block quantization),
``gluon_fwd`` (sm_90) and ``triton_fwd`` kernels, ``reference`` emulations, ``ops`` (registered on import).
``docs/kernels.md`` ("FP8 attention").
"""
from .ops import fp8_attention, fp8_attention_supported, hadamard_transform, int8_attention  # noqa: F401
from .quant import (QUANT_BLOCK, hadamard_matrix, hadamard_reference, hadamard_signs, hadamard_triton,  # noqa: F401
                    quantize_blocks, quantize_qkv)
from .reference import (attention_float64, fp8_attention_reference, int8_attention_reference,  # noqa: F401
                        quantize_reference)
from .triton_fwd import fp8_attention_quantized, fp8_attention_triton, int8_attention_triton  # noqa: F401
