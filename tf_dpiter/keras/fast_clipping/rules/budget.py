"""Memory budget of the rules' per-example work, shared by the convolution and sequence rules.

Book-keeping (Bu et al., "Differentially private optimization on large model at small cost",
Sec. 3) keeps each layer's output gradient until the clip factors are known; what a rule adds
beyond that must not grow with the batch. Two bounds:

  CHUNK_BYTES: a per-example form (per-example gradients, [T, T] Gram matrices, weighted
      copies of the inputs and output gradients for the clipped sum) runs over chunks of the
      batch whose temporaries take at most this many bytes, one chunk at a time (`over_chunks`
      for per-record values, `sum_over_chunks` for a clipped sum); the whole batch is one call
      when it fits one chunk.
  KEEP_BYTES: per-record gradients are kept for the clipped sum sum_j c_j g_j (which saves
      the book-keeping product) while they take no more than the layer input and output
      gradient that this sum no longer reads, or while the batch's take at most this many
      bytes (`keep_choice`); beyond, the norms alone are kept and the clipped sum is one
      whole-batch product of the clip-weighted output gradients, chunk by chunk.

When the trace knows the batch, every choice is made at trace time (no tf.cond). With an
unknown batch (fit's Poisson samples) the chunked loop runs over however many chunks the batch
has, and the keep choice is a run-time tf.cond; under XLA with an unknown batch the batch is
one call and the choice is the caller's default (XLA compiles one static batch; a loop over
chunks of a batch the trace does not know cannot be compiled). Bounds on an unknown batch
settle chunk choices at trace time, so that the trace builds no form that cannot run: in each
branch of the run-time keep choice (at most the largest batch it keeps: no chunk loop where
that fits a chunk; else more: no one-call form where that exceeds a chunk), and under a
caller's public bound (keras/internals/runtime.examples_at_most), which settles one call (or
keeping) up to BOUND_FACTOR times a form's limit (`settled_one_call`).
"""

import contextlib
import threading

import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.internals import runtime as routing  # XLA context (not the optimizer)
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry

# Bytes of one chunk's temporaries, and of the per-record gradients kept for the clipped sum
# (8 MiB each: the convolution rule's budget, rules/conv.py).
CHUNK_BYTES = 8 << 20
KEEP_BYTES = 8 << 20
# Bytes of the tensors book-keeping keeps for the whole batch until the clip factors are known
# (every ghost layer's output gradient and input, the vectorized layers' per-example
# gradients): beyond it, clipping.py forms the clipped sum over physical chunks of the batch.
# 64 MiB: a batch of 64 of the LSTM language model (412 KB per example) or of the Transformer
# encoder is one call.
KEPT_BYTES = 64 << 20

# Under a caller's public bound R on a batch the trace does not know (runtime.examples_at_most:
# fit's Poisson steps, R = 2 (E + 4 sd) of the plan's expected batch E,
# ledger/policy_base.public_row_bound), a form allowed up to L examples at once (one call, or
# kept per-record gradients) is chosen for every batch when R <= BOUND_FACTOR L
# (`settled_one_call`): its memory then stays within BOUND_FACTOR times the budget at the
# public bound, and the step has no run-time tf.cond on the private batch size. The
# tutorial CNN's fit at B = 256 (R = 640), oneDNN on, no XLA: 27.0 -> 22.5 CPU ms per DP
# step, DP / non-private 1.99 -> 1.71 (benchmarks/compare_revisions.py, 2 rounds, load
# 10-11, 2026-12-01), and 24.2 -> 21.5, 1.90 -> 1.54 (3 rounds, load 9-10); at B = 1,024
# (R = 2,304) 106.8 -> 81.1 (1 round, load 11-12).
# 4: R / E is 2.5 at B = 256, so a form the expected batch takes in one call is one call.
BOUND_FACTOR = 4

# Attribute of keep_choice's run-time choice (a scalar bool tensor): the largest batch, in
# examples, it keeps the per-record gradients for (a Python int). by_keep reads it.
_KEPT_BATCH_MAX = "_dp_kept_batch_max"

