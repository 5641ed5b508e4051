"""Every ``gl.warp_specialize`` call in the Gluon kernels takes its partition list, worker warp counts and register
budgets as list literals. A list built with ``+`` (such as the dQ reducer warp's partition appended as
``[...] + ([...] if DQW else [])``) unwraps constexpr arguments into Python ints; Triton's launcher
makes the constexpr 1 of an int argument equal to 1 (GROUP = 1, the common case), and the build then fails at run
time with "'int' object has no attribute '_flatten_ir'" while every offline build, all-i32, passes."""
import ast
import os

import pytest

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fxopt",
                          "kernels")
MODULES = sorted(os.path.relpath(os.path.join(d, f), KERNEL_DIR) for d, _, files in os.walk(KERNEL_DIR)
                 for f in files if f.endswith(".py"))


def _warp_specialize_calls(path):
    tree = ast.parse(open(path).read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warp_specialize":
            yield node


def test_literal_lists_are_checked_on_a_planted_sum(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def k():\n    gl.warp_specialize([(f, (a,))] + ([(g, (b,))] if X else []), [1], [24])\n")
    calls = list(_warp_specialize_calls(str(bad)))
    assert len(calls) == 1 and not isinstance(calls[0].args[0], ast.List)


def test_every_kernel_module_is_scanned():
    # a finder that stopped finding the calls would pass vacuously
    counts = {m: len(list(_warp_specialize_calls(os.path.join(KERNEL_DIR, m)))) for m in MODULES}
    assert counts[os.path.join("attention", "gluon_fwd.py")] == 3, counts
    assert counts[os.path.join("attention", "gluon_bwd.py")] == 2, counts
    assert counts[os.path.join("fp8", "gluon_fwd.py")] == 1, counts


@pytest.mark.parametrize("module", MODULES)
def test_warp_specialize_arguments_are_list_literals(module):
    calls = list(_warp_specialize_calls(os.path.join(KERNEL_DIR, module)))
    for call in calls:
        for i, arg in enumerate(call.args[:3]):
            assert isinstance(arg, ast.List), (f"{module}:{call.lineno}: argument {i} of warp_specialize is "
                                               f"{type(arg).__name__}, not a list literal")
        for part in call.args[0].elts:  # (function, (arguments...)) with a tuple literal of arguments
            assert isinstance(part, ast.Tuple) and isinstance(part.elts[1], ast.Tuple), \
                f"{module}:{call.lineno}: a partition is not (function, (argument tuple literal))"
