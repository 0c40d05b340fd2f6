"""The DPQuery contract as a test base class: test your own query as tf_dpiter tests its own.

The contract: the same result eagerly, in `tf.function` and under XLA (same seed); merged
halves equal the whole sample; record-by-record and batched accumulation agree; the config
survives a JSON round trip; events in sum units the ledger records.

Use: subclass `DPQueryContract` in a pytest module (a `Test...` class) with one case per
configuration (a seeded query factory, records with a batch axis of at least 2 rows):

    class TestMyQuery(DPQueryContract):
      cases = {"mine": QueryCase(lambda: MyQuery(1.0, 0.5, seed=1), tf.ones([4, 3]))}

Without pytest, `TestMyQuery().check_all()` runs every check of every case.
"""

import collections
import json

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError

__all__ = ["DPQueryContract", "QueryCase", "GRAPH_MODES"]

GRAPH_MODES = ("function", "xla")


class QueryCase(collections.namedtuple("QueryCase", ["factory", "records", "xla"])):
  """One configuration of a query under test.

  Attributes:
    factory: a callable returning a fresh query with a fixed seed (called once per check).
    records: a nest of tensors with a leading batch axis of at least 2 rows.
    xla: whether `get_noised_result` compiles under XLA (False e.g. for `QueryWithLedger`).
  """

  def __new__(cls, factory, records, xla=True):
    validation.check_params({"factory": validation.Callable()}, {"factory": factory})
    rows = {int(t.shape[0]) for t in tf.nest.flatten(records)}
    if len(rows) != 1 or rows.pop() < 2:
      raise ParameterValueError("`records` must be a nest of tensors sharing a leading batch "
                                f"axis of at least 2 rows. Received: records={records!r}")
    return super().__new__(cls, factory, records, bool(xla))


def _rows(records):
  return int(tf.nest.flatten(records)[0].shape[0])


def _sample_state(query, records, rows, batched=True):
  """The sample state of `query` after accumulating `rows` of `records`."""
  params = query.derive_sample_params(query.initial_global_state())
  state = query.initial_sample_state(
      tf.nest.map_structure(lambda r: tf.TensorSpec(r.shape[1:], r.dtype), records))
  if batched:
    part = tf.nest.map_structure(lambda r: tf.gather(r, rows), records)
    return query.accumulate_records(params, state, part)
  for i in rows:
    state = query.accumulate_record(params, state, tf.nest.map_structure(lambda r: r[i],
                                                                         records))
  return state


def _cycle(query, records):
  """One whole sample: (result, new global state, events)."""
  g = query.initial_global_state()
  state = _sample_state(query, records, list(range(_rows(records))))
  return query.get_noised_result(state, g)


# (test class, case name) -> (the QueryCase, its eager `_cycle`): a case's eager cycle is
# computed once per process and shared by the checks that compare against it (its factory
# gives a fresh query with a fixed seed, so every eager cycle of a case is the same).
_EAGER_CYCLES = {}


def _eager_cycle(owner, case_name):
  """The eager `_cycle` of `owner.cases[case_name]`, computed once per case object."""
  case = owner.cases[case_name]
  key = (type(owner), case_name)
  cached = _EAGER_CYCLES.get(key)
  if cached is None or cached[0] is not case:
    cached = _EAGER_CYCLES[key] = (case, _cycle(case.factory(), case.records))
  return cached[1]


def _assert_close(a, b, what, rtol=1e-5, atol=1e-5):
  fa = [np.asarray(x) for x in tf.nest.flatten(a)]
  fb = [np.asarray(x) for x in tf.nest.flatten(b)]
  assert len(fa) == len(fb), f"{what}: {len(fa)} leaves != {len(fb)} leaves"
  for x, y in zip(fa, fb):
    try:
      np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    except AssertionError as e:
      raise AssertionError(f"{what} differ:{e}") from None


def _ledger_requirement(events):
  """(sampling policy, least sample size) under which the ledger records `events`."""
  from tf_dpiter.ledger import correlated_records  # pylint: disable=g-import-not-at-top
  policy, size = "poisson", 0
  for e in events:
    if correlated_events.is_correlated_event(e):
      required, least = correlated_records.correlated_requirement(e)
      policy, size = required or policy, max(size, least)
  return policy, size


