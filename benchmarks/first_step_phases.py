"""The first train step of BERT-base (DP or non-private) broken down by phase.

  python benchmarks/first_step_phases.py --mode dp [--lora 8] [--seq 32] [--batch 4]
  python benchmarks/first_step_phases.py --mode dp --grappler      # + graph optimization time
  python benchmarks/first_step_phases.py --mode dp --cprofile 25   # + the trace's top functions
                                                   #   and files (own time)
  python benchmarks/first_step_phases.py --mode dp --op-sources 30 # + which functions made the ops

The model and data are transformer_step_time.py's (keras_hub's BertBackbone, BERT-base
config, random weights; --model plain without keras_hub; --model cnn: the tutorial CNN,
example_models.mnist_cnn_layers, on random 28x28x1 images). One `model.train_on_batch` is the
first step; its wall time (`first_step_s`) is split into:

  make_train_function_s  building the train function (since session 48 the fast path's
                         writes check and batch-independence probe run in the step's first
                         trace, after its pass checks the call; other paths probe here)
  probe_s                inside it and in the trace: batch_independence.probe_model (the
                         batch-independence probe, cached on the model), all calls
  probe_runs_s           part of probe_s: the probe's two eager training-mode forward passes
                         (batch_independence._two_runs; `calls` counts them in pairs)
  writes_check_s         data_writes.refuse_model_writes (and data_dependent_writes): the
                         state-write check (one trace of the training-mode call and its
                         data-flow analysis; in the trace on the fast path and for a model
                         built by it, else in make_train_function)
  fingerprints_s         weight_fingerprints.changed and .record around the step (the
                         weights' digests: at the first train_on_batch the digest programs'
                         XLA compilations, one per distinct variable shape above
                         HOST_ELEMENTS), all calls, in the phase they run in (after_trace_s
                         for train_on_batch's own)
  routing_s              step.resolve_clipping in the trace (per-example checks, the plan,
                         the probe when not yet cached)
  trace_s                the Python trace of train_step (resolve_clipping and the clipped
                         sum's trace included)
  clipped_sum_trace_s    fast_clipping.clipped_grad_sum traced (part of trace_s)
  after_trace_s          first_step_s - trace_s - make_train_function_s: TensorFlow's
                         function instantiation (graph conversion, Grappler, partitioning,
                         kernel creation) and the first run
  grappler_s (--grappler) the graph optimizations (meta_optimizer's per-pass times, from
                         TF_CPP_VMODULE=meta_optimizer=1 in a child process), by pass, and
                         the graphs optimized (grappler_items: name -> input nodes; a name
                         twice is a function instantiated twice),
                         and the main graph's nodes before and after them
                         (grappler_input_nodes, grappler_output_nodes); a pass that rewrites
                         the main graph without shrinking it (memory_optimizer's AddN into
                         accumulators: nodes added) is listed in grappler_main_growth
  second_step_s          the next step (steady state): first_run_excess_s = after_trace_s -
                         grappler_s - second_step_s is what remains (first allocations,
                         oneDNN primitive creation, executor setup)

`cpu_s`: the same phases (first_step, make_train_function_s, probe_s, probe_runs_s,
writes_check_s, fingerprints_s, routing_s, trace_s, clipped_sum_trace_s, after_trace_s,
second_step) in process CPU seconds (all threads): less
sensitive than wall time to other processes' load. --xla-vector-width W: XLA's preferred CPU
vector width for the process (transformer_step_time.py's option; the children inherit it).

and the traced graph's size: `graph_ops` (ops of the function train_step is traced in, at the
end of train_step) and `function_body_nodes` (nodes of the function library: tf.cond / while
bodies, nested tf.functions), with the 12 most frequent op types. Prints one JSON line.
With --op-sources, also `dead_ops`: the traced ops neither the step's outputs nor a stateful
op depend on (a gradient function's gradients of inputs nothing asked for: the weights' in
the clipped sum's first backward pass), and the functions that made them (`dead_op_sources`).

--rss: the process's resident memory by phase (MiB; /proc/self/status): the high-water mark
VmHWM read at each phase's end and reset at its start (/proc/self/clear_refs; where that
file is not writable, the peak of VmRSS sampled every 10 ms by a thread), and VmRSS at its
end, and TensorFlow's CPU allocator peak and current bytes (alloc_peak_mib, alloc_end_mib; the
peak reset at each phase's start): `built` (model built and compiled), `make_train_function`, `trace` (the Python trace of
train_step), `after_trace` (function instantiation, Grappler, executor and kernel creation,
first run), `second_step`. With --grappler as well, the VmRSS samples of after_trace are
split at the Grappler log's timestamps: `before_grappler` (the traced graph turned into a
function library and GraphDef), `grappler` (the meta optimizer on the main graph and its
functions), `after_grappler` (partitioning, executors and kernels, the first run).
"""

