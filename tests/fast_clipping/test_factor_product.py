"""The clipped sum of kept per-example gradients (algebra.factor_product, clipping._rows_sum).

sum_i c_i g_i must equal the numpy sum for static and unknown row counts, with and without
XLA, and a record with c_i = 0 must add exactly nothing even when its gradient is not finite
(rows with c = 0 are set to 0 first, with no branch on finiteness).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import clipping


def _data(shape, seed=0):
  rng = np.random.RandomState(seed)
  g = rng.randn(*shape).astype("float32")
  c = rng.uniform(0.1, 1.0, shape[0]).astype("float32")
  return g, c


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(5, 3, 7), (64, 32, 16), (4, 9)])
def test_factor_product_is_the_weighted_sum(jit, shape):
  g, c = _data(shape)
  fn = tf.function(algebra.factor_product, jit_compile=jit)
  got = fn(tf.constant(c), tf.constant(g)).numpy()
  want = np.einsum("b...,b->...", g.astype("float64"), c.astype("float64"))
  assert got.shape == shape[1:]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_factor_product_keeps_the_static_shape_and_takes_unknown_rows():
  g, c = _data((6, 4, 5), seed=1)
  spec = (tf.TensorSpec([None], tf.float32), tf.TensorSpec([None, 4, 5], tf.float32))
  fn = tf.function(algebra.factor_product, input_signature=spec)
  assert fn.get_concrete_function().structured_outputs.shape.as_list() == [4, 5]
  np.testing.assert_allclose(fn(tf.constant(c), tf.constant(g)).numpy(),
                             np.einsum("bkn,b->kn", g, c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_rows_sum_zero_factor_rows_add_nothing_even_when_not_finite(jit):
  g, c = _data((5, 3, 4), seed=2)
  c[[1, 3]] = 0.0
  g[1, 0, 0], g[3, 2, 1] = np.inf, np.nan
  want = np.einsum("bkn,b->kn", np.nan_to_num(g, posinf=0.0), c)

  @tf.function(jit_compile=jit)
  def rows_sum(g):
    return clipping._rows_sum(g, tf.constant(c))  # pylint: disable=protected-access

  got = rows_sum(tf.constant(g)).numpy()
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  finite = np.nan_to_num(g, posinf=0.0)
  np.testing.assert_allclose(rows_sum(tf.constant(finite)).numpy(), want, rtol=1e-5, atol=1e-5)
