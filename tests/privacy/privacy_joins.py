"""Shared by the participation tests: a callback that records which examples each step moved.

The test models give example i a weight of its own (column 0 of the first variable moves only
for the examples in the step, noise 0), so the set of moved rows is the set of examples the
step used.
"""

import warnings

import keras
import numpy as np

import tf_dpiter as dp


class JoinRecorder(keras.callbacks.Callback):
  """Appends to `joined`, after every step, the set of examples the step moved.

  With `counts` (steps_per_execution > 1: one callback per execution of several steps; the
  model's optimizer must not normalize, so a participation moves w[i] by exactly `counts`)
  it appends, per execution, one set per participation rank: {i : i joined more than j of
  its steps} for j = 0, 1, ...: each example's participations are counted, not their steps.
  """

  def __init__(self, joined, counts=None):
    super().__init__()
    self.joined = joined
    self.counts = counts

  def on_train_batch_begin(self, batch, logs=None):
    self.before = self.model.trainable_variables[0].numpy()[:, 0].copy()

  def on_train_batch_end(self, batch, logs=None):
    moved = self.before - self.model.trainable_variables[0].numpy()[:, 0]
    if not self.counts:
      self.joined.append(set(np.flatnonzero(np.abs(moved) > 1e-6).tolist()))
      return
    times = np.rint(moved / self.counts).astype(int)
    # whole participations, each C times the step's clip shrink 1 / (1 + eta), eta < 1e-3
    assert np.allclose(moved / self.counts, times, rtol=1e-3, atol=1e-4), moved
    for j in range(int(times.max(initial=0))):
      self.joined.append(set(np.flatnonzero(times > j).tolist()))


def one_hot_model(n):
  """A model whose one weight per example moves only for the examples of the step: a DP
  Dense(1) without bias over one-hot inputs of length `n`, kernel zeros, noise 0, learning
  rate 1, loss the output (pair with `one_hot_data(n)` and `JoinRecorder`)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((n,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=1.0),
                  loss=lambda y_true, y_pred: y_pred[:, 0])
  return model


def one_hot_data(n):
  """Example i is the i-th one-hot row of length `n`, label 0."""
  return np.eye(n, dtype=np.float32), np.zeros((n, 1), np.float32)
