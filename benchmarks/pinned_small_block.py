"""A small Dense layer's pinned clipped sums at its own block and at the raised one (session 51).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/pinned_small_block.py [--rounds 15] [--calls 200]

rules/dense._pinned_dense_sums of the MLP's [512, 10] layer (kernel and bias; B = 256 rows the
trace does not know, as in an unpadded Poisson step; inside summation.public_plan(640, 640),
the add/remove step's plan) traced twice as tf.functions:
  own      the block algebra.pinned_block picks for it alone (13 rows: 20 leaves, 6 levels)
  raised   after a [784, 512] kernel's block of 128 was reported (algebra.raised_block: 64)
timed alternately, --calls calls per round (figure: the median over --rounds rounds of wall
and process CPU ms per call, tf.function call included; and the median of the per-round
ratio raised / own). The clip shrink's block, the largest reported, is 128 in a step of both
layers either way. Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--calls", type=int, default=200)
  a = p.parse_args(argv)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import summation  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping import algebra  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping.rules import dense  # pylint: disable=g-import-not-at-top

  rng = np.random.RandomState(0)
  b = 256
  layer = keras.layers.Dense(10)
  layer.build((None, 512))
  args = (tf.constant(rng.randn(b, 512).astype("float32")),
          tf.constant(rng.randn(b, 10).astype("float32")),
          tf.constant(rng.rand(b).astype("float32")))
  spec = [tf.TensorSpec([None, 512]), tf.TensorSpec([None, 10]), tf.TensorSpec([None])]
  blocks = {}

  def make(name, larger):
    @tf.function(input_signature=spec)
    def f(x, dz, c):
      with summation.public_plan(640, 640), algebra.sum_plans() as plans:
        if larger is not None:
          algebra.report_pinned(larger, 128)   # the [784, 512] kernel's block
        out = dense._pinned_dense_sums(layer, x, dz, c, (True, True))  # pylint: disable=protected-access
      blocks[name] = plans[id(layer.kernel)]
      return out
    f(*args)
    return f

  fns = {"own": make("own", None), "raised": make("raised", keras.Variable(0.0))}
  times = {k: [] for k in fns}
  for _ in range(a.rounds):
    for k, f in fns.items():
      t, c = time.perf_counter(), time.process_time()
      for _ in range(a.calls):
        f(*args)
      times[k].append(((time.perf_counter() - t) / a.calls * 1e3,
                       (time.process_time() - c) / a.calls * 1e3))
  ratio = [r[0] / o[0] for r, o in zip(times["raised"], times["own"])]
  print(json.dumps({
      "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "load_avg": os.getloadavg(),
      "blocks": blocks,
      "wall_ms": {k: round(statistics.median(w for w, _ in v), 4) for k, v in times.items()},
      "cpu_ms": {k: round(statistics.median(c for _, c in v), 4) for k, v in times.items()},
      "ratio_wall_raised_own": round(statistics.median(ratio), 3),
      "raised_lower_rounds": sum(q < 1 for q in ratio), "rounds": a.rounds}))


if __name__ == "__main__":
  main()
