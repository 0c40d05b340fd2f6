"""CPU time of two forms of a Dense layer's clipped sum at BERT-base's shapes (issue 42).

  python benchmarks/dense_sum_forms.py [--seq 128] [--rounds 9]

sum_i c_i g_i of a Dense layer with kernel and bias trained, on x [B, T, K], dz [B, T, N]
(B = 4; (K, N) = (768, 768), (768, 3072), (3072, 768): BERT-base's projections and its
feed-forward pair), the smaller operand weighted by the clip factors, the other's dropped
rows zeroed (algebra.weight_rows / drop_rows, as the rule forms them):
  folded:  the bias as the weight of an input 1: einsum("btk,btn->kn") on [x, 1] (K + 1
           rows) and dz, split into the kernel's K rows and the bias's last row (the rule
           before 2026-11-29);
  matmul:  the kernel as one matrix product of the [B T, K] and [B T, N] rows, the bias a
           reduction of the weighted output gradient (rules/dense.py `_dense_sums` now);
  nonprivate: x^T dz and the sum of dz, unweighted (what a non-private step computes).
Each form runs 4 times per shape in one tf.function; the forms are called round robin
(--rounds timed rounds after one untimed), and the medians of the process CPU ms (all
threads) are printed with the largest difference between the folded and matmul sums.
Prints one JSON line.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SHAPES = [(768, 768), (768, 3072), (3072, 768)]


def _rows(f, t):
  return tf.reshape(f, [-1] + [1] * (t.shape.rank - 1))


def _operands(x, dz, c):
  """(x, dz) with the smaller weighted by c and the other's rows of c = 0 zeroed."""
  if x.shape[-1] <= dz.shape[-1]:
    return (tf.math.multiply_no_nan(x, _rows(c, x)),
            tf.math.multiply_no_nan(dz, _rows(tf.sign(c), dz)))
  return (tf.math.multiply_no_nan(x, _rows(tf.sign(c), x)),
          tf.math.multiply_no_nan(dz, _rows(c, dz)))


def folded(x, dz, c):
  b, t, k = x.shape
  x1 = tf.concat([x, tf.ones([b, t, 1])], -1)
  xw, dw = _operands(x1, dz, c)
  return tf.split(tf.einsum("btk,btn->kn", xw, dw), [k, 1], 0)


def matmul(x, dz, c):
  k, n = x.shape[-1], dz.shape[-1]
  xw, dw = _operands(x, dz, c)
  kernel = tf.matmul(tf.reshape(xw, [-1, k]), tf.reshape(dw, [-1, n]), transpose_a=True)
  if k > n:   # dz carries the factors
    return kernel, tf.reduce_sum(dw, [0, 1])[None]
  return kernel, tf.matmul(c[None], tf.reduce_sum(dw, 1))


def nonprivate(x, dz, c):
  del c
  k, n = x.shape[-1], dz.shape[-1]
  return (tf.matmul(tf.reshape(x, [-1, k]), tf.reshape(dz, [-1, n]), transpose_a=True),
          tf.reduce_sum(dz, [0, 1]))


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--rounds", type=int, default=9)
  a = p.parse_args()
  rng = np.random.RandomState(0)
  data = [(tf.constant(rng.randn(4, a.seq, k).astype("float32")),
           tf.constant(rng.randn(4, a.seq, n).astype("float32"))) for k, n in SHAPES]
  c = tf.constant([0.5, 1.0, 0.0, 0.7], tf.float32)
  forms = {f.__name__: tf.function(lambda f=f: [f(x, dz, c) for x, dz in data for _ in range(4)])
           for f in (folded, matmul, nonprivate)}
  diff = max(float(tf.reduce_max(tf.abs(tf.reshape(u, [-1]) - tf.reshape(v, [-1]))))
             for pu, pv in zip(forms["folded"](), forms["matmul"]()) for u, v in zip(pu, pv))
  cpu = {k: [] for k in forms}
  for r in range(1 + a.rounds):
    for name, fn in forms.items():
      c0 = time.process_time()
      tf.nest.map_structure(lambda t: t.numpy(), fn())
      if r:
        cpu[name].append(1e3 * (time.process_time() - c0))
  med = {k: round(float(np.median(v)), 1) for k, v in cpu.items()}
  print(json.dumps({"seq": a.seq, "cpu_ms": med,
                    "matmul_over_folded": round(med["matmul"] / med["folded"], 3),
                    "max_abs_diff": diff, "load_avg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
  main()
