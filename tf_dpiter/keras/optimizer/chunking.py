"""Physical chunks of a logical batch, and the dtype of the privacy arithmetic (McMahan et al. 2018, Sec. 7).

A logical batch (one noise draw, one ledger sample) may be processed in physical chunks of
at most `max_physical_batch_size` examples (whole records): the chunks' clipped sums add up
to the batch's, so chunking changes memory, not the mechanism. Both clipping paths run
through `sum_over_chunks`. Under XLA a padded Poisson sample (real records first) is split
by `chunk_layout` so that chunks of padding only are skipped: a padding record adds exactly
0, so the sum is unchanged; shapes stay static. The padded tail's chunk sums are combined
by a pinned binary tree (each through ceil(log2 K) roundings for K chunks, not up to
K - 1: the clip shrink of `summation.rounding_margin` is that much smaller).

The privacy arithmetic (norms, clip factors, the clipped sum, the noise) is done in float32,
or float64 for float64 variables, whatever the Keras dtype policy.
"""

import collections
import contextlib
import math

import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.optimizer import routing


def wide_dtype(dtype):
  """float64 for float64, else float32: the dtype of the privacy arithmetic."""
  return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def wide_template(variables):
  """TensorSpecs of `variables` in the privacy arithmetic's dtype (`wide_dtype`)."""
  return [tf.TensorSpec(v.shape, wide_dtype(v.dtype)) for v in variables]


def unscale_records(grads, scale):
  """(grads, finite): per-record gradients [M, ...] in `wide_dtype`, divided by the static loss
  `scale`, and a bool [M] (None when scale is 1).

  A record whose gradient is not finite (float16 overflow) becomes zero: a function of that
  record alone, whose norm 0 is <= C, so the sensitivity bound holds."""
  grads = [tf.cast(g, wide_dtype(g.dtype)) for g in grads]
  if scale == 1.0:
    return grads, None
  grads = [g / scale for g in grads]
  finite = None
  for g in grads:
    ok = tf.reduce_all(tf.reshape(tf.math.is_finite(g), [tf.shape(g)[0], -1]), axis=1)
    finite = ok if finite is None else tf.logical_and(finite, ok)
  zeroed = [tf.where(tf.reshape(finite, [-1] + [1] * (len(g.shape) - 1)), g, tf.zeros_like(g))
            for g in grads]
  return zeroed, finite