# Inside a branch of by_keep's run-time choice: (lo, hi), the batch has at least lo and at most
# hi examples (hi None: no upper bound), per thread (a replica's trace runs in its thread).
_BATCH_RANGE = threading.local()


@contextlib.contextmanager
def _batch_range(lo, hi):
  """Within the block the layer's batch has lo <= B <= hi examples (hi None: unbounded)."""
  outer = getattr(_BATCH_RANGE, "range", None)
  _BATCH_RANGE.range = (lo, hi)
  try:
    yield
  finally:
    _BATCH_RANGE.range = outer


def _fits_one_chunk(tensors, m):
  """Whether the batch of `tensors` ([B, ...]) is one call for chunks of m examples: True or
  False where the trace decides (m None, B static, or bounds on B settle B <= m: the enclosing
  by_keep branch's, the caller's runtime.examples_at_most), else None (a run-time tf.cond)."""
  if m is None:
    return True
  static_b = tensors[0].shape[0]
  if static_b is not None:
    return static_b <= m
  if settled_one_call(m):
    return True
  lo = (getattr(_BATCH_RANGE, "range", None) or (0, None))[0]
  if lo > m:
    return False
  return None


def batch_most():
  """The most examples a layer's batch the trace does not know can hold, where bounds settle
  it: the enclosing by_keep branch's range and the caller's public bound
  (runtime.examples_at_most, enforced at run time: a larger batch fails its step); None
  without either. A choice between a one-call form and chunks (or keeping the per-record
  gradients) that this bound settles is made at trace time: the run-time tf.cond would take
  the same branch for every batch within it, and the graph then holds no loop or branch
  that cannot run (each costs the executor at every step: the tutorial CNN's step at B = 8
  ran 14 conds and 30 while loops).

  Returns:
    an int, or None.
  """
  hi = (getattr(_BATCH_RANGE, "range", None) or (0, None))[1]
  public = routing.examples_bound()
  if public is not None:
    hi = public if hi is None else min(hi, public)
  return hi


def settled_one_call(limit, fast=None):
  """Whether every batch the bounds allow (`batch_most`) takes, at trace time, the form a
  budget allows up to `limit` examples at once (one call on the batch, or its per-record
  gradients kept): the most examples M <= limit (and <= `fast`); or, under a caller's public
  bound R (runtime.examples_bound), R <= BOUND_FACTOR limit and R / 2 <= fast (R / 2 = E +
  4 sd: a larger batch has probability below 1e-4 per step, so a speed limit is checked
  there; the memory at R stays within BOUND_FACTOR times the budget). A function of public
  values only: the batch size never picks a branch.

  Args:
    limit: the most examples the form's memory budget allows at once (a Python int).
    fast: the most examples the form runs at its best speed in one call (a Python int), or
      None for no such limit.

  Returns:
    bool (False without bounds: the caller's run-time choice).
  """
  most = batch_most()
  if most is None:
    return False
  if most <= limit and (fast is None or most <= fast):
    return True
  public = routing.examples_bound()
  return (public is not None and most <= BOUND_FACTOR * limit and
          (fast is None or most <= 2 * fast))


