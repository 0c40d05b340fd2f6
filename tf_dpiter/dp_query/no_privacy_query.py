"""Queries without privacy: for baselines. Their event makes epsilon infinite."""

import tensorflow as tf

from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import serialization


@serialization.register_query()
class NoPrivacySumQuery(dp_query.SumAggregationDPQuery):
  """Plain sum of records; reports a NonPrivateEvent."""

  def preprocess_record(self, params, record):
    """See `DPQuery.preprocess_record`: the record, unclipped

    Args:
      params: the sample params (`derive_sample_params` of the global state).
      record: one record: a nest of tensors with the structure of the template.
    """
    return record

  def get_noised_result(self, sample_state, global_state):
    """See `DPQuery.get_noised_result`: the exact sum; event NonPrivateEvent()

    Args:
      sample_state: the sample state accumulated over the records of this sample.
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    return sample_state, global_state, (events_lib.NonPrivateEvent(),)


@serialization.register_query()
class NoPrivacyAverageQuery(dp_query.SumAggregationDPQuery):
  """Plain average over the records actually seen; reports a NonPrivateEvent."""

  def initial_sample_state(self, template):
    """See `DPQuery.initial_sample_state`: (zero sum, count 0)

    Args:
      template: a nest of tensors or tf.TensorSpecs with the structure, shapes and dtypes of a
        record.
    """
    return (dp_query.zeros_like_template(template), tf.constant(0.0))

  def preprocess_record(self, params, record):
    """See `DPQuery.preprocess_record`: (record, 1)

    Args:
      params: the sample params (`derive_sample_params` of the global state).
      record: one record: a nest of tensors with the structure of the template.
    """
    return (record, tf.constant(1.0))

  def get_noised_result(self, sample_state, global_state):
    """See `DPQuery.get_noised_result`: the exact mean over the records seen (sum /
    max(count, 1)); event NonPrivateEvent()

    Args:
      sample_state: the sample state accumulated over the records of this sample.
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    total, count = sample_state
    safe = tf.maximum(count, 1.0)
    avg = tf.nest.map_structure(lambda v: v / tf.cast(safe, v.dtype), total)
    return avg, global_state, (events_lib.NonPrivateEvent(),)
