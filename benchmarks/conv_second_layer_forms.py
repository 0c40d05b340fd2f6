"""Per-example norms of the tutorial CNN's second convolution, the rule's form against forms not
in the conv rule (issue 42, item 2): each checked against per-example reference gradients.

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/conv_second_layer_forms.py [--batch 256]
      [--rounds 7] [--calls 20]

The convolution: 4x4 kernel, stride 2, "valid" padding, 13x13x16 inputs, 32 filters (output
5x5x32, T = 25 positions, patches of K = 256 entries, N = 32). Folded (space to depth, 2x2
blocks) the input is U = 6x6 pixels of 64 channels and a patch is 2x2 folded pixels
(rules/conv_unfold.py). Per-example squared norms (each a tf.function with the batch axis
unknown, as in `fit`; the whole batch in one call unless stated):
  rule_foldgram     rules/conv.py's folded patch Gram (`_fold_gram_sqr_norm`): the Gram of the
                    36 folded pixels, its 4 shifted 25x25 windows summed, times the output
                    gradients' Gram (Li et al., "Large language models can be strong
                    differentially private learners", Sec. 4; the patch Gram without unfolding)
  rule_chunked      the same over chunks of 128 examples as the rule runs it
                    (`_over_chunks`, the memory budget's chunk at B = 256)
  window_running    rule_foldgram with a running sum of the windows instead of one add_n
  shift_dz_gram     the windows moved to the output gradients' Gram instead: its 4 copies
                    padded into the 36x36 grid, summed, times the pixel Gram
  shift_dz_ef       the same as <F, E F> (E the shifted output-gradient Grams, F the folded
                    pixels): no pixel Gram
  unfolded_gram     the Gram of the unfolded patches P P^T (T^2 K) times the output gradients'
  direct_shifts     per-example gradients g_i as 4 products of the shifted folded pixels with
                    dz_i (one per 2x2 kernel block), squared and summed
  direct_unfolded   g_i = dz_i^T P_i from the unfolded patches (the rule's form before
                    the folded Gram)
  direct_gathered   the same from the patches by the rule's one gather of pixels
                    (`_gathered_patches`): the rule's kept per-example pass where its clipped
                    sum is pinned (one example per record, B = 256)
  grouped_filter    g_i by Conv2DBackpropFilter as one grouped convolution, the examples as
                    groups (input [1, 13, 13, 16 B], filter [4, 4, 16, 32 B])
  toeplitz_dz       g_i = F_i^T D_i from the folded pixels F_i [36, 64] (no unfolding) and the
                    output gradients shifted to the 4 kernel blocks D_i [36, 4 x 32] (zeros
                    where a block reaches past the grid): 1.44x the multiply-adds
  whole_batch       the convolution's whole-batch filter gradient (the non-private step's)
and the norm with the clipped sum for given clip factors c (the DP step's whole work for this
layer once the factors are known):
  rule_norm_and_sum       rule_chunked, then the book-keeping sum: one whole-batch filter
                          gradient of c_i dz_i (inputs of c_i = 0 zeroed), as rules/conv.py
  fused_direct_norm_sum   direct_shifts over chunks of 128 with the sum sum_i c_i g_i formed
                          from the same g_i in the same pass (no second filter gradient, no
                          gradients kept): possible only where the factors are known when
                          the layer's norms are formed (the layer whose norms come last)
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
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

_K, _S, _OUT = (4, 4), (2, 2), (5, 5)
_SPEC = [tf.TensorSpec([None, 13, 13, 16]), tf.TensorSpec([None, 5, 5, 32])]
_SUM_SPEC = _SPEC + [tf.TensorSpec([None])]
_CHUNK = 128


def _folded(x):
  """[B, 6, 6, 64] folded pixels of the input (rules/conv_unfold.py's fold)."""
  return conv_unfold._folded_input(x, _K, _S, "valid", _OUT)[0]  # pylint: disable=protected-access


def _dz_gram(dz):
  d = tf.reshape(dz, [-1, 25, 32])
  return tf.linalg.matmul(d, d, transpose_b=True)


def _shifted_dz_gram(dz):
  """sum over the 4 kernel blocks (a, c) of the output gradients' Gram placed at the block's
  offset in the 36x36 grid of folded-pixel pairs: [B, 36, 36]."""
  dd = tf.reshape(_dz_gram(dz), [-1, 5, 5, 5, 5])
  e = tf.add_n([tf.pad(dd, [[0, 0], [a, 1 - a], [c, 1 - c], [a, 1 - a], [c, 1 - c]])
                for a in range(2) for c in range(2)])
  return tf.reshape(e, [-1, 36, 36])


def _direct_grads(x, dz):
  """[B, 4, 64, 32] per-example gradients, one [64, 32] block per 2x2 kernel block."""
  xs = _folded(x)
  d = tf.reshape(dz, [-1, 25, 32])
  return tf.stack([tf.linalg.matmul(tf.reshape(xs[:, a:a + 5, c:c + 5, :], [-1, 25, 64]), d,
                                    transpose_a=True) for a in range(2) for c in range(2)], 1)


@tf.function(input_signature=_SPEC)
def rule_foldgram(x, dz):
  return conv._fold_gram_sqr_norm(x, dz, _K, _S, "valid")  # pylint: disable=protected-access


@tf.function(input_signature=_SPEC)
def rule_chunked(x, dz):
  return conv._over_chunks(  # pylint: disable=protected-access
      lambda a, d: (conv._fold_gram_sqr_norm(a, d, _K, _S, "valid"),), x, dz, _CHUNK, 1)[0]  # pylint: disable=protected-access


@tf.function(input_signature=_SPEC)
def window_running(x, dz):
  f = tf.reshape(_folded(x), [-1, 36, 64])
  g = tf.reshape(tf.linalg.matmul(f, f, transpose_b=True), [-1, 6, 6, 6, 6])
  w = g[:, 0:5, 0:5, 0:5, 0:5]
  for a, c in ((0, 1), (1, 0), (1, 1)):
    w = w + g[:, a:a + 5, c:c + 5, a:a + 5, c:c + 5]
  return tf.reduce_sum(tf.reshape(w, [-1, 25, 25]) * _dz_gram(dz), [1, 2])


@tf.function(input_signature=_SPEC)
def shift_dz_gram(x, dz):
  f = tf.reshape(_folded(x), [-1, 36, 64])
  return tf.reduce_sum(tf.linalg.matmul(f, f, transpose_b=True) * _shifted_dz_gram(dz), [1, 2])


@tf.function(input_signature=_SPEC)
def shift_dz_ef(x, dz):
  f = tf.reshape(_folded(x), [-1, 36, 64])
  return tf.reduce_sum(tf.linalg.matmul(_shifted_dz_gram(dz), f) * f, [1, 2])


@tf.function(input_signature=_SPEC)
def unfolded_gram(x, dz):
  p, _ = conv_unfold.patches(x, _K, _S, (1, 1), "valid", _OUT)
  return tf.reduce_sum(tf.linalg.matmul(p, p, transpose_b=True) * _dz_gram(dz), [1, 2])


@tf.function(input_signature=_SPEC)
def direct_shifts(x, dz):
  return tf.reduce_sum(tf.square(_direct_grads(x, dz)), [1, 2, 3])


@tf.function(input_signature=_SPEC)
def direct_unfolded(x, dz):
  p, _ = conv_unfold.patches(x, _K, _S, (1, 1), "valid", _OUT)
  g = tf.linalg.matmul(tf.reshape(dz, [-1, 25, 32]), p, transpose_a=True)
  return tf.reduce_sum(tf.square(g), [1, 2])


@tf.function(input_signature=_SPEC)
def direct_gathered(x, dz):
  p = conv._gathered_patches(x, _K, _S, (1, 1), "valid", _OUT)  # pylint: disable=protected-access
  g = tf.linalg.matmul(tf.reshape(dz, [-1, 25, 32]), p, transpose_a=True)
  return tf.reduce_sum(tf.square(g), [1, 2])


@tf.function(input_signature=_SPEC)
def grouped_filter(x, dz):
  m = tf.shape(x)[0]
  xt = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, 13, 13, -1])
  dt = tf.reshape(tf.transpose(dz, [1, 2, 0, 3]), [1, 5, 5, -1])
  g = tf.raw_ops.Conv2DBackpropFilter(input=xt, filter_sizes=tf.stack([4, 4, 16, m * 32]),
                                      out_backprop=dt, strides=[1, 2, 2, 1], padding="VALID")
  return tf.reduce_sum(tf.square(tf.reshape(g, [4, 4, 16, -1, 32])), [0, 1, 2, 4])


