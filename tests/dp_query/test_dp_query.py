"""DPQuery implementations: exact clipping, declared noise, events, graph and XLA modes."""

import math
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter.accounting import effective_noise_multiplier

# Nightly tier (-m slow): the mode grids beyond a latin cover; by default each check
# runs in one or two of eager / tf.function / XLA, each mode present for each query family
# (the clip levels each in one mode, both shapes of Box-Muller each in one compiled mode).
SLOW_CASES = {
    "test_gaussian_sum_clips_exactly[0.5-function]",
    "test_gaussian_sum_clips_exactly[0.5-xla]",
    "test_gaussian_sum_clips_exactly[3.0-eager]",
    "test_gaussian_sum_clips_exactly[3.0-xla]",
    "test_gaussian_sum_clips_exactly[inf-eager]",
    "test_gaussian_sum_clips_exactly[inf-function]",
    "test_mask_excludes_padded_records[function]",
    "test_nested_query_clips_each_group[eager]",
    "test_nested_query_clips_each_group[function]",
    "test_adaptive_clip_tracks_quantile[xla]",
    "test_laplace_sum_query[eager]",
    "test_laplace_sum_query[xla]",
    "test_queries_run_in_graph_and_xla[<lambda>0-eager]",
    "test_queries_run_in_graph_and_xla[<lambda>0-function]",
    "test_queries_run_in_graph_and_xla[<lambda>1-eager]",
    "test_queries_run_in_graph_and_xla[<lambda>1-xla]",
    "test_box_muller_noise_is_standard_normal[shape0-eager]",
    "test_box_muller_noise_is_standard_normal[shape0-xla]",
    "test_box_muller_noise_is_standard_normal[shape1-eager]",
    "test_box_muller_noise_is_standard_normal[shape1-function]"}


def run_query(query, records, mask=None, mode="eager", template=None):
  """One sample through `query`: returns (result, new_global_state, events)."""
  if template is None:
    template = tf.nest.map_structure(lambda r: tf.TensorSpec(r.shape[1:], r.dtype), records)
  g = query.initial_global_state()

  def fn(recs, g):
    p = query.derive_sample_params(g)
    s = query.initial_sample_state(template)
    s = query.accumulate_records(p, s, recs, mask=mask)
    return query.get_noised_result(s, g)

  if mode == "function":
    fn = tf.function(fn)
  elif mode == "xla":
    fn = tf.function(fn, jit_compile=True)
  return fn(records, g)


def np_clip(x, c):
  n = np.linalg.norm(x)
  return x * min(1.0, c / n) if n > 0 else x


MODES = ["eager", "function", "xla"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [0.5, 3.0, math.inf])
def test_gaussian_sum_clips_exactly(mode, clip):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(7, 5)).astype(np.float32) * 2
  q = dq.GaussianSumQuery(clip, 0.0, seed=1)
  result, _, events = run_query(q, tf.constant(x), mode=mode)
  expected = sum(np_clip(r, clip) for r in x)
  np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-5)
  assert float(events[0].l2_norm_clip) == pytest.approx(clip)
  assert float(events[0].stddev) == 0.0


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_mask_excludes_padded_records(mode):
  x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
  mask = tf.constant([1.0, 0.0, 1.0, 0.0])
  result, _, _ = run_query(dq.GaussianSumQuery(100.0, 0.0, seed=0), tf.constant(x), mask, mode)
  np.testing.assert_allclose(result.numpy(), x[0] + x[2], rtol=1e-6)


@pytest.mark.parametrize("stddev", [0.3, 1.1, 4.0])
def test_gaussian_sum_noise_has_declared_stddev(stddev):
  # One zero record, N = 200,000 noise coordinates. The sample std has standard error
  # stddev / sqrt(2N); the mean stddev / sqrt(N). Tolerance: 5 standard errors.
  n = 200_000
  q = dq.GaussianSumQuery(1.0, stddev, seed=42)
  result, _, _ = run_query(q, tf.zeros([1, n]))
  noise = result.numpy() - 0.0  # minus the clipped sum, which is zero
  assert abs(noise.mean()) < 5 * stddev / math.sqrt(n)
  assert abs(noise.std() - stddev) < 5 * stddev / math.sqrt(2 * n)


