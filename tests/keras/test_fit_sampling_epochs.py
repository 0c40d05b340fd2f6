"""DP fit on arrays keeps ONE iterator of its Poisson samples for all its epochs (issue 42).

A new iterator per epoch cost a new tf.data iterator, its generator's start and first draw,
and the old iterator's teardown at every epoch's start (benchmarks/epoch_start_time.py).
Poisson steps are independent, so an endless sampler whose draws run ahead across the epoch
boundary gives every step the same law and, for a seed, the same sample as before.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterTypeError


def _records(n=40):
  """n records whose feature is their index, so a batch names the records it holds."""
  x = np.arange(n, dtype=np.float32).reshape(n, 1)
  return x, np.zeros(n, np.int32)


def _members(batch):
  """The record indices of one (x, y, weights) batch (its rows of weight 1)."""
  x, _, w = (t.numpy() for t in batch)
  return sorted(int(v) for v in x[w > 0, 0])


def test_endless_draws_what_one_epoch_iterators_draw_for_a_seed():
  x, y = _records()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    per_epoch = sampling.poisson_batches(x, y, 8, steps_per_epoch=3, max_batch_size=None,
                                         seed=7)
    endless = sampling.poisson_batches(x, y, 8, steps_per_epoch=3, max_batch_size=None,
                                       seed=7, endless=True)
  epochs = [_members(b) for _ in range(3) for b in per_epoch]
  one = [_members(b) for b in endless.take(9)]
  assert one == epochs
  assert len({tuple(m) for m in one}) > 1          # the steps are different samples


def test_endless_is_infinite_and_keeps_the_declaration():
  x, y = _records()
  ds = sampling.poisson_batches(x, y, 8, steps_per_epoch=3, endless=True)
  assert ds.cardinality().numpy() == tf.data.INFINITE_CARDINALITY
  spec = sampling.get_sampling_spec(ds)
  assert (spec.policy, spec.population_size, spec.sample_size) == ("poisson", 40, 8.0)
  assert spec.selection_probability == pytest.approx(0.2)


def test_endless_padded_samples_keep_the_static_size():
  x, y = _records()
  ds = sampling.poisson_batches(x, y, 8, steps_per_epoch=2, max_batch_size=16, endless=True)
  sizes = {int(b[2].shape[0]) for b in ds.take(6)}
  assert sizes <= {16, 32}
  assert 16 in sizes


def test_endless_must_be_a_bool():
  x, y = _records()
  with pytest.raises(ParameterTypeError, match="endless"):
    sampling.poisson_batches(x, y, 8, endless="yes")


def _model():
  keras.utils.set_random_seed(0)
  m = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(2)])
  m.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return m


@pytest.mark.parametrize("steps_per_epoch", [None, 3])
def test_fit_starts_one_sampler_generator_for_all_its_epochs(monkeypatch, steps_per_epoch):
  starts = []
  original = python_source._Generators.start   # pylint: disable=protected-access

  def counting_start(self):
    starts.append(1)
    return original(self)

  monkeypatch.setattr(python_source._Generators, "start", counting_start)   # pylint: disable=protected-access
  x, y = _records()
  m = _model()
  m.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=steps_per_epoch, verbose=0)
  steps = steps_per_epoch or 5                       # round(n / B) = 40 / 8
  assert len(starts) == 1                            # one iterator, one generator, one fit
  assert int(m.ledger.sample_count.numpy()) == 4 * steps    # every step charged once
  assert int(m.optimizer.iterations.numpy()) == 4 * steps
  m.fit(x, y, batch_size=8, epochs=2, verbose=0)
  assert len(starts) == 2                            # a new fit: a new sampler
  assert int(m.ledger.sample_count.numpy()) == 4 * steps + 2 * 5
