"""DPQuery serialization: get_config/from_config, serialize/deserialize, registration."""

import collections
import json
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.dp_query import serialization
from tf_dpiter.federated import queries as fed_queries


def _vec(n=6, d=3, seed=0):
  return tf.constant(np.random.RandomState(seed).randn(n, d).astype("float32") * 2)


def _pair(n=6, seed=0):
  rng = np.random.RandomState(seed)
  return [tf.constant(rng.randn(n, 3).astype("float32")),
          tf.constant(rng.randn(n, 2, 2).astype("float32"))]


# name -> (query factory, records factory). Every query has a seed so that the noise of the
# original and of the rebuilt query can be compared draw for draw.
CASES = {
    "gaussian": (lambda: dq.GaussianSumQuery(1.5, 0.7, seed=11), _vec),
    "gaussian_inf_clip": (lambda: dq.GaussianSumQuery(math.inf, 0.0, seed=1), _vec),
    "gaussian_tensor_args": (lambda: dq.GaussianSumQuery(tf.constant(1.25), np.float32(0.5),
                                                         seed=np.int64(3)), _vec),
    "gaussian_average": (lambda: dq.GaussianAverageQuery(1.0, 0.8, 12.0, seed=2), _vec),
    "automatic_clipping": (lambda: dq.AutomaticClippingSumQuery(1.5, 0.7, 0.02, seed=12), _vec),
    "normalized": (lambda: dq.NormalizedQuery(dq.LaplaceSumQuery(2.0, 0.5, seed=4), 7), _vec),
    "laplace": (lambda: dq.LaplaceSumQuery(1.0, 0.3, seed=5), _vec),
    "no_privacy_sum": (dq.NoPrivacySumQuery, _vec),
    "no_privacy_average": (dq.NoPrivacyAverageQuery, _vec),
    "joint_clip": (lambda: dq.JointClipQuery([0.5, 2.0], 1.0, 0.4, seed=6), _pair),
    "nested_list": (lambda: dq.NestedQuery([dq.GaussianSumQuery(0.5, 0.3, seed=7),
                                            dq.GaussianAverageQuery(0.7, 0.2, 4.0, seed=8)]),
                    _pair),
    "nested_dict_tuple": (
        lambda: dq.NestedQuery({"w": dq.GaussianSumQuery(0.5, 0.3, seed=9),
                                "b": (dq.LaplaceSumQuery(1.0, 0.5, seed=10),
                                      dq.NoPrivacySumQuery())}),
        lambda: {"w": _vec(), "b": (_vec(d=2, seed=1), _vec(d=1, seed=2))}),
    "nested_gaussian_helper": (
        lambda: dq.make_nested_gaussian_query([tf.TensorSpec([3]), tf.TensorSpec([2, 2])], 1.0,
                                              1.1, clipping="dimension_adjusted", seed=12),
        _pair),
    "quantile_estimator": (lambda: dq.QuantileEstimatorQuery(1.0, 0.6, 0.3, 1.5, 6, seed=13),
                           lambda: tf.constant([0.5, 2.0, 0.1, 3.0, 1.0, 0.9])),
    "adaptive_clip": (lambda: dq.QuantileAdaptiveClipSumQuery(0.8, 1.0, 0.5, 0.2, 2.0, 6,
                                                              geometric_update=False, seed=14),
                      _vec),
    "query_with_ledger": (lambda: ledger_lib.QueryWithLedger(
        dq.GaussianSumQuery(1.0, 0.5, seed=15), 600, 0.01, policy="fixed_size", sample_size=6),
                          _vec),
    "median_clip": (lambda: fed_queries.MedianNormClipSumQuery(0.9, 1.0, seed=16), _vec),
}


def _json_round_trip(query):
  text = json.dumps(dq.serialize(query))   # what model.save writes
  return dq.deserialize(json.loads(text))


