"""Shared setup of the custom-loop tests in tests/keras (test_apply_bound_to_noised_result.py,
test_update_binding_sources.py, test_traced_loop_weights.py,
test_weights_changed_outside_review.py, test_user_sampling_at_run_time.py): fixed regression
data, a small Keras model, its DP SGD optimizer declared Poisson, the per-record loss, the
plain (un-noised) batch gradient and the private step compute_private_gradients +
apply_private_gradients.

Relation/unit of the tests that use it: add/remove one example, Poisson sampling of the
n = N = 100 records at the q each test declares (0.1 unless said), z = 1, C = 1, SGD at
learning rate 0.1; unit = example. Every call builds a fresh model and optimizer (the tests
write the weights and the ledger, so nothing here is shared between tests).
"""

import dp_accounting as dpa
import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp

N, D = 100, 4
LR = 0.1


def rdp_epsilon(steps, q=0.1, delta=1e-5):
  """dp_accounting's RDP epsilon of `steps` Poisson-sampled Gaussian steps (z = 1,
  add/remove one example), composed by hand: the tests' independent value."""
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)), steps))
  return acc.get_epsilon(delta)


def data():
  """(x [N, D], y [N, 1]) float32, fixed (numpy's default_rng(0))."""
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, D)).astype(np.float32),
          rng.normal(size=(N, 1)).astype(np.float32))


def regression_model(hidden=()):
  """keras.Sequential Input(D) -> Dense(h) for h in `hidden` -> Dense(1), at seed 0."""
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((D,))] + [keras.layers.Dense(h) for h in hidden]
                          + [keras.layers.Dense(1)])


def dp_sgd(variables, q=0.1, expected_size=10):
  """DPKerasSGDOptimizer(C = 1, z = 1, learning rate LR) built on `variables`, the user's
  own batches declared Poisson with selection probability `q` over N records."""
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=LR)
  opt.build(variables)
  opt.set_sampling(N, q, "poisson", expected_size)
  return opt


def record_loss(model):
  """The per-record loss of compute_private_gradients: squared error of record (x, y)."""

  def loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))

  return loss


def plain_gradients(model):
  """(xb, yb) -> the plain gradient of the batch's mean squared error (no clip, no noise)."""

  def gradients(xb, yb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(xb) - yb))
    return tape.gradient(loss, model.trainable_variables)

  return gradients


def private_step(opt, loss, variables):
  """step(xb, yb): the noised result of compute_private_gradients applied to `variables`
  (not traced: wrap it in tf.function for the traced loop)."""

  def step(xb, yb):
    grads = opt.compute_private_gradients(loss, variables, data=(xb, yb))
    opt.apply_private_gradients(grads, variables)

  return step


def setup():
  """(first 10 records x, y, model Dense(1), its optimizer at q = 0.1, record loss, plain
  gradients): the custom loop of the apply-binding tests."""
  x, y = data()
  model = regression_model()
  opt = dp_sgd(model.trainable_variables)
  return x[:10], y[:10], model, opt, record_loss(model), plain_gradients(model)


def assert_applied(variables, before, grads):
  """Each variable is its value `before` minus LR times the gradient applied, to 1e-6."""
  for v, w, g in zip(variables, before, grads):
    np.testing.assert_allclose(np.array(v), w - LR * np.array(g), rtol=0, atol=1e-6)
