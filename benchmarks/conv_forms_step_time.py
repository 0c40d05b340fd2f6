"""The tutorial CNN's clipped-sum step with each per-layer convolution form (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/conv_forms_step_time.py [--batch 256]
      [--rounds 9] [--calls 10] [--jit 0|1] [--poisson]

One tf.function per configuration (batch axis unknown to the trace, as in `model.fit` on
Poisson samples), timed round robin in ONE process (--rounds rounds of --calls calls each;
figure: the median over rounds of wall and of process CPU time per call):
  nonprivate      forward, backward: the gradient of the mean loss
  dp_auto         fast_clipping.clipped_grad_sum with the forms of the cost model
                  (rules/conv.py: the second convolution's folded patch Gram with a
                  book-keeping sum, the first's depthwise filter gradients in one call of
                  at most _DEPTHWISE_CHANNELS examples (one input channel), else in
                  chunks, both within the layer's memory budget)
  dp_no_foldgram  the same without the folded Gram (the second convolution keeps its
                  per-example gradient from the unfolded patches: the forms before issue 42)
  dp_one_chunk    the same with _DEPTHWISE_CHANNELS = B (since the memory budget of
                  rules/conv.py, _CHUNK_BYTES still caps the chunk: 256 examples for the
                  first convolution)
  dp_before       both
Random 28x28x1 inputs, clip 1.0, no noise. With --poisson every call gets a batch of
Binomial(60000, B / 60000) examples (as fit's unpadded Poisson samples; the same sizes for
every configuration, drawn from a fixed seed) instead of B. Prints one JSON line with the
medians and the ratios to nonprivate.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tf_dpiter.keras import example_models
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import conv


def _loss(y, logits):
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _steps(model, batch, jit):
  """{name: traced tf.function} of the module docstring's configurations."""
  spec = [tf.TensorSpec([None, 28, 28, 1]), tf.TensorSpec([None], tf.int32)]

  @tf.function(input_signature=spec, jit_compile=jit)
  def nonprivate(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss(y, model(x, training=True)))
    return tape.gradient(loss, model.trainable_variables)

  def dp(fold_gram, chunk):
    saved = conv._fold_gram_cheaper, conv._DEPTHWISE_CHANNELS  # pylint: disable=protected-access
    if not fold_gram:
      conv._fold_gram_cheaper = lambda *args: False  # pylint: disable=protected-access
    conv._DEPTHWISE_CHANNELS = chunk  # pylint: disable=protected-access
    fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, _loss, 1.0)[0],
                     input_signature=spec, jit_compile=jit)
    try:
      fn.get_concrete_function()   # the forms are chosen while tracing
    finally:
      conv._fold_gram_cheaper, conv._DEPTHWISE_CHANNELS = saved  # pylint: disable=protected-access
    return fn

  chunk = conv._DEPTHWISE_CHANNELS  # pylint: disable=protected-access
  return {"nonprivate": nonprivate, "dp_auto": dp(True, chunk),
          "dp_no_foldgram": dp(False, chunk), "dp_one_chunk": dp(True, batch),
          "dp_before": dp(False, batch)}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--rounds", type=int, default=9)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--jit", type=int, default=0)
  p.add_argument("--poisson", action="store_true",
                 help="batch sizes Binomial(60000, B / 60000), one per call (not with --jit 1:"
                 " XLA compiles each size)")
  a = p.parse_args()
  keras.utils.set_random_seed(0)
  model = keras.Sequential(example_models.mnist_cnn_layers())
  sizes = (np.random.default_rng(0).binomial(60000, a.batch / 60000, a.calls * a.rounds)
           if a.poisson else np.full(a.calls * a.rounds, a.batch))
  x = tf.random.normal([int(sizes.max()), 28, 28, 1])
  y = tf.random.uniform([int(sizes.max())], 0, 10, tf.int32)
  batches = [(x[:s], y[:s]) for s in sizes]
  steps = _steps(model, a.batch, bool(a.jit))
  for fn in steps.values():
    for _ in range(3):
      fn(*batches[0])
  wall, cpu = {k: [] for k in steps}, {k: [] for k in steps}
  load_start = os.getloadavg()
  for r in range(a.rounds):
    for name, fn in steps.items():
      t, c = time.perf_counter(), time.process_time()
      for i in range(a.calls):
        out = fn(*batches[r * a.calls + i])
      out[0].numpy()
      wall[name].append((time.perf_counter() - t) / a.calls * 1e3)
      cpu[name].append((time.process_time() - c) / a.calls * 1e3)
  med = lambda d: {k: round(statistics.median(v), 2) for k, v in d.items()}
  mw, mc = med(wall), med(cpu)
  print(json.dumps({"batch": a.batch, "poisson": a.poisson, "jit": a.jit, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "wall_ms": mw, "cpu_ms": mc,
                    "ratios_wall": {k: round(v / mw["nonprivate"], 2) for k, v in mw.items()},
                    "ratios_cpu": {k: round(v / mc["nonprivate"], 2) for k, v in mc.items()}}),
        flush=True)


if __name__ == "__main__":
  main()
