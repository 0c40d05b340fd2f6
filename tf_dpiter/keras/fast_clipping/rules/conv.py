"""Ghost norms of Conv1D / Conv2D (channels_last, groups=1).

Unfold the input into patches P_i [T, kh*kw*cin] (outside XLA by one gather of pixels,
`_gathered_patches`; under XLA conv_unfold.py's fused slices); grad W_i = P_i^T dz_i,
grad b_i = sum_t dz_t. The form is chosen per layer by a cost model
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
      gradient (Rochette et al. 2019);
  "filter": such a layer whose per-example gradient is too large to keep:
      per-example Conv2DBackpropFilter;
  otherwise the unfolded patches: a kernel small enough to keep per example
  (registry.keep_per_example) gets g_i = dz_i^T P_i by one batched matrix product, a larger
  one the cheaper of the Gram and direct norms (algebra.factored_sqr_norm) and its sum by
  book-keeping.
With one example per record and a kernel small enough to keep per example
(registry.keep_per_example), the clipped sum is sum_i c_i g_i of per-example gradients in a
pinned order (`_pinned_kept_sum` from the kept ones, `_pinned_recomputed_sum` forming them
again over chunks where they are not kept; blocks of rows, the blocks by a pairwise tree),
declared to the step (algebra.report_pinned), which then clips to C / (1 + eta) so that one
record moves the float32 sum by at most C (Casacuberta et al., "Widespread underestimation
of sensitivity in differentially private libraries and how to fix it", CCS 2022; the
book-keeping filter gradient sums the B T positions in an order no one pins: 1.25 C measured
at B = 4096 under XLA); the folded Gram is then not chosen (the per-example gradients are
formed anyway). Where the clipped sum is not formed from the gradients whose norms are taken
(the folded Gram, the sum by book-keeping) the norms are upper bounds that cover the float32
rounding of the record's terms (`_fold_gram_contraction`, float32 alone;
algebra.with_sum_rounding): a record whose positions' gradients nearly cancel got a float32
norm near 0 and moved the clipped sum by up to 7e4 C.

Memory budget (the rules' shared one, rules/budget.py): every per-example form
("depthwise", "filter", the unfolded g_i, and the folded Gram's norms) runs over chunks of
the batch whose temporaries take at most budget.CHUNK_BYTES, one chunk at a time, the chunks
of one size (`_over_chunks`, `budget.balanced_chunk`: a Poisson batch just above a multiple
of the chunk is not padded up to the next multiple; the whole batch in one call when it fits
one chunk, or, for kept gradients, when its temporaries other than the kept gradients fit
budget.CHUNK_BYTES: `_per_example_pass`), so a convolution's extra memory does not grow with
the batch. The
per-example gradients g_i are kept for the clipped sum sum_i c_i g_i (registry.FactorSums:
no second filter gradient) only while the batch's take at most budget.KEEP_BYTES (a pinned
sum: twice that, `_PINNED_KEEP_FACTOR`); beyond, the norms alone are kept (from the folded
Gram where `_fold_gram_cheaper`, as the tutorial CNN's second convolution at B = 1,024: no
per-example gradient is formed for them) and the clipped sum is one whole-batch filter
gradient of c_i dz_i (a pinned sum: the gradients formed again). With
an unknown batch (fit's Poisson samples) both choices are made at run time (tf.cond on B)
unless the step's public bound on the batch settles them at trace time
(budget.settled_one_call: one call and kept gradients up to budget.BOUND_FACTOR times the
budget's limits);
under XLA with a batch the trace does not know, the batch is one call and the gradients are
kept (registry.keep_per_example) as before: XLA compiles one static batch.

Under XLA inside a loop body or a branch (the padded Poisson tail's chunks,
keras/optimizer/chunking.py) a Conv2D's forward pass differentiates through canonical
convolutions (input NHWC, kernel HWIO; `_conv2d_canonical_grads`): XLA's CPU backend
canonicalizes the entry computation's convolutions only, and TensorFlow's own input and filter
gradients there ran a naive loop: most of the tutorial CNN's 8-row tail chunk (about 2.8 of its
3 ms CPU; 0.03 ms each by Eigen). Same sums, other forms (dilated, Conv1D) unchanged.
"""

from typing import Callable, NamedTuple

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import runtime as routing  # oneDNN, XLA, loss scale (not the optimizer)
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

# Batch-as-channels per-example filter gradients replicate dz over the input
# channels: at most this many entries per example.
_MAX_DEPTHWISE_ENTRIES = 1 << 16
# Depthwise filter-gradient calls (batch-as-channels: m examples of cin channels are m cin
# input channels). oneDNN's kernel runs 2-2.5x slower per example from 512 input channels up
# (CPU ms of one call, no XLA, oneDNN on, 2026-12-01, load 7-9, a 28x28 input's 8x8 kernel at
# stride 2: cin 1, cout 16, 384 / 500 / 511 / 512 examples 4.24 / 7.1 / 6.56 / 13.25; cout 8,
# 500 / 511 / 512 examples 5.12 / 8.0 / 11.68; cin 2, cout 16, 250 / 256 examples 6.36 /
# 14.62; cin 4, cout 8, 127 / 128 examples 5.28 / 12.02), and below that one call on the
# whole batch is cheaper than chunks (no map loop, no padded rows: the tutorial CNN's first
# convolution at 200 / 256 / 272 / 320 / 400 examples, 2.36 / 2.55 / 3.15 / 3.47 / 4.45 ms in
# one call against 3.5 / 2.89 / 4.64 / 4.39 / 6.05 in chunks of 128 padded to 128 rows;
# the rule's per-example pass with its balanced chunks at Poisson batches of mean 256, 3.09 ->
# 2.95 ms; benchmarks/conv_depthwise_channels.py). So a batch of at most
# _DEPTHWISE_CHANNELS // cin examples is one call; a larger one runs in chunks of at most
# _DEPTHWISE_CHUNK_CHANNELS // cin examples (chunks of 256 examples of one channel showed no
# gain at B = 1024, within the fit benchmark's noise), and oneDNN's own scratch
# memory (outside TensorFlow's allocator) grows with the chunk: the per-example pass of that
# convolution at B = 1024 raised the peak RSS by 62 MiB in chunks of 256, 40 in chunks of
# 128, 36 in chunks of 64, for 13.7, 13.2 and 14.2 ms of CPU time (2026-11-28, load 7).
_DEPTHWISE_CHANNELS = 384
_DEPTHWISE_CHUNK_CHANNELS = 128
# `_gathered_patches` needs at least this many input channels: a gather copies one pixel's
# cin floats at a time. B = 256, no XLA, oneDNN on, load 6-7, CPU ms of the patches, gather
# against conv_unfold.patches: 16x16 inputs, 3x3 kernel, stride 1, "same" (ExtractImagePatches):
# cin 1 3.58 / 3.29, 2 3.64 / 4.80, 4 3.62 / 4.12, 16 5.53 / 10.67; 13x13, 4x4, stride 2,
# "valid" (folded slices): cin 1 1.00 / 1.10, 2 1.07 / 1.24, 16 1.20 / 2.54.
_GATHER_MIN_CHANNELS = 2
# A per-example product (batched matrix product or depthwise filter gradient) costs about
# this many times a whole-batch convolution filter gradient per multiply-add on CPU
# (tutorial CNN, B = 256: 4-6x; BENCHMARKS.md): the cost model's weight of per-example
# work against the book-keeping sum.
_PER_EXAMPLE_SLOWDOWN = 4
# Memory budget of one convolution's per-example work, the rules' shared one
# (rules/budget.py: CHUNK_BYTES, KEEP_BYTES): the per-example gradients are formed over chunks
# of examples whose temporaries (inputs regrouped, output gradients, per-example gradients)
# take at most budget.CHUNK_BYTES, one chunk at a time, so that the layer's extra memory does
# not grow with the batch; and they are kept for the clipped sum (sum_i c_i g_i, which saves
# the whole-batch filter gradient) only while the batch's gradients take at most
# budget.KEEP_BYTES (B P 4 bytes, P kernel entries): beyond, only the norms are kept and the
# clipped sum is one whole-batch filter gradient of the clip-weighted output gradients
# (book-keeping, Bu et al. 2023, Sec. 3). Tutorial CNN, first convolution (P = 1,024): kept
# up to B = 2,048, one call up to 384 examples (_DEPTHWISE_CHANNELS), chunks of 128 beyond.


