"""What fit's own evaluation (validation_data) writes into the model is refused
(models._FitFingerprints: the weights held between the callbacks' on_test_begin and
on_test_end).

Relation: replace one example (x[0, 0] = 10.0 in D), unit example; shuffle sampling, n = 40,
batch 10, z = 1, C = 1, one epoch, the validation data the training set. Measured by review R7
(session 38) before the check: a layer keeping the largest input it sees in inference held
10.0 = x[0, 0] after the fit and the statement gave epsilon 10.726; a `test_step` override
assigning a bias from the validation batch, the same. Now the fit is refused when its
evaluation moved a weight, and so is every later statement; an evaluation that writes
nothing changes nothing (the same epsilon as the fit without validation).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  return x, rng.normal(size=(40, 1)).astype("float32")


class _Calibration(keras.layers.Layer):
  """Keeps the largest input seen in inference (a calibration range)."""

  def build(self, shape):
    self.peak = self.add_weight(shape=(), initializer="zeros", trainable=False, name="peak")

  def call(self, inputs, training=None):
    if not training:
      self.peak.assign(tf.maximum(self.peak, tf.reduce_max(inputs)))
    return inputs


class WritingTestStep(dp.keras.DPSequential):

  def test_step(self, data):
    xb, _ = data
    self.layers[-1].bias.assign(tf.reshape(tf.reduce_max(xb), [1]))   # a record's value
    return super().test_step(data)


def _fit(model, validate, **kwargs):
  x, y = _data()
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle",
            validation_data=(x, y) if validate else None, **kwargs)


@pytest.mark.parametrize("writer", ["inference_layer", "test_step"])
def test_a_write_by_fits_evaluation_is_refused_and_never_stated(writer):
  keras.utils.set_random_seed(0)
  if writer == "inference_layer":
    model = dp.keras.DPSequential([keras.Input((3,)), _Calibration(), keras.layers.Dense(1)])
  else:
    model = WritingTestStep([keras.Input((3,)), keras.layers.Dense(1)])
  with pytest.raises(dp.errors.PrivacyConfigError, match="evaluation of the validation data"):
    _fit(model, validate=True)
  with pytest.raises(dp.errors.PrivacyConfigError):
    model.privacy_statement(1e-5)


def test_an_evaluation_that_writes_nothing_changes_nothing():
  epsilons = []
  for validate in (False, True):
    keras.utils.set_random_seed(0)
    model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(4),
                                   keras.layers.Dense(1)])
    _fit(model, validate, callbacks=[keras.callbacks.LambdaCallback(
        on_test_end=lambda logs: None)])
    epsilons.append(model.privacy_statement(1e-5).epsilon)
  assert epsilons[0] == epsilons[1] > 0
