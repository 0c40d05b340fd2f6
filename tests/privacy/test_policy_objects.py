"""Each sampling policy is one object (issue 26): code, relation, unit, participation; its
event is its accounting object's (the ledger imports no accounting)."""

import math

import pytest

from tf_dpiter.accounting import ledger_events
from tf_dpiter.accounting import policy_accounting
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import records
from tf_dpiter.ledger import schema


def test_every_sampling_policy_has_one_object_stating_relation_and_unit():
  names = policies.names()
  assert len(names) == 10
  units = {schema.USER_POISSON: "user", schema.CLIENT_POISSON: "client",
           schema.CLIENT_FIXED_SIZE: "client"}
  for name in names:
    policy = policies.get(name)
    assert policy.name == name
    assert policy.relation == records.relation_for_policy(name)
    assert policy.unit == units.get(name, "example")
  with pytest.raises(ValueError, match="policy must be one of"):
    policies.get(schema.REPEAT_AND_SELECT)


def test_participation_rule_and_pass_length_come_from_the_policy():
  cyclic = policies.get(schema.CYCLIC_POISSON)
  assert [cyclic.participations(c, 4) for c in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
  assert policies.get(schema.POISSON).participations(10, 0) == 0
  group = ledger_events.SampleGroup(10, schema.SHUFFLE, 50, 0.24, 12, 1.0, (), False)
  assert policies.get(schema.SHUFFLE).steps_per_pass(group) == math.ceil(50 / 12)


@pytest.mark.parametrize("policy,n,q,m,match", [
    (schema.SHUFFLE, 10, 0.5, 11, r"`sample_size` must be in \[1, population_size=10\]"),
    (schema.CYCLIC_POISSON, 10, 0.5, 2.5, r"must be a whole number"),
    (schema.BALLS_IN_BINS, 10, 0.5, 4, r"must be 1 / sample_size"),
])
def test_declared_sampling_is_checked_by_its_policy(policy, n, q, m, match):
  assert policies.get(policy).check_sampling(n, q, m) is not None
  from tf_dpiter.ledger.query_with_ledger import QueryWithLedger  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import GaussianSumQuery  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=match):
    QueryWithLedger(GaussianSumQuery(1.0, 1.0), n, q, policy=policy, sample_size=m)


def test_denominator_and_log_line_come_from_the_policy():
  expected = {p for p in policies.names() if policies.get(p).expected_size_denominator}
  assert expected == {schema.POISSON, schema.USER_POISSON, schema.CYCLIC_POISSON,
                      schema.TRUNCATED_POISSON, schema.BALLS_IN_BINS, schema.FULL,
                      schema.CLIENT_POISSON}
  assert policies.get(schema.POISSON).expected_records(50, 0.2, 10) == pytest.approx(10)
  assert policies.get(schema.CYCLIC_POISSON).expected_records(60, 0.5, 3) == pytest.approx(10)
  for name in policies.names():
    line = policies.get(name).describe(50, 0.2, 10)
    assert "adjacency" in line and "\n" not in line
  assert "user" in policies.get(schema.USER_POISSON).describe(50, 0.2, 10)


def test_participation_bound_and_gap_are_the_events_charge():
  group = ledger_events.SampleGroup(10, schema.SHUFFLE, 50, 0.24, 12, 1.0, (), False)
  assert policies.get(schema.SHUFFLE).participation_bound(group, 3) == 3
  assert policies.get(schema.SHUFFLE).participation_bound(group, 0) == 10   # no pass: every step
  assert policies.get(schema.POISSON).participation_bound(group, 3) == 10
  cyclic = ledger_events.SampleGroup(10, schema.CYCLIC_POISSON, 50, 1.0, 4, 1.0, (), False,
                                     correlated="banded", participations=3)
  assert policies.get(schema.CYCLIC_POISSON).participation_bound(cyclic, 0) == 3
  assert policies.get(schema.CYCLIC_POISSON).min_gap(cyclic) == 4
  assert policies.get(schema.POISSON).min_gap(group) == 1


