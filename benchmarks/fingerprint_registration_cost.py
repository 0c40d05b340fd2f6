"""What registering a DP run's released weights costs (`keras.optimizer.weight_fingerprints`),
before and after a change of the library: a DP MLP Input(784) -> Dense(512) -> Dense(10)
(407,050 weights: a [784, 512] kernel digested by a compiled program, the rest on the host),
DP SGD (C = 1, z = 1, noise from OS entropy, so its released states are registered).

  python benchmarks/fingerprint_registration_cost.py --before-rev HEAD~1 [--rounds 6]
      [--calls 30] [--batch 32]

Each round runs one child process per library tree, alternated (before, after, before, ...):
the `--before-rev` revision's tf_dpiter (git archive into a temporary folder) and this
checkout's. Each child builds the model once and prints the median over --calls calls (after
3 warm-up calls) of the wall ms of:
  train_on_batch   a DP model's train_on_batch (its check, update and record: one
                   registration a call);
  registration     weight_fingerprints.record after an emulated private step (every weight
                   written in place, the private-update count moved): one registration;
  get_weights      the DP model's get_weights after an emulated private step (its
                   register_read registers the values it hands out);
  first_record     a run's first record of the model's weights (their records dropped first:
                   the lookup of values a DP run released, and the start's digests).
Prints, per figure, the median over rounds of each tree's medians and the difference, as one
JSON line (and a table).

  python benchmarks/fingerprint_registration_cost.py --in-process [--rounds 10] [--calls 20]

alternates in ONE process (this checkout's library) blocks of --calls calls with the invariant
keys computed and with them left out (`_digests_and_keys` called with want=None: the exact
digests only, as before the keys), for train_on_batch and a registration: the keys' own cost,
free of the differences between processes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FIGURES = ("train_on_batch", "registration", "get_weights", "first_record")


def _median_ms(fn, calls, prepare=None):
  """Median wall ms of `calls` calls of fn (prepare() untimed before each), after 3."""
  times = []
  for i in range(calls + 3):
    if prepare is not None:
      prepare()
    start = time.perf_counter()
    fn()
    if i >= 3:
      times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def _mlp(batch):
  """The DP MLP, its optimizer, a batch (x, y), the private-update count, the checked
  variables, an emulated private step (every weight written in place, the count moved) and the
  weight_fingerprints module (imported here: the library on sys.path)."""
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import weight_fingerprints as wf  # pylint: disable=g-import-not-at-top,line-too-long

  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((784,)), keras.layers.Dense(512, "relu"),
                                 keras.layers.Dense(10)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  opt = model.optimizer
  opt.set_sampling(60000, batch / 60000, "poisson", batch)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, 784)).astype(np.float32)
  y = rng.integers(0, 10, size=(batch,)).astype(np.int32)
  used = opt.private_step._used_results  # pylint: disable=protected-access

  def step():
    for w in model.trainable_variables:
      w.assign_sub(w * 1e-6)
    opt.iterations.assign_add(1)
    used.assign_add(1)

  return model, opt, (x, y), wf.checked_variables(model), step, wf


def child(calls, batch):
  """One tree's figures (the library on sys.path), printed as one JSON line."""
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  model, opt, (x, y), checked, step, wf = _mlp(batch)
  out = {"weights": int(sum(w.numpy().size for w in model.weights)), "tf_dpiter": dp.__file__}
  out["train_on_batch"] = _median_ms(lambda: model.train_on_batch(x, y), calls)

  out["registration"] = _median_ms(lambda: wf.record(opt, checked), calls, step)
  out["get_weights"] = _median_ms(model.get_weights, calls, step)

  def forget():   # the model's variables without records: the next record is a first one
    step()
    for v in wf._with_state(checked, [opt]):  # pylint: disable=protected-access
      wf._RECORDS.pop(id(v), None)  # pylint: disable=protected-access

  out["first_record"] = _median_ms(lambda: wf.record(opt, model.weights, only_new=True),
                                   calls, forget)
  print(json.dumps(out))


def in_process(rounds, calls, batch):
  """The keys' cost in one process (module docstring, --in-process), printed as JSON."""
  model, opt, (x, y), checked, step, wf = _mlp(batch)

  real = wf._digests_and_keys  # pylint: disable=protected-access

  def exact_only(values, arrays=None, want=None):
    del want
    return real(values, arrays, None)

  out = {fig: {"keys": [], "no_keys": []} for fig in ("train_on_batch", "registration")}
  # train_on_batch first: the emulated steps move `iterations` past the ledger's samples
  for fig, fn, prepare in (("train_on_batch", lambda: model.train_on_batch(x, y), None),
                           ("registration", lambda: wf.record(opt, checked), step)):
    for _ in range(rounds):
      for mode, digests in (("keys", real), ("no_keys", exact_only)):
        wf._digests_and_keys = digests  # pylint: disable=protected-access
        out[fig][mode].append(_median_ms(fn, calls, prepare))
  wf._digests_and_keys = real  # pylint: disable=protected-access
  summary = {"in_process": True, "rounds": rounds, "calls": calls, "batch": batch,
             "load": [round(v, 2) for v in os.getloadavg()]}
  for fig, modes in out.items():
    k, n = statistics.median(modes["keys"]), statistics.median(modes["no_keys"])
    summary[fig] = {"no_keys_ms": round(n, 3), "keys_ms": round(k, 3),
                    "delta_ms": round(k - n, 3), "ratio": round(k / n, 3)}
    print(f"{fig:15s} no keys {n:7.3f} ms  keys {k:7.3f} ms  delta {k - n:+.3f} ms "
          f"({k / n:.3f}x)")
  print(json.dumps(summary))


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--before-rev", default="HEAD~1")
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--child", action="store_true")
  p.add_argument("--in-process", action="store_true")
  a = p.parse_args()
  if a.child:
    child(a.calls, a.batch)
    return
  if a.in_process:
    in_process(a.rounds, a.calls, a.batch)
    return
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as before:
    archive = subprocess.run(["git", "-C", repo, "archive", a.before_rev, "tf_dpiter"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
    trees = {"before": before, "after": repo}
    results = {name: [] for name in trees}
    load = os.getloadavg()
    for _ in range(a.rounds):
      for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3")
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                              "--calls", str(a.calls), "--batch", str(a.batch)],
                             env=env, check=True, capture_output=True, text=True)
        results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
  summary = {"before_rev": a.before_rev, "rounds": a.rounds, "calls": a.calls,
             "batch": a.batch, "weights": results["after"][0]["weights"],
             "load": [round(x, 2) for x in load + os.getloadavg()]}
  for fig in FIGURES:
    b = statistics.median(r[fig] for r in results["before"])
    f = statistics.median(r[fig] for r in results["after"])
    summary[fig] = {"before_ms": round(b, 3), "after_ms": round(f, 3),
                    "delta_ms": round(f - b, 3), "ratio": round(f / b, 3)}
    print(f"{fig:15s} before {b:7.3f} ms  after {f:7.3f} ms  delta {f - b:+.3f} ms "
          f"({f / b:.3f}x)")
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
