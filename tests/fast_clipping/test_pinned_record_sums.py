"""The pinned sum over records of a layer whose per-record gradients are not kept
(rules/budget.pinned_sum_over_records, dp_query/summation.tree_push / tree_total): records in
chunks of a power of two, each chunk by summation.pairwise_sum, the chunks' sums by a pinned
binary tree kept as a counter in a tf.while_loop.

Checked bit for bit against a numpy float32 evaluation of the same tree (the order is the
plan whose rounding summation.rounding_margin bounds: every record through ceil(log2 R)
additions), in graph mode and under XLA, with a batch the trace knows and (graph mode) one it
does not; padding examples add exactly nothing; and the float64 sum is met to within the
tree's rounding bound (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
Sec. 4.2: |error| <= gamma_d sum |x_i|, d = ceil(log2 R)).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping.rules import budget

# Nightly tier (-m slow): the tree of each count in one mode by default, graph and XLA in turn
# ([False-1], [True-2], [False-3], [True-5], [False-8], [True-11]), the other mode nightly.
SLOW_CASES = {f"test_tree_push_and_total_are_the_adjacent_pair_tree[{jit}-{count}]"
              for i, count in enumerate([1, 2, 3, 5, 8, 11]) for jit in (i % 2 == 0,)}


def _pairwise(rows):
  """summation.pairwise_sum in numpy float32: padded to 2^d, x[:h] + x[h:] per level."""
  rows = np.asarray(rows, np.float32)
  p = 1 << summation.tree_depth(max(len(rows), 1))
  x = np.concatenate([rows, np.zeros((p - len(rows),) + rows.shape[1:], np.float32)])
  while len(x) > 1:
    h = len(x) // 2
    x = x[:h] + x[h:]
  return x[0]


def _adjacent_tree(leaves):
  """The tree of adjacent pairs over leaves padded with zeros to a power of two (float32)."""
  x = np.asarray(leaves, np.float32)
  p = 1 << summation.tree_depth(max(len(x), 1))
  x = np.concatenate([x, np.zeros((p - len(x),) + x.shape[1:], np.float32)])
  while len(x) > 1:
    x = x[0::2] + x[1::2]
  return x[0]


def _reference(rows, records):
  chunks = [rows[i:i + records] for i in range(0, len(rows), records)]
  if len(chunks) == 1:
    return _pairwise(rows)
  return _adjacent_tree([_pairwise(c) for c in chunks])


def _adversarial_rows(n, width, seed):
  """Rows of widely different magnitudes and signs: every addition rounds."""
  rng = np.random.RandomState(seed)
  return (rng.normal(size=(n, width)) * 10.0 ** rng.randint(-6, 7, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 11])
@pytest.mark.parametrize("jit", [False, True])
def test_tree_push_and_total_are_the_adjacent_pair_tree(count, jit):
  leaves = _adversarial_rows(count, 5, count)
  levels = summation.tree_depth(count) + 1

  @tf.function(jit_compile=jit)
  def run(leaves):
    stack = tf.zeros([levels, 5], tf.float32)
    _, stack = tf.while_loop(lambda i, _: i < count,
                             lambda i, s: (i + 1, summation.tree_push(s, i, leaves[i])),
                             (tf.constant(0), stack))
    return summation.tree_total(stack, tf.constant(count))

  got = run(tf.constant(leaves)).numpy()
  np.testing.assert_array_equal(got, _adjacent_tree(leaves))


def _records_sum(rows, records, jit, known=True, k=1):
  """budget.pinned_sum_over_records of rows [R, width] (records of k examples: the example
  rows [R k, width], the record's row the first example's, the others zero; a factor column
  zero on padding)."""
  r, width = rows.shape
  examples = np.zeros((r * k, width), np.float32)
  examples[::k] = rows
  spec = tf.TensorSpec([r * k if known else None, width], tf.float32)

  def body(xc, cc):   # the record's term: its first example's row, weighted by its factor
    seen.append(xc.shape[0])
    x = tf.reshape(xc * cc[:, None], [-1, k, width])
    return tf.reduce_sum(x, axis=1)

  seen = []
  fn = tf.function(lambda x: budget.pinned_sum_over_records(
      body, (x, tf.ones([tf.shape(x)[0]], tf.float32)), k, records, width),
                   input_signature=[spec], jit_compile=jit)
  return fn(tf.constant(examples)).numpy(), seen


@pytest.mark.parametrize("rows,records,jit,known", [
    (13, 4, False, True), (13, 4, True, True), (16, 4, True, True), (13, 4, False, False),
    (3, 4, False, True), (9, 1, True, True), (7, 2, False, False)])
def test_pinned_sum_over_records_is_the_plan_bit_for_bit(rows, records, jit, known):
  x = _adversarial_rows(rows, 6, rows + records)
  got, seen = _records_sum(x, records, jit, known)
  np.testing.assert_array_equal(got, _reference(x, records))
  if rows > records:   # one chunk of `records` rows at a time
    assert records in seen
  # the float64 sum, within the tree's bound gamma_d sum |x_i|
  d = summation.tree_depth(rows)
  gamma = d * 2.0 ** -24 / (1 - d * 2.0 ** -24)
  exact = x.astype(np.float64).sum(axis=0)
  assert np.all(np.abs(got - exact) <= gamma * np.abs(x.astype(np.float64)).sum(axis=0))


@pytest.mark.parametrize("jit", [False, True])
def test_records_of_two_and_the_padded_chunk(jit):
  """Records of k = 2 examples in chunks of 4 records (8 examples): 11 records, the last
  chunk padded with 2 zero examples; the same tree as 11 one-example records."""
  x = _adversarial_rows(11, 3, 7)
  got, seen = _records_sum(x, 4, jit, k=2)
  assert set(seen) <= {8}
  np.testing.assert_array_equal(got, _reference(x, 4))


def test_records_per_pinned_chunk_is_a_power_of_two_within_the_budget(monkeypatch):
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1000)
  assert budget.records_per_pinned_chunk(100) == 8
  assert budget.records_per_pinned_chunk(1001) == 1
  assert budget.records_per_pinned_chunk(10, cap=4) == 4