import argparse
import collections
import cProfile
import functools
import io
import json
import os
import pstats
import re
import subprocess
import sys
import threading
import time
import warnings

if "--grappler-child" in sys.argv:
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  os.environ["TF_CPP_VMODULE"] = "meta_optimizer=1"
else:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras.internals import batch_independence  # noqa: E402
from tf_dpiter.keras.internals import data_writes  # noqa: E402
from tf_dpiter.keras.fast_clipping import clipping as fc_clipping  # noqa: E402
from tf_dpiter.keras.optimizer import weight_fingerprints  # noqa: E402
import transformer_step_time as tst  # noqa: E402

_TIMES = collections.defaultdict(float)
_CPU = collections.defaultdict(float)   # the same phases in process CPU seconds (all threads)
_CALLS = collections.Counter()


def _timed(name, fn):
  """fn, its wall time added to _TIMES[name] and its process CPU time to _CPU[name]
  (outermost calls only)."""
  depth = [0]

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    depth[0] += 1
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      return fn(*args, **kwargs)
    finally:
      depth[0] -= 1
      if depth[0] == 0:
        _TIMES[name] += time.perf_counter() - t0
        _CPU[name] += time.process_time() - c0
        _CALLS[name] += 1
  return wrapper


def _graph_size(graph):
  """(ops, function-library nodes, top op types) of a FuncGraph."""
  ops = graph.get_operations()
  lib = graph.as_graph_def().library.function
  types = collections.Counter(op.type for op in ops)
  for f in lib:
    types.update(n.op for n in f.node_def)
  return len(ops), sum(len(f.node_def) for f in lib), types.most_common(12)


def _op_sources(graph, n, ops=None):
  """The n tf_dpiter functions (file:function of the innermost tf_dpiter frame of each op's
  creation traceback) that created the most ops (of `ops`, default all the graph's), with
  their 3 most frequent op types."""
  by_src = collections.defaultdict(collections.Counter)
  for op in graph.get_operations() if ops is None else ops:
    src = "(outside tf_dpiter)"
    for frame in reversed(op.traceback):
      # (a constant shared by keras_internals.shared_constants: the function that asked)
      if "/tf_dpiter/" in frame.filename and "shared_constant" not in frame.name:
        src = f"{frame.filename.split('/tf_dpiter/')[-1]}:{frame.name}"
        break
    by_src[src][op.type] += 1
  top = sorted(by_src.items(), key=lambda kv: -sum(kv[1].values()))[:n]
  return [[src, sum(c.values()), c.most_common(3)] for src, c in top]


def _self_seconds_by_file(stats, n):
  """The n source files whose functions' own time (cProfile tottime, callees excluded) in the
  trace is largest, with tf_dpiter's files summed as well: [[file, seconds], ...]. The trace's
  Python splits into the library's own code and TensorFlow's op construction it calls."""
  by_file = collections.Counter()
  for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
    by_file[re.sub(r"^.*?(site-packages|/tf_dpiter)/", r"\1/", filename)] += tottime
  own = sum(t for f, t in by_file.items() if f.startswith("/tf_dpiter/"))
  return ([["(all tf_dpiter files)", round(own, 3)]] +
          [[f, round(t, 3)] for f, t in by_file.most_common(n)])


def _dead_ops(graph):
  """The ops of `graph` that neither its outputs nor a stateful op depend on (data or control):
  traced for nothing (a gradient function's gradients of inputs no one asked for, shape
  constants), removed by Grappler's pruning but paid for in the trace and the graph's
  conversion."""
  ops = graph.get_operations()
  stack = [t.op for t in graph.outputs] + [op for op in ops if op._is_stateful]  # pylint: disable=protected-access
  stack += list(graph.control_outputs)
  live = set()
  while stack:
    op = stack.pop()
    if op in live:
      continue
    live.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return [op for op in ops if op not in live]


