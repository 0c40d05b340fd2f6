"""Budget look-ahead (accounting.lookahead) against dp-accounting called by hand."""

import dp_accounting as dpa
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter.accounting import lookahead
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import PrivacyLedger


def _ledger(steps, q=0.01, clip=1.5, z=1.1, n=1000, policy="poisson", m=0):
  ledger = PrivacyLedger()
  for _ in range(steps):
    ledger.record_sample(n, q, (dq.GaussianSumEvent(clip, z * clip),), policy=policy,
                         sample_size=m)
  return ledger


def _poisson_epsilon(q, z, steps, delta):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("recorded, extra", [(0, 1), (5, 1), (5, 7), (3, 0)])
def test_epsilon_after_equals_dp_accounting(recorded, extra):
  q, clip, z, delta = 0.01, 1.5, 1.1, 1e-5
  ledger = _ledger(recorded, q, clip, z)
  planned = lookahead.PlannedSample(1000, q, (dq.GaussianSumEvent(clip, z * clip),))
  got = lookahead.epsilon_after(ledger, delta, planned, extra)
  assert got == pytest.approx(_poisson_epsilon(q, z, recorded + extra, delta), rel=1e-9)
  assert int(ledger.sample_count) == recorded        # the ledger is only read


def test_fixed_size_plan_is_charged_under_replace_one():
  n, m, clip, z, eps = 50, 10, 1.0, 2.0, 4.0
  ledger = _ledger(3, m / n, clip, z, n, policy="fixed_size", m=m)
  planned = lookahead.PlannedSample(n, m / n, (dq.GaussianSumEvent(clip, z * clip),),
                                    policy="fixed_size", sample_size=m)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  # replace one: the clipped sum moves by 2S, so dp-accounting's multiplier is z / 2.
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z / 2)), 5))
  assert lookahead.delta_after(ledger, eps, planned, 2) == pytest.approx(acc.get_delta(eps),
                                                                          rel=1e-9)


def test_last_sample_repeats_the_last_step():
  ledger = _ledger(4)
  assert lookahead.last_sample(PrivacyLedger()) is None
  planned = lookahead.last_sample(ledger)
  assert planned.policy == "poisson" and planned.selection_probability == pytest.approx(0.01)
  assert lookahead.epsilon_after(ledger, 1e-5, planned, 3) == pytest.approx(
      _poisson_epsilon(0.01, 1.1, 7, 1e-5), rel=1e-9)


def test_max_extra_samples_is_the_last_within_budget():
  q, z, delta, budget = 0.05, 1.0, 1e-5, 3.0
  ledger = _ledger(10, q, 1.0, z)
  planned = lookahead.last_sample(ledger)
  k = lookahead.max_extra_samples(ledger, planned, budget, delta)
  assert k > 0
  assert _poisson_epsilon(q, z, 10 + k, delta) <= budget < _poisson_epsilon(q, z, 11 + k, delta)


def test_shuffled_plan_counts_the_passes_it_needs():
  n, m = 40, 10
  ledger = PrivacyLedger()
  planned = lookahead.PlannedSample(n, m / n, (dq.GaussianSumEvent(1.0, 2.0),),
                                    policy="shuffle", sample_size=m)
  content = lookahead.content_after(ledger, planned, 9)
  assert content.passes == 3              # 9 batches of 10 from 40: 3 passes started
  assert sum(g.count for g in content.groups) == 9


def test_nothing_recorded_nor_planned_costs_nothing():
  assert lookahead.epsilon_after(PrivacyLedger(), 1e-5, None, 0) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="sometimes"), "policy"),
    (dict(selection_probability=1.5), "selection_probability"),
])
def test_bad_plans_are_refused(kwargs, match):
  args = dict(population_size=100, selection_probability=0.1,
              events=(dq.GaussianSumEvent(1.0, 1.0),))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    lookahead.epsilon_after(PrivacyLedger(), 1e-5, lookahead.PlannedSample(**args), 1)
  with pytest.raises(PrivacyConfigError, match="count"):
    lookahead.content_after(PrivacyLedger(), None, -1)


