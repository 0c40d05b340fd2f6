"""Epsilon of the correlated-noise ledger rows equals dp-accounting called by hand."""

import math

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter.accounting import accountant
from tf_dpiter.dp_query import correlated_events as ce
from tf_dpiter.ledger import records as rec

DELTA = 1e-5


def _ledger(policy, n, q, m, rows, steps):
  """(samples, queries) arrays: `steps` samples, each with the query `rows`."""
  samples = np.array([[n, q, m, rec.policy_code(policy), 1, len(rows)]] * steps, np.float64)
  queries = np.array([[i] + list(r) for i in range(steps) for r in rows], np.float64)
  return samples, queries


@pytest.mark.parametrize("steps,cycle,bands,q,sigma", [(50, 5, 4, 0.1, 1.2), (37, 4, 4, 0.3, 0.9),
                                                      (20, 2, 2, 1.0, 3.0)])
def test_amplified_band_mf_equals_dp_accounting_by_hand(steps, cycle, bands, q, sigma):
  clip, zeta = 1.5, 1.0
  row = rec.correlated_query_row(ce.BandedGaussianEvent(clip, sigma * clip, zeta, bands),
                                 rec.CYCLIC_POISSON, cycle, factor=1.0)
  report = accountant.privacy_report(_ledger(rec.CYCLIC_POISSON, 1000, q, cycle, [row], steps),
                                     delta=DELTA)
  mech = dpa.GaussianDpEvent(sigma)
  inner = mech if q == 1.0 else dpa.PoissonSampledDpEvent(q, mech)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(inner, math.ceil(steps / cycle)))
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  assert any("cyclic Poisson" in a and "Theorem 4" in a for a in report.assumptions)


def test_cyclic_with_one_group_is_poisson_dp_sgd():
  row = [rec.GAUSSIAN, 1.0, 1.1, 1.0]
  cyc = accountant.epsilon(_ledger(rec.CYCLIC_POISSON, 500, 0.02, 1, [row], 300), DELTA)
  poi = accountant.epsilon(_ledger(rec.POISSON, 500, 0.02, 0, [row], 300), DELTA)
  assert cyc == pytest.approx(poi, rel=1e-12)


def test_runs_split_by_other_steps_are_charged_per_run():
  """Two runs of 3 steps with b = 4 may put one example in 2 steps, not ceil(6 / 4) = 2 ...
  but runs of 1 step each: every one may hold the same group: k = number of runs."""
  banded = rec.correlated_query_row(ce.BandedGaussianEvent(1.0, 1.0, 1.0, 4),
                                    rec.CYCLIC_POISSON, 4, 1.0)
  other = rec.correlated_query_row(ce.BandedGaussianEvent(1.0, 2.0, 1.0, 4),
                                   rec.CYCLIC_POISSON, 4, 1.0)
  s1, q1 = _ledger(rec.CYCLIC_POISSON, 100, 0.5, 4, [banded], 1)
  s2, q2 = _ledger(rec.CYCLIC_POISSON, 100, 0.5, 4, [other], 1)
  samples = np.concatenate([s1, s2] * 3)
  queries = np.concatenate([np.c_[[i], q[:, 1:]] for i, q in enumerate([q1, q2] * 3)])
  report = accountant.privacy_report((samples, queries), delta=DELTA)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.ComposedDpEvent([
      dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(s)), 3)
      for s in (1.0, 2.0)]))
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_banded_rows_outside_their_sampling_are_refused():
  event = ce.BandedGaussianEvent(1.0, 1.0, 1.0, 4)
  with pytest.raises(ValueError, match="cycle length >= 4"):
    rec.correlated_query_row(event, rec.CYCLIC_POISSON, 3, 1.0)
  with pytest.raises(ValueError, match="cyclic_poisson"):
    rec.correlated_query_row(event, rec.POISSON, 0, 1.0)
  row = [rec.BANDED_GAUSSIAN, 1.0, 1.0, 1.0]
  with pytest.raises(ValueError, match="only under policy cyclic_poisson"):
    accountant.epsilon(_ledger(rec.POISSON, 100, 0.1, 0, [row], 5), DELTA)