@tf.function(input_signature=_SPEC)
def toeplitz_dz(x, dz):
  f = tf.reshape(_folded(x), [-1, 36, 64])
  d = tf.stack([tf.pad(dz, [[0, 0], [a, 1 - a], [c, 1 - c], [0, 0]])
                for a in range(2) for c in range(2)], 3)       # [B, 6, 6, 4, 32]
  g = tf.linalg.matmul(f, tf.reshape(d, [-1, 36, 128]), transpose_a=True)
  return tf.reduce_sum(tf.square(g), [1, 2])


@tf.function(input_signature=_SPEC)
def whole_batch(x, dz):
  return tf.compat.v1.nn.conv2d_backprop_filter(x, [4, 4, 16, 32], dz, [1, 2, 2, 1], "VALID")


def _bookkeeping_sum(x, dz, c):
  x = tf.math.multiply_no_nan(x, tf.reshape(tf.cast(c > 0, tf.float32), [-1, 1, 1, 1]))
  dz = tf.math.multiply_no_nan(dz, tf.reshape(c, [-1, 1, 1, 1]))
  return tf.compat.v1.nn.conv2d_backprop_filter(x, [4, 4, 16, 32], dz, [1, 2, 2, 1], "VALID")


@tf.function(input_signature=_SUM_SPEC)
def rule_norm_and_sum(x, dz, c):
  return rule_chunked(x, dz), _bookkeeping_sum(x, dz, c)


