"""The float sum over records with a pinned order, and the clip shrink that makes its
sensitivity at most the ledger's (Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread
underestimation of sensitivity in differentially private libraries and how to fix it",
CCS 2022, Secs. 3-5; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
Sec. 4.2).

A float sum of records each of norm <= C can move by more than C when one record is added or
removed: the other records' roundings depend on the partial sums the removed one changed.
`pairwise_sum` fixes the order of the additions (a binary tree of elementwise adds of the two
halves, x[:h] + x[h:], which neither XLA nor Grappler reassociates: the review tests check it
on adversarial rows), so each record's term goes through at most ceil(log2 n) roundings, and
`rounding_margin` bounds what those roundings can add to the move; clipping each record to
C / (1 + eta) (`shrink`) then keeps the computed sum's sensitivity <= C, the ledger's C.
"""

import contextlib
import threading

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

# Unit roundoff of the sum's dtype (round to nearest): Higham, Sec. 2.1.
_UNIT = {tf.float32: 2.0 ** -24, tf.float64: 2.0 ** -53}


def unit_roundoff(dtype):
  """u of a float dtype: 2^-24 for float32, 2^-53 for float64.

  Args:
    dtype: tf.float32 or tf.float64 (anything tf.as_dtype takes).

  Returns:
    a Python float.

  Raises:
    ParameterValueError: another dtype (the privacy arithmetic is float32 or float64).
  """
  dtype = tf.as_dtype(dtype)
  if dtype not in _UNIT:
    raise ParameterValueError(
        f"`dtype` must be float32 or float64 (the privacy arithmetic). Received: dtype={dtype}")
  return _UNIT[dtype]


def _gamma(k, u):
  """Higham's gamma_k = k u / (1 - k u) (Lemma 3.1), k >= 0 additions."""
  return k * u / (1.0 - k * u)


def tree_depth(n):
  """ceil(log2 n) for n >= 1 rows: the additions a row's term goes through in `pairwise_sum`."""
  return max(0, int(n) - 1).bit_length()


