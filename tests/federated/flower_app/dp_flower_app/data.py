"""The tiny synthetic data set of the federated tests (no Flower import: conftest uses it)."""

import numpy as np


def synthetic(num_examples=400, dim=12, classes=4, seed=0):
  """Gaussian clusters around `classes` random centers: x [n, dim] float32, y [n] int32."""
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(classes, dim)).astype(np.float32) * 2
  y = rng.integers(0, classes, num_examples).astype(np.int32)
  x = (centers[y] + rng.normal(size=(num_examples, dim))).astype(np.float32)
  return x, y
