"""`optimizer.save_noise_state(path)` / `optimizer.restore_noise_state(path)`: the public
aliases of the private step's methods (one implementation) write and restore the correlated
mechanism's state exactly, and refuse what the step refuses.

The file holds the noise of the released weights (as secret as the data); the run it resumes
keeps its ledger (add/remove one under cyclic Poisson, unit: the example).
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.errors import PrivacyConfigError


def _model(noise="band_mf", **params):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.9, seed=7, noise=noise, learning_rate=0.05,
                                       **params)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _fit(model):
  rng = np.random.RandomState(0)
  x, y = rng.randn(48, 6).astype("float32"), rng.randint(0, 3, 48)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ds = cyclic_poisson_batches(x, y, expected_batch_size=6, num_groups=2, steps_per_epoch=4,
                                seed=1)
    model.fit(ds, verbose=0, epochs=1)


def test_optimizer_methods_write_and_restore_the_step_state(tmp_path):
  model = _model(num_bands=2, num_steps=8)
  _fit(model)
  state = [np.array(a) for a in model.optimizer.noise_state()]
  assert any(np.any(a != 0) for a in state)   # a state worth restoring
  model.optimizer.save_noise_state(str(tmp_path / "alias.npz"))
  model.optimizer.private_step.save_noise_state(str(tmp_path / "step.npz"))
  with np.load(tmp_path / "alias.npz") as a, np.load(tmp_path / "step.npz") as b:
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
      np.testing.assert_array_equal(a[k], b[k])
  other = _model(num_bands=2, num_steps=8)
  other.optimizer.build(other.trainable_variables)
  before = [np.array(a) for a in other.optimizer.noise_state()]
  assert any(np.any(a != b) for a, b in zip(before, state))   # a fresh state differs
  other.optimizer.restore_noise_state(str(tmp_path / "alias.npz"))
  for got, want in zip(other.optimizer.noise_state(), state):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_optimizer_methods_refuse_as_the_step():
  iid = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  with pytest.raises(PrivacyConfigError, match="save_noise_state applies to a correlated"):
    iid.save_noise_state("unused.npz")
  with pytest.raises(PrivacyConfigError, match="restore_noise_state applies to a correlated"):
    iid.restore_noise_state("unused.npz")


def test_the_optimizer_methods_call_the_step_methods(tmp_path, monkeypatch):
  """One implementation: the optimizer's methods delegate to its private step's."""
  model = _model(num_bands=2, num_steps=8)
  calls = []
  step = model.optimizer.private_step
  monkeypatch.setattr(step, "save_noise_state", lambda path: calls.append(("save", path)))
  monkeypatch.setattr(step, "restore_noise_state", lambda path: calls.append(("restore", path)))
  model.optimizer.save_noise_state("a.npz")
  model.optimizer.restore_noise_state("b.npz")
  assert calls == [("save", "a.npz"), ("restore", "b.npz")]