def _run(query, records):
  """Two samples through the query: sample params, results, states and events."""
  template = tf.nest.map_structure(lambda r: tf.TensorSpec(r.shape[1:], r.dtype), records)
  g = query.initial_global_state()
  out = [g]
  for _ in range(2):
    p = query.derive_sample_params(g)
    s = query.accumulate_records(p, query.initial_sample_state(template), records)
    result, g, events = query.get_noised_result(s, g)
    out += [p, result, g, events]
  return [np.asarray(x) for x in tf.nest.flatten(out)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_config_and_outputs(name):
  make, records = CASES[name]
  original = make()
  config = dq.serialize(original)
  assert set(config) == {"class_name", "config"}
  json.dumps(config)                                   # plain JSON values only
  rebuilt = _json_round_trip(original)
  assert type(rebuilt) is type(original)
  assert rebuilt.get_config() == original.get_config()
  assert type(rebuilt).from_config(original.get_config()).get_config() == original.get_config()
  want, got = _run(original, records()), _run(rebuilt, records())
  assert len(want) == len(got)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


def test_seed_kept_in_config():
  assert dq.GaussianSumQuery(1.0, 0.5, seed=42).get_config()["seed"] == 42
  assert dq.GaussianSumQuery(1.0, 0.5).get_config()["seed"] is None
  cfg = dq.QuantileAdaptiveClipSumQuery(1.0, 1.0, 0.5, 0.2, 2.0, 10, seed=3).get_config()
  assert cfg["seed"] == 3 and cfg["clipped_count_stddev"] == 2.0


def test_nested_structure_types_survive():
  q = dq.NestedQuery({"a": [dq.NoPrivacySumQuery()], "b": (dq.NoPrivacySumQuery(),)})
  rebuilt = _json_round_trip(q)
  assert isinstance(rebuilt.queries["a"], list) and isinstance(rebuilt.queries["b"], tuple)
  assert isinstance(_json_round_trip(dq.JointClipQuery((1.0, 2.0), 1.0, 0.0))
                    ._scales, tuple)  # pylint: disable=protected-access


def test_unknown_class_name_raises():
  with pytest.raises(ValueError, match=r"'NoSuchQuery'.*register_query"):
    dq.deserialize({"class_name": "NoSuchQuery", "config": {}})
  with pytest.raises(ValueError, match="class_name"):
    dq.deserialize({"config": {}})
  with pytest.raises(ValueError, match="not a DPQuery"):
    dq.deserialize({"class_name": "Dense", "config": {}}, custom_objects={"Dense": dict})


class _Unregistered(dq.GaussianSumQuery):
  pass


def test_unregistered_subclass_refused_at_serialize():
  with pytest.raises(ValueError, match=r"_Unregistered.*register_query"):
    dq.serialize(_Unregistered(1.0, 0.5))


@dq.register_query("test_serialization.ScaledSum")
class ScaledSum(dq.SumAggregationDPQuery):
  """A user's query: a child query whose noised sum is scaled by a factor."""

  def __init__(self, inner, factor):
    self.inner, self.factor = inner, factor

  def initial_global_state(self):
    return self.inner.initial_global_state()

  def derive_sample_params(self, global_state):
    return self.inner.derive_sample_params(global_state)

  def preprocess_record(self, params, record):
    return self.inner.preprocess_record(params, record)

  def get_noised_result(self, sample_state, global_state):
    r, g, e = self.inner.get_noised_result(sample_state, global_state)
    return tf.nest.map_structure(lambda t: t * self.factor, r), g, e

  def get_config(self):
    return {"inner": dq.serialize(self.inner), "factor": self.factor}

  @classmethod
  def from_config(cls, config):
    return cls(dq.deserialize(config["inner"]), config["factor"])


def test_user_registered_subclass_round_trips():
  q = dq.NestedQuery([ScaledSum(dq.GaussianSumQuery(1.0, 0.5, seed=1), 0.25)])
  assert dq.serialize(q)["config"]["queries"][0]["class_name"] == "test_serialization.ScaledSum"
  rebuilt = _json_round_trip(q)
  assert isinstance(rebuilt.queries[0], ScaledSum) and rebuilt.get_config() == q.get_config()
  for a, b in zip(_run(q, [_vec()]), _run(rebuilt, [_vec()])):
    np.testing.assert_array_equal(a, b)


@keras.saving.register_keras_serializable(package="test_serialization")
class KerasRegisteredSum(dq.NoPrivacySumQuery):
  pass


class CustomObjectSum(dq.NoPrivacySumQuery):
  pass


def test_keras_registration_and_custom_objects():
  d = dq.serialize(KerasRegisteredSum())
  assert d["class_name"] == "test_serialization>KerasRegisteredSum"
  assert type(dq.deserialize(d)) is KerasRegisteredSum
  d = {"class_name": "NestedQuery",
       "config": {"queries": [{"class_name": "CustomObjectSum", "config": {}}]}}
  with pytest.raises(ValueError, match="CustomObjectSum"):
    dq.deserialize(d)
  q = dq.deserialize(d, custom_objects={"CustomObjectSum": CustomObjectSum})
  assert type(q.queries[0]) is CustomObjectSum


def test_config_errors():
  class NoConfig(dq.NoPrivacySumQuery):
    def __init__(self, x):
      self.x = x
  with pytest.raises(NotImplementedError, match="NoConfig.get_config"):
    NoConfig(1).get_config()
  with pytest.raises(ValueError, match="namedtuple"):
    serialization.encode_nest(collections.namedtuple("P", "a")(1.0))
  with pytest.raises(ValueError, match="generator"):
    dq.QuantileEstimatorQuery(1.0, 0.5, 0.1, 1.0, 10, generator=dq.make_generator(1)).get_config()
  with pytest.raises(ValueError, match="already registered"):
    dq.register_query("GaussianSumQuery")(_Unregistered)
  with pytest.raises(ValueError, match="DPQuery subclass"):
    dq.register_query()(int)


def test_upper_layer_queries_deserialize_in_a_fresh_process():
  # dp_query names no upper module: the ledger's and federated's queries are found through
  # the modules the package root declares, imported on demand by deserialize.
  configs = [dq.serialize(CASES[name][0]()) for name in ("query_with_ledger", "median_clip")]
  code = ("import json, sys\n"
          "from tf_dpiter.dp_query import deserialize\n"
          "assert 'tf_dpiter.ledger.query_with_ledger' not in sys.modules\n"
          "assert 'tf_dpiter.federated.queries' not in sys.modules\n"
          "queries = [deserialize(c) for c in json.loads(sys.stdin.read())]\n"
          "print(' '.join(type(q).__name__ for q in queries))\n"
          "print(type(queries[0].query).__name__, queries[0].policy)\n")
  out = subprocess.run([sys.executable, "-c", code], input=json.dumps(configs),
                       capture_output=True, text=True, check=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  lines = out.stdout.split("\n")
  assert lines[0] == "QueryWithLedger MedianNormClipSumQuery"
  assert lines[1] == "GaussianSumQuery fixed_size"


def test_lower_layer_names_no_upper_module():
  source = open(serialization.__file__).read()
  assert "tf_dpiter.ledger" not in source and "tf_dpiter.federated" not in source
