"""Where the DP `model.fit` step's CPU time goes, by ablation: the DP step traced with one part
replaced, against the unchanged DP step and the non-private step (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_step_ablation.py [--variants base,no_conv1_norm]
      [--model cnn] [--batch 256] [--steps 32] [--rounds 6]

The profiler's per-op self times (benchmarks/fit_step_split.py) include the time an op waits
for a core on a loaded machine; this measures process CPU time instead. Each variant is its own
DP model (DPSequential + DPKerasSGDOptimizer(1.0, 1.1), fit on arrays: Poisson samples of
expected size --batch, no XLA) whose train function is traced while one library function is
replaced; then all models fit one epoch of --steps steps per round, round robin in ONE process
(benchmarks/fit_step_time.py's timer; figure: the median over --rounds rounds of process CPU
ms per step, and its ratio to the non-private step). Variants:
  base            the DP step as it is
  no_conv1_norm   upper bound: the per-example forms' pass (rules/conv.py `_per_example_pass`)
                  returns zeros: what that pass costs. Since the pinned sums the tutorial
                  CNN's second convolution keeps its gradients at B = 256 and runs this pass
                  too: there both convolutions' passes (no_unfold_grads: the second's products)
  no_conv2_norm   upper bound: the folded Gram norm (`_fold_gram_sqr_norm`, the second
                  convolution where its gradients are not kept: B = 1,024) returns zeros
  no_unfold_grads upper bound: the unfolded patches' per-example gradients (`_unfold_chunk`:
                  the one gather of pixels and the batched product dz^T P, the second
                  convolution's kept pass at B = 256) are zeros (its norms and sum still run)
  no_conv_kept_sums  upper bound: the convolutions' pinned sums of their kept gradients
                  (`_pinned_kept_sum`, both convolutions at B = 256) return zeros
  fold_gram_uncapped the folded Gram's norms in chunks of its own budget (256 examples), not
                  capped at the per-example pass's (64 at B = 1,024): the cap's CPU cost
                  (the cap keeps the step's allocator peak at B = 1,024 at 7.1 MiB over
                  non-private against 31.3 with chunks of 256, commit 8449c38)
  keep_32mib      the pinned sums keep per-example gradients up to 4x budget.KEEP_BYTES (32
                  MiB), not 2x: the second convolution's at B = 1,024 kept, not formed again
  reduce_sqr_sum  algebra.sqr_sum of a [B, P] tensor as reduce_sum(square(x), 1) instead of
                  the einsum "bp,bp->b" (oneDNN runs that einsum as B one-row products)
  fold_gram_128   the folded Gram's chunks of 128 examples (its temporaries estimated at 40,284
                  bytes per example, the estimate before the measured one)
  fold_gram_one_call  the folded Gram in one call up to 512 examples, not chunks of 256
                  (budget.chunk_size's powers of two: fit's Poisson batches above 256, about
                  half of them at B = 256, run two chunks); its temporaries estimated at 16,000
                  bytes per example, below the measured peak: what the chunks cost, not a budget
  no_noise        upper bound: the Gaussian noise's draw (dp_query/gaussian_query.py `_noise`)
                  returns zeros: what the draw and its Box-Muller transform cost
  depthwise_one_call  the first convolution's depthwise pass without its 128-example cap (one
                  call up to 256 examples, budget.chunk_size at 23,872 bytes per example)
  conv2_norm_island   the second convolution's folded Gram norm (`_fold_gram_sqr_norm`) as an
                  XLA island inside the non-XLA step: a nested tf.function(jit_compile=True)
                  on the batch padded with zero examples to a multiple of 16 (XLA compiles
                  one static shape; each new multiple met compiles again), its rows cut back
  conv1_norm_island   the first convolution's per-example pass as such an island, in the
                  unfolded-patches form (the depthwise form is a grouped convolution, slow
                  on XLA's CPU backend)
  conv1_norm_island_chunks  the same island compiled once, on chunks of _ISLAND_CHUNK examples
                  (the batch padded with zero examples to whole chunks, the island called per
                  chunk by tf.map_fn in the non-XLA step): no compile per batch size
  noise_island    the Gaussian noise (dp_query/gaussian_query.py `add_gaussian_noise`) as such
                  an island (static sizes: one compile); the same law and Philox counter, the
                  draws equal within float32 rounding of log / cos / sin
The upper bounds are not private steps (their norms or noise are zero): they only say what a
part costs. Prints one JSON line.
"""

import argparse
import contextlib
import json
import os
import warnings


@contextlib.contextmanager
def _replaced(owner, name, value):
  old = getattr(owner, name)
  setattr(owner, name, value)
  try:
    yield
  finally:
    setattr(owner, name, old)


