"""Shuffled passes are counted by the sampler and charged one mechanism each (issue 11 item 3).

Under policy "shuffle" each pass over a fresh permutation costs one un-amplified Gaussian
mechanism at sensitivity 2S (replace-one), whatever the number of steps in it; every pass
started counts, complete or partial. dp-accounting called by hand on those events must give
the ledger's epsilon.
"""

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting

# Nightly tier (-m slow): the epochs-as-passes settings beyond 3 epochs with
# microbatches of 4 (the case holding both multi-epoch and microbatches).
SLOW_CASES = {
    "test_epochs_of_shuffled_fit_are_passes[3-None]",
    "test_epochs_of_shuffled_fit_are_passes[1-4]",
    "test_epochs_of_shuffled_fit_are_passes[1-None]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
Z, CLIP, DELTA = 1.1, 1.0, 1e-5


def _model(microbatches=None):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, Z, microbatches, learning_rate=0.1),
                loss=LOSS)
  return model


def _data(n):
  rng = np.random.RandomState(0)
  return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


def _by_hand(mechanisms):
  """Epsilon of `mechanisms` un-amplified Gaussians of noise sigma = Z * CLIP at sensitivity
  2 * CLIP (replace-one), by dp-accounting directly."""
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  stddev = float(np.float32(Z * CLIP))   # the query's stddev, as the ledger recorded it
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(stddev / (2 * CLIP)), mechanisms))
  return acc.get_epsilon(DELTA)


def test_repeated_one_step_fits_charge_one_pass_each():
  # The case: 30 fit calls of one step each, after keras.utils.set_random_seed(0).
  # Each call draws a new permutation (a new pass): 30 mechanisms, not ceil(30 / 10) = 3.
  x, y = _data(320)
  model = _model()
  keras.utils.set_random_seed(0)
  for _ in range(30):
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, sampling="shuffle", verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 30
  assert int(model.ledger.passes.numpy()) == 30
  eps = accounting.epsilon(model.ledger, DELTA)
  assert eps == pytest.approx(_by_hand(30), rel=1e-9)
  assert eps > 3 * _by_hand(3)


@pytest.mark.parametrize("microbatches", [None, 4])
@pytest.mark.parametrize("epochs", [1, 3])
def test_epochs_of_shuffled_fit_are_passes(epochs, microbatches):
  x, y = _data(100)
  model = _model(microbatches)
  hist = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, sampling="shuffle",
                   callbacks=[dp.keras.callbacks.PrivacyMeter(DELTA)])
  assert int(model.ledger.sample_count.numpy()) == 4 * epochs     # ceil(100 / 32) per pass
  assert int(model.ledger.passes.numpy()) == epochs
  run = model.ledger.to_dict()["runs"][0]
  assert run["examples_per_record"] == (1 if microbatches is None else 8)
  assert run["queries"][0]["sensitivity"] == 2 * CLIP
  assert hist.history["epsilon"][-1] == pytest.approx(_by_hand(epochs), rel=1e-9)
  # what Poisson with the same q = 32/100, noise and number of steps would have cost
  poisson = dpa.rdp.RdpAccountant()
  poisson.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
      0.32, dpa.GaussianDpEvent(float(np.float32(Z * CLIP)) / CLIP)), 4 * epochs))
  assert hist.history["epsilon_if_poisson"][-1] == pytest.approx(
      poisson.get_epsilon(DELTA), rel=1e-9)
  assert hist.history["epsilon_if_poisson"][-1] < hist.history["epsilon"][-1]


def test_shuffled_dataset_passed_to_fit_counts_its_passes():
  x, y = _data(60)
  model = _model()
  ds = dp.data.shuffled_batches(x, y, batch_size=20)
  model.fit(ds, epochs=2, verbose=0)
  model.fit(ds, epochs=1, steps_per_epoch=1, verbose=0)   # a partial pass is a pass
  assert int(model.ledger.sample_count.numpy()) == 7
  assert int(model.ledger.passes.numpy()) == 3
  assert accounting.epsilon(model.ledger, DELTA) == pytest.approx(_by_hand(3), rel=1e-9)


def test_undeclared_data_is_refused_with_how_to_declare_it():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, y = _data(40)
  model = _model()
  model.fit(x, y, batch_size=10, verbose=0)   # declared by fit (Poisson) ...
  plain = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
  with pytest.raises(ValueError, match="poisson_batches.*shuffled_batches.*set_sampling.*"
                                       "record_passes"):
    model.fit(plain, verbose=0)               # ... which does not cover other data

  def gen():
    yield x[:10], y[:10]
  with pytest.raises(ValueError, match="cannot tell how this data is sampled"):
    model.fit(gen(), verbose=0)
  with pytest.raises(ValueError, match="sampling='shuffle' applies to arrays only"):
    model.fit(dp.data.poisson_batches(x, y, expected_batch_size=10), sampling="shuffle",
              verbose=0)
  # declared by hand: accepted; with no passes recorded every sample is its own pass
  model2 = _model()
  model2.optimizer.set_sampling(40, 0.25, "shuffle", 10)
  model2.fit(plain, epochs=1, verbose=0)
  assert int(model2.ledger.passes.numpy()) == 0
  assert accounting.epsilon(model2.ledger, DELTA) == pytest.approx(_by_hand(4), rel=1e-9)
