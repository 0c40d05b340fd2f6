"""The private step's denominator folded into the clip factors (PrivateStep.folds_denominator):
the sum comes out divided, the Gaussian query draws the noise with stddev sigma / d
(GaussianSumQuery.get_scaled_noised_result), no weight-sized division follows, the update
equals the unfolded step's and the ledger records (S, sigma)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.keras.optimizer import private_step

# Nightly (`-m slow`): the XLA case of the folded-equals-divided comparison. The fold is the
# library's Python (PrivateStep.folds_denominator, GaussianSumQuery.get_scaled_noised_result),
# the same in both modes; [False-fast] and [False-vectorized] compare it with the divided step
# by default. Under XLA the default tier asserts the folded step's parts: its noise-free
# update (sum of clipped records / E under Poisson) in tests/keras/test_step_oracle.py's
# jit=True Poisson cases (e.g. [model=multi_input-clipping=fast-jit=True-micro=None-
# physical=None-padding=True-policy=poisson-entry=fit]) and its noise scale z S lr / (q n),
# applied once, in tests/privacy/test_noise_replay_review.py::
# test_sigma_once_and_no_replay_after_rollbacks[True-True].
SLOW_CASES = {"test_folded_step_equals_the_divided_step[True-fast]"}


def test_scaled_noised_result_is_the_scaled_noised_sum():
  """a (sum + N(0, sigma^2)) from a sum given as a sum: the same draw (one generator state)
  as add_gaussian_noise with stddev a sigma, and the event of the unscaled sum (S, sigma)."""
  query = gaussian_query.GaussianSumQuery(2.0, 3.0, seed=5)
  total = [tf.constant(np.linspace(-1.0, 1.0, 48, dtype="float32")), tf.ones([3, 5])]
  a = 0.25
  scaled = [t * a for t in total]
  state = query.initial_global_state()
  gen_state = query.noise_generator.state.numpy()
  result, _, (event,) = query.get_scaled_noised_result(scaled, state, tf.constant(a))
  query.noise_generator.reset(gen_state)
  expected = gaussian_query.add_gaussian_noise(query.noise_generator, scaled, 3.0 * a)
  for r, e in zip(result, expected):
    np.testing.assert_array_equal(r.numpy(), e.numpy())
  assert float(event.l2_norm_clip) == 2.0 and float(event.stddev) == 3.0
  noise = np.concatenate([(r - s).numpy().ravel() for r, s in zip(result, scaled)])
  assert 0.3 < noise.std() < 1.2   # sigma a = 0.75 (63 values)


def test_adds_scaled_noise_only_for_the_gaussian_sum():
  assert gaussian_query.adds_scaled_noise(gaussian_query.GaussianSumQuery(1.0, 1.0))
  assert gaussian_query.adds_scaled_noise(
      dp.dp_query.AutomaticClippingSumQuery(1.0, 1.0))

  class OwnNoise(gaussian_query.GaussianSumQuery):
    def get_noised_result(self, sample_state, global_state):
      return super().get_noised_result(sample_state, global_state)

  assert not gaussian_query.adds_scaled_noise(OwnNoise(1.0, 1.0))
  assert not gaussian_query.adds_scaled_noise(dp.dp_query.NoPrivacySumQuery())


def _model():
  keras.utils.set_random_seed(3)
  inputs = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh")(inputs)
  return dp.keras.DPModel(inputs, keras.layers.Dense(3)(h))


@functools.lru_cache(maxsize=None)
def _trained(fold, jit=False, clipping="fast", noise_multiplier=1.1):
  """Weights after two steps of seeded DP-SGD (the fold on or off) and the model (once per
  setting in this module: the tests only read them)."""
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(0.7, noise_multiplier, learning_rate=0.5, seed=11,
                                     clipping=clipping)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=jit)
  opt.set_sampling(100, 0.08, "poisson", 8)
  rng = np.random.RandomState(0)
  x = rng.normal(size=(8, 6)).astype("float32")
  y = rng.randint(0, 3, 8)
  w = np.array([1, 1, 1, 1, 1, 0, 1, 0], "float32")   # two padding rows: 6 records
  original = private_step.PrivateStep.folds_denominator
  with pytest.MonkeyPatch.context() as mp:
    if not fold:
      mp.setattr(private_step.PrivateStep, "folds_denominator", property(lambda self: False))
    for _ in range(2):
      model.train_on_batch(x, y, sample_weight=w)
  assert private_step.PrivateStep.folds_denominator is original
  return [v.numpy() for v in model.trainable_variables], model


@pytest.mark.parametrize("jit,clipping", [(False, "fast"), (False, "vectorized"),
                                          (True, "fast")])
def test_folded_step_equals_the_divided_step(jit, clipping):
  """The same seeded noise and records: the folded update is the divided one within float32
  rounding (the noise is sigma / d times the same Box-Muller values)."""
  folded, model = _trained(True, jit, clipping)
  divided, _ = _trained(False, jit, clipping)
  assert model.optimizer.private_step.folds_denominator
  for f, d in zip(folded, divided):
    np.testing.assert_allclose(f, d, rtol=2e-5, atol=2e-6)


def test_folded_step_without_noise_equals_the_divided_step():
  exact_f, _ = _trained(True, noise_multiplier=0.0)
  exact_d, _ = _trained(False, noise_multiplier=0.0)
  for f, d in zip(exact_f, exact_d):
    np.testing.assert_allclose(f, d, rtol=2e-6, atol=1e-7)


def test_ledger_records_sigma_not_the_scaled_stddev():
  """The folded step's ledger rows: clip S = 0.7 and noise sigma = z S = 0.77 (not sigma / 6)."""
  _, model = _trained(True)
  _, queries = model.optimizer.private_step.ledger.get_arrays()
  assert queries.shape[0] == 2
  np.testing.assert_allclose(queries[:, 2], 0.7, rtol=1e-6)    # clip
  np.testing.assert_allclose(queries[:, 3], 0.77, rtol=1e-6)   # noise (sum units)


def test_no_weight_sized_division_in_the_folded_average():
  """noised_average of a sum formed already divided divides no weight-sized tensor; the
  plain sum's divides each leaf (the weight-sized pass the fold removes)."""
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, seed=2)
  model.compile(optimizer=opt, loss="mse")
  opt.set_sampling(100, 0.08, "poisson", 8)
  step = opt.private_step
  sums = [tf.ones(v.shape) for v in model.trainable_variables]

  def divisions(scaled):
    fn = tf.function(lambda: step.noised_average(sums, tf.constant(4.0), scaled=scaled))
    graph = fn.get_concrete_function().graph
    return sum(op.type in ("RealDiv", "Div") and op.outputs[0].shape.num_elements() != 1
               for op in graph.get_operations())   # the scalar 1 / d not counted

  assert divisions(True) == 0
  assert divisions(False) >= len(sums)


def test_folds_only_where_the_query_is_the_gaussian_sum():
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, normalize=False)
  model.compile(optimizer=opt, loss="mse")
  opt.private_step.make_state()
  assert not opt.private_step.folds_denominator   # nothing to divide
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0)
  opt.private_step.make_state()
  assert opt.private_step.folds_denominator
