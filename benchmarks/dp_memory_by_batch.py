"""DP step memory minus non-private step memory against the batch size (issue 42, item 3).

  python benchmarks/dp_memory_by_batch.py [--models cnn,transformer,lstm]
      [--batches 16,256,1024] [--steps 3] [--jit 0|1] [--onednn 1] [--two_pass] [--one_call] [--fit]

For each model, batch and mode, one fresh child process builds the model and one tf.function
step on a fixed random batch, runs it once (tracing, graph optimization, first allocations),
resets TensorFlow's CPU allocator statistics (tf.config.experimental.reset_memory_stats: with
oneDNN on, TensorFlow's CPU tensors come from a BFC allocator that keeps its pool, so RSS
after the first step no longer moves) and runs --steps more steps. Figures: "step MiB", the
allocator's peak during those steps minus its current bytes before them (what the step's
tensors take at their peak beyond the variables and the batch), the allocator's peak itself,
the process's peak RSS (tracing and graph optimization included), and "step_ms", the median
wall time of those steps. Modes:
  nonprivate  forward, backward of the mean loss, SGD update (assign_sub)
  dp          fast_clipping.clipped_grad_sum (clip 1.0, the layer rules' forms), the
              library's Gaussian noise (stddev 1.1), the division by B and the same update
  dp_two_pass (with --two_pass) the same with variant="two_pass": the clipped sum by a second
              backward pass of sum_i c_i L_i instead of book-keeping (which keeps every
              layer's output gradient until the clip factors are known)
  fit_nonprivate, fit_dp (with --fit) Keras' own train step: model.train_on_batch compiled
              with keras.optimizers.SGD, or made private (dp.keras.make_private) and
              compiled with DPKerasSGDOptimizer (the same clip and noise; Poisson sampling
              declared with expected batch B), figures as above; fit_dp_minus_nonprivate is
              against fit_nonprivate
  dp_one_call (with --one_call) dp with physical_chunks=False: the batch in one call even where
              book-keeping keeps more than rules/budget.KEPT_BYTES (the form before the
              physical chunks of the clipped sum)
Models: the tutorial CNN (example_models.mnist_cnn_layers, 28x28x1 inputs), the Transformer
encoder (example_models.transformer_encoder: 1.6M parameters, sequences of 128 ids) and the LSTM
language model of benchmarks/fit_step_time.py (Embedding 2000 x 64, LSTM 128 with
return_sequences, Dense 2000 logits per token, 40 tokens, per-token loss summed per example).
Prints one JSON line per (model, batch) with the modes and {mode}_minus_nonprivate of each
figure. The Transformer at batch 1024 needs several GiB; --models and --batches pick what fits.
"""

import argparse
import json
import os
import subprocess
import sys

L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.1


def _rss_kb(field):
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def _model_and_batch(name, batch):
  """(model, x, y, per_example_loss) of model `name` on a random batch of `batch` examples."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras import example_models  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits
  if name == "cnn":
    model = keras.Sequential(example_models.mnist_cnn_layers())
    x = rng.random((batch, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, batch)
    loss = lambda yt, logits: xent(labels=yt, logits=logits)
  elif name == "transformer":
    model = example_models.transformer_encoder()
    x = rng.integers(0, 10000, (batch, 128))
    y = rng.integers(0, 2, batch)
    loss = lambda yt, logits: xent(labels=yt, logits=logits)
  elif name == "lstm":
    model = keras.Sequential([keras.Input((40,), dtype="int32"),
                              keras.layers.Embedding(2000, 64),
                              keras.layers.LSTM(128, return_sequences=True),
                              keras.layers.Dense(2000)])
    x = rng.integers(0, 2000, (batch, 40))
    y = rng.integers(0, 2000, (batch, 40))
    loss = lambda yt, logits: tf.reduce_sum(xent(labels=yt, logits=logits), axis=1)
  else:
    raise ValueError(f"`name` must be cnn, transformer or lstm. Received: name={name!r}")
  x = tf.constant(x if x.dtype == np.float32 else x.astype(np.int32))
  return model, x, tf.constant(y.astype(np.int32)), loss


def _step(model, loss, mode, jit):
  """The tf.function of one training step of `mode` (module docstring)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import gaussian_query  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping import clipping  # pylint: disable=g-import-not-at-top
  generator = randomness.make_generator()

  def apply(grads, scale):
    for v, g in zip(model.trainable_variables, grads):
      v.assign_sub(LEARNING_RATE * scale * tf.convert_to_tensor(g))

  def nonprivate(x, y):
    with tf.GradientTape() as tape:
      value = tf.reduce_mean(loss(y, model(x, training=True)))
    apply(tape.gradient(value, model.trainable_variables), 1.0)
    return value

  def dp(x, y, variant="bookkeeping", chunks=True):
    grads, norms = clipping.clipped_grad_sum(model, x, y, loss, l2_norm_clip=L2_NORM_CLIP,
                                             variant=variant, physical_chunks=chunks)
    noised = gaussian_query.add_gaussian_noise(
        generator, [tf.convert_to_tensor(g) for g in grads], NOISE_MULTIPLIER * L2_NORM_CLIP)
    apply(noised, 1.0 / tf.cast(tf.shape(norms)[0], tf.float32))
    return tf.reduce_mean(norms)

  if mode.startswith("fit_"):   # Keras' own train step (train_on_batch), DP or not
    import keras  # pylint: disable=g-import-not-at-top
    import tf_dpiter as dp_lib  # pylint: disable=g-import-not-at-top
    batch_loss = lambda yt, logits: loss(tf.cast(yt, tf.int32), logits)
    if mode == "fit_dp":
      dp_lib.keras.make_private(model)
      opt = dp_lib.keras.DPKerasSGDOptimizer(L2_NORM_CLIP, NOISE_MULTIPLIER,
                                             learning_rate=LEARNING_RATE)
    else:
      opt = keras.optimizers.SGD(LEARNING_RATE)
    model.compile(optimizer=opt, loss=batch_loss, jit_compile=jit)

    declared = []

    def fit_step(x, y):
      if mode == "fit_dp" and not declared:
        n = int(x.shape[0])
        model.optimizer.set_sampling(4 * n, 0.25, "poisson", n)
        declared.append(n)
      return tf.constant(model.train_on_batch(x, y))

    return fit_step
  fns = {"nonprivate": nonprivate, "dp": dp,
         "dp_two_pass": lambda x, y: dp(x, y, variant="two_pass"),
         "dp_one_call": lambda x, y: dp(x, y, chunks=False)}
  return tf.function(fns[mode], jit_compile=jit)


