"""fxopt's configuration: one dataclass per pass, nested in :class:`Config`, validated by
:meth:`Config.from_options` (nested or dotted keys; an unknown key, wrong type or bad value raises
:class:`ConfigError`). Every option is described in docs/configuration.md."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A bad fxopt option: unknown key, wrong type or invalid value."""


@dataclass
class AttentionConfig:
    """Attention pass settings.

    Args:
        enabled: rewrite SDPA and hand-written attention into ``torch.ops.fxopt.flash_attention``.
        fp8: route eligible inference attention to the FP8 kernel (Hopper only).
        lower_masks: pass proven causal / window / key-padding masks as kernel arguments, not tensors.
    """

    enabled: bool = True
    fp8: bool = False
    lower_masks: bool = True


@dataclass
class W4A16Config:
    """W4A16 pass settings.

    Args:
        enabled: fuse ``dequantize_w4 -> linear`` into ``torch.ops.fxopt.w4a16_linear``.
        group_siblings: one kernel call for linears reading one input whose packed weights share a storage.
    """

    enabled: bool = True
    group_siblings: bool = True


ATTENTION_TMA_CHOICES = ("auto", "on", "off")


@dataclass
class KernelConfig:
    """Kernel route choices of the ``torch.ops.fxopt.*`` ops, applied process-wide at run time (the backend that
    compiled last sets them).

    Args:
        attention_gluon: on sm_90, the attention forward may run the Gluon builds the routing table picks.
        attention_gluon_backward: the same for the attention backward.
        attention_tma: TMA descriptors in the Triton attention forward: ``"auto"``, ``"on"`` or ``"off"``.
        fp8_gluon: on sm_90, ``fxopt::fp8_attention`` may run the Gluon FP8 forward.
        w4a16_dequant_matmul: W4A16 dequantize + cuBLAS route: ``"auto"`` (above M = 256), ``"on"``, ``"off"``.
        w4a16_gluon: the W4A16 tuner may pick the Gluon kernel (sm_90, bf16).
        w4a16_mma: the W4A16 tuner may pick the mma.sync kernel (M <= 16).
        w4a16_gemv1: the W4A16 tuner may pick the CUDA-core kernel (M <= 4).
    """

    attention_gluon: bool = True
    attention_gluon_backward: bool = True
    attention_tma: str = "auto"
    fp8_gluon: bool = True
    w4a16_dequant_matmul: Literal["auto", "on", "off"] = "auto"
    w4a16_gluon: bool = True
    w4a16_mma: bool = True
    w4a16_gemv1: bool = True

    def validate(self) -> "KernelConfig":
        """Check the choice-valued fields; raise :class:`ConfigError` naming the option. Returns ``self``."""
        if self.attention_tma not in ATTENTION_TMA_CHOICES:
            raise ConfigError(f"fxopt option 'kernels.attention_tma' is {self.attention_tma!r}; valid choices: "
                              f"{', '.join(ATTENTION_TMA_CHOICES)}")
        return self


@dataclass
class TensorParallelConfig:
    """Tensor-parallel pass settings (used by :func:`fxopt.parallelize`).

    Args:
        enabled: run the pass (off unless a process group and ``tp`` > 1 are given).
        tp: tensor-parallel degree; must equal the process group's world size.
        vocab_parallel: also shard the lm_head (and an embedding tied to it) over the vocabulary.
        vocab_parallel_embedding: with ``vocab_parallel``, also cut an untied embedding by rows.
        overlap_chunks: inference: cut each row-parallel linear into this many token chunks, each with its own
            all-reduce.
        sequence_parallel: inference: reduce-scatter / all-gather around the token-wise ops (Megatron's SP).
        sequence_parallel_min_bytes: with ``sequence_parallel``, smaller all-reduces stay all-reduces.
    """

    enabled: bool = False
    tp: int = 1
    vocab_parallel: bool = False
    vocab_parallel_embedding: bool = False
    overlap_chunks: int = 1
    sequence_parallel: bool = False
    sequence_parallel_min_bytes: int = 1 << 20


@dataclass
class PipelineConfig:
    """Pipeline pass settings (used by :func:`fxopt.pipeline`).

    Args:
        enabled: run the pass (off unless stages > 1).
        stages: number of pipeline stages.
        microbatches: micro-batches per step.
        schedule: one of ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``.
        split_points: module names (qualified) that must start a new stage; the pass balances the rest.
    """

    enabled: bool = False
    stages: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"
    split_points: list = field(default_factory=list)


