"""Ghost norms of Conv1D / Conv2D (channels_last, groups=1).

Unfold the input into patches P_i [T, kh*kw*cin] (conv_unfold.py); grad W_i =
P_i^T dz_i, grad b_i = sum_t dz_t. A kernel small enough to keep per example
(registry.keep_per_example) gets g_i as one block (registry.PerExampleBlock:
its norms and clipped sum need no second weight-gradient product); a larger one
gets the cheaper of the Gram and direct norms (algebra.factored_sqr_norm) and
its sum by book-keeping. When the output has more positions than a patch has
entries and oneDNN is on, the batch-as-channels depthwise filter gradient is
faster than the unfold for few channels (BENCHMARKS.md); a large kernel there
gets per-example Conv2DBackpropFilter.
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

# Batch-as-channels per-example filter gradients replicate dz over the input
# channels: at most this many entries per example.
_MAX_DEPTHWISE_ENTRIES = 1 << 16


def _conv_forward(layer, x, padding):
  z = ops.conv(x, layer.kernel, strides=list(layer.strides), padding=padding,
               dilation_rate=layer.dilation_rate,
               data_format=layer.data_format)
  if layer.use_bias:
    z = ops.add(z, ops.reshape(layer.bias, (1,) * (layer.rank + 1) +
                               (layer.filters,)))
  outputs = layer.activation(z) if layer.activation is not None else z
  return z, outputs


def _conv_accepts(layer):
  return (algebra.plain_layer(layer) and layer.data_format == "channels_last"
          and getattr(layer, "groups", 1) == 1)


def _depthwise_filter_grads(x4, dz4, kernel_size, strides, padding):
  """Batch moved into the channels (Rochette et al. 2019, Sec. 3): input
  [1, H, W, B cin], output gradient [1, H', W', B cin cout] (dz_i repeated
  over cin); one depthwise filter gradient."""
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  b = tf.shape(x4)[0]
  h, w = tf.shape(x4)[1], tf.shape(x4)[2]
  ho, wo = tf.shape(dz4)[1], tf.shape(dz4)[2]
  xt = tf.reshape(tf.transpose(x4, [1, 2, 0, 3]), [1, h, w, b * cin])
  dt = tf.transpose(dz4, [1, 2, 0, 3])[:, :, :, None, :]
  dt = tf.broadcast_to(dt, [ho, wo, b, cin, cout])
  dt = tf.reshape(dt, [1, ho, wo, b * cin * cout])
  g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      xt, tf.stack([kh, kw, b * cin, cout]), dt,
      [1, strides[0], strides[1], 1], padding.upper())
  g = tf.reshape(g, [kh, kw, b, cin, cout])
  return tf.transpose(g, [2, 0, 1, 3, 4])


def _per_example_filter_grads(x4, dz4, kernel_size, strides, padding, form):
  """Per-example filter gradients [B, kh, kw, cin, cout] (dilation 1), float32.

  form "depthwise": _depthwise_filter_grads; form "filter":
  Conv2DBackpropFilter per example (tf.vectorized_map). Which of the two is
  faster depends on the CPU kernels (oneDNN or not, BENCHMARKS.md).
  """
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  x4 = tf.cast(x4, tf.float32)
  dz4 = tf.cast(dz4, tf.float32)
  if form == "depthwise" and strides[0] == strides[1]:  # TF's CPU kernel
    return _depthwise_filter_grads(x4, dz4, kernel_size, strides, padding)

  def one(pair):
    xi, di = pair
    return tf.compat.v1.nn.conv2d_backprop_filter(
        xi[None], [kh, kw, cin, cout], di[None], [1, strides[0], strides[1], 1],
        padding.upper())

  return tf.vectorized_map(one, (x4, dz4))


def _choose_form(dz4, x4, ksize, dilated, keep):
  """The override; else "depthwise" (oneDNN on, few entries) or "filter" (a
  per-example gradient too large to keep) when the output has more positions than a
  patch has entries; else None (unfold, conv_unfold.patches)."""
  form = registry.form_override()
  if form is not None or dilated:
    return form
  positions = int(np.prod(dz4.shape[1:-1])) if None not in dz4.shape[1:-1] else 0
  patch = ksize[0] * ksize[1] * int(x4.shape[-1])
  if positions <= patch:
    return None
  cout = int(dz4.shape[-1])
  if (positions * int(x4.shape[-1]) * cout <= _MAX_DEPTHWISE_ENTRIES and
      routing.onednn_enabled() and not routing.in_xla_context()):
    return "depthwise"
  # Under XLA the per-example filter gradients are grouped convolutions (slow on XLA's
  # CPU backend): the unfold or the Gram norm instead.
  return None if keep or routing.in_xla_context() else "filter"


def _unpacker(layer, layout, ksize, with_bias):
  """Row sums of [kernel block(, bias block)] -> [kernel(, bias)]; layout None: the
  kernel block is in the kernel's order, else a conv_unfold block in `layout`."""
  cout = layer.filters

  def unpack(sums):
    kernel = sums[0]
    if layout is not None:
      kernel = conv_unfold.to_kernel(kernel, layout, ksize, cout)
    return [tf.reshape(kernel, layer.kernel.shape)] + list(sums[1:])

  return unpack