def _in_xla_control_flow():
  """True while a function is traced for XLA inside a loop body or a branch (tf.while_loop,
  tf.cond; chunking's padded tail chunks). XLA's CPU backend rewrites a convolution into the
  form its Eigen kernels take (input NHWC, kernel HWIO) in the entry computation only, so
  there TensorFlow's own backward convolutions (swapped kernel dimensions) run a naive loop.

  Returns:
    bool.
  """
  if not routing.in_xla_context():
    return False
  # TensorFlow has no public spelling of these graph types (runtime.in_xla_context neither).
  from tensorflow.python.ops import control_flow_util_v2 as cf  # pylint: disable=g-import-not-at-top
  graph = tf.compat.v1.get_default_graph()
  while isinstance(graph, cf.FuncGraph):
    if isinstance(graph, (cf.WhileBodyFuncGraph, cf.WhileCondFuncGraph, cf.CondBranchFuncGraph)):
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def _same_pad_before(size, k, s, padding):
  """Rows of padding before the input of a convolution along one axis.

  Args:
    size: the input's length along the axis.
    k: the kernel's length along it.
    s: the stride along it.
    padding: "same" (TensorFlow's: half the total max((ceil(size / s) - 1) s + k - size, 0),
      rounded down) or "valid" (0).

  Returns:
    int.
  """
  if padding == "valid":
    return 0
  out = -(-size // s)
  return max((out - 1) * s + k - size, 0) // 2


def _pad_or_crop(t, axis, before, after):
  """`t` padded with zeros or cropped at both ends of one axis.

  Args:
    t: a tensor with a static length along `axis`.
    axis: the axis (int).
    before: rows added before (> 0) or removed (< 0).
    after: rows added after (> 0) or removed (< 0).

  Returns:
    the tensor.
  """
  if before < 0 or after < 0:
    t = t[(slice(None),) * axis + (slice(max(-before, 0), t.shape[axis] + min(after, 0)),)]
  pads = [[0, 0]] * len(t.shape)
  pads[axis] = [max(before, 0), max(after, 0)]
  return tf.pad(t, pads) if before > 0 or after > 0 else t


def _conv2d_canonical_grads(x, kernel, stride, padding):
  """tf.nn.conv2d (NHWC, no dilation) whose input and filter gradients are canonical
  convolutions (input NHWC, kernel HWIO): XLA's CPU backend runs them by Eigen in a loop body
  too (`_in_xla_control_flow`), where TensorFlow's own Conv2DBackpropInput / Filter lower to
  swapped kernel dimensions and a naive loop. Same sums: with p_h the rows of padding
  before the input, z_p = sum_k x_{s p + k - p_h} W_k gives
    dx_j = sum_k D_{j + p_h - k} W_k  (D: dz with s - 1 zero rows between its rows), the
      correlation of D (padded by kh - 1 - p_h before) with W reversed, in and out swapped
      (s^2 times the multiply-adds of a dilated-input convolution, most of them by 0);
    dW_k = sum_{b, p} x_{b, s p + k - p_h} dz_{b, p}, a stride-1 convolution dilated by s of
      the input [cin, H, W, B] with the output gradient [ho, wo, B, cout] as the kernel.
  A zero row of x or dz adds exactly 0 to either.

  Args:
    x: [B, H, W, cin] input (static spatial sizes).
    kernel: [kh, kw, cin, cout] tensor.
    stride: (sh, sw).
    padding: "same" or "valid".

  Returns:
    z [B, ho, wo, cout].
  """
  (h, w), (kh, kw, _, _) = x.shape[1:3], kernel.shape
  (sh, sw) = stride
  ph, pw = _same_pad_before(h, kh, sh, padding), _same_pad_before(w, kw, sw, padding)

  @tf.custom_gradient
  def conv(x, kernel):
    z = tf.nn.conv2d(x, kernel, [1, sh, sw, 1], padding.upper())
    ho, wo = z.shape[1:3]

    def grad(dz):
      d = dz
      if sh > 1 or sw > 1:   # s - 1 zero rows (columns) between the rows of dz
        b, c = tf.shape(dz)[0], dz.shape[-1]
        d = tf.pad(dz[:, :, None, :, None, :], [[0, 0], [0, 0], [0, sh - 1], [0, 0],
                                                 [0, sw - 1], [0, 0]])
        d = tf.reshape(d, tf.stack([b, ho * sh, wo * sw, c]))[:, :(ho - 1) * sh + 1,
                                                               :(wo - 1) * sw + 1]
      lh, lw = kh - 1 - ph, kw - 1 - pw
      d = _pad_or_crop(d, 1, lh, h + kh - 1 - lh - ((ho - 1) * sh + 1))
      d = _pad_or_crop(d, 2, lw, w + kw - 1 - lw - ((wo - 1) * sw + 1))
      flipped = tf.transpose(tf.reverse(kernel, [0, 1]), [0, 1, 3, 2])
      dx = tf.nn.conv2d(d, flipped, [1, 1, 1, 1], "VALID")
      xp = _pad_or_crop(x, 1, ph, kh + (ho - 1) * sh - ph - h)
      xp = _pad_or_crop(xp, 2, pw, kw + (wo - 1) * sw - pw - w)
      dw = tf.nn.conv2d(tf.transpose(xp, [3, 1, 2, 0]), tf.transpose(dz, [1, 2, 0, 3]),
                        [1, 1, 1, 1], "VALID", dilations=[1, sh, sw, 1])
      return dx, tf.transpose(dw, [1, 2, 0, 3])

    return z, grad

  return keras_internals.graph_owned_gradients(conv, x, kernel)


def _conv_forward(layer, x, padding):
  if (layer.rank == 2 and padding in ("same", "valid") and tuple(layer.dilation_rate) == (1, 1)
      and None not in x.shape[1:] and _in_xla_control_flow()):
    z = _conv2d_canonical_grads(x, ops.cast(layer.kernel, x.dtype), tuple(layer.strides),
                                padding)
  else:
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


def _depthwise_chunk(x4, dz4, kernel_size, strides, padding):
  """Per-example filter gradients of a chunk of m examples by one batch-as-channels
  depthwise filter gradient (Rochette et al. 2019, Sec. 3): the input regrouped as
  [1, H, W, m cin], the output gradient as [1, H', W', m cin cout] (dz_i repeated over cin).

  Args:
    x4: [m, H, W, cin] float32 inputs.
    dz4: [m, H', W', cout] float32 output gradients.
    kernel_size: (kh, kw).
    strides: (s, s), equal strides.
    padding: "same" or "valid".

  Returns:
    [kh kw, m, cin cout] float32: example i's gradient is [:, i, :] (in the kernel's order
    once reshaped to [kh, kw, cin, cout]); left in this layout, which needs no transpose.
  """
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  m = tf.shape(x4)[0]
  h, w = (algebra.static_dim(x4, i) or tf.shape(x4)[i] for i in (1, 2))
  ho, wo = (algebra.static_dim(dz4, i) or tf.shape(dz4)[i] for i in (1, 2))
  # m enters the shapes once (the filter's size): -1 elsewhere, so that a chunk of a size the
  # trace does not know adds no shape ops per reshape
  xt = tf.reshape(tf.transpose(x4, [1, 2, 0, 3]), [1, h, w, -1])
  dt = tf.transpose(dz4, [1, 2, 0, 3])
  if cin > 1:
    dt = tf.broadcast_to(dt[:, :, :, None, :], [ho, wo, m, cin, cout])
  dt = tf.reshape(dt, [1, ho, wo, -1])
  g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      xt, tf.stack([kh, kw, m * cin, cout]), dt, [1, strides[0], strides[1], 1],
      padding.upper())
  return tf.reshape(g, [kh * kw, -1, cin * cout])


def _filter_chunk(x4, dz4, kernel_size, strides, padding):
  """Per-example filter gradients of a chunk by Conv2DBackpropFilter per example
  (tf.vectorized_map): [1, m, kh kw cin cout] float32, each row in the kernel's order."""
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])

  def one(pair):
    xi, di = pair
    return tf.compat.v1.nn.conv2d_backprop_filter(
        xi[None], [kh, kw, cin, cout], di[None], [1, strides[0], strides[1], 1],
        padding.upper())

  g = tf.vectorized_map(one, (x4, dz4))
  return tf.reshape(g, [1, tf.shape(x4)[0], kh * kw * cin * cout])


def _gathers_patches(x4, out_hw):
  """Whether `_patches` unfolds by one gather (`_gathered_patches`): not under XLA (whose
  CPU gather was slower than conv_unfold's fused slices), static spatial sizes, and at least
  _GATHER_MIN_CHANNELS input channels (a gather copies one pixel's cin floats at a time).

  Args:
    x4: [B, H, W, cin] the convolution's input.
    out_hw: (ho, wo) the static output size, or None.

  Returns:
    bool.
  """
  return (not routing.in_xla_context() and out_hw is not None and None not in out_hw and
          None not in x4.shape[1:] and int(x4.shape[-1]) >= _GATHER_MIN_CHANNELS)


def _patch_layout(x4, ksize, stride, dilation, out_hw):
  """The conv_unfold.Layout of `_patches`' entries for this layer's shapes."""
  cin = int(x4.shape[-1])
  if (not _gathers_patches(x4, out_hw) and
      conv_unfold.foldable(x4, ksize, stride, dilation, out_hw)):
    return conv_unfold.Layout(ksize[0] // stride[0], ksize[1] // stride[1], stride[0],
                              stride[1], cin)
  return conv_unfold.Layout(ksize[0], ksize[1], 1, 1, cin)


