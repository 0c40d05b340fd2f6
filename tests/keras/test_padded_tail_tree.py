"""The padded tail's chunk sums combined by a pinned tree of adjacent pairs (summation.tree_push /
tree_total on a nest, as chunking._sum_over_padded_tail uses them) and the plan that states it (summation.TreeChunks):
bit for bit against a numpy simulation of the tree in graph mode and under XLA, adversarial
values (mixed magnitudes, cancellations), every leaf count up to 33."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.optimizer import chunking


def _np_tree(x, adjacent):
  """The trees in numpy float32: zero leaves to 2^d, then x[2i] + x[2i + 1] (adjacent: the
  chunks' tree) or x[:h] + x[h:] (summation.pairwise_sum's)."""
  x = np.asarray(x, np.float32)
  p = 1 << summation.tree_depth(max(len(x), 1))
  x = np.concatenate([x, np.zeros((p - len(x),) + x.shape[1:], np.float32)])
  while p > 1:
    p //= 2
    x = x[0::2] + x[1::2] if adjacent else x[:p] + x[p:]
  return x[0]


def _leaves(k, width=5, seed=0):
  rng = np.random.RandomState(seed + k)
  scale = rng.choice([1e-8, 1e-3, 1.0, 3e3, 1e7], (k, width))
  return (rng.randn(k, width) * scale).astype(np.float32)


_COUNTS = list(range(1, 18)) + [31, 32, 33]


@functools.lru_cache(maxsize=None)
def _counter_run(levels, jit):
  """The tree of the first runs + 1 rows of x by tree_push / tree_total, in a while loop (one
  function per stack size; in a graph its rows unknown to the trace)."""

  @tf.function(jit_compile=jit,
               input_signature=None if jit else [tf.TensorSpec([None, 5], tf.float32),
                                                 tf.TensorSpec([], tf.int32)])
  def run(x, runs):
    stack = tf.zeros([levels, x.shape[1]], tf.float32)
    stack = tf.tensor_scatter_nd_update(stack, [[0]], x[:1])

    def body(i, stack):   # a nest of one leaf, as the padded tail's sums
      return i + 1, summation.tree_push(stack, i + 1, {"v": x[i + 1]})

    _, stack = tf.while_loop(lambda i, _: i < runs, body, (tf.constant(0), {"v": stack}))
    return summation.tree_total(stack, runs + 1)["v"]

  return run


@pytest.mark.parametrize("jit", [False, True])
def test_the_binary_counter_is_the_adjacent_pairs_tree_bit_for_bit(jit):
  """In a graph, each count k with a stack of exactly ceil(log2 k) + 1 levels (the top slot
  written when k is a power of two; one trace per stack size, 7 for the 20 counts). Under
  XLA, one compiled program for every k, as the padded tail runs it: the leaves padded to
  the largest count's rows, the stack sized for that count and the number of leaves a
  run-time value (one compilation instead of one per k; benchmarks/SUITE_CUTS.md, session
  45)."""
  rows = max(_COUNTS)
  shared = _counter_run(summation.tree_depth(rows) + 1, True) if jit else None
  for k in _COUNTS:
    x = _leaves(k)
    if jit:
      padded = np.concatenate([x, np.zeros((rows - k, x.shape[1]), np.float32)])
      got = shared(tf.constant(padded), tf.constant(k - 1)).numpy()
    else:
      got = _counter_run(summation.tree_depth(k) + 1, False)(tf.constant(x),
                                                             tf.constant(k - 1)).numpy()
    np.testing.assert_array_equal(got, _np_tree(x, True), err_msg=f"k={k}, jit={jit}")


@pytest.mark.parametrize("jit", [False, True])
def test_a_padded_tail_sums_its_chunks_by_the_tree(jit):
  """sum_over_chunks of a PaddedTail layout: the first chunk's and each run tail chunk's sum
  (summation.pairwise_sum within a chunk) combined by the tree; chunks after the last real
  record skipped (zero leaves: the same root)."""
  first, chunk, m = 16, 8, 16 + 8 * 9
  layout = chunking.PaddedTail(first, chunk)
  x = _leaves(m, seed=7)

  def chunk_fn(acc, rec, msk):
    s = summation.pairwise_sum(rec * msk[:, None])
    return (s if acc is None else acc + s), tf.reduce_sum(msk), msk

  @tf.function(jit_compile=jit)
  def run(x, mask):   # one trace for every mask below (the real records: a run-time value)
    return chunking.sum_over_chunks(chunk_fn, None, x, mask, layout)

  for real in (3, 16, 17, 40, m):
    mask = np.zeros(m, np.float32)
    mask[:real] = 1.0
    total, count, aux = run(tf.constant(x), tf.constant(mask))
    xm = x * mask[:, None]
    sums = [_np_tree(xm[:first], False)]
    runs = max(0, -(-(real - first) // chunk))
    sums += [_np_tree(xm[first + i * chunk:first + (i + 1) * chunk], False) for i in range(runs)]
    np.testing.assert_array_equal(total.numpy(), _np_tree(sums, True), err_msg=f"real={real}")
    assert float(count) == real
    np.testing.assert_array_equal(aux.numpy()[:m], mask)


def test_the_plan_of_a_padded_tail_states_the_tree():
  records, chunks = chunking._plan_of(chunking.PaddedTail(4096, 32), 8704)
  assert records == 4096 and isinstance(chunks, summation.TreeChunks) and chunks == 1 + 144
  records, chunks = chunking._plan_of(chunking.PaddedTail(4096, 32), tf.constant(8704))
  assert tf.is_tensor(chunks)   # unknown rows: chunks one after the other
  # the tree's margin: every chunk through ceil(log2 K) = 8 additions instead of up to 144
  seq = summation.rounding_margin(4096, 145, block=64, products=4, total=8704)
  tree = summation.rounding_margin(4096, summation.TreeChunks(145), block=64, products=4,
                                   total=8704)
  assert tree < 0.4 * seq
  u = 2.0 ** -24
  # shifted: 2 u (1 + gamma_H) n H (1 + u)^4 - 1 with H = 63 + 6 + 8 for all 8704 rows
  h = 63 + 6 + 8
  expect = (1 + 2 * u * (1 + h * u / (1 - h * u)) * 8704 * h) * (1 + u) ** 4 - 1
  assert tree == pytest.approx(expect, rel=1e-12)
  # one chunk: the same plan either way; the slot relation too
  for shifted in (True, False):
    assert summation.rounding_margin(64, summation.TreeChunks(1), shifted=shifted) == (
        summation.rounding_margin(64, 1, shifted=shifted))
    assert summation.rounding_margin(64, summation.TreeChunks(9), shifted=shifted) < (
        summation.rounding_margin(64, 9, shifted=shifted))
  assert repr(summation.TreeChunks(3)) == "TreeChunks(3)"
