"""The per-record squared norms of the layers of one class formed together
(algebra.batched_norms): the Gram form's rounding bounds and LayerNorm's sums of squares. Each
layer's bound is still an upper bound of its exact squared norm, equal to the value it gets
alone up to the order of float32 sums, and the clipped sum's trace holds one computation per
class, not one per layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
_B, _T, _K, _N = 3, 5, 4, 6


def _pairs(rng, cancel):
  """(a [B, T, K], b [B, T, N]) pairs; `cancel`: positions whose terms a_t b_t^T cancel
  (one input, opposite output gradients) up to a tiny remainder."""
  out = []
  for i in range(4):
    a = rng.normal(size=(_B, _T, _K)).astype(np.float32)
    b = rng.normal(size=(_B, _T, _N)).astype(np.float32)
    if cancel and i % 2 == 0:
      a[:, 1] = a[:, 0]
      b[:, 1] = -b[:, 0] * np.float32(1.0 + 1e-6)
    out.append((a, b))
  return out


def _exact(a, b):
  g = np.einsum("btk,btn->bkn", a.astype(np.float64), b.astype(np.float64))
  return np.sum(g ** 2, axis=(1, 2))


@pytest.mark.parametrize("cancel", [False, True])
def test_batched_bounds_bound_and_match_the_layer_alone(cancel):
  """Deferred within a block and resolved together, each layer's bound is >= its exact
  squared norm (float64) and equal, to float32 rounding, to gram_sqr_norm's outside a block;
  with the rows of the clipped sum (sum_rows) and without the ones column, as the Dense rule
  calls it."""
  pairs = _pairs(np.random.RandomState(3 + cancel), cancel)

  @tf.function
  def batched():
    with algebra.shared_ops(), algebra.batched_norms():
      with algebra.deferred_norms():
        parts = [algebra.gram_sqr_norm(tf.constant(a), tf.constant(b), with_one=False,
                                       sum_rows=_B * _T) for a, b in pairs]
      deferred = sum(isinstance(p, algebra.DeferredNorms) for p in parts)
      return algebra.resolve_norms(parts), deferred

  @tf.function
  def alone():
    return [algebra.gram_sqr_norm(tf.constant(a), tf.constant(b), sum_rows=_B * _T)
            for a, b in pairs]

  got, deferred = batched()
  assert int(deferred) == len(pairs)
  for g, r, (a, b) in zip(got, alone(), pairs):
    assert np.all(g.numpy().astype(np.float64) >= _exact(a, b))
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-6)


def test_not_deferred_without_the_rules_opt_in_or_eagerly():
  """gram_sqr_norm forms its bound in place outside deferred_norms (other callers add
  to it), eagerly, and for a graph other than the block's."""
  a = tf.ones([_B, _T, _K])
  b = tf.ones([_B, _T, _N])

  @tf.function
  def traced():
    with algebra.batched_norms():
      return algebra.gram_sqr_norm(a, b, sum_rows=_B * _T)

  assert tf.is_tensor(traced())
  with algebra.batched_norms(), algebra.deferred_norms():
    assert tf.is_tensor(algebra.gram_sqr_norm(a, b, sum_rows=_B * _T))   # eager


def test_deferred_sqr_sums_match_sqr_sum():
  """deferred_sqr_sum's rows formed together equal sqr_sum's of each alone; the same depth
  noted per layer."""
  rng = np.random.RandomState(2)
  rows = [rng.normal(size=(_B, 200)).astype(np.float32) for _ in range(3)]

  noted = {}

  @tf.function
  def batched():
    with algebra.norm_depths() as depths, algebra.batched_norms():
      parts = [algebra.deferred_sqr_sum(tf.constant(r)) for r in rows]
      noted["deferred"] = sum(isinstance(p, algebra.DeferredNorms) for p in parts)
      parts = algebra.resolve_norms(parts)
    noted["batched"] = depths
    return parts

  @tf.function
  def alone():
    with algebra.norm_depths() as depths:
      parts = [algebra.sqr_sum(tf.constant(r)) for r in rows]
    noted["alone"] = depths
    return parts

  got, ref = batched(), alone()
  assert noted["deferred"] == len(rows)
  assert noted["batched"] == noted["alone"]
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-6)


def _projections(layers=4):
  """Dense projections of one shape on [B, T, K] inputs (the Gram form's class), each with a
  LayerNorm (their sums of squares one class), summed."""
  keras.utils.set_random_seed(7)
  x = keras.Input((_T, _K))
  h = x
  for _ in range(layers):
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(_K, activation="tanh")(h))
  return keras.Model(x, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def _reference(model, x, y, clip):
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for i in range(x.shape[0]):
    with tf.GradientTape() as tape:
      loss = _LOSS(y[i:i + 1], model(x[i:i + 1]))[0]
    g = [t.numpy().astype(np.float64) for t in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(t ** 2) for t in g))
    total = [s + t * min(1.0, clip / norm) for s, t in zip(total, g)]
  return total


def test_clipped_sum_one_bound_per_shape_class(monkeypatch):
  """The clipped sum's trace: the projections' bounds and the LayerNorms' sums of squares in
  one computation per class (fewer ops in its norms than with one per layer,
  BATCHED_NORM_BYTES 0), the same norms to float32 rounding, and the per-example
  reference's clipped sum."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  model = _projections()
  rng = np.random.RandomState(1)
  x = rng.normal(size=(_B, _T, _K)).astype(np.float32)
  y = rng.randint(0, 2, _B)

  def run():
    fn = tf.function(lambda: fast_clipping.clipped_grad_sum(model, x, y, _LOSS, 0.5))
    graph = fn.get_concrete_function().graph
    ops = sum(op.name.startswith("norms/") for op in graph.get_operations())
    return fn(), ops

  (grads, norms), batched = run()
  monkeypatch.setattr(algebra, "BATCHED_NORM_BYTES", 0)
  (_, alone_norms), alone = run()
  assert batched < alone
  np.testing.assert_allclose(norms.numpy(), alone_norms.numpy(), rtol=1e-6)
  for g, r in zip(grads, _reference(model, x, y, 0.5)):
    np.testing.assert_allclose(g.numpy(), r, rtol=2e-4, atol=2e-5)
