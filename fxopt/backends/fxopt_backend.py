"""Dynamo backend: Dynamo's FX graph → fxopt passes (fixed order) → Inductor's ``compile_fx``.

The passes run on the torch-level graph before AOTAutograd and Inductor's own pattern passes, so their
``torch.ops.fxopt.*`` ops (opaque to Inductor) win. ``"fxopt"`` and ``"fxopt_eager"`` are registered through the
``torch_dynamo_backends`` entry points, or by :func:`register_backends` when fxopt is imported from a checkout.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from ..config import Config, ConfigError
from ..kernels._common import set_backend_kernels
from ..passes import run_passes

log = logging.getLogger(__name__)


class FxoptOptionError(ConfigError, torch._dynamo.exc.ShortenTraceback):
    """A bad ``options=`` entry, raised through Dynamo unchanged (Dynamo re-raises ShortenTraceback as is)."""

    def __init__(self, msg: str):
        Exception.__init__(self, msg)
        self.first_useful_frame = None


class Backend:
    """A ``torch.compile`` backend running fxopt's passes (``config``, default settings if None), then Inductor,
    or the rewritten graph as is with ``inductor=False``; ``extras`` are pass-specific inputs (parallel entry
    points). ``results`` holds one list of PassResult per compiled graph."""

    def __init__(self, config: Optional[Config] = None, *, inductor: bool = True, extras: Optional[dict] = None):
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"fxopt.Backend takes an fxopt.Config, got {type(config).__name__}")
        self.config = (config or Config()).validate()  # a bad value fails here, not at the first compile
        self.inductor = inductor
        self.extras = extras or {}
        self.results: list = []  # one list of PassResult per compiled graph, in order

    def __deepcopy__(self, memo):
        # transformers' CompileConfig deep-copies its fields before torch.compile: keep one backend (and its results)
        return self

    def __call__(self, gm: fx.GraphModule, example_inputs: list, *, options: Optional[dict] = None,
                 mode: Optional[str] = None, **unknown: Any):
        if unknown:
            raise FxoptOptionError(f"fxopt backend got unexpected arguments {sorted(unknown)}")
        try:
            cfg = Config.from_options(options, base=self.config)
        except ConfigError as e:
            raise FxoptOptionError(str(e)) from None
        if mode not in (None, "default"):
            log.info("torch.compile mode=%r is handed to Inductor", mode)
        set_backend_kernels(cfg.kernels)  # the kernel routes the compiled graph's fxopt ops take at run time
        gm, results = run_passes(gm, example_inputs, cfg, self.extras)
        self.results.append(results)
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        patches = dict(cfg.inductor_options)
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            patches.setdefault("max_autotune", True)
        if cfg.cudagraphs or mode in ("reduce-overhead", "max-autotune"):  # what these modes mean for Inductor
            patches.setdefault("triton.cudagraphs", True)
        return compile_fx(gm, example_inputs, config_patches=patches or None)


def fxopt_backend(gm: fx.GraphModule, example_inputs: list, **kwargs):
    """``torch.compile(model, backend="fxopt", options={...})``."""
    return Backend()(gm, example_inputs, **kwargs)


def fxopt_eager_backend(gm: fx.GraphModule, example_inputs: list, **kwargs):
    """``torch.compile(model, backend="fxopt_eager")``: the passes, then the rewritten graph without Inductor."""
    return Backend(inductor=False)(gm, example_inputs, **kwargs)


def register_backends() -> None:
    """Register ``"fxopt"`` and ``"fxopt_eager"`` with Dynamo unless the installed entry points already provide them."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    installed = set(entry_points(group="torch_dynamo_backends").names)
    for name, fn in (("fxopt", fxopt_backend), ("fxopt_eager", fxopt_eager_backend)):
        if name not in installed and name not in registry._COMPILER_FNS:
            registry.register_backend(fn, name=name)
