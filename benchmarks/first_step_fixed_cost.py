"""The fixed cost of the first DP step of a small model, against Keras' own first step.

  python benchmarks/first_step_fixed_cost.py [--models tiny,cnn] [--modes dp,nonprivate]
  python benchmarks/first_step_fixed_cost.py --models tiny --modes dp --sources 15

Each (model, mode) pair runs in a fresh child process (nothing traced or cached is shared),
and prints, for its first `model.train_on_batch` (and with --fit, the first `model.fit` epoch
of one step, in a second fresh model of the same process):

  first_step_s     make_train_function plus the first train_on_batch (wall seconds);
                   first_step_cpu_s: the process's CPU seconds over the same span (all its
                   threads: less sensitive to other processes' load than wall time)
  trace_s          the Python trace of train_step (the model's train_step called while tracing)
  after_trace_s    first_step_s - trace_s: TensorFlow's function instantiation (graph
                   conversion, Grappler, kernel creation) and the first run
  second_step_s    the next train_on_batch (steady state)
  graph_ops        ops of the graph train_step is traced in; function_body_nodes: the nodes of
                   its function library (tf.cond branches, nested tf.functions)
  first_fit_s      (--fit) a fresh model's first fit epoch of one step, compile included

With --warm, a first model of the same kind takes one step before the measured model is
built, so that what a process traces once (the ledger's shared write function, for one) is
done: the per-model cost a test suite pays for each of its models; keys then get "warm_".

Models: `tiny` (Input(20) -> Dense(32, relu) -> Dense(2), batch 32) and `cnn` (TF Privacy's
MNIST tutorial CNN, tf_dpiter.keras.example_models.mnist_cnn_layers, batch 64). DP is
DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1) with its default settings,
sampling declared as Poisson (n = 60,000, the batch size expected); non-private is
keras.optimizers.SGD on keras.Sequential of the same layers.

--sources N: where the DP trace spends its ops and its seconds, by tf_dpiter source file
(ops: the innermost tf_dpiter frame of each op's creation traceback; seconds: the trace's
wall time split by the innermost tf_dpiter frame of the main thread's stack, sampled every
~1 ms by a thread -- by file and by function), and the functions of the library with their
node counts -- the N largest of each.

Prints one JSON line: {"results": {"<model>_<mode>": {...}}, "ratios": {"<model>": DP /
non-private of first_step_s}, "load_avg": ...} (benchmarks/compare_revisions.py reads it:
give this script's absolute path to run the same benchmark on two revisions).
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _models(kind):
  """(layers, x, y) for the model kind."""
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tf_dpiter as dp  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(0)
  if kind == "tiny":
    layers = [keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
              keras.layers.Dense(2)]
    x = rng.rand(32, 20).astype("float32")
    y = rng.randint(0, 2, 32).astype("int32")
  else:
    layers = dp.keras.example_models.mnist_cnn_layers()
    x = rng.rand(64, 28, 28, 1).astype("float32")
    y = rng.randint(0, 10, 64).astype("int32")
  return layers, x, y


def _build(kind, private):
  import keras  # pylint: disable=import-outside-toplevel
  import tf_dpiter as dp  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  layers, x, y = _models(kind)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if private:
    model = dp.keras.DPSequential(layers)
    opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                       learning_rate=0.1)
    model.compile(optimizer=opt, loss=loss)
    opt.set_sampling(60000, len(x) / 60000, "poisson", len(x))
  else:
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
  return model, x, y


def _source_of(filename):
  if "/tf_dpiter/" in filename:
    return filename.split("/tf_dpiter/")[-1]
  return "(outside tf_dpiter)"


def _op_sources(graph, n):
  """The n tf_dpiter files that created the most ops of graph, with their top op types."""
  by_src = collections.defaultdict(collections.Counter)
  for op in graph.get_operations():
    src = "(outside tf_dpiter)"
    for frame in reversed(op.traceback):
      if "/tf_dpiter/" in frame.filename:
        src = _source_of(frame.filename)
        break
    by_src[src][op.type] += 1
  top = sorted(by_src.items(), key=lambda kv: -sum(kv[1].values()))[:n]
  return [[src, sum(c.values()), c.most_common(4)] for src, c in top]


class _Sampler:
  """Samples the main thread's stack every ~1 ms while on; each sample is charged to the
  innermost tf_dpiter frame (file:function) and, separately, to its file. Final."""

  def __init__(self):
    self.by_function = collections.Counter()
    self.by_file = collections.Counter()
    self.samples = 0
    self._on = threading.Event()
    self._stop = threading.Event()
    self._main = threading.main_thread().ident
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      if self._on.is_set():
        frame = sys._current_frames().get(self._main)  # pylint: disable=protected-access
        src = fn = "(outside tf_dpiter)"
        while frame is not None:
          if "/tf_dpiter/" in frame.f_code.co_filename:
            src = _source_of(frame.f_code.co_filename)
            fn = f"{src}:{frame.f_code.co_name}"
            break
          frame = frame.f_back
        self.by_function[fn] += 1
        self.by_file[src] += 1
        self.samples += 1
      time.sleep(0.001)

  def enable(self):
    self._on.set()

  def disable(self):
    self._on.clear()

  def stop(self):
    self._stop.set()
    self._thread.join()

  def top(self, counter, n, seconds):
    """[[name, seconds]] of the n names with the most samples, scaled to `seconds`."""
    total = max(1, self.samples)
    return [[k, round(v / total * seconds, 3)] for k, v in counter.most_common(n)]


def run_one(kind, mode, sources, fit, warm):
  """One (model, mode) first step, in this process; the dict of the module docstring."""
  warnings.simplefilter("ignore")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  private = mode == "dp"
  if warm:   # a first model trained before: what the process traces once is done
    model, x, y = _build(kind, private)
    model.train_on_batch(x, y)
  model, x, y = _build(kind, private)
  inner = model.train_step
  seen = {"trace_s": 0.0}
  profiler = _Sampler() if sources else None
  if profiler is not None:
    sys.setswitchinterval(0.0005)

  def train_step(data):
    if profiler is not None:
      profiler.enable()
    t0 = time.perf_counter()
    try:
      return inner(data)
    finally:
      seen["trace_s"] += time.perf_counter() - t0
      if profiler is not None:
        profiler.disable()
      seen["graph"] = tf.compat.v1.get_default_graph()

  model.train_step = train_step
  t0, c0 = time.perf_counter(), time.process_time()
  model.make_train_function()
  model.train_on_batch(x, y)
  first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
  t1 = time.perf_counter()
  model.train_on_batch(x, y)
  second = time.perf_counter() - t1
  out = {"first_step_s": round(first, 3), "first_step_cpu_s": round(first_cpu, 3),
         "trace_s": round(seen["trace_s"], 3),
         "after_trace_s": round(first - seen["trace_s"], 3), "second_step_s": round(second, 4)}
  if "graph" in seen:
    g = seen["graph"]
    out["graph_ops"] = len(g.get_operations())
    out["function_body_nodes"] = sum(len(f.node_def) for f in g.as_graph_def().library.function)
    if sources:
      out["op_sources"] = _op_sources(g, sources)
      profiler.stop()
      out["trace_s_by_file"] = profiler.top(profiler.by_file, sources, seen["trace_s"])
      out["trace_s_by_function"] = profiler.top(profiler.by_function, sources,
                                                seen["trace_s"])
      out["function_library"] = sorted(
          ([f.signature.name[:60], len(f.node_def)] for f in g.as_graph_def().library.function),
          key=lambda kv: -kv[1])[:sources]
  if warm:
    out = {"warm_" + k: v for k, v in out.items()}
  if fit:
    model2, x2, y2 = _build(kind, private)
    t2 = time.perf_counter()
    if private:
      model2.fit(x2, y2, batch_size=len(x2), epochs=1, verbose=0, sampling="shuffle")
    else:
      model2.fit(x2, y2, batch_size=len(x2), epochs=1, verbose=0)
    out[("warm_" if warm else "") + "first_fit_s"] = round(time.perf_counter() - t2, 3)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="tiny,cnn")
  p.add_argument("--modes", default="dp,nonprivate")
  p.add_argument("--sources", type=int, default=0,
                 help="the N tf_dpiter files making the most ops / trace seconds (DP)")
  p.add_argument("--fit", action="store_true", help="also a fresh model's first fit epoch")
  p.add_argument("--warm", action="store_true",
                 help="measure a second model of the process (a first one trained before it): "
                      "the per-model cost, without what a process traces once")
  p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    print(json.dumps(run_one(a.child[0], a.child[1], a.sources, a.fit, a.warm)), flush=True)
    return 0
  results = {}
  for kind in a.models.split(","):
    for mode in a.modes.split(","):
      args = [sys.executable, os.path.abspath(__file__), "--child", kind, mode,
              "--sources", str(a.sources)] + (["--fit"] if a.fit else []) + (
                  ["--warm"] if a.warm else [])
      r = subprocess.run(args, capture_output=True, text=True, check=False)
      lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
      if r.returncode or not lines:
        raise SystemExit(f"{kind} {mode} failed:\n{r.stderr[-3000:]}")
      results[f"{kind}_{mode}"] = json.loads(lines[-1])
  ratios = {}
  for kind in a.models.split(","):
    dp_r, np_r = results.get(f"{kind}_dp"), results.get(f"{kind}_nonprivate")
    if dp_r and np_r:
      key = "warm_first_step_s" if a.warm else "first_step_s"
      ratios[kind] = round(dp_r[key] / np_r[key], 2)
  print(json.dumps({"results": results, "ratios": ratios, "load_avg": os.getloadavg()}),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
