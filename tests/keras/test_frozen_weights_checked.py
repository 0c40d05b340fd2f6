"""A DP model's non-trainable weights are checked like its trainable ones (review R6,
finding 5): a frozen BatchNormalization's statistics recomputed from the training set by a
callback during a DP fit ("BN recalibration") are refused.

Pair (replace one example, fit's "shuffle"; unit = example): D with x[0, 0] = 10 and D' with
it 0, n = 40. Before the fix the released moving_mean[0] was 0.0846 on D and -0.1654 on D'
(x[0, 0] / n = 0.25 apart, exactly: a deterministic function of one record), with epsilon
10.726 stated at delta 1e-5 for both, no refusal.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  return x, rng.normal(size=(40, 1)).astype("float32")


def _model():
  keras.utils.set_random_seed(0)
  bn = keras.layers.BatchNormalization()
  bn.trainable = False   # frozen, as the library asks
  model = dp.keras.DPSequential([keras.Input((3,)), bn, keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  return model, bn


def test_a_callback_writing_frozen_statistics_from_the_data_is_refused():
  x, y = _data()
  model, bn = _model()

  class Recalibrate(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      bn.moving_mean.assign(x.mean(axis=0))
      bn.moving_variance.assign(x.var(axis=0))

  with pytest.raises(dp.errors.PrivacyConfigError, match="moving_mean"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle",
              callbacks=[Recalibrate()])
  with pytest.raises(dp.errors.PrivacyConfigError):
    model.privacy_statement(1e-5)


def test_frozen_statistics_untouched_pass_and_a_later_write_is_refused():
  x, y = _data()
  model, bn = _model()
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert model.privacy_statement(1e-5).epsilon > 0
  bn.moving_mean.assign(x.mean(axis=0))   # between the fit and the statement
  with pytest.raises(dp.errors.PrivacyConfigError, match="moving_mean"):
    model.privacy_statement(1e-5)
