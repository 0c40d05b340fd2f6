"""The clipped sum of per-record gradients (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Sections 2 and 7).

Functions of a `private_step.PrivateStep`: `resolve_clipping` picks the path
(routing.fast_path_obstacle), `vectorized_clipped_sum` forms the DPQuery's sample state
sum_i clip(g_i) over the records of a logical batch on the vectorized path: per-record
gradients under `tf.vectorized_map` (or a sequential loop where routing says so), cast to
float32 before the norms, the clip factors and the sum, in physical chunks
(chunking.sum_over_chunks).
"""

import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.optimizer import routing


def resolve_clipping(step, model=None, input_specs=None):
  """'vectorized' or 'fast': which per-example clipping a step uses.

  "auto" takes the fast (ghost-norm) path only when `routing.fast_path_obstacle` finds
  nothing in the way: among others, every layer must be known to act per example (Keras'
  own per-example layers, or declared with `dp.keras.declare_per_example`; per_example),
  and a batch-independence probe (run once per model and batch size, cached; see
  batch_independence) must see no layer that mixes examples. Otherwise "auto" takes the
  vectorized path, which is exact for any model (each record is run and clipped alone, in
  float32).

  Args:
    step: the PrivateStep (its clipping setting and query decide).
    model: the keras.Model the step trains.
    input_specs: optional nest of tensors/specs shaped like a batch (for the probe of a
      model without known inputs).

  Returns:
    "vectorized" or "fast".

  Raises:
    PrivacyConfigError: clipping="fast" and the fast path cannot clip this model exactly (the
      message names the offending layer, dtype policy or setting).
  """
  if step.clipping == "vectorized":
    return "vectorized"
  reason = routing.fast_path_obstacle(step, model, fast_clipping, input_specs)
  if reason is None:
    return "fast"
  if step.clipping == "fast":
    raise PrivacyConfigError(
        f"clipping='fast' cannot clip this model exactly: {reason}. Use clipping='auto' or "
        "'vectorized' (each record is clipped alone, exact for it)")
  return "vectorized"


def accumulate(query, params, sample_state, grads, record_mask):
  """Adds the clipped per-record gradients [M, ...] of the real records to sample_state.

  Args:
    query: the DPQuery (its preprocess_record clips). params: its sample params.
    sample_state: the sum so far. grads: per-record gradients, each [M, ...].
    record_mask: [M] 0/1, the real records.

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


def vectorized_clipped_sum(step, record_loss_fn, variables, records, record_mask,
                           examples_per_record=1, vectorize=True, loss_scale=1.0):
  """Sample state (clipped sum) over records, vectorized, in physical chunks.

  The per-record gradients are cast to float32 (float64 for float64 variables) before the
  norms, the clip factors and the sum, whatever the dtype policy; with loss_scale s != 1
  (float16), record_loss_fn's loss is s times the record's loss and the gradients are
  divided by s; a record whose gradient overflowed adds zero and is counted in
  `overflowed_records` (chunking.unscale_records).

  Args:
    step: the PrivateStep (query, params, physical chunk size, overflow counter).
    record_loss_fn: record -> (scalar loss, aux nest).
    variables: the trainable variables.
    records: nest of [M, ...] tensors.
    record_mask: [M], 0 for padding records.
    examples_per_record: k (int, or a scalar tensor).
    vectorize: False for a sequential loop over records (routing.use_vectorized_map).
    loss_scale: the static loss scale s.

  Returns:
    (sample_state, sum of record losses over real records, aux stacked [M, ...], or None
    with a dynamic number of chunks).
  """
  query = step.require_query()
  loss_scale = float(loss_scale)
  variables = list(variables)
  params = step.sample_params()

  def chunk_fn(state, rec, mask):
    grads, losses, aux = grads_lib.per_record_gradients(record_loss_fn, variables, rec,
                                                        vectorize)
    grads, finite = chunking.unscale_records(grads, loss_scale)
    with tf.control_dependencies(step.count_overflowed(finite, mask)):
      state = accumulate(query, params, state, grads, mask)
    # a loss without reduction (reduction=None, TF Privacy's idiom) gives each record a
    # vector: its logged value is the record's mean, as Keras reduces it
    rec_losses = tf.reduce_mean(tf.reshape(losses, [tf.shape(mask)[0], -1]), axis=1)
    return state, tf.reduce_sum(rec_losses / loss_scale * tf.cast(mask, rec_losses.dtype)), aux

  record_mask = tf.cast(record_mask, tf.float32)
  m_static = tf.TensorShape(record_mask.shape)[0]
  per_chunk = chunking.chunk_layout(step, examples_per_record, m_static)
  state = query.initial_sample_state(chunking.wide_template(variables))
  state, loss_sum, aux = chunking.sum_over_chunks(chunk_fn, state, records, record_mask,
                                                  per_chunk)
  if aux is not None and per_chunk is not None:
    aux = tf.nest.map_structure(lambda t: t[:m_static], aux)
  return state, loss_sum, aux
