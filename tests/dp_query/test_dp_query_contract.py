"""The DPQuery contract, run by every query of tf_dpiter.dp_query.

A query must give the same sample the same result eagerly, in `tf.function` and under XLA
(same seed, so the same noise); its sample states must merge (two halves of a sample merged
equal the whole sample); record-by-record and batched accumulation must agree; it must survive
a JSON round trip of its config (the rebuilt query, with the same seed, gives the same result);
and it must report privacy events in sum units that the ledger accepts.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.ledger import correlated_records
from tf_dpiter.ledger import PrivacyLedger
from tf_dpiter.ledger import QueryWithLedger

_RNG = np.random.default_rng(7)
_VEC = tf.constant(_RNG.normal(size=(4, 3)).astype(np.float32) * 2)
_PAIR = [tf.constant(_RNG.normal(size=(4, 2)).astype(np.float32)),
         tf.constant(_RNG.normal(size=(4, 3)).astype(np.float32) * 3)]
_DICT = {"a": _PAIR[0], "b": _PAIR[1]}
_SCALARS = tf.constant([0.5, 2.0, 0.1, 3.0], tf.float32)

# name -> (factory of a fresh query (fixed seed), records with a leading batch axis of 4)
CASES = {
    "gaussian_sum": (lambda: dq.GaussianSumQuery(1.0, 0.7, seed=1), _VEC),
    "gaussian_from_z": (lambda: dq.GaussianSumQuery.from_noise_multiplier(1.5, 0.4, seed=2),
                        _VEC),
    "automatic_clipping": (lambda: dq.AutomaticClippingSumQuery(1.0, 0.7, 0.05, seed=16), _VEC),
    "gaussian_average": (lambda: dq.GaussianAverageQuery(1.0, 0.7, 4.0, seed=3), _VEC),
    "normalized": (lambda: dq.NormalizedQuery(dq.GaussianSumQuery(2.0, 0.3, seed=4), 2.0),
                   _VEC),
    "joint_clip": (lambda: dq.JointClipQuery([1.0, 2.0], 1.5, 0.5, seed=5), _PAIR),
    "laplace": (lambda: dq.LaplaceSumQuery(1.0, 0.5, seed=6), _VEC),
    "nested": (lambda: dq.NestedQuery({"a": dq.GaussianSumQuery(1.0, 0.5, seed=7),
                                       "b": dq.LaplaceSumQuery(2.0, 1.0, seed=8)}), _DICT),
    "nested_gaussian": (lambda: dq.make_nested_gaussian_query(_DICT, 2.0, 0.8, seed=9), _DICT),
    "no_privacy_sum": (dq.NoPrivacySumQuery, _VEC),
    "no_privacy_average": (dq.NoPrivacyAverageQuery, _VEC),
    "quantile_estimator": (lambda: dq.QuantileEstimatorQuery(1.0, 0.5, 0.2, 1.0, 4.0, seed=10),
                           _SCALARS),
    "quantile_adaptive_clip": (lambda: dq.QuantileAdaptiveClipSumQuery(
        1.0, 1.0, 0.5, 0.2, 2.0, 4.0, seed=11), _VEC),
    "band_mf": (lambda: dq.BandMFQuery(1.0, 0.8, tf.TensorSpec([3]), num_bands=2, num_steps=4, seed=12),
                _VEC),
    "blt": (lambda: dq.BLTQuery(1.0, 0.8, tf.TensorSpec([3]), num_steps=4, num_buffers=2, seed=13), _VEC),
    "query_with_ledger": (lambda: QueryWithLedger(dq.GaussianSumQuery(1.0, 0.7, seed=15), 100,
                                                  0.04), _VEC),
    "tree": (lambda: dq.TreeAggregationQuery(1.0, 0.8, tf.TensorSpec([3]), restart_every=4, seed=14), _VEC),
}

# Queries whose get_noised_result is a graph op but not an XLA op, by design: the ledger's
# buffers grow, so its write runs outside the compiled step (the Keras DP step compiles the
# clipped sum and appends to the ledger right after it).
NOT_XLA = {"query_with_ledger"}

# Every DPQuery class the package exports must have a case above, or be named here with the
# reason it cannot run the contract on its own (a query added without either fails
# test_every_exported_query_has_a_case).
NOT_CASES = {
    "DPQuery": "abstract base class",
    "SumAggregationDPQuery": "abstract base class",
    "CorrelatedNoiseQuery": "abstract base of band_mf, blt and tree",
}


def test_every_exported_query_has_a_case():
  exported = {n for n in dir(dq) if isinstance(getattr(dq, n), type)
              and issubclass(getattr(dq, n), dq.DPQuery)}
  covered = {type(factory()).__name__ for factory, _ in CASES.values()}
  missing = exported - covered - set(NOT_CASES)
  assert not missing, f"DPQuery classes without a contract case: {sorted(missing)}"


def _template(records):
  return tf.nest.map_structure(lambda r: tf.TensorSpec(r.shape[1:], r.dtype), records)


def _row(records, i):
  return tf.nest.map_structure(lambda r: r[i], records)


def _sample_state(query, records, rows, batched=True):
  g = query.initial_global_state()
  params = query.derive_sample_params(g)
  state = query.initial_sample_state(_template(records))
  if batched:
    part = tf.nest.map_structure(lambda r: tf.gather(r, rows), records)
    return query.accumulate_records(params, state, part)
  for i in rows:
    state = query.accumulate_record(params, state, _row(records, i))
  return state


def _cycle(query, records):
  """One whole sample: (result, new global state, events)."""
  g = query.initial_global_state()
  state = _sample_state(query, records, list(range(4)))
  return query.get_noised_result(state, g)


def _numpy(nest):
  return [np.asarray(x) for x in tf.nest.flatten(nest)]


def _assert_close(a, b, rtol=1e-5, atol=1e-5):
  fa, fb = _numpy(a), _numpy(b)
  assert len(fa) == len(fb)
  for x, y in zip(fa, fb):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.fixture(params=sorted(CASES))
def case(request):
  return CASES[request.param]


@pytest.mark.parametrize("name,mode", [(n, m) for n in sorted(CASES) for m in ("function", "xla")
                                       if not (m == "xla" and n in NOT_XLA)])
def test_graph_and_xla_match_eager(name, mode):
  factory, records = CASES[name]
  eager = _cycle(factory(), records)
  graph = tf.function(_cycle, jit_compile=(mode == "xla"))
  traced = graph(factory(), records)
  # Same seed, same noise; XLA may fuse the float32 arithmetic differently.
  _assert_close(eager[0], traced[0], rtol=1e-4, atol=1e-4)
  _assert_close(eager[1], traced[1], rtol=1e-4, atol=1e-4)
  assert len(eager[2]) == len(traced[2])


class TestDPQueryContract:
  """Every query of CASES runs each of these checks."""

  def test_merged_halves_equal_the_whole_sample(self, case):
    factory, records = case
    query = factory()
    whole = _sample_state(query, records, [0, 1, 2, 3])
    merged = query.merge_sample_states(_sample_state(query, records, [0, 1]),
                                       _sample_state(query, records, [2, 3]))
    _assert_close(whole, merged)

  def test_record_by_record_equals_batched(self, case):
    factory, records = case
    query = factory()
    _assert_close(_sample_state(query, records, [0, 1, 2, 3], batched=True),
                  _sample_state(query, records, [0, 1, 2, 3], batched=False))

  def test_serialization_round_trip(self, case):
    factory, records = case
    config = json.loads(json.dumps(dq.serialize(factory())))
    rebuilt = dq.deserialize(config)
    assert type(rebuilt) is type(factory())
    assert dq.serialize(rebuilt) == config
    _assert_close(_cycle(factory(), records)[0], _cycle(rebuilt, records)[0])

  def test_events_are_ledger_events_in_sum_units(self, case):
    factory, records = case
    _, _, events = _cycle(factory(), records)
    assert events and all(events_lib.is_event(e) or correlated_events.is_correlated_event(e)
                          for e in events)
    for e in events:
      if isinstance(e, events_lib.GaussianSumEvent):
        assert float(e.l2_norm_clip) >= 0 and 0 <= float(e.stddev) < np.inf
      elif isinstance(e, events_lib.LaplaceSumEvent):
        assert float(e.l1_norm_clip) > 0 and float(e.scale) > 0
      elif correlated_events.is_correlated_event(e):
        assert float(e.l2_norm_clip) > 0 and 0 < float(e.stddev) < np.inf
    # The events a sample reports are the ones the ledger can record, under the sampling a
    # correlated-noise event requires (cyclic Poisson with b >= its bands, or shuffle).
    policy, size = "poisson", 0
    for e in events:
      if correlated_events.is_correlated_event(e):
        required, least = correlated_records.correlated_requirement(e)
        policy, size = required or policy, max(size, least)
    ledger = PrivacyLedger()
    ledger.record_sample(100, 0.04, events, policy=policy, sample_size=size or 4)
    assert int(ledger.query_count) == len(events)
