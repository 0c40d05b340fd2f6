"""Run in a fresh process: the default Poisson `fit(x, y, batch_size=B)` of a DP model under
tf.distribute.MirroredStrategy on 2 logical CPUs, optionally with jit_compile=True
(tests/keras/test_mirrored_poisson.py). Each run is a fresh model and a 2-epoch fit of 16
Poisson steps; odd sample sizes used to split into unequal replica shards and crash.

Usage: python mirrored_poisson_worker.py RUNS   (runs alternate jit_compile False / True;
prints one RESULT json line per run)
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

cpus = tf.config.list_physical_devices("CPU")
if tf.config.get_logical_device_configuration(cpus[0]) is None:   # once per process
  tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402

warnings.simplefilter("ignore")


def run(strategy, jit):
  rng = np.random.default_rng()
  n, batch = 120, 16
  x = rng.standard_normal((n, 6)).astype("float32")
  y = rng.integers(0, 3, n)
  with strategy.scope():
    model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                   keras.layers.Dense(3)])
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
  model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
  print("RESULT " + json.dumps({
      "jit": jit, "iterations": int(model.optimizer.iterations.numpy()),
      "samples": int(model.optimizer.ledger.sample_count.numpy()),
      "finite": bool(all(np.all(np.isfinite(w)) for w in model.get_weights()))}), flush=True)


def main(runs, strategy=None):
  """`runs` fits; `strategy`: a MirroredStrategy on the 2 CPUs to share (mirrored_jobs_worker)."""
  strategy = strategy or tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  for i in range(runs):
    run(strategy, bool(i % 2))


if __name__ == "__main__":
  main(int(sys.argv[1]))