def _gathered_patches(x4, ksize, stride, dilation, padding, out_hw):
  """Input patches [B, ho wo, kh kw cin] float32 in the kernel's order (kh, kw, cin) by one
  gather of pixels: the input (padded by TensorFlow's "same" rule, else as it is) viewed as
  [B, Hp Wp, cin], patch t = (p, q) entry (i, j) the pixel (sh p + dh i, sw q + dw j). One
  copy of the patches' entries, against conv_unfold.patches' folded copy, qh qw slices and
  their concatenation (the tutorial CNN's second convolution at B = 256: 1.1 against 2.5 ms
  CPU, no XLA, oneDNN on, load 7).

  Args:
    x4: [B, H, W, cin] (`_gathers_patches`).
    ksize, stride, dilation: (h, w) pairs of ints.
    padding: "same" or "valid".
    out_hw: (ho, wo) static ints.

  Returns:
    [B, ho wo, kh kw cin] float32.
  """
  (kh, kw), (sh, sw), (dh, dw), (ho, wo) = ksize, stride, dilation, out_hw
  x = tf.cast(x4, tf.float32)
  (h, w), cin = x.shape[1:3], int(x.shape[-1])
  if padding == "same":
    th = max((ho - 1) * sh + (kh - 1) * dh + 1 - h, 0)
    tw = max((wo - 1) * sw + (kw - 1) * dw + 1 - w, 0)
    x = tf.pad(x, [[0, 0], [th // 2, th - th // 2], [tw // 2, tw - tw // 2], [0, 0]])
  hp, wp = int(x.shape[1]), int(x.shape[2])
  rows = (sh * np.arange(ho)[:, None, None, None] + dh * np.arange(kh)[None, None, :, None])
  cols = (sw * np.arange(wo)[None, :, None, None] + dw * np.arange(kw)[None, None, None, :])
  index = (rows * wp + cols).reshape(ho * wo, kh * kw).astype(np.int32)
  p = tf.gather(tf.reshape(x, [-1, hp * wp, cin]), index, axis=1)
  return tf.reshape(p, [-1, ho * wo, kh * kw * cin])


def _patches(x4, ksize, stride, dilation, padding, out_hw):
  """Input patches [B, T, K] float32 and their conv_unfold.Layout: `_gathered_patches` where
  `_gathers_patches`, else conv_unfold.patches (fused slices of the folded input or
  ExtractImagePatches)."""
  if _gathers_patches(x4, out_hw):
    return (_gathered_patches(x4, ksize, stride, dilation, padding, out_hw),
            _patch_layout(x4, ksize, stride, dilation, out_hw))
  return conv_unfold.patches(x4, ksize, stride, dilation, padding, out_hw)


def _unfold_chunk(x4, dz4, kernel_size, strides, dilation, padding):
  """Per-example filter gradients of a chunk from the unfolded input, dz_i^T P_i (the order
  of the batched matrix product that needs no transpose of the patches):
  ([1, m, cout K] float32 in `_patches`' order, its conv_unfold.Layout)."""
  p, layout = _patches(x4, kernel_size, strides, dilation, padding, tuple(dz4.shape[1:3]))
  g = tf.linalg.matmul(algebra.to_btk(dz4), p, transpose_a=True)
  return tf.reshape(g, [1, tf.shape(g)[0], -1]), layout


class _Form(NamedTuple):
  """A per-example form of a convolution: chunk_fn(x4 [m, ...], dz4 [m, ...]) -> g
  [rows, m, cols] float32 (example i's gradient is g[:, i, :]); temp_bytes: its temporaries
  per example; cap: at most this many examples per chunk; to_kernel: a sum of g over the
  examples [rows, cols] -> [kh, kw, cin, cout]; whole: at most this many examples in one call
  on the whole batch (`_per_example_pass`; at least cap)."""
  chunk_fn: Callable
  rows: int
  cols: int
  temp_bytes: int
  cap: int
  to_kernel: Callable
  whole: int = 1 << 30


def _per_example_form(form, x4, dz4, ksize, stride, dilation, padding):
  """The _Form of `form` ("depthwise", "filter", or else the unfolded patches) for this
  layer's shapes (static spatial sizes and channels)."""
  kh, kw = ksize
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  size = lambda t: int(np.prod([d for d in t.shape[1:] if d is not None]))
  p = kh * kw * cin * cout
  kernel = lambda g: tf.reshape(g, [kh, kw, cin, cout])
  if form == "depthwise" and stride[0] == stride[1]:
    return _Form(lambda x, d: _depthwise_chunk(x, d, ksize, stride, padding), kh * kw,
                 cin * cout, 4 * (size(x4) + size(dz4) * cin + 2 * p),
                 max(1, _DEPTHWISE_CHUNK_CHANNELS // cin), kernel,
                 max(1, _DEPTHWISE_CHANNELS // cin, _DEPTHWISE_CHUNK_CHANNELS // cin))
  if form in ("depthwise", "filter"):
    return _Form(lambda x, d: _filter_chunk(x, d, ksize, stride, padding), 1, p,
                 4 * (size(x4) + size(dz4) + 2 * p), 1 << 30, kernel)
  t = size(dz4) // cout
  layout = _patch_layout(x4, ksize, stride, dilation, tuple(dz4.shape[1:3]))
  return _Form(lambda x, d: _unfold_chunk(x, d, ksize, stride, dilation, padding)[0], 1, p,
               4 * (t * kh * kw * cin + size(dz4) + 2 * p), 1 << 30,
               lambda g: conv_unfold.to_kernel(g, layout, ksize, cout))


def _record_grads(g, k):
  """The records' gradients [A, m / k, P], sums over a record's examples of g [A, m, P] (g
  itself for k = 1): the terms the clipped sum weights are those whose norms are taken (the
  examples' gradients weighted apart round otherwise; where they nearly cancel within a
  record, one record moved the sum by 1.04 C).

  Args:
    g: [A, m, P] float32 per-example gradients.
    k: examples per record (m a multiple of k; a Python int or a scalar tensor).

  Returns:
    [A, m / k, P] float32.
  """
  if isinstance(k, int) and k == 1:
    return g
  return tf.reduce_sum(tf.reshape(g, [g.shape[0], -1, k, g.shape[2]]), axis=2)


def _record_sqr_norms(g, k):
  """Squared norms of the records' gradients, sum over a, p of (sum over a record's examples
  of g[a, i, p])^2.

  The squares are summed in a pinned order (a reduction in an order XLA chooses may take up
  to A P - 1 roundings per square: algebra.record_sqr_sums): over the first axis by
  summation.pairwise_sum's tree of elementwise [m / k, P] adds (no transpose of the squares;
  one reduction over the non-adjacent axes (0, 2) makes TensorFlow transpose them), then
  over the contiguous last axis by summation.pinned_row_sums; the depth, the tree's levels
  plus the row sum's, noted for the clip's margin (algebra.note_norm_depth).

  Args:
    g: [A, m, P] float32 per-example gradients (example i's at g[:, i, :]).
    k: examples per record (m a multiple of k; a Python int or a scalar tensor).

  Returns:
    [m / k] float32.
  """
  g = _record_grads(g, k)
  p = g.shape[2]
  if _fuses_squares(g.shape[0], p):
    return _block_norms_sqr_sums(g[0])
  levels = summation.tree_depth(g.shape[0]) if g.shape[0] is not None else 40   # A <= 2^40
  algebra.note_norm_depth(levels + summation.square_sum_depth(
      p if p is not None else algebra.MOST_ENTRIES))
  return summation.pinned_row_sums(summation.pairwise_sum(tf.square(g), algebra.const),
                                   const=algebra.const)


# Relative roundings a block's sum of squares goes through in `_block_norms_sqr_sums` after
# the sum: the Euclidean norm's square root and the square that undoes it, each within 2
# units in the last place (a correctly rounded square root is within one; 2 covers a
# fast-math approximation), so the block's value is at least (1 - u)^5 times its float32 sum
# of squares ((1 - 2u)^2 (1 - u) >= (1 - u)^5).
_BLOCK_NORM_ROUNDINGS = 5


def _fuses_squares(a, p):
  """Whether `_record_sqr_norms` sums the squares of g [A, m, P] by `_block_norms_sqr_sums`:
  one row per example (A = 1), P a static multiple of summation.SQUARE_BLOCK above it, and
  not under XLA (which has no EuclideanNorm kernel; it fuses the squares into their sum).

  Args:
    a: A (an int or None).
    p: P (an int or None).

  Returns:
    bool.
  """
  b = summation.SQUARE_BLOCK
  return (a == 1 and p is not None and p > b and p % b == 0 and
          not routing.in_xla_context())


def _block_norms_sqr_sums(g):
  """Squared norms [m] of the rows of g [m, P] in summation.pinned_row_sums' plan (blocks of
  b = summation.SQUARE_BLOCK entries summed in any order, the blocks by summation.pairwise_sum),
  each block's sum of squares taken as the square of its Euclidean norm
  (tf.math.reduce_euclidean_norm: the squares summed in one pass, no [m, P] tensor of
  squares). Each square goes through at most summation.square_sum_depth(P) additions and
  _BLOCK_NORM_ROUNDINGS relative roundings, noted as that many more additions (a lower bound
  of the sum, algebra.note_norm_depth, covers either). The tutorial CNN's second convolution
  (P = 8,192), B = 256: 1.0 against 1.8 ms CPU (no XLA, oneDNN on, load 9).

  Args:
    g: [m, P] float32 (`_fused_squares`).

  Returns:
    [m] float32.
  """
  b, p = summation.SQUARE_BLOCK, int(g.shape[1])
  algebra.note_norm_depth(summation.square_sum_depth(p) + _BLOCK_NORM_ROUNDINGS)
  norms = tf.math.reduce_euclidean_norm(algebra.reshape(g, [-1, p // b, b]), axis=2)
  return summation.pairwise_sum(tf.transpose(tf.square(norms)), algebra.const)


def _chunkable(x4, k):
  """Whether the batch may be split into chunks: records of a Python int k, and under XLA a
  batch known to the trace (XLA compiles one static batch; a loop over chunks of a batch the
  trace does not know cannot be compiled, and there the whole batch is one call)."""
  return isinstance(k, int) and (x4.shape[0] is not None or not routing.in_xla_context())


def _over_chunks(body, x4, dz4, m, k, extra_specs=(), whole=None, fast=None):
  """body(x chunk [m', ...], dz chunk [m', ...]) -> (sq [m' / k], *extras [a, m' / k, c]) over
  the batch: on the whole batch when it fits one chunk of m examples (or m is None; or it has
  at most `whole` examples), else one chunk at a time (tf.map_fn, one iteration alive at once) in n = ceil(B / m) chunks of equal
  size (budget.balanced_chunk), the last padded with fewer than n k zero examples whose rows are cut
  from sq.

  Args:
    body: the per-chunk function.
    x4: [B, H, W, cin] float32 inputs.
    dz4: [B, ho, wo, cout] float32 output gradients.
    m: at most this many examples per chunk (a multiple of k), or None for one call on the
      batch.
    k: examples per record (a Python int, or a tensor when m is None).
    extra_specs: tf.TensorSpec of each extra output of one chunk, its chunk axis None.
    whole: the most examples one call on the whole batch takes within the memory budget (a
      Python int >= m), or None for m.
    fast: the most examples one call runs at its best speed (a Python int), or None: a
      batch of more than min(whole, fast) examples (at least m) runs in chunks; under a
      public bound, budget.settled_one_call decides at trace time.

  Returns:
    (sq [B / k], *extras [n, a, m' / k, c]) (n = 1 and m' = B for one call on the batch).
  """
  b = tf.shape(x4)[0]

  def one_shot():
    out = body(x4, dz4)
    return (out[0],) + tuple(e[None] for e in out[1:])

  if m is None:
    return one_shot()

  static_b = x4.shape[0]
  pad = lambda t, rows: tf.pad(t, [[0, rows], [0, 0], [0, 0], [0, 0]])

  def chunked():
    if static_b is not None:   # XLA: static slices of the padded batch
      n, mc = budget.balanced_chunk(static_b, m, k)
      specs = (tf.TensorSpec([mc // k], tf.float32),) + tuple(   # extras are per record
          tf.TensorSpec(s.shape[:1].concatenate([mc // k]).concatenate(s.shape[2:]), s.dtype)
          for s in extra_specs)
      split = lambda t: tf.reshape(pad(t, n * mc - static_b), [n, mc] + t.shape[1:].as_list())
      return_rows = tf.map_fn(lambda pair: tuple(body(pair[0], pair[1])),
                              (split(x4), split(dz4)), parallel_iterations=1,
                              fn_output_signature=specs)
    else:   # each chunk sliced from the batch and padded alone: no copy of the batch
      n, mc = budget.balanced_chunk(b, m, k)
      specs = (tf.TensorSpec([None], tf.float32),) + tuple(extra_specs)

      def one(i):
        xc, dc = x4[i * mc:(i + 1) * mc], dz4[i * mc:(i + 1) * mc]
        rows = mc - tf.shape(xc)[0]
        xc, dc = pad(xc, rows), pad(dc, rows)
        xc.set_shape([None] + x4.shape[1:].as_list())
        dc.set_shape([None] + dz4.shape[1:].as_list())
        return tuple(body(xc, dc))

      return_rows = tf.map_fn(one, tf.range(n), parallel_iterations=1,
                              fn_output_signature=specs)
    return (tf.reshape(return_rows[0], [-1])[:b // k],) + tuple(return_rows[1:])

  whole = m if whole is None else max(whole, m)
  at_once = whole if fast is None else max(min(whole, fast), m)
  if static_b is not None:
    return one_shot() if static_b <= at_once else chunked()
  if budget.settled_one_call(whole, None if at_once == whole else at_once):   # public bounds
    return one_shot()
  return tf.cond(b <= at_once, one_shot, chunked)


def _patch_norms(x4, ksize, stride, dilation, padding, out_hw):
  """[B, T] float32 norms ||p_t|| of the input patches (T = ho wo output positions, in
  algebra.to_btk order): the square root of the convolution of x^2 with a kernel of ones
  (one output channel; padded entries add 0), B T K multiply-adds, no unfolded patches.

  Args:
    x4: [B, H, W, cin] float32 inputs.
    ksize: (kh, kw).
    stride: (sh, sw).
    dilation: (dh, dw).
    padding: "same" or "valid".
    out_hw: (ho, wo), static.

  Returns:
    [B, T] float32.
  """
  ones = tf.ones([ksize[0], ksize[1], int(x4.shape[-1]), 1], tf.float32)
  sq = tf.nn.conv2d(tf.square(x4), ones, [1, stride[0], stride[1], 1], padding.upper(),
                    dilations=[1, dilation[0], dilation[1], 1])
  return tf.sqrt(tf.reshape(sq, [-1, out_hw[0] * out_hw[1]]))


def _per_example_pass(form, x4, dz4, k, with_grads, bound=None):
  """The per-record squared kernel-gradient norms [B / k], and with_grads the per-record
  gradients [n, A, m / k, P] (n chunks of m examples, the last padded with zero examples), formed
  one chunk at a time (budget.chunk_size) unless the batch fits one chunk (or k is a tensor).
  Kept gradients of one example per record are formed in one call on the batch while its
  temporaries other than the gradients themselves (budget.KEEP_BYTES' part) fit
  budget.CHUNK_BYTES (at most form.whole examples): the form's temporaries less the gradient,
  and less its squares where `_fuses_squares`. Over chunks, each chunk's gradients are temporaries too, and stacking
  them copies the kept ones (the tutorial CNN's second convolution at B = 256: 4.96 ms CPU
  in one call against 6.13 in 4 chunks, no XLA, oneDNN on, load 12).

  bound: (ksize, stride, dilation, padding, R) where the clipped sum is not formed from these
  gradients but by book-keeping over R rows: each norm is raised to cover the rounding of the
  record's terms in its float32 gradient (T' = k T positions) and in that product
  (algebra.with_sum_rounding, L = T' + R + 1, ||a_t|| the patch norms): where the positions'
  gradients nearly cancel the two float32 computations differ by more than the norm (one
  record moved the clipped sum by 1.6 C); the bound's temporaries (x^2, the patch norms and
  the output gradients' norms, H W cin + 3 T floats per example) join the chunk's."""
  x4 = tf.cast(x4, tf.float32)
  dz4 = tf.cast(dz4, tf.float32)
  temp = form.temp_bytes
  if bound is not None:
    known = lambda dims: int(np.prod([d for d in dims if d is not None]))
    temp += 4 * (known(x4.shape[1:]) + 3 * known(dz4.shape[1:3]))
  m = budget.chunk_size(temp, k, form.cap) if _chunkable(x4, k) else None

  def raised(sq, x, d):
    ksize, stride, dilation, padding, rows = bound
    out_hw = tuple(d.shape[1:3])
    t = out_hw[0] * out_hw[1]
    na = _patch_norms(x, ksize, stride, dilation, padding, out_hw)[..., None]
    na = algebra.regroup_btk(na)   # a record's positions, [m / k, k T, 1]
    nb = algebra.position_norms(algebra.regroup_btk(algebra.to_btk(d)))
    positions = k * t if isinstance(k, int) else tf.cast(k * t, tf.float32)
    return algebra.with_sum_rounding(sq, na[..., 0], nb, positions + rows + 1,
                                     ksize[0] * ksize[1] * int(x.shape[-1]) + int(d.shape[-1]))

  def body(x, d):
    g = tf.reshape(form.chunk_fn(x, d), [form.rows, -1, form.cols])
    if not with_grads:
      sq = _record_sqr_norms(g, k)
      return (sq if bound is None else raised(sq, x, d),)
    g = _record_grads(g, k)   # kept per record, the terms of the clipped sum
    return _record_sqr_norms(g, 1), g

  specs = (tf.TensorSpec([form.rows, None, form.cols], tf.float32),) if with_grads else ()
  whole = None
  if with_grads and m is not None and k == 1:   # one call: the kept gradients are the
    # examples' own (records of several examples keep their sums: the examples' are temporaries)
    per_example = form.temp_bytes - 4 * form.rows * form.cols * (
        2 if _fuses_squares(form.rows, form.cols) else 1)
    whole = budget.CHUNK_BYTES // max(per_example, 1)
  out = _over_chunks(body, x4, dz4, m, k, specs, whole,
                     None if whole is None else form.whole)
  return out if with_grads else out[0]


def _factor_rows(factors, g):
  """sum_i c_i g_i of per-record gradients g [n, A, m, P] (factors [B / k], padded with
  zeros to n m), a row with c_i = 0 adding exactly nothing even where it is not finite:
  [A, P] float32."""
  n, m = tf.shape(g)[0], tf.shape(g)[2]
  c = tf.reshape(tf.pad(factors, [[0, n * m - tf.shape(factors)[0]]]), [n, 1, 1, m])
  g = tf.math.multiply_no_nan(g, tf.cast(c > 0, tf.float32)[:, :, 0, :, None])
  return tf.reduce_sum(tf.linalg.matmul(tf.broadcast_to(c, [n, tf.shape(g)[1], 1, m]), g),
                       axis=0)[:, 0, :]


# The convolutions' clipped sums pinned (`_pinned_applies`): the tutorial CNN's step then gets
# the clip shrink (its sum moves by at most C when a record is added or removed). Its cost, fit
# on the tutorial CNN at B = 256 with oneDNN, no XLA (benchmarks/compare_revisions.py, 2 rounds,
# load 11-14): 37.5 -> 49.1 ms CPU per DP step (DP / non-private 2.06x -> 2.70x). False: the
# book-keeping and kept sums of before, in an order no one pins (no shrink: docs/design.md,
# "Floating point").
PINNED_SUMS = True

# A pinned sum keeps its per-example gradients while the batch's take at most this many times
# budget.KEEP_BYTES (16 MiB): formed again, they cost a second per-example pass and the norm's
# rounding bound (the tutorial CNN's second convolution, 32 KiB per example, straddled 8 MiB at
# its B = 256: about half of its Poisson batches formed them twice). The layer's extra memory
# stays bounded (at most 16 MiB kept, beyond: formed again in chunks of budget.CHUNK_BYTES).
_PINNED_KEEP_FACTOR = 2


def _pinned_applies(layer):
  """The clipped sums of this convolution are formed in a pinned order (`_pinned_kept_sum`,
  `_pinned_recomputed_sum`): one example per record (a Python int k = 1: each record's term is
  one per-example gradient whose norm clipping takes) and a per-example kernel gradient small
  enough to keep (registry.keep_per_example: forming one per example costs at most what the
  kept forms cost; a larger kernel keeps the book-keeping sum, unpinned and charged no margin:
  docs/design.md, "Floating point")."""
  k = algebra.current_examples_per_record()
  return (PINNED_SUMS and isinstance(k, int) and k == 1 and
          registry.keep_per_example(int(np.prod(layer.kernel.shape))))


def _pinned_block(form, rc):
  """Rows per block of a convolution's pinned sums (algebra.pinned_block of the records and
  the kernel's entries): the same for the kept and the recomputed per-example gradients, so
  that either branch of a run-time choice (budget.by_keep) runs the plan reported; chosen for
  the public plan's rows (algebra.plan_rows), so neighbouring batches get the same block."""
  return algebra.pinned_block(algebra.plan_rows(rc.shape[0]), 4 * form.rows * form.cols,
                              budget.CHUNK_BYTES)


def _pinned_kept_sum(form, g, rc, block, sq):
  """sum_i c_i g_i of the kept per-record gradients g [n, A, m, cols] (`_per_example_pass`;
  rows past the records are padding) in a pinned order: the records' rows [B, A cols] by
  algebra.pinned_rows_product (blocks of `block` rows summed in any order, the blocks by
  summation.pairwise_sum), declared through algebra.report_pinned (`_pinned_sums`;
  Casacuberta et al., "Widespread underestimation of sensitivity in differentially private
  libraries and how to fix it", CCS 2022). Each record's term is the very vector whose norm
  was taken.

  No pass over the kept gradients beyond the product: the records' B rows are taken (a view:
  the padded chunks' rows past B are left out) and summed in the plan of
  algebra.pinned_rows_product, which outside XLA does not pad them; under
  XLA (which fuses the pad into the product, and sums a block of other rows in another
  order) the rows up to the records' blocks, ceil(B / block) block rows, by
  algebra.pinned_rows_product, the factors padded with zeros to them (the padded chunks'
  rows past B are zero examples, exactly 0, with factor 0); and where every record's squared norm `sq` is finite, every entry of g is, so a row with c_i =
  0 adds exactly 0 as it is (0 * finite); only otherwise are the rows with c_i = 0 set to 0
  first (algebra.drop_rows: 0 * inf is NaN). The kept sum of the tutorial CNN's second
  convolution (B = 256, 8 MiB of gradients) read and wrote them three times more (a multiply,
  a pad, the product).

  Args:
    form: the layer's _Form.
    g: [n, A, m, cols] float32 kept per-record gradients.
    rc: [B] float32 record factors.
    block: `_pinned_block`.
    sq: [B] float32 squared norms of the records' g (their kernel part).

  Returns:
    [A, cols] float32.
  """
  if (form.rows > 1 and g.shape[0] == 1 and not routing.in_xla_context() and
      algebra.factor_sum_applies(g.shape[2], block)):
    # one call on the batch (its rows the records'): the depthwise form's [A, B, cols] as it
    # is, by algebra.pinned_factor_sum (the same blocks and tree; no record-major copy)
    g3 = tf.squeeze(g, axis=[0])
    g3 = tf.cond(tf.reduce_all(tf.math.is_finite(sq)), lambda: g3,
                 lambda: tf.math.multiply_no_nan(
                     g3, tf.reshape(tf.sign(rc), algebra.const([1, -1, 1]))))
    return algebra.pinned_factor_sum(rc, g3, block)
  if form.rows > 1:   # the depthwise form's kh kw rows: record-major [n, m, A, cols]
    g = tf.transpose(g, [0, 2, 1, 3])
  rows = tf.reshape(g, [-1, form.rows * form.cols])
  n_rows, records = rows.shape[0], rc.shape[0]
  if not routing.in_xla_context():   # the records' rows, their last block not padded
    if n_rows is not None and records is not None:   # sizes the trace knows: Python ints
      rows = rows if int(n_rows) == int(records) else rows[:int(records)]
    elif g.shape[0] != 1:   # chunks (one call on the batch: its records' rows alone)
      rows = rows[:tf.shape(rc)[0]]   # a view: the records' rows, no copy
    rows = tf.cond(tf.reduce_all(tf.math.is_finite(sq)), lambda: rows,
                   lambda: algebra.drop_rows(rows, rc))
    s = algebra.pinned_rows_product(tf.reshape(rc, [-1, 1]), rows, block)   # unpadded here
    return tf.reshape(s, [form.rows, form.cols])
  c = rc
  if n_rows is not None and records is not None:   # sizes the trace knows: Python ints
    take = min(-(-int(records) // block) * block, int(n_rows))
    rows = rows if take == int(n_rows) else rows[:take]
    c = rc if take == int(records) else tf.pad(rc, [[0, take - int(records)]])
  else:
    r = tf.shape(rc)[0]
    take = tf.minimum((r + block - 1) // block * block, tf.shape(rows)[0])
    rows = rows[:take]   # a view: the records' blocks, no copy
    c = tf.pad(rc, [[0, take - r]])
  rows = tf.cond(tf.reduce_all(tf.math.is_finite(sq)), lambda: rows,
                 lambda: algebra.drop_rows(rows, c))
  s = algebra.pinned_rows_product(tf.reshape(c, [-1, 1]), rows, block)
  return tf.reshape(s, [form.rows, form.cols])


def _pinned_recomputed_sum(form, x4, dz4, rc, block, sq=None):
  """sum_i c_i g_i with the per-example gradients g_i formed again by `form` (the clipped sum
  of a convolution whose norms were taken without keeping them: the folded Gram, or a batch
  over budget.KEEP_BYTES), in the plan of `_pinned_kept_sum`: blocks of `block` rows in any
  order, the blocks by a pairwise tree of depth ceil(log2 ceil(B / block))
  (summation.rounding_margin), a block without the removed record computed bit-identically
  on both datasets. Formed in chunks of m = 2^j examples (budget.chunk_size: the chunk's
  temporaries within budget.CHUNK_BYTES; m = block for a block not a power of two), each
  chunk's rows by algebra.pinned_rows_product in blocks of min(block, m) rows, the chunks'
  sums by summation.pairwise_sum: m and the block are powers of two, one a multiple of the
  other, so the tree's first log2(block / m) levels sum each block's chunks (a fixed set of
  `block` rows, in some order) and the rest is the pinned tree over the blocks, of that
  depth. The summed g_i is formed in float32 over the record's T positions (any order),
  within gamma_T S of the exact gradient (Higham, "Accuracy and Stability of Numerical
  Algorithms", Sec. 3.1; S = sum_t ||p_t|| ||dz_t||), which the norm's raise covers
  (algebra.with_sum_rounding, L >= T + 1). Under XLA with a batch the trace does not know,
  the batch is one call (`_chunkable`).

  Args:
    form: the per-example _Form.
    x4: [B, H, W, cin] inputs.
    dz4: [B, ho, wo, cout] output gradients.
    rc: [B] float32 record factors (one example per record).
    block: `_pinned_block`.
    sq: [B] float32 squared norms of the records whose norms include this kernel's (each at
      least its kernel part), or None. Where an example's inputs take at most as many floats
      as its gradient, the rows of c = 0 are zeroed in the output gradients (and in the
      inputs too unless every sq is finite) instead of in the gradients (`rows_sum`).

  Returns:
    [A, cols] float32.
  """
  x4, dz4 = tf.cast(x4, tf.float32), tf.cast(dz4, tf.float32)
  width = form.rows * form.cols
  # a chunk's temporaries: the form's (its gradients' two [P] rows per example are here g and
  # the copy algebra.drop_rows makes, or the inputs' copies, at most as many floats; no
  # squares), and the record-major copy of a form of several rows (the depthwise form's kh
  # kw). The tutorial CNN's second convolution at B = 1,024 (not kept): chunks of 64
  # examples, 32 before (its estimate counted four rows).
  m = (budget.chunk_size(form.temp_bytes + (4 * width if form.rows > 1 else 0), 1, form.cap)
       if _chunkable(x4, 1) else None)
  if m is not None and block & (block - 1):
    m = block
  size = lambda t: int(np.prod([d for d in t.shape[1:] if d is not None]))
  finite = (tf.reduce_all(tf.math.is_finite(sq))
            if sq is not None and size(x4) + size(dz4) <= width else None)

  def rows_sum(x, d, c, rows_block):   # [width]
    if finite is not None:
      # The rows of c = 0 add exactly 0 with no pass over the gradients: their output
      # gradients zeroed (algebra.drop_rows: exactly 0 even where not finite), their inputs
      # too unless every record's squared norm is finite. A record's norm is finite only if
      # its patches p_t are (a non-finite patch entry makes inf or NaN of every gradient or
      # Gram entry it enters, and so of the norm or its bound), so then sum_t p_t 0 = 0
      # exactly; every form is bilinear in x_i and dz_i and forms each example's gradient
      # apart from the others', so the rows of c > 0 are bit for bit as before. The tutorial
      # CNN's second convolution at B ~ 1,024: 17.5 -> 14.7 CPU ms per sum (its output gradients
      # 800 floats per example against its gradient's 8,192; oneDNN on, load 12-13).
      d = algebra.drop_rows(d, c)
      x = tf.cond(finite, lambda: x, lambda: algebra.drop_rows(x, c))
    g = tf.reshape(form.chunk_fn(x, d), [form.rows, -1, form.cols])
    if form.rows > 1:
      g = tf.reshape(tf.transpose(g, [1, 0, 2]), [-1, width])
    else:
      g = g[0]
    if finite is None:
      g = algebra.drop_rows(g, c)
    return algebra.pinned_rows_product(tf.reshape(c, [-1, 1]), g, rows_block)[0]

  shaped = lambda s: tf.reshape(s, [form.rows, form.cols])
  one_shot = lambda: rows_sum(x4, dz4, rc, block)
  static_b, b = x4.shape[0], tf.shape(x4)[0]
  if m is None or (static_b is not None and static_b <= m):
    return shaped(one_shot())
  pad = lambda t, rows: tf.pad(t, [[0, rows]] + [[0, 0]] * (t.shape.rank - 1))
  spec = tf.TensorSpec([width], tf.float32)
  chunk_sum = lambda x, d, c: rows_sum(x, d, c, min(block, m))

  def chunked():
    if static_b is not None:   # XLA: static slices of the padded batch
      n = -(-static_b // m)
      split = lambda t: tf.reshape(pad(t, n * m - static_b), [n, m] + t.shape[1:].as_list())
      sums = tf.map_fn(lambda e: chunk_sum(*e), (split(x4), split(dz4), split(rc)),
                       parallel_iterations=1, fn_output_signature=spec)
    else:   # each chunk sliced from the batch and padded alone: no copy of the batch
      def one(i):
        parts = [t[i * m:(i + 1) * m] for t in (x4, dz4, rc)]
        parts = [pad(t, m - tf.shape(t)[0]) for t in parts]
        for t, like in zip(parts, (x4, dz4, rc)):
          t.set_shape([m] + like.shape[1:].as_list())
        return chunk_sum(*parts)

      sums = tf.map_fn(one, tf.range((b + m - 1) // m), parallel_iterations=1,
                       fn_output_signature=spec)
    return summation.pairwise_sum(sums)

  if static_b is not None:
    return shaped(chunked())
  if budget.settled_one_call(m):   # bounds that settle the choice at trace time
    return shaped(one_shot())
  return shaped(tf.cond(b <= m, one_shot, chunked))


def _pinned_bias_sum(db, rc, block):
  """`_bias_sum` of one example per record in the pinned order of the kernel's sum
  (algebra.pinned_rows_product, blocks of `block` rows): [cout] float32."""
  return algebra.pinned_rows_product(tf.reshape(rc, [-1, 1]), algebra.drop_rows(db, rc),
                                     block)[0]


def _pinned_sums(layer, kernel, db, rc, block):
  """[the kernel's pinned sum, reshaped, and the bias's from its per-record gradients db
  [B, cout] (no bias sum for db None)], both declared by algebra.report_pinned with `block`
  so that the step charges their plan's rounding margin (clipping._with_rounding_margin)."""
  algebra.report_pinned(layer.kernel, block)
  sums = [tf.reshape(kernel, layer.kernel.shape)]
  if db is not None:
    algebra.report_pinned(layer.bias, block)
    sums.append(_pinned_bias_sum(db, rc, block))
  return sums


def _bookkeeping_kernel_sum(layer, x4, dz4, factors, ksize, stride, dilation, padding):
  """sum_i c_i g_i of the kernel as one whole-batch filter gradient of the clip-weighted
  output gradients (the gradient TensorFlow takes of the convolution itself): rows with c_i = 0
  of the input and the output gradient set to exactly 0 first. [kh, kw, cin, cout] float32."""
  kh, kw = ksize
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  rows = lambda f, t: tf.reshape(f, [-1, 1, 1, 1])
  x4 = tf.cast(x4, tf.float32)
  dz4 = tf.cast(dz4, tf.float32)
  x4 = tf.math.multiply_no_nan(x4, rows(tf.cast(factors > 0, tf.float32), x4))
  dz4 = tf.math.multiply_no_nan(dz4, rows(factors, dz4))
  kernel = tf.zeros([kh, kw, cin, cout], tf.float32)
  with tf.GradientTape() as tape:
    tape.watch(kernel)
    if (tuple(dilation) == (1, 1) and padding in ("same", "valid") and
        None not in x4.shape[1:] and _in_xla_control_flow()):   # as the forward (module doc)
      z = _conv2d_canonical_grads(x4, kernel, tuple(stride), padding)
    else:
      z = tf.nn.conv2d(x4, kernel, [1, stride[0], stride[1], 1], padding.upper(),
                       dilations=[1, dilation[0], dilation[1], 1])
  return tape.gradient(z, kernel, output_gradients=dz4)


def _bias_sum(db, factors, k):
  """sum_j c_j db_j over the records j, db the very float32 per-record bias gradients whose
  norms were taken (algebra.bias_sqr_norm with sum_from_db: a record's term in the sum is the
  vector its factor was computed from, so the norm needs no rounding bound; a second float32
  reduction of dz, in another order, could differ from it by more than the norm where the
  positions' dz nearly cancel), rows with c_j = 0 adding exactly 0: [cout] float32.

  Args:
    db: [B / k, cout] float32 per-record bias gradients.
    factors: [B] float32 clip factors of the examples' records.
    k: examples per record (the norms'; the sum runs outside their context).

  Returns:
    [cout] float32.
  """
  with algebra.examples_per_record(k):
    rc = budget.record_factors(factors)
  return tf.linalg.matvec(algebra.drop_rows(db, rc), rc, transpose_a=True)


def _bookkeeping_result(layer, form_name, sq, x4, dz4, ksize, stride, dilation, padding, db):
  """registry.FactorSums of a convolution whose norms `sq` [B / k] are formed without
  per-example gradients (the folded patch Gram, the unfolded patches): the clipped sum by
  book-keeping (`_bookkeeping_kernel_sum`, Bu et al., "Differentially private optimization on
  large model at small cost", Sec. 3), its input and output-gradient rows with c_i = 0 set
  to exactly 0 first. Left to the tape's vector-Jacobian product of the layer's own
  convolution, a record whose input is not finite (c_i = 0) would add inf * 0 = NaN to every
  entry of the released sum. db: the per-record bias gradients [B / k, cout] whose norms are
  in sq (None: no trainable bias), the bias sum's terms (`_bias_sum`)."""

  k = algebra.current_examples_per_record()
  # one example per record: the per-example gradients formed again, summed in a pinned order
  form = (_per_example_form(form_name, x4, dz4, ksize, stride, dilation, padding)
          if _pinned_applies(layer) else None)

  def sum_fn(example_factors):   # rows with c = 0 add exactly 0 (multiply_no_nan), no branch
    with tf.name_scope(_scope_name(layer, form_name, "sum")):
      factors = tf.cast(example_factors, tf.float32)
      if form is not None:
        block = _pinned_block(form, factors)
        return _pinned_sums(layer, form.to_kernel(_pinned_recomputed_sum(
            form, x4, dz4, factors, block, sq)), db, factors, block)
      kernel = _bookkeeping_kernel_sum(layer, x4, dz4, factors, ksize, stride, dilation,
                                       padding)
      sums = [tf.reshape(kernel, layer.kernel.shape)]
      if db is not None:
        sums.append(_bias_sum(db, factors, k))
      return sums

  sum_fn.keeps_per_example = False
  return registry.FactorSums(sq, sum_fn)


def _per_example_result(layer, form_name, x4, dz4, ksize, stride, dilation, padding, bias):
  """registry.FactorSums of a convolution whose per-example kernel gradients are formed
  (forms "depthwise", "filter" or the unfolded patches), within the memory budget
  (budget.CHUNK_BYTES, budget.KEEP_BYTES): the norms of the records, and the clipped sum from
  the kept gradients or by book-keeping. bias: (squared norms [B / k], per-record gradients
  [B / k, cout]) of the bias (algebra.bias_sqr_norm, the sum formed from those gradients), or
  None."""
  k = algebra.current_examples_per_record()
  form = _per_example_form(form_name, x4, dz4, ksize, stride, dilation, padding)
  p = int(np.prod(layer.kernel.shape))
  b = tf.shape(dz4)[0]
  static_b = dz4.shape[0]
  pinned = _pinned_applies(layer)
  kept_bytes = budget.KEEP_BYTES * (_PINNED_KEEP_FACTOR if pinned else 1)
  planned = budget.planned_keep(p * 4, kept_bytes)   # add/remove: the public plan's choice
  if not registry.keep_per_example(p):
    keep = False
  elif static_b is None and routing.in_xla_context():   # no run-time choice under XLA
    keep = True
  elif planned is not None:
    keep = planned
  elif static_b is not None:
    keep = static_b * p * 4 <= kept_bytes
  elif budget.settled_one_call(kept_bytes // (p * 4)):
    keep = True   # every batch within the bounds keeps: settled at trace time
  else:
    keep = b * p * 4 <= kept_bytes
  rows = algebra.batch_rows(algebra.to_btk(dz4))
  if registry.form_override() is None and _fold_gram_cheaper(x4, dz4, ksize, stride, dilation):
    # gradients not kept: the clipped sum forms them again (or is by book-keeping), so the
    # norms alone come from the folded Gram where it costs less, in chunks no larger than the
    # per-example pass's it replaces (its memory no more than that pass's). The tutorial
    # CNN's second convolution at B = 1,024, CPU ms of the norms (no XLA, oneDNN on, load 6):
    # 16.1 -> 12.4, the pass's allocator peak 4.2 -> 1.1 MiB; under XLA at 1,280 rows 23.4 -> 13.3
    most = budget.chunk_size(form.temp_bytes, k, form.cap)   # k: a Python int here
    norms_alone = lambda: _fold_gram_norms(x4, dz4, ksize, stride, padding, rows, most)
  else:
    norms_alone = lambda: _per_example_pass(form, x4, dz4, k, False,
                                            (ksize, stride, dilation, padding, rows))
  sq, g = budget.by_keep(keep, lambda: _per_example_pass(form, x4, dz4, k, True),
                         lambda: (norms_alone(),
                                  tf.zeros([1, form.rows, 0, form.cols], tf.float32)))
  kernel_sq = sq
  if bias is not None:
    sq = sq + bias[0]

  def sum_fn(example_factors):   # rows with c = 0 add exactly 0 (multiply_no_nan), no branch
    with tf.name_scope(_scope_name(layer, form_name, "sum")):
      factors = tf.cast(example_factors, tf.float32)
      with algebra.examples_per_record(k):   # the norms' records (the sum runs outside)
        rc = budget.record_factors(factors)
      if pinned:   # one example per record: the pinned order, kept or formed again
        block = _pinned_block(form, rc)
        kernel = budget.by_keep(keep, lambda: _pinned_kept_sum(form, g, rc, block, kernel_sq),
                                lambda: _pinned_recomputed_sum(form, x4, dz4, rc, block,
                                                               kernel_sq))
        return _pinned_sums(layer, form.to_kernel(kernel), None if bias is None else bias[1],
                            rc, block)
      from_g = lambda: form.to_kernel(_factor_rows(rc, g))
      by_bookkeeping = lambda: _bookkeeping_kernel_sum(layer, x4, dz4, factors, ksize, stride,
                                                       dilation, padding)
      kernel = budget.by_keep(keep, from_g, by_bookkeeping)
      sums = [tf.reshape(kernel, layer.kernel.shape)]
      if bias is not None:
        sums.append(_bias_sum(bias[1], factors, k))
      return sums

  sum_fn.keeps_per_example = keep   # a bool, or a scalar bool tensor for an unknown batch
  return registry.FactorSums(sq, sum_fn)


def _fold_gram_applies(x4, dz4, ksize, stride, dilation):
  """The folded patch Gram applies: stride blocks fold (conv_unfold.foldable) and the
  record size is a Python int."""
  k = algebra.current_examples_per_record()
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


def _choose_form(dz4, x4, ksize, stride, dilation, keep, pinned=False):
  """The form of a convolution's norm (module docstring), by the cost model.

  The override (registry.form_override) if set; else "foldgram" where _fold_gram_cheaper and
  the clipped sum is not pinned (`pinned`: its per-example gradients are formed anyway, so the
  norms are taken from them: the tutorial CNN's second convolution at B = 256, 36.8 against
  41.5 ms CPU per clipped sum with the folded Gram's norms and the gradients formed again,
  load 10);
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
    pinned: the clipped sum is formed from per-example gradients (`_pinned_applies`).

  Returns:
    "foldgram", "depthwise", "filter", an override, or None.
  """
  form = registry.form_override()
  dilated = any(d != 1 for d in dilation)
  if form is not None or dilated:
    return form
  if not pinned and _fold_gram_cheaper(x4, dz4, ksize, stride, dilation):
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


def _fold_gram_temp_bytes(x4, dz4, ksize, stride, k=1):
  """Bytes of the folded patch Gram's temporaries per example (float32), the larger of its two
  stages' live tensors:
    folding: the input cast and padded (at most max(H, hh) max(W, ww) cin each, hh = (ho + qh
      - 1) sh the rows the fold reads) and the folded copy, u sh sw cin (u = (ho + qh - 1)
      (wo + qw - 1) folded pixels);
    Grams: the folded pixels, the Gram of a record's k u pixels (k u^2 per example), the qh qw
      windows of a record's [k T, k T] patch Gram and their sum, the output gradients' Gram,
      and one [k T, k T] temporary of the contraction's bound (`_fold_gram_contraction`: the
      squares of either Gram), counted as alive together ((qh qw + 3) k T^2 per example).
  Reshapes (the Gram's windows view, the output gradients' regrouping) are views, and float32
  output gradients are not copied (others are cast: T cout more). The allocator peaks this
  bounds (B = 256, 8 runs each; tests/fast_clipping/test_conv_forms.py checks the bound):
  tutorial CNN's second convolution 31,900 bytes per example against 22,400..24,900 measured
  (one call of 256 examples at the default budget), records of 2: 54,584 against 37,768,
  of 3: 77,268 against 61,145..68,645; a 14x14x8 input to 7x7 outputs: 91,804 against 84,744
  (the float64 contraction this replaced: 29,900 measured at the tutorial CNN).

  Args:
    x4: [B, H, W, cin] the convolution's input (static spatial sizes).
    dz4: [B, ho, wo, cout] output gradients (static spatial sizes).
    ksize: (kh, kw).
    stride: (sh, sw).
    k: examples per record (a Python int).

  Returns:
    int, bytes per example.
  """
  (kh, kw), (sh, sw), (ho, wo) = ksize, stride, tuple(dz4.shape[1:3])
  (h, w), cin = x4.shape[1:3], int(x4.shape[-1])
  qh, qw = kh // sh, kw // sw
  u = (ho + qh - 1) * (wo + qw - 1)
  t = ho * wo
  folded = u * sh * sw * cin
  folding = 2 * max(h, (ho + qh - 1) * sh) * max(w, (wo + qw - 1) * sw) * cin + folded
  cast = 0 if dz4.dtype == tf.float32 else t * int(dz4.shape[-1])
  grams = folded + k * u * u + (qh * qw + 3) * k * t * t + cast
  return 4 * max(folding, grams)


def _fold_gram_contraction(ga, gb, na, nb, n_a, n_b):
  """An upper bound, in float32 alone, of the exact sum_{t,s} A_ts B_ts from float32 Gram
  matrices ga ~ A [R, T', T'] and gb ~ B: per record the float32 contraction plus a bound of
  all its rounding (no float64: the same ops on every device).

  Derivation (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 3.1: a
  float32 dot product of n terms, in any order, errs by at most gamma_n = n u / (1 - n u) times
  the sum of the terms' absolute values, u = 2^-24; Sec. 4.2: so does any float32 sum of n
  terms). With a_t, b_t the vectors (exact norms alpha_t, beta_t):
    |ga_ts - A_ts| <= gamma_na alpha_t alpha_s, |gb_ts - B_ts| <= gamma_nb beta_t beta_s
  (na: the terms and additions one entry of ga passes through, conv_unfold.patch_gram: a dot
  of sh sw cin folded-pixel products plus qh qw windows; nb: cout), so
    |sum ga gb - sum A B| <= gamma_na sum alpha_t alpha_s |gb_ts| + gamma_nb sum |ga_ts|
        beta_t beta_s + gamma_na gamma_nb (sum_t alpha_t beta_t)^2.
  The contraction is formed as T' row sums of T' products (a dot, or a product and one
  reduction: any order) and the T' rows' sums by `summation.pairwise_sum`'s pinned tree
  (elementwise adds, which neither XLA nor Grappler merge with the row reduction): each
  product passes through at most H = T' + ceil(log2 T') roundings (its own, T' - 1
  additions in its row, the tree's levels), so the contraction errs by at most
  gamma_H sum |ga_ts gb_ts| (Higham, Sec. 3.1, Lemma 3.1); that sum of absolute values is
  formed itself (one reduction of the T'^2 |products| the contraction reads, any order: its
  nonnegative terms' rounding is covered by the margin below). A single float32 reduction of
  the T'^2 products would give gamma_{T'^2} (1e-3 relative at records of 2 of the tutorial
  CNN's second convolution); two sequential ones gamma_{2T'}, with the sum of absolute
  values bounded by ||ga||_F ||gb||_F (Cauchy-Schwarz), 1.87e-3 above the exact norm on
  ordinary records of 3 examples at T' = 243 (tests/fast_clipping/
  test_fold_gram_bound_review.py; 5.8e-4 in this form). TensorFlow runs the row reduction
  as one kernel; under XLA the rows are an einsum it keeps as a dot (TF 2.21's optimized
  HLO); without XLA the einsum took 1.6 ms CPU against 0.9 for the product and row sums at
  B = 256 (oneDNN runs it as B T' one-row products; load 12).
  The other two sums of absolute values are bounded twice, and the smaller taken: by
  Cauchy-Schwarz, sum alpha_t alpha_s |gb_ts| <= (sum_t alpha_t^2) ||gb||_F, and entrywise,
  |gb_ts| <= (1 + gamma_nb) beta_t beta_s (likewise ga), by S1^2,
  S1 = sum_t alpha_t beta_t. alpha, beta are taken from the Grams' diagonals (na, nb: their
  relative rounding, and that of the bound's own float32 sums of at most T'^2 nonnegative
  terms, are covered by taking each gamma_n as (1.5 + 2 T'^2 u) (n + 1) u). Measured on the
  tutorial CNN's second convolution (64 MNIST examples, records of 1 / 2 / 3 / 4 examples),
  with the rows summed one after the other and ||ga||_F ||gb||_F: at
  most 1.4e-4 / 2.8e-4 / 5.7e-4 / 7.3e-4 above the exact norm, never below it (the float64
  contraction it replaces, algebra.bounded_gram_contraction: 1.2e-4 / 2.2e-4 / 4.1e-4 /
  4.6e-4).

  Args:
    ga, gb: [R, T', T'] float32 Gram matrices (T' static).
    na, nb: [R, T'] float32 norms of their vectors (the square roots of their diagonals).
    n_a, n_b: the roundings one entry of ga / gb passes through (Python ints).

  Returns:
    [R] float32.
  """
  t = int(ga.shape[1])
  u = 2.0 ** -24
  margin = 1.5 + 2.0 * t * t * u
  gamma = lambda n: algebra.scalar(margin * (n + 1) * u)
  gamma_ab = algebra.scalar(margin * (n_a + 1) * u * margin * (n_b + 1) * u)
  if routing.in_xla_context():
    rows = tf.einsum("bts,bts->bt", ga, gb)
    absolute = algebra.reduce_sum(tf.abs(ga * gb), [1, 2])   # fused with the products
  else:
    products = ga * gb
    rows = algebra.reduce_sum(products, 2)
    absolute = algebra.reduce_sum(tf.abs(products), [1, 2])
  # the rows' sums by the pinned tree: at most T' + ceil(log2 T') roundings per product
  c = summation.pairwise_sum(tf.transpose(rows, algebra.const([1, 0])), algebra.const)
  depth = t + summation.tree_depth(t)
  s1 = tf.square(algebra.reduce_sum(na * nb, 1))
  fa = tf.sqrt(algebra.reduce_sum(tf.square(ga), [1, 2]))
  fb = tf.sqrt(algebra.reduce_sum(tf.square(gb), [1, 2]))
  sa = algebra.reduce_sum(tf.square(na), 1)
  sb = algebra.reduce_sum(tf.square(nb), 1)
  return (c + gamma(depth) * absolute + gamma(n_a) * tf.minimum(s1, sa * fb)
          + gamma(n_b) * tf.minimum(s1, fa * sb) + gamma_ab * s1)


def _fold_gram_sqr_norm(x4, dz4, ksize, stride, padding, sum_rows=None):
  """Upper bounds of the per-record squared kernel-gradient norms sum_{t,s} <p_t, p_s>
  <dz_t, dz_s> (Li et al. 2021, Sec. 4) with the patch Gram from conv_unfold.patch_gram.

  Where the positions' gradients p_t dz_t^T nearly cancel (equal patches, opposite output
  gradients) a float32 sum of the T^2 products came out near 0 for a gradient of any norm
  (one record moved the clipped sum by 7e4 C). The products are summed by
  `_fold_gram_contraction` (the float32 contraction plus a bound of its rounding, Higham,
  "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 3.1); the norms ||p_t||,
  ||dz_t|| are the Gram matrices' diagonals. With `sum_rows` the bound is raised by the
  rounding of the record's terms in the clipped sum's product over that many rows
  (algebra.with_sum_rounding, L = R + 1).

  Args:
    x4: [B, H, W, cin] the convolution's input.
    dz4: [B, ho, wo, cout] output gradients.
    ksize: (kh, kw).
    stride: (sh, sw).
    padding: "same" or "valid".
    sum_rows: R, rows of the clipped sum's book-keeping product (B ho wo: a Python int or a
      float32 scalar tensor), or None for the bound of the exact norm alone.

  Returns:
    [B/k] float32 (k = algebra.current_examples_per_record(), a Python int).
  """
  k = algebra.current_examples_per_record()
  ga = conv_unfold.patch_gram(x4, ksize, stride, padding, tuple(dz4.shape[1:3]), k)
  b = algebra.regroup_btk(tf.cast(algebra.to_btk(dz4), tf.float32))
  gb = tf.linalg.matmul(b, b, transpose_b=True)
  na, nb = algebra.gram_diagonal_norms(ga), algebra.gram_diagonal_norms(gb)
  (sh, sw), cin, cout = stride, int(x4.shape[-1]), int(dz4.shape[-1])
  windows = (ksize[0] // sh) * (ksize[1] // sw)
  sq = _fold_gram_contraction(ga, gb, na, nb, sh * sw * cin + windows, cout)
  if sum_rows is None:
    return sq
  patch = ksize[0] * ksize[1] * cin
  return algebra.with_sum_rounding(sq, na, nb, sum_rows + 1, patch + cout)


def _fold_gram_norms(x4, dz4, ksize, stride, padding, rows, most=None):
  """`_fold_gram_sqr_norm`'s upper bounds [B / k], raised for a clipped sum over `rows` rows
  (the book-keeping product's B ho wo, which covers a sum of the per-example gradients formed
  again too: L = rows + 1 >= T + 1, `_pinned_recomputed_sum`), over chunks of the batch
  within budget.CHUNK_BYTES (`_fold_gram_temp_bytes`, `_over_chunks`).

  Args:
    x4: [B, H, W, cin] the convolution's input (`_fold_gram_applies`).
    dz4: [B, ho, wo, cout] output gradients.
    ksize, stride: (h, w) pairs of ints.
    padding: "same" or "valid".
    rows: the clipped sum's rows (algebra.batch_rows of the output gradients).
    most: at most this many examples per chunk (a Python int), or None.

  Returns:
    [B / k] float32.
  """
  k = algebra.current_examples_per_record()
  m = (budget.chunk_size(_fold_gram_temp_bytes(x4, dz4, ksize, stride, k), k, most or 1 << 30)
       if _chunkable(x4, k) else None)
  return _over_chunks(lambda x, d: (_fold_gram_sqr_norm(x, d, ksize, stride, padding, rows),),
                      x4, dz4, m, k)[0]


def _scope_name(layer, form, part):
  """The name scope of a convolution's norm or sum ops: the layer's name, its form
  ("foldgram", "depthwise", "filter", "unfold" for the unfolded patches) and the part, so that
  a profile of the step (benchmarks/fit_step_split.py) attributes each op to its layer and form.

  Args:
    layer: the convolution layer.
    form: the form chosen by _choose_form (None: the unfolded patches).
    part: "norm" or "sum".

  Returns:
    str, a valid name scope ("conv2d_1_depthwise_norm").
  """
  name = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in layer.name)
  if not name[:1].isalnum():   # a scope starts with a letter or digit
    name = "conv" + name
  return f"{name}_{form or 'unfold'}_{part}"


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
    # the bias sum is formed from this db (`_bias_sum`, registry's from the kept gradients)
    bias = (algebra.bias_sqr_norm(dz, (layer.filters,), sum_from_db=True) if bias_on else
            None)
    if not kernel_on:
      return algebra.result(layer, bias[0], {id(layer.bias): bias[1]})
    form = _choose_form(dz4, x4, ksize, stride, dilation, keep, pinned=_pinned_applies(layer))
    with tf.name_scope(_scope_name(layer, form, "norm")):   # profiles name layer and form
      return _conv_norm(form, dz4, bias)

  def _conv_norm(form, dz4, bias):
    with_bias = lambda sq: sq if bias is None else sq + bias[0]
    db = None if bias is None else bias[1]
    if form == "foldgram" and _fold_gram_applies(x4, dz4, ksize, stride, dilation):
      rows = algebra.batch_rows(algebra.to_btk(dz4))   # the book-keeping product's, B ho wo
      sq = _fold_gram_norms(x4, dz4, ksize, stride, padding, rows)
      return _bookkeeping_result(layer, form, with_bias(sq), x4, dz4, ksize, stride,
                                 dilation, padding, db)
    if (form in ("filter", "depthwise") and not dilated) or (
        keep and form not in ("gram", "foldgram")):
      return _per_example_result(layer, None if dilated else form, x4, dz4, ksize, stride,
                                 dilation, padding, bias)
    p, _ = _patches(x4, ksize, stride, dilation, padding, tuple(dz4.shape[1:3]))
    sq, _ = algebra.factored_sqr_norm(p, algebra.to_btk(dz4))
    return _bookkeeping_result(layer, form, with_bias(sq), x4, dz4, ksize, stride, dilation,
                               padding, db)

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
