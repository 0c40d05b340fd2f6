"""A new sampling policy is one ledger class and one accounting class, registered.

The policy below is defined here, in the test file: it touches no package file. It is run
through the ledger (QueryWithLedger records its samples, the array checks call its rule,
the JSON file keeps it) and through the accountant (its accounting object builds the
dp-accounting event). Relation: add or remove one example; unit: the example.

The fixture's policy is Poisson sampling whose declared rate must be at most 1/2 (a rule of
its own, so that the ledger's checks can be seen calling it); its event is a
PoissonSampledDpEvent per sample, compared with dp-accounting called by hand.
"""

import dp_accounting as dpa
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter.accounting import policy_accounting
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import PrivacyLedger
from tf_dpiter.ledger import QueryWithLedger
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import policy_base
from tf_dpiter.ledger import records
from tf_dpiter.ledger import schema

NAME, CODE = "half_rate_poisson", 100
N, Q, CLIP, Z, STEPS, DELTA = 1000, 0.05, 1.0, 1.5, 4, 1e-5


class HalfRatePoisson(policy_base.SamplingPolicy):
  """Poisson sampling declared at a rate q <= 1/2; add or remove one example."""
  name = NAME
  code = CODE
  relation = schema.ADD_OR_REMOVE
  unit = "example"
  expected_size_denominator = True

  def sampling_checks(self, population_size, selection_probability, sample_size):
    q = np.asarray(selection_probability, np.float64)
    return super().sampling_checks(population_size, selection_probability, sample_size) + [
        (q > 0.5, "selection_probability", "must be at most 1/2")]


class HalfRatePoissonAccounting(policy_accounting.PolicyAccounting):
  """PoissonSampledDpEvent(q, mechanism) per sample."""
  policy = NAME

  def _event(self, group, mech, accountant, passes, notes):
    notes.append(f"half-rate Poisson sampling (q={group.selection_probability:.6g})")
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(group.selection_probability, mech),
                                   group.count)


@pytest.fixture
def half_rate_policy():
  policy = policies.register(HalfRatePoisson())
  policy_accounting.register(HalfRatePoissonAccounting())
  yield policy
  policy_accounting.unregister(NAME)
  policies.unregister(NAME)


def _hand_epsilon(steps):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(Z)), steps)
  return dpa.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)


def _run(steps, ledger=None):
  query = QueryWithLedger(dq.GaussianSumQuery(CLIP, CLIP * Z, seed=0), N, Q, ledger=ledger,
                          policy=NAME, sample_size=N * Q)
  state = query.initial_global_state()
  spec = [tf.TensorSpec([3])]

  for _ in range(steps):   # eager: a few steps (the ledger's graph path has its own tests)
    s = query.accumulate_records(query.derive_sample_params(state),
                                 query.initial_sample_state(spec), [tf.ones([5, 3])])
    query.get_noised_result(s, state)
  return query.ledger


def test_a_policy_defined_in_a_test_runs_through_ledger_and_accountant(half_rate_policy, tmp_path):
  assert records.policy_code(NAME) == CODE and records.relation_for_policy(NAME) == (
      schema.ADD_OR_REMOVE)
  ledger = _run(STEPS)
  samples, queries = ledger.get_arrays()
  assert samples.shape[0] == STEPS and np.all(samples[:, 3] == CODE)
  np.testing.assert_allclose(queries[:, 4], CLIP)    # add/remove one: sensitivity S
  report = accounting.privacy_report(ledger, delta=DELTA, accountant="rdp")
  assert report.epsilon == pytest.approx(_hand_epsilon(STEPS), rel=1e-9)
  assert any("half-rate Poisson" in a for a in report.assumptions)
  # the file keeps the policy by name and reads back to the same code and epsilon
  path = str(tmp_path / "ledger.json")
  ledger.save_json(path)
  loaded = PrivacyLedger.load_json(path)
  np.testing.assert_array_equal(loaded.get_arrays()[0], samples)
  assert accounting.epsilon(loaded, DELTA) == pytest.approx(report.epsilon, rel=1e-12)
  # its epsilon is Poisson's at the same q (the same event)
  poisson = samples.copy()
  poisson[:, 3] = records.policy_code(schema.POISSON)
  assert accounting.epsilon((poisson, queries), DELTA) == pytest.approx(report.epsilon,
                                                                       rel=1e-12)


def test_the_policy_rule_is_checked_at_declaration_and_in_the_arrays(half_rate_policy):
  with pytest.raises(PrivacyConfigError, match=r"`selection_probability` must be at most 1/2 for "
                                               r"policy 'half_rate_poisson'.*Received: "
                                               r"selection_probability=0.7"):
    QueryWithLedger(dq.GaussianSumQuery(CLIP, Z), N, 0.7, policy=NAME, sample_size=700)
  # the ledger's array check calls the same rule (no table of its own)
  rows = np.array([[N, Q, N * Q, CODE, 1, 1], [N, 0.7, 700, CODE, 1, 1]], np.float64)
  qrows = np.array([[0, schema.GAUSSIAN, CLIP, Z, CLIP], [1, schema.GAUSSIAN, CLIP, Z, CLIP]])
  with pytest.raises(PrivacyConfigError, match=r"must be at most 1/2.* at sample 1"):
    records.validate_arrays(rows, qrows)
  # correlated rows it does not cover are refused by the ledger's checks too
  qrows[0, 1] = schema.BANDED_GAUSSIAN
  with pytest.raises(PrivacyConfigError, match=r"banded_gaussian query is accounted only under "
                                               r"policy cyclic_poisson"):
    records.validate_arrays(rows[:1], qrows[:1])


def test_a_policy_without_accounting_is_refused_by_the_accountant(half_rate_policy):
  ledger = (np.array([[N, Q, N * Q, CODE, 1, 1]] * 2, np.float64),
            np.array([[i, schema.GAUSSIAN, CLIP, Z, CLIP] for i in range(2)], np.float64))
  policy_accounting.unregister(NAME)
  try:
    with pytest.raises(PrivacyConfigError, match=r"`policy` must be one with an accounting rule"):
      accounting.epsilon(ledger, DELTA)
  finally:
    policy_accounting.register(HalfRatePoissonAccounting())


def test_unregistered_after_the_fixture():
  assert NAME not in policies.names()
  with pytest.raises(PrivacyConfigError, match="policy must be one of"):
    records.policy_code(NAME)
