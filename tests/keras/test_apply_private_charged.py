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
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


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
  with pytest.raises(tf.errors.InvalidArgumentError, match="one ledger sample per update"):
    (tf.function(plain_step) if traced else plain_step)()
  moved = max(float(np.max(np.abs(v.numpy() - b))) for v, b in zip(variables, before))
  assert moved == 0.0 and int(opt.iterations.numpy()) == int(opt.ledger.sample_count.numpy()), (
      f"plain gradients applied: weights moved {moved:.4g}, iterations "
      f"{int(opt.iterations.numpy())}, ledger {int(opt.ledger.sample_count.numpy())}")
