"""Test-session setup shared by every fxopt test.

* Each pytest run gets its own Inductor and Triton cache directories (and W4A16
  tuner file), so a stale cache from another run can never hide a change; the
  xdist workers of one run share them.
* Without CUDA, Triton kernels run through the Triton interpreter
  (``TRITON_INTERPRET=1``) on CPU tensors. This must be set before Triton is
  imported anywhere, hence at the very top of this file.
* ``@pytest.mark.gpu`` tests are skipped without CUDA.
* ``run_on_ranks(fn, world_size=2)`` runs ``fn(rank, world_size, *args)`` on
  ``world_size`` gloo processes (spawn) and re-raises the first failure.
* Launch plans (``fxopt.kernels.launch_plan``) are cleared around every test.
* Dynamo's caches are reset before every test: compiled entries of one model's
  ``forward`` would otherwise pile up across tests and hit Dynamo's recompile
  limit (fatal under ``fullgraph=True``), making a test depend on the ones before it.
"""
import os
import tempfile

# pytest-xdist workers of one run share one root (their compiles fill one cache), keyed by the run's id
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN_ID:
    _CACHE_ROOT = os.path.join(tempfile.gettempdir(), f"fxopt-test-cache-{_RUN_ID}")
    os.makedirs(_CACHE_ROOT, exist_ok=True)
else:
    _CACHE_ROOT = tempfile.mkdtemp(prefix="fxopt-test-cache-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "triton")
# the W4A16 tuner's picks persist to a file (FXOPT_W4A16_TUNE_CACHE, fxopt.env): one per test run, never ~/.cache
os.environ["FXOPT_W4A16_TUNE_CACHE"] = os.path.join(
    _CACHE_ROOT, f"w4a16_tuned_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json")
# every tuner takes its first candidate (fast GPU tests); the tuner tests clear it where they time
os.environ.setdefault("FXOPT_NO_TUNE", "1")

import torch  # noqa: E402  (torch does not import Triton eagerly)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fxopt.testing import run_on_ranks  # noqa: E402,F401  (re-exported for tests)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 cores")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    # launch plans key on arguments and FXOPT_* switches, not on module globals a test may patch
    from fxopt.kernels.launch_plan import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.fixture
def interpret_device():
    """Device for Triton kernel tests: CUDA when present, else CPU via the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
