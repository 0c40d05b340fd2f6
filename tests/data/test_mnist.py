"""dp.data.load_mnist: the one MNIST loader of tutorials, benchmarks and federated data."""

import numpy as np
import pytest

import tf_dpiter as dp


def _write(path, n_train=7, n_test=3):
  rng = np.random.default_rng(0)
  np.savez(path, x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
           y_train=rng.integers(0, 10, n_train), x_test=rng.integers(0, 256, (n_test, 28, 28),
                                                                     dtype=np.uint8),
           y_test=rng.integers(0, 10, n_test))
  return str(path)


def test_images_scaled_to_unit_range_with_channel_axis(tmp_path):
  path = _write(tmp_path / "m.npz")
  xtr, ytr, xte, yte = dp.data.load_mnist(path, train_size=5)
  with np.load(path) as d:
    raw = d["x_train"][:5]
  assert xtr.shape == (5, 28, 28, 1) and xte.shape == (3, 28, 28, 1)
  assert xtr.dtype == np.float32 and ytr.dtype == np.int32 and yte.dtype == np.int32
  np.testing.assert_allclose(xtr[..., 0] * 255.0, raw, atol=1e-4)


def test_flat_form_is_what_federated_uses(tmp_path):
  path = _write(tmp_path / "m.npz")
  flat = dp.data.load_mnist(path, flatten=True)
  fed = dp.federated.load_mnist(path)
  assert flat[0].shape == (7, 784)
  for a, b in zip(flat, fed):
    np.testing.assert_array_equal(a, b)


def test_environment_variable_gives_the_default_path(monkeypatch, tmp_path):
  monkeypatch.setenv("TF_DPITER_MNIST", str(tmp_path / "x.npz"))
  assert dp.data.default_mnist_path() == str(tmp_path / "x.npz")


def test_missing_file_and_bad_size_name_the_parameter(tmp_path):
  with pytest.raises(ValueError, match=r"`path` must be .*Received: path="):
    dp.data.load_mnist(str(tmp_path / "missing.npz"))
  # ... and says how to obtain the file.
  with pytest.raises(dp.ParameterValueError,
                     match=r"keras\.datasets\.mnist\.load_data\(\) caches it at "
                           r"~/\.keras/datasets/mnist\.npz; copy it"):
    dp.data.load_mnist(str(tmp_path / "missing.npz"))
  path = _write(tmp_path / "m.npz")
  with pytest.raises(ValueError, match="train_size"):
    dp.data.load_mnist(path, train_size=0)
