"""Per-op CPU time of one `model.fit` configuration, from TensorFlow's profiler (issue 18).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_op_profile.py --model mlp --config dp_fixed_batch
      [--steps 40] [--top 25]

Builds the configuration `--config` of benchmarks/fit_step_time.py (nonprivate_spe1, dp_spe1,
dp_padded, dp_fixed_batch, nonprivate_fixed_batch) for `--model` (cnn, mlp, transformer), fits
two warm-up epochs, then profiles one epoch of `--steps` steps with
`tf.profiler.experimental` and prints the `--top` ops by total self time per step (TensorBoard
profile plugin's "framework_op_stats" table, read through TensorFlow's own converter: no
TensorBoard needed). Self times are summed over threads, so an op sharded on 2 cores can
exceed its wall time; "IDLE" is the profiler's idle time. Prints one JSON line.
"""

import argparse
import glob
import json
import os
import tempfile
import warnings


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="mlp", choices=["cnn", "mlp", "transformer"])
  p.add_argument("--config", default="dp_fixed_batch")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--top", type=int, default=25)
  return p.parse_args()


def _op_table(xplane, steps, top):
  """[(op type, op name, self ms per step, occurrences per step)] of the top ops."""
  from tensorflow.python.profiler.internal import _pywrap_profiler_plugin  # pylint: disable=g-import-not-at-top
  data, ok = _pywrap_profiler_plugin.xspace_to_tools_data([xplane], "framework_op_stats", {})
  if not ok:
    raise RuntimeError(f"the profiler could not convert {xplane}: {data!r}")
  table = json.loads(data)[0]
  cols = [c["id"] for c in table["cols"]]
  rows = [dict(zip(cols, [c["v"] if c else None for c in r["c"]])) for r in table["rows"]]
  rows.sort(key=lambda r: -r["total_self_time"])
  return [(r["type"], r["operation"], round(r["total_self_time"] / steps / 1e3, 3),
           round(r["occurrences"] / steps, 2)) for r in rows[:top]]


def profile_epoch(model, fit_kwargs, steps, top):
  """The `top` ops of one profiled epoch of `model.fit(**fit_kwargs)` (`_op_table`'s rows),
  after two warm-up epochs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model.fit(**fit_kwargs, epochs=2, verbose=0)
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    model.fit(**fit_kwargs, epochs=1, verbose=0)
    tf.profiler.experimental.stop()
    xplane = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    return _op_table(xplane, steps, top)


def main():
  a = _parse()
  warnings.simplefilter("ignore")
  import fit_step_time  # pylint: disable=g-import-not-at-top
  configs = fit_step_time._configs(a.model, fit_step_time._parse(  # pylint: disable=protected-access
      ["--steps", str(a.steps), "--spe", "1", "--extra"]))
  if a.config not in configs:
    raise ValueError(f"--config must be one of {sorted(configs)}, got {a.config!r}")
  model, kw = configs[a.config]
  ops = profile_epoch(model, kw, a.steps, a.top)
  print(json.dumps({"model": a.model, "config": a.config, "steps": a.steps,
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "ops_ms_per_step": ops}), flush=True)


if __name__ == "__main__":
  main()
