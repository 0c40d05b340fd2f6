"""Per-record gradients, vectorized over the batch (McMahan et al. 2018, Table 1: record, sample).

A *record* is one example (num_microbatches=None) or one microbatch: example i of a batch of
B goes to microbatch i mod M (ceil(B/M) or floor(B/M) examples each, no reshape needed). The
record's gradient is that of the mean loss over its examples; all records' gradients come
from one traced computation (`tf.vectorized_map`), optionally in physical chunks.

Why the i mod M dealing is sound: microbatches are offered only under replace-one sampling
("shuffle", "fixed_size"), where an example's position comes from the public permutation (or
draw) of indices. Replacing one example keeps every position, so only its microbatch changes:
its clipped mean moves by <= 2C (the ledger records 2C). Under add/remove (Poisson) removing
an example would re-deal every later example, so microbatches are refused there. Padding
rows (mask 0) keep their positions too.

The record cut also owns the record's masks and weights (`example_mask_from_weights`,
`record_weights`, `masked_record_mean`), used by both clipping paths and `record_losses`.
"""

import keras
import tensorflow as tf

from tf_dpiter.errors import DPiterError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import runtime


def _ceil_div(a, b):
  return (a + b - 1) // b


def static_batch_size(nest):
  """Leading dimension of the first non-None leaf of `nest` if known statically, else None.

  Raises:
    ParameterValueError: the nest holds no tensor.
  """
  leaves = [t for t in tf.nest.flatten(nest) if t is not None]
  if not leaves:
    raise ParameterValueError("the batch holds no tensor")
  return tf.TensorShape(leaves[0].shape)[0]


def dynamic_batch_size(nest):
  """Leading dimension of the first non-None leaf of `nest`, a scalar int32 tensor."""
  leaves = [t for t in tf.nest.flatten(nest) if t is not None]
  return tf.shape(leaves[0])[0]


def check_num_microbatches(num_microbatches, batch_size):
  """Refuses more microbatches than the examples of a batch of static size (None: no check).

  Raises:
    PrivacyConfigError: num_microbatches > batch_size.
  """
  if num_microbatches is None:
    return
  if batch_size is not None and num_microbatches > batch_size:
    raise PrivacyConfigError(
        f"num_microbatches={num_microbatches} is more than the {batch_size} examples of the "
        "batch: each microbatch needs at least one example")


def record_weights(example_mask, sample_weight):
  """Keras sample weights of a record's k examples (a nest like `sample_weight`, else
  example_mask's shape).

  w = m * k / sum(m) * sample_weight, with m the record's example mask [..., k]: the
  mean-reduced compiled loss over the record's examples then averages its real examples only
  (padding examples of a microbatch, and examples removed by a zero weight, get weight 0)."""
  em = tf.cast(example_mask, tf.float32)
  k = em.shape[-1]   # a size the trace knows: a constant, no shape ops
  k = tf.cast(tf.shape(em)[-1], tf.float32) if k is None else float(k)
  w = em * (k / tf.maximum(tf.reduce_sum(em, -1, keepdims=True), 1.0))
  if sample_weight is None:
    return w

  def weigh(t):
    t = tf.cast(t, tf.float32)
    extra = len(t.shape) - len(w.shape)
    if w.shape[1:].is_fully_defined():   # w [R, k] beside trailing axes of 1
      return tf.reshape(w, [-1] + w.shape[1:].as_list() + [1] * extra) * t
    return tf.reshape(w, tf.concat([tf.shape(w), tf.ones([extra], tf.int32)], 0)) * t

  return tf.nest.map_structure(weigh, sample_weight)


def masked_record_mean(values, example_mask):
  """The mean of each record's values over its real examples, [..., k] -> [...]:
  sum_j m_j v_j / max(sum_j m_j, 1), with m the example mask; 0 for a record with none."""
  em = tf.cast(example_mask, values.dtype)
  return tf.reduce_sum(values * em, -1) / tf.maximum(tf.reduce_sum(em, -1), 1.0)


def example_mask_from_weights(sample_weight, batch_size):
  """[B] float32 0/1: 1 for examples with a positive weight somewhere (any output, any token);
  all ones when `sample_weight` is None."""
  if sample_weight is None:
    return tf.ones([batch_size], tf.float32)
  flags = [tf.reduce_any(tf.reshape(tf.cast(t, tf.float32), [batch_size, -1]) > 0, axis=1)
           for t in tf.nest.flatten(sample_weight)]
  any_positive = flags[0]
  for f in flags[1:]:
    any_positive = tf.logical_or(any_positive, f)
  return tf.cast(any_positive, tf.float32)