def _conv_sqr_norm_fn(layer, x4, dz4_fn, padding):
  """The sqr_norm_fn of a 2-D view of the convolution: x4 [B, H, W, cin] its input,
  dz4_fn maps the watched gradient to [B, ho, wo, cout], padding "same"/"valid"."""
  kernel_on = algebra.trainable(layer.kernel)
  bias_on = layer.use_bias and algebra.trainable(layer.bias)
  pair = lambda t: tuple(t) if len(t) == 2 else (1, t[0])
  ksize, stride, dilation = (pair(layer.kernel_size), pair(layer.strides),
                             pair(layer.dilation_rate))
  dilated = any(d != 1 for d in dilation)
  keep = registry.keep_per_example(int(np.prod(layer.kernel.shape)))

  def sqr_norm_fn(dz):
    dz4 = dz4_fn(dz)
    db = algebra.bias_grad(dz, (layer.filters,)) if bias_on else None
    if not kernel_on:
      return algebra.result(layer, algebra.sqr_sum(db), {id(layer.bias): db})
    form = _choose_form(dz4, x4, ksize, dilated, keep)
    if form in ("filter", "depthwise") and not dilated:
      g = registry.record_sum(_per_example_filter_grads(
          x4, dz4, ksize, stride, padding, form))
      layout = None
      blk = tf.reshape(g, [tf.shape(g)[0], -1])
    else:
      p, layout = conv_unfold.patches(x4, ksize, stride, dilation, padding,
                                      tuple(dz4.shape[1:3]))
      if not keep or form == "gram":
        sq, _ = algebra.factored_sqr_norm(p, algebra.to_btk(dz4))
        return sq + algebra.sqr_sum(db) if bias_on else sq
      blk = conv_unfold.block(p, algebra.to_btk(dz4))
    blocks = [blk] if db is None else [blk, db]
    sq = tf.add_n([algebra.sqr_sum(b) for b in blocks])
    if not keep:
      return sq
    return registry.PerExampleBlock(sq, blocks, _unpacker(layer, layout, ksize, bias_on))

  return sqr_norm_fn


@registry.float32_watched
@registry.supports_records
def conv2d_norm_fn(layer, inputs):
  """Norm function (registry contract) of keras.layers.Conv2D.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  if not _conv_accepts(layer):
    return None
  x = inputs
  z, outputs = _conv_forward(layer, x, layer.padding)
  return outputs, z, _conv_sqr_norm_fn(layer, x, lambda dz: dz, layer.padding)


@registry.float32_watched
@registry.supports_records
def conv1d_norm_fn(layer, inputs):
  """Norm function (registry contract) of keras.layers.Conv1D.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  if not _conv_accepts(layer):
    return None
  x = inputs
  padding = layer.padding
  if padding == "causal":
    x = ops.pad(x, layer._compute_causal_padding())  # pylint: disable=protected-access
    padding = "valid"
  z, outputs = _conv_forward(layer, x, padding)
  return outputs, z, _conv_sqr_norm_fn(layer, x[:, None], lambda dz: dz[:, None],
                                       padding)
