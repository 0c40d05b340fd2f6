"""What a user's batch-end callback costs a DP `model.fit` step, against the non-private
step (issue 42): the fit's weights check around train-batch hooks (models.py
`_FitFingerprints`: the weights held before the user's hook and compared after it, at every
step) and the rest of fit's Python per step.

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_batch_hook_cost.py [--batch 8] [--steps 64]
      [--rounds 5] [--guard-steps 200]

fit_step_time.py's nonprivate_spe1 and dp_spe1 (the tutorial CNN, no XLA) each fit one epoch
of --steps steps per round with no callback and with a callback whose on_train_batch_end does
nothing, round robin in ONE process. Figures (medians over rounds): process CPU ms per step
of the epoch, and the part spent inside the train function (its call timed around
`model.train_function`); their difference is fit's Python around the steps. Then the guard
alone (--guard-steps > 0): the DP model's `_FitFingerprints` at on_train_batch_end (`_begin`
then `_end`, as fit calls them around the user's hook) after an emulated private step (every
weight written in place, `iterations` and the private-update count moved), --guard-steps
steps per round, the median over --rounds rounds of process CPU us per step (the first round
left out). Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time
import warnings


def _guard_us(model, hook, steps, rounds):
  """Median process CPU us per step of the DP fit's guard around `hook`'s on_train_batch_end
  (models._FitFingerprints `_begin` + `_end`), after an emulated private step; the first of
  `rounds` rounds left out."""
  from tf_dpiter.keras.model import models  # pylint: disable=g-import-not-at-top
  opt = model.optimizer
  guard = models._FitFingerprints(opt, model, [hook])  # pylint: disable=protected-access
  used = opt.private_step._used_results  # pylint: disable=protected-access
  weights = list(model.trainable_variables)
  per_round = []
  for _ in range(rounds):
    total = 0.0
    for _ in range(steps):
      for w in weights:   # in place, as the DP update writes them
        w.assign_sub(w * 1e-6)
      opt.iterations.assign_add(1)
      used.assign_add(1)
      start = time.process_time()
      guard._begin("on_train_batch_end")  # pylint: disable=protected-access
      guard._end("on_train_batch_end")  # pylint: disable=protected-access
      total += time.process_time() - start
    per_round.append(1e6 * total / steps)
  return round(statistics.median(per_round[1:]), 1)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--guard-steps", type=int, default=200)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import fit_step_time  # pylint: disable=g-import-not-at-top  (a script: its folder is on the path)

  class Hook(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      pass

  load_start = os.getloadavg()
  configs = fit_step_time._configs("cnn", fit_step_time._parse(  # pylint: disable=protected-access
      ["--steps", str(a.steps), "--spe", "1", "--batch", str(a.batch), "--jit", "0"]))
  inside = {}
  for name, (model, kw) in configs.items():
    model.fit(**kw, epochs=1, verbose=0)   # traced
    fn = model.train_function

    def timed(iterator, fn=fn, name=name):
      start = time.process_time()
      try:
        return fn(iterator)
      finally:
        inside[name] += time.process_time() - start
    model.train_function = timed
    model.make_train_function = lambda force=False, timed=timed: timed
  runs = {}
  for _ in range(a.rounds):
    for name, (model, kw) in configs.items():
      for hook in (False, True):
        inside[name] = 0.0
        start = time.process_time()
        model.fit(**kw, epochs=1, verbose=0, callbacks=[Hook()] if hook else [])
        total = time.process_time() - start
        runs.setdefault(f"{name}{'_hook' if hook else ''}", []).append(
            (1e3 * total / a.steps, 1e3 * inside[name] / a.steps))
  med = lambda xs: round(statistics.median(xs), 3)
  guard = _guard_us(configs["dp_spe1"][0], Hook(), a.guard_steps, a.rounds + 1) if (
      a.guard_steps > 0) else None
  print(json.dumps({"batch": a.batch, "steps": a.steps, "rounds": a.rounds,
                    "guard_cpu_us_per_step": guard,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "epoch_cpu_ms_per_step": {k: med([r[0] for r in v]) for k, v in runs.items()},
                    "train_function_cpu_ms_per_step": {k: med([r[1] for r in v])
                                                       for k, v in runs.items()}}), flush=True)


if __name__ == "__main__":
  main()
