"""Shared algebra of the ghost-norm rules (fast_clipping/rules/).

Per-example (or per-record, see examples_per_record) squared norms of
weight gradients of the form g_i = sum_t a_t b_t^T, formed in float32 whatever
the dtype of a and b (privacy arithmetic in float32).
"""

import contextlib
import threading

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.fast_clipping import registry


# `_Records.most` outside any examples_per_record block (read at each call) and within one
# before `sum_examples` read the public plan (then kept for the block)
_OUTSIDE, _UNREAD = object(), object()


# Records of k consecutive examples (microbatches): set by clipping while the
# norm functions run; B is then a multiple of k and record j holds examples
# j*k, ..., j*k + k - 1. A record's gradient is the sum of its examples'
# contributions, so every per-example quantity is summed over the record
# before squaring, and factored forms merge k into the position axis.
class _Records(threading.local):
  k = 1   # outside any examples_per_record context: a record is one example
  most = _OUTSIDE   # the public bound on a call's examples (`sum_examples`), or None


# The k of the innermost examples_per_record context of this thread: read as
# `RECORDS.k` by the norm functions (current_examples_per_record() is the same).
RECORDS = _Records()


class _ChunkExamples(threading.local):
  most = None   # the examples of every physical chunk's call (`chunk_examples`), or None
  size = None   # the physical chunk's size m in examples (an int), or None


CHUNK_EXAMPLES = _ChunkExamples()


@contextlib.contextmanager
def chunk_examples(m, size=None):
  """Within the block, `sum_examples` counts m examples: min(B, chunk size), of a batch of B
  that clipping runs in physical chunks, as a call of its rows would be counted (a one-call
  batch counts its B), not a chunk's balanced rows, which an added example can lower (33
  examples run as 2 chunks of 17, 32 as one call of 32: the other records' clip factors
  grew); inside a summation.public_plan of R rows and r records per chunk, max(r k,
  min(R k, size)), public (min(B, size) is not: a batch the trace does not know, r < B < size,
  moved the sum by 1.18 C under add/remove). Per thread.

  Args:
    m: a Python int, or a scalar int tensor where the trace does not know B.
    size: the chunk size itself in examples (a Python int, public: it follows from the model
      and the memory budget), read inside a public plan by the clip shrink (`chunk_size`) and
      the pinned products' rows (`plan_rows`), or None.
  """
  prev = CHUNK_EXAMPLES.most, CHUNK_EXAMPLES.size
  CHUNK_EXAMPLES.most, CHUNK_EXAMPLES.size = m, size
  try:
    yield
  finally:
    CHUNK_EXAMPLES.most, CHUNK_EXAMPLES.size = prev


def chunk_size():
  """The physical chunk size m of the enclosing `chunk_examples` block (an int), or None."""
  return CHUNK_EXAMPLES.size


class examples_per_record:  # pylint: disable=invalid-name
  """Context: the built-in norm functions return per-record norms for records
  of k consecutive examples (k = 1: per-example). Within it `sum_examples` reads the
  enclosing public plan once (the first norm bound that counts rows)."""

  def __init__(self, k):
    self._k = k

  def __enter__(self):
    self._prev = RECORDS.k, RECORDS.most
    RECORDS.k, RECORDS.most = self._k, _UNREAD
    return self

  def __exit__(self, *exc):
    RECORDS.k, RECORDS.most = self._prev


def current_examples_per_record():
  """k of the enclosing examples_per_record context (1 outside): `RECORDS.k`."""
  return RECORDS.k


