"""A DP model whose class overrides train_step (review R6, finding 4): its
apply_private_gradients is bound to a noised result as a custom loop's is; only the library's
own train step is exempt. Before, train_on_batch switched the binding off around any
train_step, and the plain tape gradient of the batch was applied.

Claim: an update applied by apply_private_gradients is a function of a noised result drawn and
charged in this run. Relation/unit: add/remove one example, Poisson q = 0.25 (n = 40, expected
batch 10), z = 1, C = 1; unit = example. Measured at b8ec6ae (review probe): w1 = w0 - 0.1 g of
the plain batch gradient exactly (max error 0.0), epsilon 3.081 stated at delta 1e-5.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


def _record_loss(model):
  def record_loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))
  return record_loss


class PlainStepModel(dp.keras.DPSequential):
  """A train_step that drops the private result and applies the plain tape gradient."""

  def train_step(self, data):
    x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    variables = self.trainable_variables
    self.optimizer.compute_private_gradients(_record_loss(self), variables, data=(x, y))
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(self(x) - y))
    self.optimizer.apply_private_gradients(tape.gradient(loss, variables), variables)
    return {"loss": loss}


class PrivateStepModel(dp.keras.DPSequential):
  """A train_step that applies (half) the noised result compute_private_gradients returned."""

  def train_step(self, data):
    x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    variables = self.trainable_variables
    grads = self.optimizer.compute_private_gradients(_record_loss(self), variables,
                                                     data=(x, y))
    grads = [0.5 * g for g in grads]
    self.optimizer.apply_private_gradients(grads, variables)
    return {"norm": tf.linalg.global_norm(grads)}


def _model(cls, noise_multiplier=1.0):
  keras.utils.set_random_seed(0)
  model = cls([keras.Input((4,)), keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, noise_multiplier, learning_rate=0.1)
  model.compile(opt, "mse")
  opt.build(model.trainable_variables)
  opt.set_sampling(40, 0.25, "poisson", 10)
  rng = np.random.default_rng(0)
  return (model, opt, rng.normal(size=(10, 4)).astype("float32"),
          rng.normal(size=(10, 1)).astype("float32"))


def test_a_plain_gradient_in_an_overridden_train_step_is_refused():
  model, _, x, y = _model(PlainStepModel)
  w0 = [np.array(v) for v in model.trainable_variables]
  with pytest.raises(dp.errors.PrivacyConfigError, match="avoids the noise"):
    model.train_on_batch(x, y)
  assert all(np.array_equal(np.array(v), w) for v, w in zip(model.trainable_variables, w0))


def test_an_override_applying_the_noised_result_trains():
  """The override that applies a function of the noised result is applied, one sample
  charged; noise off, the update is w0 - 0.1 * 0.5 * (sum of the per-example gradients
  clipped to norm 1) / 10 (the expected batch), against a float64 reference."""
  model, opt, x, y = _model(PrivateStepModel, noise_multiplier=0.0)
  w, b = [np.array(v).astype(np.float64) for v in model.trainable_variables]
  residual = x.astype(np.float64) @ w + b - y                     # [10, 1]
  per_example = np.concatenate([2 * residual * x, 2 * residual], axis=1)   # d/dw, d/db
  norms = np.linalg.norm(per_example, axis=1, keepdims=True)
  clipped = per_example * np.minimum(1.0, 1.0 / norms)
  step = 0.1 * 0.5 * clipped.sum(axis=0) / 10.0
  model.train_on_batch(x, y)
  assert int(opt.ledger.sample_count.numpy()) == 1
  np.testing.assert_allclose(np.array(model.trainable_variables[0])[:, 0], w[:, 0] - step[:4],
                             rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.array(model.trainable_variables[1]), b - step[4:],
                             rtol=0, atol=1e-6)
