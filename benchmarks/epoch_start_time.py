"""What each epoch's start costs in `model.fit`, DP against non-private, phase by phase (issues 18, 42).

  python benchmarks/epoch_start_time.py [--model mlp|cnn] [--epochs 8] [--steps 48] [--calls 6]
  PYTHONPATH=<older tree> python benchmarks/epoch_start_time.py     # an older tree

One process; keras.Sequential + SGD (non-private, Keras' own shuffled batches) and
DPSequential + DPKerasSGDOptimizer (clip 1.0, noise 1.1; Poisson samples built by fit from
the arrays), batch_size=256, steps_per_epoch=--steps, after a warm-up fit (tracing). Two ways
to run epochs, each timed phase by phase from callback hooks (medians; ms):

* `epochs`: one fit(epochs=--epochs) call; epochs 2.. (the first holds fit's own set-up).
* `calls`: --calls fit(epochs=1) calls, what benchmarks/fit_step_time.py times (one epoch per
  round); `setup` is the fit call up to on_train_begin (fit's pipeline building: a DP fit
  on arrays builds its sampler's dataset here).

Phases: `start` on_epoch_begin -> on_train_batch_begin(0): Keras takes the epoch's iterator
(a new one when the last epoch's ended; rebinding its loop variable drops the old one, whose
teardown runs here); `first_step` the first step, which waits for the iterator's first
element (a new iterator: its generator starts, the first chunk of indices is drawn, the rows
gathered); `end` last on_train_batch_end -> on_epoch_end (Keras makes the next epoch's
iterator here when this one's cardinality is used up, and waits for pending ops); `steady`
the median interval between consecutive steps. `epoch_extra` = start + first_step + end -
steady: what the epoch's boundary adds over one steady step.

Then, outside fit, what one iterator of each pipeline costs (`dataset_start_ms`, medians of
--epochs fresh iterators, the pipelines alternated): `iter()`, the first element, each later
element (`next`), and dropping the iterator after --steps elements (`del`), for the DP
pipeline of a user's dataset (dp.data.poisson_batches(x, y, 256, steps_per_epoch=--steps,
max_batch_size=None): one iterator per epoch), and a plain tf.data array pipeline
(from_tensor_slices(x, y).batch(256).take(--steps).prefetch(2)). Data: n = 60000 random
MNIST-shaped records. Prints one JSON line.
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
  p.add_argument("--calls", type=int, default=6)
  return p.parse_args()


def _phases(keras):
  """A callback recording, per epoch, the phases of the module docstring (seconds)."""

  class Phases(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.called = None
      self.rows = []

    def on_train_begin(self, logs=None):
      self._train_begin = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
      self._row = {"setup": (self._train_begin - self.called) if self.called else None,
                   "steps": []}
      self._begin = time.perf_counter()
      self.called = None

    def on_train_batch_begin(self, batch, logs=None):
      if batch == 0:
        self._row["start"] = time.perf_counter() - self._begin

    def on_train_batch_end(self, batch, logs=None):
      self._row["steps"].append(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
      steps = self._row.pop("steps")
      row = self._row
      row["first_step"] = steps[0] - self._begin - row["start"]
      row["end"] = time.perf_counter() - steps[-1]
      row["steady"] = statistics.median(b - a for a, b in zip(steps, steps[1:]))
      row["epoch_extra"] = row["start"] + row["first_step"] + row["end"] - row["steady"]
      self.rows.append(row)

  return Phases()


def _medians(rows):
  """{phase: median ms} over the rows (phases absent or None left out)."""
  keys = [k for k in rows[0] if rows[0][k] is not None]
  return {k: round(1e3 * statistics.median(r[k] for r in rows), 2) for k in keys}


def _dataset_start(dp, x, y, a):
  """{pipeline: {"iter", "first", "next", "del": ms}}: medians over --epochs fresh
  iterators, the pipelines alternated."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  pipelines = {
      "dp_poisson": dp.data.poisson_batches(x, y, 256, steps_per_epoch=a.steps,
                                            max_batch_size=None),
      "plain_tf_data": tf.data.Dataset.from_tensor_slices((x, y)).batch(256).take(
          a.steps).prefetch(2)}
  labels = ("iter", "first", "next", "del")
  times = {k: {label: [] for label in labels} for k in pipelines}
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
      del it
      t4 = time.perf_counter()
      for label, value in zip(labels, (t1 - t0, t2 - t1, (t3 - t2) / (a.steps - 1), t4 - t3)):
        times[name][label].append(1e3 * value)
  return {k: {label: round(statistics.median(v), 2) for label, v in t.items()}
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
         "steps": a.steps, "calls": a.calls, "cpus": os.cpu_count(),
         "load_avg_start": os.getloadavg()}
  models = {}
  for private in (False, True):
    keras.utils.set_random_seed(0)
    if private:
      m = dp.keras.DPSequential(layers())
      m.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=loss)
    else:
      m = keras.Sequential(layers())
      m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    m.fit(x, y, batch_size=256, steps_per_epoch=a.steps, epochs=1, verbose=0)
    models["dp" if private else "nonprivate"] = m
  fit = lambda m, epochs, cb: m.fit(x, y, batch_size=256, steps_per_epoch=a.steps,
                                    epochs=epochs, verbose=0, callbacks=[cb])
  for name, m in models.items():          # one fit of --epochs epochs each
    cb = _phases(keras)
    fit(m, a.epochs, cb)
    out[f"{name}_epochs"] = _medians(cb.rows[1:])
  cbs = {name: _phases(keras) for name in models}
  for _ in range(a.calls):                # one epoch per fit call, alternated
    for name, m in models.items():
      cbs[name].called = time.perf_counter()
      fit(m, 1, cbs[name])
  for name in models:
    out[f"{name}_calls"] = _medians(cbs[name].rows)
  out["dataset_start_ms"] = _dataset_start(dp, x, y, a)
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
