"""DP-AdamBC (Tang et al., AAAI 2024): the update against a NumPy recurrence of Algorithm 1."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import adam_bc

# Nightly tier (-m slow): the fast path in graph (the fast path under XLA and the
# vectorized path in graph stay).
SLOW_CASES = {
    "test_dp_step_with_fixed_variance_matches_recurrence[fast-False]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _numpy_adam_bc(theta, grads, lr, b1, b2, eps, phi, floor):
  """theta after the steps of Algorithm 1 with the gradient sequence `grads` (float64)."""
  m = np.zeros_like(theta)
  v = np.zeros_like(theta)
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    theta = theta - lr * m_hat / (eps + np.sqrt(np.maximum(v_hat - phi, floor)))
  return theta


@pytest.mark.parametrize("phi", [0.0, 0.05, 10.0])
def test_plain_adam_bc_matches_recurrence(phi):
  rng = np.random.default_rng(0)
  theta0 = rng.normal(size=5)
  grads = [rng.normal(size=5) for _ in range(6)]
  var = tf.Variable(theta0.astype(np.float32))
  opt = adam_bc.AdamBC(learning_rate=0.01, noise_variance=phi, variance_floor=1e-4)
  for g in grads:
    opt.apply_gradients([(tf.constant(g, tf.float32), var)])
  expected = _numpy_adam_bc(theta0, grads, 0.01, 0.9, 0.999, 1e-7, phi, 1e-4)
  np.testing.assert_allclose(var.numpy(), expected, rtol=1e-4, atol=1e-6)
  if phi == 10.0:   # v^ - Phi < gamma' everywhere: the floor is what divides
    assert np.all(np.abs(var.numpy() - theta0) > 0.01)


def _per_example_clipped_mean(model, x, y, clip):
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = LOSS(y[i:i + 1], model(x[i:i + 1], training=True))
    g = [t.numpy().astype(np.float64) for t in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(a * a) for a in g))
    total = [t + a * min(1.0, clip / norm) for t, a in zip(total, g)]
  return [t / len(x) for t in total]


@pytest.mark.parametrize("clipping,jit", [("vectorized", False), ("fast", False), ("fast", True)])
def test_dp_step_with_fixed_variance_matches_recurrence(clipping, jit):
  """Noise 0, Phi given: three real DP steps = Algorithm 1 on the clipped mean gradients."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                 keras.layers.Dense(2)])
  opt = adam_bc.DPKerasAdamBCOptimizer(0.5, 0.0, learning_rate=0.02, noise_variance=1e-3,
                                       variance_floor=1e-6, clipping=clipping)
  model.compile(optimizer=opt, loss=LOSS, jit_compile=jit)
  rng = np.random.RandomState(1)
  x, y = rng.randn(6, 4).astype("float32") * 2, rng.randint(0, 2, 6)
  opt.set_sampling(60, 0.1, "poisson", 6)
  model(x[:1])
  thetas = [w.astype(np.float64) for w in model.get_weights()]
  grads_seq = []
  for _ in range(3):
    grads_seq.append(_per_example_clipped_mean(model, x, y, 0.5))
    model.train_on_batch(x, y)
  for k, w in enumerate(model.get_weights()):
    expected = _numpy_adam_bc(thetas[k], [g[k] for g in grads_seq], 0.02, 0.9, 0.999, 1e-7,
                              1e-3, 1e-6)
    # rtol: the step's clip shrink 1 / (1 + eta) (eta < 1e-3 for its public row bound) moves
    # the update non-uniformly (Adam-BC divides by sqrt(max(v - Phi, floor)), v from the
    # shrunk gradients): 1.7e-3 measured on the smallest coordinate under XLA
    np.testing.assert_allclose(w, expected, rtol=4e-3, atol=2e-6)


@pytest.mark.parametrize("policy,normalize,denominator", [
    ("poisson", True, 50.0), ("shuffle", True, 50.0), ("poisson", False, 1.0)])
def test_dp_noise_variance_is_z_s_over_b_squared(policy, normalize, denominator):
  opt = adam_bc.DPKerasAdamBCOptimizer(1.5, 1.2, learning_rate=0.01, normalize=normalize)
  opt.set_sampling(1000, 0.05, policy, 50)
  phi = float(adam_bc.dp_noise_variance(opt))
  assert phi == pytest.approx((1.2 * 1.5 / denominator) ** 2, rel=1e-6)


def test_dp_noise_variance_of_automatic_clipping_query():
  query = dp.dp_query.AutomaticClippingSumQuery(2.0, 0.9)
  opt = adam_bc.DPKerasAdamBCOptimizer(dp_query=query, learning_rate=0.01)
  opt.set_sampling(1000, 0.1, "poisson", 100)
  assert float(adam_bc.dp_noise_variance(opt)) == pytest.approx((0.9 * 2.0 / 100) ** 2, rel=1e-6)


def test_refusals():
  with pytest.raises(ValueError, match="noise_variance"):
    adam_bc.AdamBC(noise_variance=None)
  with pytest.raises(ValueError, match="noise_variance"):
    adam_bc.AdamBC(noise_variance=-1.0)
  with pytest.raises(ValueError, match="variance_floor"):
    adam_bc.AdamBC(noise_variance=0.0, variance_floor=0.0)
  with pytest.raises(ValueError, match="amsgrad"):
    adam_bc.AdamBC(noise_variance=0.0, amsgrad=True)
  opt = adam_bc.DPKerasAdamBCOptimizer(1.0, 1.0, 2, learning_rate=0.01)
  with pytest.raises(ValueError, match="num_microbatches"):
    adam_bc.dp_noise_variance(opt)


def test_config_round_trip():
  opt = adam_bc.DPKerasAdamBCOptimizer(1.0, 1.1, learning_rate=0.003, variance_floor=1e-6)
  config = keras.optimizers.serialize(opt)
  again = keras.optimizers.deserialize(config)
  assert type(again) is type(opt)
  assert again.variance_floor == 1e-6 and again.noise_variance is None
  assert again.l2_norm_clip == 1.0 and again.noise_multiplier == 1.1
  plain = adam_bc.AdamBC.from_config(adam_bc.AdamBC(noise_variance=0.2).get_config())
  assert plain.noise_variance == 0.2


def test_dp_step_sets_variance_from_z_s_b():
  """With noise, the step that sets Phi itself equals the one given Phi = (z S / B)^2 (same
  seed, so the same noise): the denominator B is the DP step's."""
  weights = []
  for phi in (None, (1.1 * 0.5 / 6.0) ** 2):
    keras.utils.set_random_seed(0)
    model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = adam_bc.DPKerasAdamBCOptimizer(0.5, 1.1, learning_rate=0.02, noise_variance=phi,
                                         seed=3)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=True)
    opt.set_sampling(60, 0.1, "poisson", 6)
    rng = np.random.RandomState(1)
    x, y = rng.randn(6, 4).astype("float32"), rng.randint(0, 2, 6)
    for _ in range(2):
      model.train_on_batch(x, y)
    weights.append(model.get_weights())
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