class _RSS:
  """Resident memory by phase (module docstring, --rss). Final."""

  def __init__(self):
    self.phases = {}
    self.samples = []   # (time.time(), VmRSS KiB) every 10 ms
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    self._from = time.time()
    self._hwm_resets = self._reset()

  @staticmethod
  def _status():
    with open("/proc/self/status", encoding="ascii") as f:
      text = f.read()
    return {k: int(v) for k, v in re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, re.M)}

  @staticmethod
  def _reset():
    """Resets VmHWM to the current RSS; False where /proc/self/clear_refs is not writable."""
    try:
      with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
      return True
    except OSError:
      return False

  def _sample(self):
    while not self._stop.is_set():
      self.samples.append((time.time(), self._status()["VmRSS"]))
      self._stop.wait(0.01)

  def end(self, name):
    """Closes phase `name` (started where the previous one ended) and starts the next."""
    now, st = time.time(), self._status()
    sampled = [r for t, r in self.samples if self._from <= t <= now] + [st["VmRSS"]]
    peak = st["VmHWM"] if self._hwm_resets else max(sampled)
    mem = tf.config.experimental.get_memory_info("CPU:0")
    self.phases[name] = {"peak_mib": round(peak / 1024), "end_mib": round(st["VmRSS"] / 1024),
                         "alloc_peak_mib": round(mem["peak"] / 2**20),
                         "alloc_end_mib": round(mem["current"] / 2**20),
                         "s": round(now - self._from, 2)}
    tf.config.experimental.reset_memory_stats("CPU:0")
    self._from = now
    self._hwm_resets = self._reset()

  def window(self, start, end):
    """(peak, last) VmRSS MiB of the samples between the epoch seconds start and end."""
    got = [r for t, r in self.samples if start <= t <= end]
    return (round(max(got) / 1024), round(got[-1] / 1024)) if got else (None, None)

  def stop(self):
    self._stop.set()
    self._thread.join()


def _cnn(private):
  """The tutorial CNN (example_models.mnist_cnn_layers), DPSequential or keras.Sequential."""
  keras.utils.set_random_seed(0)
  layers = dp.keras.example_models.mnist_cnn_layers()
  return (dp.keras.DPSequential if private else keras.Sequential)(layers)


def _cnn_batch(b):
  rng = np.random.RandomState(0)
  return (rng.rand(b, 28, 28, 1).astype("float32"), rng.randint(0, 10, b).astype("int32"))


