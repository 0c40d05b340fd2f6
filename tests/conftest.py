"""Shared test configuration: quiet TF logs, the `slow` marker, the MNIST path.

Two tiers: the default suite (`python -m pytest -q -n 2`, pytest.ini's `-m "not slow"`) and
the nightly one (`python -m pytest -q -n 2 -m slow`). A case joins the nightly tier by
`@pytest.mark.slow`, by `pytest.param(..., marks=pytest.mark.slow)`, or by its id (the test's
name with its parameter id, as pytest prints it) in its module's `SLOW_CASES` set, which
`pytest_collection_modifyitems` below marks slow; `python tools/suite_tiers.py --check`
counts both tiers and fails on a `SLOW_CASES` id that names no case.
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_PATH = os.environ.get("TF_DPITER_MNIST",
                            os.path.join(REPO_ROOT, "..", "shared", "data", "mnist.npz"))


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long runs, not part of the default suite")
  warnings.filterwarnings("ignore", message=".*NOT differentially private.*")


@pytest.hookimpl(tryfirst=True)   # before the `-m` deselection
def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.name in getattr(getattr(item, "module", None), "SLOW_CASES", ()):
      item.add_marker(pytest.mark.slow)


@pytest.fixture
def mnist_path():
  if not os.path.exists(MNIST_PATH):
    pytest.skip(f"MNIST not found at {MNIST_PATH} (set TF_DPITER_MNIST)")
  return MNIST_PATH
