"""The convolution rule's forms (rules/conv.py, rules/conv_unfold.py): the folded patch Gram
equals the Gram of the unfolded patches, the chunked depthwise per-example filter gradients
equal per-example Conv2DBackpropFilter across chunk boundaries, and the cost model picks the
measured-cheaper form for the tutorial CNN's two convolutions."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

# (input [H, W, cin], kernel, strides, padding, output [ho, wo])
GEOMETRIES = [
    ((28, 28, 1), (8, 8), (2, 2), "same", (14, 14)),    # the tutorial CNN's first conv
    ((13, 13, 4), (4, 4), (2, 2), "valid", (5, 5)),     # its second (fewer channels)
    ((9, 7, 2), (4, 2), (2, 2), "valid", (3, 3)),
    ((8, 7, 2), (4, 3), (2, 1), "same", (4, 7)),
    ((1, 9, 3), (1, 4), (1, 2), "same", (1, 5)),        # a Conv1D's 2-D view
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g[1:4]) for g in GEOMETRIES])
@pytest.mark.parametrize("k", [1, 2])
def test_patch_gram_equals_gram_of_unfolded_patches(geometry, k):
  in_shape, ksize, strides, padding, out_hw = geometry
  x = tf.constant(np.random.default_rng(0).normal(size=(4,) + in_shape), tf.float32)
  assert conv_unfold.foldable(x, ksize, strides, (1, 1), out_hw)
  p, _ = conv_unfold.patches(x, ksize, strides, (1, 1), padding, out_hw)
  t = out_hw[0] * out_hw[1]
  p = tf.reshape(p, [4 // k, k * t, -1])
  want = tf.linalg.matmul(p, p, transpose_b=True).numpy()
  got = conv_unfold.patch_gram(x, ksize, strides, padding, out_hw, k).numpy()
  assert got.shape == (4 // k, k * t, k * t)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_patch_gram_not_for_dilated_or_nondividing_strides():
  x = tf.zeros([2, 9, 9, 1])
  assert not conv_unfold.foldable(x, (3, 3), (2, 2), (1, 1), (4, 4))
  assert not conv_unfold.foldable(x, (4, 4), (2, 2), (2, 2), (3, 3))
  assert not conv_unfold.foldable(x, (4, 4), (2, 2), (1, 1), None)


@pytest.mark.parametrize("batch", [1, conv._DEPTHWISE_CHUNK + 3])
def test_depthwise_chunks_equal_per_example_filter_gradients(batch):
  """Two chunks, the second padded with zero examples: each row is its example's
  Conv2DBackpropFilter."""
  rng = np.random.default_rng(1)
  x = tf.constant(rng.normal(size=(batch, 10, 10, 2)), tf.float32)
  dz = tf.constant(rng.normal(size=(batch, 5, 5, 3)), tf.float32)
  got = conv._depthwise_filter_grads(x, dz, (4, 4), (2, 2), "same").numpy()
  assert got.shape == (batch, 4, 4, 2, 3)
  for i in range(batch):
    want = tf.compat.v1.nn.conv2d_backprop_filter(
        x[i:i + 1], [4, 4, 2, 3], dz[i:i + 1], [1, 2, 2, 1], "SAME").numpy()
    np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def _form(in_shape, ksize, strides, out_shape, k=1):
  x = tf.zeros((3,) + in_shape)
  dz = tf.zeros((3,) + out_shape)
  with registry.examples_per_record(k):
    return conv._choose_form(dz, x, ksize, strides, (1, 1), keep=True)


def test_cost_model_forms_of_the_tutorial_cnn(monkeypatch):
  """Second conv (T = 25 positions, patch 256, 32 filters): the folded Gram (about 0.1M
  multiply-adds per example for the norm) against 0.2M for the per-example gradient.
  First conv (T = 196, patch 64, 16 filters): the per-example gradient (the Gram's T^2
  terms are 1.3M)."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", None)
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32)) == "foldgram"
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32), k=2) == "foldgram"
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32), k=tf.constant(2)) is None
  assert _form((28, 28, 1), (8, 8), (2, 2), (14, 14, 16)) in ("depthwise", None)
  assert _form((13, 13, 16), (3, 3), (2, 2), (6, 6, 32)) is None   # stride does not divide
