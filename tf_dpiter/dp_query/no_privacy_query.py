"""Queries without privacy: for baselines. Their event makes epsilon infinite."""

import tensorflow as tf

from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import serialization


@serialization.register_query()
class NoPrivacySumQuery(dp_query.SumAggregationDPQuery):
  """Plain sum of records; reports a NonPrivateEvent.

  A record is summed unclipped; the result is the exact sum, with the event NonPrivateEvent().
  """

  def preprocess_record(self, params, record):
    return record

  def get_noised_result(self, sample_state, global_state):
    return sample_state, global_state, (events_lib.NonPrivateEvent(),)


@serialization.register_query()
class NoPrivacyAverageQuery(dp_query.SumAggregationDPQuery):
  """Plain average over the records actually seen; reports a NonPrivateEvent.

  The result is sum / max(count, 1), unclipped."""


  def initial_sample_state(self, template):
    return (dp_query.zeros_like_template(template), tf.constant(0.0))

  def preprocess_record(self, params, record):
    return (record, tf.constant(1.0))

  def get_noised_result(self, sample_state, global_state):
    total, count = sample_state
    safe = tf.maximum(count, 1.0)
    avg = tf.nest.map_structure(lambda v: v / tf.cast(safe, v.dtype), total)
    return avg, global_state, (events_lib.NonPrivateEvent(),)
