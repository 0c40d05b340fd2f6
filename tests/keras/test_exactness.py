"""With noise 0 the DP gradient is the mean of clipped per-record gradients (exactness).

The step through fit and train_on_batch on every axis (model, clipping path, jit_compile,
microbatches, physical chunks, padding, policy, entry point) is checked pairwise against the
per-record loop by test_step_oracle.py; this file keeps what the oracle does not reach: an
infinite clip against non-private training, and the custom-loop forms."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers

B = 8


def _data(kind, rng):
  if kind == "dense":
    return rng.randn(B, 6).astype("float32"), rng.randint(0, 3, B)
  if kind == "conv":
    return rng.randn(B, 8, 8, 2).astype("float32"), rng.randint(0, 3, B)
  if kind in ("embedding", "lstm", "gru"):
    return rng.randint(0, 20, (B, 5)).astype("int32"), rng.randint(0, 3, B)
  if kind == "multi_input":
    return {"a": rng.randn(B, 4).astype("float32"), "b": rng.randn(B, 3).astype("float32")}, \
        rng.randint(0, 3, B)
  raise ValueError(kind)


def _model(kind):
  keras.utils.set_random_seed(1)
  if kind == "dense":
    return dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                  keras.layers.Dense(3)])
  if kind == "conv":
    return dp.keras.DPSequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
                                  keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
  if kind == "embedding":
    return dp.keras.DPSequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
  if kind in ("lstm", "gru"):
    # LSTM: default while_loop (sequential fallback); GRU: unroll=True (vectorized).
    rnn = keras.layers.LSTM(4) if kind == "lstm" else keras.layers.GRU(4, unroll=True)
    return dp.keras.DPSequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  rnn, keras.layers.Dense(3)])
  if kind == "multi_input":
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4, activation="relu")(a),
                                    keras.layers.Dense(2)(b)])
    return dp.keras.make_private(keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h)))
  raise ValueError(kind)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model, clip, m=None, jit=False, **kw):
  opt = dp.keras.DPKerasSGDOptimizer(clip, 0.0, m, learning_rate=1.0, clipping="vectorized", **kw)
  model.compile(optimizer=opt, loss=LOSS, jit_compile=jit)
  return model


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_infinite_clip_zero_noise_equals_nonprivate(kind):
  rng = np.random.RandomState(1)
  x, y = _data(kind, rng)
  model = _compile(_model(kind), clip=float("inf"))
  model(x)
  ref = helpers.nonprivate_gradient(model, LOSS, x, y)
  helpers.set_sampling(model, B)
  got = helpers.one_step_update(model, x, y)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


def test_custom_loop_compute_private_gradients_both_forms():
  rng = np.random.RandomState(6)
  x, y = _data("dense", rng)
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                            keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(0.05, 0.0, learning_rate=1.0)
  opt.set_sampling(B, 1.0, "shuffle", B)
  ref = helpers.reference_gradient(model, LOSS, x, y, clip=0.05)
  vector_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  g1 = opt.compute_private_gradients(lambda d: vector_loss(d[1], model(d[0])),
                                     model.trainable_variables, data=(x, y))
  g2 = opt.compute_private_gradients(lambda: vector_loss(y, model(x)), model.trainable_variables,
                                     model=model)
  for a, b, r in zip(g1, g2, ref):
    np.testing.assert_allclose(a.numpy(), r, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(b.numpy(), r, rtol=2e-4, atol=2e-6)
  # minimize with a tape and a vector loss updates the weights by -lr * gradient
  before = [v.numpy().copy() for v in model.trainable_variables]
  with tf.GradientTape(persistent=True) as tape:
    losses = vector_loss(y, model(x))
  opt.minimize(losses, model.trainable_variables, tape=tape, model=model)
  for b0, v, r in zip(before, model.trainable_variables, ref):
    np.testing.assert_allclose(b0 - v.numpy(), r, rtol=2e-4, atol=2e-6)
  assert int(opt.ledger.sample_count.numpy()) == 3