def record_sum(t):
  """[B, ...] per-example -> [B/k, ...] per-record sums.

  Args:
    t: [B, ...] per-example tensor, B a multiple of the record size k.

  Returns:
    [B/k, ...] tensor.
  """
  k = RECORDS.k
  if isinstance(k, int) and k == 1:
    return t
  shape = tf.shape(t)
  t = tf.reshape(t, tf.concat([[shape[0] // k, k], shape[1:]], 0))
  return tf.reduce_sum(t, axis=1)


def static_dim(x, axis):
  """The static size of `x` along `axis`, or None.

  Args:
    x: a tensor.
    axis: an axis of x.

  Returns:
    int or None.
  """
  d = x.shape[axis]
  return None if d is None else int(d)


def leading_rows(g, like):
  """g[:n] for n = like's leading size (the records' rows of a padded per-record tensor); g
  itself, with no shape ops in the graph, when the trace knows both sizes and they are equal.

  Args:
    g: [R, ...] tensor, R >= n.
    like: [n, ...] tensor.

  Returns:
    [n, ...] tensor.
  """
  n, r = like.shape[0], g.shape[0]
  if n is not None and r is not None and int(n) == int(r):
    return g
  return g[:tf.shape(like)[0]]


def with_ones_column(x):
  """x [..., K] in float32 with a last column of ones, [..., K + 1] (a bias as the weight of
  an input 1); the ones are a constant where the trace knows x's shape (no slice of x).

  Args:
    x: [..., K] tensor.

  Returns:
    [..., K + 1] float32 tensor.
  """
  return once_per_graph("ones_column", x, _with_ones_column)


def _with_ones_column(x):
  x = tf.cast(x, tf.float32)
  if x.shape[:-1].is_fully_defined():
    shape = x.shape[:-1].as_list() + [1]
    ones = _memoized(("ones", tuple(shape)), lambda: tf.ones(shape, tf.float32))
  else:
    ones = tf.ones_like(x[..., :1])
  return tf.concat([x, ones], const(-1))


def regroup_btk(x):
  """[B, T, K] -> [B/k, k*T, K]: a record's positions are its examples'.

  Args:
    x: [B, T, K] with B a multiple of k (k from the caller's record grouping).

  Returns:
    [B/k, k*T, K] tensor.
  """
  k = RECORDS.k
  if isinstance(k, int) and k == 1:
    return x
  t, last = static_dim(x, 1), static_dim(x, 2)
  kt = t * k if (t is not None and isinstance(k, int)) else -1
  last = last if last is not None else tf.shape(x)[2]
  return tf.reshape(x, [tf.shape(x)[0] // k, kt, last])


def zeros(dz):
  """[B/k] float32 zeros: the running per-record squared norm.

  Args:
    dz: a [B, ...] tensor whose records (k examples each) the norm runs over.

  Returns:
    [B/k] float32 zeros.
  """
  return tf.zeros([tf.shape(dz)[0] // RECORDS.k],
                  tf.float32)


def factored_sqr_norm(a, b, sums_from_g=False, sum_rows=None):
  """Per-example ||sum_t a_t b_t^T||_F^2 for a: [B, T, K], b: [B, T, N].

  Returns (sqr_norms [B], g) with g the [B, K, N] per-example gradient when it
  was materialized and is small enough to keep (registry.keep_per_example, or
  MAX_DIRECT_PER_EXAMPLE_ENTRIES for a direct form chosen as the cheaper; else
  None). Forms (Li et al. 2021, Sec. 4):
    direct: g_i = a_i^T b_i, cost B T K N; kept when K N is small, since it
            then also replaces the book-keeping product of the same cost;
    Gram:   sum_{t,s} <a_t, a_s><b_t, b_s>, cost B T^2 (K+N), no g;
    T = 1:  ||a||^2 ||b||^2, no g.
  Without an override, direct if g is kept, else the cheaper of the two.

  Where the clipped sum is not formed from the g returned here, the direct form's norm is an
  upper bound that covers the rounding of the record's terms in g and in that sum
  (`with_sum_rounding`); the Gram form's is an upper bound of the exact norm raised the same
  way for the clipped sum's product (`gram_sqr_norm` with sum_rows); with one position per
  record (T = 1) no terms can cancel and the norm is exact to a relative rounding.

  Args:
    a: [B, T, K] layer inputs.
    b: [B, T, N] output gradients.
    sums_from_g: the caller forms the clipped sum from the g returned (registry
      PerExampleGrads): its norm needs no bound. False: a g returned may be dropped.
    sum_rows: rows of the product that forms the clipped sum (a Python int or a scalar
      tensor); None: the batch's B T.

  Returns:
    (sqr_norms [B / k] float32, g [B / k, K, N] or None).
  """
  a = regroup_btk(tf.cast(a, tf.float32))
  b = regroup_btk(tf.cast(b, tf.float32))
  t, k, n = static_dim(a, 1), static_dim(a, 2), static_dim(b, 2)
  if t == 1:   # ||a||^2 ||b||^2: the two pinned sums' depths and the product's rounding
    sa, ha = record_sqr_sums(a, noted=False)
    sb, hb = record_sqr_sums(b, noted=False)
    note_norm_depth(ha + hb + 2)
    return sa * sb, None
  if sum_rows is None:
    sum_rows = batch_rows(a)
  keep = k is not None and n is not None and registry.keep_per_example(k * n)
  form = registry.form_override()
  form = form if form in ("gram", "direct") else None
  if form is None:
    if keep or t is None or k is None or n is None:
      form = "direct"
    else:
      form = "gram" if t * t * (k + n) < t * k * n + k * n else "direct"
  if form == "gram":
    return gram_sqr_norm(a, b, sum_rows=sum_rows), None
  g = tf.einsum("btk,btn->bkn", a, b)
  keep = keep or (k is not None and n is not None and
                  k * n <= registry.MAX_DIRECT_PER_EXAMPLE_ENTRIES)
  sq = record_sqr_sums(g)
  if not (keep and sums_from_g):
    sq = with_sum_rounding(sq, position_norms(a), position_norms(b),
                           static_or_shape(a, 1) + sum_rows + 1,
                           None if None in (k, n) else k + n)
  return sq, (g if keep else None)


def public_examples():
  """The examples of one call of a layer within an add/remove step's public plan
  (summation.public_plan: its records per chunk times k, a bound on every chunk of a batch
  within the plan's bound, the same on neighbouring datasets), or None outside one or with
  records of a size the trace does not know. Read once per `examples_per_record` block."""
  most = RECORDS.most
  if most is _OUTSIDE or most is _UNREAD:
    plan, k = summation.current_public_plan(), RECORDS.k
    most = int(plan[1]) * k if plan is not None and isinstance(k, int) else None
    if RECORDS.most is _UNREAD:
      RECORDS.most = most
  return most


def sum_examples(a):
  """B, the examples of a layer's [B, ...] tensor as a record's norm bound counts the rows of
  the clipped sum's product over them (`with_sum_rounding`'s R): within an add/remove step's
  public plan its examples per call (`public_examples`), r k for r records per chunk, and a
  call of more examples is refused (a batch the trace does not know: checked at run time by
  clipping); a physical chunk's within a plan the public max(r k, min(R k, m)) for R the plan's
  rows and m the chunk size (clipping checks the batch against R); elsewhere the batch's
  (replace-one: the same rows on neighbouring datasets), a physical chunk's its batch's, at
  most its chunk size (`chunk_examples`).

  Why: a bound over the batch's own rows moves every record's clip factor when a record is
  added (L grows by its T rows), so the clipped sum moves by more than C: 1.23 C for one
  example added to 16 whose positions nearly cancel (review R22,
  tests/fast_clipping/test_fast_clipping_review_r22.py); a public R gives each record the
  same factor on both datasets (as summation.public_plan's shrink).

  Args:
    a: a [B, ...] tensor.

  Returns:
    a Python int when static or planned, else a float32 scalar tensor.

  Raises:
    PrivacyConfigError: within a public plan, a call (not a physical chunk) of more examples
      than the plan's records per chunk times k.
  """
  most, b = public_examples(), static_dim(a, 0)
  chunked = CHUNK_EXAMPLES.most   # a physical chunk's: min(its batch's rows, the chunk size)
  if most is not None:
    if chunked is not None:   # public: max(r k, min(R k, m)), not min(B, m), which B moves
      bound = int(summation.current_public_plan()[0]) * RECORDS.k
      return max(most, min(bound, int(CHUNK_EXAMPLES.size or bound)))
    if b is not None and b > most:   # its own rows would count: an added example raises them
      raise PrivacyConfigError(
          f"{plan_call_limit(summation.current_public_plan(), RECORDS.k)}. Received: a call "
          f"of {b} examples. Open the plan with `records` of at least the records of the "
          "largest call (and `rows` of at least the batch's), or call clipped_grad_sum on "
          f"chunks of at most {most} examples.")
    return most   # b unknown: clipping._within_plan_records checks it at run time
  if chunked is not None:
    return chunked if isinstance(chunked, int) else tf.cast(chunked, tf.float32)
  return b if b is not None else tf.cast(tf.shape(a)[0], tf.float32)


def plan_call_limit(plan, k):
  """The rule a call inside summation.public_plan `plan` keeps (an error message's first
  sentence): at most its records per chunk times k examples."""
  return (f"clipped_grad_sum inside `summation.public_plan(records={int(plan[1])}, ...)` "
          f"counts {int(plan[1]) * k} examples per call in every record's norm bound (records "
          f"of k = {k} examples): a call may hold at most that many")


def batch_rows(a):
  """B T for a [B, T, ...] tensor, B the examples a norm bound counts (`sum_examples`): a
  Python int when both are known to the trace, else a float32 scalar tensor."""
  b, t = sum_examples(a), static_dim(a, 1)
  if isinstance(b, int) and t is not None:
    return b * t
  return b * static_or_shape(a, 1)


def position_norms(x, with_one=False):
  """[B, T] float32 norms ||x_t|| of x [B, T, K]'s positions (of [x_t, 1] with `with_one`),
  once per x in the clipped sum's graph (`once_per_graph`: the layers that read one input,
  an attention block's query, key and value projections, share them).

  Args:
    x: [B, T, K] float32.
    with_one: a Python bool.

  Returns:
    [B, T] float32.
  """
  def make(x):
    sq = reduce_sum(tf.square(x), 2)
    return tf.sqrt(sq + scalar(1.0) if with_one else sq)

  return once_per_graph(("position_norms", with_one), x, make)


def gram_diagonal_norms(gram):
  """[B, T] float32 norms sqrt(G_tt) of the vectors of a float32 Gram matrix G [B, T, T] (its
  diagonal: the same float32 sums of squares as `position_norms`, two ops instead of three),
  once per G in the clipped sum's graph (`once_per_graph`).

  Args:
    gram: [B, T, T] float32.

  Returns:
    [B, T] float32.
  """
  return once_per_graph("diagonal_norms", gram, lambda g: tf.sqrt(tf.linalg.diag_part(g)))


def with_sum_rounding(sq, na, nb, length, widths=None):
  """A per-record squared norm raised to cover the rounding of the float32 products that
  form the record's gradient: (sqrt(sq) + gamma_L S)^2, S = sum_t ||a_t|| ||b_t||,
  L = `length`.

  Relation (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Secs. 3.1 and
  4.2): a float32 sum of n products, in any order, errs entrywise by at most
  gamma_n = n u / (1 - n u) (u = 2^-24) times the sum of their absolute values, so a gradient
  g = sum_t a_t b_t^T formed in float32 errs by a matrix E with |E_kn| <= gamma_n
  sum_t |a_tk| |b_tn|, whose Frobenius norm is at most gamma_n S (no extra product: T (K + N)
  per record). Two products round a record's terms: the per-record product g~ (T terms) whose
  squared norm is sq, and the clipped sum's product, where each term c a_t b_t^T is rounded
  once by the weight c and accumulated over at most that product's R rows (gamma_{R+1}). So
  ||g|| + gamma_{R+1} S <= ||g~|| + gamma_{T+R+1} S: with L = T + R + 1 the clip factor
  c = C / sqrt(returned) keeps c (g + the rounding of the record's own terms in the clipped
  sum) within C, where cancellation (positions' a_t b_t^T nearly opposite) would let a norm
  near 0 give c = 1 to a rounding error of order u S. Where sq bounds ||g||^2 itself
  (`bounded_gram_contraction`), L = R + 1. gamma_L is taken L u (1 + 2 (L + W + 2 T + 16) u),
  W = `widths` (K + N: it covers the float32 rounding of S and of this bound's own few
  operations), or 1.25 (L + 1) u without widths (n u <= 0.2). The relative rounding of sq's
  sum of squares (pinned in order: `record_sqr_sums`), of this bound's square root, addition
  and square, and of c is the clip's norm margin (`norm_margin`, applied once per record in
  clipping._clip_factors; the sum from kept gradients is clipped by it too). On records whose positions
  do not cancel the norm grows by gamma_L S / ||g||, about gamma_L sqrt(T) for positions of
  orthogonal gradients.

  Args:
    sq: [B] float32 squared norms (of the float32 per-record gradients, or upper bounds of
      the exact ones).
    na, nb: [B, T] float32 norms of the positions' a_t and b_t (`position_norms`); nb None
      for b_t's alone (a_t = 1).
    length: L, a Python int or a float32 scalar tensor.
    widths: K + N, the lengths of the vectors whose norms na and nb are (a Python int), or
      None.

  Returns:
    [B] float32.
  """
  s = reduce_sum(na if nb is None else na * nb, 1)
  return with_terms_rounding(sq, s, length, widths, static_dim(na, 1))


def with_terms_rounding(sq, s, length, widths=None, terms=None, noted=True):
  """(sqrt(sq) + gamma_L s)^2 for s [R] the sum of the norms of a record's terms in its
  float32 gradient (`with_sum_rounding`, which derives the bound: S = sum_t ||a_t|| ||b_t||
  there); for callers that form S themselves (a bias: `bias_sqr_norm`; LayerNormalization's
  gamma and beta in one block).

  Args:
    sq: [R] float32 squared norms.
    s: [R] float32 sums of the terms' norms.
    length: L = terms + the clipped sum's rows + 1, a Python int or a float32 scalar tensor.
    widths: the lengths of the vectors whose norms s sums (a Python int), or None.
    terms: the terms per record (a Python int), or None.
    noted: False where the caller noted this bound's roundings (`note_norm_depth`) already.

  Returns:
    [R] float32.
  """
  u = 2.0 ** -24
  # the square root, the addition and the square round the squared norm relatively: 5
  # factors (1 + d) on its scale (algebra.norm_margin covers them)
  if noted:
    note_norm_depth(after=5)
  if widths is None or terms is None or not isinstance(length, int):
    gamma = 1.25 * (length + 1) * u
  else:
    gamma = length * u * (1.0 + 2.0 * (length + widths + 2 * terms + 16) * u)
  return tf.square(tf.sqrt(tf.maximum(sq, scalar(0.0))) + scalar(gamma) * s)


def bias_sqr_norm(dz, bias_shape, rows=None, sum_from_db=False):
  """The per-record gradient db of a bias broadcast onto dz (`bias_grad`) and its squared
  norm, an upper bound covering the float32 rounding of the record's terms where the
  clipped sum is not formed from this db.

  db_r = sum of dz_t over the record's terms t (its k examples and the axes the bias is
  broadcast along), the vectors dz_t over the bias's entries. Where these nearly cancel
  (two positions under a frozen head w and -w), the float32 db is mostly rounding, and a
  clipped sum formed another way (c dz reduced over the batch, a vector-Jacobian product)
  rounds differently: one record then moves it by more than C. The bound is
  `with_sum_rounding`'s with a_t = 1 (Higham, "Accuracy and Stability of Numerical
  Algorithms", 2nd ed., Secs. 3.1 and 4.2): (||db~|| + gamma_L S)^2, S = sum_t ||dz_t||,
  L = P + R + 1 (P the record's terms, R the clipped sum's rows per entry). With one term
  per record (P = 1: no sum, e.g. a Dense bias on [B, N] in records of one example) or with
  `sum_from_db`, sqr_sum(db): the norm is exact to a relative rounding.

  Args:
    dz: [B, ...] the gradient at the biased output (any float dtype).
    bias_shape: the bias's shape (right-aligned on dz).
    rows: R, the rows the clipped sum's reduction adds per entry (a Python int or a float32
      scalar); None: the batch's, B times the broadcast axes' sizes.
    sum_from_db: the caller forms the clipped sum from the db returned.

  Returns:
    (sq [B / k] float32, db [B / k, ...] float32).
  """
  db = bias_grad(dz, bias_shape)
  sq = sqr_sum(db)
  rank = dz.shape.rank
  axes = bias_axes(rank, bias_shape)
  sizes = [static_dim(dz, a) for a in axes]
  k = RECORDS.k
  per_example = None if None in sizes else int(np.prod(sizes, dtype=np.int64))
  if sum_from_db or (per_example == 1 and isinstance(k, int) and k == 1):
    return sq, db
  entries = [a for a in range(1, rank) if a not in axes]

  def term_norms(d):
    d = tf.cast(d, tf.float32)
    n = tf.sqrt(reduce_sum(tf.square(d), entries)) if entries else tf.abs(d)
    return reduce_sum(n, list(range(1, n.shape.rank))) if n.shape.rank > 1 else n

  s = record_sum(once_per_graph(("bias_term_norms", tuple(entries)), dz, term_norms))
  if per_example is None:
    per_example = tf.cast(tf.reduce_prod(tf.gather(tf.shape(dz), axes)), tf.float32)
  if rows is None:
    rows = sum_examples(dz) * per_example
  terms = per_example * (k if isinstance(k, int) else tf.cast(k, tf.float32))
  width = int(np.prod([dz.shape[a] for a in entries])) if all(
      dz.shape[a] is not None for a in entries) else None
  return (with_terms_rounding(sq, s, terms + rows + 1, None if width is None else width + 1,
                              terms if isinstance(terms, int) else None), db)


def gram_sqr_norm(a, b, with_one=False, sum_rows=None):
  """sum_{t,s} <a_t, a_s><b_t, b_s> for a: [B, T, K], b: [B, T, N] (float32).

  with_one: a stands for [a, 1], a last input of ones whose weight is a Dense layer's bias
  (Li et al., "Large language models can be strong differentially private learners",
  Sec. 4, Gram form). <[a_t, 1], [a_s, 1]> = <a_t, a_s> + 1, so the Gram matrix of [a, 1] is
  that of a plus 1 in every entry ([B, T, T] adds, once per input): the squared norm of
  [grad W; grad b] with no [B, T, K + 1] copy of a (its bias part sum_{t,s} <b_t, b_s> =
  ||sum_t b_t||^2).

  The sum cancels when the positions' gradients a_t b_t^T nearly cancel (two positions with
  one input and opposite output gradients): in float32 it can then come out 0 or negative
  for a gradient of any norm, and a clip factor from it would let one record move the
  clipped sum by far more than C. So the value returned is an upper bound of the exact sum:
  the computed sum plus its rounding error bound (Higham, "Accuracy and Stability of
  Numerical Algorithms", 2nd ed., Sec. 3.1: a float32 sum of n products errs by at most
  gamma_n = n u / (1 - n u) times the sum of their absolute values, u = 2^-24). With
  A_ts = <a_t, a_s> (K products) and B_ts = <b_t, b_s> (N products), the T^2 products
  A~ B~ summed in float32 and every rounding bounded (`bounded_gram_contraction`, which
  derives it; no float64).

  Args:
    a: [B, T, K] layer inputs.
    b: [B, T, N] output gradients.
    with_one: a Python bool, see above.
    sum_rows: R, the rows of the product that forms the clipped sum (a Python int or a
      float32 scalar tensor): the bound is then raised to cover that product's rounding of
      the record's terms too (`with_sum_rounding` with L = R + 1, ||a_t||, ||b_t|| from the
      Grams' diagonals); None: the bound of the exact norm alone.

  Returns:
    [B] float32 upper bounds of the squared per-example gradient norms ||a^T b||_F^2 (of
    [a, 1]^T b with `with_one`).
  """
  # once per input within the clipped sum (shared_ops): layers that read the same input
  # (an attention block's query, key and value projections) share its Gram matrix
  ga = once_per_graph("gram", a, lambda a: tf.einsum("btk,bsk->bts", a, a))
  if with_one:
    ga = once_per_graph("gram_of_ones_column", ga, lambda g: g + 1.0)
  gb = tf.einsum("btn,bsn->bts", b, b)
  k, n = int(with_one) + static_or_shape(a, 2), static_or_shape(b, 2)
  deferred = _deferred_gram_bound(ga, gb, k, n, sum_rows)
  if deferred is not None:
    return deferred
  # the rounding bound's per-position norms: the Gram matrices' diagonals
  na, nb = gram_diagonal_norms(ga), gram_diagonal_norms(gb)
  # with sum_rows: the clipped sum's product rounds the record's terms too (c a_t b_t^T)
  return bounded_gram_contraction(ga, gb, na, nb, k, n, sum_rows)


class DeferredNorms:
  """A layer's [R] float32 per-record squared norm (or norm bound) still to be formed: the
  enclosing `batched_norms` block forms it with those of the other layers of its class
  (`resolve_norms`). A rule only hands it on (its FactorSums' or PerExampleBlock's
  sqr_norms). Final.

  Attributes:
    inputs: the tensors it is formed from: (ga, gb), the [R, T, T] float32 Gram matrices of
      `gram_sqr_norm`'s bound, or (x,), the [R, P] rows of `deferred_sqr_sum`.
    key: the class: ("gram", ga's shape, k, n, sum_rows) or ("squares", x's shape, dtype),
      every one static.
    value: the [R] float32 tensor once resolved, else None.
  """
  __slots__ = ("inputs", "key", "value")

  def __init__(self, inputs, key):
    self.inputs, self.key, self.value = inputs, key, None


_BATCHED = threading.local()   # .block: the enclosing `batched_norms` block's state
# Bytes of one batched group's stacked inputs (`resolve_norms`): [L R, T, T] or [L R, P] float32
BATCHED_NORM_BYTES = 4 << 20


@contextlib.contextmanager
def batched_norms():
  """Within the block, the per-record squared norms that rules hand on unchanged are formed
  per class of layers, not per layer: `gram_sqr_norm`'s rounding bound
  (`bounded_gram_contraction`, `with_terms_rounding`; where the rule opts in,
  `deferred_norms`) and `deferred_sqr_sum`'s sums of squares return a `DeferredNorms`, and
  `resolve_norms` forms those of one class (the Gram matrices' shape, k, n and the clipped
  sum's rows; the rows' shape) as one computation on their inputs stacked along the records'
  axis, split back per layer. Every op of these is per record (a reduction over a record's
  own entries, or elementwise), so a layer's value is the one it gets alone but for the order
  of an einsum's float32 sums, which the Gram bound covers in any order (Higham, "Accuracy and
  Stability of Numerical Algorithms", 2nd ed., Sec. 3.1; the sums of squares keep their
  pinned order, summation.pinned_row_sums, row by row). BERT-base's 72 projections (3
  classes) and 25 LayerNorms (1) then trace about 130 ops for these, not 97 groups of 20-30.
  Traced only, in the graph the block was opened in (a rule's tf.cond or tf.map_fn over
  chunks forms its values in place).

  Yields:
    None.
  """
  graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
  outer = getattr(_BATCHED, "block", None)
  _BATCHED.block = {"graph": graph, "pending": [], "open": False}
  try:
    yield
  finally:
    _BATCHED.block = outer


@contextlib.contextmanager
def deferred_norms():
  """Within the block (a rule's, inside `batched_norms`), `gram_sqr_norm` may return a
  `DeferredNorms`: the rule hands it on as its squared norms unchanged."""
  block = getattr(_BATCHED, "block", None)
  if block is None:
    yield
    return
  was, block["open"] = block["open"], True
  try:
    yield
  finally:
    block["open"] = was


def _defer(inputs, key, opted_in=True):
  """A DeferredNorms of `inputs` in the enclosing `batched_norms` block (the same graph, the
  inputs' shapes static), else None."""
  block = getattr(_BATCHED, "block", None)
  if (block is None or not (opted_in or block["open"]) or block["graph"] is None or
      tf.compat.v1.get_default_graph() is not block["graph"] or
      not all(t.shape.is_fully_defined() for t in inputs)):
    return None
  deferred = DeferredNorms(inputs, key)
  block["pending"].append(deferred)
  return deferred


def _deferred_gram_bound(ga, gb, k, n, sum_rows):
  """A DeferredNorms for gram_sqr_norm's bound where a `batched_norms` block takes it
  (`deferred_norms` open, static shapes and sizes), else None."""
  if ga.shape != gb.shape or not all(isinstance(v, int) for v in (k, n, sum_rows)):
    return None
  deferred = _defer((ga, gb), ("gram", tuple(ga.shape.as_list()), k, n, sum_rows),
                    opted_in=False)
  if deferred is not None:   # the bound's roundings after its sum, noted per layer as alone
    note_norm_depth(after=5)
  return deferred


def deferred_sqr_sum(x):
  """`sqr_sum`(x) [R] float32, or within a `batched_norms` block a `DeferredNorms` of it (the
  caller hands it on unchanged), its depth noted per layer as `sqr_sum` notes it.

  Args:
    x: [R, ...] float tensor.

  Returns:
    [R] float32 or a DeferredNorms.
  """
  x = tf.cast(x, tf.float32)
  deferred = _defer((x,), ("squares", tuple(x.shape.as_list())))
  if deferred is None:
    return sqr_sum(x)
  n = x.shape[1:].num_elements()
  note_norm_depth(summation.square_sum_depth(n, square_block(n)))   # record_sqr_sums' plan
  return deferred


def _resolve_class(key, group):
  """[R] float32 values of a class's DeferredNorms, from their inputs stacked."""
  stacked = [tf.concat(list(ts), 0) if len(group) > 1 else ts[0]
             for ts in zip(*(d.inputs for d in group))]
  if key[0] == "gram":
    ga, gb = stacked
    sq = bounded_gram_contraction(ga, gb, gram_diagonal_norms(ga), gram_diagonal_norms(gb),
                                  *key[2:], noted=False)
  else:
    sq = record_sqr_sums(stacked[0], noted=False)[0]
  return tf.split(sq, len(group), axis=0) if len(group) > 1 else [sq]


def resolve_norms(parts):
  """`parts` with each `DeferredNorms` replaced by its [R] float32 tensor, the pending ones of
  the enclosing `batched_norms` block formed first: per class, in groups of at most
  BATCHED_NORM_BYTES of stacked inputs, one computation on the group's inputs concatenated
  along the records' axis, split back into the layers' [R] values.

  Args:
    parts: a list of tensors and DeferredNorms.

  Returns:
    a list of tensors.
  """
  block = getattr(_BATCHED, "block", None)
  classes = {}
  for d in block["pending"] if block is not None else ():
    classes.setdefault(d.key, []).append(d)
  for key, group in classes.items():
    per_layer = sum(4 * t.shape.num_elements() for t in group[0].inputs)
    most = max(1, BATCHED_NORM_BYTES // max(per_layer, 1))
    for i in range(0, len(group), most):
      for d, v in zip(group[i:i + most], _resolve_class(key, group[i:i + most])):
        d.value = v
  if block is not None:
    block["pending"] = []
  return [p.value if isinstance(p, DeferredNorms) else p for p in parts]


def static_or_shape(x, axis):
  """The size of x along `axis`: a Python int when static, else a float32 scalar tensor."""
  d = static_dim(x, axis)
  return d if d is not None else tf.cast(tf.shape(x)[axis], tf.float32)


def bounded_gram_contraction(ga, gb, na, nb, k, n, sum_rows=None, noted=True):
  """An upper bound, in float32 alone (the same ops on every device: no float64), of the
  exact sum_{t,s} A_ts B_ts from float32 Gram matrices ga ~ A [B, T, T] (dot products of K
  terms of vectors of norms na [B, T]) and gb ~ B (N terms, norms nb): the float32
  contraction plus a bound of all its rounding.

  Derivation (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 3.1: a
  float32 dot product of n terms, in any order, errs by at most gamma_n = n u / (1 - n u)
  times the sum of the terms' absolute values, u = 2^-24; Sec. 4.2: so does any float32 sum of
  n terms). With a_t, b_t the vectors (norms alpha_t, beta_t):
    |ga_ts - A_ts| <= gamma_K alpha_t alpha_s,  |gb_ts - B_ts| <= gamma_N beta_t beta_s,
  so |sum ga gb - sum A B| <= gamma_K sum alpha_t alpha_s |gb_ts| + gamma_N sum |ga_ts|
  beta_t beta_s + gamma_K gamma_N (sum_t alpha_t beta_t)^2. The contraction itself is formed
  as T row sums of T products (an einsum: a dot, which XLA keeps; a product and two
  reductions XLA would merge into one) and a sum of the T rows: each product passes through at most
  2 T roundings, so it errs by at most gamma_{2T} sum |ga_ts gb_ts| (one reduction of the
  T^2 products would give gamma_{T^2}). alpha, beta are na, nb (the Grams' diagonals' square
  roots): their relative rounding and the bound's own float32 sums of at most T^2
  nonnegative terms are covered by taking each gamma_n as (1.25 + 2 T^2 u) (n + 1) u. k = 0
  where ga is exact (no rounding term for it). Measured against the float64 contraction this
  replaces: ReLU inputs at T = 128, K = N = 768 at most 1.38e-3 above the exact norm (float64:
  1.36e-3), at T = 128, K = 64, N = 48 1.8e-4 (1.2e-4), at T = 16, K = 8, N = 6 1.0e-5
  (5.3e-6); tests/fast_clipping/
  test_gram_float32_review.py. rules/conv's folded patch Gram bounds its contraction alike
  (`_fold_gram_contraction`).

  Args:
    ga, gb: [B, T, T] float32.
    na, nb: [B, T] float32 norms of the vectors of ga and gb.
    k, n: the dot products' lengths (ints or float32 scalar tensors).
    sum_rows: R, the rows of the product that forms the clipped sum (an int or a float32
      scalar tensor): the bound raised to cover its rounding of the record's terms too,
      `with_terms_rounding` with L = R + 1 and S = sum_t na_t nb_t (the sum this bound forms
      anyway where k > 0); None: the bound of the exact sum alone.
    noted: False where the caller noted the bound's roundings after its sum already
      (`with_terms_rounding`'s note; `resolve_norms`).

  Returns:
    [B] float32.
  """
  t = static_dim(ga, 1)
  t = t if t is not None else tf.cast(tf.shape(ga)[1], tf.float32)
  u = 2.0 ** -24
  margin = 1.25 + 2.0 * t * t * u   # + the bound's own float32 sums of T^2 terms
  # the rows an einsum (a dot) on every path: XLA, auto-clustering included, merges two
  # reductions into one of T^2 terms per record (reduce-windows of up to T^2 roundings)
  rows = tf.einsum("bts,bts->bt", ga, gb)
  gamma_b = margin * (n + 1) * u
  # ga is built once per input (gram_sqr_norm: an attention block's query, key and value
  # projections share it), and so is |ga|
  abs_ga, abs_gb = once_per_graph("abs", ga, tf.abs), tf.abs(gb)
  bound = (scalar(gamma_b) * tf.einsum("bts,bt,bs->b", abs_ga, nb, nb)
           + scalar(margin * (2 * t + 1) * u) * tf.einsum("bts,bts->b", abs_ga, abs_gb))
  s = None
  if not (isinstance(k, int) and k == 0):
    gamma_a = margin * (k + 1) * u
    s = reduce_sum(na * nb, 1)
    bound += (scalar(gamma_a) * tf.einsum("bt,bs,bts->b", na, na, abs_gb)
              + scalar(gamma_a * gamma_b) * tf.square(s))
  sq = reduce_sum(rows, 1) + bound
  if sum_rows is None:
    return sq
  if s is None:
    s = reduce_sum(na * nb, 1)
  t = static_dim(ga, 1)
  widths = k + n if isinstance(k, int) and isinstance(n, int) else None
  return with_terms_rounding(sq, s, sum_rows + 1, widths, t, noted=noted)


def scalar(value):
  """A float32 scalar operand: a Python float as one shared Const of the graph being traced
  (`const`: every layer of one shape reads the same), a tensor as it is.

  Args:
    value: a Python float or a float32 scalar tensor.

  Returns:
    a float32 scalar tensor.
  """
  return const(value, tf.float32) if isinstance(value, float) else value


def to_btk(x):
  """Reshapes [B, d1, ..., dm, K] to [B, T, K] with T = d1 * ... * dm.

  A rank-3 input is returned as it is, and a reshape whose non-batch sizes are static takes
  -1 for the batch (no shape ops in the graph).

  Args:
    x: [B, d1, ..., dm, K] tensor.

  Returns:
    [B, T, K] tensor.
  """
  x = tf.convert_to_tensor(x)
  k = static_dim(x, -1)
  if x.shape.rank == 2:
    return tf.expand_dims(x, const(1))
  if x.shape.rank == 3:
    return x
  t = static_positions(x.shape[1:-1])
  if k is not None and t != -1:
    return reshape(x, [-1, t, k])
  return tf.reshape(x, [tf.shape(x)[0], t, k if k is not None else tf.shape(x)[-1]])


def static_positions(dims):
  """The product of `dims` when all are static, else -1 (for tf.reshape).

  A reshape to [tf.shape(x)[0], -1, ...] leaves the positions unknown to the trace when the
  batch is (fit's sampled datasets), and the rules then pick forms by static sizes (the
  Gram form of factored_sqr_norm needs T): the static product keeps them known.

  Args:
    dims: a TensorShape (or list of ints / None).

  Returns:
    int.
  """
  dims = list(dims)
  return int(np.prod(dims, dtype=np.int64)) if all(d is not None for d in dims) else -1


def finite_float32(t):
  """t cast to float32, its non-finite entries replaced by 0.

  Args:
    t: a tensor.

  Returns:
    float32 tensor of t's shape.
  """
  t = tf.cast(t, tf.float32)
  return tf.where(tf.math.is_finite(t), t, tf.zeros_like(t))


def sqr_sum(x):
  """Per-row sum of squares in float32: [B, ...] -> [B], each row's squares summed in a
  pinned order (`record_sqr_sums`).

  Args:
    x: [B, ...] tensor.

  Returns:
    [B] float32.
  """
  return record_sqr_sums(x)


# Entries per row assumed where the trace does not know a row's size: a bound on a record's
# entries (2^40 floats is 4 TiB), for a static `square_sum_depth` (97).
MOST_ENTRIES = 1 << 40

# Entries of a row up to which `record_sqr_sums` sums its squares by one reduction (any order:
# each square through at most n - 1 additions) rather than in blocks of summation.SQUARE_BLOCK
# and a pairwise tree (depth 63 + ceil(log2(n / 64))). The clip's norm margin (`norm_margin`)
# stays below about 2048 u = 6.2e-5 for a Dense layer's two factors of 1024 entries; the
# 784-512-10 MLP's goes from 4.5e-6 to 3.9e-5 (its clip 0.004% lower), and its DP step (B =
# 256) sheds the tree's pads, transposes and levels, about 12 ops a sum against 2: 0.5-0.7 of
# its 11 CPU ms (A/B in one process, benchmarks/fit_step_ablation.py's timer, load 6-8).
ONE_REDUCTION_ENTRIES = 1024


def square_block(n):
  """The block `record_sqr_sums` sums a row of n squares in (summation.pinned_row_sums'
  `block`, summation.square_sum_depth's): n itself, one reduction, for
  1 <= n <= ONE_REDUCTION_ENTRIES, else summation.SQUARE_BLOCK (n None: unknown).

  Args:
    n: the row's entries, a Python int or None.

  Returns:
    a Python int >= 1.
  """
  if n is not None and 1 <= n <= ONE_REDUCTION_ENTRIES:
    return int(n)
  return summation.SQUARE_BLOCK


def record_sqr_sums(x, noted=True):
  """sum_j x[r, j]^2 of every row r of x [R, ...] in float32, in the order of
  `summation.pinned_row_sums` with the block `square_block`(n): a row of at most
  ONE_REDUCTION_ENTRIES entries by one reduction (depth n - 1), a longer one in blocks of 64
  squares, then a pairwise tree (each square through at most `summation.square_sum_depth`(n)
  additions, where one reduction in an order XLA chooses may take up to n - 1); its depth
  noted for the clip's margin (`note_norm_depth`; `noted` False: the caller notes the depth
  of what it forms from it).
  Rows are records: a record's own terms (its gradient's entries), not a bound's terms.

  Args:
    x: [R, ...] tensor (any float dtype).
    noted: a Python bool.

  Returns:
    ([R] float32) with `noted`, else ([R] float32, the depth H: a Python int).
  """
  x = tf.cast(x, tf.float32)
  if x.shape.rank is None:
    x = tf.reshape(x, [tf.shape(x)[0], -1])
  n = x.shape[1:].num_elements()
  block = square_block(n)
  depth = summation.square_sum_depth(MOST_ENTRIES if n is None else n, block)
  sums = summation.pinned_row_sums(tf.square(x), block, const=const)
  if noted:
    note_norm_depth(depth)
    return sums
  return sums, depth


_DEPTHS = threading.local()   # .stack: the records of the enclosing `norm_depths` blocks


@contextlib.contextmanager
def norm_depths():
  """Within the block the per-record sums of squares note their rounding depths
  (`note_norm_depth`); the block yields the record, a dict: "sums" (the depths H of the
  sums of the records' own squares), "after" (the most relative roundings a squared norm
  goes through after its sum: `with_terms_rounding`'s), "parts" (the noted parts, each
  added to the others at most once). `norm_margin` turns it into the clip's margin.

  Yields:
    the dict.
  """
  record = {"sums": [0], "after": 0, "parts": 0}
  stack = getattr(_DEPTHS, "stack", None)
  if stack is None:
    stack = _DEPTHS.stack = []
  stack.append(record)
  try:
    yield record
  finally:
    stack.pop()


def note_norm_depth(depth=None, after=0):
  """Notes, in the innermost `norm_depths` block (none: nothing), a per-record squared norm
  part whose sum of squares goes through at most `depth` additions after each square's
  rounding (it is at least (1 - u)^(depth + 1) times the exact sum: nonnegative terms), and
  `after` relative roundings of a squared norm after its sum.

  Args:
    depth: H, a Python int, or None (a part that is an upper bound of its exact value).
    after: a Python int.
  """
  stack = getattr(_DEPTHS, "stack", None)
  if not stack:
    return
  record = stack[-1]
  if depth is not None:
    record["sums"].append(int(depth))
  record["after"] = max(record["after"], int(after))
  record["parts"] += 1


def norm_margin(record, parts):
  """eta_norm of a `norm_depths` record: `summation.depth_margin` with
  H = the deepest noted sum + the most roundings after one + the noted parts + `parts`
  (every addition of nonnegative parts: the rules' `add_norms` and the step's AddN of its
  `parts` units, at most one per part), and 5 roundings after the sum (the square root, the
  loss scale's division, the margin's product, the clip's conversion to float32 and the clip
  factor's division: clipping._clip_factors).

  Args:
    record: the dict `norm_depths` yielded.
    parts: the squared norms the step adds (an int).

  Returns:
    a Python float.
  """
  depth = max(record["sums"]) + record["after"] + record["parts"] + int(parts)
  return summation.depth_margin(depth, roundings=5)


def add_norms(total, part):
  """total + part for per-record squared norms, with None for "nothing yet" (no zeros tensor
  in the graph for the first part).

  Args:
    total: [R] float32 or None.
    part: [R] tensor or None.

  Returns:
    [R] float32 or None (when both are None).
  """
  if part is None:
    return total
  part = tf.cast(part, tf.float32)
  return part if total is None else total + part


_SHARED = threading.local()   # .memos: a stack of {key: tensor}, one per `shared_ops` block


@contextlib.contextmanager
def shared_ops():
  """Within the block `once_per_graph` builds each of its tensors once per graph (the
  clipped sum's trace opens one: clipping.clipped_grad_sum); the tensors are forgotten when
  the block ends. Per thread (replicas trace in their own threads)."""
  memos = getattr(_SHARED, "memos", None)
  if memos is None:
    memos = _SHARED.memos = []
  memos.append({})
  try:
    yield
  finally:
    memos.pop()


def once_per_graph(kind, t, make):
  """make(t), built once per (kind, t) in the graph being traced within a `shared_ops` block
  and reused after, e.g. the clip factors reshaped or signed for every layer's sum (one op
  in the step's graph, not one per layer: fewer ops to trace, optimize and set up in the
  first step). Built with no control dependencies (they would reach every later user).
  Eagerly, outside a block, or for a t of another graph (captured from an outer one),
  make(t) each time.

  Args:
    kind: a hashable naming what make computes (with its static arguments).
    t: the tensor make reads.
    make: callable(t) -> tensor.

  Returns:
    make(t) (the first one built for (kind, t) in this graph and block).
  """
  if not tf.is_tensor(t) or not hasattr(t, "graph"):
    return make(t)
  # t (held by the key) keeps its graph and id alive
  return _memoized((kind, t.ref()), lambda: make(t), t.graph)


def _memoized(key, make, graph=None):
  """make(), memoized under `key` for the graph being traced within a `shared_ops` block
  (built with no control dependencies); make() each time eagerly, outside a block, or when
  `graph` is given and is not the graph being traced."""
  memos = getattr(_SHARED, "memos", None)
  if not memos or tf.executing_eagerly():
    return make()
  current = tf.compat.v1.get_default_graph()
  if graph is not None and graph is not current:
    return make()
  key = (id(current),) + tuple(key)
  memo = memos[-1]
  got = memo.get(key)
  if got is None or got.graph is not current:   # the memo's tensor keeps its graph alive
    with current.control_dependencies(None):
      got = memo[key] = make()
  return got


_PLANS = threading.local()   # .stack: a list of ({id(variable): block}, plan rows), one per
                             # `sum_plans`

# Rows of a block of a pinned product (`pinned_rows_product`): summed in any order by one
# batched matrix product, the blocks then by summation.pairwise_sum. Under the shifted relation
# (a record's arrival shifts the rows after it: every block may change) each row is charged
# its block's b - 1 roundings and the tree's ceil(log2(rows / b)) (summation.rounding_margin),
# so small blocks shrink the clip least: 64 rows at most while the blocks' sums fit the rules'
# budget (rules/budget.CHUNK_BYTES), as few as PINNED_LEAST where they fit PINNED_SMALL_BYTES.
PINNED_BLOCK = 64
PINNED_LEAST = 8
PINNED_SMALL_BYTES = 1 << 20


@contextlib.contextmanager
def sum_plans():
  """Collects, for the clipped sums built within the block, {id(variable): block} of the
  sums formed in a pinned order with one term per record (`report_pinned`); a variable
  missing from it was summed in an order the trace does not pin (clipping.py then charges no
  rounding margin: the cross-record rounding stays open there). The rows of the enclosing
  public plan or chunks (`plan_rows`) are read once on entry and held for the block's sums.
  Per thread."""
  stack = getattr(_PLANS, "stack", None)
  if stack is None:
    stack = _PLANS.stack = []
  plans = {}
  stack.append((plans, _context_rows()))
  try:
    yield plans
  finally:
    stack.pop()


def report_pinned(variable, block):
  """Declares that `variable`'s clipped sum was formed by `pinned_rows_product` with one
  term per record (its terms' norms are the records' norms): blocks of `block` rows summed
  in any order, the blocks by a pinned pairwise tree (`sum_plans`)."""
  stack = getattr(_PLANS, "stack", None)
  if stack:
    stack[-1][0][id(variable)] = block


def reported_block():
  """The largest block `report_pinned` has declared so far in the innermost `sum_plans` block
  (an int), or None (none yet, or outside one)."""
  stack = getattr(_PLANS, "stack", None)
  if not stack or not stack[-1][0]:
    return None
  return max(int(b) for b in stack[-1][0].values())


def raised_block(block):
  """`block` raised to min(PINNED_BLOCK, `reported_block()`) where it is below that: a small
  sum (`pinned_block`'s `small_bytes` rule) then runs as fewer, larger blocks (the MLP's
  [512, 10] kernel at B = 256 of a public bound of 640 rows: blocks of 13 rows, 20 leaves and
  a 6-level tree, become blocks of 64: 4 leaves). The step's clip shrink is charged for the
  largest block any of its sums reported (clipping._with_rounding_margin,
  summation.rounding_margin's `block`: a block's b - 1 roundings, then the tree's), and the
  raised block is at most that one, so the shrink is the same value and each term's
  rounding depth stays within the one it is charged for. Public: the blocks follow from the
  variables' shapes and the public plan's rows, not from the batch.

  Args:
    block: the block `pinned_block` chose (an int >= 1).

  Returns:
    an int >= block.
  """
  most = reported_block()
  if most is None:
    return block
  return max(int(block), min(PINNED_BLOCK, most))


def plan_rows(rows):
  """The rows a pinned sum's block is chosen for (`pinned_block`): the public plan's rows per
  chunk inside a summation.public_plan block (the same on neighbouring datasets, whose
  batches differ by a row: the block, so the clip shrink, may not depend on it), else the
  largest chunk's rows (summation.sequential_chunks: one block for every chunk), else `rows`.

  Args:
    rows: the batch's (or chunk's) rows the sum runs over: an int, or None (unknown).

  Returns:
    an int, or None.
  """
  stack = getattr(_PLANS, "stack", None)
  held = stack[-1][1] if stack else _context_rows()   # read once per `sum_plans` block
  if held is not None:
    return held
  return None if rows is None else int(rows)


def _context_rows():
  """`plan_rows`' rows from the enclosing summation.public_plan (its rows per chunk) or
  summation.sequential_chunks (the largest chunk's rows) block: an int, or None."""
  plan = summation.current_public_plan()
  if plan is not None:   # a physical chunk may hold more rows than the plan's chunk
    return max(int(plan[1]), CHUNK_EXAMPLES.size or 0)
  chunk = summation.current_chunk_rows()
  chunk = tf.get_static_value(chunk) if tf.is_tensor(chunk) else chunk
  return None if chunk is None else int(chunk)


def pinned_block(rows, row_bytes, budget_bytes, small_bytes=None):
  """Rows per block of `pinned_rows_product` for `rows` rows (an int or None) and sums of
  `row_bytes` bytes: PINNED_BLOCK, or more where the blocks' [rows / block, ...] sums would
  take more than `budget_bytes` (the rules' rules/budget.CHUNK_BYTES, 8 MiB) - at least one
  block; with `small_bytes`, fewer (down to PINNED_LEAST) where the blocks' sums fit in it.
  Non-decreasing in `rows`, so the block of a public bound on the rows covers every batch
  within it.

  Args:
    rows: the rows summed (an int), or None (unknown to the trace: PINNED_BLOCK).
    row_bytes: the bytes of one block's sum.
    budget_bytes: the most the blocks' sums may take.
    small_bytes: None, or the bytes the blocks' sums may take at blocks below PINNED_BLOCK.

  Returns:
    an int >= 1.
  """
  block = PINNED_BLOCK
  if rows is not None:
    most = max(1, budget_bytes // max(row_bytes, 1))   # the blocks' sums in the budget
    block = max(block, -(-int(rows) // most))
    if small_bytes is not None:
      few = max(1, small_bytes // max(row_bytes, 1))
      block = min(block, max(PINNED_LEAST, -(-int(rows) // few)))
    block = min(block, max(int(rows), 1))
  return block


def pinned_rows_product(a, b, block):
  """sum_i a_i^T b_i over the rows of a [B, K] and b [B, N] ([K, N], float32) in a pinned
  order: blocks of `block` consecutive rows (the last one maybe partial), each block's rows
  summed by one matrix product (any order within it), the blocks' [K, N] sums by
  summation.pairwise_sum's tree. A block that does not hold a record is computed
  bit-identically when that record is added or removed (summation.rounding_margin's `block`).

  With a = c a [B, 1] column of clip factors (a clipped sum sum_i c_i b_i), outside XLA:
  `pinned_factor_sum`, all the blocks' sums by one product with a [B, m] block-indicator
  matrix (the same blocks and tree).

  Outside XLA the rows are not padded: the full blocks by one batched matrix product of views
  of a and b, the last, partial block (of no rows where B is a multiple of the block the
  trace does not know: a zero leaf, x + 0 = x) by its own product, the leaves by
  summation.pairwise_sum_after (for rows the trace does not know, at most plan_rows' rows:
  its table of trees, no branch, no loop). The same blocks and tree as the rows padded with
  zero rows to the blocks (a zero row adds exactly 0 within its block), without copying the
  rows, multiplying padded rows or padding the tree to the bound's power of two (where the
  padded form of the MLP's [784, 512] kernel sum, B = 256 of at most 640 rows, wrote 8 leaves
  of 1.6 MB and added 7 at every step). Under XLA (static shapes, the pad fused into the
  product) and for rows the trace does not know without a public bound, the rows are padded
  with zero rows to a multiple of `block`, so that a product over a block's rows is the same
  XLA program whatever rows a caller cut.

  Args:
    a: [B, K] float32 (B static or not).
    b: [B, N] float32.
    block: rows per block (a Python int >= 1).

  Returns:
    [K, N] float32.
  """
  rows = a.shape[0]
  k, n = int(a.shape[-1]), int(b.shape[-1])
  most = blocks_most(rows, block)
  xla = not tf.executing_eagerly() and summation.in_xla_context()   # eager: never XLA
  if k == 1 and not xla and factor_sum_applies(rows, block):
    return tf.reshape(pinned_factor_sum(a[:, 0], b, block), [1, n])
  if not xla and (rows is not None or most is not None):
    if rows is not None:
      full = int(rows) // block * block
      if not full:   # one partial block
        return tf.matmul(a, b, transpose_a=True)
      sizes = [full, int(rows) - full]
    else:
      count = tf.shape(a)[0] // const(block)   # the full blocks
      sizes = tf.stack([count * const(block), const(-1)])
    (a_head, a_tail), (b_head, b_tail) = tf.split(a, sizes), tf.split(b, sizes)
    head = tf.matmul(reshape(a_head, [-1, block, k]), reshape(b_head, [-1, block, n]),
                     transpose_a=True)
    if rows is not None and full == int(rows):   # no partial block
      tail, head = head[-1], head[:-1]
    else:
      tail = tf.matmul(a_tail, b_tail, transpose_a=True)
    return summation.pairwise_sum_after(
        head, tail, None if most is None else int(plan_rows(None)) // block, const,
        None if rows is not None else count)
  if rows is not None:
    pad = (-int(rows)) % block
  else:
    pad = (-tf.shape(a)[0]) % block
  if not (isinstance(pad, int) and pad == 0):
    a = tf.pad(a, [[0, pad], [0, 0]])
    b = tf.pad(b, [[0, pad], [0, 0]])
  blocks = tf.matmul(tf.reshape(a, [-1, block, k]), tf.reshape(b, [-1, block, n]),
                     transpose_a=True)
  return summation.pairwise_sum(blocks, const, most=most)


# `pinned_factor_sum`'s product takes m multiply-adds per entry of b (m blocks: all but one
# add exact zeros), a one-row product per block one: it is used up to this many blocks (rows
# the trace knows, else the public plan's bound on them), where the product stays bound by
# reading b (the tutorial CNN at B = 256: at most 11 blocks of 64 under its bound of 640 rows).
FACTOR_SUM_BLOCKS = 16


def factor_sum_applies(rows, block):
  """Whether `pinned_rows_product` of a [B, 1] factor column takes `pinned_factor_sum`: rows
  the trace knows or a public bound on them (`blocks_most`), in at most FACTOR_SUM_BLOCKS
  blocks. Not under XLA (the caller's check).

  Args:
    rows: the rows summed, an int or None (unknown to the trace).
    block: rows per block (an int >= 1).

  Returns:
    bool.
  """
  m = -(-int(rows) // int(block)) if rows is not None else blocks_most(rows, block)
  return m is not None and m <= FACTOR_SUM_BLOCKS


def pinned_factor_sum(c, b, block):
  """sum_i c_i b_i over the rows i of b, in `pinned_rows_product`'s plan for a = c as a [B, 1]
  operand (blocks of `block` consecutive rows, any order within a block, the blocks'
  sums by summation.pairwise_sum's tree), outside XLA, with rows the trace knows or a public
  bound on them, in at most FACTOR_SUM_BLOCKS blocks (`factor_sum_applies`).

  All the blocks' sums come from one matrix product, L = E^T b (b [B, N]; for b [A, B, N],
  one [m, N] product per leading index, no transpose of b): E [B, m] holds c_i in row i's
  block's column (E = onehot(i // block) c_i, exact) and 0 elsewhere, m = floor(B / block) + 1
  the blocks (the last one partial, or of no rows where B is a multiple of the block: a zero
  leaf). Column j of the product is block j's rows weighted by c, in any order, and the
  other blocks' rows times an exact 0: finite rows add exactly 0 (x + 0 = x; clip factors
  are finite and a row of c_i > 0 is finite where its norm is; a non-finite row makes the
  sum non-finite either way, as before). The leaves are then summed by the same tree as
  `pinned_rows_product`'s (summation.pairwise_sum over the m leaves; a trace that does not
  know m: summation.pairwise_sum_after with a zero tail, whose extra trailing zero leaf
  leaves every sum as it is). Against the batched product of the blocks' [1, block] x
  [block, N] views, their tail's own product and the leaves' concatenation (oneDNN: one
  one-row product per block): the tutorial CNN's second convolution's kept gradients
  [256, 8,192] 1.39 -> 1.12 CPU ms, its first's [64, 256, 16] with the record-major
  transpose it saves 0.52 -> 0.30, a bias [256, 32] 0.19 -> 0.03 (no XLA, oneDNN on, load
  6, 2026-12-04).

  Args:
    c: [B] float32 clip factors (finite, >= 0).
    b: [B, N] or [A, B, N] float32.
    block: rows per block (a Python int >= 1).

  Returns:
    [N] or [A, N] float32.
  """
  rows = b.shape[-2]
  n = int(b.shape[-1])
  lead = b.shape.rank - 2   # the rows' axis
  if rows is not None:   # every constant shared (`const`): one per value in the graph
    m = int(rows) // block + 1 if int(rows) % block else max(int(rows) // block, 1)
    index = const((np.arange(int(rows)) // block).tolist())
    depth = const(m)
  else:
    r = tf.gather(tf.shape(b), const(lead), axis=const(0))
    depth = tf.math.floordiv(r, const(block)) + const(1)
    index = tf.math.floordiv(tf.range(const(0), r, const(1)), const(block))
  e = tf.one_hot(index, depth, on_value=const(1.0, tf.float32),
                 off_value=const(0.0, tf.float32)) * reshape(c, [-1, 1])   # [B, m]
  if lead == 0:
    leaves = tf.matmul(e, b, transpose_a=True)   # [m, N]
  else:
    a = int(b.shape[0])
    leaves = tf.matmul(tf.expand_dims(tf.transpose(e, const([1, 0])), const(0)), b)
    leaves = reshape(tf.transpose(leaves, const([1, 0, 2])), [-1, a * n])   # [m, A N]
  if rows is not None:
    total = summation.pairwise_sum(leaves, const)
  else:
    most = int(plan_rows(None)) // block + 1
    total = summation.pairwise_sum_after(leaves, const([0.0] * int(leaves.shape[1]),
                                                       tf.float32), most, const, depth)
  return total if lead == 0 else reshape(total, [a, n])


def blocks_most(rows, block):
  """The most blocks of `block` rows a pinned sum over rows the trace does not know can have:
  ceil(R / block) for R the rows `plan_rows` bounds them by (the public plan's rows per chunk,
  the same on neighbouring datasets, or the largest chunk's), None without one (or rows the
  trace knows). summation.pairwise_sum then sums the blocks by a static tree, no while loop.

  Args:
    rows: the rows summed, an int or None (unknown to the trace).
    block: rows per block (an int >= 1).

  Returns:
    an int, or None.
  """
  if rows is not None:
    return None
  most = plan_rows(None)
  return None if most is None else max(1, -(-int(most) // int(block)))


def const(value, dtype=tf.int32):
  """tf.constant(value, dtype), one Const per value and dtype in the graph being traced
  within a `shared_ops` block (the axes, shapes and sizes every layer's reductions, reshapes
  and slices read: one op in the step's graph each, not one per call).

  Args:
    value: an int, float or bool, or a (nested) list or tuple of them.
    dtype: the constant's dtype.

  Returns:
    a constant tensor.
  """
  dtype = tf.as_dtype(dtype)
  return _memoized(("const", dtype.name, _frozen(value)), lambda: tf.constant(value, dtype))


def _frozen(value):
  """value with its lists made tuples (a hashable key)."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  return value


def reshape(x, dims):
  """tf.reshape(x, dims), the shape a shared constant (`const`) when every entry of dims is
  a Python int (one may be -1).

  Args:
    x: a tensor.
    dims: a list of Python ints or scalar int32 tensors.

  Returns:
    the reshaped tensor.
  """
  dims = list(dims)
  if all(isinstance(d, int) for d in dims):   # once per x and dims (shared_ops)
    return once_per_graph(("reshape", tuple(dims)), x, lambda x: tf.reshape(x, const(dims)))
  return tf.reshape(x, dims)


def shaped(t, v):
  """t reshaped to variable v's shape (t itself where the trace knows it has it).

  Args:
    t: a tensor of v's entries (e.g. [K, N] of an EinsumDense kernel [K1, K2, N]).
    v: a variable.

  Returns:
    a tensor of v's shape.
  """
  shape = list(v.shape)
  return t if t.shape.as_list() == shape else reshape(t, shape)


def reduce_sum(x, axis):
  """tf.reduce_sum(x, axis) with the axes a shared constant (`const`).

  Args:
    x: a tensor.
    axis: an int or a list of Python ints.

  Returns:
    x summed over `axis`.
  """
  return tf.reduce_sum(x, const(list(axis) if isinstance(axis, (list, tuple)) else axis))


def rows(f, like):
  """The per-row vector f [B] shaped to broadcast over `like` [B, ...] (once per f and rank
  in a traced graph, `once_per_graph`).

  Args:
    f: [B] tensor.
    like: [B, ...] tensor of known rank.

  Returns:
    f reshaped to [B, 1, ..., 1] (like's rank).
  """
  shape = [-1] + [1] * (like.shape.rank - 1)
  return once_per_graph(("rows", len(shape)), f, lambda f: tf.reshape(f, shape))


def weight_rows(t, factors):
  """t [B, ...] in float32 with row i multiplied by c_i, and exactly 0 where c_i = 0 even
  where row i is not finite (tf.math.multiply_no_nan: one elementwise op, no branch).

  A record whose squared norm is not finite gets c_i = 0 (clipping.py); its rows of the
  layer inputs and output gradients may then hold inf or NaN, which must add nothing.

  Args:
    t: [B, ...] tensor of known rank.
    factors: [B] float32 clip factors, >= 0.

  Returns:
    float32 tensor of t's shape.
  """
  def weight(t):
    return tf.math.multiply_no_nan(tf.cast(t, tf.float32), rows(factors, t))

  if not tf.is_tensor(factors):
    return weight(t)
  return once_per_graph(("weight_rows", factors.ref()), t, weight)   # once per t and factors


def drop_rows(t, factors):
  """weight_rows(t, sign(c)): the rows of c_i = 0 set to exactly 0 (even where they are not
  finite), the others unchanged; the unweighted operand of a clipped-sum product whose other
  operand is `weight_rows(., factors)` (0 * inf would otherwise give NaN).

  Args:
    t: [B, ...] tensor of known rank.
    factors: [B] float32 clip factors, >= 0 (so sign(c) is 0 or 1).

  Returns:
    float32 tensor of t's shape.
  """
  return weight_rows(t, once_per_graph("sign", factors, tf.sign))


def factor_product(factors, g):
  """sum_i c_i g_i for g [R, ...], as the first row of [c; 0] [R, P] (a two-row product).

  The sum is a matrix-vector product, but XLA:CPU fuses a one-row product with the
  reshape of g into an elementwise loop that reads g column by column: for R = 64 and a
  [256, 128] gradient it took 3.5-3.9 ms, the two-row product 0.4 ms
  (benchmarks/xla_factor_product.py). The zero row adds R x P multiply-adds, as many as
  the sum itself, which is cheap next to the per-example gradients it reads.

  Args:
    factors: [R] float32, c_i.
    g: [R, ...] float32, g_i.

  Returns:
    float32 tensor of shape g.shape[1:].
  """
  if g.shape[1:].is_fully_defined() and g.shape[1:].num_elements() > 0:
    shape = g.shape[1:]   # static: no shape ops
    flat = g if g.shape.rank == 2 else reshape(g, [-1, shape.num_elements()])
  else:
    shape = tf.shape(g)[1:]
    flat = tf.reshape(g, [tf.shape(g)[0], -1])
  two = once_per_graph("two_rows", factors, lambda c: tf.stack([c, tf.zeros_like(c)]))
  # row 0 as a [P] vector: one strided slice (no slice and reshape)
  first = tf.strided_slice(tf.matmul(two, flat), const([0, 0]), const([1, 0]), const([1, 1]),
                           end_mask=2, shrink_axis_mask=1)
  if not isinstance(shape, tf.TensorShape):   # g's entries unknown to the trace (a shape op)
    return tf.reshape(first, shape)
  if shape.rank == 1:
    return first
  return reshape(first, shape.as_list())


def bias_grad(dz, bias_shape):
  """Per-record gradient of a bias broadcast (right-aligned) onto dz: dz
  summed over the axes the bias is broadcast along ([B] + non-1 bias dims)."""
  axes = bias_axes(dz.shape.rank, bias_shape)
  dz = tf.cast(dz, tf.float32)
  return record_sum(reduce_sum(dz, axes) if axes else dz)


def bias_axes(rank, bias_shape):
  """The non-batch axes of a [B, ...] tensor of `rank` that a bias of `bias_shape`
  (right-aligned) is broadcast along.

  Args:
    rank: the tensor's rank.
    bias_shape: the bias's shape.

  Returns:
    list of ints.
  """
  k = len(bias_shape)
  return [j for j in range(1, rank) if j < rank - k or bias_shape[j - (rank - k)] == 1]


def plain_layer(layer):
  """Neither LoRA nor quantized: the layer's forward is the textbook one.

  Args:
    layer: a Keras layer.

  Returns:
    bool.
  """
  return (not getattr(layer, "lora_enabled", False) and
          getattr(layer, "quantization_mode", None) is None)


def trainable(v):
  """v is a trainable variable (not None).

  Args:
    v: a variable or None.

  Returns:
    bool.
  """
  return v is not None and v.trainable


def result(layer, sq, grads_by_var):
  """PerExampleGrads if every trainable variable's g_i is in grads_by_var
  (id(variable) -> [B, ...]), else the squared norms alone."""
  variables = layer.trainable_variables
  if variables and all(id(v) in grads_by_var for v in variables):
    grads = []
    for v in variables:
      g = grads_by_var[id(v)]
      shape = tf.TensorShape(v.shape)
      if not shape.is_compatible_with(g.shape[1:]) or not g.shape[1:].is_fully_defined():
        # static where known: -1 (one Const), tf.shape only for a variable of no entries
        lead = -1 if shape.num_elements() else (
            g.shape[0] if g.shape[0] is not None else tf.shape(g)[0])
        g = reshape(g, [lead] + shape.as_list())
      grads.append(g)
    return registry.PerExampleGrads(sq, grads)
  return sq
