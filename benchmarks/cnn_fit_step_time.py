"""Steady-state ms/step through model.fit, non-private vs DP, one process (issue 18).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/cnn_fit_step_time.py --model cnn
  PYTHONPATH=<older tree> python benchmarks/cnn_fit_step_time.py   # an older tree's DP step

Random 28x28x1 (cnn) or 784 (mlp) inputs, batch 256, Poisson sampling for the DP model.
Each model runs --epochs epochs of --steps steps; the figure is the median interval
between consecutive on_train_batch_end calls after the first --skip intervals (so tracing
and warm-up are excluded). Prints one JSON line with both figures and their ratio.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import keras

import tf_dpiter as dp


class _Intervals(keras.callbacks.Callback):
  """Wall time between consecutive train batches within each epoch."""

  def __init__(self):
    super().__init__()
    self.times, self.last = [], None

  def on_epoch_begin(self, epoch, logs=None):
    self.last = None

  def on_train_batch_end(self, batch, logs=None):
    now = time.perf_counter()
    if self.last is not None:
      self.times.append(now - self.last)
    self.last = now


def run(name, private, x, y, args):
  """Median ms/step of one fit."""
  keras.utils.set_random_seed(0)
  ex = dp.keras.example_models
  layers = ex.mnist_cnn_layers() if name == "cnn" else ex.mlp_layers()
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if private:
    model = dp.keras.DPSequential(layers)
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                  loss=loss)
    kwargs = {"sampling": "poisson"}
  else:
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    kwargs = {}
  cb = _Intervals()
  model.fit(x, y, batch_size=args.batch, epochs=args.epochs, steps_per_epoch=args.steps,
            verbose=0, callbacks=[cb], **kwargs)
  return 1e3 * statistics.median(cb.times[args.skip:])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--skip", type=int, default=50)
  args = p.parse_args()
  rng = np.random.RandomState(0)
  n = 60000
  shape = (28, 28, 1) if args.model == "cnn" else (784,)
  x = rng.rand(n, *shape).astype("float32")
  y = rng.randint(0, 10, n).astype("int32")
  nonprivate = run(args.model, False, x, y, args)
  private = run(args.model, True, x, y, args)
  print(json.dumps({"model": args.model, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "tree": os.path.dirname(os.path.dirname(dp.__file__)),
                    "nonprivate_ms": round(nonprivate, 2), "dp_ms": round(private, 2),
                    "ratio": round(private / nonprivate, 3)}))


if __name__ == "__main__":
  main()
