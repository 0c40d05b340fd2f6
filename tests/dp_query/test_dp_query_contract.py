"""The DPQuery contract (`tf_dpiter.dp_query.testing.DPQueryContract`), run by every query of
tf_dpiter.dp_query and by `QueryWithLedger`.

The contract's checks live in the importable base class, so that users run the same checks on
their own queries; this module registers one case per query and fails when an exported query
class has no case.
"""

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter.dp_query.testing import DPQueryContract
from tf_dpiter.dp_query.testing import QueryCase
from tf_dpiter.ledger import QueryWithLedger

# Nightly tier (-m slow): each query's graph-and-XLA check runs by default in one
# mode, tf.function or XLA, alternating by name (both modes stay in the default suite); the
# other mode nightly.
SLOW_CASES = {
    "test_graph_and_xla_match_eager[automatic_clipping-xla]",
    "test_graph_and_xla_match_eager[band_mf-function]",
    "test_graph_and_xla_match_eager[blt-xla]",
    "test_graph_and_xla_match_eager[gaussian_average-function]",
    "test_graph_and_xla_match_eager[gaussian_from_z-xla]",
    "test_graph_and_xla_match_eager[gaussian_sum-function]",
    "test_graph_and_xla_match_eager[joint_clip-xla]",
    "test_graph_and_xla_match_eager[laplace-function]",
    "test_graph_and_xla_match_eager[nested-xla]",
    "test_graph_and_xla_match_eager[nested_gaussian-function]",
    "test_graph_and_xla_match_eager[no_privacy_average-xla]",
    "test_graph_and_xla_match_eager[no_privacy_sum-function]",
    "test_graph_and_xla_match_eager[normalized-xla]",
    "test_graph_and_xla_match_eager[quantile_adaptive_clip-function]",
    "test_graph_and_xla_match_eager[quantile_estimator-xla]",
    "test_graph_and_xla_match_eager[tree-function]"}

_RNG = np.random.default_rng(7)
_VEC = tf.constant(_RNG.normal(size=(4, 3)).astype(np.float32) * 2)
_PAIR = [tf.constant(_RNG.normal(size=(4, 2)).astype(np.float32)),
         tf.constant(_RNG.normal(size=(4, 3)).astype(np.float32) * 3)]
_DICT = {"a": _PAIR[0], "b": _PAIR[1]}
_SCALARS = tf.constant([0.5, 2.0, 0.1, 3.0], tf.float32)

# name -> (factory of a fresh query (fixed seed), records with a leading batch axis of 4)
_CASES = {
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


class TestDPQueryContract(DPQueryContract):
  """Every query of _CASES runs each check of the contract."""
  cases = {name: QueryCase(factory, records, xla=name not in NOT_XLA)
           for name, (factory, records) in _CASES.items()}


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
  covered = {type(case.factory()).__name__ for case in TestDPQueryContract.cases.values()}
  missing = exported - covered - set(NOT_CASES)
  assert not missing, f"DPQuery classes without a contract case: {sorted(missing)}"


def test_a_user_query_registers_cases_on_its_own_class():
  class TestMine(DPQueryContract):
    pass
  TestMine.register("sum", lambda: dq.GaussianSumQuery(1.0, 0.5, seed=3), _VEC)
  assert set(TestMine.cases) == {"sum"} and DPQueryContract.cases == {}
  done = TestMine().check_all()
  assert {(c, m) for c, _, m in done} >= {("test_graph_and_xla_match_eager", "xla"),
                                         ("test_serialization_round_trip", None)}
  assert len(done) == 6


def test_the_contract_catches_a_query_that_breaks_it():
  class Forgetful(dq.NoPrivacySumQuery):
    """Its merge keeps only the first half: breaks 'merged halves equal the whole'."""
    def merge_sample_states(self, sample_state_1, sample_state_2):
      return sample_state_1

  class TestForgetful(DPQueryContract):
    cases = {"forgetful": QueryCase(Forgetful, _VEC)}
  try:
    TestForgetful().test_merged_halves_equal_the_whole_sample("forgetful")
  except AssertionError as e:
    assert str(e).startswith("forgetful: merged halves differ:")
  else:
    raise AssertionError("the contract accepted a query whose merge drops a half")