def test_gaussian_noise_added_to_clipped_sum_nested_record():
  rng = np.random.default_rng(3)
  recs = [tf.constant(rng.normal(size=(50, 4)), tf.float32),
          tf.constant(rng.normal(size=(50, 2, 3)), tf.float32)]
  q = dq.GaussianSumQuery(1.0, 0.5, seed=7)
  result, _, _ = run_query(q, recs)
  flat = np.concatenate([recs[0].numpy(), recs[1].numpy().reshape(50, -1)], axis=1)
  clipped_sum = sum(np_clip(r, 1.0) for r in flat)
  got = np.concatenate([result[0].numpy(), result[1].numpy().ravel()])
  resid = got - clipped_sum
  # 10 coordinates of N(0, 0.5^2): all within 6 stddev.
  assert np.all(np.abs(resid) < 6 * 0.5) and np.any(resid != 0)


def test_average_query_divides_by_fixed_denominator():
  x = tf.constant(np.ones((3, 2), np.float32))
  q = dq.GaussianAverageQuery(10.0, 0.0, denominator=8.0, seed=0)
  result, _, events = run_query(q, x)
  np.testing.assert_allclose(result.numpy(), [3 / 8, 3 / 8])
  assert float(events[0].l2_norm_clip) == 10.0  # events stay in sum units


@pytest.mark.parametrize("mode", MODES)
def test_nested_query_clips_each_group(mode):
  rng = np.random.default_rng(1)
  recs = {"a": tf.constant(rng.normal(size=(6, 3)) * 3, tf.float32),
          "b": tf.constant(rng.normal(size=(6, 4)) * 3, tf.float32)}
  q = dq.NestedQuery({"a": dq.GaussianSumQuery(1.0, 0.0, seed=0),
                      "b": dq.GaussianSumQuery(2.0, 0.0, seed=0)})
  result, _, events = run_query(q, recs, mode=mode)
  np.testing.assert_allclose(result["a"].numpy(), sum(np_clip(r, 1.0) for r in recs["a"].numpy()),
                             rtol=1e-5)
  np.testing.assert_allclose(result["b"].numpy(), sum(np_clip(r, 2.0) for r in recs["b"].numpy()),
                             rtol=1e-5)
  assert [float(e.l2_norm_clip) for e in events] == [1.0, 2.0]


def test_allocation_strategies_meet_target_noise_multiplier():
  dims = [784 * 32, 32, 320, 10]
  for clips in (dq.per_layer_clips(2.0, 4), dq.dimension_adjusted_clips(2.0, dims)):
    assert sum(c * c for c in clips) == pytest.approx(4.0)  # total L2 bound S*^2
    for stds in (dq.proportional_noise(1.3, clips), dq.dimension_adjusted_noise(1.3, clips, dims)):
      # Eq. (1) computed independently here.
      z = sum((c / s) ** 2 for c, s in zip(clips, stds)) ** -0.5
      assert z == pytest.approx(1.3)
  assert dq.dimension_adjusted_clips(1.0, [5, 5, 5, 5]) == pytest.approx(dq.per_layer_clips(1.0, 4))


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "dimension_adjusted"])
def test_make_nested_gaussian_query_events_give_target_z(clipping):
  tmpl = [tf.TensorSpec([10, 3]), tf.TensorSpec([3])]
  q = dq.make_nested_gaussian_query(tmpl, 1.5, 0.9, clipping=clipping,
                                    noise_allocation="dimension_adjusted", seed=0)
  recs = [tf.random.normal([4, 10, 3]), tf.random.normal([4, 3])]
  _, _, events = run_query(q, recs, template=tmpl)
  z = effective_noise_multiplier([float(e.l2_norm_clip) for e in events],
                                 [float(e.stddev) for e in events])
  assert z == pytest.approx(0.9, rel=1e-6)


