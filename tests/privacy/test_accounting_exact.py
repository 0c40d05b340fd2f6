"""Claimed (epsilon, delta) against exact delta of concrete neighbouring pairs, and against
dp-accounting called by hand (an independent path) on a grid of sampling settings.

Neighbouring pairs: all records but one have clipped gradient 0; the differing record has
+C e_1 in D and -C e_1 in D' (replace one: the largest move of a clipped sum, 2C).
"""

import itertools
import math

import dp_accounting as dpa
import numpy as np
import pytest
import tensorflow as tf
from scipy import special, stats

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L

DELTA = 1e-5


def gdp_delta(mu, eps):
  """Exact delta(eps) of N(0,1) vs N(mu,1) (Dong, Roth, Su 2019, Cor. 2.13), in log space."""
  a = stats.norm.logcdf(-eps / mu + mu / 2)
  b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
  return math.exp(a) * -math.expm1(b - a) if b < a else 0.0


def fixed_size_delta_lower_bound(n, m, z, steps, eps):
  """A lower bound on delta(eps) of the fixed-size pair (m of n, T steps, sigma = z C).

  The sum of the T released first coordinates is a post-processing, and for any threshold
  tau, P(S) - e^eps Q(S) with S = {sum > tau} is <= delta: the best tau over a grid is a lower
  bound. Under D the sum is C * Binomial(T, m/n) + N(0, T sigma^2); under D' the same with -C.
  """
  p = m / n
  k = np.arange(steps + 1)
  log_pk = stats.binom.logpmf(k, steps, p)
  sd = z * math.sqrt(steps)           # C = 1
  tau = np.linspace(0.0, 4.0 * steps, 4001)[:, None]   # every threshold at once (one array)
  log_p = special.logsumexp(log_pk + stats.norm.logsf((tau - k) / sd), axis=1)
  log_q = special.logsumexp(log_pk + stats.norm.logsf((tau + k) / sd), axis=1)
  above = log_p > eps + log_q
  if not above.any():
    return 0.0
  return float(np.max(np.exp(log_p[above]) * -np.expm1(eps + log_q[above] - log_p[above])))


def _ledger(steps, n, q, z, policy, sample_size=0, passes=0, examples_per_record=1):
  led = L.PrivacyLedger()

  @tf.function
  def run():
    for _ in tf.range(steps):
      led.record_sample(n, q, (dq.GaussianSumEvent(1.0, z),), policy=policy,
                        sample_size=sample_size, examples_per_record=examples_per_record)

  run()
  if passes:
    led.record_passes(passes)
  return led


def test_fixed_size_n1000_m999_exact_delta_below_claim():
  n, m, z, steps = 1000, 999, 2.0, 100
  led = _ledger(steps, float(n), m / n, z, "fixed_size", sample_size=m)
  eps = accounting.epsilon(led, DELTA)
  # The pair is a post-processing of T Gaussian steps of shift 2C, sigma z C: mu = 2 sqrt(T)/z.
  assert gdp_delta(2 * math.sqrt(steps) / z, eps) <= DELTA
  # The old accounting (z = sigma / S under replace one) claimed ~85.9; this pair breaks it.
  old = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  old.compose(dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z)), steps)
  old_eps = old.get_epsilon(DELTA)
  assert old_eps == pytest.approx(85.9, abs=0.1)
  assert fixed_size_delta_lower_bound(n, m, z, steps, old_eps) > 5 * DELTA
  assert fixed_size_delta_lower_bound(n, m, z, steps, eps) <= DELTA


@pytest.mark.parametrize("z", [0.8, 1.1, 2.0])
def test_same_records_in_30_shuffled_passes_exact_delta_below_claim(z):
  """fit(batch_size=32, steps_per_epoch=1) called 30 times: each call a new pass, and the
  same 32 records can be in all 30 steps. 30 passes are charged."""
  steps = 30
  led = _ledger(steps, 1000.0, 32 / 1000, z, "shuffle", sample_size=32, passes=30)
  eps = accounting.epsilon(led, DELTA)
  mu = 2 * math.sqrt(steps) / z
  assert gdp_delta(mu, eps) <= DELTA
  # Counting steps instead of passes (the old rule: ceil(30 / ceil(1000/32)) = 1 epoch...)
  # would claim far less; the exact delta at that epsilon is far above the claim.
  old = dpa.rdp.RdpAccountant()
  old.compose(dpa.GaussianDpEvent(z), 1)
  assert gdp_delta(mu, old.get_epsilon(DELTA)) > 100 * DELTA


def test_shuffle_ledger_with_too_few_passes_is_refused():
  led = _ledger(40, 100.0, 10 / 100, 1.0, "shuffle", sample_size=10, passes=2)
  with pytest.raises(ValueError, match="passes"):
    accounting.epsilon(led, DELTA)


