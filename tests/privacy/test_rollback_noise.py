"""Rollbacks never reuse noise and never uncharge a step (noise on, the real fit step).

Four ways the step counter (`optimizer.iterations`) and the weights go back on the same model
object in one process: an in-process retry with `keras.callbacks.BackupAndRestore`,
`tf.train.Checkpoint.restore` of an earlier step, `model.load_weights` and
`iterations.assign`. After each, the same step is taken again from the same weights on the
same records. With large noise (z = 10, S = 0.01) the update is the noise: two updates at one
counter with the same noise have correlation 1, independent ones about 1/sqrt(12,000).
Each is run with the noise drawn inside the XLA program (forced on CPU: the accelerator
default) and after it. The ledger must charge every released update; epsilon is compared
with dp-accounting called by hand on that many Poisson-sampled Gaussian steps.
"""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

S, Z, N, B, DELTA = 0.01, 10.0, 64, 16, 1e-5


def _model(compiled_draw):
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0)
  opt.private_step.set_flags(compiled_noise=compiled_draw)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=True)
  return model, opt


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 300)).astype("float32"), rng.normal(size=(N, 40)).astype("float32")


def _one_step(model, x, y, **kwargs):
  model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=1, verbose=0, **kwargs)


def _corr(u1, u2):
  a, b = u1 - u1.mean(), u2 - u2.mean()
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _hand_epsilon(steps):
  event = dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(B / N, dpa.GaussianDpEvent(Z)), steps)
  return dpa.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)


class _CrashAfterBackup(keras.callbacks.Callback):
  """Keeps the kernel after epoch 0 (what BackupAndRestore backs up) and raises at the end
  of epoch 1, before BackupAndRestore writes it."""

  def __init__(self, kernel):
    super().__init__()
    self.kernel, self.backed_up = kernel, None

  def on_epoch_end(self, epoch, logs=None):
    if epoch == 0:
      self.backed_up = self.kernel.numpy().copy()
    if epoch == 1:
      raise RuntimeError("simulated crash")


def _retry_updates(model, x, y, tmp_path):
  """An in-process retry with BackupAndRestore (the idiom of its Keras docstring): the lost
  epoch's update and the retried one, both from the backed-up weights; 4 released."""
  kernel = model.layers[0].kernel
  backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  crash = _CrashAfterBackup(kernel)
  _one_step(model, x, y)
  start = int(model.optimizer.iterations.numpy())
  with pytest.raises(RuntimeError, match="simulated crash"):
    model.fit(x, y, batch_size=B, epochs=2, steps_per_epoch=1, verbose=0,
              callbacks=[crash, backup])
  lost = kernel.numpy() - crash.backed_up
  model.fit(x, y, batch_size=B, epochs=2, steps_per_epoch=1, verbose=0, callbacks=[backup])
  # restored to the end of epoch 0, then epoch 1 again
  assert int(model.optimizer.iterations.numpy()) == start + 2
  return lost, kernel.numpy() - crash.backed_up, 4


def _rollback_updates(path, model, x, y, tmp_path):
  """The update of a step at counter k, and of the step at counter k again after rolling
  back by `path`; 3 released."""
  kernel = model.layers[0].kernel
  opt = model.optimizer
  _one_step(model, x, y)
  start, counter = kernel.numpy().copy(), int(opt.iterations.numpy())
  if path == "checkpoint":
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    saved = ckpt.save(str(tmp_path / "ck"))
  elif path == "load_weights":
    model.save_weights(str(tmp_path / "w.weights.h5"))
  _one_step(model, x, y)
  first = kernel.numpy() - start
  if path == "checkpoint":
    ckpt.restore(saved)
  elif path == "load_weights":
    model.load_weights(str(tmp_path / "w.weights.h5"))
  else:
    kernel.assign(start)
    opt.iterations.assign(counter)
  assert int(opt.iterations.numpy()) == counter
  np.testing.assert_array_equal(kernel.numpy(), start)
  _one_step(model, x, y)
  return first, kernel.numpy() - start, 3


def _assert_fresh_and_charged(model, opt, compiled_draw, path, first, second, released):
  assert model._dp_noise_inside == compiled_draw   # pylint: disable=protected-access
  corr = _corr(first.ravel(), second.ravel())
  assert abs(corr) < 0.1, (path, compiled_draw, corr)
  # every released update is charged: the ledger holds them all, epsilon as by hand
  assert int(opt.ledger.sample_count.numpy()) == released, path
  eps = dp.accounting.epsilon(opt.ledger, DELTA, accountant="rdp")
  assert eps == pytest.approx(_hand_epsilon(released), rel=1e-6)