def test_passes_gdp_and_cycle_come_from_the_policy():
  shuffle = ledger_events.SampleGroup(11, schema.SHUFFLE, 50, 0.24, 12, 1.0, (), False)
  balls = ledger_events.SampleGroup(11, schema.BALLS_IN_BINS, 50, 0.25, 4, 1.0, (), False)
  assert policies.get(schema.SHUFFLE).passes_needed(shuffle) == math.ceil(11 / 5)
  assert policies.get(schema.BALLS_IN_BINS).passes_needed(balls) == math.ceil(11 / 4)
  assert policies.get(schema.POISSON).passes_needed(shuffle) == 0
  poisson = ledger_events.SampleGroup(10, schema.POISSON, 100, 0.1, 10, 2.0, (), False)
  assert policy_accounting.get(schema.POISSON).gdp_mu_squared(poisson) == pytest.approx(
      10 * 0.01 * math.expm1(0.25))
  assert policy_accounting.get(schema.FULL).gdp_mu_squared(poisson) == pytest.approx(10 / 4)
  with pytest.raises(ValueError, match="accountant='gdp' accounts Poisson"):
    policy_accounting.get(schema.SHUFFLE).gdp_mu_squared(shuffle)
  assert [p for p in policies.names() if policies.get(p).advances_cycle] == [
      schema.CYCLIC_POISSON]


# --- issue 38, finding 8: every policy's event runs the coverage check (event is final) ---

@pytest.mark.parametrize("correlated,depth", [("banded", 0), ("matrix", 0), ("tree", 3)])
def test_report_from_groups_refuses_balls_in_bins_rows_its_policy_does_not_cover(correlated,
                                                                                  depth):
  """Before: BallsInBins overrode `event` and skipped the check, ε = 4.377 was returned."""
  from tf_dpiter.accounting import accountant  # pylint: disable=g-import-not-at-top
  from tf_dpiter.errors import PrivacyConfigError  # pylint: disable=g-import-not-at-top
  assert policies.get(schema.BALLS_IN_BINS).covers == ()
  group = ledger_events.SampleGroup(10, schema.BALLS_IN_BINS, 1000.0, 0.1, 10.0, 1.0, (), False,
                                    correlated=correlated, tree_depth=depth)
  for acc in ("rdp", "pld"):
    with pytest.raises(PrivacyConfigError, match=f"no accounting rule for '{correlated}' rows"):
      accountant.report_from_groups([group], delta=1e-5, accountant=acc, passes=1)
  plain = ledger_events.SampleGroup(10, schema.BALLS_IN_BINS, 1000.0, 0.1, 10.0, 1.0, (), False)
  assert math.isfinite(accountant.report_from_groups([plain], delta=1e-5, accountant="pld",
                                                     passes=1).epsilon)


def test_event_refuses_a_group_its_own_check_sampling_refuses():
  from tf_dpiter.accounting import accountant  # pylint: disable=g-import-not-at-top
  from tf_dpiter.errors import PrivacyConfigError  # pylint: disable=g-import-not-at-top
  # balls in bins with q != 1 / k: check_sampling refuses it when recorded, and now by hand too
  group = ledger_events.SampleGroup(10, schema.BALLS_IN_BINS, 1000.0, 0.5, 10.0, 1.0, (), False)
  with pytest.raises(PrivacyConfigError, match=r"must be 1 / sample_size"):
    accountant.report_from_groups([group], delta=1e-5, accountant="pld", passes=1)


def test_every_registered_policy_keeps_the_final_event():
  for name in policies.names():
    assert type(policy_accounting.get(name)).event is policy_accounting.PolicyAccounting.event


def test_a_policy_overriding_event_is_refused_at_class_creation():
  from tf_dpiter.errors import PrivacyConfigError  # pylint: disable=g-import-not-at-top
  SamplingPolicy = policy_accounting.PolicyAccounting  # pylint: disable=invalid-name
  with pytest.raises(PrivacyConfigError, match=r"`event` must not be overridden.*_event"):
    class Skips(policy_accounting.BallsInBinsAccounting):  # pylint: disable=unused-variable
      def event(self, group, mech, accountant, passes, notes):
        return None
  with pytest.raises(PrivacyConfigError, match=r"`event` must not be overridden"):
    class SkipsToo(SamplingPolicy):  # pylint: disable=unused-variable
      event = None

  class Hook(SamplingPolicy):  # overriding the hook is the supported way
    policy = schema.POISSON

    def _event(self, group, mech, accountant, passes, notes):
      return super()._event(group, mech, accountant, passes, notes)
  assert Hook.event is SamplingPolicy.event
