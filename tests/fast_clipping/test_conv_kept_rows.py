"""The convolutions' pinned sum from kept per-example gradients (rules/conv.py
`_pinned_kept_sum`) makes no pass over the kept gradients beyond the pinned product: the rows
are taken up to the records' blocks (a view), the factors padded with zeros, and the rows of
c_i = 0 are set to 0 first only where some record's squared norm is not finite.

Outside XLA the records' rows are summed without padding them (`_pinned_rows_product_unpadded`:
the last partial block by its own product; where the trace does not know the rows, a last block
of no rows when the records fill their blocks).

Checked, graph mode and jit_compile=True, a batch the trace knows or not, chunked kept
gradients (rows past the records: zero examples): (1) the sum equals, bit for bit, the plan it
replaces (the records' rows cut, algebra.drop_rows, algebra.pinned_rows_product padding them
to the blocks) with zero factors among finite rows; (2) equals an independent float64
sum_i c_i g_i to float32 accuracy; (3) a record whose gradient is not finite (inf and NaN) with
c_i = 0 adds exactly nothing.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import conv

from . import covers


def _form(rows, cols):
  return conv._Form(None, rows, cols, 0, 1 << 30, lambda g: g)


def _replaced_plan(form, g, rc, block):
  """The plan `_pinned_kept_sum` replaced: the records' rows cut, rows with c_i = 0 set to
  0, padded to the blocks by pinned_rows_product."""
  if form.rows > 1:
    g = tf.transpose(g, [0, 2, 1, 3])
  rows = algebra.leading_rows(tf.reshape(g, [-1, form.rows * form.cols]), rc)
  s = algebra.pinned_rows_product(tf.reshape(rc, [-1, 1]), algebra.drop_rows(rows, rc), block)
  return tf.reshape(s, [form.rows, form.cols])


def _case(b, n, m, a, cols, seed):
  """Kept gradients [n, a, m, cols] of b records (rows past b: zero examples), their squared
  norms and factors in [0, 1] with some zeros."""
  rng = np.random.default_rng(seed)
  g = np.zeros((n, a, m, cols), np.float32)
  flat = rng.normal(size=(b, a, cols)).astype(np.float32) * rng.uniform(0.1, 30, (b, 1, 1))
  for i in range(b):
    g[i // m, :, i % m, :] = flat[i]
  c = rng.uniform(0, 1, b).astype(np.float32)
  c[rng.choice(b, b // 5, replace=False)] = 0.0
  return g, c


# (batch, chunk rows m, depthwise rows A, jit, static)
GRID = [(b, m, a, j, s) for b, m in ((70, 64), (130, 32), (200, 128)) for a in (1, 4)
        for j in (False, True) for s in (True, False)]


@pytest.mark.parametrize("b, m, a, jit, static",
                         covers.slow_outside(GRID, covers.all_pairs(GRID)))
def test_kept_sum_equals_the_replaced_plan_and_float64(b, m, a, jit, static):
  cols = 24
  n = -(-b // m)
  g, c = _case(b, n, m, a, cols, seed=b + a)
  form = _form(a, cols)
  sq = np.einsum("iac,iac->i", *(2 * [np.stack([g[i // m, :, i % m] for i in range(b)])]))
  block = 64
  rows = b if static else None
  spec = [tf.TensorSpec([n if static else None, a, m, cols]), tf.TensorSpec([rows]),
          tf.TensorSpec([rows])]

  @tf.function(jit_compile=jit, input_signature=spec)
  def both(g, c, sq):
    return conv._pinned_kept_sum(form, g, c, block, sq), _replaced_plan(form, g, c, block)

  _assert_the_plan_and_the_float64_sum(both(g, c, sq.astype(np.float32)), g, c, b, m)


def _assert_the_plan_and_the_float64_sum(sums, g, c, b, m):
  """The kept sum equals the replaced (padded) plan bit for bit, and sum_i c_i g_i in float64
  to float32 accuracy."""
  got, old = sums
  np.testing.assert_array_equal(got.numpy(), old.numpy())
  per_record = np.stack([g[i // m, :, i % m].astype(np.float64) for i in range(b)])
  want = np.einsum("i,iac->ac", c.astype(np.float64), per_record)
  scale = np.einsum("i,iac->ac", c.astype(np.float64), np.abs(per_record))
  assert np.all(np.abs(got.numpy() - want) <= 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("jit, static", [(False, False), (True, True)])
def test_non_finite_record_with_zero_factor_adds_nothing(jit, static):
  b, n, m, a, cols = 70, 2, 64, 1, 16
  g, c = _case(b, n, m, a, cols, seed=9)
  sq = np.stack([np.sum(g[i // m, :, i % m] ** 2) for i in range(b)]).astype(np.float32)
  clean = g.copy()
  for i, bad in ((3, np.inf), (66, np.nan)):
    g[i // m, 0, i % m, 5] = bad
    sq[i] = bad
    c[i] = 0.0
    clean[i // m, :, i % m] = 0.0
  form = _form(a, cols)
  rows = b if static else None
  spec = [tf.TensorSpec([n if static else None, a, m, cols]), tf.TensorSpec([rows]),
          tf.TensorSpec([rows])]
  step = tf.function(lambda g, c, sq: conv._pinned_kept_sum(form, g, c, 64, sq),
                     jit_compile=jit, input_signature=spec)
  got = step(g, c, sq).numpy()
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got, step(clean, c, np.nan_to_num(sq, posinf=0.0)).numpy())


@pytest.mark.parametrize("b, m, a, static", [(128, 64, 1, False), (128, 64, 4, True),
                                             (64, 64, 4, False), (5, 64, 1, False)])
def test_records_filling_their_blocks_equal_the_replaced_plan(b, m, a, static):
  """Graph mode, records that fill their blocks (a last block of no rows where the trace does
  not know them: a zero leaf in the tree) or fewer than one block: bit for bit the padded plan
  (algebra.pinned_rows_product), and the float64 sum to float32 accuracy."""
  cols = 24
  n = -(-b // m) + 1   # one chunk past the records: zero examples
  g, c = _case(b, n, m, a, cols, seed=b + a + 7)
  form = _form(a, cols)
  sq = np.einsum("iac,iac->i", *(2 * [np.stack([g[i // m, :, i % m] for i in range(b)])]))
  rows = b if static else None
  spec = [tf.TensorSpec([n if static else None, a, m, cols]), tf.TensorSpec([rows]),
          tf.TensorSpec([rows])]

  @tf.function(input_signature=spec)
  def both(g, c, sq):
    return conv._pinned_kept_sum(form, g, c, 64, sq), _replaced_plan(form, g, c, 64)

  _assert_the_plan_and_the_float64_sum(both(g, c, sq.astype(np.float32)), g, c, b, m)
