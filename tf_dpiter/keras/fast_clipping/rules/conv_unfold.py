"""Per-example convolution weight gradients from unfolded inputs (patches).

For a 2-D convolution (channels_last, groups 1) with kernel [kh, kw, cin, cout] the
gradient of one example is g_i = P_i^T dz_i, P_i [T, kh*kw*cin] its input patches and
dz_i [T, cout] the gradient at the pre-activation output (T output positions).

`patches` unfolds the input. When each stride divides its kernel size (and the
convolution is not dilated) the input is first folded into stride blocks (space to
depth: [B, H, W, C] -> [B, H/s, W/s, s*s*C]); the convolution is then a stride-1 one with
a (kh/sh) x (kw/sw) kernel, and a patch is (kh/sh)*(kw/sw) folded pixels side by side:
fewer and cheaper operations than ExtractImagePatches for a strided kernel (shifted slices
concatenated on the channel axis). The entries of a patch are then in the order
(kh/sh, kw/sw, sh, sw, cin), not the kernel's (kh, kw, cin); `Layout` says which, and `to_kernel` maps a sum of
gradients in that order back to the kernel's shape (once, after the sum over examples).
Otherwise TensorFlow's ExtractImagePatches is used (order (kh, 1, kw, 1, cin)).

`block` forms g_i as dz_i^T P_i ([B, cout, K]: the matrix product in the order that
needs no transpose of the patches), flattened: a [B, P] tensor whose row norms are the
per-example norms and whose clip-weighted row sum is the clipped sum
(registry.PerExampleBlock).

`patch_gram` forms the Gram of a record's patches, <p_t, p_s>, from the Gram of its folded
pixels without unfolding (for the Gram norm when the kernel is larger than its stride).
"""

from typing import NamedTuple

import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra


class Layout(NamedTuple):
  """Order of a patch's entries: (qh, qw, sh, sw, cin), kernel row = a * sh + r for
  block row a in [0, qh) and offset r in [0, sh) (columns alike)."""
  qh: int
  qw: int
  sh: int
  sw: int
  cin: int


def _same_pads(size, out, k, s):
  total = max((out - 1) * s + k - size, 0)
  return total // 2