def run(a):
  """One first step, instrumented (module docstring); returns the JSON dict."""
  warnings.simplefilter("ignore")
  private = a.mode == "dp"
  rss = _RSS() if a.rss else None
  if a.model == "cnn":
    model, hub = _cnn(private), None
  else:
    model, _, hub = tst.build(a.model, a.seq, a.lora, private)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  opt = (dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01) if private
         else keras.optimizers.SGD(0.01))
  model.compile(optimizer=opt, loss=loss)
  if private:
    opt.set_sampling(10000, a.batch / 10000, "poisson", a.batch)
  x, y = _cnn_batch(a.batch) if a.model == "cnn" else tst.batch(a.batch, a.seq, hub)
  if rss is not None:
    rss.end("built")

  batch_independence.probe_model = _timed("probe_s", batch_independence.probe_model)
  # (module attributes: probe_model and batch_mixing_layers look them up when they run)
  batch_independence._two_runs = _timed("probe_runs_s", batch_independence._two_runs)  # pylint: disable=protected-access
  # (one timer: refuse_model_writes traces the call itself; other checks go through
  # data_dependent_writes; outermost calls only)
  writes = functools.partial(_timed, "writes_check_s")
  data_writes.refuse_model_writes = writes(data_writes.refuse_model_writes)
  data_writes.data_dependent_writes = writes(data_writes.data_dependent_writes)
  for name in ("changed", "record"):   # models.py calls them through the module
    setattr(weight_fingerprints, name, _timed("fingerprints_s", getattr(weight_fingerprints, name)))
  fc_clipping.clipped_grad_sum = _timed("clipped_sum_trace_s", fc_clipping.clipped_grad_sum)
  if private:
    step = opt.private_step
    step.resolve_clipping = _timed("routing_s", step.resolve_clipping)
  graph = {}
  inner_step = model.train_step
  profiler = cProfile.Profile() if a.cprofile else None

  def train_step(data):
    if profiler is not None:
      profiler.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      return inner_step(data)
    finally:
      _TIMES["trace_s"] += time.perf_counter() - t0
      _CPU["trace_s"] += time.process_time() - c0
      if profiler is not None:
        profiler.disable()
      graph["g"] = tf.compat.v1.get_default_graph()
      if rss is not None and "trace" not in rss.phases:
        rss.end("trace")

  model.train_step = train_step
  t0, c0 = time.perf_counter(), time.process_time()
  model.make_train_function()
  _TIMES["make_train_function_s"] = time.perf_counter() - t0
  _CPU["make_train_function_s"] = time.process_time() - c0
  if rss is not None:
    rss.end("make_train_function")
  t1, c1 = time.perf_counter(), time.process_time()
  model.train_on_batch(x, y)
  first, first_cpu = time.perf_counter() - t1, time.process_time() - c1
  if rss is not None:
    after_trace_from = rss._from   # pylint: disable=protected-access
    rss.end("after_trace")
    after_trace_to = time.time()
  t2, c2 = time.perf_counter(), time.process_time()
  model.train_on_batch(x, y)
  second, second_cpu = time.perf_counter() - t2, time.process_time() - c2
  if rss is not None:
    rss.end("second_step")
    rss.stop()
  out = {"mode": a.mode, "lora": a.lora, "batch": a.batch, "seq": a.seq,
         "jit_compile": bool(model.jit_compile),
         "clipping": getattr(model, "_dp_traced_clipping", None),   # the path it traced
         "first_step_s": round(first + _TIMES["make_train_function_s"], 2),
         "second_step_s": round(second, 2)}
  out.update({k: round(v, 2) for k, v in sorted(_TIMES.items())})
  out["after_trace_s"] = round(first - _TIMES["trace_s"], 2)
  out["cpu_s"] = {"first_step": round(first_cpu + _CPU["make_train_function_s"], 2),
                  **{k: round(v, 2) for k, v in sorted(_CPU.items())},
                  "after_trace_s": round(first_cpu - _CPU["trace_s"], 2),
                  "second_step": round(second_cpu, 2)}
  out["calls"] = dict(_CALLS)
  if "g" in graph:
    ops, lib, types = _graph_size(graph["g"])
    out.update({"graph_ops": ops, "function_body_nodes": lib, "top_op_types": types})
    if a.op_sources:
      out["op_sources"] = _op_sources(graph["g"], a.op_sources)
      dead = _dead_ops(graph["g"])
      out["dead_ops"] = len(dead)
      out["dead_op_sources"] = _op_sources(graph["g"], 8, dead)
  if profiler is not None:
    s = io.StringIO()
    stats = pstats.Stats(profiler, stream=s)
    stats.sort_stats("cumulative").print_stats(a.cprofile)
    out["cprofile_cumulative"] = [l for l in s.getvalue().splitlines() if re.match(r"\s+\d", l)]
    out["cprofile_self_s_by_file"] = _self_seconds_by_file(stats, a.cprofile)
  if rss is not None:
    out["rss_by_phase"] = rss.phases
    out["rss_hwm_reset"] = rss._hwm_resets   # pylint: disable=protected-access
    if a.grappler_child:   # for _grappler's split at the log's timestamps
      out["rss_after_trace_window"] = [after_trace_from, after_trace_to]
      out["rss_samples"] = [(round(t, 3), r) for t, r in rss.samples
                            if after_trace_from <= t <= after_trace_to]
  out["load_avg"] = os.getloadavg()
  return out


_PASS = re.compile(r"meta_optimizer\.cc:\d+\] (\S+?)(?:\{.*\})?: Graph size after: .* "
                   r"time = ([\d.]+)ms")

_GROWTH = re.compile(r"meta_optimizer\.cc:\d+\] (\S+?)(?:\{.*\})?: Graph size after: \d+ nodes "
                     r"\((-?\d+)\)")

