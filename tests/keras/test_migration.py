"""Habits of TF Privacy and Keras users (issue 14): TF Privacy's DP model arguments,
make_dp_model_class, one-call budgets (from_budget), gradient_accumulation_steps, and a custom
loop that applies private gradients with apply_gradients."""

import logging
import math

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _layers():
  return [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)]


def _data(n=64, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, 4).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


@pytest.mark.parametrize("form", ["keywords", pytest.param("positional", marks=pytest.mark.slow)])
def test_dp_sequential_with_tf_privacy_arguments(form):
  if form == "keywords":
    model = dp.keras.DPSequential(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
                                  layers=_layers())
  else:
    model = dp.keras.DPSequential(1.0, 1.1, None, False, None, _layers())
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
  opt = model.optimizer
  assert isinstance(opt, dp.keras.DPOptimizerMixin)
  assert (opt.l2_norm_clip, opt.noise_multiplier, opt.num_microbatches) == (1.0, 1.1, None)
  assert opt.learning_rate.numpy() == pytest.approx(0.1)
  x, y = _data()
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert int(model.ledger.sample_count) == 4


def test_make_dp_model_class_and_bad_arguments():
  cls = dp.keras.make_dp_model_class(keras.Model)
  inp = keras.Input((4,))
  model = cls(l2_norm_clip=0.5, noise_multiplier=0.8, inputs=inp, outputs=keras.layers.Dense(3)(inp))
  model.compile(optimizer="sgd", loss=LOSS)
  assert model.optimizer.noise_multiplier == 0.8
  with pytest.raises(ValueError, match="one place"):
    m2 = dp.keras.DPSequential(l2_norm_clip=1.0, noise_multiplier=1.1, layers=_layers())
    m2.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1), loss=LOSS)
  with pytest.raises(ValueError, match="layer_registry"):
    dp.keras.DPSequential(l2_norm_clip=1.0, noise_multiplier=1.1, layer_registry=object(),
                          layers=_layers())
  with pytest.raises(ValueError, match="go together"):
    dp.keras.DPSequential(l2_norm_clip=1.0, layers=_layers())


def _dp_accounting_epsilon(z, q, steps, delta):
  """epsilon of `steps` Poisson-sampled Gaussian steps, by dp-accounting's RDP accountant."""
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  return acc.get_epsilon(delta)


def test_from_budget_calibrates_noise_against_dp_accounting(caplog):
  n, batch, epochs, eps, delta = 6000, 64, 3, 2.0, 1e-5
  with caplog.at_level(logging.INFO, logger="tf_dpiter"):
    opt = dp.keras.DPKerasSGDOptimizer.from_budget(
        eps, delta, epochs=epochs, batch_size=batch, population_size=n, l2_norm_clip=1.0,
        learning_rate=0.1)
  z = opt.noise_multiplier
  steps = math.ceil(epochs * n / batch)
  q = batch / n
  assert _dp_accounting_epsilon(z, q, steps, delta) <= eps
  assert _dp_accounting_epsilon(z * (1 - 2e-3), q, steps, delta) > eps   # not over-noised
  assert opt.l2_norm_clip == 1.0 and opt.learning_rate.numpy() == pytest.approx(0.1)
  assert f"{z:.4f}" in caplog.text and "calibrated" in caplog.text
  assert opt.calibration["steps"] == steps
  with pytest.raises(ValueError, match="l2_norm_clip"):
    dp.keras.DPKerasAdamOptimizer.from_budget(eps, delta, 1, batch, n)
  with pytest.raises(ValueError, match="noise_multiplier"):
    dp.keras.DPKerasAdamOptimizer.from_budget(eps, delta, 1, batch, n, l2_norm_clip=1.0,
                                              noise_multiplier=1.0)


def test_make_private_with_epsilon_calibrates_a_copy_of_the_plain_optimizer():
  """Opacus' one call: the functional model becomes private, the plain Adam becomes a DP Adam
  with its hyperparameters and a noise multiplier calibrated against dp-accounting."""
  n, batch, epochs, eps, delta = 6000, 64, 2, 3.0, 1e-5
  inputs = keras.Input((4,))
  model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
  model, opt = dp.keras.make_private_with_epsilon(
      model, keras.optimizers.Adam(learning_rate=3e-3, beta_1=0.8), eps, delta, epochs,
      batch, n, l2_norm_clip=0.5)
  assert isinstance(model, dp.keras.DPModelMixin) and isinstance(opt, keras.optimizers.Adam)
  assert opt.l2_norm_clip == 0.5 and opt.beta_1 == pytest.approx(0.8)
  assert opt.learning_rate.numpy() == pytest.approx(3e-3)
  z, steps, q = opt.noise_multiplier, math.ceil(epochs * n / batch), batch / n
  assert _dp_accounting_epsilon(z, q, steps, delta) <= eps
  assert _dp_accounting_epsilon(z * (1 - 2e-3), q, steps, delta) > eps
  model.compile(optimizer=opt, loss=LOSS)
  x, y = _data()
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert int(model.ledger.sample_count) > 0
  with pytest.raises(ValueError, match="plain keras.optimizers.Optimizer"):
    dp.keras.make_private_with_epsilon(model, opt, eps, delta, epochs, batch, n, 0.5)


def test_gradient_accumulation_steps_is_refused_with_the_fix():
  """Keras' accumulation would noise and charge every micro-step (30 ledger samples for 7
  updates); the error points to max_physical_batch_size, which keeps one noise draw and one
  ledger sample per update."""
  with pytest.raises(ValueError, match="max_physical_batch_size"):
    dp.keras.DPKerasSGDOptimizer(1.0, 1.1, gradient_accumulation_steps=4)
  with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
    dp.keras.DPOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=4), 1.0, 1.1)
  model = dp.keras.DPSequential(_layers())
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, max_physical_batch_size=4)
  model.compile(optimizer=opt, loss=LOSS)
  x, y = _data(n=56)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.ledger.sample_count) == int(opt.iterations.numpy()) == 7


def test_apply_gradients_after_compute_private_gradients_names_apply_private_gradients():
  layer = keras.layers.Dense(2)
  layer.build((None, 4))
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0)
  opt.set_sampling(100, 0.1, "poisson")
  x, _ = _data(n=8)

  def loss_fn(xr):
    return tf.reduce_sum(layer(xr), axis=-1)

  grads = opt.compute_private_gradients(loss_fn, layer.trainable_variables, data=x)
  with pytest.raises(ValueError, match=r"apply_private_gradients\(grads, variables\)"):
    opt.apply_gradients(zip(grads, layer.trainable_variables))
  opt.apply_private_gradients(grads, layer.trainable_variables)
  assert int(opt.iterations.numpy()) == 1
