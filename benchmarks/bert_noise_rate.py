"""The Gaussian noise of one BERT-base DP step on this CPU: the raw draw rates (issue 42).

  python benchmarks/bert_noise_rate.py [--threads 0] [--repeats 3] [--only NAME ...]

Every variant produces noise for BERT-base's 109.5M trainable values (float32) in one
tf.function (jit: `jit_compile=True`), called --repeats times after one warm-up call; figure:
median ms per call. --threads sets TensorFlow's intra-op threads (0: its default, one per
core); run it once per setting (one process each). Variants:
  bits_int64            Philox bits alone: generator.uniform_full_int, N/2 int64 (2 x 32 bits
                        per pair of normals, the library's input): a floor for any exact draw
  stateless_philox      tf.random.stateless_normal([N], alg="philox") (TF's bounded-tail
                        Box-Muller, a speed reference)
  generator_normal      tf.random.Generator(philox).normal([N])
  library_blocks        randomness.padded_normal in blocks of gaussian_query.BLOCK_VALUES,
                        one after the other (the draws of one step, without the additions)
  library_blocks_xla_draw  the same with each draw a jit_compile=True function called from the
                        TensorFlow graph (what compiling only the query's draw would run)
  library_step_noise    gaussian_query.add_gaussian_noise on BERT-base's leaves (zeros, sigma
                        1.3): the step's whole noise (draws, slices, additions, casts)
  pass_axpb             one element-wise pass y = a x + b over N values: the cost of each pass
                        the step makes over the gradients after the draw
  *_jit                 the same under XLA (jit_compile=True)
Prints one JSON object: per variant the median wall ms (NAME_ms), the median process CPU ms
(all threads, NAME_cpu_ms) and N per CPU second (NAME_per_cpu_s: 32-bit words for bits_int64,
values otherwise). --xla-vector-width W: XLA's preferred CPU vector width (XLA_FLAGS) for
the process, e.g. 256 (XLA's default) against 512, one process each.

  python benchmarks/bert_noise_rate.py --average [--repeats 9]

--average: the noised average of BERT-base-shaped sums (d = 4) as the DP step forms it,
called round robin in one process (medians of wall and of the process's CPU ms, all
threads): `folded`, the sums' noise drawn at sigma / d and added (one pass after the draw;
`PrivateStep.folds_denominator`), against `divided`, the noise drawn at sigma, its Box-Muller
halves joined by a copy before they are added, and the noised sum divided by d (the step
before the fold).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from tf_dpiter.dp_query import gaussian_query  # noqa: E402
from tf_dpiter.dp_query import randomness  # noqa: E402


def bert_base_shapes(classes=2):
  """The trainable variables' shapes of a BERT-base classifier (keras_hub's BertBackbone
  from the BERT-base config, pooled output -> Dense(classes)): 109.5M values."""
  h, f, heads, vocab, pos = 768, 3072, 12, 30522, 512
  shapes = [(vocab, h), (pos, h), (2, h), (h,), (h,)]
  for _ in range(12):
    for _ in range(3):   # query, key, value
      shapes += [(h, heads, h // heads), (heads, h // heads)]
    shapes += [(heads, h // heads, h), (h,), (h,), (h,)]   # output, its LayerNorm
    shapes += [(h, f), (f,), (f, h), (h,), (h,), (h,)]     # feed-forward, its LayerNorm
  shapes += [(h, h), (h,), (h, classes), (classes,)]
  return shapes


def _median_ms(fn, repeats):
  """(median wall ms, median process CPU ms) of `repeats` calls after a warm-up call."""
  fn()   # trace and warm up
  times, cpu = [], []
  for _ in range(repeats):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    tf.nest.map_structure(lambda x: x.shape, out)
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def variants(n, shapes):
  """name -> a zero-argument function producing the noise (or pass) for n values."""
  gen = tf.random.Generator.from_seed(1, alg="philox")
  seed = tf.constant([1, 2], tf.int32)
  x = tf.Variable(tf.zeros([n]))
  zeros = [tf.Variable(tf.zeros(s)) for s in shapes]
  block = int(gaussian_query.BLOCK_VALUES)

  def blocks():
    out, previous = [], []
    for start in range(0, n, block):
      with tf.control_dependencies(previous):
        z = randomness.padded_normal(gen, min(block, n - start), 1.3)
      previous = [z]
      out.append(z[0])
    return tf.stack(out)

  xla_draw = tf.function(lambda: randomness.padded_normal(gen, block, 1.3), autograph=False,
                         jit_compile=True)

  def blocks_xla_draw():
    out, previous = [], []
    for start in range(0, n, block):
      with tf.control_dependencies(previous):
        z = (xla_draw() if n - start >= block
             else randomness.padded_normal(gen, n - start, 1.3))
      previous = [z]
      out.append(z[0])
    return tf.stack(out)

  def step_noise():
    noised = gaussian_query.add_gaussian_noise(gen, [v.read_value() for v in zeros], 1.3)
    return [t[..., :1] for t in noised]

  raw = {
      "bits_int64": lambda: gen.uniform_full_int([n // 2], dtype=tf.int64),
      "stateless_philox": lambda: tf.random.stateless_normal([n], seed, alg="philox"),
      "generator_normal": lambda: gen.normal([n]),
      "library_blocks": blocks,
      "library_blocks_xla_draw": blocks_xla_draw,
      "library_step_noise": step_noise,
      "pass_axpb": lambda: x * 0.25 + 1.3,
  }
  out = {}
  for name, fn in raw.items():
    out[name] = tf.function(fn, autograph=False)
    if name not in ("library_step_noise", "library_blocks_xla_draw"):
      out[name + "_jit"] = tf.function(fn, autograph=False, jit_compile=True)
  return out


def average(repeats):
  """--average: folded against divided (module docstring); one JSON line."""
  shapes = bert_base_shapes()
  gen = tf.random.Generator.from_seed(1, alg="philox")
  # fresh sums in each call (one fill pass, alike in both): the noise writes into their buffers
  sums = lambda: [tf.fill(s, 1.0) for s in shapes]  # noqa: E731
  d, sigma = 4.0, 1.3
  halves = randomness.padded_normal_halves

  def joined(generator, size, stddev=None):
    z = tf.concat(halves(generator, size, stddev), 0)
    m = z.shape[0] // 2
    return z[:m], z[m:]

  folded = tf.function(lambda: gaussian_query.add_gaussian_noise(gen, sums(), sigma / d),
                       autograph=False)

  def divided_fn():
    noised = gaussian_query.add_gaussian_noise(gen, sums(), sigma)
    return [t / d for t in noised]

  divided = tf.function(divided_fn, autograph=False)
  randomness.padded_normal_halves = joined
  try:
    divided.get_concrete_function()   # traced with the halves joined (the draw before)
  finally:
    randomness.padded_normal_halves = halves
  parts = {"folded": folded, "divided": divided}
  wall = {k: [] for k in parts}
  cpu = {k: [] for k in parts}
  for r in range(repeats + 1):
    for name, fn in parts.items():
      t, c = time.perf_counter(), time.process_time()
      out = fn()
      tf.nest.map_structure(lambda x: x.shape, out)
      if r:
        wall[name].append(1e3 * (time.perf_counter() - t))
        cpu[name].append(1e3 * (time.process_time() - c))
  med = lambda v: round(statistics.median(v), 1)  # noqa: E731
  print(json.dumps({"noised_average_ms": {k: med(v) for k, v in wall.items()},
                    "noised_average_cpu_ms": {k: med(v) for k, v in cpu.items()},
                    "repeats": repeats, "load_avg": os.getloadavg()}), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF's default)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--only", nargs="+", default=None, help="time only these variants")
  p.add_argument("--average", action="store_true",
                 help="the noised average, folded against divided (module docstring)")
  p.add_argument("--xla-vector-width", type=int, default=0,
                 help="XLA's preferred CPU vector width in bits (0: XLA_FLAGS left alone)")
  a = p.parse_args()
  if a.xla_vector_width:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_cpu_prefer_vector_width")]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_cpu_prefer_vector_width={a.xla_vector_width}"])
  if a.average:
    return average(a.repeats)
  if a.threads:
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
  shapes = bert_base_shapes()
  n = sum(int(tf.TensorShape(s).num_elements()) for s in shapes)
  result = {"values": n, "threads": a.threads, "block_values": int(gaussian_query.BLOCK_VALUES)}
  for name, fn in variants(n, shapes).items():
    if a.only and name not in a.only:
      continue
    wall, cpu = _median_ms(fn, a.repeats)
    result[name + "_ms"], result[name + "_cpu_ms"] = round(wall, 1), round(cpu, 1)
    # 32-bit words (bits_int64) or values per CPU second: N per call
    result[name + "_per_cpu_s"] = round(n / (cpu / 1e3)) if cpu else None
    print(json.dumps({name: result[name + "_ms"], "cpu_ms": result[name + "_cpu_ms"]}),
          flush=True)
  result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  result["load_avg"] = os.getloadavg()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
