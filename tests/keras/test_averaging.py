"""Weight-averaging callbacks: the EMA / Polyak recurrences against NumPy, evaluation on the
average, and a training trajectory that the swaps leave untouched."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.callbacks.averaging import ExponentialMovingAverage
from tf_dpiter.keras.callbacks.averaging import PolyakAveraging


class _Recorder(keras.callbacks.Callback):
  """The trainable weights after every training batch (and at the start)."""

  def on_train_begin(self, logs=None):
    self.history = [[w.numpy().copy() for w in self.model.trainable_weights]]

  def on_train_batch_end(self, batch, logs=None):
    self.history.append([w.numpy().copy() for w in self.model.trainable_weights])


def _data(n=96, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, 5).astype(np.float32)
  y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)
  return x, y


def _model(seed=0, dp_model=False):
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
  if dp_model:
    model = dp.keras.DPSequential(layers)
    opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.5,
                                       learning_rate=0.5, momentum=0.5)
  else:
    model = keras.Sequential(layers)
    opt = keras.optimizers.SGD(0.5, momentum=0.5)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_follows_the_numpy_recurrence(warmup):
  x, y = _data()
  model, rec = _model(), _Recorder()
  ema = ExponentialMovingAverage(decay=0.8, warmup=warmup, swap_on_train_end=False)
  model.fit(x, y, batch_size=16, epochs=3, shuffle=False, callbacks=[rec, ema], verbose=0)
  avg = [w.copy() for w in rec.history[0]]
  for t, weights in enumerate(rec.history[1:], start=1):
    d = min(0.8, (1 + t) / (10 + t)) if warmup else 0.8
    avg = [d * a + (1 - d) * w for a, w in zip(avg, weights)]
  assert len(rec.history) == 1 + 3 * 6
  for got, want in zip(ema.averaged_weights, avg):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_polyak_is_the_uniform_average_from_start():
  x, y = _data()
  model, rec = _model(), _Recorder()
  polyak = PolyakAveraging(start=4, swap_on_train_end=False)
  model.fit(x, y, batch_size=16, epochs=2, shuffle=False, callbacks=[rec, polyak], verbose=0)
  want = [np.mean([h[i] for h in rec.history[4:]], axis=0) for i in range(len(rec.history[0]))]
  for got, w in zip(polyak.averaged_weights, want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_evaluate_sees_the_average_and_training_is_unaffected():
  x, y = _data()
  xv, yv = _data(32, seed=1)
  plain = _model(seed=3)
  hist_plain = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, validation_data=(xv, yv),
                         verbose=0)
  averaged, ema = _model(seed=3), ExponentialMovingAverage(decay=0.7)
  hist = averaged.fit(x, y, batch_size=16, epochs=3, shuffle=False, validation_data=(xv, yv),
                      callbacks=[ema], verbose=0)
  # the training losses (raw iterates) are those of the run without averaging
  np.testing.assert_allclose(hist.history["loss"], hist_plain.history["loss"], rtol=1e-6)
  assert int(averaged.optimizer.iterations) == int(plain.optimizer.iterations) == 18
  # after fit the model holds the average; evaluate sees it
  for got, want in zip(averaged.trainable_weights, ema.averaged_weights):
    np.testing.assert_array_equal(got.numpy(), want)
  reference = _model(seed=3)
  reference.set_weights(ema.averaged_weights)
  np.testing.assert_allclose(averaged.evaluate(xv, yv, verbose=0),
                             reference.evaluate(xv, yv, verbose=0), rtol=1e-6)
  # validation during fit ran on the average: the last epoch's val_loss is the final average's
  np.testing.assert_allclose(hist.history["val_loss"][-1], reference.evaluate(xv, yv, verbose=0),
                             rtol=1e-5)
  assert abs(hist.history["val_loss"][-1] - hist_plain.history["val_loss"][-1]) > 1e-6
  # restore_raw puts back the last iterate, the one the run without averaging ends on
  ema.restore_raw()
  for got, want in zip(averaged.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_ema_on_a_dp_model_matches_the_recurrence():
  x, y = _data()
  model, rec = _model(dp_model=True), _Recorder()
  ema = ExponentialMovingAverage(decay=0.9, swap_on_train_end=False)
  model.fit(x, y, batch_size=16, epochs=2, callbacks=[rec, ema], verbose=0)
  avg = [w.copy() for w in rec.history[0]]
  for weights in rec.history[1:]:
    avg = [0.9 * a + 0.1 * w for a, w in zip(avg, weights)]
  assert len(rec.history) > 1
  for got, want in zip(ema.averaged_weights, avg):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments():
  with pytest.raises(ValueError, match="decay"):
    ExponentialMovingAverage(decay=1.0)
  with pytest.raises(ValueError, match="start"):
    PolyakAveraging(start=0)
