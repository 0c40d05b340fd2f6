"""Shared test configuration: quiet TF logs, the `slow` marker, the MNIST path."""

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


@pytest.fixture
def mnist_path():
  if not os.path.exists(MNIST_PATH):
    pytest.skip(f"MNIST not found at {MNIST_PATH} (set TF_DPITER_MNIST)")
  return MNIST_PATH
