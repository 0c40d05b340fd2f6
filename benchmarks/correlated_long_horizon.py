"""Long-horizon correlated noise on MNIST: DP-SGD vs BandMF vs BLT at equal epsilon, >= 2,000 steps.

Choquette-Choo et al. ("Amplified Banded Matrix Factorization", 2023) report BandMF's gain over
DP-SGD growing with the number of steps. This grid checks it on a cheap model (an MLP,
784-hidden-10, ReLU) over T >= 2,000 steps, for epsilon in {1, 2, 4, 8} at delta = 1e-5, all
under add/remove one example (unit: one training example), the ledger of each run read by the
accountant (dp-accounting):

  dpsgd : Poisson sampling q = B / N, T steps.
  bandmf: cyclic Poisson over b groups (q = B b / N), b-banded Toeplitz strategy, b chosen
          among --bands by the smallest expected prefix-sum error at its calibrated noise.
  blt   : cyclic batches (N / B fixed groups, q = 1), a 4-buffer BLT optimized for T steps,
          min separation N / B; no amplification by sampling.

Protocol (nothing is chosen on the test set):
  * data: the first 50,000 MNIST training examples train; the last 10,000 are the validation
    split; the 10,000 test examples are read only for the reported figures.
  * learning rate: for every (epsilon, mechanism), each rate of --lrs is trained with seed 0 and
    the one with the best validation accuracy kept;
  * figures: seeds 0..S-1 at the kept rate; test accuracy mean, min and max (spread), the
    ledger epsilon of every run.
The step (clipped sum by ghost norms, the query's noise, update -lr * noised sum / B) and the
calibration are those of benchmarks/correlated_noise_mnist.py, imported from it.

  nice -n 10 timeout 3600 python -m benchmarks.correlated_long_horizon \
      --out benchmarks/results_correlated_long_horizon.json
`--out` keeps every finished run (JSON list, rewritten after each run); a rerun with the same
file skips the runs already in it, so an interrupted grid resumes.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

from benchmarks import correlated_noise_mnist as cn  # noqa: E402
from tf_dpiter.accounting import accountant  # noqa: E402
from tf_dpiter.dp_query import band_mf_query  # noqa: E402
from tf_dpiter.dp_query import blt_query  # noqa: E402
from tf_dpiter.dp_query import gaussian_query  # noqa: E402
from tf_dpiter.keras import example_models  # noqa: E402
from tf_dpiter.ledger import records as rec  # noqa: E402

VALIDATION = 10000


def load(path):
  """(x_train, y_train, x_val, y_val, x_test, y_test), images flattened to 784 in [0, 1]."""
  with np.load(path) as d:
    x, y, xt, yt = d["x_train"], d["y_train"], d["x_test"], d["y_test"]
  f = lambda a: (a.reshape(len(a), -1) / 255.0).astype(np.float32)
  return (f(x[:-VALIDATION]), y[:-VALIDATION].astype(np.int64), f(x[-VALIDATION:]),
          y[-VALIDATION:].astype(np.int64), f(xt), yt.astype(np.int64))


def _query(mech, z, variables, steps, steps_per_pass, bands, seed):
  if mech == "dpsgd":
    return gaussian_query.GaussianSumQuery(1.0, z, seed=seed)
  if mech == "bandmf":
    return band_mf_query.BandMFQuery(1.0, z, variables, num_bands=bands, num_steps=steps,
                                     seed=seed)
  return blt_query.BLTQuery(1.0, z, variables, num_steps=steps, num_buffers=cn.BLT_BUFFERS,
                            min_separation=steps_per_pass, seed=seed)


def _ledger_row(mech, ev, srow):
  ev = tf.nest.map_structure(lambda t: t.numpy() if tf.is_tensor(t) else t, ev)
  if mech == "dpsgd":
    return [rec.GAUSSIAN, float(ev.l2_norm_clip), float(ev.stddev), float(ev.l2_norm_clip)]
  return rec.correlated_query_row(
      type(ev)(*[float(f) if isinstance(f, np.ndarray) else f for f in ev]),
      rec.policy_name(srow[3]), srow[2], 1.0)


def train(mech, z, data, batch, epochs, lr, bands, seed, hidden):
  """Trains the MLP; returns (val accuracy, test accuracy, ledger epsilon, s/step)."""
  x, y, xv, yv, xt, yt = data
  keras.utils.set_random_seed(seed)
  model = keras.Sequential(example_models.mlp_layers(hidden))
  variables = model.trainable_variables
  n = len(x)
  steps_per_pass = n // batch
  query = _query(mech, z, variables, epochs * steps_per_pass, steps_per_pass, bands, seed)
  step = cn._make_step(query, model, variables, lr, batch, "fast")
  state = query.initial_global_state()
  srow = cn._sample_for(mech, n, batch, bands)
  samples, queries = [], []
  start = time.time()
  for i, (xb, yb, mask) in enumerate(cn._batches(mech, x, y, batch, epochs, bands, seed)):
    state, events = step(tf.convert_to_tensor(xb), tf.convert_to_tensor(yb),
                         tf.convert_to_tensor(mask), state)
    samples.append(srow)
    queries.append([i] + _ledger_row(mech, events[0], srow))
  per_step = (time.time() - start) / max(1, len(samples))
  acc = lambda a, b: float(np.mean(np.argmax(model.predict(a, batch_size=2000, verbose=0), 1)
                                   == b))
  eps = accountant.privacy_report((np.array(samples), np.array(queries), 0), delta=cn.DELTA)
  return acc(xv, yv), acc(xt, yt), eps.epsilon, per_step


def choose_noise(mech, eps, n, batch, epochs, band_options):
  """(bands, z, prefix RMSE): the calibrated noise; BandMF's b by smallest prefix error."""
  steps_per_pass = n // batch
  steps = epochs * steps_per_pass
  if mech != "bandmf":
    z = cn.calibrate(mech, eps, n, batch, epochs)
    return 1, z, cn.prefix_rmse(mech, z, steps, steps_per_pass)
  options = []
  for b in band_options:
    if b * batch <= n:
      z = cn.calibrate(mech, eps, n, batch, epochs, b)
      options.append((cn.prefix_rmse(mech, z, steps, steps_per_pass, b), b, z))
  err, b, z = min(options)
  return b, z, err


