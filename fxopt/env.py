"""Every environment variable fxopt reads, in one place.

Kernel and pass choices a user may want are typed fields of :class:`fxopt.Config`, not variables. What is left here
is process-wide plumbing that has no place in a compile call:

| variable | default | meaning |
|---|---|---|
| ``FXOPT_DUMP_DIR`` | unset | write each graph before and after each pass to this directory as Python files |
| ``FXOPT_LAUNCH_PLANS`` | ``1`` | ``0``: no cached launch plans (every kernel call takes the full Python launch path) |
| ``FXOPT_W4A16_TUNE_CACHE`` | ``~/.cache/fxopt/w4a16_tuned.json`` | the W4A16 tuner's file of picks; ``0`` or empty: none |
| ``FXOPT_NO_TUNE`` | unset | ``1``: every tuner takes its first candidate untimed: the W4A16 tuner and the Triton autotune lists of the attention and fp8 kernels (fast tests) |

Logging is Torch's: ``TORCH_LOGS=+fxopt`` (every module logs to ``logging.getLogger(__name__)``).
Each accessor reads the variable when called, so a test's ``monkeypatch.setenv`` takes effect at once.
"""
from __future__ import annotations

import os
from typing import Optional


def dump_dir() -> Optional[str]:
    """``FXOPT_DUMP_DIR``: where the pass manager writes graphs, or ``None``."""
    return os.environ.get("FXOPT_DUMP_DIR") or None


def launch_plans() -> bool:
    """``FXOPT_LAUNCH_PLANS``: whether kernel entry points may replay cached launch plans."""
    return os.environ.get("FXOPT_LAUNCH_PLANS", "1") != "0"


def w4a16_tune_cache() -> Optional[str]:
    """``FXOPT_W4A16_TUNE_CACHE``: the tuner's JSON file, or ``None`` for no file."""
    path = os.environ.get("FXOPT_W4A16_TUNE_CACHE")
    if path is None:
        path = os.path.join(os.path.expanduser("~"), ".cache", "fxopt", "w4a16_tuned.json")
    return None if path in ("", "0") else path


def no_tune() -> bool:
    """``FXOPT_NO_TUNE``: every tuner takes its first candidate without timing."""
    return os.environ.get("FXOPT_NO_TUNE") == "1"
