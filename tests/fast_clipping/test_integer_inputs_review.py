"""Review: fast clipping of a Dense layer whose call receives integer inputs (a model input of
dtype int32 or uint8 fed straight to Dense, which casts it inside its call).

The DP step with noise 0, SGD lr 1 and normalize=False moves the weights by the clipped sum
sum_i c_i g_i, c_i = min(1, C / ||g_i||) (McMahan et al. 2018, Section 1); it must equal an
independent float64 per-example loop (g_i = x_i^T (softmax(z_i) - onehot(y_i)), and the
bias's softmax(z_i) - onehot(y_i)), in graph mode and under XLA. Worked at e70d7a6 (this
file's cases pass there); a first backward pass that watches only the call's floating
inputs finds no path from them to Dense's output and must not refuse the layer.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp

C, B, F, K = 1.0, 8, 6, 3


def _oracle(x, y, kernel, bias):
  x = x.astype(np.float64)
  z = x @ kernel.astype(np.float64) + bias.astype(np.float64)
  p = np.exp(z - z.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  dz = p - np.eye(K)[y]
  total_k, total_b = np.zeros((F, K)), np.zeros(K)
  for i in range(B):
    gk, gb = np.outer(x[i], dz[i]), dz[i]
    c = min(1.0, C / np.sqrt(np.sum(gk ** 2) + np.sum(gb ** 2)))
    total_k += c * gk
    total_b += c * gb
  return total_k, total_b


@pytest.mark.parametrize("dtype, jit", [("int32", False),
                                        pytest.param("uint8", True, marks=pytest.mark.slow)])
def test_dense_on_integer_inputs_clips_as_the_per_example_loop(dtype, jit):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((F,), dtype=dtype)
  model = dp.keras.DPModel(inputs, keras.layers.Dense(K)(inputs))
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping="fast",
                                     normalize=False)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=jit)
  opt.set_sampling(1000, B / 1000, "poisson", B)
  rng = np.random.RandomState(1)
  x = rng.randint(0, 5, (B, F)).astype(dtype)
  y = rng.randint(0, K, B)
  kernel, bias = [w.copy() for w in model.get_weights()]
  model.train_on_batch(x, y)
  assert opt.resolve_clipping(model) == "fast"
  new_kernel, new_bias = model.get_weights()
  want_k, want_b = _oracle(x, y, kernel, bias)
  np.testing.assert_allclose(kernel - new_kernel, want_k, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(bias - new_bias, want_b, rtol=1e-4, atol=1e-5)
