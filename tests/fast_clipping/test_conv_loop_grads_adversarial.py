"""Adversarial geometries for the canonical-convolution gradients of a Conv2D traced for XLA
in a loop body or branch (rules/conv.py `_conv2d_canonical_grads`): strides larger than the
kernel (input rows no output reads), 1x1 kernels, kernels larger than the input ("same"),
strides that leave rows over, a single output row; value, input and filter gradients equal
tf.nn.conv2d's. The rule's forward pass takes that form only inside XLA control flow (not
eagerly, not in a plain graph, not for dilation or a layer the rule declines); and a padded
Poisson step of a CNN with those geometries under XLA equals the per-example loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.keras.fast_clipping.rules import conv

GEOMETRIES = [((9, 9), (2, 2), (3, 3), "valid"), ((9, 10), (2, 2), (3, 3), "same"),
              ((8, 8), (1, 1), (2, 2), "same"), ((7, 5), (1, 1), (3, 2), "valid"),
              ((3, 4), (5, 5), (1, 1), "same"), ((4, 4), (5, 3), (2, 3), "same"),
              ((5, 6), (5, 6), (1, 1), "valid"), ((11, 6), (3, 1), (4, 5), "valid"),
              ((2, 2), (3, 3), (4, 4), "same")]


def _value_and_grads(fn, x, kernel):
  with tf.GradientTape() as tape:
    tape.watch([x, kernel])
    z = fn(x, kernel)
  dz = tf.constant(np.random.RandomState(9).randn(*z.shape).astype("float32"))
  return [z] + tape.gradient(z, [x, kernel], output_gradients=dz)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_canonical_grads_equal_tensorflows_conv(geometry):
  (h, w), (kh, kw), stride, padding = geometry
  rng = np.random.RandomState(h * w + kh)
  x = tf.constant(rng.randn(3, h, w, 2).astype("float32"))
  kernel = tf.constant(rng.randn(kh, kw, 2, 3).astype("float32"))
  ref = _value_and_grads(lambda a, b: tf.nn.conv2d(a, b, [1, *stride, 1], padding.upper()),
                         x, kernel)

  def in_loop():   # inside a one-iteration while loop, as the tail chunks run
    return tf.while_loop(
        lambda i, *_: i < 1,
        lambda i, *acc: (i + 1, *_value_and_grads(
            lambda a, b: conv._conv2d_canonical_grads(a, b, stride, padding), x, kernel)),  # pylint: disable=protected-access
        [tf.constant(0)] + [tf.zeros_like(r) for r in ref])[1:]

  got = tf.function(in_loop, jit_compile=True)()
  for r, g in zip(ref, got):
    assert r.shape == g.shape
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-5)
  assert float(tf.reduce_max(tf.abs(ref[1]))) > 0   # the input gradient is not trivially 0


def test_rule_takes_the_canonical_form_only_in_xla_control_flow():
  """Eagerly, in a plain graph's loop, in XLA's entry computation, and for a dilated layer in
  an XLA loop: TensorFlow's own conv (no custom gradient)."""
  seen = []
  plain = keras.layers.Conv2D(2, 3, strides=2)
  plain.build((None, 9, 9, 1))
  dilated = keras.layers.Conv2D(2, 3, dilation_rate=2)
  dilated.build((None, 9, 9, 1))
  x = tf.zeros([2, 9, 9, 1])

  def probe(layer):
    def body(i):
      seen.append((layer.name, conv._in_xla_control_flow()))  # pylint: disable=protected-access
      conv._conv_forward(layer, x, layer.padding)  # pylint: disable=protected-access
      return i + 1
    return body

  probe(plain)(0)
  tf.function(lambda: tf.while_loop(lambda i: i < 1, probe(plain), [0]))()
  tf.function(lambda: probe(plain)(0), jit_compile=True)()
  tf.function(lambda: tf.while_loop(lambda i: i < 1, probe(plain), [0]), jit_compile=True)()
  assert [s[1] for s in seen] == [False, False, False, True]
  canonical = []
  original = conv._conv2d_canonical_grads  # pylint: disable=protected-access
  try:
    conv._conv2d_canonical_grads = lambda *a: canonical.append(1) or original(*a)  # pylint: disable=protected-access
    tf.function(lambda: tf.while_loop(lambda i: i < 1, probe(dilated), [0]),
                jit_compile=True)()
    assert not canonical
    tf.function(lambda: tf.while_loop(lambda i: i < 1, probe(plain), [0]), jit_compile=True)()
    assert canonical
  finally:
    conv._conv2d_canonical_grads = original  # pylint: disable=protected-access


def test_padded_poisson_step_with_odd_geometries_is_exact():
  """Stride 3 over a 2x2 kernel ("same", rows no output reads), a 1x1 stride-2 convolution and
  a kernel of 5 on a 4-row map ("same"): a padded Poisson sample under XLA whose tail runs in
  chunks; the update equals the per-example reference."""
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  clip, n, e, m, real = 0.05, 1000, 8, 24, 19
  keras.utils.set_random_seed(6)
  model = dp.keras.DPSequential([
      keras.Input((11, 11, 2)), keras.layers.Conv2D(4, 2, strides=3, padding="same",
                                                    activation="tanh"),
      keras.layers.Conv2D(3, 1, strides=2, activation="tanh"),
      keras.layers.Conv2D(3, 5, padding="same"),
      keras.layers.Flatten(), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(clip, 0.0, learning_rate=1.0),
                loss=loss, jit_compile=True)
  model.optimizer.set_sampling(n, e / n, "poisson", e)
  rng = np.random.RandomState(1)
  x = np.zeros((m, 11, 11, 2), "float32")
  y = np.zeros(m, "int64")
  x[:real], y[:real] = rng.randn(real, 11, 11, 2), rng.randint(0, 3, real)
  w = np.zeros(m, "float32")
  w[:real] = 1.0
  canonical = []
  original = conv._conv2d_canonical_grads  # pylint: disable=protected-access
  try:
    conv._conv2d_canonical_grads = lambda *a: canonical.append(1) or original(*a)  # pylint: disable=protected-access
    ref = helpers.reference_gradient(model, loss, x[:real], y[:real], clip=clip)
    got = helpers.one_step_update(model, x, y, sample_weight=w)
  finally:
    conv._conv2d_canonical_grads = original  # pylint: disable=protected-access
  assert canonical, "no tail chunk took the canonical form"
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r * real / e, rtol=2e-4, atol=2e-6)