def test_one_band_is_recorded_as_a_plain_gaussian_query():
  row = rec.correlated_query_row(ce.BandedGaussianEvent(2.0, 3.0, 1.0, 1), rec.POISSON, 0, 1.0)
  assert row == [rec.GAUSSIAN, 2.0, 3.0, 2.0]


@pytest.mark.parametrize("tree_size,passes", [(10, 3), (1, 2), (7, 1)])
def test_tree_aggregation_equals_dp_accounting_by_hand(tree_size, passes):
  n, m, sigma, clip = 100, 10, 2.5, 1.0
  row = rec.correlated_query_row(ce.TreeGaussianEvent(clip, sigma, tree_size), rec.SHUFFLE, m,
                                 factor=2.0)
  samples, queries = _ledger(rec.SHUFFLE, n, m / n, m, [row], passes * (n // m))
  report = accountant.privacy_report((samples, queries, passes), delta=DELTA)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
  depth = math.ceil(math.log2(tree_size + 1))
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.SingleEpochTreeAggregationDpEvent(sigma / (2 * clip), 2 ** depth - 1), passes))
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  assert any("tree aggregation" in a for a in report.assumptions)


def test_tree_of_one_leaf_costs_a_gaussian_per_pass():
  row = rec.correlated_query_row(ce.TreeGaussianEvent(1.0, 3.0, 1), rec.SHUFFLE, 10, 2.0)
  tree = accountant.epsilon(_ledger(rec.SHUFFLE, 100, 0.1, 10, [row], 20) + (2,), DELTA)
  plain = accountant.epsilon(_ledger(rec.SHUFFLE, 100, 0.1, 10, [[rec.GAUSSIAN, 1.0, 3.0, 2.0]],
                                     20) + (2,), DELTA)
  assert math.isclose(tree, plain, rel_tol=1e-12)


def test_tree_without_passes_is_refused():
  row = rec.correlated_query_row(ce.TreeGaussianEvent(1.0, 3.0, 8), rec.SHUFFLE, 10, 2.0)
  with pytest.raises(ValueError, match="no shuffled pass"):
    accountant.epsilon(_ledger(rec.SHUFFLE, 100, 0.1, 10, [row], 5), DELTA)
  with pytest.raises(ValueError, match="shuffle"):
    rec.correlated_query_row(ce.TreeGaussianEvent(1.0, 3.0, 8), rec.POISSON, 0, 1.0)


def test_truncated_poisson_ledger_is_the_truncated_subsampled_gaussian_event():
  """Fast check of the conversion (the PLD epsilon itself takes ~10 s: see the slow test)."""
  ledger = _ledger(rec.TRUNCATED_POISSON, 100, 0.1, 12, [[rec.GAUSSIAN, 2.0, 3.0, 2.0]], 10)
  assert accountant.ledger_to_dp_event(ledger, accountant="pld") == dpa.SelfComposedDpEvent(
      dpa.TruncatedSubsampledGaussianDpEvent(100, 0.1, 12, 1.5), 10)
  with pytest.raises(ValueError, match="accountant='pld'"):
    accountant.epsilon(ledger, DELTA, accountant="rdp")


@pytest.mark.slow
@pytest.mark.parametrize("n,q,cap,sigma,steps", [(100, 0.1, 12, 1.5, 10), (1000, 0.05, 60, 1.0, 40)])
def test_truncated_poisson_equals_dp_accounting_by_hand(n, q, cap, sigma, steps):
  row = [rec.GAUSSIAN, 1.0, sigma, 1.0]
  ledger = _ledger(rec.TRUNCATED_POISSON, n, q, cap, [row], steps)
  report = accountant.privacy_report(ledger, delta=DELTA, accountant="pld")
  acc = dpa.pld.PLDAccountant()
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.TruncatedSubsampledGaussianDpEvent(n, q, cap, sigma), steps))
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  with pytest.raises(ValueError, match="accountant='pld'"):
    accountant.epsilon(ledger, DELTA, accountant="rdp")