_ISLAND_BUCKET = 16
_ISLAND_CHUNK = 64


def _island(fn, batch_args):
  """fn(*args) as a nested tf.function(jit_compile=True) inside the enclosing trace, its first
  `batch_args` arguments' batch axis padded with zero rows to a multiple of _ISLAND_BUCKET and
  the rows of its first output (the norms) cut back; other outputs returned padded."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  compiled = tf.function(fn, jit_compile=True, autograph=False)

  def call(*args):
    b = tf.shape(args[0])[0]
    padded = (b + _ISLAND_BUCKET - 1) // _ISLAND_BUCKET * _ISLAND_BUCKET
    pad = lambda t: tf.pad(t, [[0, padded - b]] + [[0, 0]] * (t.shape.rank - 1))
    out = compiled(*[pad(a) for a in args[:batch_args]], *args[batch_args:])
    return (out[0][:b],) + tuple(out[1:]) if isinstance(out, tuple) else out[:b]

  return call


def _variants():
  """{name: context manager factory active while that variant's train function is traced}."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import gaussian_query  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping import algebra  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping.rules import conv  # pylint: disable=g-import-not-at-top

  def zero_pass(form, x4, dz4, k, with_grads, bound=None):   # conv._per_example_pass's
    del bound   # the book-keeping form's rounding bound: no norm to raise
    b = tf.shape(x4)[0]
    sq = tf.zeros([b // k])
    return (sq, tf.zeros([1, form.rows, b, form.cols])) if with_grads else sq

  def zero_noise(generator, size, dtype, stddev):   # gaussian_query._noise's parts, zeros
    del generator, stddev
    if dtype == tf.float64:
      return (tf.zeros([size], dtype),)
    half = tf.zeros([(size + 1) // 2], tf.float32)   # float32: the Box-Muller draw's halves
    return half, half

  fold_gram = conv._fold_gram_sqr_norm  # pylint: disable=protected-access
  conv2_island = lambda x4, dz4, *a: _island(lambda x, d: fold_gram(x, d, *a), 2)(x4, dz4)
  per_example_pass = conv._per_example_pass  # pylint: disable=protected-access

  first_conv = lambda x4, dz4: (tuple(x4.shape[1:]) == (28, 28, 1) and
                                tuple(dz4.shape[1:]) == (14, 14, 16))

  def conv1_island(form, x4, dz4, k, with_grads, bound=None):
    if not first_conv(x4, dz4):
      return per_example_pass(form, x4, dz4, k, with_grads, bound)
    unfold = conv._per_example_form(None, x4, dz4, (8, 8), (2, 2), (1, 1), "same")  # pylint: disable=protected-access
    return _island(lambda x, d: per_example_pass(unfold, x, d, k, with_grads, bound), 2)(
        x4, dz4)

  def conv1_island_chunks(form, x4, dz4, k, with_grads, bound=None):
    if not first_conv(x4, dz4) or k != 1 or not with_grads:
      return per_example_pass(form, x4, dz4, k, with_grads, bound)
    unfold = conv._per_example_form(None, x4, dz4, (8, 8), (2, 2), (1, 1), "same")  # pylint: disable=protected-access
    m = _ISLAND_CHUNK
    compiled = tf.function(lambda x, d: per_example_pass(unfold, x, d, 1, True, bound),
                           jit_compile=True, autograph=False)
    b = tf.shape(x4)[0]
    n = (b + m - 1) // m
    split = lambda t: tf.reshape(tf.pad(t, [[0, n * m - b]] + [[0, 0]] * 3),
                                 tf.concat([[n, m], tf.shape(t)[1:]], 0))
    def one(pair):
      sq, g = compiled(tf.ensure_shape(pair[0], [m] + x4.shape[1:].as_list()),
                       tf.ensure_shape(pair[1], [m] + dz4.shape[1:].as_list()))
      return sq, g[0]
    sq, g = tf.map_fn(one, (split(x4), split(dz4)), parallel_iterations=1,
                      fn_output_signature=(tf.TensorSpec([m], tf.float32),
                                           tf.TensorSpec([unfold.rows, m, unfold.cols],
                                                         tf.float32)))
    return tf.reshape(sq, [-1])[:b], g

  add_noise = gaussian_query.add_gaussian_noise
  noise_island = lambda generator, structure, stddev: tf.function(
      lambda s: add_noise(generator, s, stddev), jit_compile=True, autograph=False)(structure)

  unfold_chunk = conv._unfold_chunk  # pylint: disable=protected-access

  def zero_unfold(x4, dz4, ksize, stride, dilation, padding):   # its layout from one example
    g, layout = unfold_chunk(x4[:1], dz4[:1], ksize, stride, dilation, padding)
    return tf.zeros(tf.stack([1, tf.shape(x4)[0], tf.shape(g)[2]])), layout

  fold_gram_norms = conv._fold_gram_norms  # pylint: disable=protected-access

  def reduce_sqr_sum(x):
    x = tf.cast(x, tf.float32)
    return tf.reduce_sum(tf.square(x), axis=list(range(1, x.shape.rank)))

  return {
      "base": contextlib.nullcontext,
      "no_conv1_norm": lambda: _replaced(conv, "_per_example_pass", zero_pass),
      "no_conv2_norm": lambda: _replaced(
          conv, "_fold_gram_sqr_norm", lambda x4, dz4, *a: tf.zeros([tf.shape(x4)[0]])),
      "no_unfold_grads": lambda: _replaced(conv, "_unfold_chunk", zero_unfold),
      "no_conv_kept_sums": lambda: _replaced(
          conv, "_pinned_kept_sum", lambda form, *a: tf.zeros([form.rows, form.cols])),
      "fold_gram_uncapped": lambda: _replaced(
          conv, "_fold_gram_norms", lambda *a: fold_gram_norms(*a[:6])),
      "keep_32mib": lambda: _replaced(conv, "_PINNED_KEEP_FACTOR", 4),
      "reduce_sqr_sum": lambda: _replaced(algebra, "sqr_sum", reduce_sqr_sum),
      "fold_gram_128": lambda: _replaced(conv, "_fold_gram_temp_bytes", lambda *a: 40284),
      "fold_gram_one_call": lambda: _replaced(conv, "_fold_gram_temp_bytes",
                                              lambda *a, **k: 16000),
      "no_noise": lambda: _replaced(gaussian_query, "_noise", zero_noise),
      "depthwise_one_call": lambda: _replaced(conv, "_DEPTHWISE_CHANNELS", 1 << 30),
      "conv2_norm_island": lambda: _replaced(conv, "_fold_gram_sqr_norm", conv2_island),
      "conv1_norm_island": lambda: _replaced(conv, "_per_example_pass", conv1_island),
      "conv1_norm_island_chunks": lambda: _replaced(conv, "_per_example_pass",
                                                    conv1_island_chunks),
      "noise_island": lambda: _replaced(gaussian_query, "add_gaussian_noise", noise_island),
  }


def chosen(spec, variants):
  """The variant names of the comma-separated `spec`, each one of `variants` and once.

  Raises:
    ValueError: an unknown or repeated name.
  """
  names = spec.split(",")
  unknown = [n for n in names if n not in variants]
  if unknown or len(set(names)) != len(names):
    raise ValueError(f"`--variants` must name distinct variants of {sorted(variants)}. "
                     f"Received: variants={spec!r}")
  return names


def saved_against_base(ms):
  """{variant: ms saved against the variant "base"} of a {name: ms per step} ({} without
  base; the non-private step left out)."""
  if "base" not in ms:
    return {}
  return {k: round(ms["base"] - v, 3) for k, v in ms.items() if k != "nonprivate"}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="base,no_conv1_norm,no_conv2_norm,reduce_sqr_sum")
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--rounds", type=int, default=6)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  import fit_step_time  # pylint: disable=g-import-not-at-top
  variants = _variants()
  names = chosen(a.variants, variants)
  load_start = os.getloadavg()
  xs, ys, b = fit_step_time.dataset(a.model, fit_step_time._parse(  # pylint: disable=protected-access
      ["--batch", str(a.batch)]))
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  fit_kw = dict(x=xs, y=ys, batch_size=b, steps_per_epoch=a.steps)
  configs = {}
  for name in ["nonprivate"] + names:
    keras.utils.set_random_seed(0)
    model = fit_step_time.build_model(a.model, name != "nonprivate")
    model.compile(loss=loss, optimizer=(keras.optimizers.SGD(0.1) if name == "nonprivate" else
                                        dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1)))
    with (contextlib.nullcontext() if name == "nonprivate" else variants[name]()):
      model.fit(**fit_kw, epochs=1, verbose=0)   # traced here, with the variant's function
    configs[name] = (model, fit_kw)
  t = fit_step_time._time_round_robin(configs, a.rounds, a.steps)  # pylint: disable=protected-access
  cpu = {k: v[1] for k, v in t.items()}
  print(json.dumps({"model": a.model, "batch": a.batch, "steps": a.steps, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "cpu_ms_per_step": cpu, "wall_ms_per_step": {k: v[0] for k, v in t.items()},
                    "cpu_ratio_to_nonprivate": {k: round(v / cpu["nonprivate"], 3)
                                                for k, v in cpu.items()},
                    "cpu_ms_saved_against_base": saved_against_base(cpu)}), flush=True)


if __name__ == "__main__":
  main()
