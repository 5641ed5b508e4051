"""fxopt: graph rewrites for ``torch.compile`` (``backend="fxopt"``): fused FlashAttention, W4A16 linears, tensor and
pipeline parallel splits on Dynamo's graph, then Inductor. Public API: :class:`Backend`, :class:`Config`,
:func:`explain`, and :func:`load_quantized`, :func:`save_quantized`, :func:`quantize`, :func:`parallelize`,
:func:`pipeline`, :func:`distribute` (imported on first use)."""
import importlib

from .backends import Backend, register_backends
from .config import AttentionConfig, Config, ConfigError, PipelineConfig, TensorParallelConfig, W4A16Config
from .explain import ExplainReport, explain

__version__ = "0.1.0"

register_backends()

_LAZY = {
    "load_quantized": "fxopt.quant.checkpoint",
    "save_quantized": "fxopt.quant.checkpoint",
    "quantize": "fxopt.quant.calibrate",
    "parallelize": "fxopt.parallel.tensor_parallel",
    "pipeline": "fxopt.parallel.pipeline",
    "distribute": "fxopt.parallel.distribute",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxopt' has no attribute {name!r}")


__all__ = ["Backend", "Config", "ConfigError", "AttentionConfig", "W4A16Config", "TensorParallelConfig",
           "PipelineConfig", "ExplainReport", "explain", "load_quantized", "save_quantized", "quantize",
           "parallelize", "pipeline", "distribute", "__version__"]
