"""Step time of the real DP train step under dtype policies (issue 12, item 2).

The MNIST tutorial CNN (tf_dpiter.keras.example_models.mnist_cnn_layers), batch 256,
DPKerasSGDOptimizer(C=1.0, z=1.1): `model.train_on_batch` of a DPSequential (clipping,
noise, ledger and update), median ms/step, under float32 and mixed_bfloat16, for
  * clipping="fast"        (after: the ghost-norm path, float32 privacy arithmetic),
  * clipping="vectorized"  (before: where "auto" sent 16-bit policies until issue 12),
  * the non-private keras.Sequential step (same layers, SGD).
All configurations run in one process, interleaved round by round, so their ratios are
comparable on a shared machine.

  python benchmarks/fast_clipping_dtype.py --steps 20 --warmup 3 --rounds 3
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np

import tf_dpiter as dp
from tf_dpiter.keras import example_models

BATCH = 256


def make_step(layers_fn, clipping, loss, n, batch):
  """train_on_batch closure of a fresh model: DP with `clipping`, or non-private (None)."""
  keras.utils.set_random_seed(0)
  if clipping is None:
    model = keras.Sequential(layers_fn())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
  else:
    model = dp.keras.DPSequential(layers_fn())
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, clipping=clipping)
    model.compile(optimizer=opt, loss=loss)
    opt.set_sampling(n, batch / n, "poisson")
  return model


def time_steps(models, x, y, steps, warmup, rounds):
  """{name: median ms/step} over `rounds` interleaved rounds of `steps` timed steps."""
  times = {name: [] for name in models}
  for name, model in models.items():
    for _ in range(warmup):
      model.train_on_batch(x, y)
  for _ in range(rounds):
    for name, model in models.items():
      for _ in range(steps):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        times[name].append(1e3 * (time.perf_counter() - t0))
  return {name: statistics.median(t) for name, t in times.items()}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--rounds", type=int, default=3)
  args = p.parse_args()
  rng = np.random.default_rng(0)
  x = rng.random((BATCH, 28, 28, 1), np.float32)
  y = rng.integers(0, 10, BATCH).astype(np.int32)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  results = {}
  for policy in ("float32", "mixed_bfloat16"):
    keras.config.set_dtype_policy(policy)
    models = {}
    for clipping in ("fast", "vectorized", None):
      model = make_step(example_models.mnist_cnn_layers, clipping, loss, 60000, BATCH)
      if clipping is not None:
        assert model.optimizer.resolve_clipping(model) == clipping
      models[clipping or "non_private"] = model
    ms = time_steps(models, x, y, args.steps, args.warmup, args.rounds)
    results[policy] = {k: round(v, 2) for k, v in ms.items()}
    results[policy]["fast_over_non_private"] = round(ms["fast"] / ms["non_private"], 2)
    results[policy]["vectorized_over_fast"] = round(ms["vectorized"] / ms["fast"], 2)
    print(policy, json.dumps(results[policy]), flush=True)
  keras.config.set_dtype_policy("float32")
  print(json.dumps(results))


if __name__ == "__main__":
  main()
