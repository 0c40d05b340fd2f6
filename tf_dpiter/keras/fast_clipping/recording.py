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
operations that consumed the unit's variables during its call (`rec["uses"]`) and the span
of graph operations the call created (`rec["span"]`), and `unrecorded_uses` names the
variables consumed by any other operation.

Uses through a derived tensor. A tensor computed from a variable inside a recorded call can
leave the call other than through its outputs: kept on a layer attribute (`self.w2 =
self.kernel * 2`) and read by another layer, by the model's own call or by a later call of the
same layer, or handed on as a Keras mask. Its consumers are other uses of the variable that
no recorded call produces: `unrecorded_uses` follows every tensor derived from a variable read
inside a call (through the operations the call created) and names the variable when such a
tensor is consumed outside that call and is not one of the call's outputs. An output of a
call computed from the variables but not from the call's inputs (no batch axis: a per-example
gradient of it does not exist) is named too.
"""

import threading

import tensorflow as tf

from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import runtime
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


def install(units, track_uses=False, first_tape=None):
  """Replaces each unit layer's `call` by a recording wrapper.

  Args:
    units: the plan's units (layers with their norm functions).
    track_uses: keep in each record the graph operations that consumed the unit's
      variables during the call (`rec["uses"]`); only in a traced forward pass (graph mode).
    first_tape: optional tf.GradientTape (watch_accessed_variables=False) of the first
      backward pass (the gradients at the units' watched tensors and outputs): each call's
      floating inputs are watched on it before the call and its floating outputs after,
      and the unit's variables before the call unless its norm function is marked
      `registry.watched_from_inputs`. That tape then records no read of such a unit's
      variables, so its backward pass forms no gradient of them (which nothing uses);
      `first_tape_misses` checks the mark on the traced pass.

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
      first = graph.version if graph is not None else None
      if first_tape is not None:
        first_tape.watch(_floating((args, kwargs)))
        if not _from_inputs_only(_unit):
          first_tape.watch(keras_internals.gradient_sources(_unit.variables))
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
      if first_tape is not None:
        first_tape.watch(_floating(outputs))
      if graph is not None:
        rec["uses"] = _consumers(graph, _unit) - before
        rec["span"] = (first, graph.version)   # graph.get_operations()[first:last]: the call's
      _unit.records.append(rec)
      return outputs

    installed.append(keras_internals.swap_call(layer, wrapped))
  return installed


def _floating(structure):
  """The floating (and complex) tensors of a nest: what a tape can watch."""
  return [t for t in tf.nest.flatten(structure)
          if tf.is_tensor(t) and (t.dtype.is_floating or t.dtype.is_complex)]


def _from_inputs_only(unit):
  """True if the first backward pass need not record the reads of the unit's variables: a
  ghost unit whose norm function is marked `registry.watched_from_inputs` (a vectorized
  unit's sources are its outputs, watched after the call, but its norm function may still
  serve a record: the mark is asked for every ghost unit)."""
  return unit.kind == plan_lib.GHOST and getattr(unit.norm_fn, "watched_from_inputs", False)


def first_tape_misses(units):
  """True if the first tape of a forward pass recorded with `install(units, track_uses=True,
  first_tape=...)` in the current (traced) graph may have missed a watched tensor of the
  first backward pass (of a ghost unit called once): one not computed (through
  gradient-carrying tensors the call created, no StopGradient) from one of the call's
  floating inputs, or from a read of the unit's variables where they were watched. The
  gradient at such a tensor there would miss paths to the loss: the caller then takes the
  first backward pass on the tape of all the variables, also for a rule marked
  `registry.watched_from_inputs` (e.g. a Dense fed integer inputs it casts in its call).

  Args:
    units: the plan's units after the forward pass.

  Returns:
    True if a watched tensor may be missed.
  """
  graph = tf.compat.v1.get_default_graph()
  operations = graph.get_operations()
  for unit in units:
    if _vectorized(unit) or "span" not in unit.records[0]:
      continue
    rec = unit.records[0]
    starts = {t.ref() for t in _floating((rec["args"], rec["kwargs"]))}
    if not _from_inputs_only(unit):
      starts |= {_variable_handle(graph, v).ref() for v in unit.variables}
    created = _created(operations, rec)
    for t in tf.nest.flatten(rec["watched"]):
      if not _reached_from(created, starts, t):
        return True
  return False


def _reached_from(created, starts, t, gradient_only=True):
  """True if `t` is one of `starts` (tensor refs) or computed from one of them by operations
  in `created` (a backward walk); `gradient_only`: through gradient-carrying tensors only, a
  StopGradient ending the path (what a tape that watched `starts` recorded)."""
  seen, todo = set(), [t]
  while todo:
    t = todo.pop()
    if t.ref() in starts:
      return True
    op = t.op
    if op in seen or op not in created:
      continue
    seen.add(op)
    if gradient_only and op.type in ("StopGradient", "PreventGradient"):
      continue
    todo.extend(i for i in op.inputs if not gradient_only or _carries_gradient(i))
  return False


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
  operations = graph.get_operations()   # in creation order (one list for every call's span)
  found = []
  for unit in units:
    inside = set(before)
    for rec in unit.records:
      inside |= rec.get("uses", set())
    for v in unit.variables:
      handle = _variable_handle(graph, v)
      outside = {op for op in handle.consumers() if op not in inside}
      for rec in unit.records:
        outside |= _escaping_uses(operations, rec, handle, _vectorized(unit))
      if outside:
        found.append((unit.layer.name, v.path, tuple(sorted({op.type for op in outside}))))
  return found


# dtypes that carry no gradient: a tensor of them derived from a variable (its shape, a
# comparison) is no use of the variable's value the gradient follows
_NO_GRADIENT = (tf.bool, tf.string)


def _carries_gradient(t):
  return not (t.dtype in _NO_GRADIENT or t.dtype.is_integer)


def _created(operations, rec):
  """The operations the recorded call `rec` created (a set, kept in the record)."""
  if "created" not in rec:
    first, last = rec["span"]
    rec["created"] = frozenset(operations[first:last])
  return rec["created"]


def _vectorized(unit):
  """True if the unit's records get vectorized per-example gradients (`vectorized_grads`,
  re-running the call on each example), as clipping._sources decides: every unit but a
  ghost unit called once whose norm function served the call."""
  return not (unit.kind == plan_lib.GHOST and len(unit.records) == 1 and
              unit.records[0]["watched"] is not None)


def _escaping_uses(operations, rec, handle, vectorized):
  """The operations outside the recorded call `rec` that consume a tensor derived (inside the
  call, through the operations it created) from a read of `handle` in it, other than the
  call's outputs; and, for a `vectorized` record (re-run on each example with the gradient at
  each of its outputs sliced per example), the operation computing an output so derived that
  does not depend on the call's inputs (no batch axis: the sliced gradient would not be the
  example's). A registered norm function's outputs (a position table broadcast to the batch)
  are its rule's to get right.

  A forward walk from the call's reads of the variable over the operations the call created:
  its tensors that carry a gradient (float, complex, resource, variant) are the derived
  ones. Linear in the operations the call created."""
  if "span" not in rec:
    return set()
  reads = [op for op in handle.consumers() if op in rec.get("uses", ())]
  if not reads:
    return set()
  created = _created(operations, rec)
  outputs = {t.ref() for t in tf.nest.flatten(rec["outputs"]) if tf.is_tensor(t)}
  escaping, seen, todo, derived = set(), set(reads), list(reads), set()
  while todo:
    op = todo.pop()
    if op.type in ("StopGradient", "PreventGradient"):
      continue
    for t in op.outputs:
      if not _carries_gradient(t):
        continue
      derived.add(t.ref())
      for consumer in t.consumers():
        if consumer in created:
          if consumer not in seen:
            seen.add(consumer)
            todo.append(consumer)
        elif t.ref() not in outputs:
          escaping.add(consumer)
  # an output not computed from the call's tensor arguments (a backward walk): no batch axis
  args = {a.ref() for a in tf.nest.flatten((rec["args"], rec["kwargs"])) if tf.is_tensor(a)}
  unbatched = [t for t in tf.nest.flatten(rec["outputs"]) if vectorized and tf.is_tensor(t) and
               t.ref() in derived and not _reached_from(created, args, t, gradient_only=False)]
  return escaping | {t.op for t in unbatched}


def uninstall(installed):
  """Restores the layers' own `call` (the tokens `install` returned), last first.

  Args:
    installed: the tokens `install` returned.

  Returns:
    None.
  """
  for token in reversed(installed):
    keras_internals.restore_call(token)


def vectorized_grads(unit, rec, out_grads):
  """Per-example gradients [B, *v.shape] of <outputs, out_grads> w.r.t. the
  unit's variables, re-running the layer on each example (tf.vectorized_map; a loop over
  the examples, tf.map_fn, where the call runs keras.ops.scan: runtime.loops_over_lists).
  """
  structure = (rec["args"], rec["kwargs"])
  flat = tf.nest.flatten(structure)
  batched = [i for i, t in enumerate(flat) if tf.is_tensor(t) and (t.shape.rank or 0) >= 1]
  xs = [flat[i] for i in batched]
  sources = keras_internals.gradient_sources(unit.variables)
  list_loops = []

  def one(elems, check_loops=False):
    first = tf.compat.v1.get_default_graph().version
    new_flat = list(flat)
    for k, i in enumerate(batched):
      new_flat[i] = tf.expand_dims(elems[k], 0)
    args, kwargs = tf.nest.pack_sequence_as(structure, new_flat)
    with tf.GradientTape() as tape:
      out = tf.nest.flatten(unit.orig_call(*args, **kwargs))
      s = tf.add_n([
          tf.reduce_sum(tf.cast(o, tf.float32) *
                        tf.cast(tf.expand_dims(g, 0), tf.float32))
          for o, g in zip(out, elems[len(xs):])
      ])
    loops = runtime.loops_over_lists(first) if check_loops else ()
    if loops:   # before pfor converts the body
      list_loops.extend(loops)
      raise runtime.ListLoop(f"while loops over a TensorList: {list(loops)}")
    grads = tape.gradient(s, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]

  elems = xs + list(out_grads)
  try:
    return tf.vectorized_map(lambda e: one(e, check_loops=True), elems)
  except runtime.ListLoop:
    # keras.ops.scan in the call: pfor converts it wrongly; the examples one at a time
    runtime.refuse_list_loops_under_xla(list_loops)
  return tf.map_fn(one, elems, fn_output_signature=[tf.TensorSpec(v.shape, v.dtype)
                                                     for v in sources])