def _load_rows(path):
  return json.load(open(path)) if path and os.path.exists(path) else []


def _run(args, data, rows, key, mech, eps, plan, lr, seed):
  """Runs one (mechanism, epsilon, lr, seed) unless `rows` has it; returns its row."""
  for r in rows:
    if all(r.get(k) == v for k, v in key.items()):
      return r
  bands, z, err = plan
  t0 = time.time()
  val, test, led, per_step = train(mech, z, data, args.batch, args.epochs, lr, bands, seed,
                                   args.hidden)
  row = dict(key, bands=bands, z=round(z, 4), prefix_rmse=round(err, 2), val_accuracy=round(
      val, 4), test_accuracy=round(test, 4), ledger_epsilon=round(led, 3),
      steps=args.epochs * (len(data[0]) // args.batch), s_per_step=round(per_step, 4),
      wall_s=round(time.time() - t0, 1), command=" ".join(sys.argv))
  print(json.dumps(row), flush=True)
  rows.append(row)
  if args.out:
    cn._append_result(args.out, row)
  return row


def summary(rows, epsilons, mechanisms):
  """Markdown table: test accuracy mean, sample sd and [min, max] over the final seeds at the
  learning rate with the best validation accuracy (seed 0)."""
  lines = ["| epsilon | mechanism | b | z | lr (val) | steps | test acc % mean ± sd [min, max] | "
           "seeds | ledger eps (max) |", "|---|---|---|---|---|---|---|---|---|"]
  for eps in epsilons:
    for mech in mechanisms:
      tuned = [r for r in rows if r["epsilon_target"] == eps and r["mechanism"] == mech
               and r.get("phase") == "lr"]
      if not tuned:
        continue
      best = max(tuned, key=lambda r: r["val_accuracy"])["lr"]   # rates added later count
      final = [r for r in rows if r["epsilon_target"] == eps and r["mechanism"] == mech
               and r.get("phase") == "final" and r["lr"] == best]
      if not final:
        continue
      a = [r["test_accuracy"] * 100 for r in final]
      sd = float(np.std(a, ddof=1)) if len(a) > 1 else 0.0
      lines.append(f"| {eps:g} | {mech} | {final[0]['bands']} | {final[0]['z']} | "
                   f"{final[0]['lr']:g} | {final[0]['steps']} | {np.mean(a):.2f} ± {sd:.2f} "
                   f"[{min(a):.2f}, {max(a):.2f}] | {len(a)} | "
                   f"{max(r['ledger_epsilon'] for r in final):.3f} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--mnist", default=os.environ.get("TF_DPITER_MNIST",
                                                   "/work/shared/data/mnist.npz"))
  p.add_argument("--epsilons", type=float, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--mechanisms", nargs="+", default=["dpsgd", "bandmf", "blt"])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--epochs", type=int, default=11, help="passes; steps = epochs * (N // B)")
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0])
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--bands", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
  p.add_argument("--out", default=None)
  p.add_argument("--table-only", action="store_true", help="print the table of --out and exit")
  args = p.parse_args()
  if args.table_only:
    print(summary(_load_rows(args.out), args.epsilons, args.mechanisms))
    return
  data = load(args.mnist)
  n = len(data[0])
  rows = _load_rows(args.out)
  print(f"N={n} batch={args.batch} epochs={args.epochs} steps={args.epochs * (n // args.batch)}",
        flush=True)
  for eps in args.epsilons:
    for mech in args.mechanisms:
      plan = choose_noise(mech, eps, n, args.batch, args.epochs, args.bands)
      base = {"epsilon_target": eps, "mechanism": mech, "batch": args.batch,
              "epochs": args.epochs, "hidden": args.hidden, "delta": cn.DELTA}
      tuned = [_run(args, data, rows, dict(base, phase="lr", lr=lr, seed=0), mech, eps, plan,
                    lr, 0) for lr in args.lrs]
      chosen = max(tuned, key=lambda r: r["val_accuracy"])
      best = chosen["lr"]
      if not any(r.get("phase") == "final" and r["seed"] == 0 and r["lr"] == best
                 and r["epsilon_target"] == eps and r["mechanism"] == mech for r in rows):
        row = dict(chosen, phase="final")   # the seed-0 run at the chosen rate is reused
        rows.append(row)
        if args.out:
          cn._append_result(args.out, row)
      for seed in range(args.seeds):
        _run(args, data, rows, dict(base, phase="final", lr=best, seed=seed), mech, eps, plan,
             best, seed)
  print(summary(rows, args.epsilons, args.mechanisms))


if __name__ == "__main__":
  main()
