"""tf.custom_gradient's gradient functions held by the graph they were traced in.

TensorFlow's `tf.custom_gradient`, traced in a graph (inside a tf.function), registers its
gradient function under a new name ("CustomGradient-<uid>") in TensorFlow's process-wide
gradient registry (`ops.gradient_registry`) and never removes it. The function closes over
the traced outputs, so the registry keeps every graph the library's custom gradients were
traced in (a whole DP train step, with its functions and their compiled kernels) alive until
the process ends: many fits in one process (a notebook, a test suite) grow without bound.
`graph_owned_gradients` moves each such function onto the graph it was traced in and leaves in
the registry a forwarder that holds the graph weakly; a finalizer removes the entry when the
graph is collected. While the graph lives, a gradient of it finds the same function.
"""

import functools
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

_PREFIX = "CustomGradient-"
_OWNED = "_tf_dpiter_custom_gradients"


def graph_owned_gradients(fn, *args):
  """fn(*args), the tf.custom_gradient functions it registered held by the current graph.

  Args:
    fn: a callable that may call `tf.custom_gradient` functions.
    *args: its arguments.

  Returns:
    fn(*args).
  """
  registry = getattr(getattr(tf_ops, "gradient_registry", None), "_registry", None)
  if tf.executing_eagerly() or not isinstance(registry, dict):
    return fn(*args)
  before = set(registry)
  out = fn(*args)
  graph = tf_ops.get_default_graph()
  owned = getattr(graph, _OWNED, None)
  if owned is None:
    owned = {}
    setattr(graph, _OWNED, owned)
  graph_ref = weakref.ref(graph)
  for name in [k for k in registry if k not in before and k.startswith(_PREFIX)]:
    entry = registry[name]
    owned[name] = entry["type"]
    registry[name] = dict(entry, type=functools.partial(_forward, graph_ref, name))
    weakref.finalize(graph, registry.pop, name, None)
  return out


def _forward(graph_ref, name, op, *grads):
  return getattr(graph_ref(), _OWNED)[name](op, *grads)