@tf.function(input_signature=_SUM_SPEC)
def fused_direct_norm_sum(x, dz, c):
  """Norms and sum_i c_i g_i [4, 4, 16, 32] from the same g_i, chunk by chunk."""
  b = tf.shape(x)[0]
  n = (b + _CHUNK - 1) // _CHUNK

  def body(i, acc, sq):
    xc, dc, cc = x[i * _CHUNK:(i + 1) * _CHUNK], dz[i * _CHUNK:(i + 1) * _CHUNK], c[i * _CHUNK:(
        i + 1) * _CHUNK]
    g = _direct_grads(xc, dc)                                      # [m, 4, 64, 32]
    sq = sq.write(i, tf.reduce_sum(tf.square(g), [1, 2, 3]))
    g = tf.math.multiply_no_nan(g, tf.reshape(tf.cast(cc > 0, tf.float32), [-1, 1, 1, 1]))
    return i + 1, acc + tf.reshape(tf.linalg.matvec(tf.reshape(g, [-1, 4 * 64 * 32]), cc,
                                                     transpose_a=True), [4, 64, 32]), sq

  _, acc, sq = tf.while_loop(
      lambda i, *_: i < n, body,
      [tf.constant(0), tf.zeros([4, 64, 32]), tf.TensorArray(tf.float32, n, infer_shape=False)],
      parallel_iterations=1)
  # block (a, c) rows in the folded order (r, s, cin) -> kernel [4, 4, 16, 32]
  kernel = tf.transpose(tf.reshape(acc, [2, 2, 2, 2, 16, 32]), [0, 2, 1, 3, 4, 5])
  return sq.concat(), tf.reshape(kernel, [4, 4, 16, 32])


NORMS = {"rule_foldgram": rule_foldgram, "rule_chunked": rule_chunked,
         "window_running": window_running, "shift_dz_gram": shift_dz_gram,
         "shift_dz_ef": shift_dz_ef, "unfolded_gram": unfolded_gram,
         "direct_shifts": direct_shifts, "direct_unfolded": direct_unfolded,
         "direct_gathered": direct_gathered, "grouped_filter": grouped_filter,
         "toeplitz_dz": toeplitz_dz,
         "whole_batch": whole_batch}
NORMS_AND_SUMS = {"rule_norm_and_sum": rule_norm_and_sum,
                  "fused_direct_norm_sum": fused_direct_norm_sum}


def reference(x, dz, c):
  """(squared norms [B], sum_i c_i g_i) from per-example Conv2DBackpropFilter."""
  g = tf.stack([tf.compat.v1.nn.conv2d_backprop_filter(
      x[i:i + 1], [4, 4, 16, 32], dz[i:i + 1], [1, 2, 2, 1], "VALID")
                for i in range(int(x.shape[0]))])
  return (tf.reduce_sum(tf.square(g), [1, 2, 3, 4]).numpy(),
          tf.tensordot(c, g, 1).numpy())


def check(x, dz, c):
  """Every form's result against the per-example reference (raises AssertionError)."""
  want_sq, want_sum = reference(x, dz, c)
  for name, fn in NORMS.items():
    if name != "whole_batch":
      np.testing.assert_allclose(fn(x, dz).numpy(), want_sq, rtol=2e-4, err_msg=name)
  for name, fn in NORMS_AND_SUMS.items():
    sq, total = fn(x, dz, c)
    np.testing.assert_allclose(sq.numpy(), want_sq, rtol=2e-4, err_msg=name)
    np.testing.assert_allclose(total.numpy(), want_sum, rtol=2e-4, atol=1e-3, err_msg=name)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=20)
  a = p.parse_args()
  x = tf.random.normal([a.batch, 13, 13, 16], seed=0)
  dz = tf.random.normal([a.batch, 5, 5, 32], seed=1)
  c = tf.random.uniform([a.batch], seed=2) * tf.cast(tf.range(a.batch) % 7 != 3, tf.float32)
  check(x[:37], dz[:37], c[:37])
  calls = {**{k: (lambda f=f: f(x, dz)) for k, f in NORMS.items()},
           **{k: (lambda f=f: f(x, dz, c)) for k, f in NORMS_AND_SUMS.items()}}
  for fn in calls.values():
    fn()
  cpu, wall = {k: [] for k in calls}, {k: [] for k in calls}
  load_start = os.getloadavg()
  for _ in range(a.rounds):
    for name, fn in calls.items():
      t0, w0 = time.process_time(), time.perf_counter()
      for _ in range(a.calls):
        out = fn()
      tf.nest.flatten(out)[0].numpy()
      cpu[name].append((time.process_time() - t0) / a.calls * 1e3)
      wall[name].append((time.perf_counter() - w0) / a.calls * 1e3)
  med = lambda d: {k: round(statistics.median(v), 3) for k, v in d.items()}
  print(json.dumps({"batch": a.batch, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "cpu_ms": med(cpu), "wall_ms": med(wall)}), flush=True)


if __name__ == "__main__":
  main()
