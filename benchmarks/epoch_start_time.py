"""What each epoch's start costs in `model.fit`, DP against non-private (issue 18).

  python benchmarks/epoch_start_time.py [--model mlp|cnn] [--epochs 8] [--steps 48]
  PYTHONPATH=<older tree> python benchmarks/epoch_start_time.py     # an older tree

One process, one `fit(x, y, batch_size=256, steps_per_epoch=--steps, epochs=--epochs)` call
per configuration, after a warm-up fit (tracing): keras.Sequential + SGD (non-private, Keras'
own shuffled batches) and DPSequential + DPKerasSGDOptimizer (clip 1.0, noise 1.1; Poisson
samples built by fit from the arrays). Per epoch: the time from on_epoch_begin to the end of
the epoch's first step (a new iterator over the data, the first batch, the step) and the
median of the other steps; figures are medians over epochs 2.. (the first epoch also holds
fit's own set-up). Then, outside fit, what a new iterator of each pipeline costs
(`dataset_start_ms`, medians of --epochs fresh iterators): `iter()` and the first element of
the DP pipeline fit builds from arrays without XLA (dp.data.poisson_batches(x, y, 256,
steps_per_epoch=--steps, max_batch_size=None)) and of a plain tf.data array pipeline
(from_tensor_slices(x, y).batch(256).prefetch(2)), and the rest of the DP pipeline's pass
per element. Data: n = 60000 random MNIST-shaped records. Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time
import warnings


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
  p.add_argument("--epochs", type=int, default=8)
  p.add_argument("--steps", type=int, default=48)
  return p.parse_args()


def _timer(keras, steps):
  """A callback recording each epoch's first-step time and its other step times."""

  class EpochStart(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.first, self.other = [], []

    def on_epoch_begin(self, epoch, logs=None):
      self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      now = time.perf_counter()
      if batch == 0:
        self.first.append(now - self._begin)
      else:
        self.other.append(now - self._last)
      self._last = now

  return EpochStart()


def _dataset_start(dp, x, y, a):
  """{pipeline: {"iter": ms, "first": ms, "next": ms per later element}}: medians over
  --epochs fresh iterators, the pipelines alternated."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  pipelines = {
      "dp_poisson": dp.data.poisson_batches(x, y, 256, steps_per_epoch=a.steps,
                                            max_batch_size=None),
      "plain_tf_data": tf.data.Dataset.from_tensor_slices((x, y)).batch(256).prefetch(2)}
  times = {k: ([], [], []) for k in pipelines}
  for _ in range(a.epochs):
    for name, ds in pipelines.items():
      t0 = time.perf_counter()
      it = iter(ds)
      t1 = time.perf_counter()
      next(it)
      t2 = time.perf_counter()
      for _ in range(a.steps - 1):
        next(it)
      t3 = time.perf_counter()
      for column, value in zip(times[name], (t1 - t0, t2 - t1, (t3 - t2) / (a.steps - 1))):
        column.append(1e3 * value)
  return {k: {label: round(statistics.median(v), 2) for label, v in zip(("iter", "first", "next"), t)}
          for k, t in times.items()}


def main():
  a = _parse()
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.rand(60000, *((28, 28, 1) if a.model == "cnn" else (784,))).astype("float32")
  y = rng.randint(0, 10, 60000).astype("int32")
  layers = (dp.keras.example_models.mnist_cnn_layers if a.model == "cnn"
            else dp.keras.example_models.mlp_layers)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  out = {"model": a.model, "tf_dpiter": os.path.dirname(dp.__file__), "epochs": a.epochs,
         "steps": a.steps, "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
  for private in (False, True):
    keras.utils.set_random_seed(0)
    if private:
      m = dp.keras.DPSequential(layers())
      m.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=loss)
    else:
      m = keras.Sequential(layers())
      m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    m.fit(x, y, batch_size=256, steps_per_epoch=a.steps, epochs=1, verbose=0)
    cb = _timer(keras, a.steps)
    m.fit(x, y, batch_size=256, steps_per_epoch=a.steps, epochs=a.epochs, verbose=0,
          callbacks=[cb])
    name = "dp" if private else "nonprivate"
    out[f"{name}_first_step_ms"] = round(1e3 * statistics.median(cb.first[1:]), 2)
    out[f"{name}_first_step_ms_all"] = [round(1e3 * t, 1) for t in cb.first]
    out[f"{name}_other_steps_ms"] = round(1e3 * statistics.median(cb.other), 2)
  out["dataset_start_ms"] = _dataset_start(dp, x, y, a)
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
