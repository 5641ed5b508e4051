"""fxopt's graph passes: one file per pass, registered with :mod:`fxopt.passes.manager`.

Order (fixed): attention → w4a16 → tensor_parallel → pipeline. See each module's docstring for its design.
"""
from .manager import PASS_ORDER, PassContext, PassResult, Skip, register_pass, registered_passes, run_passes

__all__ = ["PASS_ORDER", "PassContext", "PassResult", "Skip", "register_pass", "registered_passes", "run_passes"]


def _import_passes() -> None:
    import importlib

    for name in PASS_ORDER:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:  # a pass not written yet is simply not registered
            if e.name != f"{__name__}.{name}":
                raise


_import_passes()
