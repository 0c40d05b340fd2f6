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


def test_a_noise_state_of_another_run_with_as_many_samples_is_refused(tmp_path):
  """Two runs of 4 steps each (equal sample counts): run A's noise state restored into run B
  (whose released weights carry B's noise) is refused at the restore, B's state untouched; into
  a fresh model restored afterwards from B's checkpoint, at B's next fit (the run tables differ:
  `ledger.run_ids`). Run A's own checkpoint and its state resume (the same table)."""
  import tensorflow as tf
  run_a, run_b = _model(num_bands=2, num_steps=8), _model(num_bands=2, num_steps=8)
  _fit(run_a)
  _fit(run_b)
  assert int(run_a.ledger.sample_count) == int(run_b.ledger.sample_count) == 4
  run_a.optimizer.save_noise_state(str(tmp_path / "a.npz"))
  b_state = [np.array(v) for v in run_b.optimizer.noise_state()]
  with pytest.raises(PrivacyConfigError, match="a state of another run"):
    run_b.optimizer.restore_noise_state(str(tmp_path / "a.npz"))
  for got, want in zip(run_b.optimizer.noise_state(), b_state):
    np.testing.assert_array_equal(np.asarray(got), want)

  b_ckpt = tf.train.Checkpoint(model=run_b, optimizer=run_b.optimizer).save(
      str(tmp_path / "b"))
  a_ckpt = tf.train.Checkpoint(model=run_a, optimizer=run_a.optimizer).save(
      str(tmp_path / "a"))
  fresh = _model(num_bands=2, num_steps=8)
  fresh.optimizer.build(fresh.trainable_variables)
  fresh.optimizer.restore_noise_state(str(tmp_path / "a.npz"))   # the ledger holds 0: later
  tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(b_ckpt)
  assert int(fresh.ledger.sample_count) == 4
  with pytest.raises(PrivacyConfigError, match="a state of another run"):
    _fit(fresh)
  assert int(fresh.ledger.sample_count) == 4   # nothing charged, nothing released

  resumed = _model(num_bands=2, num_steps=8)
  resumed.optimizer.build(resumed.trainable_variables)
  tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(a_ckpt)
  resumed.optimizer.restore_noise_state(str(tmp_path / "a.npz"))
  _fit(resumed)
  assert int(resumed.ledger.sample_count) == 8
