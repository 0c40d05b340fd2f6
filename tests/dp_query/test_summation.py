"""summation: the pinned pairwise sum over records and its rounding margin.

Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it" (CCS 2022); Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., Sec. 4.2. `pairwise_sum` must add in the order
it is written (the bound of `rounding_margin` assumes it) whatever runs it: checked bit for
bit against an independent float32 simulation of the same tree in numpy (IEEE round to
nearest), eagerly, traced and under XLA, on rows built against a sequential order and on rows
with heavy cancellation over 40 binary orders of magnitude.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError

U = 2.0 ** -24


def _tree(x, dtype=np.float32):
  """The pinned tree in numpy `dtype`: pad to 2^d with zero rows, then halve (a row count
  unknown to the trace runs the same tree)."""
  x = np.asarray(x, dtype)
  n = max(len(x), 1)
  p = 1 << (n - 1).bit_length()
  x = np.concatenate([x, np.zeros((p - len(x),) + x.shape[1:], dtype)])
  while len(x) > 1:
    h = len(x) // 2
    x = (x[:h] + x[h:]).astype(dtype)
  return x[0]


def _sequential_adversary(n):
  """The review's rows (tests/privacy/test_sum_rounding_review.py): a running sum held just
  below 2^K, one row of C crossing it, then rows of -3/4 ulp."""
  k = int(np.log2(n)) - 1
  m, w = 2 ** k, 2.0 ** (k - 24)
  return np.array([1.0] * (m - 1) + [0.5, 1.0] + [-0.75 * w] * (n - m - 1), np.float32)


def _cancelling(n, rng):
  mags = 2.0 ** rng.randint(-20, 20, size=(n, 3))
  return (rng.choice([-1.0, 1.0], size=(n, 3)) * mags * rng.rand(n, 3)).astype(np.float32)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("n", [1, 7, 256, 1000, 4096])
def test_pairwise_sum_adds_in_the_written_order(mode, n):
  rng = np.random.RandomState(n)
  rows = [_sequential_adversary(max(n, 4))[:n, None] * np.ones((1, 3), np.float32),
          _cancelling(n, rng)]
  fn = summation.pairwise_sum
  if mode != "eager":
    fn = tf.function(fn, jit_compile=(mode == "xla"))
  for x in rows:
    got = fn(tf.constant(x)).numpy()
    np.testing.assert_array_equal(got, _tree(x))


@pytest.mark.parametrize("jit", [False, True])
def test_pairwise_sum_of_a_row_count_unknown_to_the_trace(jit):
  """Under XLA rows of one shape (`_pairwise_sum_dynamic`), in a graph halving shapes
  (`_pairwise_sum_shrinking`): both the written tree, bit for bit."""
  fn = tf.function(summation.pairwise_sum, jit_compile=jit, input_signature=[
      tf.TensorSpec([None, 3], tf.float32)])
  rng = np.random.RandomState(0)
  for n in (0, 1, 2, 5, 33, 64, 1000):
    x = _cancelling(n, rng)
    np.testing.assert_array_equal(fn(x).numpy(), _tree(x))


def test_pairwise_sums_share_one_loop_and_give_each_tree():
  """pairwise_sums of leaves whose row count the trace does not know: one while loop for all
  of them in a graph, each leaf's written tree bit for bit (float32 and float64 leaves)."""
  specs = [tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.float64),
           tf.TensorSpec([None, 2, 2], tf.float32)]
  fn = tf.function(lambda *xs: summation.pairwise_sums(list(xs)), input_signature=specs)
  ops = fn.get_concrete_function().graph.get_operations()
  assert [op.type for op in ops if op.type in ("While", "StatelessWhile")] == ["StatelessWhile"]
  rng = np.random.RandomState(1)
  for n in (0, 1, 5, 33):
    xs = [_cancelling(n, rng), rng.randn(n), rng.randn(n, 2, 2).astype(np.float32)]
    for got, x in zip(fn(*xs), xs):
      np.testing.assert_array_equal(got.numpy(), _tree(x, x.dtype))