@pytest.mark.parametrize("compiled_draw", [True, False])
def test_a_rollback_or_retry_draws_fresh_noise_and_stays_charged(compiled_draw, tmp_path):
  """The three rollbacks, then the retry with BackupAndRestore, in turn on one model (one
  compiled program): each one's retaken step is independent of the step it replaces, and the
  ledger charges all steps so far."""
  model, opt = _model(compiled_draw)
  x, y = _data()
  released = 0
  for path in ("checkpoint", "load_weights", "iterations_assign", "backup_and_restore"):
    if path == "backup_and_restore":
      first, second, count = _retry_updates(model, x, y, tmp_path)
    else:
      first, second, count = _rollback_updates(path, model, x, y, tmp_path)
    released += count
    _assert_fresh_and_charged(model, opt, compiled_draw, path, first, second, released)


def _band_mf_model(seed=None, bands=2):
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0, noise="band_mf", num_bands=bands,
                                     num_steps=16, seed=seed)
  model.compile(opt, keras.losses.MeanSquaredError())
  return model, opt


def _cyclic(x, y):
  with pytest.warns(UserWarning):   # a sampler seed is for tests only
    return dp.data.cyclic_poisson_batches(x, y, expected_batch_size=B, num_groups=2,
                                          steps_per_epoch=2, seed=1)


def test_a_correlated_mechanism_refuses_a_rolled_back_run(tmp_path):
  model, opt = _band_mf_model()
  x, y = _data()
  ds = _cyclic(x, y)
  model.fit(ds, epochs=1, verbose=0)
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  saved = ckpt.save(str(tmp_path / "ck"))
  model.fit(ds, epochs=1, verbose=0)
  ckpt.restore(saved)
  assert int(opt.iterations.numpy()) == 2 and int(opt.ledger.sample_count.numpy()) == 4
  # the cyclic sampler refuses first (eagerly)
  with pytest.raises(dp.errors.PrivacyConfigError, match="rolled a correlated-noise"):
    model.fit(ds, epochs=1, verbose=0)


def test_a_tree_mechanism_refuses_a_rolled_back_run():
  """Under shuffled passes the step itself refuses (no sampler check stands before it)."""
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0, noise="tree", restart_every=2)
  model.compile(opt, keras.losses.MeanSquaredError())
  x, y = _data()
  with pytest.warns(UserWarning):
    ds = dp.data.shuffling.shuffled_batches(x, y, batch_size=32, seed=1)   # 2 steps per pass
  model.fit(ds, epochs=2, verbose=0)
  opt.iterations.assign(2)
  with pytest.raises(tf.errors.InvalidArgumentError, match="cannot continue a rolled-back"):
    model.fit(ds, epochs=1, verbose=0)
  assert int(opt.ledger.sample_count.numpy()) == 4   # nothing released, nothing charged


def test_a_correlated_mechanism_resumed_elsewhere_draws_fresh_noise(tmp_path):
  """Without a seed the generator's state is not saved: a run resumed from a checkpoint in a
  new optimizer (another process; its noise state from save_noise_state's private file, as
  no checkpoint holds it) never redraws the noise of the steps taken after it. One band: the
  step's noise is its fresh draw alone (with more bands it also carries the restored
  history, which both runs share by design)."""
  model, opt = _band_mf_model(bands=1)
  x, y = _data()
  model.fit(_cyclic(x, y), epochs=1, verbose=0)
  saved = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ck"))
  opt.private_step.save_noise_state(str(tmp_path / "noise.npz"))
  names = [n for n, _ in tf.train.list_variables(saved)]
  start = model.layers[0].kernel.numpy().copy()
  model.fit(_cyclic(x, y), epochs=1, steps_per_epoch=1, verbose=0)
  first = model.layers[0].kernel.numpy() - start
  other, other_opt = _band_mf_model(bands=1)
  other_opt.prepare_mechanism(other.trainable_variables)
  tf.train.Checkpoint(model=other, optimizer=other_opt).restore(saved).assert_consumed()
  other_opt.private_step.restore_noise_state(str(tmp_path / "noise.npz"))
  np.testing.assert_array_equal(other.layers[0].kernel.numpy(), start)
  other.fit(_cyclic(x, y), epochs=1, steps_per_epoch=1, verbose=0)
  second = other.layers[0].kernel.numpy() - start
  assert abs(_corr(first.ravel(), second.ravel())) < 0.1
  seeded, seeded_opt = _band_mf_model(seed=3, bands=1)
  seeded_opt.prepare_mechanism(seeded.trainable_variables)
  assert len(seeded_opt.variables) == len(opt.variables) + 1   # the generator: seeded only
  assert len(names) > 3