def test_joint_clipping_section2_example():
  # alpha = (1, 100), sigma_g = 0.01, S_g = 1; in each record one of v1, v2 is zero and
  # ||v1|| <= 1, ||v2|| <= 100, so the scaled record has norm <= 1: nothing is clipped, and
  # the noise on v1 has std 0.01, on v2 std 100 * 0.01 = 1 (Section 2).
  rng = np.random.default_rng(5)
  n, d = 40, 5000
  v1 = rng.normal(size=(n, d)); v1 /= np.linalg.norm(v1, axis=1, keepdims=True) * 1.25
  v2 = rng.normal(size=(n, d)); v2 *= 80 / np.linalg.norm(v2, axis=1, keepdims=True)
  first = rng.random(n) < 0.5
  v1[~first] = 0; v2[first] = 0
  recs = (tf.constant(v1, tf.float32), tf.constant(v2, tf.float32))
  q = dq.JointClipQuery((1.0, 100.0), l2_norm_clip=1.0, stddev=0.01, seed=3)
  result, _, events = run_query(q, recs)
  r1 = result[0].numpy() - v1.sum(0)
  r2 = result[1].numpy() - v2.sum(0)
  # d = 5000 coordinates each: sample std within 5 standard errors (std / sqrt(2d)).
  assert abs(r1.std() - 0.01) < 5 * 0.01 / math.sqrt(2 * d)
  assert abs(r2.std() - 1.0) < 5 * 1.0 / math.sqrt(2 * d)
  assert (float(events[0].l2_norm_clip), float(events[0].stddev)) == pytest.approx((1.0, 0.01))
  # A record beyond its scale is clipped jointly: v1 of norm 3 becomes norm 1.
  big = (tf.constant([[3.0, 0.0]]), tf.constant([[0.0, 0.0]]))
  res, _, _ = run_query(dq.JointClipQuery((1.0, 100.0), 1.0, 0.0, seed=0), big)
  np.testing.assert_allclose(res[0].numpy(), [1.0, 0.0], rtol=1e-6)


def test_value_noise_multiplier_pays_for_the_count():
  z, sb = 1.1, 5.0
  zv = dq.value_noise_multiplier(z, sb)
  # Eq. (1) over the two queries: value (C, zv*C) and count (1/2, sb).
  assert (zv ** -2 + (0.5 / sb) ** 2) ** -0.5 == pytest.approx(z)
  with pytest.raises(ValueError, match="clipped_count_stddev"):
    dq.value_noise_multiplier(2.0, 0.5)


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_adaptive_clip_tracks_quantile(mode):
  rng = np.random.default_rng(0)
  n = 200
  norms = np.linspace(0.1, 2.0, n)
  dirs = rng.normal(size=(n, 8)); dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
  recs = tf.constant(dirs * norms[:, None], tf.float32)
  q = dq.QuantileAdaptiveClipSumQuery(initial_l2_norm_clip=0.2, noise_multiplier=0.5,
                                      target_unclipped_quantile=0.5, learning_rate=0.2,
                                      clipped_count_stddev=2.0, expected_num_records=n, seed=11)
  g = q.initial_global_state()
  tmpl = tf.TensorSpec([8], tf.float32)

  def step(g):
    s = q.accumulate_records(q.derive_sample_params(g), q.initial_sample_state(tmpl), recs)
    return q.get_noised_result(s, g)

  step = tf.function(step, jit_compile=(mode == "xla"))
  for _ in range(150):
    _, g, events = step(g)
  clip = float(g.l2_norm_clip)
  # The median norm is 1.05; the count noise (std 2 over 200 records => 1% in fraction)
  # keeps the estimate inside the 40%-60% quantile band of the norms.
  assert np.quantile(norms, 0.4) < clip < np.quantile(norms, 0.6)
  z = effective_noise_multiplier([float(e.l2_norm_clip) for e in events],
                                 [float(e.stddev) for e in events])
  assert z == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_laplace_sum_query(mode):
  x = tf.constant([[3.0, -1.0], [0.2, 0.1]])
  result, _, events = run_query(dq.LaplaceSumQuery(1.0, 1e-9, seed=0), x, mode=mode)
  np.testing.assert_allclose(result.numpy(), [0.75 + 0.2, -0.25 + 0.1], atol=1e-5)
  assert float(events[0].l1_norm_clip) == 1.0