@dataclass
class Config:
    """All fxopt settings.

    Args:
        enabled: master switch; ``False`` runs no pass (the graph goes to Inductor as Dynamo produced it).
        attention: :class:`AttentionConfig`.
        w4a16: :class:`W4A16Config`.
        tensor_parallel: :class:`TensorParallelConfig`.
        pipeline: :class:`PipelineConfig`.
        kernels: :class:`KernelConfig` (kernel route choices).
        inductor_options: Inductor ``config_patches``, e.g. ``{"max_autotune": True}``.
        cudagraphs: replay the compiled graphs from CUDA graphs (``mode="reduce-overhead"``, usable with options).
    """

    enabled: bool = True
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    w4a16: W4A16Config = field(default_factory=W4A16Config)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    inductor_options: dict = field(default_factory=dict)
    cudagraphs: bool = False

    @classmethod
    def from_options(cls, options: Optional[dict] = None, base: Optional["Config"] = None) -> "Config":
        """Build a Config from ``torch.compile``'s ``options`` dict, validating every key and type."""
        cfg = copy.deepcopy(base) if base is not None else cls()
        if options is None:
            return cfg
        if not isinstance(options, dict):
            raise ConfigError(f"fxopt options must be a dict, got {type(options).__name__}")
        for key, value in options.items():
            _apply(cfg, str(key).split("."), value, prefix="")
        cfg.validate()
        return cfg

    def validate(self) -> "Config":
        """Check every value (types, ranges, choices, Inductor's config keys); raise :class:`ConfigError` naming
        the first bad option and what it allows. Returns ``self``."""
        for key in Config.valid_keys():
            obj = self
            *parents, name = key.split(".")
            for p in parents:
                obj = getattr(obj, p)
            _check_type(key, getattr(obj, name), typing.get_type_hints(type(obj))[name])
        tp, pp = self.tensor_parallel, self.pipeline
        _at_least("tensor_parallel.tp", tp.tp, 1)
        _at_least("tensor_parallel.overlap_chunks", tp.overlap_chunks, 1)
        _at_least("tensor_parallel.sequence_parallel_min_bytes", tp.sequence_parallel_min_bytes, 0)
        _at_least("pipeline.stages", pp.stages, 1)
        _at_least("pipeline.microbatches", pp.microbatches, 1)
        from .parallel.pipeline import SCHEDULES

        if pp.schedule not in SCHEDULES:
            raise ConfigError(f"fxopt option 'pipeline.schedule' is {pp.schedule!r}; valid choices: "
                              f"{', '.join(SCHEDULES)}")
        bad = [p for p in pp.split_points if not isinstance(p, str) or not p]
        if bad:
            raise ConfigError(f"fxopt option 'pipeline.split_points' takes qualified module names (non-empty str), "
                              f"got {bad!r}")
        self.kernels.validate()
        _check_inductor_options(self.inductor_options)
        return self

    @staticmethod
    def valid_keys() -> list[str]:
        return _keys(Config, "")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"fxopt option {key!r} must be an int >= {low}, got {value!r}")


def _check_inductor_options(options: dict) -> None:
    """Every key must be one of Inductor's config keys (dotted for sub-configs, e.g. ``"triton.cudagraphs"``)."""
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=5)
            hint = f"closest Inductor keys: {', '.join(close)}" if close else "no Inductor key is close"
            raise ConfigError(f"fxopt option 'inductor_options' has {key!r}, which is not a key of "
                              f"torch._inductor.config ({hint}; all keys: torch._inductor.config.get_config_copy())")


def _keys(cls, prefix: str) -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += _keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _apply(obj: Any, path: list[str], value: Any, prefix: str) -> None:
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    name = path[0]
    if name not in names:
        raise _unknown(prefix, path)
    t = hints[name]
    full = prefix + name
    if dataclasses.is_dataclass(t):
        sub = getattr(obj, name)
        if len(path) > 1:
            _apply(sub, path[1:], value, full + ".")
        elif isinstance(value, dict):
            for k, v in value.items():
                _apply(sub, str(k).split("."), v, full + ".")
        elif isinstance(value, t):
            setattr(obj, name, value)
        else:
            raise ConfigError(f"fxopt option {full!r} takes a dict or {t.__name__}, got {type(value).__name__}")
        return
    if len(path) > 1:
        raise _unknown(prefix, path)
    setattr(obj, name, _check_type(full, value, t))


def _unknown(prefix: str, path: list[str]) -> ConfigError:
    return ConfigError(f"unknown fxopt option {prefix + '.'.join(path)!r}; valid keys: "
                       f"{', '.join(Config.valid_keys())}")


def _check_type(key: str, value: Any, t: Any) -> Any:
    origin = typing.get_origin(t) or t
    if origin is Literal:
        if value not in typing.get_args(t):
            raise ConfigError(f"fxopt option {key!r} is {value!r}; valid choices: "
                              f"{', '.join(map(repr, typing.get_args(t)))}")
        return value
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, (list, tuple)),
        dict: lambda v: isinstance(v, dict),
    }.get(origin)
    if ok is None or not ok(value):
        raise ConfigError(
            f"fxopt option {key!r} must be {getattr(origin, '__name__', origin)}, got {type(value).__name__} "
            f"{value!r}; valid keys: {', '.join(Config.valid_keys())}"
        )
    if origin is float:
        return float(value)
    if origin is list:
        return list(value)
    return value
