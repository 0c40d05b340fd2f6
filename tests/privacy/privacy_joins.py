"""Shared by the participation tests: a callback that records which examples each step moved.

The test models give example i a weight of its own (column 0 of the first variable moves only
for the examples in the step, noise 0), so the set of moved rows is the set of examples the
step used.
"""

import keras
import numpy as np


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
    assert np.allclose(moved / self.counts, times, atol=1e-4), moved   # whole participations
    for j in range(int(times.max(initial=0))):
      self.joined.append(set(np.flatnonzero(times > j).tolist()))
