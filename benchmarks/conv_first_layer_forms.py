"""Per-example filter gradients of the tutorial CNN's first convolution, forms not in the conv
rule (issue 42, item 2c): each against the rule's depthwise chunk, on one chunk.

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/conv_first_layer_forms.py [--chunk 128]
      [--rounds 7] [--calls 10]

The convolution: 8x8 kernel, stride 2, "same" padding, 28x28x1 inputs, 16 filters (output
14x14x16); per example g_i[a, b, n] = sum_t xpad_i[2 t + (a, b)] dz_i[t, n] (xpad: the input
padded by 3 on each side, 34x34). Forms (each a tf.function with the chunk axis unknown, as in
`fit`; every form's result is checked against `rule_depthwise` before timing):
  rule_depthwise   rules/conv.py's _depthwise_chunk: one depthwise filter gradient with the
                   examples as channels, channel multiplier 16 (Rochette et al., "Efficient
                   per-example gradient computations in convolutional neural networks", Sec. 3)
  fwd_dilated      the same sum as a forward depthwise convolution: the examples' padded
                   inputs as channels, filtered by their own output gradients (14x14, dilation
                   2), output 8x8 per example and filter
  fwd_phases       fwd_dilated without the dilation: the padded input split into its 4 stride
                   phases (2x2), each a stride-1 depthwise convolution with a 14x14 filter
  s2d_depthwise    the input padded and moved to depth (2x2 blocks: 17x17x4), the kernel a
                   stride-1 4x4 one: the depthwise filter gradient of that (dz repeated over the
                   4 phases)
  multiplier_one   rule_depthwise with channel multiplier 1: the input repeated over the 16
                   filters, one depthwise channel per (example, filter)
  unfold_gather    the patches unfolded by the rule's one gather of pixels
                   (conv._gathered_patches, [m, 196, 64]), then g_i = P_i^T dz_i by one
                   batched matrix product (m products of 64x196 by 196x16)
  unfold_extract   the same product, the patches by ExtractImagePatches of the padded input
  grouped_filter   the rule's regrouping, the gradient by Conv2DBackpropFilter as a grouped
                   convolution (m groups of one input channel, 16 filters each: a
                   [8, 8, 1, 16 m] filter), not the depthwise kernel
  nchw_depthwise   rule_depthwise with data_format NCHW: the input needs no transpose ([1, m,
                   28, 28] is a view of it), the output gradients one per example ([m, 16, 14,
                   14])
  phases_stride1   four stride-1 depthwise filter gradients, one per stride phase of the
                   padded input ([1, 17, 17, m] each, a 4x4 kernel; the same output gradients)
  whole_batch      the convolution's whole-batch filter gradient (Conv2DBackpropFilter), the
                   non-private step's cost for the same multiply-adds
Figure: median over --rounds rounds of the process CPU and wall time of --calls calls. Prints
one JSON line.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tf_dpiter.keras.fast_clipping.rules import conv

_SPEC = [tf.TensorSpec([None, 28, 28, 1]), tf.TensorSpec([None, 14, 14, 16])]


def _padded(x):
  return tf.pad(x, [[0, 0], [3, 3], [3, 3], [0, 0]])


@tf.function(input_signature=_SPEC)
def rule_depthwise(x, dz):
  return conv._depthwise_chunk(x, dz, (8, 8), (2, 2), "same")  # pylint: disable=protected-access


@tf.function(input_signature=_SPEC)
def fwd_dilated(x, dz):
  m = tf.shape(x)[0]
  xt = tf.transpose(_padded(x), [3, 1, 2, 0])                    # [1, 34, 34, m]
  f = tf.transpose(dz, [1, 2, 0, 3])                             # [14, 14, m, 16]
  g = tf.nn.depthwise_conv2d(xt, f, [1, 1, 1, 1], "VALID", dilations=[2, 2])
  return tf.reshape(g[:, :8, :8], [64, m, 16])


@tf.function(input_signature=_SPEC)
def fwd_phases(x, dz):
  m = tf.shape(x)[0]
  xp = _padded(x)[:, :, :, 0]                                    # [m, 34, 34]
  xt = tf.transpose(tf.reshape(xp, [m, 17, 2, 17, 2]), [2, 4, 1, 3, 0])
  xt = tf.reshape(xt, [4, 17, 17, m])                            # phase (a % 2, b % 2)
  f = tf.transpose(dz, [1, 2, 0, 3])
  g = tf.nn.depthwise_conv2d(xt, f, [1, 1, 1, 1], "VALID")       # [4, 4, 4, m 16]
  g = tf.transpose(tf.reshape(g, [2, 2, 4, 4, m * 16]), [2, 0, 3, 1, 4])   # a = 2 q + phase
  return tf.reshape(g, [64, m, 16])


@tf.function(input_signature=_SPEC)
def s2d_depthwise(x, dz):
  m = tf.shape(x)[0]
  xs = tf.nn.space_to_depth(_padded(x), 2)                       # [m, 17, 17, 4]
  xt = tf.reshape(tf.transpose(xs, [1, 2, 0, 3]), [1, 17, 17, m * 4])
  dt = tf.broadcast_to(tf.transpose(dz, [1, 2, 0, 3])[:, :, :, None, :], [14, 14, m, 4, 16])
  g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      xt, tf.stack([4, 4, m * 4, 16]), tf.reshape(dt, [1, 14, 14, m * 64]), [1, 1, 1, 1],
      "VALID")                                                   # [qh, qw, (m, ph, pw), 16]
  g = tf.transpose(tf.reshape(g, [4, 4, m, 2, 2, 16]), [0, 3, 1, 4, 2, 5])
  return tf.reshape(g, [64, m, 16])


@tf.function(input_signature=_SPEC)
def multiplier_one(x, dz):
  m = tf.shape(x)[0]
  xt = tf.reshape(tf.broadcast_to(tf.transpose(x, [1, 2, 0, 3]), [28, 28, m, 16]),
                  [1, 28, 28, m * 16])
  dt = tf.reshape(tf.transpose(dz, [1, 2, 0, 3]), [1, 14, 14, m * 16])
  g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      xt, tf.stack([8, 8, m * 16, 1]), dt, [1, 2, 2, 1], "SAME")
  return tf.reshape(g, [64, m, 16])


def _unfolded_product(patches, dz):
  """g [64, m, 16] from patches [m, 196, 64] and dz: one batched product P_i^T dz_i."""
  g = tf.linalg.matmul(patches, tf.reshape(dz, [-1, 196, 16]), transpose_a=True)
  return tf.transpose(g, [1, 0, 2])


@tf.function(input_signature=_SPEC)
def unfold_gather(x, dz):
  patches = conv._gathered_patches(x, (8, 8), (2, 2), (1, 1), "same", (14, 14))  # pylint: disable=protected-access
  return _unfolded_product(patches, dz)


@tf.function(input_signature=_SPEC)
def unfold_extract(x, dz):
  patches = tf.image.extract_patches(_padded(x), [1, 8, 8, 1], [1, 2, 2, 1], [1, 1, 1, 1],
                                     "VALID")
  return _unfolded_product(tf.reshape(patches, [-1, 196, 64]), dz)


@tf.function(input_signature=_SPEC)
def grouped_filter(x, dz):
  m = tf.shape(x)[0]
  xt = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, 28, 28, -1])
  dt = tf.reshape(tf.transpose(dz, [1, 2, 0, 3]), [1, 14, 14, -1])
  g = tf.raw_ops.Conv2DBackpropFilter(input=xt, filter_sizes=tf.stack([8, 8, 1, m * 16]),
                                      out_backprop=dt, strides=[1, 2, 2, 1], padding="SAME")
  return tf.reshape(g, [64, m, 16])


@tf.function(input_signature=_SPEC)
def nchw_depthwise(x, dz):
  m = tf.shape(x)[0]
  dt = tf.reshape(tf.transpose(dz, [0, 3, 1, 2]), [1, -1, 14, 14])
  g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      tf.reshape(x, [1, -1, 28, 28]), tf.stack([8, 8, m, 16]), dt, [1, 1, 2, 2], "SAME",
      data_format="NCHW")
  return tf.reshape(g, [64, m, 16])


@tf.function(input_signature=_SPEC)
def phases_stride1(x, dz):
  m = tf.shape(x)[0]
  xp = tf.reshape(tf.transpose(_padded(x), [3, 1, 2, 0]),      # [1, 34, 34, m] by phase
                  [1, 17, 2, 17, 2, -1])
  dt = tf.reshape(tf.transpose(dz, [1, 2, 0, 3]), [1, 14, 14, -1])
  g = [tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
      xp[:, :, pa, :, pb, :], tf.stack([4, 4, m, 16]), dt, [1, 1, 1, 1], "VALID")
       for pa in (0, 1) for pb in (0, 1)]                        # [4, 4, m, 16] each
  g = tf.transpose(tf.reshape(tf.stack(g), [2, 2, 4, 4, m * 16]), [2, 0, 3, 1, 4])
  return tf.reshape(g, [64, m, 16])                               # a = 2 q + phase


@tf.function(input_signature=_SPEC)
def whole_batch(x, dz):
  return tf.compat.v1.nn.conv2d_backprop_filter(x, [8, 8, 1, 16], dz, [1, 2, 2, 1], "SAME")


FORMS = {"rule_depthwise": rule_depthwise, "fwd_dilated": fwd_dilated,
         "fwd_phases": fwd_phases, "s2d_depthwise": s2d_depthwise,
         "multiplier_one": multiplier_one, "unfold_gather": unfold_gather,
         "unfold_extract": unfold_extract, "grouped_filter": grouped_filter,
         "nchw_depthwise": nchw_depthwise, "phases_stride1": phases_stride1,
         "whole_batch": whole_batch}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--chunk", type=int, default=128, help="examples per call")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=10)
  a = p.parse_args()
  x = tf.random.normal([a.chunk, 28, 28, 1], seed=0)
  dz = tf.random.normal([a.chunk, 14, 14, 16], seed=1)
  want = rule_depthwise(x, dz).numpy()
  for name, fn in FORMS.items():
    if name != "whole_batch":
      np.testing.assert_allclose(fn(x, dz).numpy(), want, rtol=1e-4, atol=1e-3, err_msg=name)
    for _ in range(2):
      fn(x, dz)
  cpu, wall = {k: [] for k in FORMS}, {k: [] for k in FORMS}
  load_start = os.getloadavg()
  for _ in range(a.rounds):
    for name, fn in FORMS.items():
      c, t = time.process_time(), time.perf_counter()
      for _ in range(a.calls):
        out = fn(x, dz)
      out.numpy()
      cpu[name].append((time.process_time() - c) / a.calls * 1e3)
      wall[name].append((time.perf_counter() - t) / a.calls * 1e3)
  med = lambda d: {k: round(statistics.median(v), 2) for k, v in d.items()}
  print(json.dumps({"chunk": a.chunk, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "cpu_ms": med(cpu), "wall_ms": med(wall)}), flush=True)


if __name__ == "__main__":
  main()
