"""algebra.record_sqr_sums: the fast path's per-record sums of squares in the pinned order of
summation.pinned_square_sum with the block algebra.square_block (one reduction up to
algebra.ONE_REDUCTION_ENTRIES entries, else blocks of 64, then a pairwise tree), and the clip's
margin from the depths noted (algebra.norm_depths, algebra.norm_margin)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping import algebra

# Nightly tier (-m slow): by default each shape once, its (known batch, jit) taking the four
# combinations in turn (every shape, both batch kinds, graph and XLA and each pair of those
# stay by default); the other three combinations of each shape nightly.
_SQR_SHAPES = ["shape%d" % i for i in range(7)]
_SQR_MODES = [(True, True), (False, True), (True, False), (False, False)]
SLOW_CASES = {f"test_each_row_is_the_pinned_square_sum_bit_for_bit[{known}-{shape}-{jit}]"
              for i, shape in enumerate(_SQR_SHAPES) for known, jit in _SQR_MODES
              if (known, jit) != _SQR_MODES[i % 4]}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(3, 0), (3, 1), (3, 64), (3, 65), (5, 7, 100), (2, 1025),
                                   (2, 4096)])
@pytest.mark.parametrize("known_batch", [True, False])
def test_each_row_is_the_pinned_square_sum_bit_for_bit(jit, shape, known_batch):
  x = np.random.RandomState(0).randn(*shape).astype(np.float32)
  spec = tf.TensorSpec(shape if known_batch else (None,) + shape[1:])
  rows = tf.function(algebra.record_sqr_sums, jit_compile=jit, input_signature=[spec])(x)
  block = algebra.square_block(int(np.prod(shape[1:])))
  assert block == (summation.SQUARE_BLOCK if np.prod(shape[1:]) in (0, 1025, 4096) else
                   np.prod(shape[1:]))
  one = tf.function(lambda r: summation.pinned_square_sum(r, block), jit_compile=jit)
  expected = np.array([one(tf.constant(r)).numpy() for r in x], np.float32)
  if block == summation.SQUARE_BLOCK or len(shape) == 2:
    np.testing.assert_array_equal(rows.numpy(), expected)
  else:   # one reduction over a row's axes: any order (its depth n - 1), not the flat row's
    np.testing.assert_allclose(rows.numpy(), expected, rtol=2 * block * 2.0 ** -24)
  exact = (x.astype(np.float64) ** 2).reshape(shape[0], -1).sum(1)
  np.testing.assert_allclose(rows.numpy(), exact, rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_tiny_squares_are_not_dropped(jit):
  """One square of 1 and 2^20 - 1 squares of 0.9 u (u = 2^-24): one reduction adding them
  to the big partial sum one at a time drops them all (exact sum 1.0562); the pinned order
  sums them in blocks first. The computed sum is within the depth's relative bound."""
  n = 1 << 20
  x = np.full((1, n), np.sqrt(0.9 * 2.0 ** -24), np.float32)
  x[0, 0] = 1.0
  got = tf.function(algebra.record_sqr_sums, jit_compile=jit)(x).numpy()[0]
  exact = float(np.sum(x.astype(np.float64) ** 2))
  u = 2.0 ** -24
  depth = summation.square_sum_depth(n)
  assert (1 - u) ** (depth + 1) * exact <= got <= exact * (1 + u) ** (depth + 1)


def test_the_margin_counts_the_deepest_sum_and_the_parts():
  x = tf.zeros([2, 1 << 20])
  with algebra.norm_depths() as depths:
    algebra.record_sqr_sums(x)
    algebra.record_sqr_sums(tf.zeros([2, 10]))
  assert max(depths["sums"]) == summation.square_sum_depth(1 << 20) == 63 + 14
  assert depths["parts"] == 2 and depths["after"] == 0
  eta = algebra.norm_margin(depths, 3)
  u = 2.0 ** -24
  k = (77 + 2 + 3 + 1) / 2.0 + 5
  assert eta == pytest.approx(k * u / (1 - k * u), rel=1e-12)
  with algebra.norm_depths() as none:
    pass
  assert algebra.norm_margin(none, 1) < eta


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("n", [33, 64, 96, 512, 1024, 8192])
def test_windowed_blocks_keep_the_depth_bound_on_big_and_tiny_squares(jit, n):
  """Under XLA a block of 64 squares is summed as two windows of 32 added
  (summation._block_sums), a row of at most ONE_REDUCTION_ENTRIES squares (one block) as its
  windows; each row's sum stays within the plan's depth bound (square_sum_depth with the
  block algebra.square_block: n - 1 for one reduction) of the float64 sum, on rows of one
  square of 1 and tiny squares of 0.9 u (dropped one by one by a single long reduction,
  which that depth covers), the big square in each position of a block across rows."""
  rows = 5
  x = np.full((rows, n), np.sqrt(0.9 * 2.0 ** -24), np.float32)
  for r in range(rows):
    x[r, (r * 37) % n] = 1.0
  got = tf.function(algebra.record_sqr_sums, jit_compile=jit)(x).numpy()
  exact = (x.astype(np.float64) ** 2).sum(1)
  u = 2.0 ** -24
  depth = summation.square_sum_depth(n, algebra.square_block(n))
  assert depth == (n - 1 if n <= algebra.ONE_REDUCTION_ENTRIES else summation.square_sum_depth(n))
  assert np.all((1 - u) ** (depth + 1) * exact <= got)
  assert np.all(got <= exact * (1 + u) ** (depth + 1))
  windows = []
  tf.function(lambda: windows.append(summation._windows(summation.SQUARE_BLOCK)) or 0.0,
              jit_compile=jit)()
  assert windows == [2 if jit else 1]
