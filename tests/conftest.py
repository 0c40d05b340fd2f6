"""Shared test configuration: quiet TF logs, XLA's LLVM level, the `slow` marker, the MNIST path."""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles the tests' many small programs with LLVM's -O0 (about 10 % less test CPU on
# the XLA-heavy files): the HLO passes, and so the programs the tests check, are unchanged,
# and without fast-math either level computes the same IEEE operations. Set here, before
# TensorFlow starts (subprocesses inherit it); a level already in XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

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