def test_pairwise_sum_after_a_head_is_the_tree_over_its_leaves_and_the_tail():
  """summation.pairwise_sum_after: head's m leaves then the tail, the tree of pairwise_sum
  over the m + 1 leaves stacked, bit for bit, for every m up to the bound (one trace: its
  table of trees, no branch per m) and for each m the trace knows; an m above the bound fails
  at run time. Leaves of mixed magnitude (every other order rounds differently)."""
  most, rng = 9, np.random.RandomState(1)
  unknown = tf.function(lambda h, t: summation.pairwise_sum_after(h, t, most),
                        input_signature=[tf.TensorSpec([None, 2, 3]), tf.TensorSpec([2, 3])])
  for m in range(most + 1):
    leaves = (rng.randn(m + 1, 2, 3) * 10.0 ** rng.randint(-7, 8, (m + 1, 2, 3))
              ).astype(np.float32)
    want = _tree(leaves)
    for got in (unknown(leaves[:m], leaves[m]),
                summation.pairwise_sum_after(tf.constant(leaves[:m]), tf.constant(leaves[m]))):
      assert np.array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32)), m
  assert unknown.experimental_get_tracing_count() == 1
  with pytest.raises(tf.errors.InvalidArgumentError):
    unknown(np.zeros([most + 1, 2, 3], np.float32), np.zeros([2, 3], np.float32))
  with pytest.raises(ParameterValueError, match="most"):
    tf.function(summation.pairwise_sum_after, input_signature=[
        tf.TensorSpec([None, 2]), tf.TensorSpec([2])]).get_concrete_function()


def _gamma(k):
  return k * U / (1 - k * U)


def _eta(nodes, most, products=0):
  """rounding_margin's docstring: (1 + u (1 + gamma_H) nodes) (1 + u)^products - 1."""
  return (1 + U * (1 + _gamma(most)) * nodes) * (1 + U) ** products - 1


@pytest.mark.parametrize("n, eta", [(256, 2.4e-4), (1024, 1.2e-3), (8192, 0.0127)])
def test_rounding_margin_of_one_row_per_record(n, eta):
  """Shifted rows (any arrangement): 2 u (1 + gamma_d) d n, d = ceil(log2 n), as Higham's
  gamma_d (2 n - 1); the slot relation (r a masked row of the same plan): the nodes on r's
  path, sum over levels of (2 * 2^l - 1) < 4 n, no log factor."""
  d = int(np.log2(n))
  assert summation.rounding_margin(n) == pytest.approx(_eta(2 * d * n, d), rel=1e-12)
  assert summation.rounding_margin(n) == pytest.approx(_gamma(d) * (2 * n - 1), rel=1e-2)
  assert summation.rounding_margin(n) == pytest.approx(eta, rel=0.02)
  slot = summation.rounding_margin(n, shifted=False)
  assert slot == pytest.approx(_eta(sum(2 * 2 ** l - 1 for l in range(1, d + 1)), d), rel=1e-12)
  assert slot < 4 * U * n * (1 + 1e-3)
  for shifted in (True, False):
    got = summation.rounding_margin(tf.constant(n), shifted=shifted)
    assert got.numpy() == pytest.approx(summation.rounding_margin(n, shifted=shifted), rel=1e-12)


