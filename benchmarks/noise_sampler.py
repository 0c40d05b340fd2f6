"""Issue 12: the Gaussian sampler's tail and speed.

Prints (1) the median time of one `randomness.normal` draw of 407,050 values (the MLP's
gradient size) in a tf.function, beside TF's own `Generator.normal` and secure mode; (2) for the settings
below, the largest |z| the sampler can reach and the delta floor a bound B would imply,
T q P(Z > B - 1/z) (the record's shift is 1/z standard deviations; McMahan et al. 2018 Section 8).
The sampler in use has no bound (`randomness.exponential` is exact in the tail), so its
floor is 0; the old one stopped at sqrt(2 * 33 ln 2) = 6.764.

  python benchmarks/noise_sampler.py [--repeats 50]
"""

import argparse
import json
import math
import time

from scipy import stats
import tensorflow as tf

from tf_dpiter.dp_query import randomness

SETTINGS = [  # name, n, batch, z, epochs
    ("MNIST tutorial (full)", 60000, 256, 1.1, 60),
    ("MNIST tutorial (quick)", 60000, 256, 1.1, 2),
    ("z=0.5, 10 epochs", 60000, 256, 0.5, 10),
    ("issue 12 example z=0.6, 60 epochs", 60000, 256, 0.6, 60),
]
OLD_BOUND = math.sqrt(2 * 33 * math.log(2))


def _median_ms(fn, repeats):
  fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn().numpy()
    times.append(time.perf_counter() - t)
  return sorted(times)[len(times) // 2] * 1e3


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--size", type=int, default=407050)
  a = p.parse_args()
  gen = tf.random.Generator.from_non_deterministic_state(alg="philox")
  ours = tf.function(lambda: randomness.normal(gen, [a.size]))
  tfs = tf.function(lambda: gen.normal([a.size]))
  secure_src = randomness.make_generator(secure=True)
  secure = tf.function(lambda: randomness.normal(secure_src, [a.size]))
  print(json.dumps({"figure": "noise_draw_ms", "size": a.size,
                    "randomness.normal": round(_median_ms(ours, a.repeats), 3),
                    "tf.random.Generator.normal": round(_median_ms(tfs, a.repeats), 3),
                    "secure_mode": round(_median_ms(secure, a.repeats), 3)}))
  for name, n, b, z, epochs in SETTINGS:
    steps = math.ceil(epochs * n / b)
    floor = steps * (b / n) * stats.norm.sf(OLD_BOUND - 1.0 / z)
    print(json.dumps({"figure": "truncation_delta_floor", "setting": name, "steps": steps,
                      "old_bound": round(OLD_BOUND, 3), "old_floor": float(f"{floor:.3g}"),
                      "new_bound": "none", "new_floor": 0.0}))


if __name__ == "__main__":
  main()
