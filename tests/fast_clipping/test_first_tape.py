"""The first backward pass's own tape (clipping.install's first_tape): a norm function
marked registry.watched_from_inputs has its watched tensors recorded from the call's
floating inputs, so the pass forms no gradient of its variables; an unmarked one whose
watched tensor is computed from the layer's variables alone still gets the exact per-record
sum (noise off, against an independent float64 loop, graph and XLA); a marked one whose
watched tensor is not computed from the inputs is refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import registry

C = 0.5
X = np.random.RandomState(0).randn(4, 3, 2).astype("float32")
Y = np.random.RandomState(1).randn(4, 1).astype("float32")


class Scale(keras.layers.Layer):
  """y = x * w over the last axis (w [K]); per example."""

  def build(self, shape):
    self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

  def call(self, x):
    return x * self.w


def _scale_norm_fn(layer, x):
  """watched: w broadcast to x's shape, computed from w alone (as a position table is)."""
  watched = tf.broadcast_to(tf.convert_to_tensor(layer.w), tf.shape(x))

  def sqr_norm_fn(dw):
    g = tf.reduce_sum(dw, axis=1)   # [B, K]: the example's gradient of w
    return registry.PerExampleGrads(tf.reduce_sum(tf.square(g), axis=1), [g])

  return x * watched, watched, sqr_norm_fn


def _model(rule):
  registry.register_layer(Scale, rule)
  keras.utils.set_random_seed(0)
  x = keras.Input((3, 2))
  h = keras.layers.Dense(2)(Scale()(x))
  out = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.LayerNormalization()(h)))
  return keras.Model(x, out)


def _loss(y, p):
  return tf.reduce_sum(tf.square(y - p), axis=1)


def _oracle(model):
  """sum_i min(1, C / ||g_i||) g_i in float64, one example at a time (its own tape)."""
  ws = [tf.Variable(tf.cast(v, tf.float64)) for v in model.trainable_variables]
  w, k1, b1, gamma, beta, k2, b2 = ws
  total = [np.zeros(v.shape) for v in ws]
  for i in range(len(X)):
    x = tf.constant(X[i:i + 1], tf.float64)
    with tf.GradientTape() as tape:
      h = tf.matmul(x * w, k1) + b1
      mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
      h = (h - mean) / tf.sqrt(var + 1e-3) * gamma + beta
      p = tf.matmul(tf.reshape(h, [1, -1]), k2) + b2
      loss = tf.reduce_sum(tf.square(Y[i:i + 1] - p))
    g = tape.gradient(loss, ws)
    norm = np.sqrt(sum(float(tf.reduce_sum(t * t)) for t in g))
    for j, t in enumerate(g):
      total[j] += t.numpy() * min(1.0, C / norm)
  return total


def _clipped_sum(model, jit_compile):
  fn = tf.function(lambda x, y: fc.clipped_grad_sum(model, x, y, _loss, C)[0],
                   jit_compile=jit_compile)
  return fn, [g.numpy() for g in fn(X, Y)]


@pytest.fixture(autouse=True)
def _restore_registry():
  before = dict(registry._REGISTRY)  # pylint: disable=protected-access
  yield
  registry._REGISTRY.clear()  # pylint: disable=protected-access
  registry._REGISTRY.update(before)  # pylint: disable=protected-access


@pytest.mark.parametrize("jit_compile", [False, True])
def test_watched_from_the_variables_alone_exact(jit_compile):
  """Scale's rule is unmarked (its watched tensor comes from w alone): the first tape
  records the reads of w, and the sum is the per-record loop's."""
  model = _model(_scale_norm_fn)
  _, got = _clipped_sum(model, jit_compile)
  for g, want in zip(got, _oracle(model)):
    np.testing.assert_allclose(g, want, rtol=2e-4, atol=1e-5)


def test_marked_rules_form_no_variable_gradient_in_the_first_pass():
  """Dense is marked: the first backward pass takes no gradient of a kernel (a MatMul of
  the layer's input with the output gradient, transpose_a) nor of a bias (BiasAddGrad
  appears only for the biases' matrix products, not here: Dense adds its bias with AddV2 or
  BiasAdd, whose gradient of the bias is the output gradient's sum)."""
  model = _model(_scale_norm_fn)
  fn, _ = _clipped_sum(model, False)
  graph = fn.get_concrete_function(X, Y).graph
  kernel_grads = [op.name for op in graph.get_operations()
                  if op.type == "MatMul" and op.name.startswith("gradient_tape/")
                  and op.get_attr("transpose_a")]
  assert not kernel_grads


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_marked_rule_whose_watched_tensor_is_not_from_the_inputs_takes_the_full_tape(
    jit_compile):
  """A rule marked `watched_from_inputs` whose watched tensor comes from its weight alone
  (as a Dense fed integer inputs it casts in its call: test_integer_inputs_review): the
  first backward pass goes back to the tape of all the variables, and the sum is the
  per-record loop's."""
  model = _model(registry.watched_from_inputs(
      lambda layer, x: _scale_norm_fn(layer, x)))
  _, got = _clipped_sum(model, jit_compile)
  for g, want in zip(got, _oracle(model)):
    np.testing.assert_allclose(g, want, rtol=2e-4, atol=1e-5)