def test_rounding_margin_of_chunks_replicas_blocks_and_products():
  # 8 chunks of 512 one after the other: every row through the tree's 9 levels, chunks 1
  # and 2 through 7 additions, chunk k >= 2 through 9 - k
  chunked = 512 * (7 + sum(9 - k for k in range(2, 9)))
  assert summation.rounding_margin(512, chunks=8) == pytest.approx(
      _eta(2 * (4096 * 9 + chunked), 16), rel=1e-12)
  # slot: the tree's levels in the chunk, then the accumulator after chunk j + 1
  slot = (sum(2 * 2 ** l - 1 for l in range(1, 10))
          + sum(2 * min((j + 1) * 512, 4096) - 1 for j in range(1, 8)))
  assert summation.rounding_margin(512, chunks=8, shifted=False) == pytest.approx(
      _eta(slot, 16), rel=1e-12)
  # a padded tail's chunks (fewer rows than records * chunks): the rows where charged most
  assert summation.rounding_margin(512, chunks=8, total=600) == pytest.approx(
      _eta(2 * (600 * 9 + 512 * 7 + 88 * 7), 16), rel=1e-12)
  # two replicas (any order): one more rounding for every row; n doubles
  assert summation.rounding_margin(256, replicas=2) == pytest.approx(
      _eta(2 * 512 * 9, 9), rel=1e-12)
  assert summation.rounding_margin(256, replicas=2, shifted=False) == pytest.approx(
      _eta(sum(2 * 2 ** l - 1 for l in range(1, 9)) + 1023, 9), rel=1e-12)
  # blocks of 64 (any order) under a tree of 4: shifted, every row through 63 + 2; slot,
  # r's block (63 nodes of <= 64 rows) and the tree's 2 levels (128, 256 rows)
  assert summation.rounding_margin(256, block=64) == pytest.approx(
      _eta(2 * 256 * 65, 65), rel=1e-12)
  assert summation.rounding_margin(256, block=64, shifted=False) == pytest.approx(
      _eta(63 * 127 + 255 + 511, 65), rel=1e-12)
  # a final rounding: one more level of n rows
  assert summation.rounding_margin(256, final=1, shifted=False) == pytest.approx(
      _eta(sum(2 * 2 ** l - 1 for l in range(1, 9)) + 511, 9), rel=1e-12)
  assert summation.rounding_margin(256, products=4) == pytest.approx(
      (1 + summation.rounding_margin(256)) * (1 + U) ** 4 - 1)
  assert summation.rounding_margin(8, dtype=tf.float64) == pytest.approx(
      2 * 3 * 8 * 2.0 ** -53, rel=1e-6)
  for shifted in (True, False):
    got = summation.rounding_margin(tf.constant(512), chunks=tf.constant(8), block=64,
                                    shifted=shifted)
    assert got.numpy() == pytest.approx(
        summation.rounding_margin(512, chunks=8, block=64, shifted=shifted), rel=1e-12)


def test_the_slot_bound_is_below_the_shifted_one():
  """The slot relation is a special arrangement: its bound never exceeds the shifted one."""
  for plan in (dict(records=8), dict(records=300, block=64), dict(records=512, chunks=5),
               dict(records=100, replicas=3, final=2), dict(records=4096, block=64, final=1)):
    assert summation.rounding_margin(**plan, shifted=False) <= summation.rounding_margin(**plan)


@pytest.mark.parametrize("bad", [dict(records=0), dict(records=2.0), dict(records=4, block=0),
                                 dict(records=4, products=-1), dict(records=True)])
def test_rounding_margin_refuses_a_bad_plan(bad):
  with pytest.raises(ParameterValueError, match="must be an int"):
    summation.rounding_margin(**bad)


@pytest.mark.parametrize("eta", [0.0, 2.4e-4, 0.0127, 1.0 / 3.0])
def test_shrink_rounds_down(eta):
  for s in (summation.shrink(eta), float(summation.shrink(tf.constant(eta, tf.float64)))):
    assert np.float32(s) == s
    assert s * (1 + eta) <= 1.0
    assert float(np.nextafter(np.float32(s), np.float32(2))) * (1 + eta) > 1.0


def test_removing_a_row_moves_the_pinned_sum_by_at_most_c_with_the_shrink():
  """Add/remove one row (a zero row in its place, as a masked record): rows of norm <= C / (1
  + eta) (one term per record), each constructed near powers of two so that the tree's
  additions round; float64 norms of the float32 sums' difference. 200 trials at n = 64."""
  rng = np.random.RandomState(3)
  n = 64
  c = summation.shrink(summation.rounding_margin(n))
  worst = 0.0
  for _ in range(200):
    big = 2.0 ** rng.randint(0, 6)
    x = (rng.choice([-1.0, 1.0], size=(n, 1)) * (big - rng.rand(n, 1) * 2.0 ** -rng.randint(
        10, 24, size=(n, 1)))).astype(np.float32)
    x = (x / max(np.abs(x).max(), 1e-30) * c).astype(np.float32)
    x = np.where(np.abs(x.astype(np.float64)) > c, np.float32(c) * np.sign(x), x)
    r = rng.randint(n)
    without = x.copy()
    without[r] = 0.0
    moved = np.abs(_tree(x).astype(np.float64) - _tree(without).astype(np.float64)).max()
    worst = max(worst, moved)
  assert worst <= 1.0, worst
