"""Where the DP `model.fit` step's op time goes, part by part, against the non-private step
(issue 42, item 2).

  TF_ENABLE_ONEDNN_OPTS=1 python -m benchmarks.fit_step_split [--model cnn]
      [--configs dp_spe1,nonprivate_spe1] [--steps 64] [--batch 256] [--jit 0|1] [--rounds 3]

The configurations of benchmarks/fit_step_time.py in --configs (dp_spe1: DP fit on Poisson
samples; nonprivate_spe1; dp_fixed_batch, nonprivate_fixed_batch, dp_padded) are built in ONE
process and fit two warm-up epochs each; then --rounds rounds, the configurations alternated,
each profile one epoch of --steps steps with `tf.profiler.experimental` (TensorFlow's
"framework_op_stats" table, as benchmarks/fit_op_profile.py reads it). The ops' self time per
step is summed into the parts of the step (`split`; figure: the median over rounds):
  forward                the layers' forward pass
  backward               the backward pass to the layers' inputs and outputs (input gradients,
                         activations' and pooling's gradients)
  weight_grad            whole-batch weight gradients taken by the tape (the non-private
                         step's kernel gradients; in the DP step the book-keeping sums that
                         the tape forms: one filter gradient of the clip-weighted output
                         gradients, Bu et al., "Differentially private optimization on large
                         model at small cost", Sec. 3)
  norm:LAYER:FORM        a convolution's per-example norms (rules/conv.py names their ops
                         LAYER_FORM_norm: forms depthwise, foldgram, filter, unfold)
  sum:LAYER:FORM         a convolution's clipped sum from its kept per-example gradients
  norms_other            the other layers' norms and the clip factors
  clipped_sum_other      the other layers' clipped sums
  noise                  random draws and the Gaussian transform
  input                  the tf.data pipeline (sampling, batching)
  other                  the rest (update, ledger, loss)
Self times are summed over threads (an op on 2 cores can exceed its wall time) and the
machine may be shared: compare parts within one run, DP against non-private. The profiler's
table holds at most 500 ops (TensorFlow 2.21: the DP CNN step's table stops at 500 rows, none
of zero time, while the step runs about 660 ops), so the ms leave out its smallest ops. The ops executed per step are counted from the profile's trace
instead (`op_counts`: every op run by TensorFlow's executor threads and the tf.data threads,
and the eager ops the Python thread runs around the train function, part "eager"). Prints one
JSON line: per configuration the parts in ms per step and in ops per step, and the DP -
non-private difference per part for the first two configurations.
"""

import argparse
import collections
import glob
import json
import os
import re
import statistics
import tempfile
import warnings

# An op's part from its name (the tf.function's call prefix removed) and type.
_CONV_SCOPE = re.compile(r"(?:^|/)([\w.-]+?)_(depthwise|foldgram|filter|unfold)_(norm|sum)/")
_WEIGHT_GRAD_TYPES = ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter",
                      "BiasAddGrad")
_NOISE_TYPES = ("Random", "Cos", "Sin", "Log", "Sqrt", "Philox")


def part_of(op_type, name):
  """The part of the step (module docstring) an op belongs to.

  Args:
    op_type: the op's type as the profiler gives it ("_MklNativeFusedConv2D", "Dataset", ...).
    name: the op's full name.

  Returns:
    str, the part's key.
  """
  n = name.replace("StatefulPartitionedCall/", "")
  conv = _CONV_SCOPE.search(n)
  if conv:
    return f"{conv.group(3)}:{conv.group(1)}:{conv.group(2)}"
  if op_type == "Dataset" or n.startswith("Iterator"):
    return "input"
  if n.startswith("norms"):
    return "norms_other"
  if n.startswith("clipped_sum"):
    return "clipped_sum_other"
  if n.startswith("gradient_tape/"):
    plain = op_type.lstrip("_").replace("MklNative", "").replace("Mkl", "")
    # A dense layer's kernel gradient is the second product of MatMul's gradient (x^T dy).
    weight = (plain.startswith(_WEIGHT_GRAD_TYPES) if "MatMul" not in plain
              else n.endswith("/MatMul/MatMul_1"))
    return "weight_grad" if weight else "backward"
  if n.startswith("forward") or re.match(r"(dp_)?sequential(_\d+)?/", n):
    return "forward"
  if any(t in op_type for t in _NOISE_TYPES) or "stateful_uniform" in n:
    return "noise"
  return "other"


def split(ops):
  """{part: ms per step} of a profile's op table.

  Args:
    ops: [(op type, op name, self ms per step, occurrences per step)], the profiler's rows
      (the "IDLE" row left out).

  Returns:
    dict, parts sorted by time (largest first), ms rounded to 3 decimals, with "total".
  """
  parts = collections.Counter()
  for op_type, name, ms, _ in ops:
    if op_type != "IDLE":
      parts[part_of(op_type, name)] += ms
  out = {k: round(v, 3) for k, v in parts.most_common()}
  out["total"] = round(sum(parts.values()), 3)
  return out