def test_laplace_noise_variance():
  # Laplace(0, b) has variance 2 b^2; the sample variance of N draws has relative standard
  # error sqrt((kurtosis - 1) / N) = sqrt(5 / N) (excess kurtosis 3). Tolerance: 5 s.e.
  n, b = 400_000, 0.7
  result, _, _ = run_query(dq.LaplaceSumQuery(1.0, b, seed=9), tf.zeros([1, n]))
  var = result.numpy().var()
  assert abs(var / (2 * b * b) - 1) < 5 * math.sqrt(5 / n)


def test_no_privacy_queries():
  x = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
  s, _, ev = run_query(dq.NoPrivacySumQuery(), x)
  np.testing.assert_allclose(s.numpy(), [9, 12])
  assert isinstance(ev[0], dq.NonPrivateEvent)
  a, _, _ = run_query(dq.NoPrivacyAverageQuery(), x, mask=tf.constant([1.0, 1.0, 0.0]))
  np.testing.assert_allclose(a.numpy(), [2, 3])


def test_merge_sample_states_equals_one_pass():
  x = tf.random.stateless_normal([10, 4], seed=[1, 2])
  q = dq.GaussianSumQuery(1.0, 0.0, seed=0)
  p = q.derive_sample_params(q.initial_global_state())
  tmpl = tf.TensorSpec([4])
  s1 = q.accumulate_records(p, q.initial_sample_state(tmpl), x[:6])
  s2 = q.accumulate_records(p, q.initial_sample_state(tmpl), x[6:])
  s = q.accumulate_records(p, q.initial_sample_state(tmpl), x)
  np.testing.assert_allclose(q.merge_sample_states(s1, s2).numpy(), s.numpy(), rtol=1e-6)
  # accumulate_record one at a time agrees with the vectorized path
  s3 = q.initial_sample_state(tmpl)
  for r in x:
    s3 = q.accumulate_record(p, s3, r)
  np.testing.assert_allclose(s3.numpy(), s.numpy(), rtol=1e-5)


@pytest.mark.parametrize("kwargs,name", [
    (dict(l2_norm_clip=-1.0, stddev=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=float("nan"), stddev=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, stddev=-0.1), "stddev"),
    (dict(l2_norm_clip=1.0, stddev=float("nan")), "stddev"),
    (dict(l2_norm_clip=1.0, stddev=float("inf")), "stddev"),
])
def test_bad_gaussian_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    dq.GaussianSumQuery(**kwargs)


def test_bad_other_arguments():
  with pytest.raises(ValueError, match="scale"):
    dq.LaplaceSumQuery(1.0, 0.0)
  with pytest.raises(ValueError, match="denominator"):
    dq.GaussianAverageQuery(1.0, 1.0, denominator=-5)
  with pytest.raises(ValueError, match="target_quantile"):
    dq.QuantileEstimatorQuery(1.0, 1.5, 0.1, 1.0, 10)
  with pytest.raises(ValueError, match="scales"):
    dq.JointClipQuery((1.0, -2.0), 1.0, 0.1)


