"""What the Gaussian noise of a BERT-base DP step costs, stage by stage (issue 42).

  python benchmarks/noise_draw_cost.py [--rounds 5] [--only NAME ...]

Without XLA (TensorFlow's default CPU path), each stage of `randomness.padded_normal_halves`
is its own tf.function, timed on one full draw of `gaussian_query.BLOCK_VALUES` values
(m = BLOCK_VALUES / 2 Box-Muller pairs; inputs held in variables, so nothing is folded at
trace time):
  bits            the Philox words: generator.uniform_full_int([m], int64) (2m 32-bit words)
  unstack         the words [2, m] split into radius and angle words by `tf.unstack` (a copy)
  split           the same by `tf.split` on axis 0 (views of the buffer when m % 16 == 0)
  cast            uint32 -> float32 (m values)
  half_scale      (k + 0.5) * 2^-32 (two passes)
  log             ln of m values
  min             reduce_min over the m buckets (the exact-tail branch's test)
  radius          sqrt(-2 ln U) * sigma (three passes) ...
  radius_folded   ... against sqrt(ln U * (-2 sigma^2)) (two passes)
  angle           cast(h) * 2 pi 2^-32 (two passes)
  cos, sin        one transcendental each over m values
  products        r cos, r sin (two passes)
  add             the noise added into a leaf of 2m values (one pass)
  draw            the whole draw, `randomness.padded_normal_halves(gen, BLOCK_VALUES, 1.3)`
  fill            BERT-base's leaves filled with a value read from a variable (a fresh buffer
                  each, as the step's sum is): the base of the two below
  step_noise      fill, then `gaussian_query.add_gaussian_noise` on the filled leaves (109.5M
                  values, sigma 1.3): the step's whole noise (its draws, slices and additions)
  step_noise_in_place  the same with `gaussian_query.JOIN_BLOCKS` 0 while tracing: every leaf
                  across draws written into its own buffer by TensorStridedSliceUpdate (the
                  code before the leaves' parts were joined)
The functions are called round robin, --rounds times after one warm-up call each; figures are
medians of wall ms and of the process's CPU ms (all threads) per call; the per-block stages
scaled to BERT-base are `x blocks` (109.5M / BLOCK_VALUES). Prints one JSON line last.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

from bert_noise_rate import bert_base_shapes  # noqa: E402
from tf_dpiter.dp_query import gaussian_query  # noqa: E402
from tf_dpiter.dp_query import randomness  # noqa: E402

_TWO_PI_2_32 = 6.283185307179586 * 2.0 ** -32


def stages(shapes):
  """name -> a zero-argument tf.function (the stages in the module docstring)."""
  gen = tf.random.Generator.from_seed(1, alg="philox")
  block = int(gaussian_query.BLOCK_VALUES)
  m = block // 2
  words = tf.Variable(tf.bitcast(gen.uniform_full_int([m], dtype=tf.int64), tf.uint32))
  k = tf.Variable(tf.cast(tf.reshape(words, [-1])[:m], tf.float32))
  u = tf.Variable((k + 0.5) * 2.0 ** -32)
  log_u = tf.Variable(tf.math.log(u))
  theta = tf.Variable(k * _TWO_PI_2_32)
  r = tf.Variable(tf.sqrt(log_u * -2.0))
  leaf = tf.Variable(tf.zeros([block]))
  sigma = tf.constant(1.3)
  fill_value = tf.Variable(0.0)

  def fills():
    return [tf.fill(s, fill_value.read_value()) for s in shapes]

  def step_noise(join_blocks):
    def noised():
      kept = gaussian_query.JOIN_BLOCKS
      gaussian_query.JOIN_BLOCKS = join_blocks
      try:
        out = gaussian_query.add_gaussian_noise(gen, fills(), 1.3)
      finally:
        gaussian_query.JOIN_BLOCKS = kept
      return [t[..., :1] for t in out]
    return noised

  def unstack():
    return tf.unstack(tf.reshape(words, [2, m]))

  def split():
    return [tf.reshape(w, [m]) for w in tf.split(tf.reshape(words, [2, m]), 2, 0)]

  raw = {
      "bits": lambda: gen.uniform_full_int([m], dtype=tf.int64),
      "unstack": unstack,
      "split": split,
      "cast": lambda: tf.cast(tf.reshape(words, [-1])[:m], tf.float32),
      "half_scale": lambda: (k + 0.5) * 2.0 ** -32,
      "log": lambda: tf.math.log(u),
      "min": lambda: tf.reduce_min(k),
      "radius": lambda: tf.sqrt(log_u * -2.0) * sigma,
      "radius_folded": lambda: tf.sqrt(log_u * (-2.0 * sigma * sigma)),
      "angle": lambda: tf.cast(tf.reshape(words, [-1])[m:], tf.float32) * _TWO_PI_2_32,
      "cos": lambda: tf.cos(theta),
      "sin": lambda: tf.sin(theta),
      "products": lambda: (r * theta, r * theta),
      "add": lambda: leaf + leaf,
      "draw": lambda: randomness.padded_normal_halves(gen, block, 1.3),
      "fill": lambda: [t[..., :1] for t in fills()],
      "step_noise": step_noise(gaussian_query.JOIN_BLOCKS),
      "step_noise_in_place": step_noise(0),
  }
  return {name: tf.function(fn, autograph=False) for name, fn in raw.items()}


def _call(fn):
  t, c = time.perf_counter(), time.process_time()
  out = fn()
  tf.nest.map_structure(lambda x: x.numpy().shape if x.shape.rank == 0 else x[:1].numpy(), out)
  return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--only", nargs="+", default=None, help="time only these stages")
  a = p.parse_args()
  shapes = bert_base_shapes()
  n = sum(int(tf.TensorShape(s).num_elements()) for s in shapes)
  fns = {k: v for k, v in stages(shapes).items() if not a.only or k in a.only}
  for fn in fns.values():
    _call(fn)
  times = {name: ([], []) for name in fns}
  for _ in range(a.rounds):
    for name, fn in fns.items():
      wall, cpu = _call(fn)
      times[name][0].append(wall)
      times[name][1].append(cpu)
  blocks = n / gaussian_query.BLOCK_VALUES
  result = {"values": n, "block_values": int(gaussian_query.BLOCK_VALUES),
            "blocks": round(blocks, 2), "rounds": a.rounds, "load": os.getloadavg()[0]}
  for name, (wall, cpu) in times.items():
    result[name] = {"wall_ms": round(statistics.median(wall), 2),
                    "cpu_ms": round(statistics.median(cpu), 2)}
    if not name.startswith(("step_noise", "fill")):
      result[name]["bert_cpu_ms"] = round(statistics.median(cpu) * blocks, 1)
    print(json.dumps({name: result[name]}), flush=True)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
