"""Cost of the Gaussian noise draw of one DP step, before/after a change and against
TensorFlow's own samplers (issue 18).

  python benchmarks/fit_noise_draw.py [--sizes 407050 26010] [--calls 15] [--rounds 10]
                                      [--onednn default|0|1] [--threads 0] [--before COMMIT]
                                      [--only SAMPLER ...]
  (BERT-base size: --sizes 110000000 --calls 1 --rounds 3
                   --only library_normal before_normal uniform_full_int)

For each size (407,050 = the 784-512-10 MLP's parameters, 26,010 = the tutorial CNN's), each
sampler draws that many float32 standard normals in one tf.function; the samplers are called
round robin in one process (--rounds rounds of --calls calls each, after warm-up); figure:
median ms per draw (including the copy of the result to NumPy). Samplers:
  library_normal      tf_dpiter's `randomness.normal` (Box-Muller from Philox bits, radius
                      from an exponential exact in the tail: the noise every DP step draws)
  library_noise_mlp   `gaussian_query.add_gaussian_noise` on the MLP's four gradient leaves
                      (sigma = 1.3): the draw, its split and the additions of one DP step
  library_secure      `randomness.normal` in secure mode (os.urandom bits, (z1 + z2)/sqrt 2)
  before_normal, before_secure, before_noise_mlp
                      the same with `tf_dpiter/dp_query/randomness.py` of --before (read
                      with `git show`, loaded as its own module; before_noise_mlp re-creates
                      that commit's add_gaussian_noise: one draw, tf.split, x sigma, add)
  generator_normal    tf.random.Generator(philox).normal (float32 Box-Muller from 23-bit
                      uniforms: a bounded tail, which the library avoids; a speed reference)
  uniform_full_int    the Philox bits alone (2 x 32 bits per pair of normals): a floor
Prints one JSON object per size.

  python benchmarks/fit_noise_draw.py --step_overlap [--onednn 0|1]

How much of the draw the MLP's DP train step (batch 256, fast clipping) pays: the step with
its real noise against the same step whose `randomness.padded_normal_halves` returns zeros (traced
so, in the same process, called round robin), beside the draw alone. If the step's extra cost
is below the draw's, part of the draw runs alongside the backward pass.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP_LEAVES = [(784, 512), (512,), (512, 10), (10,)]


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", type=int, nargs="+", default=[407050, 26010])
  p.add_argument("--calls", type=int, default=15)
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--onednn", choices=["default", "0", "1"], default="default")
  p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF's default)")
  p.add_argument("--before", default=None, help="git commit whose randomness.py to compare")
  p.add_argument("--only", nargs="+", default=None, help="time only these samplers")
  p.add_argument("--step_overlap", action="store_true", help="the MLP step's share of the draw")
  return p.parse_args()


def _load_before(commit):
  """`tf_dpiter/dp_query/randomness.py` of `commit` as a module of its own."""
  src = subprocess.run(["git", "show", f"{commit}:tf_dpiter/dp_query/randomness.py"],
                       cwd=ROOT, capture_output=True, check=True, text=True).stdout
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("randomness_before", f.name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  os.unlink(f.name)
  return module


def _old_noise(tf, module, generator, leaves, stddev):
  """The add_gaussian_noise of before this change: one draw, tf.split, x sigma, add."""
  sizes = [tf.size(v) for v in leaves]
  noise = module.normal(generator, [tf.add_n(sizes)])
  parts = tf.split(noise, tf.stack(sizes))
  return [v + tf.reshape(part, tf.shape(v)) * stddev for v, part in zip(leaves, parts)]


def _samplers(size, before):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import gaussian_query  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  gen = randomness.make_generator()
  secure = randomness.make_generator(secure=True)
  tf_gen = tf.random.Generator.from_non_deterministic_state(alg="philox")
  leaves = [tf.zeros(s) for s in MLP_LEAVES]
  fns = {"library_normal": lambda: randomness.normal(gen, [size]),
         "library_noise_mlp": lambda: gaussian_query.add_gaussian_noise(gen, leaves, 1.3),
         "library_secure": lambda: randomness.normal(secure, [size]),
         "generator_normal": lambda: tf_gen.normal([size]),
         "uniform_full_int": lambda: tf_gen.uniform_full_int([(size + 1) // 2], tf.int64)}
  if before is not None:
    fns["before_normal"] = lambda: before.normal(gen, [size])
    fns["before_noise_mlp"] = lambda: _old_noise(tf, before, gen, leaves, 1.3)
    fns["before_secure"] = lambda: before.normal(before.make_generator(secure=True), [size])
  return {k: tf.function(f) for k, f in fns.items()}


def _fetch(out):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for t in tf.nest.flatten(out):
    if tf.is_tensor(t):
      t.numpy()


def _time(fns, rounds, calls):
  """Median ms per call of each function, called round robin."""
  times = {k: [] for k in fns}
  for f in fns.values():
    _fetch(f())
    _fetch(f())
  for _ in range(rounds):
    for k, f in fns.items():
      for _ in range(calls):
        t = time.perf_counter()
        _fetch(f())
        times[k].append(1e3 * (time.perf_counter() - t))
  return {k: round(statistics.median(v), 3) for k, v in times.items()}


def _step_overlap(rounds, calls):
  """Median ms of the MLP DP step with real noise, with zero noise, and of the draw alone."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = tf.constant(rng.rand(256, 784).astype("float32"))
  y = tf.constant(rng.randint(0, 10, 256).astype("int32"))

  def model():
    m = dp.keras.DPSequential(dp.keras.example_models.mlp_layers())
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.15, clipping="auto")
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    opt.set_sampling(60000, 256 / 60000, "shuffle", 256)
    m.train_on_batch(x, y)   # traced here
    return lambda: m.train_on_batch(x, y)

  real = model()
  draw = randomness.padded_normal
  halves = randomness.padded_normal_halves
  randomness.padded_normal_halves = lambda g, size, stddev=None: (
      tf.zeros([(size + 1) // 2 + 32]), tf.zeros([(size + 1) // 2 + 32]))
  zero = model()
  randomness.padded_normal_halves = halves
  gen = randomness.make_generator()
  alone = tf.function(lambda: draw(gen, 407050, 1.3))
  ms = _time({"dp_step_real_noise": real, "dp_step_zero_noise": zero, "draw_alone": alone},
             rounds, calls)
  print(json.dumps({"figure": "mlp_dp_step_noise_overlap", "ms": ms,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
                    "load_avg": os.getloadavg()}))


def main():
  a = _parse()
  if a.onednn != "default":
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = a.onednn
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.simplefilter("ignore")
  if a.threads:
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
  if a.step_overlap:
    return _step_overlap(a.rounds, a.calls)
  before = _load_before(a.before) if a.before else None
  for size in a.sizes:
    fns = _samplers(size, before)
    fns = {k: f for k, f in fns.items() if a.only is None or k in a.only}
    ms = _time(fns, a.rounds, a.calls)
    print(json.dumps({"size": size, "calls": a.calls * a.rounds, "tf": tf.__version__,
                      "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
                      "before": a.before, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                      "ms_per_draw": ms,
                      "vs_library_normal": {k: round(v / ms["library_normal"], 3)
                                            for k, v in ms.items() if "library_normal" in ms}}),
          flush=True)


if __name__ == "__main__":
  main()