def test_seed_warns_not_private():
  with pytest.warns(dq.NotPrivateSeedWarning, match="NOT differentially private"):
    dq.GaussianSumQuery(1.0, 1.0, seed=3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    g1 = dq.make_generator()  # OS entropy: no warning
  g2 = dq.make_generator()
  assert not np.array_equal(g1.normal([8]).numpy(), g2.normal([8]).numpy())
  assert g1.algorithm == tf.random.Algorithm.PHILOX.value


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("query_fn", [
    lambda: dq.JointClipQuery((1.0, 2.0), 1.0, 0.0, seed=0),
    lambda: dq.NestedQuery((dq.GaussianSumQuery(1.0, 0.0, seed=0), dq.NoPrivacySumQuery())),
])
def test_queries_run_in_graph_and_xla(mode, query_fn):
  recs = (tf.constant([[0.3, 0.4], [0.0, 0.1]]), tf.constant([[0.5, 0.0], [0.2, 0.2]]))
  eager, _, _ = run_query(query_fn(), recs)
  got, _, events = run_query(query_fn(), recs, mode=mode)
  for a, b in zip(tf.nest.flatten(eager), tf.nest.flatten(got)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
  assert len(events) >= 1


@pytest.mark.parametrize("geometric", [True, False])
def test_quantile_estimator_update_rule(geometric):
  # Zero count noise: 3 of 4 records are <= 1.0, so the fraction below is 0.75; with target
  # 0.5 and rate 0.4 the estimate moves down by exp(-0.1) (geometric) or by 0.1.
  q = dq.QuantileEstimatorQuery(initial_estimate=1.0, target_quantile=0.5, learning_rate=0.4,
                                below_estimate_stddev=0.0, expected_num_records=4,
                                geometric_update=geometric, seed=0)
  g = q.initial_global_state()
  s = q.accumulate_records(q.derive_sample_params(g), q.initial_sample_state(),
                           tf.constant([0.2, 0.5, 1.0, 3.0]))
  estimate, new_g, events = q.get_noised_result(s, g)
  expected = math.exp(-0.1) if geometric else 0.9
  assert float(estimate) == pytest.approx(expected, rel=1e-6)
  assert float(new_g.current_estimate) == pytest.approx(expected, rel=1e-6)
  assert (float(events[0].l2_norm_clip), float(events[0].stddev)) == (0.5, 0.0)


class _CountingQuery(dq.DPQuery):
  """A DPQuery that is not a sum aggregation: counts records (tests the generic loop)."""

  def initial_sample_state(self, template):
    return tf.constant(0.0)

  def preprocess_record(self, params, record):
    return record

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    return sample_state + 1.0

  def merge_sample_states(self, s1, s2):
    return s1 + s2

  def get_noised_result(self, sample_state, global_state):
    return sample_state, global_state, (dq.NonPrivateEvent(),)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_generic_accumulate_records_loops_and_masks(mode):
  q = _CountingQuery()
  result, _, _ = run_query(q, tf.ones([5, 2]), mask=tf.constant([1.0, 0.0, 1.0, 1.0, 0.0]),
                           mode=mode)
  assert float(result) == 3.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(200_001,), (301, 667)])
