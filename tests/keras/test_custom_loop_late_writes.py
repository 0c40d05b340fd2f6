"""A custom loop's traced step writing the learning rate or `iterations` from the batch after
`apply_private_gradients` (review R8, session 39, finding 1).

The update's walk runs at its trace on the graph traced so far; a write traced after it used
to be unseen (the learning rate and `iterations` carry no digest): the next update is
lr(batch t) times its noised gradient. Now the whole step is walked at the next statement
(update_binding.NoisedResults.refuse_late_writes) and such a run is refused, then and later.

Relation/unit: add/remove one example (x[0, 0] = 3000), the user's Poisson q = 10 / 100,
C = 1, z = 1, two traced steps; unit = example. Measured (session 39, noise off, before the
fix): ||w(D) - w(D')|| = 3.014 against the 0.02 the two charged steps allow, epsilon 2.413
stated; no finite epsilon bounds the mechanism run.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib

N, D, Q, DELTA = 100, 4, 0.1, 1e-5


def _loop(write, drop_record_0=False, z=1.0):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, D)).astype(np.float32)
  y = rng.normal(size=(10, 1)).astype(np.float32)
  x[0, 0] = 3000.0
  if drop_record_0:
    x, y = x[1:], y[1:]
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((D,)),
                            keras.layers.Dense(1, kernel_initializer="zeros")])
  lr = (keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5) if write == "iterations"
        else 0.1)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, z, learning_rate=lr)
  opt.build(model.trainable_variables)
  opt.set_sampling(N, Q, "poisson", 10)
  variables = model.trainable_variables

  def record_loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))

  @tf.function
  def step(xb, yb):
    grads = opt.compute_private_gradients(record_loss, variables, data=(xb, yb))
    opt.apply_private_gradients(grads, variables)
    if write == "learning_rate":   # a loss- or input-adapted rate for the next step
      opt.learning_rate.assign(0.1 * tf.reduce_mean(tf.abs(xb)))
    elif write == "public_learning_rate":   # a public value after the update
      opt.learning_rate.assign(0.05)
    elif write == "iterations":    # the schedule's position, from the batch
      opt.iterations.assign(tf.cast(tf.reduce_max(tf.abs(xb)), opt.iterations.dtype))

  step(x, y)
  step(x, y)
  return model, opt


@pytest.mark.parametrize("write", ["learning_rate", "iterations"])
def test_a_write_from_the_batch_after_the_update_is_refused(write):
  _, opt = _loop(write)
  for _ in range(2):   # refused, and again later
    with pytest.raises(dp.errors.PrivacyConfigError, match="from the batch"):
      statement_lib.run_statement(opt, DELTA)


def test_a_public_write_after_the_update_is_stated():
  """The same loop writing a public learning rate after its update (or nothing) is stated:
  epsilon = dp_accounting's RDP for two Poisson-sampled Gaussian steps, by hand."""
  import dp_accounting  # pylint: disable=g-import-not-at-top
  for write in ("public_learning_rate", None):
    _, opt = _loop(write)
    stated = statement_lib.run_statement(opt, DELTA)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(
        Q, dp_accounting.GaussianDpEvent(1.0)), 2)
    assert stated.steps == 2
    assert stated.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("write", [True, False])
def test_a_loop_retraced_per_batch_size_is_walked_whole(write):
  """Five traces (one per Poisson batch size, more than the graphs kept until a statement):
  the finished traces are walked as the next ones are traced, and the verdict is the same."""
  rng = np.random.default_rng(0)
  model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.build(model.trainable_variables)
  opt.set_sampling(N, Q, "poisson", 10)
  variables = model.trainable_variables

  def record_loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))

  @tf.function
  def step(xb, yb):
    grads = opt.compute_private_gradients(record_loss, variables, data=(xb, yb))
    opt.apply_private_gradients(grads, variables)
    if write:
      opt.learning_rate.assign(0.1 * tf.reduce_mean(tf.abs(xb)))

  for size in range(8, 13):   # five static shapes: five traces
    step(rng.normal(size=(size, D)).astype(np.float32),
         rng.normal(size=(size, 1)).astype(np.float32))
  if write:
    with pytest.raises(dp.errors.PrivacyConfigError, match="from the batch"):
      statement_lib.run_statement(opt, DELTA)
  else:
    assert statement_lib.run_statement(opt, DELTA).steps == 5
