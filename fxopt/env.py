"""Every environment variable fxopt reads, one accessor each (table: docs/configuration.md). Pass and kernel
choices are :class:`fxopt.Config` fields; these are process-wide plumbing. Each accessor reads the variable when
called, so a test's ``monkeypatch.setenv`` takes effect at once.
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
