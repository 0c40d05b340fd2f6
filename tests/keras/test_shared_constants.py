"""keras_internals.shared_constants: integer and boolean constants shared per traced graph."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.internals import keras_internals as graph_constants


def _consts(graph):
  return [op for op in graph.get_operations() if op.type == "Const"]


def test_integer_constants_are_shared_floats_are_not():
  seen = {}

  @tf.function(autograph=False)
  def f(x):
    with graph_constants.shared_constants():
      a = tf.constant([1, 2], tf.int32)
      b = tf.constant([1, 2], tf.int32)
      c = tf.constant([1, 3], tf.int32)
      t = tf.constant(True)
      u = tf.constant(True)
      f1 = tf.constant(2.0)
      f2 = tf.constant(2.0)
      seen.update(a=a, b=b, c=c, t=t, u=u, f1=f1, f2=f2)
      return tf.reshape(x, [2, -1]) * f1 + tf.reshape(x, [2, -1]) * f2
    # (the reshapes' [2, -1] shapes: one Const)

  out = f(tf.range(6, dtype=tf.float32))
  np.testing.assert_array_equal(out.numpy(), 4.0 * np.arange(6, dtype=np.float32).reshape(2, 3))
  assert seen["a"] is seen["b"]
  assert seen["a"] is not seen["c"]
  assert seen["t"] is seen["u"]
  assert seen["f1"] is not seen["f2"]
  shapes = [op for op in _consts(seen["a"].graph)
            if op.get_attr("value").tensor_content == np.array([2, -1], np.int32).tobytes()
            or list(tf.make_ndarray(op.get_attr("value")).ravel()) == [2, -1]]
  assert len(shapes) == 1


def test_outside_a_block_nothing_is_shared():
  seen = []

  @tf.function(autograph=False)
  def f():
    seen.extend([tf.constant(7), tf.constant(7)])
    return seen[-1]

  assert int(f()) == 7
  assert seen[0] is not seen[1]


def test_control_dependencies_and_other_graphs_get_their_own():
  seen = {}

  @tf.function(autograph=False)
  def f(x):
    with graph_constants.shared_constants():
      a = tf.constant(5)
      with tf.control_dependencies([x]):
        b = tf.constant(5)
      inner = []

      def branch():
        inner.append(tf.constant(5))
        return inner[-1] + 1

      r = tf.cond(x > 0, branch, lambda: tf.constant(5))
      seen.update(a=a, b=b, inner=inner[0])
      return a + b + r

  assert int(f(tf.constant(1))) == 16
  assert seen["a"] is not seen["b"]
  assert seen["b"].op.control_inputs   # its control dependency kept
  assert seen["inner"].graph is not seen["a"].graph


def test_gradients_unchanged_inside_a_block():
  """A reshape- and broadcast-heavy function's value and gradient, traced with and without
  the block: bit-identical."""
  x0 = np.random.RandomState(0).randn(4, 3, 5).astype(np.float32)

  def loss(x):
    y = tf.reshape(x, [4, 15]) * tf.range(15, dtype=tf.float32)
    z = tf.reduce_sum(tf.reshape(y, [4, 3, 5]) * x[:, :1, :], axis=[1, 2])
    return tf.reduce_sum(tf.nn.softmax(z)) + tf.reduce_sum(tf.square(x[1:, 1:]))

  def make(shared):
    @tf.function(autograph=False)
    def g(x):
      with (graph_constants.shared_constants() if shared else _null()):
        with tf.GradientTape() as tape:
          tape.watch(x)
          value = loss(x)
        return value, tape.gradient(value, x)
    return g

  v0, g0 = make(False)(tf.constant(x0))
  v1, g1 = make(True)(tf.constant(x0))
  np.testing.assert_array_equal(v0.numpy(), v1.numpy())
  np.testing.assert_array_equal(g0.numpy(), g1.numpy())
  plain = make(False).get_concrete_function(tf.TensorSpec([4, 3, 5], tf.float32)).graph
  shared = make(True).get_concrete_function(tf.TensorSpec([4, 3, 5], tf.float32)).graph
  assert len(_consts(shared)) < len(_consts(plain))


def test_eager_is_untouched_and_the_wrapper_removed_after_the_block():
  from tensorflow.python.framework import constant_op  # pylint: disable=g-import-not-at-top
  original = constant_op._constant_impl   # pylint: disable=protected-access
  with graph_constants.shared_constants():
    assert constant_op._constant_impl is not original   # pylint: disable=protected-access
    with graph_constants.shared_constants():
      a, b = tf.constant(3), tf.constant(3)
    assert constant_op._constant_impl is not original   # pylint: disable=protected-access
  assert constant_op._constant_impl is original   # pylint: disable=protected-access
  assert int(a) == int(b) == 3


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


if __name__ == "__main__":
  pytest.main([__file__, "-q"])