def rounding_margin(records, chunks=1, replicas=1, block=1, dtype=tf.float32, products=0,
                    final=0, total=None):
  """eta >= 0 such that, with every record's term of norm <= C / (1 + eta), adding or
  removing one record moves the computed float sum by at most C.

  Relation: add/remove one record, the removed record a masked row (term 0) of the same
  static plan, so both sums run the same additions in the same order. Unit: the L2 norm of
  the summed terms (C's unit).

  Plan (static; padding rows count as records): each chunk holds `records` rows; its rows are
  formed in blocks of `block` rows summed in ANY order (block 1: one row per record), the
  blocks combined by `pairwise_sum` (depth d = ceil(log2 ceil(records / block))); the chunks'
  sums are added one after the other into an accumulator (K = chunks: at most K - 1 additions
  per chunk sum); the replicas' sums are added in any order (an all-reduce: at most R - 1).

  Derivation (Higham, Sec. 4.2 and Lemma 3.1: a term that goes through k roundings is
  x (1 + theta), |theta| <= gamma_k = k u / (1 - k u), componentwise). A block that does not
  hold the removed record r is computed bit-identically on D and D'. r's block sum moves by
  at most ||x_r|| (1 + g1) + 2 g1 sum_{b in block, b != r} ||x_b||, g1 = gamma_(block - 1);
  each block sum y_j enters the fixed tree of chunks and replicas with at most
  L = d + (K - 1) + (R - 1) roundings, g2 = gamma_L, so with n = records K R rows of norm
  <= C' the move is at most
      C' [(1 + g1 (2 block - 1)) (1 + g2) + 2 g2 (1 + g1) (n - 1)],
  and `products` roundings of each term's own products (a weight multiplied in) scale every
  ||x_b|| by (1 + u)^products; `final` roundings of the whole sum (a scale multiplied into
  it: fl(s y) = s y (1 + delta) componentwise) are `final` more levels of the tree (L + final).
  eta is that bracket times (1 + u)^products, minus 1: one row per
  record (block 1, one chunk) gives gamma_d (2 n - 1) (2.4e-4 at n = 256, 1.2e-3 at 1024,
  0.0127 at 8192 in float32). The float32 norm of each record (its clip factor) is not part of
  this bound: see docs/design.md, "Floating point".

  Args:
    records: rows per chunk (>= 1): a Python int (the static plan), or a scalar int tensor
      (rows known at run time only; padding rows count: the batch's row count must not
      depend on which records are present, as fit's padded batches).
    chunks: K >= 1 chunks added sequentially (an int, or a scalar int tensor).
    replicas: R >= 1 replicas' sums added in any order.
    block: rows summed in any order before the tree (>= 1); a block of more rows than
      `records` counts `records` (its other rows are zero padding, added exactly).
    dtype: the sum's dtype (float32 or float64).
    products: roundings of each term before the sum (>= 0).
    final: roundings of the sum after it is formed (>= 0).
    total: the rows of all chunks together where fewer than records * chunks (chunks of
      unequal size: a padded tail's), an int; n above is then total * replicas.

  Returns:
    eta: a Python float, or a float64 scalar tensor for a tensor `records`.

  Raises:
    ParameterValueError: a count that is not a positive int, products < 0, or a plan whose
      gamma is not defined (k u >= 1).
  """
  if tf.is_tensor(records) or tf.is_tensor(chunks):
    return _rounding_margin_tensor(records, chunks, replicas, block, dtype, products, final)
  rows = int(records) * int(chunks) if total is None else min(int(total),
                                                              int(records) * int(chunks))
  for name, value, low in (("records", records, 1), ("chunks", chunks, 1),
                           ("replicas", replicas, 1), ("block", block, 1),
                           ("products", products, 0), ("final", final, 0)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise ParameterValueError(
          f"`{name}` must be an int >= {low}. Received: {name}={value!r}")
  u = unit_roundoff(dtype)
  block = min(int(block), int(records))   # a block's padding rows are zeros: x + 0 is exact
  depth = (tree_depth(-(-int(records) // int(block))) + int(chunks) - 1 + int(replicas) - 1
           + int(final))
  if max(depth, block - 1) * u >= 0.5:
    raise ParameterValueError(
        f"the plan's rounding bound is not defined (depth {depth}, block {block}). "
        f"Received: records={records}, chunks={chunks}, replicas={replicas}, block={block}")
  return _margin(rows * int(replicas), depth, block, u, products)


def _margin(n, depth, block, u, products):
  """`rounding_margin`'s formula (its docstring), n rows in all; Python floats or tensors."""
  g1, g2 = _gamma(block - 1, u), _gamma(depth, u)
  bound = (1 + g1 * (2 * block - 1)) * (1 + g2) + 2 * g2 * (1 + g1) * (n - 1)
  return bound * (1 + u) ** products - 1.0


def _rounding_margin_tensor(records, chunks, replicas, block, dtype, products, final):
  """`rounding_margin` of a row count known at run time only (a scalar int tensor): the same
  formula in float64, the depth ceil(log2 ceil(records / block)) in integers."""
  u = unit_roundoff(dtype)
  rows = tf.maximum(tf.cast(records, tf.int64), 1)
  block = tf.minimum(rows, tf.constant(int(block), tf.int64))   # padding rows: exact zeros
  leaves = (rows + block - 1) // block
  powers = tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.range(63, dtype=tf.int64))
  depth = tf.reduce_sum(tf.cast(leaves - 1 >= powers, tf.int64))   # the bit length of leaves - 1
  chunks = tf.maximum(tf.cast(chunks, tf.int64), 1)
  depth = tf.cast(depth + chunks - 1 + replicas - 1 + final, tf.float64)
  n = tf.cast(rows * chunks * replicas, tf.float64)
  return _margin(n, depth, tf.cast(block, tf.float64), u, products)


def shrink(eta, dtype=tf.float32):
  """1 / (1 + eta) rounded DOWN to `dtype`: the factor each record's clip is multiplied by
  (C' = C shrink <= C / (1 + eta)).

  Args:
    eta: `rounding_margin`'s value (>= 0): a Python float, or a float64 scalar tensor.
    dtype: float32 or float64.

  Returns:
    a Python float exactly representable in `dtype`, or a scalar `dtype` tensor for a
    tensor `eta`.
  """
  if tf.is_tensor(eta):
    eta = tf.cast(eta, tf.float64)
    s = tf.cast(1.0 / (1.0 + eta), dtype)
    up = tf.cast(s, tf.float64) * (1.0 + eta) > 1.0   # the rounding went up: one float below
    return tf.where(up, tf.math.nextafter(s, tf.zeros_like(s)), s)
  np_dtype = np.float64 if tf.as_dtype(dtype) == tf.float64 else np.float32
  s = np_dtype(1.0 / (1.0 + eta))
  while float(s) * (1.0 + eta) > 1.0:   # the rounding went up: the next float below
    s = np.nextafter(s, np_dtype(0.0))
  return float(s)


_CHUNKS = threading.local()   # .stack: the chunk counts of the enclosing `sequential_chunks`


_PUBLIC = threading.local()   # .stack: the `public_plan`s of the enclosing blocks


@contextlib.contextmanager
def public_plan(rows, records, chunks=1, block=1):
  """Within the block, a DP step's shrink is that of a plan that does not depend on which
  records are present: at most `rows` rows (a public bound, the same on neighbouring
  datasets), summed as `records` rows per chunk in `chunks` chunks with blocks of at most
  `block` rows (`public_shrink`). Per thread.

  Why (add/remove one record; the unit: the L2 norm of a record's clipped term): an
  unpadded batch has n rows on D and n + 1 on D' = D + r. A shrink s(n) taken from the rows
  gives sum_D s(n) x_i and sum_D' s(n + 1) x_i + s(n + 1) x_r, whose difference holds
  (s(n + 1) - s(n)) sum_D x_i: up to n |s(n + 1) - s(n)| C more than C (in float32 about
  2.4e-4 C at n = 255, 7.9e-3 C at n = 256, where the tree gains a level), and r's arrival
  shifts the rows after it, so no block is computed identically on both. A shrink of a public plan covering both
  removes the first term; `public_shrink` charges the second (every term's block roundings).

  Args:
    rows: the public bound on the rows of a replica's batch (an int >= 1).
    records, chunks: the plan of `rows` rows (the chunks' layout of that many rows).
    block: the largest block of rows summed in any order before the pinned tree.
  """
  with _pushed(_PUBLIC, (rows, records, chunks, block)):
    yield


@contextlib.contextmanager
def _pushed(local, value):
  """`value` on top of the per-thread stack `local.stack` within the block."""
  stack = getattr(local, "stack", None)
  if stack is None:
    stack = local.stack = []
  stack.append(value)
  try:
    yield
  finally:
    stack.pop()


def current_public_plan():
  """(rows, records, chunks, block) of the innermost `public_plan` block, or None."""
  stack = getattr(_PUBLIC, "stack", None)
  return stack[-1] if stack else None


def public_shrink(rows, records, chunks=1, block=1, final=0):
  """`step_shrink` of the sum of a batch of `rows` rows planned as (`records`, `chunks`,
  `block`), made independent of the rows inside a `public_plan` block: there the shrink is
  that of the public plan, with every term charged its block's b - 1 roundings as levels of
  the tree (blocks of 1: the rows of a block differ between D and D' once a record's arrival
  shifts the others), and the batch's rows are checked against the bound
  (`within_public_rows`; past it the shrink is NaN, which XLA keeps: the step then updates
  nothing finite).

  Args:
    rows: the batch's rows (an int or scalar int tensor), or None where the caller checks
      them (a chunk of the batch).
    records, chunks, block, final: the batch's own plan (`step_shrink`), used outside a
      `public_plan` block.

  Returns:
    a float32 Python float or scalar tensor in (0, 1] (NaN past the bound).

  Raises:
    PrivacyConfigError: rows known to the trace above the public bound.
  """
  plan = current_public_plan()
  if plan is None:
    return step_shrink(records, chunks=chunks, block=block, final=final)
  bound, records, chunks, most = plan
  block = max(int(block), int(most))
  s = step_shrink(records, chunks=chunks, block=1, final=final + block - 1, total=bound)
  within = True if rows is None else within_public_rows(rows)
  if within is True:
    return s
  with tf.control_dependencies([within]):
    s = tf.identity(tf.convert_to_tensor(s, tf.float32))
  return tf.where(within, s, tf.constant(float("nan"), tf.float32))


def within_public_rows(rows):
  """Checks a batch's rows against the innermost `public_plan`'s bound: True where the
  trace knows them (or outside a block), else a bool scalar tensor guarded by a run-time
  assertion (graph mode; XLA drops assertions, so callers also make the result NaN).

  Args:
    rows: an int or scalar int tensor.

  Returns:
    True, or a scalar bool tensor.

  Raises:
    PrivacyConfigError: rows known to the trace above the bound.
  """
  plan = current_public_plan()
  if plan is None:
    return True
  bound = int(plan[0])
  static = tf.get_static_value(rows) if tf.is_tensor(rows) else rows
  if static is not None:
    if int(static) > bound:
      raise PrivacyConfigError(
          f"`rows` must be at most {bound}, the public bound of an add/remove step's plan "
          "(twice the padded size of the declared sampling: the clip shrink may not depend "
          f"on which records are present). Received: rows={int(static)}")
    return True
  rows = tf.cast(rows, tf.int64)
  check = tf.debugging.assert_less_equal(
      rows, tf.constant(bound, tf.int64),
      message=f"`rows` must be at most {bound}, the public bound of an add/remove step's plan")
  with tf.control_dependencies([check]):
    return tf.identity(rows <= bound)


def step_shrink(records, chunks=1, block=1, final=0, total=None):
  """The clip shrink `shrink(rounding_margin(...))` of a DP step's clipped sum: `records` rows
  per chunk, `chunks` chunks added one after the other, blocks of `block` rows, the current
  tf.distribute strategy's replicas all-reduced, 4 roundings of each term's own products (the
  clip factor, a public scale and this shrink multiplied in, the term times its weight) and
  `final` roundings of the sum. A record clipped to S and multiplied by it moves the float32
  sum by at most S (Casacuberta et al., "Widespread underestimation of sensitivity in
  differentially private libraries and how to fix it", CCS 2022).

  Args:
    records: rows per chunk, padding included (an int, or a scalar int tensor).
    chunks: the chunks (an int, or a scalar int tensor).
    block: rows summed in any order before the pinned tree.
    final: roundings of the whole sum after it is formed.
    total: the rows of all chunks together (`rounding_margin`), None: records * chunks.

  Returns:
    a float32 Python float or scalar tensor in (0, 1].
  """
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  return shrink(rounding_margin(records, chunks=chunks, replicas=replicas, block=block,
                                products=4, final=final, total=total))


@contextlib.contextmanager
def sequential_chunks(chunks, records=None):
  """Within the block, a clipped sum formed per physical chunk is added to the sums of
  `chunks` chunks one after the other (`current_chunks`; the caller that chunks the batch
  opens it around its chunks' sums). Per thread.

  Args:
    chunks: K >= 1 (an int, or a scalar int tensor).
    records: rows of the largest chunk (an int or scalar int tensor), None when every chunk
      is a call of the same rows: each chunk's sum then charges the plan of the largest, so
      that every record of the batch is scaled by one shrink (`current_chunk_rows`).
  """
  with _pushed(_CHUNKS, (chunks, records)):
    yield


def current_chunks():
  """K of the innermost `sequential_chunks` block (1 outside: the batch in one sum)."""
  stack = getattr(_CHUNKS, "stack", None)
  return stack[-1][0] if stack else 1


def current_chunk_rows():
  """Rows of the largest chunk of the innermost `sequential_chunks` block (None: outside
  one, or not stated)."""
  stack = getattr(_CHUNKS, "stack", None)
  return stack[-1][1] if stack else None


def pairwise_sum(x):
  """sum_i x[i] over the leading axis by a pinned binary tree: the rows padded with zero rows
  to 2^d (d = ceil(log2 n); x + 0 is exact), then d levels of x[:h] + x[h:] (elementwise adds,
  which XLA and Grappler keep as written; n unknown to the trace: the same tree in a
  tf.while_loop over rows of one shape). Each row's term goes through d roundings in an
  order fixed by the row's index alone (`rounding_margin`).

  Args:
    x: a float tensor [n, ...]; n static or not (then a tf.while_loop of halvings).

  Returns:
    the sum, x.shape[1:].
  """
  x = tf.convert_to_tensor(x)
  tail = [[0, 0]] * (x.shape.rank - 1)
  n = x.shape[0]
  if n is not None:
    p = 1 << tree_depth(max(n, 1))
    if p > n:
      x = tf.pad(x, [[0, p - n]] + tail)
    while p > 1:
      p //= 2
      x = x[:p] + x[p:]
    return x[0]
  return _pairwise_sum_dynamic(x)


def _pairwise_sum_dynamic(x):
  """`pairwise_sum` of a row count n the trace does not know, in shapes that stay [n, ...]
  (XLA compiles it): the same tree (rows past n are the zero padding), level h = p/2, ..., 1
  setting row j < h to row j + row j + h in a tf.while_loop; rows at or past h are left as
  they are and never read again."""
  rank = x.shape.rank
  x = tf.pad(x, [[0, tf.cast(tf.equal(tf.shape(x)[0], 0), tf.int32)]] + [[0, 0]] * (rank - 1))
  n = tf.shape(x)[0]
  index = tf.range(n)
  column = lambda t: tf.reshape(t, [-1] + [1] * (rank - 1))
  p = tf.while_loop(lambda q: q < n, lambda q: q * 2, [tf.constant(1)])
  p = p[0] if isinstance(p, (list, tuple)) else p

  def level(h, y):
    partner = index + h
    other = tf.gather(y, tf.minimum(partner, n - 1))
    other = tf.where(column(partner < n), other, tf.zeros_like(other))   # the zero padding
    return h // 2, tf.where(column(index < h), y + other, y)

  _, x = tf.while_loop(lambda h, y: h >= 1, level, (p // 2, x))
  return x[0]
