"""A training-mode forward pass that writes non-trainable state from the data is refused.

Claim: the model `DPModel.fit` releases is (epsilon, delta)-DP, add/remove one example
(Poisson), unit = example; the private step clips and noises gradients only. Pair (review R,
session 33): a layer keeping a running mean of its inputs in training mode; D = 40 examples,
D' = D without its first. The vectorized path ran the assign on the batch's first record: the
released mean was 0.01 x[0] for D and 0.01 x[1] for D', with certainty (no noise touches it).
Now every clipping path refuses the model before its first step, on both datasets; seed
generators' states (Dropout, GaussianNoise) and statistics written only in inference mode are
accepted.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


class RunningMean(keras.layers.Layer):
  """Identity that tracks a moving mean of its inputs (in training mode, or in inference)."""

  def __init__(self, in_training=True, **kwargs):
    super().__init__(**kwargs)
    self.in_training = in_training

  def build(self, shape):
    self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                name="running_mean")

  def call(self, x, training=None):
    if bool(training) == self.in_training:
      self.mean.assign(0.99 * self.mean + 0.01 * tf.reduce_mean(x, axis=0))
    return x


def _pair():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype(np.float32)
  y = rng.normal(size=(40, 1)).astype(np.float32)
  return (x, y), (x[1:], y[1:])


def _model(clipping, *layers):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), *layers, keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.01,
                                             clipping=clipping), "mse")
  return model


@pytest.mark.parametrize("clipping", ["vectorized", "auto"])
def test_a_running_statistic_of_the_data_is_refused_on_both_datasets(clipping):
  for x, y in _pair():
    layer = RunningMean(name="tracker")
    model = _model(clipping, layer)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with pytest.raises(dp.errors.PrivacyConfigError, match="tracker/running_mean"):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert np.array_equal(layer.mean.numpy(), np.zeros(2))   # nothing released
    assert int(model.optimizer.iterations.numpy()) == 0
    assert int(model.ledger.sample_count.numpy()) == 0


@pytest.mark.parametrize("clipping", ["vectorized", "auto"])
def test_seed_states_and_inference_statistics_are_accepted(clipping):
  (x, y), _ = _pair()
  layer = RunningMean(in_training=False)
  model = _model(clipping, keras.layers.Dropout(0.1), keras.layers.GaussianNoise(0.1), layer)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == int(model.optimizer.iterations.numpy()) > 0
  assert np.array_equal(layer.mean.numpy(), np.zeros(2))   # fit never ran inference mode