def test_box_muller_noise_is_standard_normal(mode, shape):
  """randomness.normal (Box-Muller on Philox bits) against N(0, 1): Kolmogorov-Smirnov
  at N = 200k (critical value 1.95 / sqrt(N) at level 0.001), the mean and variance
  within 5 standard errors, and the tail mass beyond 3 within 5 binomial standard errors.
  Odd sizes check that no pair half is dropped or repeated."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", randomness.NotPrivateSeedWarning)
    gen = randomness.make_generator(seed=7)
  fn = lambda: randomness.normal(gen, shape)  # noqa: E731
  if mode != "eager":
    fn = tf.function(fn, jit_compile=(mode == "xla"))
  z = fn().numpy()
  assert z.shape == shape and z.dtype == np.float32
  z = z.ravel().astype(np.float64)
  n = z.size
  assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(n)
  assert abs(z.mean()) < 5 / math.sqrt(n)
  assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / n)
  p3 = 2 * stats.norm.sf(3.0)
  assert abs(np.mean(np.abs(z) > 3.0) - p3) < 5 * math.sqrt(p3 * (1 - p3) / n)
  assert len(np.unique(z)) > 0.99 * n   # no repeated halves (float32 ties: ~0.1%)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float64])
def test_normal_noise_dtypes(dtype):
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  gen = tf.random.Generator.from_seed(3, alg="philox")
  z = randomness.normal(gen, [4001], dtype=dtype)
  assert z.dtype == dtype and z.shape == (4001,)
  z = tf.cast(z, tf.float64).numpy()
  assert abs(z.std() - 1.0) < 5 * math.sqrt(2.0 / 4001) + 0.01


@pytest.mark.parametrize("bucket_bits,refine_below", [(32, 256), (4, 16), (2, 4)])
def test_exponential_is_exact_in_the_tail(bucket_bits, refine_below):
  """randomness.exponential against Exp(1): KS at N = 200k, and the tail masses beyond
  1, 2 and 3 times b ln 2 (the recursion depths for small b) within 5 binomial s.e.
  Small b with every bucket refined runs the k = 0 recursion on 1/16 and 1/4 of the draws."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  gen = tf.random.Generator.from_seed(11, alg="philox")
  n = 200_000
  e = tf.function(lambda: randomness.exponential(gen, n, bucket_bits, refine_below))()
  e = e.numpy().astype(np.float64)
  assert np.all(e >= 0)
  assert stats.kstest(e, "expon").statistic < 1.95 / math.sqrt(n)
  for depth in (1, 2, 3):
    t = depth * bucket_bits * math.log(2) if bucket_bits < 32 else 4.0 * depth
    p = math.exp(-t)
    assert abs(np.mean(e > t) - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_normal_noise_tail_conditional_ks():
  """The sampler in its tail: |z| given |z| > 4 against the normal tail law (KS with the
  tolerance of the tail sample's size, level 0.001), from 4e7 draws (~2500 tail values)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  gen = tf.random.Generator.from_seed(5, alg="philox")
  draw = tf.function(lambda: randomness.normal(gen, [4_000_000]))
  tail = np.concatenate([np.abs(z[np.abs(z) > 4.0]) for z in
                         (draw().numpy().astype(np.float64) for _ in range(10))])
  m = tail.size
  p4 = 2 * stats.norm.sf(4.0)
  assert abs(m / 4e7 - p4) < 5 * math.sqrt(p4 / 4e7)
  cdf = lambda t: 1.0 - stats.norm.sf(t) / stats.norm.sf(4.0)  # noqa: E731
  assert stats.kstest(tail, cdf).statistic < 1.95 / math.sqrt(m)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_secure_mode_noise_is_standard_normal(mode):
  """Secure mode (os.urandom bits, (z1 + z2)/sqrt 2) against N(0, 1) at N = 100k."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  src = randomness.make_generator(secure=True)
  fn = lambda: randomness.normal(src, [100_001])  # noqa: E731
  if mode == "function":
    fn = tf.function(fn)
  def check():
    z = fn().numpy().astype(np.float64)
    n = z.size
    assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(n)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / n)

  try:     # unseeded: a second, independent draw only if the first fails by chance (level
    check()  # 0.001): both fail with probability 1e-6 under the law, a wrong law fails both
  except AssertionError:
    check()
  with pytest.raises(ValueError, match="seed"):
    randomness.make_generator(seed=1, secure=True)


def test_secure_mode_query_noise_and_config():
  q = dq.GaussianSumQuery(1.0, 2.0, secure_mode=True)
  assert q.get_config()["secure_mode"] is True
  g = q.initial_global_state()
  s = q.accumulate_records(q.derive_sample_params(g), q.initial_sample_state(tf.TensorSpec([20000])),
                           tf.zeros([3, 20000]))
  noised, _, _ = q.get_noised_result(s, g)
  assert abs(float(tf.math.reduce_std(noised)) - 2.0) < 5 * 2.0 * math.sqrt(2.0 / 20000)


@pytest.mark.parametrize("clip, z, expected", [
    (2.0, 1.5, 3.0), (math.inf, 0.0, 0.0), (2.0, 0.0, 0.0), (3, 2, 6.0)])
