"""Recording forward pass of fast clipping: each unit layer's `call` is replaced,
for one forward pass, by a wrapper that runs its norm function (ghost units) and
records the call; and vectorized per-example gradients of a recorded call.

`layer.call` is swapped on the live layers: `CALL_LOCK` keeps replica threads
(tf.distribute) from interleaving their wrappers on the shared layers.

Uses outside the recorded calls. A unit's norm and clipped sum see its variables only
through its recorded calls: a variable also read elsewhere (a tied output projection
`h @ embedding.embeddings^T` in another layer, a sublayer's kernel read by its parent
without calling the sublayer) has a gradient part no recorded call produces. When a
traced forward pass is recorded with `track_uses=True`, each record keeps the graph
operations that consumed the unit's variables during its call (`rec["uses"]`), and
`unrecorded_uses` names the variables consumed by any other operation.
"""

import threading

import tensorflow as tf

from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.fast_clipping import plan as plan_lib

CALL_LOCK = threading.RLock()


def _variable_handle(graph, variable):
  """The placeholder of `variable`'s resource handle in the traced `graph` (captured
  once per graph: every read of the variable in it consumes this tensor)."""
  # the backend tf.Variable (Keras 3's TensorFlow variable keeps it as `_value`; `value`
  # is a cast tensor inside a mixed-precision layer's call)
  backend = getattr(variable, "_value", None)
  if not isinstance(backend, tf.Variable):
    backend = keras_internals.gradient_sources([variable])[0]
  return graph.capture(backend.handle)


def _consumers(graph, unit):
  """The operations of `graph` that consume one of the unit's variables, so far."""
  return {op for v in unit.variables for op in _variable_handle(graph, v).consumers()}


def install(units, track_uses=False):
  """Replaces each unit layer's `call` by a recording wrapper.

  Args:
    units: the plan's units (layers with their norm functions).
    track_uses: keep in each record the graph operations that consumed the unit's
      variables during the call (`rec["uses"]`); only in a traced forward pass (graph mode).

  Returns:
    tokens for `uninstall`.
  """
  installed = []
  graph = tf.compat.v1.get_default_graph() if track_uses else None
  for unit in units:
    layer = unit.layer
    orig = layer.call  # bound method of the class (or an earlier override)
    unit.orig_call = orig

    def wrapped(*args, _unit=unit, _orig=orig, **kwargs):
      rec = {"args": args, "kwargs": kwargs, "watched": None}
      before = _consumers(graph, _unit) if graph is not None else None
      outputs = None
      if _unit.kind == plan_lib.GHOST:
        res = _unit.norm_fn(_unit.layer, *args, **kwargs)
        if res is not None:
          outputs, watched, sqr_norm_fn = res
          rec["watched"] = watched
          rec["sqr_norm_fn"] = sqr_norm_fn
      if outputs is None:
        outputs = _orig(*args, **kwargs)
      rec["outputs"] = outputs
      if graph is not None:
        rec["uses"] = _consumers(graph, _unit) - before
      _unit.records.append(rec)
      return outputs

    installed.append(keras_internals.swap_call(layer, wrapped))
  return installed


def variable_consumers(units):
  """The operations of the current (traced) graph that consume the units' variables so far:
  the uses from before a recorded forward pass, which `unrecorded_uses` leaves out.

  Args:
    units: the plan's units.

  Returns:
    a set of tf.Operation.
  """
  graph = tf.compat.v1.get_default_graph()
  return {op for unit in units for op in _consumers(graph, unit)}


def unrecorded_uses(units, before=frozenset()):
  """The variables consumed outside their unit's recorded calls in a forward pass recorded
  with `install(units, track_uses=True)` in the current (traced) graph.

  Args:
    units: the plan's units after the forward pass.
    before: the operations that consumed the units' variables before the pass
      (`variable_consumers`), not counted: a pass traced in a graph that already reads them.

  Returns:
    a list of (layer name, variable path, sorted operation types of the outside uses).
  """
  graph = tf.compat.v1.get_default_graph()
  found = []
  for unit in units:
    inside = set(before)
    for rec in unit.records:
      inside |= rec.get("uses", set())
    for v in unit.variables:
      outside = [op for op in _variable_handle(graph, v).consumers() if op not in inside]
      if outside:
        found.append((unit.layer.name, v.path, tuple(sorted({op.type for op in outside}))))
  return found


def uninstall(installed):
  """Restores the layers' own `call` (the tokens `install` returned), last first.

  Args:
    installed: the tokens `install` returned.

  Returns:
    None.
  """
  for token in reversed(installed):
    keras_internals.restore_call(token)


def _is_batched(t):
  return tf.is_tensor(t) and t.shape.rank is not None and t.shape.rank >= 1


def vectorized_grads(unit, rec, out_grads):
  """Per-example gradients [B, *v.shape] of <outputs, out_grads> w.r.t. the
  unit's variables, re-running the layer on each example (tf.vectorized_map).
  """
  structure = (rec["args"], rec["kwargs"])
  flat = tf.nest.flatten(structure)
  batched = [i for i, t in enumerate(flat) if _is_batched(t)]
  xs = [flat[i] for i in batched]
  n_x = len(xs)
  variables = unit.variables
  orig = unit.orig_call

  def one(elems):
    new_flat = list(flat)
    for k, i in enumerate(batched):
      new_flat[i] = tf.expand_dims(elems[k], 0)
    args, kwargs = tf.nest.pack_sequence_as(structure, new_flat)
    with tf.GradientTape() as tape:
      out = tf.nest.flatten(orig(*args, **kwargs))
      s = tf.add_n([
          tf.reduce_sum(tf.cast(o, tf.float32) *
                        tf.cast(tf.expand_dims(g, 0), tf.float32))
          for o, g in zip(out, elems[n_x:])
      ])
    grads = tape.gradient(s, keras_internals.gradient_sources(variables),
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]

  return tf.vectorized_map(one, xs + list(out_grads))
