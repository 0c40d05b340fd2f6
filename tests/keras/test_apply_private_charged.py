"""`apply_private_gradients` applies one charged private step per update; plain gradients are
refused (review R3, session 34, finding 6: they were applied without a ledger sample).

Claim (optimizers.DPOptimizerBase.apply: "Refuses plain gradients (the private path goes
through apply_private_gradients)"; custom_loops module): a custom loop's updates are the
noised averages the ledger charged; relation add/remove one example (Poisson), unit =
example.

Gap: `apply` / `apply_gradients` refuse plain gradients and their message points to
`apply_private_gradients`, which takes any list of tensors: `tape.gradient(loss, vars)` is
applied, `iterations` advances, the ledger does not. The next private call refuses
(require_covers: iterations > samples, with a message about a restore), but the last such
update of a loop is never seen: `dp.accounting.epsilon(opt.ledger, delta)` states the
private steps alone for weights whose last update is a deterministic function of the data.

Measured at 4e2a813: one private step (Poisson q = 0.25, z = 1, S = 1), then
apply_private_gradients(tape.gradient(MSE of all 40 examples)): accepted, weights moved by
0.0688 (max abs), ledger 1 sample, iterations 2, epsilon(ledger, 1e-5) = 3.08 (finite; the
released update is un-noised: infinite). Now the update waits for an assertion that the
ledger holds more samples than the updates so far (under XLA a NaN update): refused, eagerly
and traced, the weights unmoved.

Review R4, session 35, finding 7: that check counted the ledger's samples, and a ledger that
adopted earlier samples (the charge travelling with a DP-pretrained layer's variables) let as
many plain updates through (10 plain SGD updates, the first equal to w0 - 0.1 g, ledger 10 =
the pretraining's). Now the step counts the noised results it drew and recorded itself (in no
checkpoint) and each update uses them up: refused at the first plain update.
"""

import gc
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

# refused by the update's binding to a noised result (update_binding: when traced, or eagerly
# before the update), or by the count of charged results (charged_gradients)
_REFUSED = (tf.errors.InvalidArgumentError, dp.errors.PrivacyConfigError)
_REFUSAL = ("one noised and recorded result per update|a function of it only|"
            "drawn eagerly since the last update")


@pytest.mark.parametrize("traced", [False, True])
def test_plain_gradients_given_to_apply_private_gradients_are_refused(traced):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype(np.float32)
  y = rng.normal(size=(40, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.set_sampling(40, 0.25, "poisson", 10)
  variables = model.trainable_variables
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    grads = opt.compute_private_gradients(
        lambda r: keras.losses.mean_squared_error(r[1], model(r[0])), variables,
        data=(x[:10], y[:10]))
    opt.apply_private_gradients(grads, variables)
  assert int(opt.ledger.sample_count.numpy()) == 1

  def plain_step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    return opt.apply_private_gradients(tape.gradient(loss, variables), variables)

  before = [v.numpy().copy() for v in variables]
  with pytest.raises(_REFUSED, match=_REFUSAL):
    (tf.function(plain_step) if traced else plain_step)()
  moved = max(float(np.max(np.abs(v.numpy() - b))) for v, b in zip(variables, before))
  assert moved == 0.0 and int(opt.iterations.numpy()) == int(opt.ledger.sample_count.numpy()), (
      f"plain gradients applied: weights moved {moved:.4g}, iterations "
      f"{int(opt.iterations.numpy())}, ledger {int(opt.ledger.sample_count.numpy())}")


def test_plain_gradients_are_refused_after_the_ledger_adopted_samples():
  """A DP-pretrained layer (10 fit steps, its model dropped) fine-tuned in a custom loop by a
  new DP optimizer: the ledger adopts the 10 samples; plain tape gradients given to
  apply_private_gradients are refused at the first update, the weights unmoved; a private
  step (compute then apply) still goes through, and a plain one after it is refused."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(100, 2)).astype(np.float32)
  y = rng.normal(size=(100, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)
  pre = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  pre.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pre.fit(x, y, batch_size=10, epochs=1, verbose=0)
  layers = pre.layers
  del pre
  gc.collect()
  model = keras.Sequential([keras.Input((2,))] + layers)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.set_sampling(100, 0.1, "poisson", 10)
  w0 = [v.numpy().copy() for v in model.trainable_variables]

  @tf.function
  def plain_step(a, b):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(a, training=True) - b))
    opt.apply_private_gradients(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables)

  @tf.function
  def private_step(a, b):
    grads = opt.compute_private_gradients(
        lambda r: keras.losses.mean_squared_error(r[1], model(r[0], training=True)),
        model.trainable_variables, data=(a, b))
    opt.apply_private_gradients(grads, model.trainable_variables)

  with pytest.raises(_REFUSED, match=_REFUSAL):
    plain_step(x[:10], y[:10])
  assert int(opt.ledger.sample_count) >= 10   # the adopted samples
  for w, v in zip(w0, model.trainable_variables):
    np.testing.assert_array_equal(v.numpy(), w)
  before = int(opt.ledger.sample_count)
  private_step(x[:10], y[:10])
  assert int(opt.ledger.sample_count) == before + 1
  with pytest.raises(_REFUSED, match=_REFUSAL):
    plain_step(x[:10], y[:10])

  @tf.function
  def two_computes_one_apply(a, b):   # both charged; the update uses both up
    loss = lambda r: keras.losses.mean_squared_error(r[1], model(r[0], training=True))
    opt.compute_private_gradients(loss, model.trainable_variables, data=(a, b))
    grads = opt.compute_private_gradients(loss, model.trainable_variables, data=(a, b))
    opt.apply_private_gradients(grads, model.trainable_variables)

  two_computes_one_apply(x[:10], y[:10])
  assert int(opt.ledger.sample_count) == before + 3
  with pytest.raises(_REFUSED, match=_REFUSAL):
    plain_step(x[:10], y[:10])
