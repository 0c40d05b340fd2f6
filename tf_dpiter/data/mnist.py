"""MNIST from a local keras-layout .npz file (no download): the data of the tutorials,
benchmarks and federated simulations, loaded in one place.

The file holds x_train [60000, 28, 28] uint8, y_train, x_test [10000, 28, 28], y_test (the
layout of `keras.datasets.mnist`). Its path: the argument, else the environment variable
TF_DPITER_MNIST, else ../shared/data/mnist.npz beside the repository.
"""

import os

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


def default_mnist_path():
  """Path of mnist.npz: env TF_DPITER_MNIST, else ../shared/data/mnist.npz from the repo root.

  Returns:
    a path string (not checked for existence).
  """
  env = os.environ.get("TF_DPITER_MNIST")
  if env:
    return env
  repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return os.path.normpath(os.path.join(repo_root, "..", "shared", "data", "mnist.npz"))


def load_mnist(path=None, train_size=None, test_size=None, flatten=False):
  """MNIST images scaled to [0, 1] and int32 labels.

  Args:
    path: the .npz path; None: `default_mnist_path()`.
    train_size: keep the first `train_size` training examples (None: all 60,000).
    test_size: keep the first `test_size` test examples (None: all 10,000).
    flatten: images as float32 [n, 784] instead of [n, 28, 28, 1].

  Returns:
    (x_train, y_train, x_test, y_test).

  Raises:
    ParameterValueError: the file does not exist, or a size below 1.
  """
  path = path or default_mnist_path()
  if not os.path.exists(path):
    raise ParameterValueError(
        f"`path` must be an existing keras-layout mnist.npz: on a machine with internet, "
        f"keras.datasets.mnist.load_data() caches it at ~/.keras/datasets/mnist.npz; copy it "
        f"to this path, or pass its path (--data_path) or set TF_DPITER_MNIST. Received: "
        f"path={path!r}")
  for name, size in (("train_size", train_size), ("test_size", test_size)):
    if size is not None:
      validation.check_integer(name, size, 1)
  with np.load(path) as d:
    xtr, ytr = d["x_train"][:train_size], d["y_train"][:train_size]
    xte, yte = d["x_test"][:test_size], d["y_test"][:test_size]

  def scale(a):
    a = a.astype(np.float32) / 255.0
    return a.reshape(a.shape[0], -1) if flatten else a.reshape(a.shape[0], 28, 28, 1)
  return scale(xtr), ytr.astype(np.int32), scale(xte), yte.astype(np.int32)