def _by_hand(policy, n, batch, z, steps, microbatches):
  q = batch / n
  replace = policy in ("fixed_size", "shuffle")
  z_eff = z / 2 if (replace or microbatches) else z
  rel = (dpa.NeighboringRelation.REPLACE_ONE if replace
         else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=rel)
  if policy == "poisson":
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z_eff)), steps)
  elif policy == "fixed_size":
    acc.compose(dpa.SampledWithoutReplacementDpEvent(n, batch, dpa.GaussianDpEvent(z_eff)), steps)
  elif policy == "shuffle":
    acc.compose(dpa.GaussianDpEvent(z_eff), math.ceil(steps / math.ceil(n / batch)))
  else:
    acc.compose(dpa.GaussianDpEvent(z_eff), steps)
  return acc.get_epsilon(DELTA)


GRID = [(policy, batch, z, epochs, mb)
        for policy in ("poisson", "fixed_size", "shuffle")
        for batch in (10, 100)
        for z in (0.8, 2.0)
        for epochs in (1, 30)
        for mb in ((None, 5) if policy != "poisson" else (None,))]
# Sampling without replacement costs ~0.2 s per accountant: the default suite runs the 5
# fixed_size rows that cover every pair of levels of (batch, z, epochs, microbatches) (a
# covering array of strength 2; its other 11 rows run with -m slow); the other policies' rows
# all run.
_FIXED_SIZE_DEFAULT = [("fixed_size", 10, 0.8, 1, None), ("fixed_size", 10, 2.0, 30, 5),
                       ("fixed_size", 100, 0.8, 30, 5), ("fixed_size", 100, 2.0, 1, 5),
                       ("fixed_size", 100, 2.0, 30, None)]


def test_the_default_fixed_size_rows_cover_every_pair_of_levels():
  fixed = [g for g in GRID if g[0] == "fixed_size"]
  assert set(_FIXED_SIZE_DEFAULT) <= set(fixed)
  for i, j in itertools.combinations(range(1, 5), 2):
    assert ({(g[i], g[j]) for g in _FIXED_SIZE_DEFAULT} ==
            {(g[i], g[j]) for g in fixed}), (i, j)


@pytest.mark.parametrize("policy,batch,z,epochs,microbatches", [
    pytest.param(*g, marks=pytest.mark.slow if g[0] == "fixed_size" and
                 g not in _FIXED_SIZE_DEFAULT else ()) for g in GRID])
def test_epsilon_equals_dp_accounting_by_hand(policy, batch, z, epochs, microbatches):
  n = 1000
  steps = math.ceil(epochs * n / batch)
  r = accounting.compute_dp_sgd_privacy(n, batch, z, epochs, DELTA, sampling=policy,
                                        num_microbatches=microbatches)
  assert r.steps == steps
  assert r.epsilon == pytest.approx(_by_hand(policy, n, batch, z, steps, microbatches), rel=1e-9)
  relation = "replace one" if policy != "poisson" else "add or remove one"
  assert relation in r.assumptions[0]


@pytest.mark.parametrize("policy,examples_per_record", [("poisson", 1), ("fixed_size", 1),
                                                        ("fixed_size", 4), ("shuffle", 4)])
def test_ledger_epsilon_equals_dp_accounting_by_hand(policy, examples_per_record):
  n, batch, z, steps = 1000, 100, 1.3, 50
  passes = math.ceil(steps / 10) if policy == "shuffle" else 0
  led = _ledger(steps, float(n), batch / n, z, policy, sample_size=batch, passes=passes,
                examples_per_record=examples_per_record)
  expected = _by_hand(policy, n, batch, z, steps, examples_per_record > 1)
  assert accounting.epsilon(led, DELTA) == pytest.approx(expected, rel=1e-9)
  back = accounting.epsilon(led.to_json(), DELTA)     # the file path gives the same number
  assert back == pytest.approx(expected, rel=1e-9)


def test_microbatches_refused_under_add_or_remove():
  with pytest.raises(ValueError, match="microbatches"):
    accounting.compute_dp_sgd_privacy(1000, 100, 1.0, 1, DELTA, sampling="poisson",
                                      num_microbatches=10)
  with pytest.raises(ValueError, match="microbatches"):
    L.PrivacyLedger().record_sample(1000.0, 0.1, (dq.GaussianSumEvent(1.0, 1.0),),
                                    policy="poisson", examples_per_record=10)


def test_mnist_tf_privacy_idiom_epsilon():
  """fit(x, y, batch_size=256, epochs=60) on MNIST, clip 1, noise 1.1: Poisson, eps ~ 2.6."""
  r = accounting.compute_dp_sgd_privacy(60000, 256, 1.1, 60, DELTA, sampling="poisson")
  assert r.epsilon == pytest.approx(2.6, abs=0.05)
