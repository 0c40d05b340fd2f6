"""What is charged is what the steps used; the budget looks ahead per policy (issue 26, item 7).

Shuffled passes and balls-in-bins epochs are charged when one of their steps is taken (a
pass a prefetch started and the fit dropped costs nothing); StopAtPrivacyBudget never ends
above its budget, stops BandMF only when the next step costs more, and does not crash under
balls in bins; a tree whose restart period does not divide the real (drop_remainder) pass
is refused before any step.
"""

import math
import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data import balls_in_bins
from tf_dpiter.data import shuffling
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.callbacks import StopAtPrivacyBudget

# Nightly tier (-m slow): the shuffled budget at 40 (25 stays).
SLOW_CASES = {
    "test_budget_under_shuffle_ends_at_or_below_the_budget[40.0]"}

DELTA = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(48, 4).astype("float32"), rng.randint(0, 3, 48)


def _model(z=1.0, **noise):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, z, learning_rate=0.1, **noise),
                  loss=LOSS)
  return model


def _fit(model, ds, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(ds, verbose=0, **kwargs)


def test_shuffle_charges_the_passes_its_steps_used_not_the_prefetched_ones():
  x, y = _data()
  model = _model()
  ds = shuffling.shuffled_batches(x, y, batch_size=12, passes=None)   # 4 steps per pass
  for _ in range(5):
    _fit(model, ds, epochs=1, steps_per_epoch=3)   # every fit starts a new permutation
  # 5 fits of 3 steps, each in its own pass (a new iterator): 5 passes used; the pass each
  # fit's prefetch started after its third step was never used.
  assert int(model.ledger.sample_count) == 15 and int(model.ledger.passes) == 5


@pytest.mark.parametrize("budget", [25.0, 40.0])
def test_budget_under_shuffle_ends_at_or_below_the_budget(budget):
  x, y = _data()
  model = _model(z=0.6)
  stop = StopAtPrivacyBudget(budget, DELTA)
  _fit(model, shuffling.shuffled_batches(x, y, batch_size=12, passes=None), epochs=1,
       steps_per_epoch=200, callbacks=[stop])
  steps, passes = int(model.ledger.sample_count), int(model.ledger.passes)
  eps = dp.accounting.epsilon(model.ledger, DELTA)
  assert eps <= budget
  assert steps > 0 and passes == math.ceil(steps / 4) and steps % 4 == 0   # a pass boundary
  # the next pass would have passed the budget
  led = model.ledger
  over = dp.accounting.epsilon((*led.get_arrays(), passes + 1), DELTA)
  assert over > budget


def test_budget_under_balls_in_bins_looks_ahead_without_crashing():
  x, y = _data()
  model = _model()
  stop = StopAtPrivacyBudget(12.0, DELTA)
  _fit(model, balls_in_bins.balls_in_bins_batches(x, y, steps_per_epoch=4), epochs=50,
       callbacks=[stop])
  steps, epochs = int(model.ledger.sample_count), int(model.ledger.passes)
  assert 0 < steps < 200 and epochs == math.ceil(steps / 4)
  assert dp.accounting.epsilon(model.ledger, DELTA) <= 12.0
  over = dp.accounting.epsilon((*model.ledger.get_arrays(), epochs + 1), DELTA)
  assert over > 12.0


def test_budget_under_band_mf_takes_every_step_that_costs_the_same():
  x, y = _data()
  model = _model(noise="band_mf", num_bands=4, num_steps=40)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ds = cyclic_poisson_batches(x, y, expected_batch_size=3, num_groups=4, steps_per_epoch=40)
  eps_of = {}
  stop = StopAtPrivacyBudget(4.0, DELTA)
  _fit(model, ds, epochs=1, callbacks=[stop])
  steps = int(model.ledger.sample_count)
  samples, queries = model.ledger.get_arrays()
  # participations ceil(t / 4): epsilon is flat on 1-4, 5-8, 9-12, so the stop is at a
  # multiple of 4 and the next step starts a participation (epsilon of the two step counts
  # the assertion reads, t = steps and steps + 1)
  assert steps % 4 == 0 and 0 < steps < 12
  for t in (steps, steps + 1):
    eps_of[t] = dp.accounting.epsilon((np.repeat(samples[:1], t, 0), np.concatenate(
        [np.c_[np.full(len(queries[:1]), i), queries[:1, 1:]] for i in range(t)])), DELTA)
  assert eps_of[steps] <= 4.0 < eps_of[steps + 1]


def test_tree_on_drop_remainder_passes_is_checked_with_the_real_pass_length():
  rng = np.random.RandomState(0)
  x, y = rng.randn(50, 4).astype("float32"), rng.randint(0, 3, 50)
  model = _model(noise="tree", restart_every=5)   # ceil(50 / 12) = 5, but floor = 4
  ds = shuffling.shuffled_batches(x, y, batch_size=12, drop_remainder=True)
  with pytest.raises(PrivacyConfigError, match=r"a pass of this dataset is 4 steps"):
    _fit(model, ds, epochs=1)
  assert int(model.ledger.sample_count) == 0
