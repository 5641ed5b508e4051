"""W4A16 linear: int4 weights in fxopt's packed format, fp16 / bf16 activations, fused dequantization.

Importing the package registers the ops (``ops``). Builds: ``triton_tiles`` ("swapx" / "swapd"), ``gemv1``, ``mma``,
``gluon``, ``dequant``; ``tuner`` picks among them. ``docs/kernels.md`` ("W4A16").
"""
from fxopt.kernels.w4a16.common import W4A16Config
from fxopt.kernels.w4a16.dequant import dequantize_w4_triton
from fxopt.kernels.w4a16.ops import (column_span, dequantize_w4, w4a16_linear, w4a16_linear_cat, w4a16_matmul,
                                     w4a16_reference)
from fxopt.kernels.w4a16.routing import Routes, routes
from fxopt.kernels.w4a16.tuner import bench_streamed_us, candidate_configs, choose_config, export_picks

__all__ = ["W4A16Config", "Routes", "routes", "w4a16_matmul", "w4a16_linear", "w4a16_linear_cat", "dequantize_w4",
           "dequantize_w4_triton", "w4a16_reference", "choose_config", "candidate_configs", "column_span",
           "export_picks", "bench_streamed_us"]
