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


class TreeChunks(int):
  """A count K of chunks whose sums are combined by a pinned binary tree (each chunk's sum
  through ceil(log2 K) additions: keras.optimizer.chunking's padded tail) rather than added
  one after the other; an int everywhere else (`rounding_margin` reads the difference)."""

  def __repr__(self):
    return f"TreeChunks({int(self)})"


def rounding_margin(records, chunks=1, replicas=1, block=1, dtype=tf.float32, products=0,
                    final=0, total=None, shifted=True):
  """eta >= 0 such that, with every record's term of norm <= C / (1 + eta), adding or
  removing one record moves the computed float sum by at most C.

  Unit: the L2 norm of the summed terms (C's unit). Relation: add/remove one record r, in one
  of two forms. `shifted` True: the rows of D and D' = D + r are laid out in the same static
  plan but r's arrival may shift the rows after it (a batch gathered in index order, as
  fit's Poisson batches and unpadded batches are), so any partial sum may differ; valid for
  every arrangement of the rows. `shifted` False: r is a masked row (term 0) of the same plan
  on D, every other row in the same slot on both.

  Plan (static; padding rows count as records): each chunk holds `records` rows, formed in
  blocks of b = min(`block`, records) rows summed in ANY order (a matrix product: each
  coordinate may have its own order), the blocks combined by `pairwise_sum` (the same binary
  tree for every coordinate, depth d = ceil(log2 ceil(records / b))); the K = `chunks` chunks'
  sums added one after the other into an accumulator (chunk 1 and 2 through K - 1
  additions, chunk k >= 2 through K - k + 1), or, for a `TreeChunks` K, combined by a
  pinned binary tree of the chunks' sums (every chunk through ceil(log2 K) additions, a
  node of level l holding at most 2^l chunks); the R = `replicas` replicas' sums added in any
  order (an all-reduce); then `final` roundings of the whole sum (a scale s <= 1 multiplied
  in: fl(s y) = s y + e, |e| <= u |s y|, counted as levels). Every term goes through at most
  H = (b - 1) + d + (K - 1) + (R - 1) + final roundings.

  Derivation (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 2.2
  and Lemma 3.1; round to nearest, u the unit roundoff). Each addition of computed values
  gives fl(a + c) = a + c + e, |e| <= u |a + c| componentwise, and a partial sum over a set V
  of rows has |a + c| <= (1 + gamma_H) sum_{i in V} |x_i| (every term through at most H
  roundings, gamma_H = H u / (1 - H u)), so in norm ||e|| <= u (1 + gamma_H) m_V C'' where m_V
  bounds the rows of V and C'' = C' (1 + u)^products bounds a term's norm after its own
  products' roundings (C' the clip).
  Shifted: the computed sum is the exact sum of the terms plus E = sum of every addition's e;
  per coordinate sum_v |e_v| <= u (1 + gamma_H) sum_i depth_i |x_i| (a row is in as many
  partial sums as roundings on its path), so ||E|| <= u (1 + gamma_H) C'' sum_i depth_i with
  depth_i the row's largest rounding count over coordinates: (b - 1) + d + c_k + (R - 1) +
  final, c_k its chunk's count. The exact sums differ by r's term, so the move is at most
      C'' [1 + 2 u (1 + gamma_H) P],   P = max over <= n rows of sum_i depth_i,
  n = rows in all (P: the rows placed in the chunks of most additions first).
  Slot: a partial sum that does not contain r is the same float on D and D'; one that does,
  v = fl(a + c) with a holding r, moves by at most ||a - a'|| + u (||a + c|| + ||a' + c||) <=
  ||a - a'|| + u (1 + gamma_H) (2 m_v - 1) C'' (m_v rows with r, m_v - 1 without). Summed up
  r's path from its leaf (a move of ||x_r|| <= C''): r's block (at most b - 1 nodes of at
  most b rows each, any order per coordinate: the bound of the worst order), the tree's level
  l = 1..d (a node of min(2^l b, records) rows), the accumulator after chunk j + 1 (at most
  min((j + 1) records, rows per replica) rows, j = 1..K - 1), the all-reduce (any order: R - 1
  nodes of n rows) and the finals (n rows each):
      C'' [1 + u (1 + gamma_H) S],   S = sum over those nodes of (2 m_v - 1),
  about 4 u n C'' for one row per record: no log factor (2.4e-4 -> 6.5e-5 at n = 256).
  eta is the bracket times (1 + u)^products, minus 1. Shifted, one row per record in one
  chunk: 2 u ceil(log2 n) n, as Higham's gamma bound (2.4e-4 at n = 256, 1.2e-3 at 1024,
  0.0127 at 8192 in float32). The float32 norm of each record (its clip factor) is not part
  of this bound: see docs/design.md, "Floating point".

  Args:
    records: rows per chunk (>= 1): a Python int (the static plan), or a scalar int tensor
      (rows known at run time only; padding rows count).
    chunks: K >= 1 chunks added sequentially (an int, or a scalar int tensor), or a
      `TreeChunks` (combined by a pinned tree).
    replicas: R >= 1 replicas' sums added in any order.
    block: rows summed in any order before the tree (>= 1); a block of more rows than
      `records` counts `records` (its other rows are zero padding, added exactly).
    dtype: the sum's dtype (float32 or float64).
    products: roundings of each term before the sum (>= 0).
    final: roundings of the sum after it is formed (>= 0).
    total: the rows of all chunks together where fewer than records * chunks (chunks of
      unequal size: a padded tail's), an int; n above is then total * replicas.
    shifted: the relation (above): True (the default) for any arrangement of the rows.

  Returns:
    eta: a Python float, or a float64 scalar tensor for a tensor `records` or `chunks`.

  Raises:
    ParameterValueError: a count that is not a positive int, products < 0, or a plan whose
      gamma is not defined (k u >= 1/2).
  """
  if tf.is_tensor(records) or tf.is_tensor(chunks):
    return _rounding_margin_tensor(records, chunks, replicas, block, dtype, products, final,
                                   shifted)
  for name, value, low in (("records", records, 1), ("chunks", chunks, 1),
                           ("replicas", replicas, 1), ("block", block, 1),
                           ("products", products, 0), ("final", final, 0)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise ParameterValueError(
          f"`{name}` must be an int >= {low}. Received: {name}={value!r}")
  tree = isinstance(chunks, TreeChunks)
  records, chunks, replicas = int(records), int(chunks), int(replicas)
  rows = records * chunks if total is None else min(int(total), records * chunks)
  u = unit_roundoff(dtype)
  block = min(int(block), records)   # a block's padding rows are zeros: x + 0 is exact
  depth = tree_depth(-(-records // block))
  across = tree_depth(chunks) if tree else chunks - 1   # a chunk's most additions
  most = (block - 1) + depth + across + replicas - 1 + int(final)
  if most * u >= 0.5:
    raise ParameterValueError(
        f"the plan's rounding bound is not defined (depth {most}). Received: "
        f"records={records}, chunks={chunks}, replicas={replicas}, block={block}")
  n = rows * replicas
  if shifted:
    # the chunks' additions: chunk 1 and 2 through K - 1, chunk k >= 2 through K - k + 1,
    # the rows placed where they are charged most
    counts = ([across] * chunks if tree else
              [chunks - 1] + [chunks - k + 1 for k in range(2, chunks + 1)])
    left, chunked = rows, 0
    for c in counts:
      take = min(records, left)
      chunked, left = chunked + take * c, left - take
    levels = n * ((block - 1) + depth + (replicas - 1) + int(final)) + replicas * chunked
    nodes = 2 * levels
  else:
    nodes = ((block - 1) * (2 * block - 1)
             + sum(2 * min(block << level, records) - 1 for level in range(1, depth + 1))
             + (sum(2 * min((records << level), rows) - 1 for level in range(1, across + 1))
                if tree else
                sum(2 * min((j + 1) * records, rows) - 1 for j in range(1, chunks)))
             + (replicas - 1 + int(final)) * (2 * n - 1))
  return _margin(nodes, most, u, products)


def _margin(nodes, most, u, products):
  """`rounding_margin`'s eta from the weighted node count (P or S of its docstring: 2 P or
  S) and H; Python floats or float64 tensors."""
  return (1.0 + u * (1.0 + _gamma(most, u)) * nodes) * (1.0 + u) ** products - 1.0


def _rounding_margin_tensor(records, chunks, replicas, block, dtype, products, final, shifted):
  """`rounding_margin` of a row count known at run time only (scalar int tensors, every
  chunk of `records` rows): the same formula in float64, the depth and the sums over the
  tree's levels and the chunks in closed form."""
  u = unit_roundoff(dtype)
  rows = tf.maximum(tf.cast(records, tf.int64), 1)
  block = tf.minimum(rows, tf.constant(int(block), tf.int64))   # padding rows: exact zeros
  leaves = (rows + block - 1) // block
  levels = tf.range(1, 64, dtype=tf.int64)
  powers = tf.bitwise.left_shift(tf.constant(1, tf.int64), levels - 1)
  on_path = leaves - 1 >= powers                                  # levels 1..d
  depth = tf.reduce_sum(tf.cast(on_path, tf.int64))               # the bit length of leaves - 1
  k = tf.maximum(tf.cast(chunks, tf.int64), 1)
  f64 = lambda t: tf.cast(t, tf.float64)
  most = f64(block - 1 + depth + k - 1 + replicas - 1 + final)
  n = f64(rows * k * replicas)
  b, m, kk = f64(block), f64(rows), f64(k)
  if shifted:
    chunked = m * (kk - 1.0) * (kk + 2.0) / 2.0   # sum of rows times the chunks' additions
    nodes = 2.0 * (n * (b - 1.0 + f64(depth) + replicas - 1 + final) + replicas * chunked)
  else:
    level_rows = tf.minimum(b * f64(tf.bitwise.left_shift(tf.constant(1, tf.int64), levels)), m)
    tree = tf.reduce_sum(tf.where(on_path, 2.0 * level_rows - 1.0, 0.0))
    nodes = ((b - 1.0) * (2.0 * b - 1.0) + tree
             + 2.0 * m * (kk * (kk + 1.0) / 2.0 - 1.0) - (kk - 1.0)
             + (replicas - 1 + final) * (2.0 * n - 1.0))
  return _margin(nodes, most, u, products)


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
  that of the public plan under `rounding_margin`'s shifted relation (a record's arrival
  shifts the rows after it: every row charged its block's b - 1 roundings and the whole
  tree), and the batch's rows are checked against the bound
  (`within_public_rows`; past it the shrink is NaN, which XLA keeps: the step then updates
  nothing finite). Outside one (a replace-one step: every batch has the same rows on both
  datasets, the replaced record in its slot; a step refuses an undeclared sampling) the
  batch's own plan under the slot relation.

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
  if plan is None:   # the same rows on both datasets: the slot relation
    return step_shrink(records, chunks=chunks, block=block, final=final)
  bound, records, chunks, most = plan
  s = step_shrink(records, chunks=chunks, block=max(int(block), int(most)), final=final,
                  total=bound, shifted=True)
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
          "(the public row bound R of the declared sampling: the clip shrink may not depend "
          f"on which records are present). Received: rows={int(static)}")
    return True
  within = tf.cast(rows, tf.int64) <= bound
  # one Assert op, unguarded (tf.debugging's assertions wrap it in a tf.cond: two branch
  # functions traced per call, about 25 ops of the step's trace for a scalar check)
  check = tf.raw_ops.Assert(condition=within, data=[
      f"`rows` must be at most {bound}, the public bound of an add/remove step's plan. "
      "Received: rows =", rows])
  with tf.control_dependencies([check]):
    return tf.identity(within)


def after_row_check(within, nest):
  """`nest` with its tensors made to wait for a row check (`within_public_rows`' result), so
  that no op reading them runs before the check's assertion: a batch past the public bound
  then fails with the bound's message, not with an error of an op planned for at most the
  bound's rows (a pinned sum's gather: "indices = 6 is not in [0, 6)" under a 2-replica
  MirroredStrategy, review of the per-replica row bound). A graph runs independent ops in
  any order; the control dependency fixes it.

  Args:
    within: True (nothing to wait for) or the scalar bool tensor `within_public_rows` made.
    nest: a nest of tensors (composite ones included), None or other leaves kept as they are.

  Returns:
    `nest`, its tensors identities made after the check.
  """
  if within is True:
    return nest
  with tf.control_dependencies([within]):
    return tf.nest.map_structure(lambda t: tf.identity(t) if tf.is_tensor(t) else t, nest)


def step_shrink(records, chunks=1, block=1, final=0, total=None, shifted=False):
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
    shifted: `rounding_margin`'s relation: False (the removed record a masked row in its
      slot: the batch's own plan, rows the same on both datasets) or True (rows may shift).

  Returns:
    a float32 Python float or scalar tensor in (0, 1].
  """
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  return shrink(rounding_margin(records, chunks=chunks, replicas=replicas, block=block,
                                products=4, final=final, total=total, shifted=shifted))


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


def in_xla_context():
  """True while a function is being traced for XLA (`tf.function(jit_compile=True)`, or a
  Keras model compiled with `jit_compile=True`): the graph or one of its outer graphs is an
  XLA context. The pinned sums pick their tree's form by it (`pairwise_sum`), and the fast
  path's rules XLA-friendly forms (XLA's CPU grouped convolutions, e.g. a batch-as-channels
  depthwise filter gradient, are orders of magnitude slower than a matmul).

  Returns:
    bool.
  """
  # TensorFlow has no public spelling of this test; tf.vectorized_map makes the same one.
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def pairwise_sum(x, const=None, most=None):
  """sum_i x[i] over the leading axis by a pinned binary tree: the rows padded with zero rows
  to 2^d (d = ceil(log2 n); x + 0 is exact), then d levels of x[:h] + x[h:] (elementwise adds,
  which XLA and Grappler keep as written; n unknown to the trace: the same tree in a
  tf.while_loop, over rows of one shape under XLA, else of halving shapes). Each row's term
  goes through d roundings in an order fixed by the row's index alone (`rounding_margin`).

  Args:
    x: a float tensor [n, ...]; n static or not (then a tf.while_loop of halvings).
    const: None, or a function (value, dtype) -> a constant tensor that the caller shares
      across the graph (e.g. keras.fast_clipping.algebra.const): a static n's tree then takes
      its padding and axis from it and halves by tf.split (one op and no new Const per
      level; the same additions).
    most: None, or a Python int bounding an n the trace does not know (a public bound the
      caller's step enforces): outside XLA the rows are then padded with zero rows to
      P = 2^ceil(log2 most), a shape the trace knows, and summed by the static tree, no
      tf.while_loop. Its levels above p = 2^ceil(log2 n) add zero rows (x + 0 = x), so the
      sums are those of the tree over p rows; more than P rows fail the padding (a negative
      pad) at run time.

  Returns:
    the sum, x.shape[1:].
  """
  x = tf.convert_to_tensor(x)
  tail = [[0, 0]] * (x.shape.rank - 1)
  n = x.shape[0]
  if n is not None:
    p = 1 << tree_depth(max(n, 1))
    if p > n:
      pads = [[0, p - n]] + tail
      x = tf.pad(x, pads if const is None else const(pads, tf.int32))
    while p > 1:
      p //= 2
      if const is None:
        x = x[:p] + x[p:]
      else:
        low, high = tf.split(x, 2, axis=const(0, tf.int32))
        x = low + high
    return x[0] if const is None else tf.squeeze(x, axis=[0])
  if in_xla_context():
    return _pairwise_sum_dynamic(x)
  if most is not None:
    width = 1 << tree_depth(max(int(most), 1))
    x = tf.pad(x, [[0, width - tf.shape(x)[0]]] + tail)   # n = 0: zero rows
    x.set_shape([width] + x.shape[1:].as_list())
    return pairwise_sum(x, const)
  return _pairwise_sum_shrinking([x])[0]


def pairwise_sum_after(head, tail, most=None, const=None, count=None):
  """`pairwise_sum` of the m + 1 leaves head[0], ..., head[m - 1], tail (leaf m) without
  stacking them or padding them to a power of two, and without a branch or a loop where the
  trace does not know m: the same additions, so the same sums bit for bit (but the sign of
  a zero: 0 + (-0) = +0) and `rounding_margin`'s tree.

  The tree: h = 2^(ceil(log2 (m + 1)) - 1), the largest power of two <= m (m >= 1).
  pairwise_sum's first level sets leaf i < h to leaf i + leaf i + h where i + h <= m (its
  partner is a zero padding leaf otherwise: x + 0 = x); every level after it adds the two
  halves of exactly h, h / 2, ..., 2 leaves (a complete tree: no padding left). So the first
  level is y = [head[:m - h] + head[h:m], head[m - h] + tail, head[m - h + 1:h]] (h leaves,
  one concatenation; [tail] for m = 0), and level j of the rest sums y reshaped to [f_j, c /
  f_j, ...] over its first axis: f_j = 2 is y[:c/2] + y[c/2:] (one addition per entry, exact
  as the two-term sum it is in any order; a float32 sum accumulated wider and rounded once
  is the same float), f_j = 1 an axis of one (no work: TensorFlow's reduction hands the
  buffer on); the last level sums y's 2 leaves or 1 as they are.
  A trace that does not know m reads the sizes [m - h, 1, 2h - m - 1, m - h] and the f_j from
  one constant table over the m <= `most` it can be (one gather: an m above `most` fails it
  at run time); one that knows m builds the tree statically. Cost: the tree's m leaf
  additions, h leaves written by the concatenation, none padded; `pairwise_sum` of the leaves
  stacked and padded to 2^ceil(log2 (most + 1)) writes that many and adds one fewer.

  Args:
    head: a float tensor [m, ...] (m static or not; the leaf shape static).
    tail: a float tensor of shape head.shape[1:].
    most: a Python int bounding an m the trace does not know (required then).
    const: None, or pairwise_sum's `const` (a shared-constant maker).
    count: None, or m as a scalar int32 tensor where the caller has it (else head's rows).

  Returns:
    the sum, tail's shape.

  Raises:
    ParameterValueError: m unknown to the trace and `most` None.
  """
  const = const or (lambda value, dtype: tf.constant(value, dtype))
  m = head.shape[0]
  if m is not None:   # the tree the trace knows
    m = int(m)
    if not m:
      return tail
    h = 1 << (m.bit_length() - 1)
    low, one, rest, high = tf.split(head, [m - h, 1, 2 * h - m - 1, m - h])
    y = [low + high] if m > h else []
    y = tf.concat(y + [one + tail[None]] + ([rest] if 2 * h > m + 1 else []), 0)
    return pairwise_sum(y, const) if h > 1 else y[0]
  if most is None:
    raise ParameterValueError(
        "`most` must bound the leaves of a head the trace does not know. Received: most=None")
  table, parts = _after_table(int(most), tail.shape.as_list())
  plan = tf.gather(const(table, tf.int32), tf.shape(head)[0] if count is None else count)
  plan = tf.split(plan, const(parts, tf.int32), num=len(parts)) if len(parts) > 1 else [plan]
  low, one, rest, high = tf.split(head, plan[0], num=4)
  # m = 0: `one` holds no leaf, its sum a zero leaf (x + 0 = x). The tail gets its axis
  # (a broadcasting add of [1, 1, N] and [1, N] is one Grappler makes a failing BiasAdd of)
  zero = const(0, tf.int32)
  y = tf.concat([low + high, tf.reduce_sum(one, zero, keepdims=True) + tf.expand_dims(
      tail, zero), rest], zero)
  for shape in plan[1:]:
    y = tf.reduce_sum(tf.reshape(y, shape), zero)
  return tf.reduce_sum(y, zero)   # the last level: y holds 2 leaves or 1


def _after_table(most, leaf):
  """`pairwise_sum_after`'s table for m = 0..most: row m the head's split sizes [m - h, 1,
  2h - m - 1, m - h] then, per level after the first but the last, the shape [f, -1] + leaf
  y is summed over the first axis of, f = 2 on the m's levels, 1 on the others (the last
  level sums y's 2 leaves or 1 as they are); and the row's parts' lengths."""
  levels = max(most, 1).bit_length() - 1   # log2 of the largest h
  rows = []
  for m in range(most + 1):
    h = 1 << (m.bit_length() - 1) if m else 0
    row = [m - h, 1, 2 * h - m - 1, m - h] if m else [0, 0, 0, 0]
    for j in range(levels - 1):
      row += [2 if j < max(h, 1).bit_length() - 1 else 1, -1] + list(leaf)
    rows.append(row)
  return rows, [4] + [2 + len(leaf)] * max(levels - 1, 0)


# Entries of a record summed in any order before `pinned_square_sum`'s tree: 64 keeps each
# square's rounding count small (63 + the tree's levels) and the tree's levels (one slice
# and one add each) few.
SQUARE_BLOCK = 64


def pinned_square_sum(x, block=SQUARE_BLOCK):
  """sum_j x_j^2 over every entry of x, in an order pinned by the entries' indices alone:
  the flattened squares padded with zeros to a multiple of b = `block` (x + 0 is exact),
  each block of b summed in any order (a reduce_sum over a last axis of b), then the blocks'
  sums by `pairwise_sum`'s tree of elementwise adds (`pinned_row_sums` of one row). Each
  square goes through at most (min(b, n) - 1) + ceil(log2 ceil(n / b)) additions
  (`square_sum_depth`), whatever the compiler does, where one reduction of all n terms may
  add tiny squares one at a time to a partial sum holding a big one and drop them (Higham,
  "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 4.2: up to n - 1 roundings
  per term). Not reductions of reductions: XLA merges those into one reduction of any order.

  Args:
    x: a float tensor of any shape (n entries, n static or not).
    block: b >= 1.

  Returns:
    a scalar of x's dtype.
  """
  return pinned_row_sums(tf.reshape(tf.square(x), [1, -1]), block)[0]


def pinned_row_sums(terms, block=SQUARE_BLOCK, const=None):
  """sum_j terms[r, j] of every row r of terms [R, ...] (nonnegative terms, e.g. a record's
  squares, one record a row) in `pinned_square_sum`'s order: each row's n entries padded
  with zeros to a multiple of b = `block`, each block summed in any order (one reduce_sum
  over a last axis of b), then the row's blocks by `pairwise_sum`'s tree (over the blocks'
  axis, moved to the front: elementwise adds of [R] rows). Each term goes through at most
  `square_sum_depth`(n) additions, whatever the compiler does (no reduction of a
  reduction, which XLA would merge into one of any order). Under XLA a block of more than
  XLA_WINDOW entries is summed as its windows' sums added (`_block_sums`): one of the orders
  "any order" allows, so the same bound.

  Args:
    terms: a float tensor [R, ...] (R static or not; n = the product of the other sizes,
      static or not).
    block: b >= 1.
    const: None, or a shared-constant function for the shapes and axes (`pairwise_sum`).

  Returns:
    [R] of terms' dtype.
  """
  terms = tf.convert_to_tensor(terms)
  c = (lambda v: v) if const is None else (lambda v: const(v, tf.int32))
  r = terms.shape[0]
  n = terms.shape[1:].num_elements()
  windows = _windows(block)
  if n is not None:
    if n <= (block if windows == 1 else XLA_WINDOW):   # one block (one window under XLA):
      # one reduction over the entries' axes, in any order: an einsum up to SQUARE_BLOCK
      # entries (its axes an attribute, no Const and no call for one), a reduce_sum above
      # (oneDNN's einsum ran a row of 512 squares, the tutorial CNN's dense layer's input at
      # B = 256, in 0.20 ms CPU against 0.10; no XLA, oneDNN on, load 6-7, 2026-12-04)
      if n > SQUARE_BLOCK:
        return tf.reduce_sum(terms, c(list(range(1, terms.shape.rank))))
      axes = "abcdefghijklmnopqrstuvwxyz"[:terms.shape.rank]
      return tf.einsum(f"{axes}->a", terms)
    rows = tf.reshape(terms, c([-1, n]))
    pad = -n % block
    if pad:
      rows = tf.pad(rows, c([[0, 0], [0, pad]]))
    blocks = _block_sums(rows, [-1, (n + pad) // block], block, windows, c)
    if (n + pad) // block == 1:   # one block: its sum, no tree
      return tf.squeeze(blocks, axis=[1])
  else:
    lead = r if r is not None else tf.shape(terms)[0]
    rows = tf.reshape(terms, [lead, -1])
    rows = tf.pad(rows, [[0, 0], [0, tf.math.floormod(-tf.shape(rows)[1], block)]])
    blocks = _block_sums(rows, [lead, -1], block, windows, lambda v: v)
  return pairwise_sum(tf.transpose(blocks, c([1, 0])), const)


# Entries XLA:CPU reduces as written: its tree-reduction pass rewrites a reduction over more
# than 32 entries of an axis into a reduce-window of 32 and a reduction of the windows' sums,
# which it does not fuse with the squares that feed it (the squares are written out, then
# read by a reduce-window that is not vectorized): the tutorial CNN's [256, 8192] per-record
# squares took 1.63 CPU ms per pinned_row_sums under XLA in that form, 1.22 in
# `_block_sums`' (load 10).
XLA_WINDOW = 32


def _windows(block):
  """The windows `_block_sums` splits a block of `block` entries into: block / XLA_WINDOW
  under XLA where that is a whole number above 1, else 1 (the block in one reduction)."""
  if block > XLA_WINDOW and block % XLA_WINDOW == 0 and in_xla_context():
    return block // XLA_WINDOW
  return 1


def _block_sums(rows, lead, block, windows, c):
  """The sums of `rows` [R, m] (m a multiple of `block`) over blocks of `block` consecutive
  entries, lead + [m / block] (`lead` the reshape's leading sizes, [R, m / block]): one
  reduction over a last axis of `block`, or with `windows` > 1 (`_windows`) a reduction over a
  last axis of XLA_WINDOW entries (which XLA:CPU fuses with the squares' producer) and the
  block's `windows` window sums added by tf.add_n. Either is an order of the block's entries,
  which `pinned_row_sums`' plan leaves free (at most block - 1 additions per entry)."""
  if windows == 1:
    return tf.reduce_sum(tf.reshape(rows, c(lead + [block])), axis=c(len(lead)))
  parts = tf.reduce_sum(tf.reshape(rows, c(lead + [windows, XLA_WINDOW])),
                        axis=c(len(lead) + 1))
  return tf.add_n(tf.unstack(parts, num=windows, axis=len(lead)))


def square_sum_depth(size, block=SQUARE_BLOCK):
  """The most additions a square goes through in `pinned_square_sum` of `size` entries:
  (min(b, n) - 1) + ceil(log2 ceil(n / b)).

  Args:
    size: n >= 0 entries (an int, or a scalar int tensor).
    block: b.

  Returns:
    an int, or a float64 scalar tensor for a tensor `size`.
  """
  if tf.is_tensor(size):
    n = tf.maximum(tf.cast(size, tf.float64), 1.0)
    leaves = tf.math.ceil(n / float(block))
    # ceil(log2 leaves) + 1: one level more than needed where log2 of a power of two
    # rounds up (exact in float64 below 2^50: the +1 only covers it)
    levels = tf.math.ceil(tf.math.log(leaves) / tf.math.log(tf.constant(2.0, tf.float64)))
    return (tf.minimum(n, float(block)) - 1.0) + levels + 1.0
  n = max(int(size), 1)
  return (min(block, n) - 1) + tree_depth(-(-n // block))


def pinned_norm(leaves, dtype=tf.float32):
  """(||x||~, s) of a record x given as its leaves: the norm sqrt of the leaves'
  `pinned_square_sum`s added by tf.add_n, and s = `shrink`(`norm_margin` of the leaves'
  sizes), the factor the clip is multiplied by so that the clipped record's norm is at most
  the clip (`norm_margin`'s derivation). One call: the clip's norm and its margin together.

  Args:
    leaves: a list of float tensors of `dtype` (the record's leaves).
    dtype: float32 or float64.

  Returns:
    (a scalar `dtype` tensor, a Python float or scalar `dtype` tensor in (0, 1]).
  """
  if not leaves:
    return tf.constant(0.0, dtype), 1.0
  sizes = []
  for x in leaves:
    shape = tf.TensorShape(x.shape)
    sizes.append(shape.num_elements() if shape.is_fully_defined() else tf.size(x))
  norm = tf.sqrt(tf.add_n([pinned_square_sum(x) for x in leaves]))
  return norm, shrink(norm_margin(sizes, dtype), dtype)


def norm_margin(sizes, dtype=tf.float32, block=SQUARE_BLOCK):
  """eta_norm >= 0 such that a record x (leaves of `sizes` entries) whose norm is computed
  as sqrt of `pinned_square_sum` per leaf, the leaves' sums combined by `pairwise_sum`, and
  clipped to C' = fl(C s), s = `shrink`(eta_norm), c = fl(C' / ||x||~), has c ||x|| <= C: the
  computed norm ||x||~ is taken low by at most the factor 1 / (1 + eta_norm), the clip
  raised by at most that factor's rounding. In float32 2.1e-6 for one leaf of 64 entries,
  2.5e-6 for one of 2^20 (H = 63 + 14).

  Derivation (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Secs. 2.2
  and 3.1; round to nearest, u the unit roundoff). Every square fl(x_j^2) = x_j^2 (1 + d),
  every addition fl(a + b) = (a + b)(1 + d), |d| <= u; the terms are nonnegative, so the
  computed sum is sum_j x_j^2 prod (1 + d) over at most H + 1 factors (the square and H
  additions: H = the largest `square_sum_depth` of a leaf + L - 1 for L leaves added in
  any order) and
  is at least (1 - u)^(H + 1) ||x||^2. The square root rounds once more:
  ||x||~ >= (1 - u)^((H + 1) / 2 + 1) ||x||. The clip C' = fl(C s) <= C s (1 + u) and the
  factor fl(C' / ||x||~) <= (C' / ||x||~)(1 + u) add two more factors, so
  c ||x|| <= C s (1 - u)^-k, k = (H + 1) / 2 + 3, and (1 - u)^-k <= 1 + gamma_k
  (Bernoulli: (1 - u)^k >= 1 - k u), so eta_norm = gamma_k makes c ||x|| <= C. Assumes the
  squares do not underflow (float32: entries above 2^-63 in magnitude matter, i.e. a clip
  C above about sqrt(n) 2^-63); a flushed square loses at most 2^-126 absolutely.

  Args:
    sizes: the leaves' entry counts (ints, or scalar int tensors).
    dtype: the norm's dtype (float32 or float64).
    block: `pinned_square_sum`'s b.

  Returns:
    a Python float, or a float64 scalar tensor when a size is a tensor.

  Raises:
    ParameterValueError: a bound that is not defined (k u >= 1/2).
  """
  u = unit_roundoff(dtype)
  sizes = list(sizes) or [0]
  leaves = len(sizes) - 1
  if any(tf.is_tensor(n) for n in sizes):
    depth = tf.reduce_max(tf.stack([tf.cast(square_sum_depth(n, block), tf.float64)
                                    for n in sizes])) + leaves
    return depth_margin(depth, 3, dtype)
  depth = max(square_sum_depth(n, block) for n in sizes) + leaves
  if ((depth + 1) / 2.0 + 3.0) * u >= 0.5:
    raise ParameterValueError(
        f"`sizes` must give a norm whose rounding bound is defined (k u < 1/2). "
        f"Received: sizes={sizes}")
  return depth_margin(depth, 3, dtype)


def depth_margin(depth, roundings=3, dtype=tf.float32):
  """gamma_k, k = (H + 1) / 2 + `roundings`, for a norm sqrt(s) whose computed sum of
  squares s is at least (1 - u)^(H + 1) times the exact one (H = `depth`: each square's
  rounding and at most H additions of nonnegative terms, `square_sum_depth` per pinned sum
  plus the additions that combine them) and that then goes through `roundings` more
  relative roundings up to the clip factor (`norm_margin`'s derivation: the square root,
  the clip's and the factor's, 3). A norm raised by the factor (1 + gamma_k), or a clip
  lowered by it, gives c ||x|| <= C (Higham, "Accuracy and Stability of Numerical
  Algorithms", 2nd ed., Sec. 3.1; (1 - u)^-k <= 1 + gamma_k).

  Args:
    depth: H >= 0, an int or a scalar float tensor.
    roundings: the relative roundings after the sum (an int).
    dtype: the norm's dtype (float32 or float64).

  Returns:
    a Python float, or a float64 scalar tensor for a tensor `depth`.

  Raises:
    ParameterValueError: a bound that is not defined (k u >= 1/2).
  """
  u = unit_roundoff(dtype)
  if tf.is_tensor(depth):
    k = (tf.cast(depth, tf.float64) + 1.0) / 2.0 + float(roundings)
    return k * u / (1.0 - k * u)
  k = (depth + 1) / 2.0 + roundings
  if k * u >= 0.5:
    raise ParameterValueError(
        f"`depth` must give a norm whose rounding bound is defined (k u < 1/2). "
        f"Received: depth={depth}")
  return _gamma(k, u)


def _tree_width(n):
  """p = 2^ceil(log2 max(n, 1)), the padded row count of `pairwise_sum`'s tree, for a scalar
  int32 tensor 0 <= n <= 2^30: the bits of max(n, 1) - 1 smeared right (v |= v >> s for
  s = 1, 2, 4, 8, 16 sets every bit below the highest), plus one. Integer operations only,
  no tf.while_loop (a graph loop costs the executor its frames at every step), the same p as
  doubling 1 until it reaches n."""
  v = tf.maximum(n, 1) - 1
  for shift in (1, 2, 4, 8, 16):
    v = tf.bitwise.bitwise_or(v, tf.bitwise.right_shift(v, shift))
  return v + 1


def pairwise_sums(xs):
  """`pairwise_sum` of each tensor of `xs` (a list of float tensors [n, ...], the same row
  count n in every one, e.g. a batch's per-record gradients, one tensor per variable): the
  same sums, bit for bit; where n is unknown to the trace outside XLA, one tf.while_loop of
  halvings carries every tensor (`_pairwise_sum_shrinking`), not one loop per tensor (each
  loop costs the executor its frames at every step, and the trace two functions and the tree
  width's ops: the tutorial CNN's vectorized step had eight).

  Args:
    xs: a list of float tensors [n, ...].

  Returns:
    a list of the sums, each x.shape[1:].
  """
  xs = [tf.convert_to_tensor(x) for x in xs]
  if len(xs) < 2 or any(x.shape[0] is not None for x in xs) or in_xla_context():
    return [pairwise_sum(x) for x in xs]
  return _pairwise_sum_shrinking(xs)


def _pairwise_sum_shrinking(xs):
  """`pairwise_sum` of each tensor of the list `xs` (row count n, the same in every one, unknown
  to the trace), outside XLA: the rows padded with zero rows to p = 2^d once, then level
  h = p/2, ..., 1 keeps x[:h] + x[h:2h] (shapes halve, which XLA cannot compile), every tensor
  in one tf.while_loop. The same tree and additions as `_pairwise_sum_dynamic`, bit for bit,
  at about n row additions where that one passes over all n rows at every level (a [10,
  25600] sum: 0.80 against 2.89 CPU ms, load 17)."""
  n = tf.shape(xs[0])[0]
  p = _tree_width(n)
  # n = 0: one zero row
  xs = [tf.pad(x, [[0, p - n]] + [[0, 0]] * (x.shape.rank - 1)) for x in xs]
  _, xs = tf.while_loop(lambda h, ys: h >= 1,
                        lambda h, ys: (h // 2, [y[:h] + y[h:2 * h] for y in ys]),
                        (p // 2, xs), shape_invariants=(
                            tf.TensorShape([]),
                            [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]))
  return [x[0] for x in xs]


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
  p = _tree_width(n)

  def level(h, y):
    partner = index + h
    other = tf.gather(y, tf.minimum(partner, n - 1))
    other = tf.where(column(partner < n), other, tf.zeros_like(other))   # the zero padding
    return h // 2, tf.where(column(index < h), y + other, y)

  _, x = tf.while_loop(lambda h, y: h >= 1, level, (p // 2, x))
  return x[0]


def tree_push(stack, count, value):
  """Adds leaf number `count` (0-based, a scalar int32 tensor) to a pinned binary tree kept
  as a counter, for leaves formed one at a time (a tf.while_loop over chunks: one extra
  leaf-sized buffer per level, not one per leaf). Slot l of `stack` ([levels, ...], levels >
  ceil(log2 K) for K leaves) holds the sum of the 2^l leaves of a complete subtree where bit l
  of `count` is set; the t trailing one bits of `count` are the subtrees the new leaf
  completes: carry = slot[t - 1] + (... + (slot[0] + value)), then written to slot t. The
  additions are those of a balanced binary tree of adjacent pairs over the leaves padded with
  zero leaves to a power of two (`tree_total`): each leaf through at most ceil(log2 K) of them,
  a node of level l holding 2^l leaves, as in `pairwise_sum` (which pairs i with i + K / 2
  instead): `rounding_margin`'s tree. Dynamic reads and writes of one slot, no host round trip.

  Args:
    stack: [levels, ...] float tensor (zeros before the first leaf), or a nest of them (one
      tree per leaf of the nest, merged in one loop).
    count: the leaf's index, a scalar int32 tensor.
    value: the leaf, stack.shape[1:] (a nest: `stack`'s structure).

  Returns:
    the new stack.
  """
  ones = tf.bitwise.bitwise_xor(count, count + 1)            # 2^(t + 1) - 1
  t = tf.cast(tf.raw_ops.PopulationCount(x=ones), tf.int32) - 1

  def merge(level, carry):
    return level + 1, tf.nest.map_structure(lambda slot, c: tf.gather(slot, level) + c,
                                            stack, carry)

  _, carry = tf.while_loop(lambda level, _: level < t, merge, (tf.constant(0), value))
  return tf.nest.map_structure(
      lambda slot, c: tf.tensor_scatter_nd_update(slot, tf.reshape(t, [1, 1]), c[None]),
      stack, carry)


def tree_total(stack, count):
  """The root of `tree_push`'s tree after `count` leaves (a scalar int32 tensor): the complete
  subtrees (the set bits of `count`) added from the smallest up, slot[l] + (the sum of the
  smaller ones), the root of the tree of adjacent pairs over the leaves padded with zero
  leaves (x + 0 is exact, so the padded tree's other additions change nothing).

  Args:
    stack: `tree_push`'s [levels, ...] stack (levels static or not), or a nest of them.
    count: the leaves pushed.

  Returns:
    stack.shape[1:] (a nest: `stack`'s structure).
  """
  if not tf.is_tensor(stack):
    return tf.nest.map_structure(lambda one: tree_total(one, count), stack)
  levels = stack.shape[0]
  total = tf.zeros_like(stack[0])

  def add(level, total):
    bit = tf.equal(tf.bitwise.bitwise_and(tf.bitwise.right_shift(count, level), 1), 1)
    return tf.where(bit, tf.gather(stack, level) + total, total)

  if levels is not None:
    for level in range(int(levels)):
      total = add(tf.constant(level), total)
    return total
  _, total = tf.while_loop(lambda level, _: level < tf.shape(stack)[0],
                           lambda level, total: (level + 1, add(level, total)),
                           (tf.constant(0), total))
  return total
