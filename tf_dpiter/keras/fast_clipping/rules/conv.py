"""Ghost norms of Conv1D / Conv2D (channels_last, groups=1).

Unfold the input into patches P_i [T, kh*kw*cin] (conv_unfold.py); grad W_i =
P_i^T dz_i, grad b_i = sum_t dz_t. The form is chosen per layer by a cost model
(`_choose_form`, in multiply-adds per example; BENCHMARKS.md "Per-layer forms of the
convolution"):
  "foldgram": when the kernel is larger than its stride and the output has few positions
      (T^2 small against T K N), the Gram norm sum_{t,s} <p_t, p_s><dz_t, dz_s> with the
      patch Gram formed from the folded pixels (conv_unfold.patch_gram, no unfold) and
      the clipped sum by book-keeping: one whole-batch filter gradient of c_i dz_i, at
      the convolution kernels' rate (Bu et al. 2022, "mixed ghost clipping", Sec. 3.2;
      Bu et al. 2023, Sec. 3);
  "depthwise": when the output has more positions than a patch has entries, oneDNN is
      on (not under XLA) and few channels, the batch-as-channels depthwise filter
      gradient (Rochette et al. 2019), at most _DEPTHWISE_CHUNK examples per call;
  "filter": such a layer whose per-example gradient is too large to keep:
      per-example Conv2DBackpropFilter;
  otherwise the unfolded patches: a kernel small enough to keep per example
  (registry.keep_per_example) gets g_i as one block (registry.PerExampleBlock: its
  norms and clipped sum need no second weight-gradient product), a larger one the
  cheaper of the Gram and direct norms (algebra.factored_sqr_norm) and its sum by
  book-keeping.
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.keras.internals import runtime as routing  # oneDNN, XLA, loss scale (not the optimizer)
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

# Batch-as-channels per-example filter gradients replicate dz over the input
# channels: at most this many entries per example.
_MAX_DEPTHWISE_ENTRIES = 1 << 16
# At most this many examples per depthwise filter-gradient call: oneDNN's kernel slows down
# per example with the channel count (B cout channels); at B = 1024 the tutorial CNN's first
# convolution took 47-86 ms in one call and 10-14 ms in chunks of 64 to 256 (BENCHMARKS.md).
_DEPTHWISE_CHUNK = 256
# A per-example product (batched matrix product or depthwise filter gradient) costs about
# this many times a whole-batch convolution filter gradient per multiply-add on CPU
# (tutorial CNN, B = 256: 4-6x; BENCHMARKS.md): the cost model's weight of per-example
# work against the book-keeping sum.
_PER_EXAMPLE_SLOWDOWN = 4


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
  """Per-example filter gradients [B, kh, kw, cin, cout] by batch-as-channels depthwise
  filter gradients (Rochette et al. 2019, Sec. 3), at most _DEPTHWISE_CHUNK examples per call.

  The batch is split into n = ceil(B / _DEPTHWISE_CHUNK) chunks of m = ceil(B / n) examples
  (padded with fewer than n zero examples, whose zero gradients are sliced off); a chunk is
  one input [1, H, W, m cin] and one output gradient [1, H', W', m cin cout] (dz_i repeated
  over cin).

  Args:
    x4: [B, H, W, cin] float32 inputs.
    dz4: [B, H', W', cout] float32 output gradients.
    kernel_size: (kh, kw).
    strides: (s, s), equal strides.
    padding: "same" or "valid".

  Returns:
    [B, kh, kw, cin, cout] float32.
  """
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  b = tf.shape(x4)[0]
  n = tf.maximum((b + _DEPTHWISE_CHUNK - 1) // _DEPTHWISE_CHUNK, 1)
  m = (b + n - 1) // n
  h, w = (algebra.static_dim(x4, i) or tf.shape(x4)[i] for i in (1, 2))
  ho, wo = (algebra.static_dim(dz4, i) or tf.shape(dz4)[i] for i in (1, 2))
  x4 = tf.pad(x4, [[0, n * m - b], [0, 0], [0, 0], [0, 0]])
  dz4 = tf.pad(dz4, [[0, n * m - b], [0, 0], [0, 0], [0, 0]])
  xt = tf.transpose(tf.reshape(x4, [n, m, h, w, cin]), [0, 2, 3, 1, 4])
  xt = tf.reshape(xt, [n, 1, h, w, m * cin])
  dt = tf.transpose(tf.reshape(dz4, [n, m, ho, wo, cout]), [0, 2, 3, 1, 4])
  dt = tf.broadcast_to(dt[:, :, :, :, None, :], [n, ho, wo, m, cin, cout])
  dt = tf.reshape(dt, [n, 1, ho, wo, m * cin * cout])
  shape = tf.stack([kh, kw, m * cin, cout])

  def chunk(pair):
    return tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        pair[0], shape, pair[1], [1, strides[0], strides[1], 1], padding.upper())

  g = tf.map_fn(chunk, (xt, dt), parallel_iterations=2,
                fn_output_signature=tf.TensorSpec([kh, kw, None, cout], tf.float32))
  g = tf.transpose(tf.reshape(g, [n, kh, kw, m, cin, cout]), [0, 3, 1, 2, 4, 5])
  return tf.reshape(g, [n * m, kh, kw, cin, cout])[:b]


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


def _fold_gram_applies(x4, dz4, ksize, stride, dilation):
  """The folded patch Gram applies: stride blocks fold (conv_unfold.foldable) and the
  record size is a Python int."""
  k = registry.current_examples_per_record()
  return isinstance(k, int) and conv_unfold.foldable(x4, ksize, stride, dilation,
                                                     tuple(dz4.shape[1:3]))


def _fold_gram_cheaper(x4, dz4, ksize, stride, dilation):
  """Whether "foldgram" costs fewer multiply-adds per example than the alternatives.

  Per example, with T output positions, K = kh kw cin patch entries, N = cout, U folded
  pixels (conv_unfold.patch_gram) and s = _PER_EXAMPLE_SLOWDOWN (per-example products
  against the whole-batch filter gradient):
    foldgram:       U^2 sh sw cin + (qh qw + N + 1) T^2 (norm) + T K N / s (book-keeping)
    per-example g:  T K N (norm and sum from g)
    unfolded Gram:  T^2 (K + N) + T K N / s.

  Args:
    x4: [B, H, W, cin] the convolution's input (static spatial sizes to apply).
    dz4: [B, ho, wo, cout] output gradients.
    ksize: (kh, kw).
    stride: (sh, sw).
    dilation: (dh, dw).

  Returns:
    bool.
  """
  if not _fold_gram_applies(x4, dz4, ksize, stride, dilation):
    return False
  out_hw = tuple(dz4.shape[1:3])
  (kh, kw), (sh, sw), (ho, wo) = ksize, stride, out_hw
  t, n, cin = ho * wo, int(dz4.shape[-1]), int(x4.shape[-1])
  kk = kh * kw * cin
  qh, qw = kh // sh, kw // sw
  u = (ho + qh - 1) * (wo + qw - 1)
  fold = u * u * sh * sw * cin + (qh * qw + n + 1) * t * t + t * kk * n / _PER_EXAMPLE_SLOWDOWN
  return fold < min(t * kk * n, t * t * (kk + n) + t * kk * n / _PER_EXAMPLE_SLOWDOWN)


def _choose_form(dz4, x4, ksize, stride, dilation, keep):
  """The form of a convolution's norm (module docstring), by the cost model.

  The override (registry.form_override) if set; else "foldgram" where _fold_gram_cheaper;
  else, when the output has more positions than a patch has entries, "depthwise" (oneDNN
  on, not under XLA, few entries) or "filter" (a per-example gradient too large to keep);
  else None (unfolded patches). Under XLA the same choice except "depthwise" and "filter"
  (grouped convolutions, slow on XLA's CPU backend).

  Args:
    dz4: [B, ho, wo, cout] output gradients.
    x4: [B, H, W, cin] the convolution's input.
    ksize: (kh, kw).
    stride: (sh, sw).
    dilation: (dh, dw).
    keep: the per-example kernel gradient is small enough to keep.

  Returns:
    "foldgram", "depthwise", "filter", an override, or None.
  """
  form = registry.form_override()
  dilated = any(d != 1 for d in dilation)
  if form is not None or dilated:
    return form
  if _fold_gram_cheaper(x4, dz4, ksize, stride, dilation):
    return "foldgram"
  positions = int(np.prod(dz4.shape[1:-1])) if None not in dz4.shape[1:-1] else 0
  patch = ksize[0] * ksize[1] * int(x4.shape[-1])
  if positions <= patch:
    return None
  cout = int(dz4.shape[-1])
  if (positions * int(x4.shape[-1]) * cout <= _MAX_DEPTHWISE_ENTRIES and
      routing.onednn_enabled() and not routing.in_xla_context()):
    return "depthwise"
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


def _fold_gram_sqr_norm(x4, dz4, ksize, stride, padding):
  """Per-record squared kernel-gradient norms sum_{t,s} <p_t, p_s><dz_t, dz_s> (Li et al.
  2021, Sec. 4) with the patch Gram from conv_unfold.patch_gram.

  Args:
    x4: [B, H, W, cin] the convolution's input.
    dz4: [B, ho, wo, cout] output gradients.
    ksize: (kh, kw).
    stride: (sh, sw).
    padding: "same" or "valid".

  Returns:
    [B/k] float32 (k = registry.current_examples_per_record(), a Python int).
  """
  k = registry.current_examples_per_record()
  ga = conv_unfold.patch_gram(x4, ksize, stride, padding, tuple(dz4.shape[1:3]), k)
  b = algebra.regroup_btk(tf.cast(algebra.to_btk(dz4), tf.float32))
  gb = tf.linalg.matmul(b, b, transpose_b=True)
  return tf.reduce_sum(ga * gb, axis=[1, 2])


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
    form = _choose_form(dz4, x4, ksize, stride, dilation, keep)
    if form == "foldgram" and _fold_gram_applies(x4, dz4, ksize, stride, dilation):
      sq = _fold_gram_sqr_norm(x4, dz4, ksize, stride, padding)
      return sq + algebra.sqr_sum(db) if bias_on else sq
    if form in ("filter", "depthwise") and not dilated:
      g = registry.record_sum(_per_example_filter_grads(
          x4, dz4, ksize, stride, padding, form))
      layout = None
      blk = tf.reshape(g, [tf.shape(g)[0], -1])
    else:
      p, layout = conv_unfold.patches(x4, ksize, stride, dilation, padding,
                                      tuple(dz4.shape[1:3]))
      if not keep or form in ("gram", "foldgram"):
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
