"""What the Poisson data pipeline costs, and what two of its settings buy (issue 18).

  python benchmarks/poisson_pipeline_cost.py [--rounds 6] [--steps 400]

One process, MNIST-sized random arrays (n = 60000 rows of 784 float32), expected batch 256,
unpadded samples, settings alternated round robin:
  * per batch: wall and process CPU time to draw and gather `--steps` samples, consumed
    inside TensorFlow (`Dataset.reduce`), with the indices handed to tf.data one step per
    generator call (`INDEX_CHUNK = 1`) or `dp.data.sampling.INDEX_CHUNK` steps per call;
  * per fit call: wall time of `DPSequential.fit(x, y, batch_size=256, steps_per_epoch=8,
    epochs=1)` (the 784-512-10 MLP, clip 1.0, noise 1.1) with `sampling.PIPELINE_OPTIONS`
    (tf.data's default graph rewrites off) or with tf.data's default options (the rewrite
    serializes the captured arrays at the first iterator of every fit).
Figures: medians over rounds (the order of the settings alternates by round). Prints one JSON line.
"""

import argparse
import gc
import json
import os
import statistics
import time
import warnings


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--steps", type=int, default=400)
  return p.parse_args()


def _per_batch(dp, sampling, x, y, chunk, steps):
  """(wall ms, CPU ms) per sample of a Poisson pass with INDEX_CHUNK = chunk."""
  sampling.INDEX_CHUNK = chunk
  ds = dp.data.poisson_batches(x, y, 256, steps_per_epoch=steps, max_batch_size=None)
  ds.reduce(0, lambda a, e: a + 1).numpy()                       # warm-up pass
  t, c = time.perf_counter(), time.process_time()
  ds.reduce(0, lambda a, e: a + 1).numpy()
  return 1e3 * (time.perf_counter() - t) / steps, 1e3 * (time.process_time() - c) / steps


def main():
  a = _parse()
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  from tf_dpiter.data import sampling  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.rand(60000, 784).astype("float32")
  y = rng.randint(0, 10, 60000).astype("int32")
  chunk, options = sampling.INDEX_CHUNK, sampling.PIPELINE_OPTIONS
  model = dp.keras.DPSequential(dp.keras.example_models.mlp_layers())
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=256, steps_per_epoch=8, epochs=1, verbose=0)
  batch = {1: [], chunk: []}
  fit = {"pipeline_options": [], "tf_data_defaults": []}
  settings = [("pipeline_options", options), ("tf_data_defaults", tf.data.Options())]
  for r in range(a.rounds):
    for name, opts in settings[::1 if r % 2 else -1]:      # order alternates by round
      sampling.PIPELINE_OPTIONS = opts
      gc.collect()
      t = time.perf_counter()
      model.fit(x, y, batch_size=256, steps_per_epoch=8, epochs=1, verbose=0)
      fit[name].append(1e3 * (time.perf_counter() - t))
    sampling.PIPELINE_OPTIONS = options
    for k in list(batch)[::1 if r % 2 else -1]:
      batch[k].append(_per_batch(dp, sampling, x, y, k, a.steps))
    sampling.INDEX_CHUNK = chunk
  med = lambda v: round(statistics.median(v), 3)
  out = {"cpus": os.cpu_count(), "steps": a.steps, "rounds": a.rounds,
         "per_batch_ms": {f"index_chunk_{k}": {"wall": med([w for w, _ in v]),
                                               "cpu": med([c for _, c in v])}
                          for k, v in batch.items()},
         "fit_call_ms": {k: med(v) for k, v in fit.items()}}
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