def to_records(nest, example_mask, num_microbatches):
  """Splits a batch into records of k examples: leaves [B, ...] -> [M, k, ...].

  Returns (records, example_mask [M, k], record_mask [M]). record_mask is 1 for records
  holding at least one real example. num_microbatches None gives M = B, k = 1.
  """
  if num_microbatches is None:
    recs = tf.nest.map_structure(lambda t: None if t is None else tf.expand_dims(t, 1), nest)
    em = tf.expand_dims(example_mask, 1)
    return recs, em, example_mask
  b = dynamic_batch_size((nest, example_mask))
  m = num_microbatches
  k = _ceil_div(b, m)
  pad = m * k - b

  def split(t):
    if t is None:
      return None
    t = tf.convert_to_tensor(t)
    rank = len(t.shape)
    t = tf.pad(t, [[0, pad]] + [[0, 0]] * (rank - 1))
    t = tf.reshape(t, tf.concat([[k, m], tf.shape(t)[1:]], 0))
    return tf.transpose(t, [1, 0] + list(range(2, rank + 1)))

  recs = tf.nest.map_structure(split, nest)
  em = split(example_mask)
  record_mask = tf.cast(tf.reduce_sum(em, axis=1) > 0, example_mask.dtype)
  return recs, em, record_mask


def consecutive_records(nest, example_mask, k):
  """Records of k consecutive rows (user-level batches, data.user_sampling): leaves
  [B, ...] -> [B / k, k, ...]; returns (records, example_mask [B / k, k], record_mask).

  Raises:
    ParameterValueError: a static batch size that is not a multiple of k.
  """
  b = static_batch_size((nest, example_mask))
  if b is not None and b % k:
    raise ParameterValueError(f"a user-level batch of {b} rows is not whole users of "
                              f"max_examples_per_user={k} rows")

  def split(t):
    if t is None:
      return None
    t = tf.convert_to_tensor(t)
    return tf.reshape(t, tf.concat([[-1, k], tf.shape(t)[1:]], 0))

  recs = tf.nest.map_structure(split, nest)
  em = split(example_mask)
  return recs, em, tf.cast(tf.reduce_sum(em, axis=1) > 0, example_mask.dtype)


