"""One attribute says that a DP optimizer's updates check no weight fingerprint
(weight_fingerprints.DEFERRED): optimizers.fingerprints_deferred and the fingerprints' own
checks read it, a DP fit and train_on_batch set it while they run the optimizer and put back
what it was, and an internal probe (auditing's noise-free optimizer) holds it as a class
attribute. No privacy figure is computed here (relation, unit: see the fit tests).
"""

import keras
import numpy as np

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity
from tf_dpiter.keras.optimizer import optimizers
from tf_dpiter.keras.optimizer import weight_fingerprints


class _Seen(keras.callbacks.Callback):
  """Keeps fingerprints_deferred(optimizer) at every batch end."""

  def __init__(self):
    super().__init__()
    self.seen = []

  def on_train_batch_end(self, batch, logs=None):
    self.seen.append(optimizers.fingerprints_deferred(self.model.optimizer))


def _model(opt):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(opt, "mse")
  return model


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(40, 3)).astype("float32"),
          rng.normal(size=(40, 1)).astype("float32"))


def test_fit_sets_the_one_attribute_while_it_runs_and_clears_it_after():
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  model = _model(opt)
  seen = _Seen()
  model.fit(*_data(), batch_size=10, epochs=1, verbose=0, sampling="shuffle", callbacks=[seen])
  assert seen.seen == [True] * 4
  assert getattr(opt, weight_fingerprints.DEFERRED) is False
  assert not optimizers.fingerprints_deferred(opt)


def test_an_optimizer_deferred_before_fit_is_deferred_after():
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  model = _model(opt)
  x, y = _data()
  setattr(opt, weight_fingerprints.DEFERRED, True)   # as the probe's class attribute
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert optimizers.fingerprints_deferred(opt)


def test_the_probe_and_the_fingerprints_read_the_same_attribute():
  probe_class = sensitivity._recording_sgd_class(dp.keras)  # pylint: disable=protected-access
  assert getattr(probe_class, weight_fingerprints.DEFERRED) is True
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  variable = keras.Variable(np.zeros([2], "float32"))
  weight_fingerprints.record(opt, [variable])
  rec = weight_fingerprints._record_of(variable)  # pylint: disable=protected-access
  for value in (False, True):
    setattr(opt, weight_fingerprints.DEFERRED, value)
    assert weight_fingerprints._deferred(rec) is value  # pylint: disable=protected-access
    assert optimizers.fingerprints_deferred(opt) is value
