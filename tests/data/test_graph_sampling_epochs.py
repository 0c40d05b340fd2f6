"""`poisson_batches_in_graph` draws a new, independent Poisson sample at every step of the
dataset's whole life: every epoch's iterator, `repeat` and a later `fit` continue the count of
samples drawn instead of replaying the first epoch's samples (relation add/remove one example;
the ledger charges every step as an independent Poisson(q) sample, so a replayed epoch would
be a repeated release its epsilon does not cover: with q = 0.01, z = 1, 100 steps and 10
identical epochs, epsilon 23.3 in truth against 1.83 charged, dp-accounting PLD, delta 1e-5)."""

import keras
import numpy as np

import tf_dpiter as dp
from tf_dpiter.data import graph_sampling

N, EB, STEPS = 64, 8, 4


def _data():
  ids = np.arange(N, dtype="int32")
  return ids[:, None].astype("float32"), ids % 3


def _members(batches):
  out = []
  for bx, _, mask in batches:
    m = int(mask.sum())
    out.append(tuple(sorted(int(v) for v in bx[:m, 0])))
  return out


def test_every_iteration_and_repeat_draw_new_samples():
  x, y = _data()
  ds = graph_sampling.poisson_batches_in_graph(x, y, EB, steps_per_epoch=STEPS)  # OS entropy
  epochs = [_members(ds.as_numpy_iterator()) for _ in range(3)]
  epochs.append(_members(ds.repeat(2).as_numpy_iterator()))
  samples = [s for e in epochs for s in e]
  assert len(samples) == 5 * STEPS
  # 20 Poisson(1/8) samples of 64 records: two equal non-empty ones have probability ~1e-9
  non_empty = [s for s in samples if s]
  assert len(set(non_empty)) == len(non_empty), samples


def test_a_seeded_dataset_draws_the_same_first_epoch_and_new_later_ones():
  x, y = _data()
  a = graph_sampling.poisson_batches_in_graph(x, y, EB, steps_per_epoch=STEPS, seed=3)
  b = graph_sampling.poisson_batches_in_graph(x, y, EB, steps_per_epoch=STEPS, seed=3)
  first_a, first_b = _members(a.as_numpy_iterator()), _members(b.as_numpy_iterator())
  assert first_a == first_b
  assert _members(a.as_numpy_iterator()) != first_a


def test_each_record_joins_a_fraction_q_of_many_epochs():
  """The marginal law over 50 epochs of 4 steps (200 samples): record i joins each with
  probability q = 1/8, so its count is Binomial(200, 1/8) (mean 25, sd 4.7)."""
  x, y = _data()
  ds = graph_sampling.poisson_batches_in_graph(x, y, EB, steps_per_epoch=STEPS)
  counts = np.zeros(N)
  for _ in range(50):
    for s in _members(ds.as_numpy_iterator()):
      counts[list(s)] += 1
  assert abs(counts.mean() - 25.0) < 1.5, counts.mean()   # mean of 64: sd 0.59
  assert counts.max() < 25 + 6 * 4.7, counts.max()


def test_fit_for_two_epochs_trains_on_distinct_samples_and_charges_each():
  x, y = _data()
  ds = graph_sampling.poisson_batches_in_graph(x, y, EB, steps_per_epoch=STEPS)
  seen = []

  class Record(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      seen.append(batch)

  model = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(ds, epochs=2, verbose=0, callbacks=[Record()])
  assert int(model.ledger.sample_count.numpy()) == 2 * STEPS == len(seen)
  # the dataset went on counting: the next iterator's samples are new ones, not epoch 1's
  later = _members(ds.as_numpy_iterator())
  assert later != _members(ds.as_numpy_iterator())