def records_per_chunk(max_physical_batch_size, examples_per_record, num_records_static):
  """max(1, P // k) records per physical chunk (P = `max_physical_batch_size`, k an int or a
  scalar tensor), or None when there is no limit or the whole batch fits in one chunk."""
  p = max_physical_batch_size
  if p is None:
    return None
  k = examples_per_record
  per_chunk = max(1, p // k) if isinstance(k, int) else tf.maximum(1, p // k)
  if num_records_static is not None and isinstance(per_chunk, int) and (
      per_chunk >= num_records_static):
    return None
  return per_chunk


class TailChunks(tuple):
  """Record counts of the consecutive physical chunks of a padded batch: the first chunk
  always runs, every later one only if it holds a real record (`sum_over_chunks`)."""


class PaddedTail(collections.namedtuple("PaddedTail", ["first", "chunk"])):
  """A padded batch as a first chunk of `first` records, always run, then chunks of `chunk`
  records (the last one padded) run in a tf.while_loop up to the last one holding a real
  record (`sum_over_chunks`); the batch's size is known when XLA compiles."""


def chunk_layout(step, examples_per_record, num_records_static, multiple=8, xla=None):
  """How `sum_over_chunks` splits a batch: `records_per_chunk`, or, for a padded sample of a
  random-size policy (Poisson) under XLA, a `PaddedTail` (no physical chunk size) or a
  `TailChunks` (with one, static batch). With E the replica's expected records and
  sd = sqrt(E), the first chunk has max(multiple, ceil(E / multiple) * multiple) records, the
  tail's chunks max(multiple, ceil(sd / 2 / multiple) * multiple): about E + sd / 3 records
  run instead of E + 4 sd (BENCHMARKS.md). The sum is the same whatever the layout. `xla`:
  whether the step is traced for XLA (None: asks the graph). Returns None, an int, a
  TailChunks or a PaddedTail."""
  return _layout(step, examples_per_record, num_records_static, multiple, xla)


def _layout(step, examples_per_record, num_records_static, multiple=8, xla=None):
  """`chunk_layout` (also of the public row bound: `public_rows`)."""
  flags = step.flags
  per_chunk = records_per_chunk(flags.max_physical_batch_size, examples_per_record,
                                num_records_static)
  if (step.sampling is None or not flags.skip_padding_tail
      or not isinstance(examples_per_record, int)
      or not step.expected_size_denominator
      or not (routing.in_xla_context() if xla is None else xla)):
    return per_chunk
  m = None if num_records_static is None else int(num_records_static)
  if per_chunk is not None:
    if m is None:
      return per_chunk
    sizes = [per_chunk] * (m // per_chunk) + ([m % per_chunk] if m % per_chunk else [])
    return TailChunks(sizes) if len(sizes) > 1 else per_chunk
  if getattr(step, "draws_keyed", False):   # keyed random layers: one padded chunk (no draw
    return None   # shared by a chunk's records grouped by position)
  with tf.init_scope():   # read when the step is traced: it sets a shape, not a value
    expected = float(step.expected_records.numpy())
  expected /= tf.distribute.get_strategy().num_replicas_in_sync   # this replica's share
  sd = math.sqrt(max(expected, 0.0))
  first = max(multiple, int(math.ceil(expected / multiple)) * multiple)
  if m is not None and first >= m:
    return None
  return PaddedTail(first, max(multiple, int(math.ceil(sd / 2 / multiple)) * multiple))


def sum_plan(per_chunk, record_mask):
  """(records per chunk, chunks) of the additions `sum_over_chunks` runs for a layout (the
  static plan `summation.rounding_margin` bounds); for a `PaddedTail` of known rows the chunks
  are a `summation.TreeChunks`. Ints where the trace knows them, else scalar tensors; a chunk
  skipped for holding no real record adds 0 (exact), so a padded layout counts its largest."""
  return _plan_of(per_chunk, batch_rows(record_mask))


def batch_rows(record_mask):
  """M, the rows of a [M] record mask: an int where the trace knows it, else a scalar tensor."""
  m = tf.TensorShape(record_mask.shape)[0]
  return tf.shape(record_mask)[0] if m is None else m


def _plan_of(per_chunk, m):
  """`sum_plan` of a layout of m rows (an int or scalar tensor)."""
  if per_chunk is None:
    return m, 1
  if isinstance(per_chunk, TailChunks):
    return max(per_chunk), len(per_chunk)
  if isinstance(per_chunk, PaddedTail):
    records = max(per_chunk.first, per_chunk.chunk)
    if tf.is_tensor(m):   # chunks the trace does not know: added one after the other
      tail = tf.maximum((tf.maximum(m - per_chunk.first, 0) + per_chunk.chunk - 1)
                        // per_chunk.chunk, 1)
      return records, 1 + tail
    tail = max(-(-max(m - per_chunk.first, 0) // per_chunk.chunk), 1)
    # the chunks' sums combined by a pinned tree (`_sum_over_padded_tail`)
    return records, summation.TreeChunks(1 + tail)
  return per_chunk, (m + per_chunk - 1) // per_chunk


def public_row_bound(step):
  """R_P, a public bound on the rows of a replica's batch under an add/remove sampling (None
  under replace-one, or while undeclared): `LedgerSampling.replica_row_bound(P)` for the P
  replicas in sync, R itself for one. Neighbouring datasets have different row counts under
  add/remove unless the batch is padded to a size fixed in advance, so the clip shrink is
  taken from the plan of R_P rows (summation.public_plan), which bounds every batch not
  refused (probability of a refusal at most 1e-18 per replica and step). Read when the step
  is traced: a declaration changing it asks for a retrace; a sample above the bound a step
  was traced with fails that step."""
  rows = None if step.sampling is None else step.sampling.public_row_bound
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if rows is None or replicas == 1:   # R_1 = R
    return rows
  return step.sampling.replica_row_bound(replicas)


@contextlib.contextmanager
def public_rows(step, examples_per_record, chunk=None, xla=None):
  """Within the block, the step's clip shrink (summation.public_shrink) is that of the plan of
  `public_row_bound(step)` rows in the layout `chunk_layout` gives that many (the plan covers
  every smaller batch's layout), so it is the same on neighbouring datasets under
  add/remove; a no-op under replace-one. `chunk`: records per chunk of a layout the caller
  chose from public values, or None. Yields the public row bound in force (this plan's or an
  enclosing block's), or None."""
  bound = public_row_bound(step)
  if bound is None:
    plan = summation.current_public_plan()
    yield None if plan is None else plan[0]
    return
  layout = chunk if chunk is not None else _layout(step, examples_per_record, bound, xla=xla)
  records, chunks = _plan_of(layout, bound)
  with summation.public_plan(bound, records, chunks):
    yield bound


def _slice(nest, start, size):
  end = None if size is None else start + size
  return tf.nest.map_structure(lambda t: None if t is None else t[start:end], nest)


def _unless_empty(chunk_fn, acc, chunk, mask, first_aux):
  """chunk_fn on a chunk, run only if its mask has a real record (else: acc, 0, and zeros
  shaped like the first chunk's aux with this chunk's rows)."""
  rows = tf.shape(mask)[0]

  def run():
    new_acc, loss, aux = chunk_fn(acc, chunk, mask)
    return new_acc, tf.cast(loss, tf.float32), aux

  def skip():
    zeros = lambda t: tf.zeros(tf.concat([[rows], tf.shape(t)[1:]], 0), t.dtype)
    return acc, tf.constant(0.0), tf.nest.map_structure(zeros, first_aux)

  return tf.cond(tf.reduce_any(mask > 0), run, skip)


def _sum_over_tail_chunks(chunk_fn, acc, records, record_mask, sizes):
  loss_sum, auxes, start = tf.constant(0.0), [], 0
  for i, size in enumerate(sizes):
    chunk, mask = _slice(records, start, size), _slice(record_mask, start, size)
    if i == 0:
      acc, loss, aux = chunk_fn(acc, chunk, mask)
    else:
      acc, loss, aux = _unless_empty(chunk_fn, acc, chunk, mask, auxes[0])
    loss_sum = loss_sum + loss
    start += size
    auxes.append(aux)
  return acc, loss_sum, tf.nest.map_structure(lambda *ts: tf.concat(ts, 0), *auxes)


def _take(nest, i):
  return tf.nest.map_structure(lambda t: None if t is None else t[i], nest)


def _tree_levels(nchunks):
  """Levels of `_sum_over_padded_tail`'s tree over K = 1 + nchunks leaves (ceil(log2 K)
  additions, one slot per level); None where neither the trace nor the public plan bounds K."""
  static = tf.get_static_value(nchunks)
  if static is not None:
    return summation.tree_depth(1 + int(static)) + 1
  plan = summation.current_public_plan()   # the rows are checked against its bound
  if plan is not None and isinstance(plan[2], summation.TreeChunks):
    return summation.tree_depth(int(plan[2])) + 1
  return None


def _sum_over_padded_tail(chunk_fn, acc, records, record_mask, layout):
  """The first chunk, then the tail's chunks in a tf.while_loop that stops after the last chunk
  holding a real record; the aux of chunks not run is zeros (padding rows).

  The chunks' sums are combined by a pinned binary tree (`summation.tree_push`): the first
  chunk's sum is leaf 0, every tail chunk is run from a zero accumulator and is the next
  leaf, so each row's term goes through ceil(log2 K) additions for K = 1 + tail chunks
  (`summation.TreeChunks` plan) instead of up to K - 1. Without a static or public bound on K
  the chunks are added one after the other (`_plan_of` states that plan)."""
  acc, loss_sum, aux = chunk_fn(acc, _slice(records, 0, layout.first),
                                record_mask[:layout.first])
  rest_mask = record_mask[layout.first:]
  chunks, cmask, nchunks = grads_lib.chunked(_slice(records, layout.first, None), rest_mask,
                                             layout.chunk, min_chunks=1)
  m = tf.TensorShape(rest_mask.shape)[0]
  if m is not None:   # the trace knows the tail's chunks (tf.shape's arithmetic it does not)
    nchunks_static = max(-(-int(m) // layout.chunk), 1)
    nchunks = tf.constant(nchunks_static)
  holds_real = tf.cast(tf.reduce_any(cmask > 0, axis=1), tf.int32)
  runs = tf.reduce_max(tf.concat([[0], holds_real * tf.range(1, nchunks + 1)], 0))
  buf = tf.nest.map_structure(
      lambda t: tf.zeros(tf.concat([[nchunks, layout.chunk], tf.shape(t)[1:]], 0), t.dtype), aux)
  levels = _tree_levels(nchunks)

  if levels is None:
    def body(i, acc, loss_sum, buf):
      acc, loss, chunk_aux = chunk_fn(acc, _take(chunks, i), cmask[i])
      buf = tf.nest.map_structure(
          lambda b, t: tf.tensor_scatter_nd_update(b, [[i]], t[None]), buf, chunk_aux)
      return i + 1, acc, loss_sum + tf.cast(loss, tf.float32), buf

    _, acc, loss_sum, buf = tf.while_loop(
        lambda i, *_: i < runs, body, [tf.constant(0), acc, tf.cast(loss_sum, tf.float32), buf])
  else:
    zero = tf.nest.map_structure(tf.zeros_like, acc)
    stack = tf.nest.map_structure(
        lambda t: tf.tensor_scatter_nd_update(
            tf.zeros(tf.concat([[levels], tf.shape(t)], 0), t.dtype), [[0]], t[None]), acc)

    def tree_body(i, stack, loss_sum, buf):
      own, loss, chunk_aux = chunk_fn(zero, _take(chunks, i), cmask[i])
      stack = summation.tree_push(stack, i + 1, own)   # leaf i + 1: the first chunk is leaf 0
      buf = tf.nest.map_structure(
          lambda b, t: tf.tensor_scatter_nd_update(b, [[i]], t[None]), buf, chunk_aux)
      return i + 1, stack, loss_sum + tf.cast(loss, tf.float32), buf

    _, stack, loss_sum, buf = tf.while_loop(
        lambda i, *_: i < runs, tree_body,
        [tf.constant(0), stack, tf.cast(loss_sum, tf.float32), buf])
    acc = summation.tree_total(stack, runs + 1)
  rows = tf.shape(rest_mask)[0]
  tail = tf.nest.map_structure(
      lambda b: tf.reshape(b, tf.concat([[-1], tf.shape(b)[2:]], 0))[:rows], buf)
  return acc, loss_sum, tf.nest.map_structure(lambda h, t: tf.concat([h, t], 0), aux, tail)


@tf.autograph.experimental.do_not_convert   # no tensor-dependent Python control flow
def sum_over_chunks(chunk_fn, acc, records, record_mask, per_chunk, template=None):
  """Runs chunk_fn over the physical chunks of a batch of records, accumulating.

  With acc=None the first chunk's result is the accumulator (no zeros made); only a dynamic
  number of chunks (a tf.while_loop) starts from zeros shaped like `template`.

  Args:
    chunk_fn: (acc, records_chunk, record_mask_chunk) -> (acc, loss_sum, aux), aux a nest of
      tensors with the chunk's records on the leading axis; acc may be None (first chunk).
    acc: the initial accumulator (a nest of tensors), or None.
    records: nest of [M, ...] tensors (None leaves allowed).
    record_mask: [M] float, 0 for padding records.
    per_chunk: records per chunk (`records_per_chunk`), None for one chunk, or a TailChunks
      (`chunk_layout`).
    template: with acc=None, a nest of `tf.TensorSpec`s shaped like the accumulator.

  Returns:
    (acc, loss_sum, aux): aux concatenated over chunks (may hold padding records past M), or
    None when the number of chunks is dynamic.

  Raises:
    ParameterValueError: acc=None without `template` and a dynamic number of chunks.
  """
  within = summation.within_public_rows(batch_rows(record_mask))   # an add/remove step's bound
  records, record_mask = summation.after_row_check(within, (records, record_mask))
  if per_chunk is None:
    out = chunk_fn(acc, records, record_mask)
  else:
    # a clipped sum formed per chunk charges the chunks' additions (summation.rounding_margin)
    with summation.sequential_chunks(*reversed(sum_plan(per_chunk, record_mask))):
      out = _sum_over_chunks(chunk_fn, acc, records, record_mask, per_chunk, template)
  if within is True or not summation.in_xla_context():
    return out
  # XLA drops the assertion: past the bound the sums are NaN (no finite update)
  nan = tf.where(within, 1.0, float("nan"))
  return (tf.nest.map_structure(lambda a: a * tf.cast(nan, a.dtype), out[0]), *out[1:])


def _sum_over_chunks(chunk_fn, acc, records, record_mask, per_chunk, template):
  """`sum_over_chunks` of more than one chunk."""
  if isinstance(per_chunk, PaddedTail):
    return _sum_over_padded_tail(chunk_fn, acc, records, record_mask, per_chunk)
  if isinstance(per_chunk, TailChunks):
    return _sum_over_tail_chunks(chunk_fn, acc, records, record_mask, per_chunk)
  chunks, cmask, nchunks = grads_lib.chunked(records, record_mask, per_chunk)
  static_chunks = tf.get_static_value(nchunks)
  loss_sum = tf.constant(0.0)
  if static_chunks is not None:
    # unrolled; each chunk waits for the sums before it, so chunks do not run at once
    auxes = []
    for i in range(int(static_chunks)):
      chunk = _take(chunks, i)
      if acc is not None:
        with tf.control_dependencies(tf.nest.flatten(acc)):
          chunk = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), chunk)
      acc, loss, aux = chunk_fn(acc, chunk, cmask[i])
      loss_sum = loss_sum + loss
      auxes.append(aux)
    return acc, loss_sum, tf.nest.map_structure(lambda *ts: tf.concat(ts, 0), *auxes)

  def body(i, acc, loss_acc):
    acc, loss, _ = chunk_fn(acc, _take(chunks, i), cmask[i])
    return i + 1, acc, loss_acc + loss

  if acc is None:
    if template is None:
      raise ParameterValueError(
          "sum_over_chunks with acc=None needs `template` when the number of chunks is "
          "dynamic. Received: template=None")
    acc = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), template)
  _, acc, loss_sum = tf.while_loop(lambda i, *_: i < nchunks, body,
                                   [tf.constant(0), acc, loss_sum])
  return acc, loss_sum, None