class DPQueryContract:
  """Base class of a query's contract tests: subclass it and fill `cases`.

  Attributes:
    cases: {name: QueryCase}. A subclass fills it in its body, or with `register`.
  """

  cases = {}

  @classmethod
  def register(cls, name, factory, records, xla=True):
    """Adds the case `name` to this class's cases (the class's own dict, not its base's).

    Args:
      name: the case's name (a test id).
      factory, records, xla: see `QueryCase`.

    Returns:
      `factory`, so that `register` can be applied to a factory function.

    Raises:
      ParameterValueError: `name` is already a case of this class.
    """
    if "cases" not in cls.__dict__:
      cls.cases = dict(cls.cases)
    if name in cls.cases:
      raise ParameterValueError(f"`name` must be a new case of {cls.__name__}. Received: "
                                f"name={name!r}")
    cls.cases[name] = QueryCase(factory, records, xla)
    return factory

  # ---- pytest integration: one test per case (and graph mode) -------------------------------

  def pytest_generate_tests(self, metafunc):
    """pytest hook (called for a test class's methods): parametrizes `case_name` and `mode`."""
    if "case_name" not in metafunc.fixturenames:
      return
    if "mode" in metafunc.fixturenames:
      pairs = [(n, m) for n in sorted(self.cases) for m in GRAPH_MODES
               if m != "xla" or self.cases[n].xla]
      metafunc.parametrize("case_name,mode", pairs, ids=[f"{n}-{m}" for n, m in pairs])
    else:
      metafunc.parametrize("case_name", sorted(self.cases))

  def check_all(self):
    """Runs every check on every case without pytest.

    Returns:
      the list of (check, case, mode) run.

    Raises:
      AssertionError: the first check that fails.
    """
    done = []
    for name in sorted(self.cases):
      for mode in GRAPH_MODES:
        if mode != "xla" or self.cases[name].xla:
          self.test_graph_and_xla_match_eager(name, mode)
          done.append(("test_graph_and_xla_match_eager", name, mode))
      for check in ("test_merged_halves_equal_the_whole_sample",
                    "test_record_by_record_equals_batched", "test_serialization_round_trip",
                    "test_events_are_ledger_events_in_sum_units"):
        getattr(self, check)(name)
        done.append((check, name, None))
    return done

  # ---- the contract ---------------------------------------------------------------------------

  def test_graph_and_xla_match_eager(self, case_name, mode):
    """The same sample, same seed: eager, `tf.function` and XLA give the same result.

    The two graph forms are the two ways the library traces a query: "function" converts it
    with AutoGraph (a plain `tf.function`, as the federated server's aggregation), "xla"
    compiles it without AutoGraph conversion (as the Keras DP step, `autograph=False`).
    """
    factory, records, _ = self.cases[case_name]
    eager = _eager_cycle(self, case_name)
    xla = mode == "xla"
    traced = tf.function(_cycle, jit_compile=xla, autograph=not xla)(factory(), records)
    # XLA may fuse the float32 arithmetic differently.
    _assert_close(eager[0], traced[0], f"{case_name} {mode}: result", rtol=1e-4, atol=1e-4)
    _assert_close(eager[1], traced[1], f"{case_name} {mode}: global state", rtol=1e-4,
                  atol=1e-4)
    assert len(eager[2]) == len(traced[2]), f"{case_name} {mode}: a different number of events"

  def test_merged_halves_equal_the_whole_sample(self, case_name):
    """merge_sample_states(first half, second half) == the whole sample's state."""
    factory, records, _ = self.cases[case_name]
    query, n = factory(), _rows(records)
    whole = _sample_state(query, records, list(range(n)))
    merged = query.merge_sample_states(_sample_state(query, records, list(range(n // 2))),
                                       _sample_state(query, records, list(range(n // 2, n))))
    _assert_close(whole, merged, f"{case_name}: merged halves")

  def test_record_by_record_equals_batched(self, case_name):
    """accumulate_record one by one == accumulate_records on the batch."""
    factory, records, _ = self.cases[case_name]
    query, rows = factory(), list(range(_rows(records)))
    _assert_close(_sample_state(query, records, rows, batched=True),
                  _sample_state(query, records, rows, batched=False),
                  f"{case_name}: record by record")

  def test_serialization_round_trip(self, case_name):
    """serialize -> JSON -> deserialize gives the same class, config and (seeded) result."""
    factory, records, _ = self.cases[case_name]
    query = factory()
    assert isinstance(query, dp_query.DPQuery), f"{case_name}: {query!r} is not a DPQuery"
    config = json.loads(json.dumps(serialization.serialize(query)))
    rebuilt = serialization.deserialize(config)
    assert type(rebuilt) is type(query), f"{case_name}: rebuilt as {type(rebuilt).__name__}"
    assert serialization.serialize(rebuilt) == config, f"{case_name}: config changed"
    _assert_close(_eager_cycle(self, case_name)[0], _cycle(rebuilt, records)[0],
                  f"{case_name}: rebuilt query's result")

  def test_events_are_ledger_events_in_sum_units(self, case_name):
    """The events of a sample are privacy events the ledger records, in sum units."""
    from tf_dpiter.ledger import PrivacyLedger  # pylint: disable=g-import-not-at-top
    records = self.cases[case_name].records
    _, _, events = _eager_cycle(self, case_name)
    assert events and all(events_lib.is_event(e) or correlated_events.is_correlated_event(e)
                          for e in events), f"{case_name}: not privacy events: {events!r}"
    for e in events:
      if isinstance(e, events_lib.GaussianSumEvent):
        assert float(e.l2_norm_clip) >= 0 and 0 <= float(e.stddev) < np.inf, (case_name, e)
      elif isinstance(e, events_lib.LaplaceSumEvent):
        assert float(e.l1_norm_clip) > 0 and float(e.scale) > 0, (case_name, e)
      elif correlated_events.is_correlated_event(e):
        assert float(e.l2_norm_clip) > 0 and 0 < float(e.stddev) < np.inf, (case_name, e)
    # A correlated-noise event needs the sampling it was designed for (cyclic Poisson with
    # b >= its bands, or shuffling): record the sample under it.
    policy, size = _ledger_requirement(events)
    ledger = PrivacyLedger()
    ledger.record_sample(100, 0.04, events, policy=policy, sample_size=size or _rows(records))
    assert int(ledger.query_count) == len(events), f"{case_name}: the ledger dropped events"
