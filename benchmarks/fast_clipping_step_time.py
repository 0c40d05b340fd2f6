"""Step time and peak memory: non-private vs fast-clipped DP vs vectorized DP.

Models: the MNIST CNN of TF Privacy's tutorial, the 784-512-10 MLP and a small
Transformer encoder (Embedding 10k x 128, 2 blocks of MultiHeadAttention +
LayerNorm + Dense, sequence 128). Every step is one tf.function (optionally
jit_compile=True) doing forward, backward and a plain SGD update; the DP steps
add Gaussian noise (the library's draw, stddev = noise multiplier * C) to the
clipped sum inside the step so its cost is counted.

  python benchmarks/fast_clipping_step_time.py --steps 30 --warmup 5
  python benchmarks/fast_clipping_step_time.py --memory        # batch 1024

ms/step is the median over --steps timed steps after --warmup steps.
Peak memory on CPU: each (model, mode) runs in a fresh subprocess; after the
warm-up the kernel's peak-RSS counter is reset (/proc/self/clear_refs) and the
figure is the peak RSS during --mem-steps steps minus the RSS before them
("step memory"), plus the absolute peak. On a GPU: tf.config.experimental
peak bytes after reset_memory_stats.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf
import keras

from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness
from tf_dpiter.keras import example_models

from tf_dpiter.keras.fast_clipping import clipping  # pylint: disable=g-import-not-at-top

BATCH = {"cnn": 256, "mlp": 256, "transformer": 64}
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.1


def build_model(name):
  keras.utils.set_random_seed(0)
  if name == "cnn":  # TF Privacy tutorial (mnist_dpsgd_tutorial_keras).
    model = keras.Sequential(example_models.mnist_cnn_layers())
  elif name == "mlp":
    model = keras.Sequential(example_models.mlp_layers())
  elif name == "transformer":
    model = example_models.transformer_encoder()
  else:
    raise ValueError(f"model must be cnn, mlp or transformer, got {name!r}")
  return model


def make_batch(name, batch):
  rng = np.random.default_rng(0)
  if name == "cnn":
    x = rng.random((batch, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, batch)
  elif name == "mlp":
    x = rng.random((batch, 784), np.float32)
    y = rng.integers(0, 10, batch)
  else:
    x = rng.integers(0, 10000, (batch, 128)).astype(np.int32)
    y = rng.integers(0, 2, batch)
  return tf.constant(x), tf.constant(y.astype(np.int32))


def per_example_loss(y_true, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(y_true, tf.int32), logits=logits)


def _apply(model, grads, scale):
  for v, g in zip(model.trainable_variables, grads):
    v.assign_sub(LEARNING_RATE * scale * tf.convert_to_tensor(g))


_GENERATOR = []


def _noised(grads):
  """The library's Gaussian noise (GaussianSumQuery's draw), z * C per entry."""
  if not _GENERATOR:
    _GENERATOR.append(randomness.make_generator())
  return gaussian_query.add_gaussian_noise(
      _GENERATOR[0], [tf.convert_to_tensor(g) for g in grads],
      NOISE_MULTIPLIER * L2_NORM_CLIP)


def make_step(model, mode, jit):
  """Returns a tf.function doing one training step of `mode`."""

  def nonprivate(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(per_example_loss(y, model(x, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    _apply(model, grads, 1.0)
    return loss

  def fast(variant, noise=True):
    def step(x, y):
      grads, norms = clipping._clipped_grad_sum(  # pylint: disable=protected-access
          model, x, y, per_example_loss, L2_NORM_CLIP, variant=variant)
      b = tf.cast(tf.shape(norms)[0], tf.float32)
      _apply(model, _noised(grads) if noise else grads, 1.0 / b)
      return tf.reduce_mean(norms)
    return step

  def vectorized(x, y):
    variables = model.trainable_variables

    def one(xy):
      xi, yi = xy
      with tf.GradientTape() as tape:
        loss = per_example_loss(yi[None], model(xi[None], training=True))[0]
      return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    pe = tf.vectorized_map(one, (x, y))
    b = tf.shape(x)[0]
    sq = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [b, -1]), 1)
                   for g in pe])
    norms = tf.sqrt(sq)
    factors = tf.minimum(1.0, L2_NORM_CLIP / tf.maximum(norms, 1e-30))
    grads = [tf.tensordot(factors, g, axes=1) for g in pe]
    _apply(model, _noised(grads), 1.0 / tf.cast(b, tf.float32))
    return tf.reduce_mean(norms)

  fns = {"nonprivate": nonprivate, "fast": fast("bookkeeping"),
         "fast_two_pass": fast("two_pass"), "vectorized": vectorized,
         # Not DP: shows what the noise draw costs.
         "fast_no_noise": fast("bookkeeping", noise=False)}
  return tf.function(fns[mode], jit_compile=jit)


def time_model(name, modes, batch, steps, warmup, jit):
  """Median ms/step per mode; modes are timed round-robin so that load
  changes on a shared machine hit all modes alike."""
  x, y = make_batch(name, batch)
  steps_fn, models = {}, {}
  for mode in modes:
    models[mode] = build_model(name)
    steps_fn[mode] = make_step(models[mode], mode, jit)
    try:
      for _ in range(warmup):
        steps_fn[mode](x, y).numpy()
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:12s} {mode:14s} FAILED: {type(e).__name__}: "
            f"{str(e)[-1500:]}", flush=True)
      del steps_fn[mode]
  times = {mode: [] for mode in steps_fn}
  for _ in range(steps):
    for mode, step in steps_fn.items():
      t0 = time.perf_counter()
      step(x, y).numpy()
      times[mode].append(1e3 * (time.perf_counter() - t0))
  return {mode: statistics.median(t) for mode, t in times.items()}


def _rss_kb(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return -1


def memory_mode(name, mode, batch, steps, jit):
  """Peak step memory in MiB (see module docstring)."""
  model = build_model(name)
  x, y = make_batch(name, batch)
  step = make_step(model, mode, jit)
  step(x, y).numpy()
  gpu = bool(tf.config.list_physical_devices("GPU"))
  if gpu:
    tf.config.experimental.reset_memory_stats("GPU:0")
    base = tf.config.experimental.get_memory_info("GPU:0")["current"]
    for _ in range(steps):
      step(x, y).numpy()
    peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return {"step_mib": (peak - base) / 2**20, "peak_mib": peak / 2**20}
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  base = _rss_kb("VmRSS")
  for _ in range(steps):
    step(x, y).numpy()
  peak = _rss_kb("VmHWM")
  return {"step_mib": (peak - base) / 1024, "peak_mib": peak / 1024}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="cnn,mlp,transformer")
  p.add_argument("--modes", default="nonprivate,fast,fast_two_pass,vectorized")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--no-jit", action="store_true")
  p.add_argument("--memory", action="store_true",
                 help="peak memory at --mem-batch instead of step time")
  p.add_argument("--mem-batch", type=int, default=1024)
  p.add_argument("--mem-steps", type=int, default=3)
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  jit = not args.no_jit
  if args.child:
    name, mode = args.child.split(":")
    print(json.dumps(memory_mode(name, mode, args.mem_batch, args.mem_steps,
                                 jit)))
    return
  models, modes = args.models.split(","), args.modes.split(",")
  device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
  print(f"# device={device} jit_compile={jit} tf={tf.__version__} "
        f"keras={keras.__version__}")
  for name in models:
    if args.memory:
      for mode in modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--child",
               f"{name}:{mode}", "--mem-batch", str(args.mem_batch),
               "--mem-steps", str(args.mem_steps)] + (
                   ["--no-jit"] if not jit else [])
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        row = {}
        try:
          row[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
          row[mode] = {"error": res.stderr.strip().splitlines()[-1:]}
        print(f"{name:12s} batch={args.mem_batch} {mode:14s} {row[mode]}",
              flush=True)
    else:
      row = time_model(name, modes, BATCH[name], args.steps, args.warmup, jit)
      for mode, ms in row.items():
        ratio = ms / row["nonprivate"] if "nonprivate" in row else 0.0
        print(f"{name:12s} batch={BATCH[name]:4d} {mode:14s} "
              f"{ms:9.2f} ms/step  x{ratio:.2f}", flush=True)


if __name__ == "__main__":
  main()
