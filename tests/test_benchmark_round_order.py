"""The benchmarks' interleaved timing order (``benchmarks/common.py::round_order``, used by
benchmarks/attention.py): every round is a permutation of the candidates, and no candidate is always timed right
after the same one (a rotation that kept fwd_fxopt always after cuDNN measured it 1-7% under the same kernel
timed as fwd_gluon)."""
import importlib.util
import os

import pytest


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "common.py")
    spec = importlib.util.spec_from_file_location("fxopt_bench_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n", [3, 4, 5])
def test_round_orders_vary_each_candidates_predecessor(bench, n):
    names = [f"c{i}" for i in range(n)]
    orders = [bench.round_order(names, r) for r in range(3)]
    assert all(sorted(o) == names for o in orders)
    assert orders[0] == names
    for r in range(2):  # between consecutive rounds, every candidate not first in both has a new predecessor
        pred = [{b: a for a, b in zip(o, o[1:])} for o in orders[r:r + 2]]
        for c in names:
            if c in pred[0] and c in pred[1]:
                assert pred[0][c] != pred[1][c], (n, r, c, orders)