def child(name, mode, batch, steps, jit):
  """{step_mib, alloc_peak_mib, peak_rss_mib, step_ms} of one (model, mode, batch) in this
  process."""
  import statistics  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model, x, y, loss = _model_and_batch(name, batch)
  step = _step(model, loss, mode, jit)
  step(x, y).numpy()
  tf.config.experimental.reset_memory_stats("CPU:0")
  base = tf.config.experimental.get_memory_info("CPU:0")["current"]
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    step(x, y).numpy()
    times.append(time.perf_counter() - start)
  peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  return {"step_mib": round((peak - base) / 2**20, 1), "alloc_peak_mib": round(peak / 2**20, 1),
          "peak_rss_mib": round(_rss_kb("VmHWM") / 1024, 1),
          "step_ms": round(1000 * statistics.median(times), 1)}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="cnn,transformer,lstm")
  p.add_argument("--batches", default="16,256,1024")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--jit", type=int, default=0)
  p.add_argument("--onednn", default="1", help="TF_ENABLE_ONEDNN_OPTS of the children")
  p.add_argument("--two_pass", action="store_true", help="also dp_two_pass")
  p.add_argument("--one_call", action="store_true", help="also dp_one_call")
  p.add_argument("--fit", action="store_true",
                 help="also fit_nonprivate and fit_dp: Keras' train step (train_on_batch)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    name, mode, batch = a.child.split(":")
    print(json.dumps(child(name, mode, int(batch), a.steps, bool(a.jit))))
    return
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=a.onednn, TF_CPP_MIN_LOG_LEVEL="3")
  for name in a.models.split(","):
    for batch in (int(b) for b in a.batches.split(",")):
      row = {"model": name, "batch": batch, "jit": a.jit, "onednn": a.onednn,
             "load_avg": os.getloadavg()}
      for mode in (("nonprivate", "dp") + (("dp_two_pass",) if a.two_pass else ()) +
                   (("dp_one_call",) if a.one_call else ()) +
                   (("fit_nonprivate", "fit_dp") if a.fit else ())):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{name}:{mode}:{batch}",
               "--steps", str(a.steps), "--jit", str(a.jit)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        lines = res.stdout.strip().splitlines()
        row[mode] = json.loads(lines[-1]) if res.returncode == 0 and lines else {
            "error": res.stderr.strip().splitlines()[-3:]}
      for mode, base in (("dp", "nonprivate"), ("dp_two_pass", "nonprivate"),
                         ("dp_one_call", "nonprivate"), ("fit_dp", "fit_nonprivate")):
        if mode in row and "error" not in row[mode] and "error" not in row[base]:
          row[f"{mode}_minus_nonprivate"] = {
              k: round(row[mode][k] - row[base][k], 1)
              for k in ("step_mib", "alloc_peak_mib", "peak_rss_mib")}
          row[f"{mode}_over_nonprivate_ms"] = round(
              row[mode]["step_ms"] / row[base]["step_ms"], 3)
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