# An op's run in the profile's trace: "name:Type" on TensorFlow's threads, "EagerLocalExecute:
# Type" for an eager op on the Python thread (a tf.function's call is "__inference_...").
_OP_EVENT = re.compile(r"^([^:]+):([A-Z_][A-Za-z0-9_]*)$")
_EAGER_EVENT = re.compile(r"^EagerLocalExecute: (?!__inference_)([A-Z_][A-Za-z0-9_]*)$")


def op_counts(events, steps):
  """{part: ops executed per step} of a profile's trace.

  Args:
    events: [(line name, event name)] of the host plane's events (`_trace_events`).
    steps: the steps the profile covers.

  Returns:
    dict, parts sorted by count (largest first), rounded to 2 decimals, with "total".
  """
  parts = collections.Counter()
  for line, name in events:
    eager = _EAGER_EVENT.match(name) if line == "python" else None
    run = None if line == "python" else _OP_EVENT.match(name)
    if eager:
      parts["eager"] += 1
    elif run and not line.startswith("tf_data"):
      parts[part_of(run.group(2), run.group(1))] += 1
    elif run:
      parts["input"] += 1
  out = {k: round(v / steps, 2) for k, v in parts.most_common()}
  out["total"] = round(sum(parts.values()) / steps, 2)
  return out


def _trace_events(xplane):
  """[(line name, event name)] of every event on the host plane of the XSpace file `xplane`."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  space = xplane_pb2.XSpace()
  with open(xplane, "rb") as f:
    space.ParseFromString(f.read())
  return [(line.name, plane.event_metadata[e.metadata_id].name)
          for plane in space.planes if plane.name.startswith("/host:")
          for line in plane.lines for e in line.events]


def _profile_split(model, kw, steps):
  """({part: ms per step}, {part: ops per step}) of one profiled epoch of `model.fit(**kw)`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from benchmarks import fit_op_profile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    model.fit(**kw, epochs=1, verbose=0)
    tf.profiler.experimental.stop()
    xplane = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    return (split(fit_op_profile._op_table(xplane, steps, 100000)),  # pylint: disable=protected-access
            op_counts(_trace_events(xplane), steps))


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp", "transformer"])
  p.add_argument("--configs", default="dp_spe1,nonprivate_spe1")
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--jit", type=int, default=0)
  p.add_argument("--rounds", type=int, default=3,
                 help="profiled epochs per configuration, alternated (figure: the median)")
  a = p.parse_args()
  warnings.simplefilter("ignore")
  from benchmarks import fit_step_time  # pylint: disable=g-import-not-at-top
  load_start = os.getloadavg()
  configs = fit_step_time._configs(a.model, fit_step_time._parse(  # pylint: disable=protected-access
      ["--steps", str(a.steps), "--spe", "1", "--extra", "--batch", str(a.batch),
       "--jit", str(a.jit)]))
  names = a.configs.split(",")
  unknown = [n for n in names if n not in configs]
  if unknown:
    raise ValueError(f"`--configs` must name configurations of {sorted(configs)}. "
                     f"Received: configs={a.configs!r}")
  for name in names:
    model, kw = configs[name]
    model.fit(**kw, epochs=2, verbose=0)   # warm-up: tracing, first allocations
  runs = {name: [] for name in names}
  for _ in range(a.rounds):   # alternated in one process: the configurations see one load
    for name in names:
      model, kw = configs[name]
      runs[name].append(_profile_split(model, kw, a.steps))
  medians = lambda which: {name: _medians([r[which] for r in rs]) for name, rs in runs.items()}
  out, ops = medians(0), medians(1)
  print(json.dumps({"model": a.model, "batch": a.batch, "steps": a.steps, "jit": a.jit,
                    "rounds": a.rounds, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                    "ms_per_step": out, "difference_first_minus_second": _difference(out, names),
                    "ops_per_step": ops,
                    "ops_difference_first_minus_second": _difference(ops, names)}), flush=True)


def _medians(splits):
  """{part: median over the rounds' `splits`}, largest first."""
  parts = {k for s in splits for k in s}
  med = {k: round(statistics.median(s.get(k, 0.0) for s in splits), 3) for k in parts}
  return dict(sorted(med.items(), key=lambda kv: -kv[1]))


def _difference(per_config, names):
  """{part: the first configuration's figure - the second's}, largest change first ({} for one
  configuration)."""
  if len(names) < 2:
    return {}
  dp, plain = per_config[names[0]], per_config[names[1]]
  diff = {k: round(dp.get(k, 0.0) - plain.get(k, 0.0), 3) for k in {**dp, **plain}}
  return dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))


if __name__ == "__main__":
  main()
