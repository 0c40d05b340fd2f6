"""The custom loop's inputs that could weight, repeat or leak a record are refused.

Claims (custom_loops module docstring): the ledger records the sensitivity C of one record's
clipped gradient; a custom loop writes the same ledger samples as `fit`. Review R2 (session 33):
(1) `mask` weighted each clipped record unchecked: mask 10 moved the noise-free sum by 9.9998 C
(add/remove one example, both forms); (2) a batch of 50 under a declared fixed_size sample of
10 of 100 was charged at q = 0.1 (epsilon 17.51 charged, 43.55 for what ran; replace one);
(3) the data form ran a loss_fn writing a running mean of the records into a variable (the
released mean moved with one record, un-noised).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

B = 4


def _model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((1,)),
                           keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])


def _grads(opt, model, form, x, y, mask=None):
  if form == "data":
    return opt.compute_private_gradients(
        lambda r: keras.losses.mean_squared_error(r[1], model(r[0])), model.trainable_variables,
        data=(x, y), mask=mask)
  return opt.compute_private_gradients(lambda: keras.losses.mean_squared_error(y, model(x)),
                                       model.trainable_variables, mask=mask, model=model)


@pytest.mark.parametrize("form", ["data", "losses"])
def test_a_mask_weight_other_than_0_or_1_is_refused(form):
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1e-12, learning_rate=1.0)
  opt.set_sampling(100, B / 100, "poisson", B)
  x, y = np.full((B, 1), 100.0, np.float32), np.zeros((B, 1), np.float32)
  with pytest.raises(dp.errors.ParameterValueError, match=r"`mask` must hold 0.*\[10.0\]"):
    _grads(opt, model, form, x, y, np.array([10.0, 0, 0, 0], np.float32))
  # a mask the trace cannot read: refused when the step runs (graph mode)
  step = tf.function(lambda m: _grads(opt, model, form, x, y, m))
  with pytest.raises(tf.errors.InvalidArgumentError, match="mask` must hold 0"):
    step(tf.constant([10.0, 0, 0, 0]))
  # 0/1 masks run: the sum of the one unmasked record is its clipped gradient (C = 1)
  g = step(tf.constant([1.0, 0, 0, 0]))
  assert abs(float(g[0].numpy().ravel()[0]) * B) == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize("form", ["data", "losses"])
def test_a_batch_above_the_declared_fixed_size_is_refused(form):
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.set_sampling(100, 0.1, "fixed_size", 10)
  x, y = np.ones((50, 1), np.float32), np.zeros((50, 1), np.float32)
  with pytest.raises(dp.errors.ParameterValueError, match="at most sample_size=10.*50 rows"):
    _grads(opt, model, form, x, y)
  spec = (tf.TensorSpec([None, 1]), tf.TensorSpec([None, 1]))
  step = tf.function(lambda a, b: _grads(opt, model, form, a, b), input_signature=spec)
  with pytest.raises(tf.errors.InvalidArgumentError, match="more rows than the sample_size"):
    step(x, y)
  assert int(opt.ledger.sample_count.numpy()) == 0
  step(x[:10], y[:10])   # the declared size runs and is charged once
  assert int(opt.ledger.sample_count.numpy()) == 1


class RunningMean(keras.layers.Layer):
  def build(self, shape):
    self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False)

  def call(self, x, training=None):
    if training:
      self.mean.assign(0.99 * self.mean + 0.01 * tf.reduce_mean(x, axis=0))
    return x


def test_a_data_form_loss_writing_a_running_statistic_is_refused():
  keras.utils.set_random_seed(0)
  tracker = RunningMean()
  model = keras.Sequential([keras.Input((2,)), tracker, keras.layers.Dropout(0.1),
                            keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.set_sampling(40, 1.0, "poisson", 40)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype(np.float32)
  y = rng.normal(size=(40, 1)).astype(np.float32)
  loss = lambda r: keras.losses.mean_squared_error(r[1], model(r[0], training=True))
  step = tf.function(lambda a, b: opt.compute_private_gradients(
      loss, model.trainable_variables, data=(a, b)))
  with pytest.raises(dp.errors.PrivacyConfigError, match="writes the variable .*from the data"):
    step(x, y)
  with pytest.raises(dp.errors.PrivacyConfigError, match="in training mode writes the variable"):
    opt.compute_private_gradients(loss, model.trainable_variables, data=(x, y), model=model)
  assert np.array_equal(tracker.mean.numpy(), np.zeros(2))
  # Dropout's seed state alone (an integer write) is accepted
  plain = keras.Sequential([keras.Input((2,)), keras.layers.Dropout(0.1), keras.layers.Dense(1)])
  ok = tf.function(lambda a, b: opt.compute_private_gradients(
      lambda r: keras.losses.mean_squared_error(r[1], plain(r[0], training=True)),
      plain.trainable_variables, data=(a, b)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert all(np.all(np.isfinite(g.numpy())) for g in ok(x, y))


@pytest.mark.parametrize("form", ["data", "losses"])
def test_a_step_compiled_by_xla_is_refused_before_anything_is_charged(form):
  # A custom step under tf.function(jit_compile=True) (Keras' accelerator idiom) failed with
  # tf2xla's "Shape of resource privacy_ledger/queries cannot be changed": the ledger's
  # buffers grow. Now a library error names jit_compile at trace time; nothing is drawn or
  # charged, and the same step without jit_compile runs and is charged once.
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0)
  opt.set_sampling(100, B / 100, "poisson", B)
  x, y = np.ones((B, 1), np.float32), np.zeros((B, 1), np.float32)
  step = tf.function(lambda m: _grads(opt, model, form, x, y, m), jit_compile=True)
  with pytest.raises(dp.errors.PrivacyConfigError, match="jit_compile.*Received: jit_compile=True"):
    step(tf.ones([B]))
  assert int(opt.ledger.sample_count.numpy()) == 0
  tf.function(lambda m: _grads(opt, model, form, x, y, m))(tf.ones([B]))
  assert int(opt.ledger.sample_count.numpy()) == 1
