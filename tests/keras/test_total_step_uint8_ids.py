"""Ids and labels of any dtype against the vocabulary (review R6, finding 3).

`total_records.guard_embedding_ids` masks an example whose ids feeding an Embedding are
outside [0, input_dim). Before the fix it cast input_dim into the ids' dtype: uint8 ids of a
byte-level model (input_dim 256) were all "out of range" (256 wraps to 0), so every example
contributed zero, silently (measured: noise off, the weights did not move at all, against
0.013 / 0.0039 / 0.088 with the same ids as int32; input_dim 300 kept ids 0..43 only).
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.internals import total_records


def _fit(dtype):
  """(initial weights, weights after two full-batch steps, noise off)."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, size=(40, 4)).astype(dtype)
  y = rng.integers(0, 256, size=(40, 1)).astype("int32")
  keras.utils.set_random_seed(0)
  inp = keras.Input((4,), dtype=dtype)
  h = keras.layers.Flatten()(keras.layers.Embedding(256, 3)(inp))
  model = dp.keras.DPModel(inp, keras.layers.Dense(256)(h))
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.5),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  before = [np.array(v) for v in model.trainable_variables]
  # full batches: the shuffle's order (OS entropy) cannot change the update
  model.fit(x, y, batch_size=40, epochs=2, verbose=0, sampling="shuffle")
  return before, [np.array(v) for v in model.trainable_variables]


def _valid(dtype, input_dim, ids):
  inp = keras.Input((1,), dtype=dtype)
  model = keras.Model(inp, keras.layers.Embedding(input_dim, 2)(inp))
  _, valid = total_records.guard_embedding_ids(
      model, tf.constant(np.asarray(ids, dtype).reshape(-1, 1)))
  return valid.numpy()


def test_ids_are_compared_with_the_vocabulary_exactly_in_every_dtype():
  np.testing.assert_array_equal(_valid("uint8", 300, np.arange(256)), np.ones(256))
  np.testing.assert_array_equal(_valid("uint8", 256, np.arange(256)), np.ones(256))
  np.testing.assert_array_equal(_valid("uint8", 200, [0, 199, 200, 255]), [1, 1, 0, 0])
  np.testing.assert_array_equal(_valid("int8", 100, [-1, 0, 99, 100, 127]), [0, 1, 1, 0, 0])
  # floats: Keras' int32 cast truncates toward zero (-0.5 -> 0, 9.9 -> 9)
  np.testing.assert_array_equal(
      _valid("float32", 10, [-1.0, -0.5, 0.0, 9.9, 10.0, np.nan, np.inf]),
      [0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(_valid("float16", 300, [255.0, 299.0, 300.0]), [1, 1, 0])


def test_a_byte_model_trains_as_with_int32_ids():
  """Noise off: the uint8 run's weights equal the int32 run's (same ids), and they moved."""
  before, reference = _fit("int32")
  assert max(float(np.abs(a - b).max()) for a, b in zip(reference, before)) > 1e-3
  for got, want in zip(_fit("uint8")[1], reference):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_an_eager_step_guards_the_ids_of_numpy_arrays():
  """run_eagerly=True: train_on_batch hands the step the arrays themselves; an id outside the
  vocabulary still makes its example contribute zero instead of stopping the step (noise
  off: the weights equal those of the step without that example)."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 10, size=(8, 3)).astype(np.int32)
  y = rng.normal(size=(8, 1)).astype(np.float32)
  x_bad = x.copy()
  x_bad[0, 0] = 10
  after = []
  for xs, ys in ((x_bad, y), (x[1:], y[1:])):
    keras.utils.set_random_seed(0)
    model = dp.keras.DPSequential([keras.Input((3,), dtype="int32"),
                                   keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                                   keras.layers.Dense(1)])
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)   # noise 0: a test only
      opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.1, normalize=False)
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    model.optimizer.set_sampling(64, 8 / 64, "poisson", 8)
    model.train_on_batch(xs, ys)
    after.append([np.array(v) for v in model.trainable_variables])
  for got, want in zip(*after):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
