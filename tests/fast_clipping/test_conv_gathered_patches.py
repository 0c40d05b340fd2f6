"""rules/conv.py's gathered patches (`_gathered_patches`, the unfolded input outside XLA):
bit-equal to TensorFlow's ExtractImagePatches (strides, dilation, "same" and "valid", odd
sizes, a Conv1D's 2-D view), their layout is the kernel's (the kept per-example gradients map
back to the whole-batch filter gradient), and XLA keeps conv_unfold's folded slices."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

# (H, W, cin), (kh, kw), (sh, sw), (dh, dw)
CASES = [((13, 13, 16), (4, 4), (2, 2), (1, 1)),   # the tutorial CNN's second convolution
         ((9, 7, 3), (3, 2), (2, 1), (1, 1)),
         ((8, 9, 2), (3, 3), (1, 1), (2, 1)),
         ((1, 11, 4), (1, 3), (1, 2), (1, 1)),     # a Conv1D's 2-D view
         ((5, 6, 2), (1, 1), (1, 1), (1, 1))]


@pytest.mark.parametrize("case,padding", list(itertools.product(CASES, ["same", "valid"])))
def test_gathered_patches_equal_extract_patches(case, padding):
  (h, w, cin), ksize, stride, dilation = case
  x = tf.constant(np.random.default_rng(0).normal(size=(3, h, w, cin)), tf.float32)
  kernel = tf.zeros(ksize + (cin, 1))
  out_hw = tuple(tf.nn.conv2d(x, kernel, (1,) + stride + (1,), padding.upper(),
                              dilations=(1,) + dilation + (1,)).shape[1:3])
  ref = tf.image.extract_patches(x, (1,) + ksize + (1,), (1,) + stride + (1,),
                                 (1,) + dilation + (1,), padding.upper())
  got = conv._gathered_patches(x, ksize, stride, dilation, padding, out_hw)
  assert got.shape == (3, out_hw[0] * out_hw[1], ksize[0] * ksize[1] * cin)
  np.testing.assert_array_equal(got.numpy(), tf.reshape(ref, got.shape).numpy())


def test_kept_gradients_sum_to_the_filter_gradient():
  """The unfold form's per-example gradients (gathered patches), mapped by its to_kernel,
  sum to TensorFlow's whole-batch filter gradient (float64 reference of float32 data)."""
  rng = np.random.default_rng(1)
  x = tf.constant(rng.normal(size=(5, 13, 13, 16)), tf.float32)
  dz = tf.constant(rng.normal(size=(5, 5, 5, 32)), tf.float32)
  form = conv._per_example_form(None, x, dz, (4, 4), (2, 2), (1, 1), "valid")
  assert conv._gathers_patches(x, (5, 5))
  g = tf.reshape(form.chunk_fn(x, dz), [5, -1])
  got = form.to_kernel(tf.reshape(tf.reduce_sum(g, 0), [form.rows, form.cols])).numpy()
  ref = tf.compat.v1.nn.conv2d_backprop_filter(
      tf.cast(x, tf.float64), [4, 4, 16, 32], tf.cast(dz, tf.float64), [1, 2, 2, 1],
      "VALID").numpy()
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
  per_example = [tf.compat.v1.nn.conv2d_backprop_filter(
      tf.cast(x[i:i + 1], tf.float64), [4, 4, 16, 32], tf.cast(dz[i:i + 1], tf.float64),
      [1, 2, 2, 1], "VALID").numpy() for i in range(5)]
  for i in range(5):
    gi = form.to_kernel(tf.reshape(g[i], [form.rows, form.cols])).numpy()
    np.testing.assert_allclose(gi, per_example[i], rtol=1e-5, atol=1e-4)


def test_xla_keeps_the_folded_slices():
  x = tf.zeros([2, 13, 13, 16])

  @tf.function(jit_compile=True)
  def layout_under_xla(x):
    assert not conv._gathers_patches(x, (5, 5))
    assert conv._patch_layout(x, (4, 4), (2, 2), (1, 1), (5, 5)) == conv_unfold.Layout(
        2, 2, 2, 2, 16)
    return x

  layout_under_xla(x)
  assert conv._patch_layout(x, (4, 4), (2, 2), (1, 1), (5, 5)) == conv_unfold.Layout(
      4, 4, 1, 1, 16)
