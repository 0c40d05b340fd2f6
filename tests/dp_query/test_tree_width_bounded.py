"""summation.pairwise_sum's loop-free forms: the tree width in closed form and the tree of a
row count the trace does not know under a static bound (`most`), against the loop forms,
bit for bit."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation


def _doubling(n):
  """The width the doubling loop gave: 1 doubled until it reaches n."""
  p = 1
  while p < n:
    p *= 2
  return p


def test_tree_width_equals_the_doubling_loop():
  width = tf.function(summation._tree_width,  # pylint: disable=protected-access
                      input_signature=[tf.TensorSpec([], tf.int32)])
  ns = list(range(0, 1100)) + [2**k + d for k in range(11, 31) for d in (-1, 0, 1)
                               if 2**k + d <= 2**30]
  got = [int(width(tf.constant(n, tf.int32))) for n in ns]
  assert got == [_doubling(n) for n in ns]


def _cancelling_rows(n, cols, seed):
  """Rows whose sum depends on the order of the additions (large terms that cancel)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, cols)).astype(np.float32)
  x[::2] *= np.float32(1e7)
  x[1::2] = -x[::2][: n // 2] + rng.standard_normal((n // 2, cols)).astype(np.float32)
  return x


@pytest.mark.parametrize("most", [1, 5, 8, 48])
def test_bounded_tree_equals_the_loop_tree_bit_for_bit(most):
  spec = tf.TensorSpec([None, 7], tf.float32)
  loop = tf.function(summation.pairwise_sum, input_signature=[spec])
  bounded = tf.function(lambda x: summation.pairwise_sum(x, most=most), input_signature=[spec])
  graph = bounded.get_concrete_function().graph
  assert not [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
  for n in range(0, most + 1):
    x = _cancelling_rows(n, 7, seed=n)
    want, got = loop(x).numpy(), bounded(x).numpy()
    # the same additions in the same order: equal bits (the sign of a zero sum aside)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(got.view(np.int32) | np.int32(-2**31),
                          want.view(np.int32) | np.int32(-2**31))
    if n:
      exact = np.sum(x.astype(np.float64), axis=0)
      assert np.all(np.isfinite(got)) and got.shape == exact.shape


def test_bounded_tree_refuses_rows_past_the_bound():
  bounded = tf.function(lambda x: summation.pairwise_sum(x, most=8),
                        input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  with pytest.raises(tf.errors.InvalidArgumentError):
    bounded(tf.ones([9, 3]))


def test_bounded_tree_under_xla_keeps_the_dynamic_form():
  fn = tf.function(lambda x: summation.pairwise_sum(x, most=8), jit_compile=True,
                   input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  x = _cancelling_rows(6, 3, seed=1)
  want = tf.function(summation.pairwise_sum,
                     input_signature=[tf.TensorSpec([None, 3], tf.float32)])(x)
  np.testing.assert_array_equal(fn(x).numpy(), want.numpy())
