"""A DP model's traced steps are freed with the model: many fits in one process do not grow.

TensorFlow's tf.custom_gradient, traced in a graph, registers its gradient function in a
process-wide registry that would hold the traced DP step (the per-record losses of the fast
path, tf_dpiter/keras/optimizer/record_losses.py) for the rest of the process; the library
moves it onto the step's graph (keras_internals.graph_owned_gradients). TensorFlow's
Dataset.scan adds its function to the global default graph even when executing eagerly, which
would hold the fit's sampler and the arrays it reads (tf_dpiter/data/python_source.py); the
library takes it out again. Checked: after a shuffled fit of a DP model and its deletion, the
live traced graphs (FuncGraph) and TensorFlow's gradient registry are no more than they were
after a first, identical fit (one fit more is enough: each leaked step is counted).
"""

import gc

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops as tf_ops

import tf_dpiter as dp


def _fit(jit):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 3)).astype("float32")
  y = rng.normal(size=(16, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse",
                jit_compile=jit)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffle")


def _alive():
  gc.collect()
  graphs = sum(1 for o in gc.get_objects() if isinstance(o, func_graph.FuncGraph))
  return graphs, len(tf_ops.gradient_registry._registry)   # pylint: disable=protected-access


def test_a_deleted_dp_model_frees_its_traced_steps():
  """Both modes in one measurement (graph and jit_compile=True): each mode's extra fit would
  add its leaked step to both counts, and the two collections and object scans of a worker's
  large heap are paid once (benchmarks/SUITE_CUTS.md, session 45)."""
  for jit in (False, True):
    _fit(jit)   # first uses: the library's module-level tf.functions trace once per mode
  before = _alive()
  for jit in (False, True):
    _fit(jit)   # one more identical fit: a fit that kept its traced step would add to both
  after = _alive()
  # no growth; fewer is fine (a graph an earlier test left to a cache may go meanwhile)
  assert after[0] <= before[0] and after[1] <= before[1], (after, before)
