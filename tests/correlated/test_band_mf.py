"""BandMF: one band is DP-SGD, the noise has the covariance its strategy implies, the
strategy optimizer's invariants (column norms, bands, sensitivity from the matrix)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import matrix_factorization as mf


def _records(rng, batch):
  return {"w": tf.constant(rng.normal(size=[batch, 3, 4]), tf.float32),
          "b": tf.constant(rng.normal(size=[batch, 5]), tf.float32)}


def _run(query, records, steps):
  template = tf.nest.map_structure(lambda x: x[0], records)
  state = query.initial_global_state()
  outs = []
  for _ in range(steps):
    params = query.derive_sample_params(state)
    sample = query.accumulate_records(params, query.initial_sample_state(template), records)
    result, state, events = query.get_noised_result(sample, state)
    outs.append(np.concatenate([np.ravel(v.numpy()) for v in tf.nest.flatten(result)]))
  return np.stack(outs), events


@pytest.mark.parametrize("seed", [1, 7])
def test_one_band_adds_exactly_the_gaussian_sum_noise(seed):
  records = _records(np.random.default_rng(seed), 6)
  template = tf.nest.map_structure(lambda x: x[0], records)
  band = band_mf_query.BandMFQuery(1.5, 1.1, template, num_bands=1, seed=seed)
  gauss = gaussian_query.GaussianSumQuery(1.5, 1.1 * 1.5, seed=seed)
  got, events = _run(band, records, 4)
  want, _ = _run(gauss, records, 4)
  # Same Philox values, same coordinates; the Gaussian query multiplies sigma into the
  # Box-Muller radius (r sigma cos) where this query scales z (r cos sigma): the float32
  # products may differ in their last bits, a few ulp of the largest value.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=4 * np.finfo(np.float32).eps * np.abs(want).max())
  assert events[0].num_bands == 1 and float(events[0].column_norm) == 1.0


@pytest.mark.parametrize("strategy", ["toeplitz", "banded"])
def test_noise_covariance_is_what_the_strategy_implies(strategy):
  steps, bands, d, sigma = 8, 3, 20000, 2.0
  zeros = {"x": tf.zeros([1, d])}
  query = band_mf_query.BandMFQuery(1.0, sigma, {"x": tf.zeros([d])}, num_bands=bands,
                                    num_steps=steps, strategy=strategy, seed=3)
  noise, events = _run(query, zeros, steps)          # [steps, d]: pure noise
  rows = query.band_rows
  c = np.zeros([steps, steps])
  for t in range(steps):
    for k in range(min(bands, t + 1)):
      c[t, t - k] = rows[min(t, len(rows) - 1), k]
  assert mf.num_bands(c) == bands
  np.testing.assert_allclose(mf.column_norms(c).max(), 1.0, rtol=1e-6)
  cinv = np.linalg.inv(c)
  expected = sigma ** 2 * cinv @ cinv.T
  got = noise @ noise.T / d
  # Sample covariance of d independent draws: sd of entry (i, j) = sqrt((S_ii S_jj + S_ij^2) / d).
  se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)
  assert np.all(np.abs(got - expected) <= 5 * se), np.max(np.abs(got - expected) / se)
  # Whitened: C W / sigma is iid N(0, 1) across steps.
  white = c @ noise / sigma
  cov = white @ white.T / d
  se_white = np.sqrt((1 + np.eye(steps)) / d)
  assert np.all(np.abs(cov - np.eye(steps)) <= 5 * se_white)
  assert events[0].num_bands == bands


@pytest.mark.parametrize("n,bands", [(32, 1), (32, 4), (200, 8)])
def test_toeplitz_strategy_beats_dp_sgd_and_keeps_unit_columns(n, bands):
  c = mf.optimize_banded_toeplitz(n, bands)
  assert len(c) == bands and np.isclose(np.linalg.norm(c), 1.0)
  matrix = mf.toeplitz_matrix(c, n)
  assert mf.column_norms(matrix).max() <= 1.0 + 1e-12
  sgd = mf.prefix_error(np.eye(n))
  assert np.isclose(sgd, (n + 1) / 2)                  # ||A||_F^2 / n = sum_i i / n
  err = mf.prefix_error(matrix)
  init = mf.toeplitz_matrix(mf.sqrt_prefix_coefficients(bands), n)
  init_err = mf.prefix_error(init) * mf.column_norms(init).max() ** 2
  assert err <= init_err * (1 + 1e-9)
  assert (err < sgd) if bands > 1 else np.isclose(err, sgd)


def test_general_banded_is_no_worse_than_toeplitz():
  n, bands = 48, 4
  general = mf.optimize_banded(n, bands)
  assert mf.num_bands(general) == bands
  np.testing.assert_allclose(mf.column_norms(general), 1.0, rtol=1e-9)
  toeplitz = mf.toeplitz_matrix(mf.optimize_banded_toeplitz(n, bands), n)
  assert mf.prefix_error(general) <= mf.prefix_error(toeplitz) * (1 + 1e-6)


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="num_steps"):
    band_mf_query.BandMFQuery(1.0, 1.0, [tf.zeros([2])], num_bands=3)
  with pytest.raises(ValueError, match="strategy"):
    band_mf_query.BandMFQuery(1.0, 1.0, [tf.zeros([2])], num_bands=2, num_steps=4,
                              strategy="dense")
  with pytest.raises(ValueError, match="noise_multiplier"):
    band_mf_query.BandMFQuery(1.0, -1.0, [tf.zeros([2])])
