"""q is a stated public parameter, fixed once per run (issue 26, item 6).

`poisson_batches(..., population_size=N)` states q = B / N whatever the number of records
given, so two neighbouring datasets (one record more or less) are sampled with the same q;
`fit` on arrays fixes N at the run's first fit (its ledger) and keeps q = B / N afterwards.
The real pipeline is checked: the records' empirical rate is q, not B / n.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data import sampling


def test_declared_population_fixes_q_for_a_neighbouring_dataset():
  x = np.arange(8, dtype=np.float32)[:, None]
  full = sampling.poisson_batches(x, expected_batch_size=6, population_size=8,
                                  steps_per_epoch=400, max_batch_size=None)
  neighbour = sampling.poisson_batches(x[:7], expected_batch_size=6, population_size=8,
                                       steps_per_epoch=400, max_batch_size=None)
  for ds, n in ((full, 8), (neighbour, 7)):
    spec = sampling.get_sampling_spec(ds)
    assert spec.selection_probability == 0.75 and spec.population_size == 8.0
    joins = np.zeros(8)
    for bx, w in ds:
      joins[bx.numpy()[w.numpy() > 0, 0].astype(int)] += 1
    rate = joins[:n] / 400
    assert np.all(np.abs(rate - 0.75) < 5 * np.sqrt(0.75 * 0.25 / 400))   # q, not 6 / 7
    assert joins[n:].sum() == 0


def test_bad_population_size_is_refused():
  x = np.zeros((8, 1), np.float32)
  with pytest.raises(ValueError, match=r"`population_size` must be (None or )?a number >= 1"):
    sampling.poisson_batches(x, expected_batch_size=2, population_size=0)
  with pytest.raises(ValueError, match=r"`expected_batch_size` must be a number in \(0, n=4"):
    sampling.poisson_batches(x, expected_batch_size=6, population_size=4)


def test_fit_keeps_q_of_the_runs_first_fit():
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x, y = rng.randn(8, 3).astype(np.float32), rng.randint(0, 2, 8)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=6, epochs=1, steps_per_epoch=5, verbose=0)
  with pytest.warns(UserWarning, match=r"stated over N=8 records .* these arrays hold 7"):
    model.fit(x[:7], y[:7], batch_size=6, epochs=1, steps_per_epoch=5, verbose=0)
  samples, _ = model.ledger.get_arrays()
  assert samples.shape[0] == 10
  np.testing.assert_array_equal(samples[:, 0], 8.0)
  np.testing.assert_array_equal(samples[:, 1], 0.75)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(ValueError, match=r"batch_size=9 is more than the population size N=8"):
      model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=9, verbose=0)