def test_gaussian_stddev_is_z_times_clip_with_explicit_edges(clip, z, expected):
  assert dq.gaussian_stddev(clip, z) == expected
  q = dq.GaussianSumQuery.from_noise_multiplier(clip, z, seed=0)
  assert (q.l2_norm_clip, q.stddev) == (clip, expected)


@pytest.mark.parametrize("mode", MODES)
def test_gaussian_stddev_on_tensors_never_gives_nan(mode):
  fn = lambda s, z: dq.gaussian_stddev(s, z)
  if mode != "eager":
    fn = tf.function(fn, jit_compile=(mode == "xla"))
  clips = tf.constant([math.inf, 2.0, 0.0], tf.float32)
  zs = tf.constant([0.0, 1.5, 3.0], tf.float32)
  got = fn(clips, zs)
  assert got.dtype == tf.float32
  np.testing.assert_array_equal(got.numpy(), [0.0, 3.0, 0.0])


@pytest.mark.parametrize("clip, z, match", [
    (math.inf, 1.0, "`l2_norm_clip` must be finite when the noise multiplier is > 0.*"
     "Received: l2_norm_clip=inf"),
    (1.0, math.inf, "`noise_multiplier` must be a finite number >= 0"),
    (-1.0, 1.0, "`l2_norm_clip` must be a number > 0. Received: l2_norm_clip=-1.0"),
    (0.0, 1.5, "`l2_norm_clip` must be a number > 0. Received: l2_norm_clip=0.0"),
    (1.0, float("nan"), "noise_multiplier"),
])
def test_gaussian_stddev_refuses_what_has_no_meaning(clip, z, match):
  from tf_dpiter.errors import PrivacyConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(PrivacyConfigError, match=match):
    dq.gaussian_stddev(clip, z)


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_batched_clip_is_each_records_clip(mode):
  """GaussianSumQuery.preprocess_records clips a batch at once (no per-record vectorization):
  each record as preprocess_record clips it alone, up to the order within a pinned block
  (which the norm's margin covers), within the clip, a non-finite record zeros, in graph
  mode and under XLA; a subclass
  with its own preprocess_record keeps its records' own clip."""
  rng = np.random.default_rng(3)
  records = [(rng.normal(size=(6, 3, 3, 1, 8)) * rng.uniform(0.05, 3, (6, 1, 1, 1, 1)))
             .astype("float32"), rng.normal(size=(6, 200)).astype("float32"),
             rng.normal(size=(6,)).astype("float64")]
  records[1][4, 7] = np.nan
  query = dq.GaussianSumQuery(1.0, 0.0)
  spec = [tf.TensorSpec([None] + list(r.shape[1:]), r.dtype) for r in records]
  batched = tf.function(lambda *r: query.preprocess_records(1.0, list(r)),
                        input_signature=spec, jit_compile=mode == "xla")
  graph = batched.get_concrete_function().graph
  assert not [op.name for op in graph.get_operations() if "pfor" in op.name]
  got = [t.numpy() for t in batched(*records)]
  assert [g.dtype for g in got] == [r.dtype for r in records]
  for i in range(6):
    alone = [t.numpy() for t in query.preprocess_record(1.0, [r[i] for r in records])]
    for g, a in zip(got, alone):
      np.testing.assert_allclose(g[i], a, rtol=1e-6, atol=0)
    norm = math.sqrt(sum(float(np.sum(np.square(g[i].astype(np.float64)))) for g in got))
    # within the clip up to the float32 rounding of the clipped entries; record 4 (a NaN): 0
    assert norm <= 1.0 + 1e-6 if i != 4 else norm == 0.0

  class Halving(dq.GaussianSumQuery):
    def preprocess_record(self, params, record):
      return tf.nest.map_structure(lambda x: x / 2, record)

  halved = Halving(1.0, 0.0).preprocess_records(1.0, [tf.constant(records[1])])
  np.testing.assert_array_equal(halved[0].numpy(), records[1] / 2)
