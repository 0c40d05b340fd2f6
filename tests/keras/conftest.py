import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

from tf_dpiter.dp_query import NotPrivateSeedWarning  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_seed_warnings():
  # Tests fix seeds on purpose (reproducible, hence not private).
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    yield

@pytest.fixture(scope="module")
def mnist_or_synthetic_path(tmp_path_factory):
  """Real MNIST where the suite finds it (TF_DPITER_MNIST or ../shared/data/mnist.npz, as
  tests/conftest.py), else a small synthetic MNIST-layout npz (2,000 train, 500 test)."""
  from tests.conftest import MNIST_PATH  # pylint: disable=import-outside-toplevel
  if os.path.exists(MNIST_PATH):
    return MNIST_PATH
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(0)
  arrays = {}
  for split, n in (("train", 2000), ("test", 500)):
    y = rng.randint(0, 10, n).astype("uint8")
    arrays[f"x_{split}"] = (rng.rand(n, 28, 28) * 60 + y[:, None, None] * 19).astype("uint8")
    arrays[f"y_{split}"] = y
  path = str(tmp_path_factory.mktemp("mnist") / "mnist_small.npz")
  np.savez(path, **arrays)
  return path
