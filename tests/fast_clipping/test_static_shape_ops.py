"""Static shapes where the trace knows them: the per-layer norm and sum helpers add no shape
ops (Shape, StridedSlice, Pack chains) to the DP step's graph when the sizes are static, and
stay exact with sizes the trace does not know (a BERT-base DP step had 15,459 ops against the
non-private step's 7,283, the excess mostly such chains; fewer ops, less graph optimization
and executor setup in the first step)."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry

_SHAPE_OPS = {"Shape", "StridedSlice", "Pack", "OnesLike"}


def _op_types(fn, *specs):
  """Op types of fn traced afresh at `specs` (a new tf.function: a trace at a more general
  signature would be reused)."""
  traced = tf.function(fn, autograph=False).get_concrete_function(*specs)
  return [op.type for op in traced.graph.get_operations()]


def test_leading_rows_is_the_tensor_itself_when_sizes_are_static_and_equal():
  """Equal static sizes: no op at all; a padded g [R > n] or an unknown batch: the first n
  rows, exactly."""
  g = tf.reshape(tf.range(12.0), [6, 2])
  assert algebra.leading_rows(g, tf.zeros([6])) is g
  np.testing.assert_array_equal(algebra.leading_rows(g, tf.zeros([4])), g.numpy()[:4])

  def cut(g, like):
    return algebra.leading_rows(g, like)

  out = tf.function(cut).get_concrete_function(tf.TensorSpec([None, 2]), tf.TensorSpec([None]))
  np.testing.assert_array_equal(out(g, tf.zeros([3])), g.numpy()[:3])
  assert not _SHAPE_OPS & set(_op_types(cut, tf.TensorSpec([5, 2]), tf.TensorSpec([5])))


def test_with_ones_column_static_shape_takes_no_slice_of_x():
  """[B, T, K] -> [B, T, K + 1] with ones last, as a constant under static shapes; the same
  values with an unknown batch (ones_like of a slice there)."""
  x = tf.random.stateless_normal([3, 4, 5], seed=[1, 2])
  want = np.concatenate([x.numpy(), np.ones([3, 4, 1], np.float32)], -1)
  np.testing.assert_array_equal(algebra.with_ones_column(x), want)

  def ones(x):
    return algebra.with_ones_column(x)

  assert not _SHAPE_OPS & set(_op_types(ones, tf.TensorSpec([3, 4, 5])))
  unknown_batch = tf.function(ones).get_concrete_function(tf.TensorSpec([None, 4, 5]))
  np.testing.assert_array_equal(unknown_batch(x), want)


def test_result_keeps_per_example_gradients_already_shaped_like_the_variables():
  """algebra.result: per-record gradients [B, *v.shape] pass through (no reshape); [B, P]
  ones are reshaped to [B, *v.shape], also with an unknown batch."""
  layer = keras.layers.Dense(3)
  layer.build((None, 2))
  sq = tf.ones([4])
  gk, gb = tf.ones([4, 2, 3]), tf.ones([4, 3])
  res = algebra.result(layer, sq, {id(layer.kernel): gk, id(layer.bias): gb})
  assert isinstance(res, registry.PerExampleGrads)
  assert res.grads[0] is gk and res.grads[1] is gb

  @tf.function(input_signature=[tf.TensorSpec([None, 6])])
  def flat(g):
    return algebra.result(layer, sq, {id(layer.kernel): g, id(layer.bias): gb}).grads[0]

  out = flat(tf.reshape(tf.range(24.0), [4, 6]))
  assert out.shape == (4, 2, 3)
  np.testing.assert_array_equal(out, np.arange(24.0).reshape(4, 2, 3))


def test_clip_factors_reshaped_and_signed_once_per_clipped_sum():
  """Within algebra.shared_ops (the clipped sum's trace) weight_rows / drop_rows /
  factor_product of many layers reshape, sign and stack the same factors once; outside
  the block, and for other factors, each call builds its own; values unchanged. The shared
  tensor carries none of the control dependencies of its first user."""
  g = tf.reshape(tf.range(24.0), [4, 3, 2])
  c = tf.constant([0.5, 0.0, 2.0, 1.0])
  want_w = g.numpy() * c.numpy()[:, None, None]
  want_sum = np.tensordot(c.numpy(), g.numpy(), axes=1)

  def calls(c, g, shared):
    with algebra.shared_ops() if shared else contextlib.nullcontext():
      with tf.control_dependencies([tf.print("first")]):
        first = algebra.weight_rows(g, c)
      out = [first] + [algebra.weight_rows(g * 1.0, c) for _ in range(3)]
      out += [algebra.drop_rows(g, c) for _ in range(3)]
      flat = tf.reshape(g, [4, 6])
      out += [algebra.factor_product(c, flat) for _ in range(3)]
      return out

  # Reshapes: the factors' rows (of c and of sign(c)), g flattened (the [P] products are the
  # first row of a two-row product as they are: a strided slice, no reshape)
  for shared, reshapes, signs, packs in ((True, 2 + 1, 1, 1), (False, 7 + 1, 3, 3)):
    graph = tf.function(lambda c, g, s=shared: calls(c, g, s),
                        autograph=False).get_concrete_function(
        tf.TensorSpec([4]), tf.TensorSpec([4, 3, 2])).graph
    types = [op.type for op in graph.get_operations()]
    assert (types.count("Reshape"), types.count("Sign"), types.count("Pack")) == (
        reshapes, signs, packs)
    if shared:
      sign = [op for op in graph.get_operations() if op.type == "Sign"][0]
      assert not sign.control_inputs
  out = tf.function(lambda c, g: calls(c, g, True), autograph=False)(c, g)
  np.testing.assert_allclose(out[0], want_w)
  np.testing.assert_array_equal(out[4], g.numpy() * (c.numpy() > 0)[:, None, None])
  np.testing.assert_allclose(tf.reshape(out[7], [3, 2]), want_sum, rtol=1e-6)
  eager = calls(c, g, True)   # eagerly: no memo, same values
  np.testing.assert_allclose(eager[1], want_w)
