"""The clipped sum of per-record gradients (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Sections 2 and 7).

`accumulate` adds the clipped per-record gradients of a chunk to a DPQuery's sample state
sum_i clip(g_i), cast to float32 (float64 for float64 variables) before the norms, the clip
factors and the sum. The vectorized path of `private_step.PrivateStep.clipped_sum` (per-record
gradients under `tf.vectorized_map`, or a sequential loop where routing says so, in physical
chunks) and the custom loops (`custom_loops`) use it.
"""

import tensorflow as tf

from tf_dpiter.keras.optimizer import chunking


# Not converted by AutoGraph (no tensor-dependent Python control flow): converting the
# library's functions made most of a large model's trace time.
@tf.autograph.experimental.do_not_convert
def accumulate(query, params, sample_state, grads, record_mask):
  """Adds the clipped per-record gradients [M, ...] of the real records to sample_state.

  Args:
    query: the DPQuery (its preprocess_record clips). params: its sample params.
    sample_state: the sum so far. grads: per-record gradients, each [M, ...].
    record_mask: [M] weights of the records: 0 for padding, 1 for a real record (or the
      step's `sum_scale`, the sum's denominator folded in: each clipped gradient is added
      times it).

  Returns:
    the new sample state.
  """
  grads = [tf.cast(g, chunking.wide_dtype(g.dtype)) for g in grads]
  if hasattr(query, "accumulate_records"):
    return query.accumulate_records(params, sample_state, grads, mask=record_mask)
  pre = tf.vectorized_map(lambda r: query.preprocess_record(params, r), grads)
  summed = tf.nest.map_structure(
      lambda t: tf.reduce_sum(t * tf.reshape(tf.cast(record_mask, t.dtype),
                                             [-1] + [1] * (len(t.shape) - 1)), 0), pre)
  return query.accumulate_preprocessed_record(sample_state, summed)

