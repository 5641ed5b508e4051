"""fxopt: graph rewrites for ``torch.compile``.

``torch.compile(model, backend="fxopt")`` runs fxopt's passes (fused FlashAttention, W4A16 linears, tensor and pipeline
parallel splits) on Dynamo's graph, then Inductor. Public API: :class:`Backend`, :class:`Config`, :func:`explain`,
and the entry functions of each feature.
"""
from .backends import Backend, register_backends
from .config import AttentionConfig, Config, ConfigError, PipelineConfig, TensorParallelConfig, W4A16Config
from .explain import ExplainReport, explain

__version__ = "0.1.0"

register_backends()

__all__ = ["Backend", "Config", "ConfigError", "AttentionConfig", "W4A16Config", "TensorParallelConfig",
           "PipelineConfig", "ExplainReport", "explain", "__version__"]
