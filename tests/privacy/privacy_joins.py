"""Shared by the participation tests: a callback that records which examples each step moved.

The test models give example i a weight of its own (column 0 of the first variable moves only
for the examples in the step, noise 0), so the set of moved rows is the set of examples the
step used.
"""

import keras
import numpy as np


class JoinRecorder(keras.callbacks.Callback):
  """Appends to `joined`, after every step, the set of examples the step moved."""

  def __init__(self, joined):
    super().__init__()
    self.joined = joined

  def on_train_batch_begin(self, batch, logs=None):
    self.before = self.model.trainable_variables[0].numpy()[:, 0].copy()

  def on_train_batch_end(self, batch, logs=None):
    moved = self.before - self.model.trainable_variables[0].numpy()[:, 0]
    self.joined.append(set(np.flatnonzero(np.abs(moved) > 1e-6).tolist()))