def test_tensor_events_are_read():
  planned = lookahead.PlannedSample(1000, 0.01, (dq.GaussianSumEvent(tf.constant(1.5),
                                                                     tf.constant(1.65)),))
  assert lookahead.epsilon_after(None, 1e-5, planned, 4) == pytest.approx(
      _poisson_epsilon(0.01, 1.1, 4, 1e-5), rel=1e-6)


@pytest.mark.parametrize("threshold, start, limit, expected", [
    (37, 0, 10**9, 37), (37, 5, 10**9, 37), (0, 1, 100, 0), (10**6, 0, 1000, 1000),
    (64, 1, 10**9, 64)])
def test_largest_integer(threshold, start, limit, expected):
  calls = []

  def ok(n):
    calls.append(n)
    return n <= threshold

  assert lookahead.largest_integer(ok, start, limit) == expected
  assert max(calls) <= limit + 1 and len(calls) < 80


@pytest.mark.parametrize("geometric", [False, True])
def test_bisect_returns_the_safe_side(geometric):
  boundary = 0.3137
  # smallest x with ok: x >= boundary (e.g. a noise multiplier)
  up = lookahead.bisect(lambda x: x >= boundary, 0.01, 1.0, 1e-6, geometric)
  assert boundary <= up <= boundary * (1 + 1e-6)
  # largest x with ok: x <= boundary (e.g. a sampling rate)
  down = lookahead.bisect(lambda x: x <= boundary, 1.0, 0.01, 1e-6, geometric)
  assert boundary * (1 - 1e-6) <= down <= boundary


def test_step_budget_stops_exactly_at_the_budget_and_caches():
  q, z, delta, budget = 0.05, 1.0, 1e-5, 3.0
  ledger = _ledger(10, q, 1.0, z)
  planned = lookahead.last_sample(ledger)
  guard = lookahead.StepBudget(budget, delta)
  recorded, allowed = guard.allowed_total(ledger, planned)
  assert recorded == 10
  assert _poisson_epsilon(q, z, allowed, delta) <= budget < _poisson_epsilon(q, z, allowed + 1,
                                                                             delta)
  assert not guard.exceeds(ledger, planned, allowed - 10)
  assert guard.exceeds(ledger, planned, allowed - 9)
  # Another kind of sample in the ledger changes what is left: no stale cache.
  ledger.record_sample(1000, 0.2, (dq.GaussianSumEvent(1.0, 0.5),))
  _, fewer = guard.allowed_total(ledger, planned)
  assert fewer < allowed


def test_last_sample_keeps_the_recorded_rows():
  ledger = PrivacyLedger()
  ledger.record_sample(50, 0.2, (dq.GaussianSumEvent(1.0, 2.0), dq.LaplaceSumEvent(1.0, 3.0)),
                       policy="fixed_size", sample_size=10)
  planned = lookahead.last_sample(ledger)
  samples, queries = planned.arrays()
  recorded_samples, recorded_queries = ledger.get_arrays()
  assert samples.tolist() == recorded_samples.tolist()
  assert queries.tolist() == recorded_queries.tolist()


def test_max_extra_samples_after_other_steps_equals_dp_accounting():
  """A ledger of other steps (q, z) = (0.02, 1.2) then a plan of (0.05, 1.0): the search over
  the planned count (the curves cached, `accountants.rdp_accountant_class`) stops where
  dp-accounting's epsilon of the mixed composition, by hand, passes the budget."""
  delta, budget = 1e-5, 2.5
  ledger = _ledger(6, 0.02, 1.0, 1.2)
  planned = lookahead.PlannedSample(1000, 0.05, (dq.GaussianSumEvent(1.0, 1.0),))
  k = lookahead.max_extra_samples(ledger, planned, budget, delta)

  def by_hand(extra):
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.2)), 6),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.0)),
                                extra)]))
    return acc.get_epsilon(delta)

  assert k > 0
  assert by_hand(k) <= budget < by_hand(k + 1)
  for extra in (1, k // 2, k):
    assert lookahead.epsilon_after(ledger, delta, planned, extra) == pytest.approx(
        by_hand(extra), rel=1e-12)