_STAMP = re.compile(r"^I\d{4} \d\d:\d\d:(\d+\.\d+)\s+\d+ meta_optimizer\.cc", re.M)

_SIZE = re.compile(r"meta_optimizer\.cc:\d+\] \S+: Graph size after: (\d+) nodes \((-?\d+)\)")


def _grappler(a):
  """Runs the child with meta_optimizer logging; adds the Grappler time by pass."""
  args = [sys.executable, os.path.abspath(__file__), "--grappler-child"] + [
      s for s in sys.argv[1:] if s != "--grappler"]
  r = subprocess.run(args, capture_output=True, text=True, check=False)
  lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
  if not lines:
    raise SystemExit(r.stderr[-3000:])
  out = json.loads(lines[-1])
  by_pass = collections.defaultdict(float)
  for m in _PASS.finditer(r.stderr):
    by_pass[m.group(1)] += float(m.group(2)) / 1e3
  main = r.stderr.split("Optimized main graph")[0]
  sizes = _SIZE.findall(main)
  if sizes:   # the main graph's first pass: nodes before it = after - change
    out["grappler_input_nodes"] = int(sizes[0][0]) - int(sizes[0][1])
    out["grappler_output_nodes"] = int(sizes[-1][0])
  # the main graph's passes (the first grappler item) that added nodes
  first_item = re.split(r"Starting optimization for grappler item", main)
  first_item = first_item[1] if len(first_item) > 1 else main
  out["grappler_main_growth"] = [[m.group(1), int(m.group(2))] for m in _GROWTH.finditer(first_item)
                                 if int(m.group(2)) > 0]
  out["grappler_s"] = round(sum(by_pass.values()), 2)
  # each graph optimized: its name and the nodes its first pass started from
  items = re.split(r"Starting optimization for grappler item: (\S+)", r.stderr)[1:]
  out["grappler_items"] = []
  for name, log in zip(items[0::2], items[1::2]):
    first = _SIZE.search(log)
    out["grappler_items"].append(
        [name, int(first.group(1)) - int(first.group(2)) if first else None])
  out["grappler_by_pass_s"] = {k: round(v, 2) for k, v in
                               sorted(by_pass.items(), key=lambda kv: -kv[1])[:8]}
  out["first_run_excess_s"] = round(out["after_trace_s"] - out["grappler_s"]
                                    - out["second_step_s"], 2)
  samples = out.pop("rss_samples", None)
  stamps = [float(t) for t in _STAMP.findall(r.stderr)]
  if samples and stamps:   # the after-trace samples split at the Grappler log's first/last line
    start, end = out.pop("rss_after_trace_window")
    g0, g1 = min(stamps), max(stamps)
    split = {}
    for name, lo, hi in (("before_grappler", start, g0), ("grappler", g0, g1),
                         ("after_grappler", g1, end)):
      got = [r for t, r in samples if lo <= t <= hi]
      split[name] = {"peak_mib": round(max(got) / 1024) if got else None,
                     "end_mib": round(got[-1] / 1024) if got else None,
                     "s": round(hi - lo, 2)}
    out["rss_after_trace_split"] = split
  del a
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=["keras_hub", "plain", "cnn"], default="keras_hub",
                 help="cnn: the tutorial CNN on 28x28x1 inputs (--seq, --lora ignored)")
  p.add_argument("--mode", choices=["nonprivate", "dp"], default="dp")
  p.add_argument("--xla-vector-width", type=int, default=0,
                 help="XLA's preferred CPU vector width in bits (0: XLA_FLAGS left alone)")
  p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--grappler", action="store_true",
                 help="also time the graph optimizations (a child process logs them)")
  p.add_argument("--grappler-child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--op-sources", type=int, default=0,
                 help="print this many tf_dpiter functions that created the most ops")
  p.add_argument("--rss", action="store_true",
                 help="resident memory (VmHWM / VmRSS) by phase")
  p.add_argument("--cprofile", type=int, default=0,
                 help="print this many functions of the trace's cProfile (cumulative)")
  a = p.parse_args()
  tst.set_xla_vector_width(a.xla_vector_width)
  out = _grappler(a) if a.grappler else run(a)
  print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
