"""The float16 overflow count, an un-noised count of records, is in no checkpoint (review R3,
session 34, finding 8: it was saved in every tf.train.Checkpoint and BackupAndRestore backup).

Claim (private_step.count_overflowed: "A zeroed record adds 0 to the clipped sum: the
guarantee holds"; the module docstring lists "_dp_overflow_count" among the variables that
checkpoints carry). Relation add/remove one example (Poisson), unit = example.

Gap: the counter itself is a deterministic function of the private records (how many had a
float16 gradient overflow under mixed_float16), released with the checkpoint (also a
tf.print warning and the dp_overflowed_records log). One outlier record moves it by 1.

Pair: D = 40 examples in R^2 with (x[0], y[0]) = ((1000, 1000), -1000), D' = D without it;
mixed_float16, Poisson q = 1, z = 1, S = 1, one step. Measured at 4e2a813: checkpoint key
optimizer/_dp_overflow_count = 1 (D) vs 0 (D'). Now the count is not tracked (no checkpoint
key) and stated as a diagnostic outside the guarantee; the optimizer still counts it.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


def _checkpointed_overflow_count(x, y, directory):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01), "mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
      os.path.join(directory, "ckpt"))
  reader = tf.train.load_checkpoint(path)
  keys = [k for k in reader.get_variable_to_shape_map() if "overflow" in k]
  return {k: int(reader.get_tensor(k)) for k in keys}, model.optimizer.overflowed_records


def test_the_checkpoint_holds_no_count_of_the_private_records(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype(np.float32)
  y = rng.normal(size=(40, 1)).astype(np.float32)
  x[0], y[0] = [1000.0, 1000.0], [-1000.0]
  policy = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    on_d = _checkpointed_overflow_count(x, y, str(tmp_path / "d"))
    on_d2 = _checkpointed_overflow_count(x[1:], y[1:], str(tmp_path / "d2"))
  finally:
    keras.mixed_precision.set_global_policy(policy)
  assert on_d[0] == on_d2[0] == {}, (on_d, on_d2)   # no checkpoint key on either dataset
  assert (on_d[1], on_d2[1]) == (1, 0)   # the diagnostic itself still counts the outlier
