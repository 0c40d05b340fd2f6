"""Review R (session 29): the pinned pairwise order of the sum over records survives graph
mode and XLA (dp_query/summation.pairwise_sum, SumAggregationDPQuery.accumulate_records).

The clip shrink's margin (summation.rounding_margin; Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., Sec. 4.2) counts ceil(log2 n) roundings per record: it holds
only while the sum is computed in that tree. Rows of mixed magnitudes (1e-8 .. 1e8, random
signs) make every other order round differently, so a result bit-identical to a float32
numpy emulation of the tree shows the tree was kept. Tried to make XLA reassociate: the sum
inside a larger fused program (a scale before, a reduction after), rows from a concatenation,
an unknown row count, the query's own accumulate_records (clip 1e30: factor 1, mask 1:
every product exact).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter.dp_query import summation

D = 64


def _tree(x):
  """The tree of pairwise_sum's docstring in float32 numpy: pad to 2^d, halve d times."""
  x = np.asarray(x, np.float32)
  n = x.shape[0]
  p = 1 << summation.tree_depth(max(n, 1))
  x = np.concatenate([x, np.zeros((p - n,) + x.shape[1:], np.float32)])
  while p > 1:
    p //= 2
    x = (x[:p] + x[p:]).astype(np.float32)
  return x[0]


def _rows(n, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((n, D)) * 10.0 ** rng.integers(-8, 9, (n, D))).astype(np.float32)


def _forms():
  spec = [tf.TensorSpec([None, D], tf.float32)]
  query = dpq.GaussianSumQuery(1e30, 0.0)

  def in_query(x):
    state = query.initial_sample_state(tf.TensorSpec([D], tf.float32))
    params = query.derive_sample_params(query.initial_global_state())
    return query.accumulate_records(params, state, x, mask=tf.ones([tf.shape(x)[0]]))

  def fused(x):   # exact scale before (x 1), a reduction after: one XLA cluster
    s = summation.pairwise_sum(x * 1.0)
    return s + 0.0 * tf.reduce_sum(s)

  def concatenated(x):
    h = x.shape[0] // 2 if x.shape[0] is not None else tf.shape(x)[0] // 2
    return summation.pairwise_sum(tf.concat([x[:h], x[h:]], 0))

  return {
      "graph": tf.function(summation.pairwise_sum),
      "xla": tf.function(summation.pairwise_sum, jit_compile=True),
      "xla_unknown_n": tf.function(summation.pairwise_sum, jit_compile=True,
                                   input_signature=spec),
      "graph_unknown_n": tf.function(summation.pairwise_sum, input_signature=spec),
      "xla_fused": tf.function(fused, jit_compile=True),
      "xla_concat": tf.function(concatenated, jit_compile=True),
      "query_graph": tf.function(in_query),
      "query_xla": tf.function(in_query, jit_compile=True),
      "query_xla_unknown_n": tf.function(in_query, jit_compile=True, input_signature=spec),
  }


FORMS = _forms()


_DEFAULT = ("query_xla_unknown_n", "xla_fused", "graph_unknown_n")


@pytest.mark.parametrize("form", [f if f in _DEFAULT else pytest.param(f, marks=pytest.mark.slow)
                                  for f in sorted(FORMS)])
def test_sum_is_the_pinned_tree_bit_for_bit(form):
  for n in (3, 33, 257, 1000):
    x = _rows(n, n)
    want = _tree(x)
    assert np.sum(np.cumsum(x, 0, dtype=np.float32)[-1] != want) > 0   # order matters here
    got = np.asarray(FORMS[form](tf.constant(x)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
        form, n, int(np.sum(got != want)))


def _pinned_forms(block, k, n, rows):
  from tf_dpiter.keras.fast_clipping import algebra   # pylint: disable=g-import-not-at-top
  fn = lambda a, b: algebra.pinned_rows_product(a, b, block)   # noqa: E731
  spec = [tf.TensorSpec([None, k]), tf.TensorSpec([None, n])]

  def planned(a, b):   # rows the trace does not know, bounded by a public plan: the blocks'
    # tree read from summation.pairwise_sum_after's table (outside XLA)
    with summation.public_plan(rows, rows):
      return fn(a, b)

  return {"eager": fn, "graph": tf.function(fn), "xla": tf.function(fn, jit_compile=True),
          "graph_unknown_n": tf.function(fn, input_signature=spec),
          "graph_planned_n": tf.function(planned, input_signature=spec),
          "xla_unknown_n": tf.function(fn, jit_compile=True, input_signature=spec),
          "xla_fused": tf.function(lambda a, b: fn(a * 1.0, b) + 0.0 * tf.reduce_sum(a),
                                   jit_compile=True)}


@pytest.mark.parametrize("rows, block", [(1000, 64), pytest.param(1000, 128, marks=(
    pytest.mark.slow)), pytest.param(4096, 128, marks=pytest.mark.slow)])
def test_the_fast_paths_pinned_product_keeps_its_blocks_and_tree(rows, block):
  """fast_clipping.algebra.pinned_rows_product: blocks of `block` rows by one batched matrix
  product (any order within a block), the blocks' sums by the pinned tree, in every form
  (outside XLA the rows unpadded, the last block by its own product; rows the trace does not
  know within a public plan's bound by summation.pairwise_sum_after). One nonzero row per
  block (the block's sum exact in any order) of mixed magnitude: the result must be the tree
  over the blocks bit for bit (a single dot over all rows differs here in 5 of 15 coordinates
  at 1000 rows, 10 at 4096), at the bound's rows and at fewer, a multiple of the block (the
  last block of no rows: a zero leaf)."""
  k, n = 3, 5
  rng = np.random.default_rng(rows)
  blocks = -(-rows // block)
  a, b = np.zeros((rows, k), np.float32), np.zeros((rows, n), np.float32)
  vals = (rng.standard_normal((blocks, k)) * 10.0 ** rng.integers(-7, 8, (blocks, k))
          ).astype(np.float32)
  for j in range(blocks):
    r = j * block + rng.integers(0, min(block, rows - j * block))
    a[r], b[r] = vals[j], 1.0
  want = _tree(np.repeat(vals[:, :, None], n, axis=2))
  assert np.sum(a.T @ b != want) > 0
  cut = 4 * block
  want_cut = _tree(np.repeat(vals[:4, :, None], n, axis=2))
  for name, fn in _pinned_forms(block, k, n, rows).items():
    for m, expected in ((rows, want), (cut, want_cut)):
      got = np.asarray(fn(tf.constant(a[:m]), tf.constant(b[:m])))
      assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (
          name, m, int(np.sum(got != expected)))
