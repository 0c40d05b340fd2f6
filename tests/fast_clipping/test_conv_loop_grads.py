"""A convolution traced for XLA inside a loop body or a branch (the padded Poisson tail's
chunks, chunking.sum_over_chunks) differentiates through canonical convolutions
(rules/conv.py `_conv2d_canonical_grads`): the same values and gradients as tf.nn.conv2d,
every compiled convolution in the input-NHWC / kernel-HWIO form that XLA's CPU backend runs
by Eigen (TensorFlow's own backward convolutions there run a naive loop), and a DP CNN's
padded Poisson step under XLA stays exact whether the tail ran or not."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.keras.fast_clipping.rules import conv

from .conftest import per_record_clipped_sum

# (input [H, W], kernel, strides, padding): the tutorial CNN's two convolutions, uneven
# strides and kernels, a kernel not divisible by the stride, inputs the stride leaves over
GEOMETRIES = [((28, 28), (8, 8), (2, 2), "same"), ((13, 13), (4, 4), (2, 2), "valid"),
              ((9, 7), (3, 2), (1, 2), "same"), ((10, 11), (3, 3), (3, 2), "valid"),
              ((6, 6), (5, 5), (2, 2), "same"), ((7, 8), (2, 3), (2, 3), "same")]
CANONICAL = "dim_labels=b01f_01io->b01f"


def _value_and_grads(fn, x, kernel, dz_seed):
  with tf.GradientTape() as tape:
    tape.watch([x, kernel])
    z = fn(x, kernel)
  dz = tf.constant(np.random.RandomState(dz_seed).randn(*z.shape).astype("float32"))
  return [z] + tape.gradient(z, [x, kernel], output_gradients=dz)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_canonical_grads_equal_tensorflows_conv(geometry):
  (h, w), (kh, kw), stride, padding = geometry
  rng = np.random.RandomState(h * w)
  x = tf.constant(rng.randn(3, h, w, 2).astype("float32"))
  kernel = tf.constant(rng.randn(kh, kw, 2, 4).astype("float32"))
  ref = _value_and_grads(lambda a, b: tf.nn.conv2d(a, b, [1, *stride, 1], padding.upper()),
                         x, kernel, 7)
  got = tf.function(lambda: _value_and_grads(
      lambda a, b: conv._conv2d_canonical_grads(a, b, stride, padding), x, kernel, 7),  # pylint: disable=protected-access
                    jit_compile=True)()
  for r, g in zip(ref, got):
    assert r.shape == g.shape
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-5)


def _compiled(fn, x, in_loop):
  """(optimized HLO, value) of fn(x) under XLA, inside a one-iteration tf.while_loop or not."""
  def run(x):
    if not in_loop:
      return fn(x)
    out = tf.nest.map_structure(tf.zeros_like, fn(x))   # shapes only (pruned)
    return tf.while_loop(lambda i, *_: i < 1,
                         lambda i, *acc: (i + 1, *[a + t for a, t in zip(acc, fn(x))]),
                         [tf.constant(0), *out])[1:]

  f = tf.function(run, jit_compile=True)
  return f.experimental_get_compiler_ir(x)(stage="optimized_hlo"), f(x)


def test_loop_body_convolutions_are_canonical():
  layer = keras.layers.Conv2D(5, 4, strides=2)
  layer.build((None, 13, 13, 3))
  x = tf.constant(np.random.RandomState(2).randn(4, 13, 13, 3).astype("float32"))
  kernel = tf.constant(layer.kernel.numpy())
  seen = []

  def rule_dx(x):   # the rule's forward pass, as the fast path calls it; its input gradient
    seen.append(conv._in_xla_control_flow())  # pylint: disable=protected-access
    with tf.GradientTape() as tape:
      tape.watch(x)
      z, _ = conv._conv_forward(layer, x, layer.padding)  # pylint: disable=protected-access
      loss = tf.reduce_sum(z * z)
    return [tape.gradient(loss, x)]

  def both(x):   # input and filter gradients of the canonical form
    with tf.GradientTape() as tape:
      tape.watch([x, kernel])
      z = conv._conv2d_canonical_grads(x, kernel, (2, 2), "valid")  # pylint: disable=protected-access
      loss = tf.reduce_sum(z * z)
    return tape.gradient(loss, [x, kernel])

  for fn, count in ((rule_dx, 2), (both, 3)):   # forward, dx (, dW)
    hlo, in_loop = _compiled(fn, x, True)
    labels = re.findall(r"dim_labels=[^,\s]+", hlo)
    assert len(labels) == count and set(labels) == {CANONICAL}, labels
    _, entry = _compiled(fn, x, False)
    for a, b in zip(in_loop, entry):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-4)
  # traces: the loop's zeros (entry), its body, the entry alone (TensorFlow's own conv there)
  assert seen == [False, True, False]
  assert not conv._in_xla_control_flow()   # eagerly  # pylint: disable=protected-access


def test_padded_poisson_cnn_step_under_xla_is_exact():
  """The tutorial CNN's layers (its second convolution's clipped sum by book-keeping: the
  filter gradient; its first's from the kept per-example gradients) on a padded Poisson sample
  (E = 16 of M = 48 rows: first chunk 16, tail chunks of 8) under XLA: 21 real rows (one tail
  chunk) and 40 (three), one trace; each update equals the reference at the weights it started
  from (tests/keras/test_xla_padded_tail.py: a sample without a tail chunk), the per-record
  loop of conftest.per_record_clipped_sum (traced: 61 records of the CNN)."""
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  clip, n, e, m = 0.05, 1000, 16, 48
  keras.utils.set_random_seed(3)
  model = dp.keras.DPSequential(dp.keras.example_models.mnist_cnn_layers())
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(clip, 0.0, learning_rate=1.0),
                loss=loss, jit_compile=True)
  model.optimizer.set_sampling(n, e / n, "poisson", e)
  for real in (21, 40):
    rng = np.random.RandomState(real)
    x = np.zeros((m, 28, 28, 1), "float32")
    y = np.zeros(m, "int64")
    x[:real], y[:real] = rng.rand(real, 28, 28, 1), rng.randint(0, 10, real)
    w = np.zeros(m, "float32")
    w[:real] = 1.0
    ref, _ = per_record_clipped_sum(model, x[:real], y[:real], loss, clip, traced=True)
    got = helpers.one_step_update(model, x, y, sample_weight=w)
    for g, r in zip(got, ref):   # reference: the sum over the real rows; update: sum / E
      np.testing.assert_allclose(g, r / e, rtol=2e-4, atol=2e-6, err_msg=str(real))
  assert int(model.optimizer.ledger.sample_count.numpy()) == 2
