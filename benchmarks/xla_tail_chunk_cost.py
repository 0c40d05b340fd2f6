"""What each Poisson tail chunk adds to the DP step under XLA (issue 42, item 2).

  python benchmarks/xla_tail_chunk_cost.py [--model cnn] [--batch 256] [--reals 256,264,272,288]
      [--calls 30] [--rounds 5] [--onednn 1]

One process builds the DP model of benchmarks/fit_step_time.py (DPKerasSGDOptimizer(1.0, 1.1),
the default clipping, jit_compile=True, Poisson q = B / 60000 declared with set_sampling) and
times its compiled clipped-sum program (`model._dp_core_fn`: per-example norms, clipped sum
and, for DP-SGD, the noise) on batches padded to data.sampling.default_max_batch_size (what
fit pads a Poisson sample to under XLA), whose first R rows are real (weight 1) and the rest
padding, for each R of --reals. keras/optimizer/chunking.py runs a first chunk of about B rows
and then the tail's chunks (8 rows for B = 256) up to the last real row, so R = B runs no tail
chunk, B + 8 one, B + 16 two, ...: the differences are the tail chunks' cost. Round robin over
R (--calls calls each per round, --rounds rounds after a warm-up); figures: the median over
rounds of the wall and process CPU ms per call. Prints one JSON object (and the load average).
Compare revisions alternated with benchmarks/compare_revisions.py.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import fit_step_time   # benchmarks/ (the script's directory): the same models and data


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="cnn")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--transformer_batch", type=int, default=64,
                 help="batch of the Transformer and the LSTM")
  p.add_argument("--reals", default="256,264,272,288", help="real rows of the padded batches")
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--onednn", default="1")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _child(a):
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  load0 = os.getloadavg()
  xs, ys, b = fit_step_time.dataset(a.model, a)
  n = fit_step_time.N_POP
  pad = dp.data.sampling.default_max_batch_size(n, b / n)
  reals = [int(r) for r in a.reals.split(",")]
  keras.utils.set_random_seed(0)
  model = fit_step_time.build_model(a.model, True)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=True)
  model.optimizer.set_sampling(n, b / n, "poisson", b)

  def padded(real):
    x, y, w = xs[:pad].copy(), ys[:pad].copy(), np.zeros(pad, "float32")
    x[real:], y[real:], w[:real] = 0, 0, 1.0
    return [tf.constant(t) for t in (x, y, w)]

  model.fit(tf.data.Dataset.from_tensors(tuple(padded(b))).repeat(), steps_per_epoch=1,
            epochs=1, verbose=0)   # builds the train function (and _dp_core_fn)
  params = model.optimizer.private_step.sample_params()
  args = {r: padded(r) for r in reals}
  core = lambda r: model._dp_core_fn(*args[r], params)  # pylint: disable=protected-access

  def sync(out):
    for t in tf.nest.flatten(out):
      if hasattr(t, "numpy"):
        t.numpy()

  for r in reals:   # warm-up (one compiled program: the shapes are the same)
    for _ in range(3):
      sync(core(r))
  wall, cpu = {r: [] for r in reals}, {r: [] for r in reals}
  for _ in range(a.rounds):
    for r in reals:
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(a.calls):
        out = core(r)
      sync(out)
      wall[r].append(1e3 * (time.perf_counter() - t0) / a.calls)
      cpu[r].append(1e3 * (time.process_time() - c0) / a.calls)
  med = lambda d: {str(r): round(statistics.median(v), 3) for r, v in d.items()}
  print(json.dumps({"model": a.model, "batch": b, "padded_to": pad,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "tf": tf.__version__,
                    "results": [{"wall_ms": med(wall), "cpu_ms": med(cpu)}],
                    "load_avg": [load0, os.getloadavg()]}), flush=True)


def main():
  a = _parse()
  if a.child:
    _child(a)
    return
  fit_step_time.run_children(__file__, sys.argv[1:], a.onednn)


if __name__ == "__main__":
  main()
