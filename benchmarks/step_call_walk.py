"""The call walk of one batch through DP fit's step: calls, files, returns to a file left.

Runs one `train_on_batch` of a small DP model eagerly (`run_eagerly=True`, so the step's
Python runs as it would be traced) under `sys.setprofile`, keeps the Python calls whose code
lives in the `tf_dpiter` package, and prints:

  calls    the number of tf_dpiter function calls made by the step;
  files    the distinct tf_dpiter files those calls run in;
  returns  the times control comes back to a tf_dpiter file it had left for another
           tf_dpiter file (A -> B -> A counts one): how often the step's logic is split
           across files that call each other back and forth.

The walk starts at the first tf_dpiter frame and covers the whole step: the per-record
clipped sum, the noise, the ledger write and the optimizer update. `--entry` says where the
step is entered: `train_on_batch` (the default; the DP model's `train_on_batch`, with its
per-call guards: the restored-ledger check, the replica check, the eager build) or
`train_function` (the call `fit` makes for each batch: Keras' train function on one
(x, y, sample_weight) batch, as `train_on_batch` hands it over).

Run from a checkout's root (it measures the tf_dpiter that checkout holds):
  python -m benchmarks.step_call_walk [--clipping fast|vectorized]
      [--entry train_on_batch|train_function] [--files] [--sequence]
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import tf_dpiter as dp  # pylint: disable=g-import-not-at-top

PKG = os.path.dirname(os.path.abspath(dp.__file__))


def walk(clipping, entry="train_on_batch"):
  """(list of (file, function) calls) of one steady DP step entered at `entry` (module
  docstring)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, clipping=clipping)
  model.compile(optimizer=opt, run_eagerly=True,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randn(8, 6).astype("float32"), rng.randint(0, 3, 8)
  model.optimizer.set_sampling(64, 8 / 64, "poisson", 8)
  model.train_on_batch(x, y)   # build and warm up: the walk is of a steady step
  calls = []

  def profiler(frame, event, arg):  # pylint: disable=unused-argument
    if event == "call":
      f = frame.f_code.co_filename
      if f.startswith(PKG):
        calls.append((os.path.relpath(f, PKG), frame.f_code.co_name))

  sys.setprofile(profiler)
  try:
    if entry == "train_function":
      # as inside fit, which takes the weights' fingerprints around its loop, not per step
      opt._dp_fingerprints_deferred = True  # pylint: disable=protected-access
      try:
        model.train_function(iter([(x, y, None)]))
      finally:
        opt._dp_fingerprints_deferred = False  # pylint: disable=protected-access
    else:
      model.train_on_batch(x, y)
  finally:
    sys.setprofile(None)
  return calls


def summarize(calls):
  """{'calls', 'files', 'returns'} of a call list (see the module docstring)."""
  left, returns, prev = set(), 0, None
  for f, _ in calls:
    if prev is not None and f != prev:
      left.add(prev)
      if f in left:
        returns += 1
    prev = f
  return {"calls": len(calls), "files": len({f for f, _ in calls}), "returns": returns}


def stays(calls):
  """[(file, [function names])]: the walk cut where control moves to another file."""
  out = []
  for f, name in calls:
    if out and out[-1][0] == f:
      out[-1][1].append(name)
    else:
      out.append((f, [name]))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--clipping", default="fast", choices=("fast", "vectorized"))
  ap.add_argument("--entry", default="train_on_batch",
                  choices=("train_on_batch", "train_function"),
                  help="where the step is entered (module docstring)")
  ap.add_argument("--files", action="store_true", help="also list the files and their calls")
  ap.add_argument("--sequence", action="store_true",
                  help="also print the walk in order, one line per stay in a file")
  args = ap.parse_args()
  calls = walk(args.clipping, args.entry)
  print(args.clipping, args.entry, summarize(calls))
  if args.files:
    counts = {}
    for f, _ in calls:
      counts[f] = counts.get(f, 0) + 1
    for f, n in sorted(counts.items(), key=lambda kv: -kv[1]):
      print(f"  {n:5d}  {f}")
  if args.sequence:
    for f, names in stays(calls):
      print(f"  {f}: {' '.join(names)}")


if __name__ == "__main__":
  main()
