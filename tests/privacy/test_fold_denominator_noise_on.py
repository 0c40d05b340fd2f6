"""The 1 / denominator folded into the clip factors and the noise stddev, with the noise ON.

Review of PrivateStep.folds_denominator (the DP step's average formed as a sum already scaled
by a = 1 / d, noise drawn with stddev a sigma): for one real Keras step from the same weights
and the same seeded generator state,

  step(noise on) - step(noise off) = -lr (sigma z) / d,

where z is drawn here independently by the query's own stream (`add_gaussian_noise` on zeros
with the generator reset to its state before the step) and d is the denominator computed here
from the rule (the expected batch size under Poisson, the records the batch's rows form
whatever their weights under a fixed-size policy, 1 without normalization), not read from
the code under test. The same step with the
fold disabled (a PrivateStep whose `folds_denominator` is False) must give the same weights
within float32 rounding, and the ledger records (S, sigma) either way.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.keras.optimizer import private_step

CLIP, SIGMA, LR, B = 0.7, 1.1, 0.5, 8


def _model(dtype=None):
  keras.utils.set_random_seed(3)
  inputs = keras.Input((5,))
  h = keras.layers.Dense(6, activation="tanh", dtype=dtype)(inputs)
  return dp.keras.DPModel(inputs, keras.layers.Dense(3, dtype=dtype)(h))


def _data(weights):
  rng = np.random.RandomState(0)
  return (rng.normal(size=(B, 5)).astype("float32"), rng.randint(0, 3, B),
          np.asarray(weights, "float32"))


def _one_step(noise, fold, policy="poisson", normalize=True, weights=(1,) * B,
              num_microbatches=None, max_physical_batch_size=None, dtype=None, jit=False,
              clipping="fast"):
  """One train_on_batch from the seeded initial weights.

  Returns:
    (weight deltas before - after as float64 arrays, the noise the query's stream gives for
    the generator state before the step at stddev S sigma (zeros when noise=0), the model).
  """
  model = _model(dtype)
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, SIGMA if noise else 0.0, learning_rate=LR, seed=11,
                                     normalize=normalize, clipping=clipping,
                                     num_microbatches=num_microbatches,
                                     max_physical_batch_size=max_physical_batch_size)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=jit)
  opt.set_sampling(100, B / 100, policy, B)
  x, y, w = _data(weights)
  before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  step = opt.private_step
  step.make_state()
  gen = step.base_query.noise_generator
  state = gen.state.numpy().copy()
  with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if not fold:
      mp.setattr(private_step.PrivateStep, "folds_denominator", property(lambda self: False))
    model.train_on_batch(x, y, sample_weight=w)
    assert step.folds_denominator == (fold and normalize)
  after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  # the independent draw: the query's stream from the same generator state, on zeros
  gen.reset(state)
  zeros = [tf.zeros(v.shape, tf.float32) for v in model.trainable_variables]
  z = gaussian_query.add_gaussian_noise(gen, zeros, CLIP * SIGMA)
  z = [t.numpy().astype(np.float64) for t in z] if noise else [np.zeros(v.shape) for v in zeros]
  return [b - a for b, a in zip(before, after)], z, model


CASES = {
    # name: (kwargs of _one_step, the denominator d by the rule)
    "poisson_expected_size": (dict(), float(B)),
    "poisson_padding_rows": (dict(weights=(1, 1, 1, 1, 1, 0, 1, 0)), float(B)),
    "poisson_empty_batch": (dict(weights=(0,) * B), float(B)),
    # replace one: the records the batch's rows form, weight-0 ones included (a record's
    # weight is private: a count of positive weights would show it in the noise's scale)
    "fixed_size_weight_0_records": (dict(policy="shuffle", weights=(1, 1, 1, 0, 1, 1, 1, 0)),
                                    float(B)),
    "fixed_size_all_weights_0": (dict(policy="shuffle", weights=(0,) * B), float(B)),
    "not_normalized": (dict(normalize=False), 1.0),
    "microbatches": (dict(policy="shuffle", num_microbatches=4), 4.0),
    "physical_chunks": (dict(max_physical_batch_size=3), float(B)),
    "vectorized": (dict(clipping="vectorized", weights=(1, 0, 1, 1, 1, 1, 1, 1)), float(B)),
}


# the default suite runs two (an empty Poisson batch over q n, padding rows); the rest are slow
DEFAULT_CASES = ("poisson_padding_rows", "fixed_size_all_weights_0")


@pytest.mark.parametrize("name", [
    name if name in DEFAULT_CASES else pytest.param(name, marks=pytest.mark.slow)
    for name in CASES])
def test_noised_step_is_sum_plus_sigma_z_over_d(name):
  """noise on - noise off = -lr (S sigma z) / d, z from the query's own stream, d by the rule;
  the fold and the unfolded step agree within float32 rounding."""
  kwargs, d = CASES[name]
  on, z, model = _one_step(True, True, **kwargs)
  off, _, _ = _one_step(False, True, **kwargs)
  unfolded, z_unfolded, _ = _one_step(True, False, **kwargs)
  for a, b, n in zip(on, off, z):
    np.testing.assert_allclose(a - b, LR * n / d, rtol=1e-4, atol=2e-6)
  for a, b in zip(on, unfolded):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
  for a, b in zip(z, z_unfolded):
    np.testing.assert_array_equal(a, b)             # one seeded draw in both
  assert np.std(np.concatenate([n.ravel() for n in z])) > 0.3   # S sigma = 0.77
  _, queries = model.optimizer.private_step.ledger.get_arrays()
  assert queries.shape[0] == 1
  np.testing.assert_allclose(queries[:, 2], CLIP, rtol=1e-6)          # S
  np.testing.assert_allclose(queries[:, 3], CLIP * SIGMA, rtol=1e-6)  # S sigma, not S sigma/d
  assert int(model.ledger.sample_count.numpy()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float16", 3e-3), ("bfloat16", 2e-2),
                                       ("mixed_float16", 3e-3), ("mixed_bfloat16", 2e-2)])
def test_sixteen_bit_fold_equals_the_unfolded_step(dtype, tol):
  """16-bit variables or compute: the folded and the divided step give the same weights within
  16-bit rounding, and the noise part is S sigma z / d (d = B)."""
  on, z, model = _one_step(True, True, dtype=dtype)
  unfolded, _, _ = _one_step(True, False, dtype=dtype)
  off, _, _ = _one_step(False, True, dtype=dtype)
  for a, b in zip(on, unfolded):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
  for a, b, n in zip(on, off, z):
    np.testing.assert_allclose(a - b, LR * n / B, rtol=5 * tol, atol=5 * tol)
  assert float(model.optimizer.private_step.ledger.get_arrays()[1][0, 3]) == pytest.approx(
      CLIP * SIGMA, rel=1e-6)


@pytest.mark.slow
def test_xla_fold_is_sum_plus_sigma_z_over_d():
  on, z, _ = _one_step(True, True, jit=True, weights=(1, 1, 0, 1, 1, 1, 1, 1))
  off, _, _ = _one_step(False, True, jit=True, weights=(1, 1, 0, 1, 1, 1, 1, 1))
  for a, b, n in zip(on, off, z):
    np.testing.assert_allclose(a - b, LR * n / B, rtol=1e-4, atol=2e-6)


def _folds(policy="poisson", size=B, **kwargs):
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(**kwargs)
  model.compile(optimizer=opt, loss="mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt.set_sampling(100, B / 100, policy, size)
  opt.private_step.make_state()
  return opt.private_step.folds_denominator, opt.private_step.base_query


def test_adaptive_clipping_does_not_fold():
  query = dp.dp_query.QuantileAdaptiveClipSumQuery(
      initial_l2_norm_clip=1.0, noise_multiplier=1.1, target_unclipped_quantile=0.5,
      learning_rate=0.2, clipped_count_stddev=1.0, expected_num_records=B)
  folds, base = _folds(dp_query=query)
  assert base is query
  assert not folds


@pytest.mark.parametrize("noise", ["tree", "band_mf", "blt"])
def test_correlated_mechanisms_do_not_fold(noise):
  extra = {"tree": dict(restart_every=13), "band_mf": dict(num_bands=2, num_steps=8),
           "blt": dict(num_buffers=2, num_steps=8)}[noise]
  policy, size = ("shuffle", B) if noise == "tree" else ("cyclic_poisson", 2)
  folds, base = _folds(policy, size, l2_norm_clip=1.0, noise_multiplier=1.1, noise=noise,
                       **extra)
  assert not isinstance(base, gaussian_query.GaussianSumQuery)
  assert not folds


def test_gaussian_subclasses_fold_only_with_the_plain_noise():
  """A subclass that changes the noised result or the sample state in any of the overridden
  hooks must not fold; one that only changes the clip factors (automatic clipping) folds."""

  class OwnScaledNoise(gaussian_query.GaussianSumQuery):
    def get_scaled_noised_result(self, scaled_sum, global_state, scale):
      return super().get_scaled_noised_result(scaled_sum, global_state, scale)

  class OwnAccumulate(gaussian_query.GaussianSumQuery):
    def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
      return super().accumulate_preprocessed_record(sample_state, preprocessed_record)

  class OwnInitialState(gaussian_query.GaussianSumQuery):
    def initial_sample_state(self, template=None):
      return super().initial_sample_state(template)

  for cls in (OwnScaledNoise, OwnAccumulate, OwnInitialState):
    folds, base = _folds(dp_query=cls(1.0, 1.1))
    assert isinstance(base, cls)
    assert not folds, cls.__name__
  folds, _ = _folds(dp_query=dp.dp_query.AutomaticClippingSumQuery(1.0, 1.1))
  assert folds
