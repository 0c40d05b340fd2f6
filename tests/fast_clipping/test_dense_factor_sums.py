"""The Dense rule's clipped sum from the clip factors (registry.FactorSums).

sum_i c_i g_i with g_i = (sum_t x_t dz_t^T, sum_t dz_t) must equal the sum formed from
per-example gradients in numpy, whichever operand carries the factors (K <= N: the input,
else the output gradient), and a record with c_i = 0 must add exactly nothing even when
its input and output gradient are not finite (a float16 overflow), with no branch on
finiteness (algebra.weight_rows / drop_rows), with and without XLA.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping.rules import dense

# Nightly tier (-m slow): jit x poisoned x (K, N) pairwise by default ([False-False-3-7],
# [False-True-7-3], [True-False-7-3], [True-True-3-7]), the other half nightly.
SLOW_CASES = {"test_dense_sums_match_per_example_gradients[False-False-7-3]",
              "test_dense_sums_match_per_example_gradients[False-True-3-7]",
              "test_dense_sums_match_per_example_gradients[True-False-3-7]",
              "test_dense_sums_match_per_example_gradients[True-True-7-3]"}


def _reference(x, dz, c):
  keep = c > 0
  kernel = np.einsum("btk,btn,b->kn", x[keep], dz[keep], c[keep])
  bias = np.einsum("btn,b->n", dz[keep], c[keep])
  return kernel, bias


@pytest.mark.parametrize("k,n", [(3, 7), (7, 3)])
@pytest.mark.parametrize("poisoned", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_dense_sums_match_per_example_gradients(k, n, poisoned, jit):
  rng = np.random.RandomState(k)
  b, t = 5, 4
  x = rng.randn(b, t, k).astype("float32")
  dz = rng.randn(b, t, n).astype("float32")
  c = np.array([1.0, 0.3, 0.0, 0.7, 0.0], "float32")
  if poisoned:       # records 2 and 4 add nothing; their values are not finite
    x[2, 1, 0], dz[4, 0, 1], dz[2, 3, 2] = np.inf, np.nan, -np.inf
  layer = keras.layers.Dense(n)
  layer.build((None, t, k))
  want_kernel, want_bias = _reference(np.nan_to_num(x), np.nan_to_num(dz), c)
  fn = tf.function(lambda x, dz, c: dense._dense_sums(layer, x, dz, c), jit_compile=jit)
  kernel, bias = fn(tf.constant(x), tf.constant(dz), tf.constant(c))
  np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-6)
  assert np.isfinite(kernel.numpy()).all() and np.isfinite(bias.numpy()).all()


def test_dense_without_bias_and_frozen_kernel():
  rng = np.random.RandomState(0)
  x, dz = rng.randn(3, 2, 4).astype("float32"), rng.randn(3, 2, 6).astype("float32")
  c = np.array([0.5, 1.0, 0.0], "float32")
  want_kernel, want_bias = _reference(x, dz, c)
  no_bias = keras.layers.Dense(6, use_bias=False)
  no_bias.build((None, 2, 4))
  (kernel,) = dense._dense_sums(no_bias, tf.constant(x), tf.constant(dz), tf.constant(c))
  np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-6)
  frozen = keras.layers.Dense(6)
  frozen.build((None, 2, 4))
  frozen.kernel.trainable = False
  (bias,) = dense._dense_sums(frozen, tf.constant(x), tf.constant(dz), tf.constant(c))
  np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", [(), (2, 3)])
@pytest.mark.parametrize("k,n", [(3, 7), (7, 3)])
def test_dense_sums_without_and_with_two_position_axes(positions, k, n):
  """[B, K] inputs (no positions) and [B, T1, T2, K] ones: the kernel one product of the
  rows of every position, the bias a reduction, against numpy; a record with c_i = 0 and
  values that are not finite adds nothing."""
  rng = np.random.RandomState(k + len(positions))
  b = 4
  x = rng.randn(b, *positions, k).astype("float32")
  dz = rng.randn(b, *positions, n).astype("float32")
  c = np.array([0.25, 0.0, 1.0, 0.5], "float32")
  x[1].flat[0], dz[1].flat[-1] = np.nan, np.inf
  layer = keras.layers.Dense(n)
  layer.build((None,) + positions + (k,))
  flat_x = np.nan_to_num(x).reshape(b, -1, k)
  flat_dz = np.nan_to_num(dz).reshape(b, -1, n)
  want_kernel, want_bias = _reference(flat_x, flat_dz, c)
  kernel, bias = tf.function(lambda x, dz, c: dense._dense_sums(layer, x, dz, c))(
      tf.constant(x), tf.constant(dz), tf.constant(c))
  np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-6)
