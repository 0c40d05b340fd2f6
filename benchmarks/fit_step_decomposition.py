"""The DP `model.fit` step's CPU time split into the clipped sum and the rest of the private
step, against the non-private step (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_step_decomposition.py [--model cnn]
      [--batches 8,256] [--steps 32] [--rounds 3] [--jit 0|1]

For each batch size in --batches, three models are fit round robin in ONE process
(benchmarks/fit_step_time.py's timer and configurations: Poisson samples of expected size B
from n = 60000 random records; figure: the median over --rounds rounds of process CPU ms per
step):
  nonprivate_spe1   keras.Sequential + SGD (fit_step_time.py's)
  dp_spe1           DPSequential + DPKerasSGDOptimizer(1.0, 1.1), the default clipping
                    (fit_step_time.py's)
  dp_plain_sum      the same DP model whose train function is traced while
                    `fast_clipping.clipped_grad_sum` is replaced by the plain gradient of the
                    masked sum of per-example losses (one backward pass, no per-example work,
                    norms 0): the private step's sampling, loss, noise, ledger, checks and
                    update, without clipping. NOT a private step (nothing is clipped): it only
                    says what the rest of the step costs.
Printed per batch size: the three CPU ms, dp_spe1 - dp_plain_sum (the clipped sum's cost over
a plain gradient: per-example norms, factors, clipped sums), dp_plain_sum - nonprivate_spe1
(the private step outside the clipped sum) and the ratios to the non-private step. With 8
among the batch sizes the per-step fixed costs show (most per-example work vanishes).
Prints one JSON line.
"""

import argparse
import json
import os
import warnings


def _plain_grad_sum(model, inputs, targets, per_example_loss_fn, mask=None, **unused):
  """Stand-in for fast_clipping.clipped_grad_sum with return_outputs=True: the gradient of the
  masked sum of the per-example losses (no clipping), zero norms, the outputs and losses."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.GradientTape() as tape:
    outputs = model(inputs, training=True)
    losses = per_example_loss_fn(targets, outputs)
    weights = 1.0 if mask is None else tf.cast(mask, losses.dtype)
    total = tf.reduce_sum(losses * weights)
  grads = tape.gradient(total, model.trainable_variables)
  return grads, tf.zeros(tf.shape(losses)[:1]), outputs, losses


def _configs(model, batch, a):
  """fit_step_time.py's nonprivate_spe1 and dp_spe1 for `model` at `batch`, and dp_plain_sum."""
  import fit_step_time  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras import fast_clipping  # pylint: disable=g-import-not-at-top
  argv = ["--steps", str(a.steps), "--spe", "1", "--batch", str(batch), "--jit", str(a.jit)]
  configs = fit_step_time._configs(model, fit_step_time._parse(argv))  # pylint: disable=protected-access
  plain, kw = fit_step_time._configs(model, fit_step_time._parse(argv))["dp_spe1"]  # pylint: disable=protected-access
  original = fast_clipping.clipped_grad_sum
  fast_clipping.clipped_grad_sum = _plain_grad_sum
  try:
    plain.fit(**kw, epochs=1, verbose=0)   # traced while replaced
  finally:
    fast_clipping.clipped_grad_sum = original
  configs["dp_plain_sum"] = (plain, kw)
  return configs


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--batches", default="8,256")
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--jit", type=int, default=0)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  import fit_step_time  # pylint: disable=g-import-not-at-top  (a script: its folder is on the path)
  out = {"model": a.model, "steps": a.steps, "rounds": a.rounds, "jit": a.jit,
         "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "load_avg_start": os.getloadavg(),
         "batches": {}}
  for batch in (int(b) for b in a.batches.split(",")):
    t = fit_step_time._time_round_robin(_configs(a.model, batch, a), a.rounds, a.steps)  # pylint: disable=protected-access
    cpu = {k: v[1] for k, v in t.items()}
    plain, dp, np_ = cpu["dp_plain_sum"], cpu["dp_spe1"], cpu["nonprivate_spe1"]
    out["batches"][batch] = {
        "cpu_ms_per_step": cpu,
        "clipped_sum_over_plain_gradient_ms": round(dp - plain, 3),
        "private_step_outside_clipped_sum_ms": round(plain - np_, 3),
        "ratio_dp": round(dp / np_, 3), "ratio_dp_plain_sum": round(plain / np_, 3)}
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
