"""Neighbouring datasets through the real queries with noise off: the change of C G never
exceeds what the ledger's rows claim; serialization keeps each query's strategy."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import blt_query
from tf_dpiter.dp_query import blt_strategy
from tf_dpiter.dp_query import matrix_factorization as mf
from tf_dpiter.dp_query import serialization
from tf_dpiter.dp_query import tree_aggregation_query as taq
from tf_dpiter.ledger import records as rec

# Nightly (`-m slow`): BandMF with 2 bands. test_band_mf_neighbours_stay_within_the_recorded_
# sensitivity[3] stays by default: the same BandMFQuery ("banded" strategy, noise off), the
# same extra record joining every b-th step of 12, the same three assertions (each step's
# change <= S, the run's change of C G within sqrt(k) times the ledger row's
# per-participation sensitivity and within the min-separation bound), at b = 3.
SLOW_CASES = {"test_band_mf_neighbours_stay_within_the_recorded_sensitivity[2]"}


def _released(query, data, steps, cycle, extra=None):
  """Noise-free outputs [steps, d]; `extra` joins every step t = 0 mod cycle (cyclic Poisson,
  q = 1: the worst case of its group)."""
  template = tf.zeros([data.shape[1]])
  state = query.initial_global_state()
  out = []
  for t in range(steps):
    batch = data if (extra is None or t % cycle) else np.vstack([data, extra])
    params = query.derive_sample_params(state)
    sample = query.accumulate_records(params, query.initial_sample_state(template),
                                      tf.constant(batch, tf.float32))
    result, state, events = query.get_noised_result(sample, state)
    out.append(result.numpy())
  return np.stack(out), events[0]


def _minsep_sensitivity(matrix, min_separation, max_participations=None):
  """L2 sensitivity of C G (per unit clip) when one example's participations are at least
  b' = `min_separation` >= C's bands steps apart, at most k = `max_participations` times
  (default ceil(n / b')): the columns then have disjoint supports, so ||C u||^2 is a sum of
  squared column norms, maximized over patterns u by dynamic programming (Choquette-Choo et
  al., "(Amplified) Banded Matrix Factorization", Sections 2-4)."""
  c = np.asarray(matrix, np.float64)
  n = c.shape[1]
  assert min_separation >= max(mf.num_bands(c), 1), "participations closer than the bands"
  k = -(-n // min_separation)
  k = k if max_participations is None else min(int(max_participations), k)
  w = mf.column_norms(c) ** 2
  # best[j][t]: the largest sum of j squared norms of columns >= t, >= min_separation apart.
  best = np.zeros([k + 1, n + min_separation])
  for j in range(1, k + 1):
    for t in range(n - 1, -1, -1):
      best[j, t] = max(best[j, t + 1], w[t] + best[j - 1, t + min_separation])
  return float(np.sqrt(best[k, 0]))


def test_minsep_sensitivity_from_the_matrix():
  n = 10
  matrix = mf.toeplitz_matrix(mf.optimize_banded_toeplitz(n, 3), n)
  norms = mf.column_norms(matrix)
  # Separation 3: columns 0, 3, 6, 9 (all of full norm except the last ones' truncation).
  best = max(np.sum(norms[list(p)] ** 2) for p in [(0, 3, 6, 9), (0, 3, 6), (1, 4, 7)])
  assert np.isclose(_minsep_sensitivity(matrix, 3) ** 2, best)
  assert np.isclose(_minsep_sensitivity(matrix, 3, max_participations=1), norms.max())


@pytest.mark.parametrize("bands", [2, 3])
def test_band_mf_neighbours_stay_within_the_recorded_sensitivity(bands):
  steps, clip, d = 12, 1.5, 6
  rng = np.random.default_rng(bands)
  data = rng.normal(size=[5, d])
  extra = 100.0 * rng.normal(size=[1, d])                       # clipped to S
  query = band_mf_query.BandMFQuery(clip, 0.0, tf.zeros([d]), num_bands=bands, num_steps=steps,
                                    strategy="banded", seed=0)
  with_x, event = _released(query, data, steps, bands, extra)
  without, _ = _released(query, data, steps, bands)
  diff = with_x - without
  assert np.all(np.linalg.norm(diff, axis=1) <= clip * (1 + 1e-5))
  rows = query.band_rows
  c = np.zeros([steps, steps])
  for k in range(bands):
    c[np.arange(k, steps), np.arange(steps - k)] = rows[k:, k]
  row = rec.correlated_query_row(event._replace(l2_norm_clip=float(event.l2_norm_clip),
                                                stddev=float(event.stddev)),
                                 rec.CYCLIC_POISSON, bands, 1.0)
  per_participation = row[3]
  participations = -(-steps // bands)
  # The run's change of C G: within sqrt(k) x the recorded per-participation sensitivity.
  assert np.linalg.norm(c @ diff) <= np.sqrt(participations) * per_participation * (1 + 1e-5)
  assert np.linalg.norm(c @ diff) <= _minsep_sensitivity(c, bands) * clip * (1 + 1e-5)


def test_blt_neighbours_stay_within_the_recorded_sensitivity():
  steps, clip, d, sep = 12, 1.0, 4, 3
  rng = np.random.default_rng(0)
  data = rng.normal(size=[5, d])
  extra = 50.0 * rng.normal(size=[1, d])
  query = blt_query.BLTQuery(clip, 0.0, tf.zeros([d]), num_steps=steps, min_separation=sep,
                             theta=[0.7, 0.2], omega=[0.3, 0.4], seed=0)
  diff = _released(query, data, steps, sep, extra)[0] - _released(query, data, steps, sep)[0]
  c = mf.toeplitz_matrix(blt_strategy.strategy_coefficients(query.theta, query.omega, steps),
                         steps)
  k = -(-steps // sep)
  assert np.linalg.norm(c @ diff) ** 2 <= k * (query.equivalent_sensitivity * clip) ** 2 * (1 + 1e-5)


@pytest.mark.parametrize("make", [
    lambda: band_mf_query.BandMFQuery(1.0, 1.1, [tf.zeros([3])], num_bands=3, num_steps=20),
    lambda: taq.TreeAggregationQuery(1.0, 1.1, [tf.zeros([3])], restart_every=7),
    lambda: blt_query.BLTQuery(1.0, 1.1, [tf.zeros([3])], num_steps=10, theta=[0.5],
                               omega=[0.2])])
def test_serialization_round_trip_keeps_the_strategy(make):
  query = make()
  back = serialization.deserialize(serialization.serialize(query))
  assert type(back) is type(query) and back.get_config() == query.get_config()
  a, b = query.initial_global_state(), back.initial_global_state()
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_array_equal(x.numpy(), y.numpy())
