"""The clip-weighted sum of kept per-example gradients, sum_i c_i g_i, three ways (issue 25).

  python benchmarks/xla_factor_product.py [--shapes 64x256x128,64x128x128,256x800x10]
      [--calls 50] [--rounds 5]

Fast clipping keeps a layer's per-example gradients g [R, K, N] when they are small or were
computed anyway (the direct norm form) and sums them weighted by the clip factors c [R].
For each shape R x K x N, one process times, with and without XLA (jit_compile=True and a
plain tf.function; figure: the median over --rounds of the mean wall ms over --calls calls):

  one_row      tf.tensordot(c, g, 1): a one-row (matrix-vector) product
  two_row      algebra.factor_product: row 0 of [c; 0] times g as [R, K N]
  weighted_sum reduce_sum(c_i g_i, axis 0): an elementwise product and a reduction

and checks that the three agree. Prints one JSON object per shape.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="64x256x128,64x128x128,256x800x10")
  p.add_argument("--calls", type=int, default=50)
  p.add_argument("--rounds", type=int, default=5)
  return p.parse_args(argv)


def _forms():
  return {
      "one_row": lambda c, g: tf.tensordot(c, g, axes=1),
      "two_row": algebra.factor_product,
      "weighted_sum": lambda c, g: tf.reduce_sum(g * c[:, None, None], axis=0),
  }


def _time(fn, args, calls, rounds):
  fn(*args).numpy()
  out = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      result = fn(*args)
    result.numpy()
    out.append((time.perf_counter() - start) / calls * 1e3)
  return round(statistics.median(out), 3)


def main(argv=None):
  a = _parse(argv)
  for spec in a.shapes.split(","):
    r, k, n = (int(v) for v in spec.split("x"))
    rng = np.random.default_rng(0)
    g = tf.constant(rng.standard_normal((r, k, n)), tf.float32)
    c = tf.constant(rng.uniform(0, 1, r), tf.float32)
    ms, sums = {}, {}
    for jit in (True, False):
      for name, form in _forms().items():
        fn = tf.function(form, jit_compile=jit)
        key = f"{name}_{'xla' if jit else 'tf'}"
        sums[key] = fn(c, g).numpy()
        ms[key] = _time(fn, (c, g), a.calls, a.rounds)
    ref = sums["weighted_sum_tf"]
    for key, value in sums.items():
      np.testing.assert_allclose(value, ref, rtol=1e-4, atol=1e-4, err_msg=key)
    print(json.dumps({"shape": [r, k, n], "ms": ms, "load_avg": os.getloadavg()[0],
                      "tf": tf.__version__}), flush=True)


if __name__ == "__main__":
  main()
