"""What an unknown batch dimension costs the DP fit step of the tutorial CNN (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/unknown_batch_dim_cost.py [--rounds 3] [--steps 32]

Poisson samples have a private size, so fit's step is traced with an unknown batch dimension;
a fixed batch is traced with a static one. This separates that cost from the pipeline's and
from the varying sizes: two DP models of the tutorial CNN (clip 1.0, noise 1.1, the default
fast clipping, sampling declared by `set_sampling(n, B / n, "shuffle", B)`), fitted on the same
`--steps` batches of exactly B = 256 random MNIST-shaped rows, one dataset batched with
`drop_remainder=True` (the batch dimension static: 256) and one without (unknown: None), in
one process, alternated round robin after a warm-up epoch each. Figure: median over `--rounds`
of the epoch's wall time / steps (ms), and the process CPU time / steps. Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import tf_dpiter as dp  # pylint: disable=g-import-not-at-top

N, B = 60000, 256


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
      keras.layers.MaxPool2D(2, 1),
      keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
      keras.layers.MaxPool2D(2, 1), keras.layers.Flatten(),
      keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.optimizer.set_sampling(N, B / N, "shuffle", B)
  return model


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=32)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  rng = np.random.default_rng(0)
  x = rng.random((B * a.steps, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 10, B * a.steps)
  data = {name: tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=static)
          for name, static in (("static", True), ("unknown", False))}
  models = {name: _model() for name in data}
  for name, model in models.items():   # warm-up: the trace
    model.fit(data[name], epochs=1, verbose=0)
  wall, cpu = {k: [] for k in data}, {k: [] for k in data}
  load_start = os.getloadavg()
  for _ in range(a.rounds):
    for name, model in models.items():
      t, c = time.perf_counter(), time.process_time()
      model.fit(data[name], epochs=1, verbose=0)
      wall[name].append((time.perf_counter() - t) / a.steps * 1e3)
      cpu[name].append((time.process_time() - c) / a.steps * 1e3)
  med = lambda d: {k: round(statistics.median(v), 2) for k, v in d.items()}
  print(json.dumps({"batch": B, "steps": a.steps, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "wall_ms_per_step": med(wall), "cpu_ms_per_step": med(cpu)}), flush=True)


if __name__ == "__main__":
  main()
