"""EinsumDense's clipped sum from the clip factors (rules/dense.py `_einsum_sums`, a
registry.FactorSums): equal to sum_i c_i g_i of per-example tape gradients, with and
without bias, with a record whose gradient is not finite, and no backward pass through the
network per layer (the step's graph stays the size of one backward pass)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping


# 272 x 16 x 17 = 73,984 kernel entries: more than registry.keep_per_example keeps, so the
# sum is formed from the factors, not from kept per-example gradients
_C, _D, _E = 272, 16, 17


def _model(bias_axes, layers=1):
  keras.utils.set_random_seed(3)
  x = keras.Input((5, _C))
  h = x
  for _ in range(layers):
    h = keras.layers.EinsumDense("abc,cde->abde", output_shape=(5, _D, _E),
                                 bias_axes=bias_axes)(h)
    h = keras.layers.Reshape((5, _C))(h)
  out = keras.layers.Dense(2)(keras.layers.Flatten()(h))
  return keras.Model(x, out)


def _reference(model, x, y, loss_fn, clip):
  total = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
  for i in range(x.shape[0]):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[i:i + 1], model(x[i:i + 1]))[0]
    g = [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(t ** 2) for t in g))
    if not np.isfinite(norm):
      continue
    total = [a + t * min(1.0, clip / norm) for a, t in zip(total, g)]
  return total


@pytest.mark.parametrize("bias_axes", [None, "de", "e"])
def test_einsum_sum_equals_per_example_reference(bias_axes):
  model = _model(bias_axes)
  rng = np.random.RandomState(0)
  x = rng.normal(size=(6, 5, _C)).astype("float32")
  y = rng.randint(0, 2, 6)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  got, _ = tf.function(lambda: fast_clipping.clipped_grad_sum(model, x, y, loss_fn, 0.5))()
  for g, r in zip(got, _reference(model, x, y, loss_fn, 0.5)):
    np.testing.assert_allclose(g.numpy(), r, rtol=2e-4, atol=2e-5)


def test_non_finite_record_adds_nothing():
  """A record with an infinite input: c = 0, and the kernel's and bias's sums are those of
  the other records (its rows are zeroed in both operands of the einsum, no branch)."""
  model = _model("de")
  rng = np.random.RandomState(1)
  x = rng.normal(size=(4, 5, _C)).astype("float32")
  y = rng.randint(0, 2, 4)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  bad = x.copy()
  bad[2, 1, 1] = np.inf
  got, norms = fast_clipping.clipped_grad_sum(model, bad, y, loss_fn, 0.5)
  assert not np.isfinite(norms.numpy()[2])
  keep = np.array([0, 1, 3])
  want, _ = fast_clipping.clipped_grad_sum(model, x[keep], y[keep], loss_fn, 0.5)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g.numpy()))
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-4, atol=2e-5)


def test_graph_grows_by_a_layer_not_by_a_backward_pass():
  """Ops of the traced clipped sum for 2 and 8 EinsumDense layers: the 6 extra layers add
  fewer ops than per-layer backward passes through the stack would (measured: 84 ops a layer,
  244 with a tape gradient per layer, which grows with the depth)."""
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  x = np.zeros((4, 5, _C), np.float32)
  y = np.zeros(4, np.int64)
  counts = []
  for layers in (2, 8):
    model = _model("de", layers)
    g = tf.function(lambda m=model: fast_clipping.clipped_grad_sum(
        m, x, y, loss_fn, 1.0)[0]).get_concrete_function().graph
    counts.append(len(g.get_operations()))
  assert (counts[1] - counts[0]) / 6 < 150, counts
