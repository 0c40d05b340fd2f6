"""The first `model.fit` of a small DP model: its CPU seconds and the ops its trace builds.

  python benchmarks/fit_trace_cost.py --model dense --clipping fast [--jit] [--op-sources 30]
  python benchmarks/fit_trace_cost.py --model cnn --cprofile /tmp/fit.prof   # + a profile
  python benchmarks/fit_trace_cost.py --model cnn --nonprivate   # the plain Keras baseline

The fit measured is the first fit of a second model built in the process (the first model's
fit pays the process' one-time costs: lazy imports, tf.data's and XLA's set-up), as a test
of the default suite fits after others: batch_size 10, steps_per_epoch 2, one epoch.
Settings are the default test tier's (tests/conftest.py): XLA's CPU backend at LLVM -O0
unless XLA_FLAGS is set, Grappler's graph optimizations off.

Models: `dense` (4 -> Dense(8, relu) -> Dense(1), mse: the size most tests fit), `mlp`
(example_models.mlp_layers(64), 784 -> 64 -> 10), `cnn` (example_models.mnist_cnn_layers,
the tutorial CNN on 28x28x1).

Prints one JSON line: `fit_cpu_s` (process CPU, user + system, of the measured fit),
`fit_wall_s`, `graphs` and `ops` (the FuncGraphs traced during the fit and their ops: the
train function, its loops' and conditions' branches, the dataset's functions) and with
--op-sources the tf_dpiter functions that made the most ops (innermost tf_dpiter frame of
each op's creation traceback). With --cprofile the fit runs under cProfile on a CPU-time
timer (about 3-4x slower) and the stats are written to the given file.
"""

import argparse
import cProfile
import collections
import json
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import func_graph  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras import example_models  # noqa: E402


def _build(name, clipping, jit, nonprivate=False):
  """(compiled model, x, y) of `name` (module docstring): DP, or plain Keras if `nonprivate`."""
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  if name == "dense":
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    x = rng.normal(size=(100, 4)).astype("float32")
    y, loss = x[:, :1], "mse"
  else:
    layers = example_models.mlp_layers(64) if name == "mlp" else example_models.mnist_cnn_layers()
    shape = (100, 784) if name == "mlp" else (64, 28, 28, 1)
    x = rng.normal(size=shape).astype("float32")
    y = (np.arange(shape[0]) % 10).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if nonprivate:
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(learning_rate=0.1), loss, jit_compile=jit)
  else:
    model = dp.keras.DPSequential(layers)
    model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, clipping=clipping),
                  loss, jit_compile=jit)
  return model, x, y


def _fit(model, x, y):
  model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=2, verbose=0)


def _op_sources(graphs, n):
  """[[tf_dpiter file:function, ops], ...] for the n functions that made the most ops."""
  by_source = collections.Counter()
  for graph in graphs:
    for op in graph.get_operations():
      source = "(outside tf_dpiter)"
      for frame in reversed(op.traceback or []):
        if "/tf_dpiter/" in frame.filename and "shared_constant" not in frame.name:
          source = f"{frame.filename.split('/tf_dpiter/')[-1]}:{frame.name}"
          break
      by_source[source] += 1
  return [list(item) for item in by_source.most_common(n)]


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=["dense", "mlp", "cnn"], default="dense")
  p.add_argument("--clipping", choices=["fast", "vectorized", "auto"], default="fast")
  p.add_argument("--jit", action="store_true", help="compile(jit_compile=True)")
  p.add_argument("--nonprivate", action="store_true",
                 help="the same model and fit with keras.Sequential and keras.optimizers.SGD "
                      "(the DP overhead's baseline; --clipping is ignored)")
  p.add_argument("--op-sources", type=int, default=0, help="list this many op sources")
  p.add_argument("--cprofile", default=None, help="write the fit's cProfile stats here")
  a = p.parse_args()
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
  graphs, traced = [], func_graph.func_graph_from_py_func

  def recording(*args, **kwargs):
    graph = traced(*args, **kwargs)
    graphs.append(graph)
    return graph

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _fit(*_build(a.model, a.clipping, a.jit, a.nonprivate))   # the process' one-time costs
    model, x, y = _build(a.model, a.clipping, a.jit, a.nonprivate)
    profile = cProfile.Profile(time.process_time) if a.cprofile else None
    func_graph.func_graph_from_py_func = recording
    try:
      cpu, wall = time.process_time(), time.perf_counter()
      if profile is not None:
        profile.enable()
      _fit(model, x, y)
      if profile is not None:
        profile.disable()
      cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
      func_graph.func_graph_from_py_func = traced
  if profile is not None:
    profile.dump_stats(a.cprofile)
  out = {"model": a.model, "clipping": "nonprivate" if a.nonprivate else a.clipping, "jit": a.jit, "fit_cpu_s": round(cpu, 3),
         "fit_wall_s": round(wall, 3), "graphs": len(graphs),
         "ops": sum(len(g.get_operations()) for g in graphs),
         "load": os.getloadavg()[0], "profiled": profile is not None}
  if a.op_sources:
    out["op_sources"] = _op_sources(graphs, a.op_sources)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