def examples_per_record(num_microbatches, batch_size_static, record_example_mask):
  """k of to_records' [M, k] layout: 1 per example, ceil(B / M) per microbatch (a Python
  int when B is static, else a scalar tensor read off record_example_mask [M, k])."""
  if num_microbatches is None:
    return 1
  if batch_size_static is not None:
    return -(-batch_size_static // num_microbatches)
  return tf.shape(record_example_mask)[1]


def from_records(t, batch_size, num_microbatches):
  """Inverse of to_records for one leaf: [M, k, ...] -> [B, ...], in the batch's example order."""
  tail = t.shape[2:]
  shape = [-1] + tail.as_list() if tail.is_fully_defined() else tf.concat(
      [[-1], tf.shape(t)[2:]], 0)
  if num_microbatches is None:
    return tf.reshape(t, shape)
  rank = len(t.shape)
  t = tf.transpose(t, [1, 0] + list(range(2, rank)))
  return tf.reshape(t, shape)[:batch_size]


@tf.autograph.experimental.do_not_convert   # no tensor-dependent Python control flow
def per_record_gradients(record_loss_fn, variables, records, vectorize=True):
  """Vectorized gradients of record_loss_fn(record) w.r.t. variables, one per record.

  record_loss_fn(record) -> (scalar loss, aux nest). Returns (grads: list of [M, *v.shape],
  losses [M], aux stacked on a leading [M] axis). Sparse (IndexedSlices) gradients are
  densified per record; unconnected variables get zeros. A record loss running
  keras.ops.scan (runtime.loops_over_lists) is looped over record by record (pfor converts
  it wrongly at run time); under XLA it is refused (PrivacyConfigError).
  """
  flat = tf.nest.flatten(records)
  present = [i for i, t in enumerate(flat) if t is not None]
  list_loops = []   # the while loops over a TensorList `one` found (pfor's trace rewraps errors)
  # the backend variables (keras_internals.gradient_sources' rule, spelled here: the step's
  # walk stays in this file): an unread Keras 3 variable fails the ZERO unconnected gradient
  sources = [v.value if isinstance(v, keras.Variable) else v for v in variables]

  def one(tensors, check_loops=False):
    leaves = [None] * len(flat)
    for i, t in zip(present, tensors):
      leaves[i] = t
    rec = tf.nest.pack_sequence_as(records, leaves)
    first = tf.compat.v1.get_default_graph().version
    with tf.GradientTape() as tape:
      loss, aux = record_loss_fn(rec)
    # runtime.loops_over_lists, spelled here: the step's walk stays in this file
    created = tf.compat.v1.get_default_graph().get_operations()[first:] if check_loops else ()
    loops = [op.name for op in created if op.type in ("While", "StatelessWhile") and
             any(t.dtype == tf.variant for t in op.inputs)]
    if loops:
      list_loops.extend(loops)
      raise runtime.ListLoop(f"while loops over a TensorList: {list(loops)}")
    grads = tape.gradient(loss, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads = [tf.convert_to_tensor(g) for g in grads]
    return grads, loss, aux

  elems = [flat[i] for i in present]
  if any(isinstance(t, tf.RaggedTensor) for t in elems):
    vectorize = False   # pfor cannot batch ragged rows (RaggedTensorFromVariant): a loop
  if vectorize:
    try:
      return tf.vectorized_map(lambda t: one(t, check_loops=True), elems,
                               fallback_to_while_loop=True)
    except (runtime.ListLoop, TypeError, ValueError, NotImplementedError,
            tf.errors.OpError) as e:
      if isinstance(e, DPiterError) and not isinstance(e, runtime.ListLoop):
        raise   # the library's refusal (a ValueError too) is not pfor failing: never a loop
      # pfor cannot vectorize some graphs (RNN while_loops): the same by a sequential loop
      runtime.refuse_list_loops_under_xla(list_loops)
      _warn_fallback(e)
  probe = one([t[0] for t in elems])
  sig = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), probe)
  return tf.map_fn(one, elems, fn_output_signature=sig)


_WARNED = []


def _warn_fallback(err):
  if not _WARNED:
    _WARNED.append(True)
    import warnings  # pylint: disable=g-import-not-at-top
    warnings.warn(
        "per-example gradients could not be vectorized (tf.vectorized_map failed: "
        f"{type(err).__name__}); falling back to a sequential loop over records, which is "
        "slower. For RNN layers, unroll=True keeps the vectorized path.", RuntimeWarning)


def jacobian_record_gradients(tape, record_losses, variables, use_pfor=True):
  """Per-record gradients of a vector of record losses [M] via a batched jacobian (pfor, or
  a while loop over records with use_pfor=False: routing.use_vectorized_map)."""
  jac = tape.jacobian(record_losses, variables,
                      unconnected_gradients=tf.UnconnectedGradients.ZERO,
                      experimental_use_pfor=use_pfor)
  return [tf.convert_to_tensor(j) for j in jac]


def chunked(records, record_mask, records_per_chunk, min_chunks=0):
  """Pads the record axis to a multiple of records_per_chunk and adds a chunk axis.

  min_chunks: at least this many chunks (padding records only past the batch): a loop body
  that indexes chunk i must compile (XLA) even when the batch has no record.

  Returns (chunks: leaves [C, R, ...], chunk_masks [C, R], num_chunks).
  """
  m = tf.shape(record_mask)[0]
  c = tf.maximum(_ceil_div(m, records_per_chunk), min_chunks)
  pad = c * records_per_chunk - m

  def split(t):
    if t is None:
      return None
    rank = len(t.shape)
    t = tf.pad(t, [[0, pad]] + [[0, 0]] * (rank - 1))
    return tf.reshape(t, tf.concat([[c, records_per_chunk], tf.shape(t)[1:]], 0))

  return tf.nest.map_structure(split, records), split(record_mask), c


def one_or_nan(ok, message):
  """1.0, or NaN behind a failed run-time assertion carrying `message` (a list of strings and
  tensors): graph mode refuses the step; XLA drops assertions, so the NaN then spoils the
  release instead of letting the refused input through."""
  check = tf.debugging.Assert(ok, message)
  with tf.control_dependencies([check]):
    return tf.where(ok, tf.constant(1.0), tf.constant(float("nan")))
