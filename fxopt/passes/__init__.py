"""fxopt's graph passes: one module per pass, registered with :mod:`fxopt.passes.manager`.

Order (fixed): attention → w4a16 → tensor_parallel → pipeline. See each module's docstring for its design.
"""
from .manager import PASS_ORDER, PassContext, PassResult, Skip, register_pass, registered_passes, run_passes
from . import attention, w4a16, tensor_parallel, pipeline  # noqa: F401,I001  (importing a pass registers it)

__all__ = ["PASS_ORDER", "PassContext", "PassResult", "Skip", "register_pass", "registered_passes", "run_passes"]