def _fold(x, sh, sw):
  """[B, H, W, C] (H, W multiples of sh, sw) -> [B, H/sh, W/sw, sh*sw*C], entries of a
  block in the order (row offset, column offset, channel)."""
  if sh == sw == 1:
    return x
  if sh == sw:
    return tf.nn.space_to_depth(x, sh)
  b, h, w, c = tf.shape(x)[0], x.shape[1], x.shape[2], x.shape[3]
  x = tf.reshape(x, [b, h // sh, sh, w // sw, sw, c])
  x = tf.transpose(x, [0, 1, 3, 2, 4, 5])
  return tf.reshape(x, [b, h // sh, w // sw, sh * sw * c])


def _folded_input(x, ksize, strides, padding, out_hw):
  """The input padded, cropped and folded into stride blocks: [B, ho+qh-1, wo+qw-1, sh*sw*cin]
  (qh = kh/sh, qw = kw/sw); output position (h, w) reads folded pixels (h + a, w + c),
  a < qh, c < qw (module docstring)."""
  (kh, kw), (sh, sw), (ho, wo) = ksize, strides, out_hw
  qh, qw = kh // sh, kw // sw
  h, w = x.shape[1], x.shape[2]
  top = _same_pads(h, ho, kh, sh) if padding == "same" else 0
  left = _same_pads(w, wo, kw, sw) if padding == "same" else 0
  hh, ww = (ho + qh - 1) * sh, (wo + qw - 1) * sw
  x = tf.pad(x, [[0, 0], [top, max(hh - h - top, 0)], [left, max(ww - w - left, 0)],
                 [0, 0]])[:, :hh, :ww]
  return _fold(x, sh, sw), Layout(qh, qw, sh, sw, int(x.shape[3]))


def _folded_patches(x, ksize, strides, padding, out_hw):
  """Patches [B, ho*wo, kh*kw*cin] by stride-block folding (module docstring)."""
  ho, wo = out_hw
  xs, layout = _folded_input(x, ksize, strides, padding, out_hw)
  qh, qw = layout.qh, layout.qw
  cs = int(xs.shape[3])
  # Patch t = (h, w) holds folded pixels (h + a, w + c), a < qh, c < qw: qh * qw shifted
  # slices side by side on the channel axis (one fused copy; a gather is slower under XLA).
  p = tf.concat([xs[:, a:a + ho, c:c + wo, :] for a in range(qh) for c in range(qw)], axis=-1)
  return tf.reshape(p, [-1, ho * wo, qh * qw * cs]), layout


def foldable(x, ksize, strides, dilation, out_hw):
  """Whether `patches` folds stride blocks (so `patch_gram` applies).

  Args:
    x: [B, H, W, cin] the convolution's input.
    ksize: (kh, kw).
    strides: (sh, sw).
    dilation: (dh, dw).
    out_hw: (ho, wo) the static output size, or None.

  Returns:
    bool: static spatial sizes, no dilation, each stride dividing its kernel size.
  """
  (kh, kw), (sh, sw), (dh, dw) = ksize, strides, dilation
  static = out_hw is not None and None not in out_hw and None not in x.shape[1:]
  return static and dh == dw == 1 and kh % sh == 0 and kw % sw == 0


def patch_gram(x, ksize, strides, padding, out_hw, k):
  """Per-record Gram of the input patches, <p_t, p_s>, without unfolding them.

  A patch is qh x qw folded pixels (module docstring), so <p_t, p_s> = sum over a < qh,
  c < qw of <f_{t+(a,c)}, f_{s+(a,c)}>: the Gram of the U = (ho+qh-1)(wo+qw-1) folded
  pixels f (cost U^2 sh sw cin per example, against T^2 kh kw cin for the unfolded patches)
  summed over qh*qw shifted [T, T] windows. With the Gram of the output gradients this gives
  the squared norm sum_{t,s} <p_t, p_s><dz_t, dz_s> (Li et al. 2021, Sec. 4) at a fraction
  of the unfolded Gram's cost when the kernel is larger than its stride.

  Args:
    x: [B, H, W, cin] the convolution's input; foldable(...) must hold.
    ksize: (kh, kw).
    strides: (sh, sw).
    padding: "same" or "valid".
    out_hw: (ho, wo) static ints.
    k: examples per record (a Python int; B a multiple of k): a record's positions are
      its examples' (algebra.regroup_btk order).

  Returns:
    [B/k, k*ho*wo, k*ho*wo] float32.
  """
  ho, wo = out_hw
  xs, layout = _folded_input(tf.cast(x, tf.float32), ksize, strides, padding, out_hw)
  hu, wu, cs = int(xs.shape[1]), int(xs.shape[2]), int(xs.shape[3])
  f = tf.reshape(xs, [-1, k * hu * wu, cs])
  g = tf.reshape(tf.linalg.matmul(f, f, transpose_b=True), [-1, k, hu, wu, k, hu, wu])
  g = tf.add_n([g[:, :, a:a + ho, c:c + wo, :, a:a + ho, c:c + wo]
                for a in range(layout.qh) for c in range(layout.qw)])
  return tf.reshape(g, [-1, k * ho * wo, k * ho * wo])


def patches(x, ksize, strides, dilation, padding, out_hw):
  """Input patches [B, T, kh*kw*cin] float32 of a 2-D convolution and their order.

  Args:
    x: [B, H, W, cin] the convolution's input (after any causal padding).
    ksize, strides, dilation: (h, w) pairs of ints.
    padding: "same" or "valid".
    out_hw: (ho, wo) the static output size, or None if unknown.

  Returns:
    (patches [B, ho*wo, kh*kw*cin] float32, Layout).
  """
  x = tf.cast(x, tf.float32)
  (kh, kw), (sh, sw), (dh, dw) = ksize, strides, dilation
  if foldable(x, ksize, strides, dilation, out_hw):
    return _folded_patches(x, ksize, strides, padding, out_hw)
  p = tf.image.extract_patches(x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1],
                               rates=[1, dh, dw, 1], padding=padding.upper())
  return algebra.to_btk(p), Layout(kh, kw, 1, 1, int(x.shape[3]))


def to_kernel(g, layout, ksize, cout):
  """A [cout, K] sum of g_i^T (patch order `layout`) -> [kh, kw, cin, cout].

  Args:
    g: [cout, qh*qw*sh*sw*cin] tensor.
    layout: the patches' Layout.
    ksize: (kh, kw).
    cout: output channels.

  Returns:
    [kh, kw, cin, cout] tensor.
  """
  qh, qw, sh, sw, cin = layout
  g = tf.reshape(g, [cout, qh, qw, sh, sw, cin])
  g = tf.transpose(g, [1, 3, 2, 4, 5, 0])
  return tf.reshape(g, [ksize[0], ksize[1], cin, cout])


def block(p, dz):
  """Per-record kernel gradients dz_i^T P_i, flattened.

  Args:
    p: [B, T, K] patches (float32).
    dz: [B, T, cout] output gradients. Records of algebra.examples_per_record are
      merged into T (algebra.regroup_btk).

  Returns:
    [B/k, cout*K] float32.
  """
  p = algebra.regroup_btk(p)
  dz = algebra.regroup_btk(tf.cast(dz, tf.float32))
  g = tf.linalg.matmul(dz, p, transpose_a=True)
  return tf.reshape(g, [tf.shape(g)[0], -1])
