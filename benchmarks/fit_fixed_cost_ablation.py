"""The DP `model.fit` step's fixed cost (the private step outside the clipped sum), by
ablation at a small batch (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_fixed_cost_ablation.py [--batch 8]
      [--variants base,plain_sum,no_noise,...] [--steps 32] [--rounds 3]

Each variant is its own DP model (fit_step_time.py's dp_spe1: DPSequential +
DPKerasSGDOptimizer(1.0, 1.1), Poisson samples of expected size --batch from n = 60000, no
XLA) whose train function is traced while one library function is replaced; all models and
the non-private one (fit_step_time.py's nonprivate_spe1) then fit one epoch of --steps steps
per round, round robin in ONE process (fit_step_time.py's timer, its batch-end callback
included; figures: the median over --rounds rounds of process CPU ms per step, and of the
CPU inside the train function alone, its call timed, without fit's Python around it).
Variants (all but base are cost probes, NOT private steps):
  base               the DP step as it is
  plain_sum          the clipped sum replaced by the plain gradient of the masked loss sum
                     (fit_step_decomposition.py's dp_plain_sum)
  no_noise           the Gaussian draw returns zeros (fit_step_ablation.py's)
  no_charge_check    PrivateStep.charged_gradients passes the gradients on (no assertion)
  no_row_check       summation.within_public_rows answers True (no run-time assertion)
  sum_by_reduce      summation._pairwise_sum_shrinking as one reduce_sum (the pinned trees'
                     two while loops per sum gone; not the pinned order)
  no_gate            private_step.gate_sums_on_noise adds no edge
  plus_600_ops       the DP step with 600 more tiny ops (300 independent one-entry slices of
                     the noised result, each times a constant, summed by one AddN into it
                     times a variable's 0): what an executed op costs the step, to weigh
                     a change that only removes ops (the noised result is unchanged)
Prints one JSON line: CPU ms per step, and each variant's saving against base.
"""

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings

import fit_step_ablation   # a script beside this one: its folder is on the path


def _time_inside(model):
  """Wraps `model.train_function` (made now) so that each call's process CPU time is kept;
  returns the list of epochs' lists of seconds (a new epoch at each fit). (The ledger write
  cannot be ablated here: fit refuses a ledger that holds fewer samples than steps.)"""
  model.make_train_function()
  fn = model.train_function
  epochs = []
  def timed(iterator):
    start = time.process_time()
    try:
      return fn(iterator)
    finally:
      epochs[-1].append(time.process_time() - start)
  model.train_function = timed
  model.make_train_function = lambda force=False: timed
  original_fit = model.fit
  def fit(*args, **kwargs):
    epochs.append([])
    return original_fit(*args, **kwargs)
  model.fit = fit
  return epochs


def _variants():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import fit_step_decomposition  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import gaussian_query  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import summation  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras import fast_clipping  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import private_step  # pylint: disable=g-import-not-at-top
  ablation = fit_step_ablation._variants()  # pylint: disable=protected-access
  _replaced = fit_step_ablation._replaced  # pylint: disable=protected-access
  return {
      "base": contextlib.nullcontext,
      "plain_sum": lambda: _replaced(fast_clipping, "clipped_grad_sum",
                                     fit_step_decomposition._plain_grad_sum),  # pylint: disable=protected-access
      "no_noise": ablation["no_noise"],
      "no_charge_check": lambda: _replaced(private_step.PrivateStep, "charged_gradients",
                                           lambda self, grads: (list(grads), [])),
      "no_row_check": lambda: _replaced(summation, "within_public_rows", lambda rows: True),
      "sum_by_reduce": lambda: _replaced(summation, "_pairwise_sum_shrinking",
                                         lambda x: tf.reduce_sum(x, 0)),
      "no_gate": lambda: _replaced(private_step, "gate_sums_on_noise", lambda s, n: 0),
      "plus_600_ops": lambda: _replaced(gaussian_query, "add_gaussian_noise",
                                        _with_tiny_ops(gaussian_query.add_gaussian_noise, 300)),
  }


def _with_tiny_ops(add_noise, pairs):
  """add_noise with 2 `pairs` + 1 more ops run each step: `pairs` slices of one entry each of
  the first noised leaf (distinct entries while it has `pairs`), each times a constant, one AddN of them, added to that leaf times 0
  read from a variable (so that Grappler folds none of them away)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.init_scope():
    zero = tf.Variable(0.0, trainable=False)

  def noised(generator, structure, stddev):
    leaves = tf.nest.flatten(add_noise(generator, structure, stddev))
    flat = tf.reshape(leaves[0], [-1])
    size = int(flat.shape[0])   # distinct entries: Grappler merges equal slices
    extra = tf.add_n([flat[i % size] * float(i + 1) for i in range(pairs)])
    leaves[0] = leaves[0] + extra * zero.read_value()
    return tf.nest.pack_sequence_as(structure, leaves)
  return noised


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variants", default="base,plain_sum,no_noise,no_charge_check,"
                 "no_row_check,sum_by_reduce,no_gate")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  import fit_step_time  # pylint: disable=g-import-not-at-top  (a script: its folder is on the path)
  variants = _variants()
  names = fit_step_ablation.chosen(a.variants, variants)
  load_start = os.getloadavg()
  argv = ["--steps", str(a.steps), "--spe", "1", "--batch", str(a.batch), "--jit", "0"]
  configs = {"nonprivate": fit_step_time._configs("cnn", fit_step_time._parse(argv))[  # pylint: disable=protected-access
      "nonprivate_spe1"]}
  for name in names:
    model, kw = fit_step_time._configs("cnn", fit_step_time._parse(argv))["dp_spe1"]  # pylint: disable=protected-access
    with variants[name]():
      model.fit(**kw, epochs=1, verbose=0)   # traced here, with the variant's function
    configs[name] = (model, kw)
  inside = {k: _time_inside(m) for k, (m, _) in configs.items()}
  t = fit_step_time._time_round_robin(configs, a.rounds, a.steps)  # pylint: disable=protected-access
  cpu = {k: v[1] for k, v in t.items()}
  # CPU inside the train function (the traced step and its call), per step: the median over
  # the rounds' epochs (the warm-up epoch left out)
  step_cpu = {k: round(1e3 * statistics.median(
      [sum(e) / len(e) for e in inside[k][1:] if e]), 3) for k in configs}
  print(json.dumps({"batch": a.batch, "steps": a.steps, "rounds": a.rounds,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "cpu_ms_per_step": cpu, "train_function_cpu_ms_per_step": step_cpu,
                    "train_function_ms_saved_against_base": (
                        fit_step_ablation.saved_against_base(step_cpu)),
                    "cpu_ms_saved_against_base": fit_step_ablation.saved_against_base(cpu)}),
        flush=True)


if __name__ == "__main__":
  main()
