"""Average queries: a sum query divided by a fixed expected denominator.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures", footnote 1: the estimator f_i divides by the *expected* sample size qn, never by the realized |R| (which would leak the sample size). The division
is post-processing, so the privacy events are those of the numerator.
"""

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import serialization


@serialization.register_query()
class NormalizedQuery(dp_query.SumAggregationDPQuery):
  """numerator_query's noised sum divided by a fixed `denominator` (e.g. q n).

  Post-processing: the events are the numerator's (module docstring).

  Args:
    numerator_query: a SumAggregationDPQuery.
    denominator: > 0, the public expected sample size.

  Raises:
    ParameterTypeError: numerator_query is not a SumAggregationDPQuery.
    PrivacyConfigError: denominator missing or <= 0.
  """

  def __init__(self, numerator_query, denominator):
    validation.check_instance("numerator_query", numerator_query,
                              dp_query.SumAggregationDPQuery, "a SumAggregationDPQuery")
    validation.check_params({"denominator": validation.Required(validation.Interval(
        float, 0, None, "neither"), "the expected sample size q*n")}, {"denominator": denominator})
    self._numerator = numerator_query
    self._denominator = denominator

  @property
  def numerator_query(self):
    """The sum query whose noised result is divided (its events are this query's)."""
    return self._numerator

  def get_config(self):
    return {"numerator_query": serialization.serialize(self._numerator),
            "denominator": serialization.plain(self._denominator)}

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    config["numerator_query"] = serialization.deserialize(config["numerator_query"])
    return cls(**config)

  @property
  def denominator(self):
    """The fixed, public denominator (the expected sample size q n)."""
    return self._denominator

  # The numerator's state, params and clipping, unchanged (forwarded).
  initial_global_state = dp_query.forwarded("initial_global_state", "_numerator")
  derive_sample_params = dp_query.forwarded("derive_sample_params", "_numerator")
  initial_sample_state = dp_query.forwarded("initial_sample_state", "_numerator")
  preprocess_record = dp_query.forwarded("preprocess_record", "_numerator")

  def get_noised_result(self, sample_state, global_state):
    noised_sum, new_state, events = self._numerator.get_noised_result(sample_state, global_state)
    return (tf.nest.map_structure(lambda v: tf.truediv(v, tf.cast(self._denominator, v.dtype)),
                                  noised_sum), new_state, events)

  def derive_metrics(self, global_state):
    return self._numerator.derive_metrics(global_state)


@serialization.register_query()
class GaussianAverageQuery(NormalizedQuery):
  """(sum of records clipped to S + N(0, sum_stddev^2)) / denominator.

  Args:
    l2_norm_clip: S.
    sum_stddev: sigma of the sum (= z S).
    denominator: q n > 0.
    seed: fixes the noise (tests only: not private).

  Raises:
    PrivacyConfigError: see GaussianSumQuery and NormalizedQuery.
  """

  def __init__(self, l2_norm_clip, sum_stddev, denominator, seed=None):
    super().__init__(gaussian_query.GaussianSumQuery(l2_norm_clip, sum_stddev, seed=seed),
                     denominator)

  def get_config(self):
    num = self._numerator.get_config()
    return {"l2_norm_clip": num["l2_norm_clip"], "sum_stddev": num["stddev"],
            "denominator": serialization.plain(self._denominator), "seed": num["seed"]}

  @classmethod
  def from_config(cls, config):
    return cls(**config)
