"""The ledger travels with the model: save -> load -> fit charges every earlier step.

Neighbouring relation and unit: add/remove one example (Poisson sampling, q = B / n fixed by
the declared batch size and population). Rule: every noised step ever taken is charged, so
after `model.save` -> `keras.models.load_model` (or a `tf.train.Checkpoint`) -> `fit`, the
ledger holds >= one sample per optimizer iteration, and epsilon equals that of an
uninterrupted run of as many steps, computed here with dp-accounting by hand (the same
sequence of Poisson-subsampled Gaussian events), not by the library's accountant. A model
restored without its ledger (weights only) refuses to train until the ledger is supplied.
"""

import functools
import os

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import weight_fingerprints
import tf_dpiter.keras  # noqa: F401  (registers the DP classes for load_model)

N, BATCH, Z, DELTA, EPOCHS = 200, 20, 1.1, 1e-5, 3
STEPS = N // BATCH


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _by_hand(steps):
  """epsilon of `steps` Poisson(q = B/n) Gaussian(z) steps, dp-accounting's RDP by hand.

  The step draws its noise at stddev z*S in float32 (S = 1: 1.1 -> 1.100000024), the noise
  the events carry.
  """
  acc = dpa.rdp.RdpAccountant()
  z = float(np.float32(Z))
  acc.compose(dpa.PoissonSampledDpEvent(BATCH / N, dpa.GaussianDpEvent(z)), steps)
  return acc.get_epsilon(DELTA)


def _trained(epochs):
  x, y = _data()
  model = _model()
  model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
  return model, x, y


@functools.lru_cache(maxsize=None)
def _shared_trained(epochs):
  """`_trained(epochs)` once per process, for the tests that only read that model (save it,
  checkpoint it, write its ledger) and restore into, and fit, models of their own."""
  return _trained(epochs)


def _assert_charged(model, steps):
  iterations = int(model.optimizer.iterations.numpy())
  samples = int(model.ledger.sample_count.numpy())
  assert iterations == steps and samples >= iterations
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(_by_hand(steps), rel=1e-9)


def test_save_load_fit_charges_every_earlier_step(tmp_path):
  model, x, y = _shared_trained(EPOCHS - 1)
  path = os.path.join(tmp_path, "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert int(loaded.ledger.sample_count.numpy()) == (EPOCHS - 1) * STEPS
  loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  _assert_charged(loaded, EPOCHS * STEPS)
  # the ledger of the loaded run is the ledger of one uninterrupted run, row for row
  uninterrupted, _, _ = _trained(EPOCHS)
  for a, b in zip(loaded.ledger.get_arrays(), uninterrupted.ledger.get_arrays()):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_restore_fit_charges_every_earlier_step(tmp_path):
  model, x, y = _shared_trained(EPOCHS - 1)
  path = tf.train.Checkpoint(model=model).save(os.path.join(tmp_path, "ckpt"))
  restored = _model()
  tf.train.Checkpoint(model=restored).restore(path)
  restored.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  _assert_charged(restored, EPOCHS * STEPS)


def test_load_weights_of_a_saved_model_continue_its_ledger(tmp_path):
  """The model's own weights-file entry carries the ledger (DPModelMixin.save_own_variables),
  so load_weights into a new model continues it; a short ledger supplied by hand is refused."""
  model, x, y = _shared_trained(EPOCHS - 1)
  path = os.path.join(tmp_path, "m.keras")
  model.save(path)
  restored = _model()
  restored.load_weights(path)               # weights, optimizer variables and the ledger
  assert int(restored.optimizer.iterations.numpy()) == (EPOCHS - 1) * STEPS
  assert int(restored.ledger.sample_count.numpy()) == (EPOCHS - 1) * STEPS
  short = dp.ledger.PrivacyLedger()
  with pytest.raises(ValueError, match="holds 0 samples"):
    restored.optimizer.restore_ledger(short)
  restored.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  _assert_charged(restored, EPOCHS * STEPS)


def test_checkpoint_of_iterations_without_ledger_refuses(tmp_path):
  model, x, y = _shared_trained(1)
  # a checkpoint that keeps the weights and the step counter but not the optimizer object
  path = tf.train.Checkpoint(weights=model.trainable_variables,
                             step=model.optimizer.iterations).save(os.path.join(tmp_path, "c"))
  # restored as in another process: in this one, the live run's values restored adopt its
  # ledger (weight_fingerprints' copies by value, review R17), which another process lacks
  weight_fingerprints._RELEASED.clear()  # pylint: disable=protected-access
  weight_fingerprints._RELEASED_KEYS.clear()  # pylint: disable=protected-access
  restored = _model()
  restored.optimizer.build(restored.trainable_variables)
  tf.train.Checkpoint(weights=restored.trainable_variables,
                      step=restored.optimizer.iterations).restore(path)
  assert int(restored.optimizer.iterations.numpy()) == STEPS
  with pytest.raises(ValueError, match="Supply the ledger"):
    restored.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_custom_loop_on_a_restored_optimizer_refuses_until_the_ledger_is_supplied(tmp_path):
  model, x, y = _shared_trained(1)
  ledger_path = os.path.join(tmp_path, "ledger.json")
  model.ledger.save_json(ledger_path)
  restored = _model()
  restored.optimizer.build(restored.trainable_variables)
  restored.optimizer.iterations.assign(STEPS)          # e.g. restored by a partial checkpoint
  opt = restored.optimizer
  opt.set_sampling(N, BATCH / N, "poisson")

  @tf.function
  def step(bx, by):
    grads = opt.compute_private_gradients(
        lambda d: keras.losses.sparse_categorical_crossentropy(d[1], restored(d[0]),
                                                               from_logits=True),
        restored.trainable_variables, data=(bx, by), model=restored)
    opt.apply_private_gradients(grads, restored.trainable_variables)

  with pytest.raises(ValueError, match="restore_ledger"):
    step(x[:BATCH], y[:BATCH])
  opt.restore_ledger(ledger_path)
  step(x[:BATCH], y[:BATCH])
  assert int(opt.ledger.sample_count.numpy()) == STEPS + 1 == int(opt.iterations.numpy())