def kept_chunk(kept_bytes, k):
  """Examples per physical chunk of the clipped sum: the largest power of two m with
  m kept_bytes <= KEPT_BYTES (at least 8), rounded down to whole records of k examples (at
  least one record).

  Args:
    kept_bytes: bytes book-keeping keeps per example until the clip factors are known (a
      Python int).
    k: examples per record (a Python int).

  Returns:
    int, a multiple of k.

  Raises:
    ParameterValueError: `kept_bytes` is not > 0 (no chunk size follows from it).
  """
  if not kept_bytes > 0:
    raise ParameterValueError(
        f"`kept_bytes` must be > 0. Received: kept_bytes={kept_bytes!r}")
  m = 8
  while m * 2 * kept_bytes <= KEPT_BYTES:
    m *= 2
  return max(k, m // k * k)


def chunk_size(temp_bytes, k, cap=1 << 30):
  """Examples per chunk: the largest power of two whose temporaries fit CHUNK_BYTES.

  m = 2^j with m temp_bytes <= CHUNK_BYTES (at least 8, at most cap), rounded down to whole
  records of k examples (at least one record).

  Args:
    temp_bytes: bytes of the form's temporaries per example (a Python int).
    k: examples per record (a Python int).
    cap: at most this many examples per chunk.

  Returns:
    int, a multiple of k.
  """
  m = 8
  while m * 2 <= cap and m * 2 * temp_bytes <= CHUNK_BYTES:
    m *= 2
  return max(k, m // k * k)


def balanced_chunk(b, m, k):
  """Examples per chunk when a batch of b examples is split into n = ceil(b / m) chunks of at
  most m: the smallest multiple of k that covers b in n chunks, k ceil(ceil(b / k) / n), so
  the last chunk is padded with fewer than n k zero examples (chunks of exactly m would pad up
  to m - 1: a Poisson batch of 257 in chunks of 128 computed 384 examples).

  Args:
    b: examples in the batch (a Python int, or a scalar int32 tensor).
    m: at most this many examples per chunk (a Python int, a multiple of k).
    k: examples per record (a Python int).

  Returns:
    (n, chunk): chunks and examples per chunk, Python ints when b is one, else int32 tensors.
  """
  n = (b + m - 1) // m
  if isinstance(b, int):
    n = max(n, 1)
  else:
    n = tf.maximum(n, 1)
  records = (b + k - 1) // k
  return n, (records + n - 1) // n * k


def examples_per_chunk(batch_tensor, temp_bytes, cap=1 << 30):
  """chunk_size for the current record size, or None where the batch is one call: a record
  size the trace does not know, or XLA with a batch the trace does not know.

  Args:
    batch_tensor: a [B, ...] tensor of the layer (its static batch decides).
    temp_bytes: bytes of the form's temporaries per example.
    cap: at most this many examples per chunk.

  Returns:
    int or None.
  """
  k = algebra.current_examples_per_record()
  if not isinstance(k, int):
    return None
  if batch_tensor.shape[0] is None and routing.in_xla_context():
    return None
  return chunk_size(temp_bytes, k, cap)


def chunk_rows(batch_tensor, m, t):
  """Rows of one product of `sum_over_chunks` over chunks of m examples of t positions:
  min(B, m) t (B t when m is None), B the examples a norm bound counts
  (algebra.sum_examples: an add/remove step's public plan's); the rounding of a record's
  terms in the clipped sum accumulates over at most these rows (algebra.with_sum_rounding).

  Args:
    batch_tensor: a [B, ...] tensor of the layer.
    m: examples per chunk (a Python int) or None.
    t: positions per example (a Python int).

  Returns:
    a Python int when B is static or planned or m bounds it, else a float32 scalar tensor.
  """
  b = algebra.sum_examples(batch_tensor)
  if isinstance(b, int):
    return (b if m is None else min(b, m)) * t
  return (b if m is None else tf.minimum(b, float(m))) * t


def _pad_rows(t, rows):
  return tf.pad(t, [[0, rows]] + [[0, 0]] * (t.shape.rank - 1))


def _chunk_of(t, i, m):
  """Rows [i m, (i + 1) m) of t, padded with zero rows to m (static shape [m, ...])."""
  c = t[i * m:(i + 1) * m]
  c = _pad_rows(c, m - tf.shape(c)[0])
  c.set_shape([m] + t.shape[1:].as_list())
  return c


def _split(tensors, m):
  """(n, chunk_fn(i) -> tuple of chunks, rows per chunk) of [B, ...] tensors in chunks of at
  most m rows: with a batch the trace knows, n = ceil(B / m) chunks of one size
  (balanced_chunk: the last padded with fewer than n k zero examples), a free reshape when
  nothing is padded; else chunks of m, the last padded to m."""
  static_b = tensors[0].shape[0]
  if static_b is not None:
    n, mc = balanced_chunk(static_b, m, algebra.current_examples_per_record())
    split = [tf.reshape(_pad_rows(t, n * mc - static_b) if n * mc > static_b else t,
                        [n, mc] + t.shape[1:].as_list()) for t in tensors]
    return n, lambda i: tuple(s[i] for s in split), mc
  b = tf.shape(tensors[0])[0]
  n = (b + m - 1) // m
  return n, lambda i: tuple(_chunk_of(t, i, m) for t in tensors), m


def over_chunks(body, tensors, m, out_specs):
  """Per-record values of the batch formed one chunk of m examples at a time.

  body(*chunks) -> (values [m / k], *extras [m / k, ...]) for chunks [m, ...] of `tensors`;
  on the whole batch when m is None or the trace knows B <= m, else one chunk at a time
  (tf.map_fn, one iteration alive at once; chunks of one size, balanced_chunk, with a batch
  the trace knows; the last chunk padded with zero examples whose rows are cut off). With an unknown batch, a tf.cond runs a batch that fits one chunk as one
  call (the loop's machinery cost the Transformer's DP step about 10 % at B = 64).

  Args:
    body: the per-chunk function.
    tensors: a tuple of [B, ...] tensors (B a multiple of the record size k).
    m: examples per chunk (a multiple of k), or None for one call on the batch.
    out_specs: tf.TensorSpec of each of body's outputs for one chunk (first: [m / k]; their
      leading size is set to the chunk's records).

  Returns:
    a tuple (values [B / k], *extras [R, ...]) with R >= B / k rows (the padded chunks'), the
    batch's rows first.
  """
  one_call = _fits_one_chunk(tensors, m)
  if one_call:
    return tuple(body(*tensors))
  k = algebra.current_examples_per_record()
  b = tf.shape(tensors[0])[0]

  def chunked():
    n, chunk, mc = _split(tensors, m)
    specs = [tf.TensorSpec([mc // k] + s.shape[1:].as_list(), s.dtype) for s in out_specs]
    out = tf.map_fn(lambda i: tuple(body(*chunk(i))), tf.range(n), parallel_iterations=1,
                    fn_output_signature=tuple(specs))
    flat = tuple(tf.reshape(o, [-1] + o.shape[2:].as_list()) for o in out)
    return (flat[0][:b // k],) + flat[1:]

  if one_call is False:
    return chunked()
  return tf.cond(b <= m, lambda: tuple(body(*tensors)), chunked)


def sum_over_chunks(body, tensors, m, like):
  """sum over chunks of body(*chunks) (a list of float32 tensors of fixed shapes): on the
  whole batch when m is None or the trace knows B <= m, else one chunk of m examples at a
  time in a tf.while_loop (one iteration alive at once; the padded rows of the last chunk are
  zero examples, and must add nothing: their clip factor is 0).

  Args:
    body: chunks -> list of float32 tensors.
    tensors: a tuple of [B, ...] tensors, the clip factors among them.
    m: examples per chunk, or None.
    like: list of the shapes of body's outputs (static).

  Returns:
    list of float32 tensors.
  """
  one_call = _fits_one_chunk(tensors, m)
  if one_call:
    return list(body(*tensors))

  def chunked():
    n, chunk, _ = _split(tensors, m)

    def step(i, acc):
      return i + 1, [a + s for a, s in zip(acc, body(*chunk(i)))]

    acc0 = [tf.zeros(s, tf.float32) for s in like]
    _, acc = tf.while_loop(lambda i, _: i < n, step, (tf.constant(0), acc0),
                           parallel_iterations=1)
    return acc

  if one_call is False:
    return chunked()
  return tf.cond(tf.shape(tensors[0])[0] <= m, lambda: list(body(*tensors)), chunked)


def records_per_pinned_chunk(record_bytes, cap=1 << 30, budget_bytes=None):
  """Records per chunk of `pinned_sum_over_records`: the largest power of two r with
  r record_bytes <= `budget_bytes` (CHUNK_BYTES by default; at least 1, at most the power of
  two at or above cap).

  Args:
    record_bytes: bytes of one record's temporaries in the chunk (its float32 gradient and
      its rows of the weighted operands), a Python int.
    cap: the records there are (a Python int >= 1): no chunk beyond the power of two that
      holds them.
    budget_bytes: the chunk's budget (a Python int), None: CHUNK_BYTES.

  Returns:
    a power of two (a Python int).
  """
  budget_bytes = CHUNK_BYTES if budget_bytes is None else budget_bytes
  r = 1
  while r < cap and r * 2 * record_bytes <= budget_bytes:
    r *= 2
  return r


def pinned_sum_over_records(body, tensors, k, records, width):
  """sum_j of the records' rows body(*chunk) [r, width] (each row one record's float32 term)
  over the batch of `tensors` ([B, ...], B a multiple of k), in a pinned order: the batch in
  chunks of `records` records (a power of two; the last chunk padded with zero examples,
  whose rows body must make exactly 0), each chunk's rows by summation.pairwise_sum, the
  chunks' sums by the pinned tree of summation.tree_push in a tf.while_loop (one chunk alive
  at a time; a batch of one chunk: one call). Every record's term goes through
  ceil(log2 R) additions for R records, a node of level l holding at most 2^l records: the
  plan of summation.rounding_margin with blocks of one record (the tree over the chunks'
  sums continues the chunks' own trees: ceil(log2 r) + ceil(log2 ceil(R / r)) =
  ceil(log2 R) for r a power of two).

  Args:
    body: (*chunks) -> [r, width] float32, the records' terms of a chunk of r k examples.
    tensors: a tuple of [B, ...] tensors (the clip factors among them, zero on padding).
    k: examples per record (a Python int).
    records: records per chunk (a power of two, a Python int).
    width: the terms' entries (a Python int).

  Returns:
    [width] float32.
  """
  m = records * k
  static_b = tensors[0].shape[0]
  if static_b is not None and static_b <= m:
    return summation.pairwise_sum(body(*tensors))

  if static_b is not None:   # XLA: static slices of the batch padded to whole chunks
    n = -(-int(static_b) // m)
    split = [tf.reshape(_pad_rows(t, n * m - static_b) if n * m > static_b else t,
                        [n, m] + t.shape[1:].as_list()) for t in tensors]
    chunk_of = lambda i: [tf.gather(t, i) for t in split]
  else:   # each chunk sliced from the batch and padded alone: no copy of the batch
    def chunk_of(i):
      parts = [t[i * m:(i + 1) * m] for t in tensors]
      parts = [_pad_rows(p, m - tf.shape(p)[0]) for p in parts]
      for p, like in zip(parts, tensors):
        p.set_shape([m] + like.shape[1:].as_list())
      return parts

  def chunk(i):
    return summation.pairwise_sum(body(*chunk_of(i)))

  def chunked():
    if static_b is not None:
      stack = tf.zeros([summation.tree_depth(n) + 1, width], tf.float32)
      count = tf.constant(n)
    else:
      count = (tf.shape(tensors[0])[0] + m - 1) // m
      # ceil(log2 n) + 1 slots: the bit length of n - 1, plus one
      bits = tf.range(1, 32)
      levels = tf.reduce_sum(tf.cast(tf.bitwise.left_shift(1, bits - 1) <= count - 1,
                                     tf.int32)) + 1
      stack = tf.zeros(tf.stack([levels, width]), tf.float32)

    def step(i, stack):
      return i + 1, summation.tree_push(stack, i, chunk(i))

    _, stack = tf.while_loop(lambda i, _: i < count, step, (tf.constant(0), stack),
                             parallel_iterations=1)
    return summation.tree_total(stack, count)

  if static_b is not None:
    return chunked()
  one_call = _fits_one_chunk(tensors, m)
  if one_call is not None:   # bounds settle it (batch_most)
    return summation.pairwise_sum(body(*tensors)) if one_call else chunked()
  return tf.cond(tf.shape(tensors[0])[0] <= m,
                 lambda: summation.pairwise_sum(body(*tensors)), chunked)


def pinned_kept_sum(record_c, g):
  """sum_j c_j g_j over kept per-record gradients g [R, P] (R >= records: padded rows beyond
  the factors add nothing) by summation.pairwise_sum of the weighted rows (a row with c_j = 0
  exactly 0 even where it is not finite): one term per record, the plan of
  `pinned_sum_over_records` (blocks of one record), so either branch of a run-time keep
  choice runs the plan reported.

  Args:
    record_c: [B / k] float32 record factors.
    g: [R, P] float32 per-record gradients.

  Returns:
    [P] float32.
  """
  c = _factors_of_rows(record_c, g)
  return summation.pairwise_sum(algebra.weight_rows(g, c))


def planned_keep(record_bytes, budget_bytes):
  """Within an add/remove step's public plan, whether per-record gradients of `record_bytes`
  each are kept: when the plan's examples per call (algebra.public_examples) take at most
  BOUND_FACTOR budget_bytes (as `settled_one_call` settles a choice by a public bound), the
  same on neighbouring datasets. A choice by the batch's own size made the norms exact
  (kept) on one dataset and the not-kept form's upper bounds on the other, which differ for
  every record: one example added to 128 records of a Dense whose positions nearly cancel
  moved the clipped sum by 114.5 C (review R22,
  tests/fast_clipping/test_fast_clipping_review_r22.py).

  Args:
    record_bytes: bytes of one record's gradient (a Python int).
    budget_bytes: the budget of the kept gradients (KEEP_BYTES, or a rule's multiple of it).

  Returns:
    a Python bool, or None outside a public plan (replace-one: the same rows on both
    datasets) or with records of a size the trace does not know.
  """
  most, k = algebra.public_examples(), algebra.current_examples_per_record()
  if most is None or not isinstance(k, int):
    return None
  return most // k * record_bytes <= BOUND_FACTOR * budget_bytes


def keep_choice(batch_tensor, record_bytes, allowed, operand_bytes=0):
  """Whether the per-record gradients (record_bytes each) are kept for the clipped sum.

  They are kept when the rule allows it and either they take no more than the operands of the
  book-keeping product they replace (operand_bytes per record: the layer's input and output
  gradient, which the sum from the kept gradients no longer reads, so keeping adds nothing
  that grows with the batch), or the batch's take at most KEEP_BYTES.

  Args:
    batch_tensor: a [B, ...] tensor of the layer.
    record_bytes: bytes of one record's gradient (a Python int).
    allowed: the rule would keep them without a budget (a Python bool).
    operand_bytes: bytes per record of the operands of the book-keeping product (a Python
      int; 0 when the rule does not count them).

  Returns:
    a Python bool when the trace decides (not allowed; record_bytes <= operand_bytes; XLA with
    an unknown batch: allowed; an add/remove step's public plan: `planned_keep`; a batch the
    trace knows: B / k record_bytes <= KEEP_BYTES),
    else a scalar bool tensor (B / k record_bytes <= KEEP_BYTES at run time, compared as
    floor(B / k) <= floor(KEEP_BYTES / record_bytes), which cannot overflow int32), carrying
    the largest batch it keeps for: (floor(KEEP_BYTES / record_bytes) + 1) k - 1 (by_keep).
  """
  if not allowed:
    return False
  if record_bytes <= operand_bytes:
    return True
  k = algebra.current_examples_per_record()
  static_b = batch_tensor.shape[0]
  if not isinstance(k, int) or (static_b is None and routing.in_xla_context()):
    return True
  planned = planned_keep(record_bytes, KEEP_BYTES)
  if planned is not None:
    return planned
  if static_b is not None:
    return static_b // k * record_bytes <= KEEP_BYTES
  records_kept = min(KEEP_BYTES // record_bytes, 2**31 - 1)   # an int32 constant
  if settled_one_call((records_kept + 1) * k - 1):   # every batch within the bounds keeps
    return True
  keep = tf.shape(batch_tensor)[0] // k <= records_kept
  setattr(keep, _KEPT_BATCH_MAX, (records_kept + 1) * k - 1)
  return keep


def by_keep(keep, kept_fn, other_fn):
  """kept_fn() where the per-record gradients are kept, else other_fn(): chosen at trace time
  for a Python bool `keep`, by a run-time tf.cond for a scalar bool tensor (keep_choice with a
  batch the trace does not know). For keep_choice's tensor, each branch is traced knowing the
  batch range it runs for (B <= the largest batch kept, else more), so that over_chunks and
  sum_over_chunks on that batch build only the form that can run there; the branches must
  chunk only tensors of the batch keep_choice measured.

  Args:
    keep: a Python bool or a scalar bool tensor (keep_choice).
    kept_fn: the form that uses the kept gradients (no arguments).
    other_fn: the form without them (no arguments); under a tf.cond its results must match
      kept_fn's in structure and dtype.

  Returns:
    what the chosen function returns.
  """
  if keep is True:
    return kept_fn()
  if keep is False:
    return other_fn()
  kept_max = getattr(keep, _KEPT_BATCH_MAX, None)
  if kept_max is None:
    return tf.cond(keep, kept_fn, other_fn)

  def in_range(fn, lo, hi):
    def run():
      with _batch_range(lo, hi):
        return fn()
    return run

  return tf.cond(keep, in_range(kept_fn, 0, kept_max), in_range(other_fn, kept_max + 1, None))


def record_factors(example_factors, k=None):
  """[B] clip factors of each example's record -> [B / k] factors of the records.

  Args:
    example_factors: [B] float32, each example's record's factor.
    k: the records' examples (None: the enclosing algebra.examples_per_record's).

  Returns:
    [B / k] float32.
  """
  if k is None:
    k = algebra.current_examples_per_record()
  if isinstance(k, int) and k == 1:
    return example_factors
  return tf.reshape(example_factors, [-1, k])[:, 0]


def kept_sum(record_c, g):
  """sum_j c_j g_j over kept per-record gradients g [R, P] (R >= records: padded rows
  beyond the factors add nothing), a row with c_j = 0 adding exactly 0 even where it is not
  finite: [P] float32.

  Args:
    record_c: [B / k] float32 record factors.
    g: [R, P] float32 per-record gradients.

  Returns:
    [P] float32.
  """
  c = _factors_of_rows(record_c, g)
  return algebra.factor_product(c, algebra.drop_rows(g, c))


def _factors_of_rows(record_c, g):
  """The record factors padded with zeros to g's rows (R >= records; as given when equal:
  no shape ops)."""
  rows, records = g.shape[0], record_c.shape[0]
  if rows is not None and records is not None and int(rows) == int(records):
    return record_c
  return tf.pad(record_c, [[0, tf.shape(g)[0] - tf.shape(record_c)[0]]])


def factored_sqr_norms(a, b, keep_allowed=None, with_one=False, sum_rows=None):
  """Per-record ||sum_t a_t b_t^T||_F^2 for a [B, T, K], b [B, T, N] within the budget.

  Forms (Li et al., "Large language models can be strong differentially private learners",
  Sec. 4): direct g_j = a_j^T b_j (cost T K N per example), Gram sum_{t,s} <a_t, a_s>
  <b_t, b_s> (cost T^2 (K + N)). The per-record gradients are kept (direct form) where
  keep_choice says so; else the cheaper form gives the norms alone (registry.form_override
  forces "gram" or "direct"). Every form runs over chunks (over_chunks); T = 1 or sizes the
  trace does not know: algebra.factored_sqr_norm on the batch. Where the clipped sum is not
  formed from kept gradients (the norms alone), the direct form's norms are upper bounds
  covering the rounding of the record's terms in its per-record product and in the clipped
  sum's product (algebra.with_sum_rounding); the sum from kept gradients reuses the g whose
  norm was taken and needs no bound.

  Args:
    a: [B, T, K] layer inputs.
    b: [B, T, N] output gradients.
    keep_allowed: per-record gradients may be kept (a Python bool), or None for the rules'
      default: when registry.keep_per_example(K N), or when the direct form is the cheaper
      and K N <= registry.MAX_DIRECT_PER_EXAMPLE_ENTRIES (its sum from the kept gradients
      then saves the book-keeping product of the same cost).
    with_one: a gets a last column of ones (a Dense layer's bias as the weight of an input
      1): in the Gram form as 1 added to a's Gram matrix (algebra.gram_sqr_norm), in the
      direct form appended chunk by chunk (no [B, T, K + 1] copy of the batch).
    sum_rows: rows of the product that forms the clipped sum when no gradient is kept (a
      Python int or a float32 scalar tensor); None: the batch's B T (what a product over
      the whole batch, or the two-pass variant's backward pass, sums).

  Returns:
    (sqr_norms [B / k] float32, keep, g): keep a Python bool or a scalar bool tensor, g the
    kept [R, K N] per-record gradients (R >= B / k rows, the records' first) or None when keep
    is False (an unused [0, K N] where keep is a tensor and false at run time).
  """
  t, kk, n = (algebra.static_dim(a, 1), algebra.static_dim(a, 2), algebra.static_dim(b, 2))
  one = algebra.with_ones_column if with_one else (lambda x: x)
  if sum_rows is None:
    sum_rows = algebra.batch_rows(a)
  if t == 1 or None in (t, kk, n):
    sq, g = algebra.factored_sqr_norm(one(tf.cast(a, tf.float32)), b, sums_from_g=True,
                                      sum_rows=sum_rows)
    if g is None:
      return sq, False, None
    return sq, True, tf.reshape(g, [tf.shape(g)[0], -1])
  kk += int(with_one)
  k = algebra.current_examples_per_record()
  override = registry.form_override()
  cheap = override if override in ("gram", "direct") else (
      "gram" if t * t * (kk + n) < t * kk * n else "direct")
  if keep_allowed is None:
    keep_allowed = override != "gram" and (
        registry.keep_per_example(kk * n) or
        (cheap == "direct" and kk * n <= registry.MAX_DIRECT_PER_EXAMPLE_ENTRIES))
  keep = keep_choice(a, kk * n * 4, keep_allowed,
                     4 * t * (kk + n) * (k if isinstance(k, int) else 1))
  a = tf.cast(a, tf.float32)
  b = tf.cast(b, tf.float32)

  def pass_of(form, with_g):
    per_example = 4 * (2 * t * (kk + n) + (3 * t * t * (k if isinstance(k, int) else 1)
                                            if form == "gram" else 2 * kk * n))
    m = examples_per_chunk(a, per_example)
    rec = m // k if m is not None else None

    def body(ac, bc):
      bc = algebra.regroup_btk(bc)
      if form == "gram":   # the ones column in the Gram matrix: no copy of a (gram_sqr_norm)
        return (algebra.gram_sqr_norm(algebra.regroup_btk(ac), bc, with_one, sum_rows),)
      ar = algebra.regroup_btk(ac)
      g = algebra.reshape(tf.einsum("btk,btn->bkn", algebra.regroup_btk(one(ac)), bc),
                          [-1, kk * n])
      sq = algebra.record_sqr_sums(g)
      if with_g:   # the clipped sum from this g: no bound
        return sq, g
      return (algebra.with_sum_rounding(
          sq, algebra.position_norms(ar, with_one), algebra.position_norms(bc),
          algebra.static_or_shape(bc, 1) + sum_rows + 1, kk + n),)

    specs = [tf.TensorSpec([rec], tf.float32)]
    if with_g:
      specs.append(tf.TensorSpec([rec, kk * n], tf.float32))
    return over_chunks(body, (a, b), m, specs)

  # the unused [0, K N] only where the choice is a run-time tf.cond (its branches must match)
  sq, g = by_keep(keep, lambda: pass_of("direct", True),
                  lambda: (pass_of(cheap, False)[0], None if keep is False else
                           tf.zeros([0, kk * n], tf.float32)))
  return sq, keep, None if keep is False else g
