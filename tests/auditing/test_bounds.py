"""Soundness and power of the ε lower bounds on a known μ-GDP pair of Gaussians.

Member scores ~ N(μ, 1), non-member scores ~ N(0, 1): the pair is exactly μ-GDP, so its true
ε at δ is `gdp_epsilon(μ, δ)`. A bound at confidence 1 - α may exceed it in at most a
fraction α of repetitions; with R repetitions the number of violations of a sound bound is
at most Binomial(R, α), so we allow up to its 99.9 % quantile (a test that fails by chance
with probability <= 0.001).
"""

import numpy as np
import pytest
from scipy import stats

import tf_dpiter.auditing as audit

# Nightly tier (-m slow): the GDP pair's bound at further mu (data only): each method keeps a
# default case, [0.5-split] and [1.0-bonferroni]; the one-run bound keeps [1.0].
SLOW_CASES = {
    "test_bound_is_sound_on_gdp_pair[0.5-bonferroni]",
    "test_bound_is_sound_on_gdp_pair[1.0-split]",
    "test_bound_is_sound_on_gdp_pair[2.0-bonferroni]",
    "test_bound_is_sound_on_gdp_pair[2.0-split]",
    "test_one_run_bound_is_sound[3.0]"}

DELTA = 1e-5
ALPHA = 0.05


def _violation_limit(reps):
  return int(stats.binom.ppf(0.999, reps, ALPHA))


@pytest.mark.parametrize("k,n,alpha", [(0, 50, 0.05), (7, 50, 0.05), (50, 50, 0.01), (300, 1000, 0.001)])
def test_clopper_pearson_limits_are_exact_binomial_tails(k, n, alpha):
  lo = audit.clopper_pearson(k, n, alpha, "lower")
  hi = audit.clopper_pearson(k, n, alpha, "upper")
  assert 0.0 <= lo <= k / n <= hi <= 1.0
  if k > 0:
    assert stats.binom.sf(k - 1, n, lo) == pytest.approx(alpha, rel=1e-6)
  if k < n:
    assert stats.binom.cdf(k, n, hi) == pytest.approx(alpha, rel=1e-6)


@pytest.mark.parametrize("method", ["bonferroni", "split"])
@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_bound_is_sound_on_gdp_pair(mu, method):
  reps, n = 200, 500
  true_eps = audit.gdp_epsilon(mu, DELTA)
  rng = np.random.default_rng(int(mu * 100) + len(method))
  bounds = np.array([
      audit.epsilon_lower_bound(rng.normal(mu, 1, n), rng.normal(0, 1, n), DELTA,
                                confidence=1 - ALPHA, method=method, seed=r)
      for r in range(reps)])
  violations = int(np.sum(bounds > true_eps))
  print(f"mu={mu} method={method}: true eps {true_eps:.3f}, {violations}/{reps} violations, "
        f"mean bound {bounds.mean():.3f}")
  assert violations <= _violation_limit(reps)
  assert bounds.mean() > 0.0          # the bound is not trivially 0


def test_bound_tightens_as_canaries_grow():
  mu = 2.0
  true_eps = audit.gdp_epsilon(mu, DELTA)
  means = []
  for n in (100, 1000, 10000):
    rng = np.random.default_rng(n)
    means.append(np.mean([audit.epsilon_lower_bound(rng.normal(mu, 1, n), rng.normal(0, 1, n),
                                                    DELTA) for _ in range(4)]))
  print("mean bounds for n = 100, 1000, 10000:", np.round(means, 3), "true", round(true_eps, 3))
  assert means[0] < means[1] < means[2] < true_eps


def test_separated_scores_give_large_bound():
  # Noise 0: members and non-members never overlap; the bound is limited only by the
  # number of trials, log(n / log(K / α)) ≈ 11.7 at n = 10^6.
  n = 10**6
  b = audit.lower_bound(np.ones(n), np.zeros(n), DELTA)
  assert b.epsilon > 11.0
  assert b.fpr_upper < 2e-5 and b.tpr_lower > 0.999


def test_identical_distributions_give_zero_mostly():
  rng = np.random.default_rng(5)
  bounds = [audit.epsilon_lower_bound(rng.normal(size=300), rng.normal(size=300), DELTA)
            for _ in range(40)]
  assert sum(b > 0 for b in bounds) <= _violation_limit(40)


@pytest.mark.parametrize("thresholds", [None, [-5.0, 0.0, 1.0]])
def test_low_scores_of_nonmembers_are_evidence_too(thresholds):
  # Only non-members ever score very low: the test "score <= t" (TNR <= e^ε FNR + δ) sees it.
  rng = np.random.default_rng(3)
  members = rng.normal(0, 1, 5000)
  nonmembers = np.where(rng.random(5000) < 0.3, -10.0, rng.normal(0, 1, 5000))
  b = audit.lower_bound(members, nonmembers, DELTA, thresholds=thresholds)
  assert b.direction == "nonmember" and b.epsilon > 3.0
  if thresholds is not None:
    assert b.num_tests == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(member_scores=[], nonmember_scores=[1.0]), "member_scores"),
    (dict(member_scores=[np.nan], nonmember_scores=[1.0]), "member_scores"),
    (dict(member_scores=[1.0], nonmember_scores=[0.0], delta=1.5), "delta"),
    (dict(member_scores=[1.0], nonmember_scores=[0.0], confidence=1.0), "confidence"),
    (dict(member_scores=[1.0], nonmember_scores=[0.0], method="max"), "method"),
    (dict(member_scores=[1.0], nonmember_scores=[0.0], method="split"), "split"),
])
def test_bad_arguments_are_named(kwargs, match):
  kwargs.setdefault("delta", DELTA)
  with pytest.raises(ValueError, match=match):
    audit.lower_bound(**kwargs)


@pytest.mark.parametrize("mu", [1.0, 3.0])
def test_one_run_bound_is_sound(mu):
  reps, m = 100, 1000
  true_eps = audit.gdp_epsilon(mu, DELTA)
  rng = np.random.default_rng(int(mu * 10))
  bounds = []
  for _ in range(reps):
    inc = rng.random(m) < 0.5
    bounds.append(audit.one_run_epsilon_lower_bound(rng.normal(0, 1, m) + mu * inc, inc, DELTA))
  bounds = np.array(bounds)
  assert int(np.sum(bounds > true_eps)) <= _violation_limit(reps)
  assert bounds.mean() > 0.0


def test_one_run_bound_tightens_and_pure_dp_is_tighter():
  rng = np.random.default_rng(11)
  results = []
  for m in (100, 1000, 10000):
    inc = rng.random(m) < 0.5
    s = rng.normal(0, 1, m) + 100.0 * inc   # perfectly separable canaries
    results.append((audit.one_run_epsilon_lower_bound(s, inc, 0.0),
                    audit.one_run_epsilon_lower_bound(s, inc, DELTA)))
  pure, approx = zip(*results)
  assert pure[0] < pure[1] < pure[2]
  assert approx[0] < approx[1] < approx[2]
  assert all(p >= a for p, a in zip(pure, approx))
  # With pure DP and all m guesses right, W = m ~ Bin(m, p) needs p^m <= α / K.
  assert pure[2] > 6.0
