"""Shared small fixtures: a tiny MLP on synthetic data keeps every test fast."""

import warnings

import numpy as np
import pytest

from tf_dpiter import federated as F


@pytest.fixture(autouse=True)
def _quiet_seed_warnings():
  # Tests fix seeds on purpose (reproducible, hence not private); silence that warning.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*NOT differentially private.*")
    yield


def synthetic(num_examples=400, dim=12, classes=4, seed=0):
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(classes, dim)).astype(np.float32) * 2
  y = rng.integers(0, classes, num_examples).astype(np.int32)
  x = (centers[y] + rng.normal(size=(num_examples, dim))).astype(np.float32)
  return x, y


@pytest.fixture
def tiny():
  x, y = synthetic()
  model = F.MLP((12, 8, 4), use_bias=True)
  return model, x, y
