"""Clipped gradient sum with ghost norms (fast per-example clipping).

For a sample of B records (examples) with per-example losses L_i, returns

    sum_i g_i * min(1, C / ||g_i||_2),   g_i = d L_i / d theta,

(the clipped sum of McMahan et al. 2018, Sec. 2, pi_C) without materializing
g_i for registered layers: ||g_i||^2 is the sum over layers of per-layer
squared norms computed from the layer's inputs and the gradient at its output
(Goodfellow 2015; Li et al. 2021, Sec. 4). Trainable layers that are not
registered get vectorized per-example gradients for their own variables
(tf.vectorized_map); their squared norms are added to the ghost norms
(plan.py says which layer is which).

Two ways to form the clipped sum once the clip factors c_i are known:
  * "bookkeeping" (Bu et al. 2023, Sec. 3): one backward pass to the layer
    outputs, then per layer the vector-Jacobian product with c_i * dz_i.
  * "two_pass" (Li et al. 2021): a second backward pass of sum_i c_i L_i.
Both are exact in float32; the default is the one measured faster
(BENCHMARKS.md). A registered layer whose norm function returns the per-example
gradients (registry.PerExampleGrads: small convolutions, LayerNorm) is summed
as sum_i c_i g_i instead of by a vector-Jacobian product.

Recording. For one forward pass each unit layer's `call` is replaced (`install`) by a wrapper
that runs its norm function (ghost units) and records the call; `layer.call` is swapped on the
live layers, so `CALL_LOCK` keeps replica threads (tf.distribute) from interleaving their
wrappers. A vectorized unit's recorded calls are re-run per example (`vectorized_grads`).

Uses outside the recorded calls. A unit's norm and clipped sum see its variables only
through its recorded calls: a variable also read elsewhere (a tied output projection
`h @ embedding.embeddings^T` in another layer, a sublayer's kernel read by its parent
without calling the sublayer) has a gradient part no recorded call produces. When a
traced forward pass is recorded with `track_uses=True`, each record keeps the graph
operations that consumed the unit's variables during its call (`rec["uses"]`) and the span
of graph operations the call created (`rec["span"]`), and `unrecorded_uses` names the
variables consumed by any other operation. A tensor computed from a variable inside a
recorded call can also leave the call other than through its outputs: kept on a layer
attribute (`self.w2 = self.kernel * 2`) and read by another layer, by the model's own call
or by a later call of the same layer, or handed on as a Keras mask. `unrecorded_uses`
follows every tensor derived from a variable read inside a call (through the operations the
call created) and names the variable when such a tensor is consumed outside that call and is
not one of the call's outputs; an output of a vectorized call computed from the variables
but not from the call's inputs (no batch axis) is named too.

Dtype policies. The norms, the clip factors and the clipped sum are
float32 whatever the compute dtype: the ghost products cast activations and
backprops to float32, and the vector-Jacobian product of a 16-bit layer is
taken through its norm function's float32 recomputation of the watched tensor
(registry.float32_watched), so the 16-bit model math is kept but no sum over
records is formed in 16 bits. Under float16 the summed loss is multiplied by a
static loss scale S (runtime.loss_scale) and the norms and sums divided by it.
A record whose norm is not finite gets clip factor 0 and adds nothing, as on
the vectorized path (a function of that record alone). Only "bookkeeping" is
exact under 16-bit compute; "two_pass" is refused there.

Memory. Book-keeping keeps every ghost layer's output gradient and input (and the vectorized
layers' per-example gradients) for the whole batch until the clip factors are known: bytes
that grow with the batch (the LSTM language model's logits gradient, 320,000 bytes per
example). Where they would exceed rules/budget.KEPT_BYTES, the clipped sum is formed over
physical chunks of whole records, one chunk at a time in a tf.while_loop (forward, norms,
factors, sum; the chunks' sums added): the clip factor of a record is a function of that
record's norm alone, so the sum is the same. The kept bytes per example are measured on a
forward pass traced (never run) on one record and the chunk is chosen at trace time; a batch
the trace does not know runs ceil(B / m) balanced chunks (one when it fits), under XLA it is
one call. The Keras models' train step passes physical_chunks=False: its loss reads the
whole batch's record weights, and it splits the batch itself (max_physical_batch_size, or
`physical_chunk_examples`; traced by its train function, it measures the kept bytes on its
own pass instead: `CHUNK_CHECK_ATTR`).
A second backward pass (Li et al.'s ghost clipping, "two_pass") does not bound the kept bytes
in TensorFlow: the persistent tape keeps the forward activations (the softmax
cross-entropy's [B, T, V] backprop among them) until that pass.
"""

import contextlib
import numbers
import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query
from tf_dpiter.dp_query import summation
from tf_dpiter.errors import DPiterError
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import runtime  # oneDNN, XLA, loss scale (not the optimizer)
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import plan as plan_lib
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget

GHOST = plan_lib.GHOST
VECTORIZED = plan_lib.VECTORIZED
DEFAULT_VARIANT = "bookkeeping"

_ZERO = tf.UnconnectedGradients.ZERO


def _check_clip(l2_norm_clip):
  if isinstance(l2_norm_clip, numbers.Number):
    if not (l2_norm_clip > 0 and l2_norm_clip < float("inf")):
      raise PrivacyConfigError(
          f"l2_norm_clip must be a positive finite number, got {l2_norm_clip}")
    return tf.constant(float(l2_norm_clip), tf.float32)
  return tf.cast(l2_norm_clip, tf.float32)


def _check_examples_per_record(k):
  """A positive int, or a scalar integer tensor (dynamic batch, > 0 by
  construction of the caller)."""
  if tf.is_tensor(k):
    static = tf.get_static_value(k)
    if static is None:
      return tf.cast(k, tf.int32)
    k = int(static)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ParameterValueError(
        f"examples_per_record must be a positive integer, got {k!r}")
  return k


def _refuse_planned_unknown_k(k):
  """Refuses records of k examples, k a tensor whose value the trace does not know, inside a
  summation.public_plan: every record's norm bound must count the plan's r k examples per
  call (algebra.public_examples), which cannot be formed without k; the call's own rows
  counted instead moved the sum past C. Add/remove one example, unit example: public_plan(64,
  8, 8), 4 vs 5 examples, k = 1 as a tensor in a tf.function: 1.1776732 C (review R29; k = 1
  as an int: 0.9999274 C).

  Args:
    k: `_check_examples_per_record`'s value (an int, or an int32 scalar tensor).

  Raises:
    PrivacyConfigError: k is a tensor inside a public plan.
  """
  if not tf.is_tensor(k):   # (k an int: no summation visit, the step's call walk)
    return
  plan = summation.current_public_plan()
  if plan is None:
    return
  raise PrivacyConfigError(
      "`examples_per_record` must be a Python int (or a tensor whose value the trace knows) "
      f"inside `summation.public_plan(rows={int(plan[0])}, records={int(plan[1])}, ...)`: "
      "every record's norm bound counts the plan's records per chunk times examples_per_record "
      f"examples, which an unknown value does not give. Received: examples_per_record={k!r}. "
      "Pass k as a Python int (the records' size is public under add/remove), or call "
      "clipped_grad_sum outside the plan (a replace-one step, batches of the same rows on "
      "neighbouring datasets).")


def _grouped(k):
  return tf.is_tensor(k) or k > 1


# The recording forward pass (module docstring, "Recording"): each unit layer's `call`
# replaced, for one pass, by a wrapper that runs its norm function and records the call.

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
  re-running the call on each example), as `_sources` decides: every unit but a
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


# A model's attribute: a list, set by its caller (the DP train step), to which each traced
# `_forward` appends the ops its call of the model created, in the graph being traced: the
# model's training-mode call as the step runs it, which data_writes.refuse_traced_writes
# reads for the variables it reads (no trace of its own). None or absent: nothing kept.
CALL_OPS_ATTR = "_dp_call_ops"
# A model's attribute: a `ChunkCheck` (or the examples a batch holds on average, a float),
# set by a caller that chunks the batch itself and traces the batch in one call without asking
# `physical_chunk_examples` (the Keras train step, traced by its train function, which can
# trace the step again): a traced `_forward` measures the kept bytes of its own recorded pass
# and raises ChunkedPassNeeded, before anything is formed from the pass, where that answer
# would chunk the batch, or (`ChunkCheck.by_size` False) give the step's sum another public
# plan than the one it was traced with. None or absent: no check.
CHUNK_CHECK_ATTR = "_dp_chunk_check"


class ChunkCheck:
  """What a traced `_forward` under `CHUNK_CHECK_ATTR` checks (`_refuse_one_call`).

  Attributes:
    expected: the examples a batch holds on average (float; the step's declared sampling).
    planned: the chunk size (examples) of the public plan the step's sum was traced with
      (chunking.public_rows), None: one chunk.
    by_size: False under an add/remove sampling: the public chunk is decided without the
      batch's own size (its static rows differ on neighbouring datasets), so one added
      example cannot change the clip shrink's plan (`physical_chunk_examples`).
  """

  def __init__(self, expected, planned=None, by_size=True):
    self.expected, self.planned, self.by_size = float(expected), planned, bool(by_size)


class ChunkedPassNeeded(DPiterError):
  """The signal (raised by a traced `_forward` under `CHUNK_CHECK_ATTR`, caught by the
  caller, which traces the step again) that the batch in one call keeps more than
  rules/budget.KEPT_BYTES, or that the sum's public plan must be another: `examples` is
  `physical_chunk_examples`'s answer, m (None: one call), `public` the public plan's chunk
  (`physical_chunk_examples(..., by_size=False)`; m when the check is by size)."""

  examples = None
  public = None


def _forward(model, units, inputs, targets, per_example_loss_fn, mask, k,
             scale, first_tape=None):
  """The recorded forward pass and the loss (run it under a tape). Traced (graph mode), the
  pass also finds the trainable variables read outside their unit's recorded calls
  (`unrecorded_variable_uses`'s check on the pass itself, no separate trace) and raises
  UnrecordedUsesError before anything is formed from it.

  Returns (outputs, raw_losses [B], losses [B] (weighted per record),
  record_mask [B/k], scaled_total)."""
  traced = not tf.executing_eagerly()
  with CALL_LOCK:
    graph = tf.compat.v1.get_default_graph() if traced else None
    start = len(graph.get_operations()) if traced else 0   # the call's ops (reads included)
    before = variable_consumers(units) if traced else None
    installed = install(units, track_uses=traced, first_tape=first_tape)
    try:
      outputs = model(inputs, training=True)
    finally:
      uninstall(installed)
    if traced:
      _refuse_unrecorded(unrecorded_uses(units, before))
      check = getattr(model, CHUNK_CHECK_ATTR, None)
      if check is not None:
        _refuse_one_call(units, inputs, k,
                         check if isinstance(check, ChunkCheck) else ChunkCheck(check))
      found = getattr(model, CALL_OPS_ATTR, None)
      if found is not None:
        found.append(graph.get_operations()[start:])
  raw_losses = tf.cast(per_example_loss_fn(targets, outputs), tf.float32)
  if raw_losses.shape.rank != 1:
    raise ParameterValueError(
        f"per_example_loss_fn must return a [B] tensor, got shape "
        f"{raw_losses.shape}")
  b_static = raw_losses.shape[0]
  if _grouped(k) and not tf.is_tensor(k) and b_static is not None and b_static % k:
    raise ParameterValueError(
        f"the batch of {b_static} examples is not a whole number of records "
        f"of examples_per_record={k}; pad it (with mask 0)")
  batch = tf.shape(raw_losses)[0]
  mask_f = (tf.ones([batch], tf.float32) if mask is None else
            tf.cast(tf.reshape(mask, [-1]), tf.float32))
  if not _grouped(k):
    record_mask = mask_f
    losses = raw_losses * mask_f if mask is not None else raw_losses
  else:
    # A record's loss is the mean loss of its real examples.
    count = tf.reduce_sum(tf.reshape(mask_f, [-1, k]), axis=1)
    record_mask = tf.cast(count > 0, tf.float32)
    losses = raw_losses * mask_f / tf.repeat(tf.maximum(count, 1.0), k)
  total = tf.reduce_sum(losses)
  return outputs, raw_losses, losses, record_mask, total * scale


def _sources(units):
  """Tensors of the first backward pass: the watched tensors of ghost units
  (ghost: (unit, start, n)) and the outputs of the other units' calls
  (vect: (unit, record, start, n)); sources is their concatenation."""
  ghost, vect, sources = [], [], []
  for u in units:
    if not u.records:
      continue
    if (u.kind == GHOST and len(u.records) == 1 and
        u.records[0]["watched"] is not None):
      w = tf.nest.flatten(u.records[0]["watched"])
      ghost.append((u, len(sources), len(w)))
      sources.extend(w)
    else:
      for rec in u.records:
        o = tf.nest.flatten(rec["outputs"])
        vect.append((u, rec, len(sources), len(o)))
        sources.extend(o)
  return ghost, vect, sources


def _sqr_norms(ghost, vect, src_grads, k, num_records):
  """Per-record squared norms [B/k] float32 (scaled by S^2 under a loss scale),
  the per-record gradients at hand ({id(unit): [g per variable] or a
  registry.PerExampleBlock}) and the sum functions of GhostSums and FactorSums results
  ({id(unit): sum_fn or the FactorSums})."""
  parts = []   # every unit's [R] part, added by one AddN (not one add per unit)
  per_example, normed, sum_fns = {}, set(), {}
  # the records of every norm function and sum below; the norms the rules hand on formed
  # per class of layers, not per layer (algebra.batched_norms)
  with algebra.examples_per_record(k), algebra.batched_norms():
    for u, start, n in ghost:
      rec = u.records[0]
      grads_w = tf.nest.pack_sequence_as(rec["watched"], src_grads[start:start + n])
      res = rec["sqr_norm_fn"](grads_w)
      if isinstance(res, registry.PerExampleGrads):
        per_example[id(u)] = list(res.grads)
        normed.add(id(u))
        res = res.sqr_norms
      elif isinstance(res, registry.PerExampleBlock):
        per_example[id(u)] = res
        normed.add(id(u))
        res = res.sqr_norms
      elif isinstance(res, registry.GhostSums):
        sum_fns[id(u)] = res.sum_fn
        res = res.sqr_norms
      elif isinstance(res, registry.FactorSums):
        sum_fns[id(u)] = res
        res = res.sqr_norms
      if res is not None:
        parts.append(res if isinstance(res, algebra.DeferredNorms) else
                     tf.cast(res, tf.float32))
    parts = algebra.resolve_norms(parts)
    for u, rec, start, n in vect:
      g = vectorized_grads(u, rec, src_grads[start:start + n])
      g = [tf.cast(algebra.record_sum(t), tf.float32) for t in g]
      if id(u) in per_example:
        per_example[id(u)] = [a + b for a, b in zip(per_example[id(u)], g)]
      else:
        per_example[id(u)] = g
  for uid, gs in per_example.items():
    if uid in normed:
      continue
    parts.extend(algebra.sqr_sum(g) for g in gs)
  if not parts:
    return tf.zeros([num_records], tf.float32), per_example, sum_fns
  if len(parts) > 1 and all(p.shape.rank == 1 and p.shape.is_compatible_with(parts[0].shape)
                            for p in parts):
    return tf.add_n(parts), per_example, sum_fns
  sq = parts[0]   # a part the trace cannot match to [R] (a norm function's broadcast): adds
  for part in parts[1:]:
    sq = sq + part
  return sq, per_example, sum_fns


def _clip_factors(sq, clip_factors_fn, record_mask, scale, masked, margin=0.0):
  """(norms, factors): ||g_j|| and the clip factors c_j = clip_factors_fn((1 + eta) ||g_j||)
  (the DPQuery's rule: `DPQuery.record_clip_factors`), 0 for a masked record; float32,
  without gradient. eta = `margin` (algebra.norm_margin): the computed norm may be low by
  the factor 1 / (1 + eta) (the rounding of the records' sums of squares, pinned in order:
  algebra.record_sqr_sums), so the factor is taken from the norm raised by 1 + eta, rounded
  up to float32 (summation.depth_margin counts the product's own rounding), and
  c ||g_j|| <= C (the same margin as the vectorized path's, summation.norm_margin). The norms
  returned are the computed ones."""
  norms = tf.sqrt(tf.maximum(sq, 0.0)) / scale
  raised = norms
  if margin:
    up = np.float32(1.0 + margin)
    while float(up) < 1.0 + margin:   # rounded up: the next float32 above
      up = np.nextafter(up, np.float32(2.0))
    raised = norms * float(up)
  factors = tf.cast(clip_factors_fn(raised), tf.float32)
  if masked:
    factors = factors * record_mask
  return norms, tf.stop_gradient(factors)


def gaussian_clip_factors(l2_norm_clip):
  """The factor function of the Gaussian sum query's clip: norms -> min(1, C / norms), 0 for
  a non-finite norm (`tf_dpiter.dp_query.clip_factors`).

  Args:
    l2_norm_clip: C > 0, finite (a number or a float tensor).

  Returns:
    a callable [R] float32 norms -> [R] float32 factors.

  Raises:
    PrivacyConfigError: C is a number that is not positive and finite.
  """
  clip = _check_clip(l2_norm_clip)
  return lambda norms: dp_query.clip_factors(norms, clip)


def _factors_fn(l2_norm_clip, clip_factors_fn):
  """The clip factor function from exactly one of (l2_norm_clip, clip_factors_fn)."""
  if (l2_norm_clip is None) == (clip_factors_fn is None):
    raise PrivacyConfigError(
        "give exactly one of l2_norm_clip and clip_factors_fn, got "
        f"l2_norm_clip={l2_norm_clip!r}, clip_factors_fn={clip_factors_fn!r}")
  if clip_factors_fn is None:
    return gaussian_clip_factors(l2_norm_clip)
  if not callable(clip_factors_fn):
    raise ParameterTypeError(f"clip_factors_fn must be callable, got {clip_factors_fn!r}")
  return clip_factors_fn


def _check_loss_scale(loss_scale):
  """`loss_scale`, a float > 0 (clipped_grad_sum's argument)."""
  if (isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float))
      or not 0.0 < loss_scale < float("inf")):
    raise ParameterValueError(f"`loss_scale` must be None or a finite float > 0 "
                              f"(runtime.loss_scale of the model). Received: "
                              f"loss_scale={loss_scale!r}")
  return float(loss_scale)


def _check_variant(variant, scale):
  if variant not in ("bookkeeping", "two_pass"):
    raise ParameterValueError(f"variant must be 'bookkeeping' or 'two_pass', got "
                              f"{variant!r}")
  if scale != 1.0 and variant == "two_pass":
    raise ParameterValueError("variant='two_pass' is not supported under a loss scale "
                              f"({scale}); use variant='bookkeeping'")


# {id(model): (weak reference to the model, {input signature: (kept bytes per example or
# None, output signature)})}: the probe's results, one trace per model and input signature.
_PROBES = {}


def _example_bytes(t):
  """Bytes per example (row) of a [B, ...] tensor, at least 4 per entry (a sum is float32),
  0 for what is not a batched tensor, None where a dimension is unknown."""
  if not tf.is_tensor(t) or t.shape.rank is None or t.shape.rank < 1:
    return 0
  dims = t.shape[1:].as_list()
  if None in dims:
    return None
  size = 1
  for d in dims:
    size *= d
  return size * max(t.dtype.size, 4)


def _units_kept_bytes(units):
  """Bytes per example book-keeping keeps until the clip factors are known: a ghost unit's
  watched tensors (their output gradients have their shapes) and call inputs, another unit's
  outputs and per-example gradients. None where a size is unknown."""
  total = 0
  for u in units:
    for rec in u.records:
      if u.kind == GHOST and len(u.records) == 1 and rec["watched"] is not None:
        parts = tf.nest.flatten(rec["watched"]) + tf.nest.flatten((rec["args"], rec["kwargs"]))
      else:
        parts = tf.nest.flatten(rec["outputs"])
        total += sum(4 * v.shape.num_elements() for v in u.variables)
      for t in parts:
        b = _example_bytes(t)
        if b is None:
          return None
        total += b
  return total


def _rows_spec(t, k):
  """tf.TensorSpec of k rows of a batched tensor, spec or Keras tensor; None for what has no
  leading batch axis."""
  shape = getattr(t, "shape", None)
  dtype = getattr(t, "dtype", None)
  if shape is None or dtype is None:
    return None
  shape = tf.TensorShape(shape)
  if shape.rank is None or shape.rank < 1:
    return None
  return tf.TensorSpec([k] + shape[1:].as_list(), tf.as_dtype(dtype))


def _probe(model, inputs, grouped, k):
  """(kept bytes per example or None, output signature) of `_probe_pass` ((None, None)
  where an input has no leading batch axis)."""
  found = _probe_pass(model, inputs, grouped, k)
  return (None, None) if found is None else found[:2]


def _probe_pass(model, inputs, grouped, k):
  """(kept bytes per example or None, output signature, unrecorded uses), or None where an
  input has no leading batch axis: a forward pass of one record (k examples) traced, never
  run, with the layers recorded as clipped_grad_sum records them. The output signature is a
  nest of tf.TensorSpec of one example of each model output; the kept bytes are None where a
  size is unknown; the unrecorded uses are unrecorded_uses of the pass (variables
  read outside their unit's recorded calls). Kept per model, input signature, trained
  variables and registered rules."""
  flat = tf.nest.flatten(inputs)
  specs = [_rows_spec(t, k) for t in flat]
  if not flat or any(s is None for s in specs):
    return None
  key = (grouped, k, tuple((tuple(s.shape[1:].as_list()), s.dtype.name) for s in specs),
         tuple(id(v) for v in model.trainable_variables), registry.RULES_VERSION)
  ref, seen = _PROBES.get(id(model), (None, {}))
  if ref is None or ref() is not model:
    seen = {}
    _PROBES[id(model)] = (weakref.ref(model), seen)
  if key not in seen:
    found = []

    def forward(*xs):
      units = plan_lib.plan(model, grouped=grouped)
      with CALL_LOCK:
        installed = install(units, track_uses=True)
        try:
          outputs = model(tf.nest.pack_sequence_as(inputs, list(xs)), training=True)
        finally:
          uninstall(installed)
      known = all(_example_bytes(x) is not None for x in xs)
      found.append((_units_kept_bytes(units) if known else None,
                    tf.nest.map_structure(lambda o: tf.TensorSpec(o.shape[1:], o.dtype),
                                          outputs),
                    unrecorded_uses(units)))
      return tf.constant(0)

    tf.function(forward, autograph=False).get_concrete_function(*specs)
    seen[key] = found[0]
  return seen[key]


def unrecorded_variable_uses(model, inputs):
  """The trained variables the fast path would read outside their unit's recorded calls.

  A unit's per-example norm and its clipped sum are formed from the layer's recorded calls
  (Li et al., "Large language models can be strong differentially private learners",
  Section 4; Bu et al., "Differentially private optimization on large model at small cost",
  Section 3). A variable also read elsewhere in the forward pass (another layer computing
  `h @ embedding.embeddings^T`, a layer reading a sublayer's kernel without calling it) has
  gradient terms no recorded call produces: book-keeping leaves them out of the update
  (silently wrong), a second backward pass puts them in the sum but not in the norm (the
  clip no longer bounds one example). So does a tensor computed from a variable inside its
  layer's call and consumed elsewhere (kept on an attribute, handed on as a Keras mask, an
  output with no batch axis). Found from one forward pass of one example traced
  (never run, kept per model and input signature; shared with the physical-chunk probe):
  every graph operation consuming a variable's handle must have been created inside one of
  its unit's recorded calls, and every tensor derived from it there must leave the call only
  as one of its outputs (unrecorded_uses). A traced clipped_grad_sum checks its own
  recorded forward pass the same way (no separate trace); eagerly it calls this function.

  Args:
    model: a built keras.Model.
    inputs: a nest of tensors, tf.TensorSpec or Keras tensors shaped like a batch
      (leading batch axis), or None (the model's own inputs, when it has them).

  Returns:
    a list of (layer name, variable path, operation types of the outside uses), empty when
    every use is recorded; None when the inputs are unknown (not checked).
  """
  if inputs is None:
    try:
      inputs = model.input   # the inputs' structure (a dict for a dict of inputs)
    except (AttributeError, ValueError):
      return None
    if inputs is None or (isinstance(inputs, (list, tuple, dict)) and not inputs):
      return None
  found = _probe_pass(model, inputs, False, 1)
  return None if found is None else found[2]


def describe_unrecorded(uses):
  """A sentence naming the variables used outside their layer's call and what to do.

  Args:
    uses: the non-empty list `unrecorded_variable_uses` returned.

  Returns:
    str.
  """
  named = "; ".join(f"variable {path!r} of layer {layer!r} (read by {list(ops)})"
                    for layer, path, ops in uses)
  return (f"trainable variables are used outside their layer's own call: {named}. The fast "
          "path forms each layer's per-example gradient norm from the layer's calls only, so "
          "those uses would be left out of the clipped update. Call the layer instead of "
          "reading its variable or keeping a tensor computed from it for use elsewhere (an "
          "attribute, a Keras mask, an output without the batch axis; for an output "
          "projection tied to an embedding, use keras_hub.layers.ReversibleEmbedding and call "
          "it with reverse=True), or use clipping='vectorized'")


class UnrecordedUsesError(PrivacyConfigError):
  """clipped_grad_sum's refusal of a model whose trainable variables are used outside their
  layer's recorded calls (`describe_unrecorded`); `uses` holds them, as
  `unrecorded_variable_uses` returns them (the Keras step routes on it under
  clipping="auto")."""

  uses = ()


def _refuse_unrecorded(uses):
  """Raises UnrecordedUsesError naming `uses` (the list `unrecorded_variable_uses` returns)
  when it is not empty."""
  if uses:
    error = UnrecordedUsesError(
        f"clipped_grad_sum cannot clip this model exactly: {describe_unrecorded(uses)}")
    error.uses = uses
    raise error


def warn_unrecorded(uses, stacklevel=4):
  """Warns that clipping="auto" takes the vectorized path because of `uses`.

  Args:
    uses: the non-empty list `unrecorded_variable_uses` returned.
    stacklevel: for warnings.warn.
  """
  warnings.warn(
      f"{describe_unrecorded(uses)}. Under clipping='auto' the private step takes the "
      "vectorized path (each example's gradient computed alone: exact, slower)",
      UserWarning, stacklevel=stacklevel)


def _one_call_anyway(inputs, k, by_size=True):
  """True where the batch is one call whatever its kept bytes: k unknown at trace time, an
  input without a batch axis, XLA with an unknown batch, or (`by_size`) a known batch of at
  most the smallest chunk."""
  if not isinstance(k, int):
    return True
  flat = tf.nest.flatten(inputs)
  if not flat or not tf.is_tensor(flat[0]) or flat[0].shape.rank in (None, 0):
    return True
  static_b = flat[0].shape[0]
  if static_b is None:
    return runtime.in_xla_context()
  return by_size and static_b <= budget.kept_chunk(budget.KEPT_BYTES + 1, k)


def _chunk_of(kept, k, inputs, by_size=True):
  """m = budget.kept_chunk(kept, k) of `kept` bytes per example, or None (one call): kept
  unknown or 0 (no unit records a forward pass), or (`by_size`) a known batch of at most m."""
  if not kept:
    return None
  m = budget.kept_chunk(kept, k)
  return None if by_size and _fits_in(inputs, m) else m


def _fits_in(inputs, m):
  """True where the batch `inputs` is known to hold at most m examples (one call of it keeps
  within the budget)."""
  static_b = tf.nest.flatten(inputs)[0].shape[0]
  return static_b is not None and static_b <= m


def _physical_chunk(model, inputs, k, by_size=True):
  """(examples per physical chunk m, output signature), or None where the batch is one call
  (`_one_call_anyway`, `_chunk_of`). m = budget.kept_chunk(kept bytes per example, k), the
  kept bytes of `_probe_pass` (module docstring)."""
  if _one_call_anyway(inputs, k, by_size):
    return None
  kept, signature = _probe(model, inputs, _grouped(k), k)
  m = _chunk_of(kept, k, inputs, by_size)
  return None if m is None else (m, signature)


def _refuse_one_call(units, inputs, k, check):
  """Raises ChunkedPassNeeded when the recorded pass just traced on the batch `inputs` (its
  units' records) keeps too much for `check.expected` examples in one call, or (`check`'s
  by_size False) its public chunk is not the `check.planned` the step's sum was traced with:
  the answer of `physical_chunk_examples`, from the kept bytes per example of this pass
  rather than of a probe's.

  Args:
    units: the pass's recorded units.
    inputs: the batch's model inputs, [B, ...].
    k: examples per record.
    check: a `ChunkCheck`.

  Raises:
    ChunkedPassNeeded: the step must be traced again (in chunks, or with another plan).
  """
  if _one_call_anyway(inputs, k, check.by_size):
    return
  known = all(_example_bytes(x) is not None for x in tf.nest.flatten(inputs))
  m = _chunk_of(_units_kept_bytes(units) if known else None, k, inputs, check.by_size)
  public = m if m is not None and check.expected > m else None
  layout = None if public is None or _fits_in(inputs, public) else public
  if layout is None and (check.by_size or public == check.planned):
    return
  signal = ChunkedPassNeeded(f"the book-keeping of more than {public} examples keeps more than "
                             f"{budget.KEPT_BYTES} bytes: this batch in "
                             f"{'one call' if layout is None else f'chunks of {layout}'}, "
                             f"the sum's public plan in chunks of {public}")
  signal.examples, signal.public = layout, public if not check.by_size else layout
  raise signal


def physical_chunk_examples(model, inputs, k, expected_examples, by_size=True):
  """Examples per physical chunk of a caller that chunks the batch itself (the Keras train
  step), so that book-keeping keeps at most rules/budget.KEPT_BYTES until the clip factors
  are known: m = budget.kept_chunk(kept bytes per example, k), measured by a forward pass of
  one record traced (not run). None (one call) when the expected batch fits in m examples,
  or where `_physical_chunk` keeps one call (k or a kept size unknown, XLA with an unknown
  batch). Bu et al., "Differentially private optimization on large model at small cost",
  Section 3: the clip factors of a record depend on its own norm only, so the chunks'
  clipped sums add up to the batch's.

  Args:
    model: the keras.Model the clipped sum differentiates.
    inputs: the batch's model inputs, [B, ...] (B may be unknown).
    k: examples per record (a Python int).
    expected_examples: the examples a batch holds on average (float; a Poisson batch's
      expected size), decided when the step is traced.
    by_size: False: m whatever the batch's own size (None only where the expected batch
      fits in m, or the batch is one call for a public reason: k or a kept size unknown, XLA
      with an unknown batch); the public chunk of an add/remove step's clip-shrink plan,
      which must not depend on the batch's rows (chunking.public_rows).

  Returns:
    int m, a multiple of k, or None.
  """
  found = _physical_chunk(model, inputs, k, by_size)
  if found is None or expected_examples <= found[0]:
    return None
  return found[0]


def _within_plan_records(inputs, k):
  """Checks a batch the trace does not know, run in one call (not a physical chunk's), against
  the enclosing summation.public_plan's records per chunk r, whose r k examples every record's
  norm bound then counts (algebra.sum_examples, which refuses a call of more examples the
  trace knows): a call of more would count too few rows. Add/remove one example, unit example:
  counting a call's own rows instead moved the sum by 1.18 C (public_plan(64, 4, 16), 4 vs 5
  examples in one call). Nothing for a batch the trace knows, outside a plan, for a physical
  chunk's call (its count is public: algebra.chunk_examples), for k unknown to the trace, or
  within a bound the caller enforces (runtime.examples_at_most of at most r k).

  Args:
    inputs: the call's model inputs, [B, ...].
    k: examples per record.

  Returns:
    None, or a scalar bool tensor, True where B <= r k, guarded by a run-time assertion (graph
    mode; XLA drops it: the caller makes the clip factors NaN, the sums then NaN).
  """
  flat = tf.nest.flatten(inputs)
  if (not flat or not tf.is_tensor(flat[0]) or flat[0].shape.rank in (None, 0)
      or flat[0].shape[0] is not None or not isinstance(k, int)):
    return None   # (a batch the trace knows: checked by algebra.sum_examples, no visit here)
  plan = summation.current_public_plan()
  if plan is None or algebra.chunk_size() is not None:
    return None
  most = int(plan[1]) * k
  bound = runtime.examples_bound()
  if bound is not None and bound <= most:   # the caller enforces it at run time
    return None
  rows = tf.shape(flat[0])[0]
  within = rows <= most
  check = tf.raw_ops.Assert(condition=within, data=[
      f"{algebra.plan_call_limit(plan, k)}. Received: examples =", rows])
  with tf.control_dependencies([check]):
    return tf.identity(within)


def _chunked_grad_sum(model, inputs, targets, per_example_loss_fn, factors_fn, mask, k,
                      variant, return_outputs, m, signature):
  """clipped_grad_sum's (grads, norms, outputs, losses) over physical chunks of whole
  records (module docstring): n = ceil(B / m) chunks of one size (budget.balanced_chunk),
  the last padded with examples of mask 0 (clip factor 0: they add nothing, their rows are
  cut), in a tf.while_loop (one chunk alive at once); outputs None unless return_outputs."""
  x_flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]
  y_flat = [t if t is None else tf.convert_to_tensor(t) for t in tf.nest.flatten(targets)]
  static_b = x_flat[0].shape[0]
  b = static_b if static_b is not None else tf.shape(x_flat[0])[0]
  n, chunk = budget.balanced_chunk(b, m, k)
  pad = n * chunk - b
  masked = mask is not None or not isinstance(pad, int) or pad > 0
  mask_f = None
  if masked:
    mask_f = (tf.ones([b], tf.float32) if mask is None else
              tf.cast(tf.reshape(mask, [-1]), tf.float32))
  rows = [i for i, t in enumerate(y_flat) if t is not None and t.shape.rank not in (None, 0)]
  batched = x_flat + [y_flat[i] for i in rows] + ([mask_f] if masked else [])

  def padded(t):
    if isinstance(pad, int) and pad == 0:
      return t
    t = tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1))
    if isinstance(pad, int):
      t.set_shape([n * chunk] + t.shape[1:].as_list())
    return t

  batched = [padded(t) for t in batched]
  if isinstance(chunk, int):   # a batch the trace knows: chunks of a static shape
    split = [tf.reshape(t, [n, chunk] + t.shape[1:].as_list()) for t in batched]
    take = lambda i: [s[i] for s in split]
  else:
    take = lambda i: [t[i * chunk:(i + 1) * chunk] for t in batched]
  variables = model.trainable_variables
  out_specs = tf.nest.flatten(signature) if return_outputs else []

  def body(i, acc, norms_ta, losses_ta, outs):
    parts = take(i)
    xi = tf.nest.pack_sequence_as(inputs, parts[:len(x_flat)])
    yl = list(y_flat)
    for j, r in enumerate(rows):
      yl[r] = parts[len(x_flat) + j]
    yi = tf.nest.pack_sequence_as(targets, yl)
    mi = parts[-1] if masked else None
    grads, norms, outputs, losses = _clipped_grad_sum(
        model, xi, yi, per_example_loss_fn, mask=mi, variant=variant, examples_per_record=k,
        return_outputs=True, clip_factors_fn=factors_fn, chunked=False)
    grads = [tf.cast(g, a.dtype) for a, g in zip(acc, grads)]
    if xla:
      acc = [a + g for a, g in zip(acc, grads)]
    else:   # the first chunk's sums start the accumulator
      acc = [tf.cond(i > 0, lambda a=a, g=g: a + g, lambda g=g: g) for a, g in zip(acc, grads)]
    outs = [ta.write(i, tf.cast(o, ta.dtype)) for ta, o in zip(outs, tf.nest.flatten(outputs))]
    return (i + 1, acc, norms_ta.write(i, norms), losses_ta.write(i, losses), outs)

  # No zeros accumulator outside XLA: the first chunk's sums are the accumulator (a loop
  # variable of unknown shape that starts empty), so the sum costs one weight-sized tensor per
  # variable, as in one call. XLA needs static shapes: there it starts from zeros.
  xla = runtime.in_xla_context()
  dtypes = [sum_dtype(v) for v in variables]
  acc0 = [tf.zeros(v.shape if xla else [0], d) for v, d in zip(variables, dtypes)]
  ta = lambda dtype: tf.TensorArray(dtype, size=n, infer_shape=False)
  loop_vars = (tf.constant(0), acc0, ta(tf.float32), ta(tf.float32),
               [ta(spec.dtype) for spec in out_specs])
  invariants = None if xla else (tf.TensorShape([]), [tf.TensorShape(None)] * len(acc0),
                                  tf.TensorShape(None), tf.TensorShape(None),
                                  [tf.TensorShape(None)] * len(out_specs))
  # each chunk's norm bounds, block and shrink count min(B, m) rows, as a call of at most m
  # rows counts its own, not its balanced `chunk` rows (which an added example can lower: 33
  # rows run as 2 chunks of 17, 32 as one call of 32); inside a public plan also the shrink
  # of the bound in chunks of m (`_chunks_shrink`): clipped_grad_sum, "Relation"
  most = min(b, m) if isinstance(b, int) else tf.minimum(b, m)
  # inside a public plan the chunks' norm bounds count max(r k, min(R k, m)) (public:
  # algebra.sum_examples), so the batch is checked against the plan's bound R
  within = summation.within_public_rows(b // k)
  # B unknown to the trace, not XLA (there one call): the assertion runs first
  n = summation.after_row_check(within, n)
  with summation.sequential_chunks(n, most), algebra.chunk_examples(most, m):
    _, acc, norms_ta, losses_ta, outs = tf.while_loop(
        lambda i, *_: i < n, body, loop_vars, parallel_iterations=1,
        shape_invariants=invariants)
  acc = [tf.ensure_shape(a, v.shape) for a, v in zip(acc, variables)]
  records = b // k
  norms = norms_ta.concat()[:records]
  losses = losses_ta.concat()[:b]
  outputs = (tf.nest.pack_sequence_as(signature, [o.concat()[:b] for o in outs])
             if return_outputs else None)
  return acc, norms, outputs, losses


def _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                      l2_norm_clip=None, mask=None, variant=DEFAULT_VARIANT,
                      examples_per_record=1, return_outputs=False,
                      clip_factors_fn=None, chunked=True, loss_scale=None):
  """Implementation of clipped_grad_sum with a choice of `variant`; `chunked` False: the
  batch in one call whatever its kept bytes (a physical chunk's)."""
  factors_fn = _factors_fn(l2_norm_clip, clip_factors_fn)
  k = _check_examples_per_record(examples_per_record)
  _refuse_planned_unknown_k(k)
  scale = runtime.loss_scale(model) if loss_scale is None else _check_loss_scale(loss_scale)
  _check_variant(variant, scale)
  units = plan_lib.plan(model, grouped=_grouped(k))   # its errors first
  if tf.executing_eagerly():   # a traced pass checks itself (_forward)
    _refuse_unrecorded(unrecorded_variable_uses(model, inputs))
  chunking = _physical_chunk(model, inputs, k) if chunked else None
  within = None if chunking is not None else _within_plan_records(inputs, k)
  if within is not None:   # no op of the call before the check (summation.after_row_check)
    inputs, targets, mask = summation.after_row_check(within, (inputs, targets, mask))
  if chunking is not None:
    grads, norms, outputs, raw_losses = _chunked_grad_sum(
        model, inputs, targets, per_example_loss_fn, factors_fn, mask, k, variant,
        return_outputs, *chunking)
    if return_outputs:
      return grads, norms, outputs, raw_losses
    return grads, norms

  # Traced, the first backward pass has a tape of its own that records no read of a marked
  # unit's variables (install's first_tape): it forms no gradient of them, which
  # nothing used (BERT-base at seq 32: 405 of the DP train step's 12,445 ops).
  first = (None if tf.executing_eagerly() else
           tf.GradientTape(watch_accessed_variables=False))
  with tf.GradientTape(persistent=True) as tape, tf.name_scope("forward"):
    with first or contextlib.nullcontext():
      outputs, raw_losses, losses, record_mask, total = _forward(
          model, units, inputs, targets, per_example_loss_fn, mask, k, scale, first)

  # First backward pass: gradients at the watched tensors of ghost units and
  # at the outputs of vectorized units (one pass through the network).
  # Name scopes: the phases of the traced graph (op counts and profiles by phase).
  ghost, vect, sources = _sources(units)
  if first is not None and first_tape_misses(units):
    first = None   # a watched tensor the first tape may not have recorded: the full tape
  with tf.name_scope("backward_to_layers"):
    src_grads = (first or tape).gradient(total, sources, unconnected_gradients=_ZERO)
  with tf.name_scope("norms"):
    num_records = tf.shape(raw_losses)[0] // k
    with algebra.norm_depths() as depths:
      sq, per_example, sum_fns = _sqr_norms(ghost, vect, src_grads, k, num_records)
    norms, factors = _clip_factors(sq, factors_fn, record_mask, scale,
                                   mask is not None or _grouped(k),
                                   algebra.norm_margin(depths, len(ghost) + len(vect)))
    if within is not None:   # a call past the plan's records: NaN sums (XLA drops the assert)
      factors = tf.where(within, factors, float("nan"))
    example_factors = tf.repeat(factors, k) if _grouped(k) else factors

  with tf.name_scope("clipped_sum"):
    if variant == "two_pass":
      result = two_pass_sum(units, losses, example_factors, tape)
    else:
      with algebra.sum_plans() as plans:
        result = bookkeeping_sum(units, ghost, sources, src_grads, per_example,
                                         sum_fns, factors / scale, example_factors / scale, tape)
      result = _with_rounding_margin(result, plans, num_records, k)
  del tape
  out = dense_result(model, result)
  if return_outputs:
    return out, norms, outputs, raw_losses
  return out, norms


# The clipped sum once the clip factors are known (module docstring, "bookkeeping" and
# "two_pass").

def _dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def sum_dtype(v):
  """dtype of a variable's clipped sum: float32 for 16-bit variables."""
  dtype = tf.as_dtype(v.dtype)
  return tf.float32 if dtype.is_floating and dtype.size < 4 else dtype


def _float32_vjp(unit, weighted):
  """sum_i c_i g_i of a 16-bit ghost unit in float32: the norm function is run
  again on the float32 inputs with every variable read as a watched float32
  copy (keras.StatelessScope), and its watched tensors are differentiated."""
  rec = unit.records[0]   # its floating inputs cast to float32, non-finite -> 0
  args, kwargs = tf.nest.map_structure(
      lambda t: algebra.finite_float32(t) if tf.is_tensor(t) and t.dtype.is_floating else t,
      (rec["args"], rec["kwargs"]))
  w32 = [tf.cast(tf.convert_to_tensor(v), tf.float32) for v in unit.variables]
  with tf.GradientTape() as tape:
    tape.watch(w32)
    with keras.StatelessScope() as scope:
      # Set after construction: the constructor would cast the values to the
      # variables' (16-bit) dtype.
      keras_internals.map_variables(scope, unit.variables, w32)
      watched = tf.nest.flatten(unit.norm_fn(unit.layer, *args, **kwargs)[1])
  bad = [w.dtype.name for w in watched if w.dtype != tf.float32]
  if bad:
    raise ParameterValueError(
        f"the norm function of layer {unit.layer.name!r} is marked "
        f"float32_watched but returned watched tensors of dtype {bad}")
  return tape.gradient(watched, w32, output_gradients=weighted,
                       unconnected_gradients=_ZERO)


def _ghost_vjp(unit, watched, grads_w, example_factors, tape, sum_fn=None):
  """sum_i c_i g_i of a ghost unit: the rule's own sum (FactorSums, GhostSums), else the
  vector-Jacobian product of the watched tensors with the clip-weighted
  gradients, in float32 for 16-bit layers."""
  if isinstance(sum_fn, registry.FactorSums):
    return [_dense(g) for g in sum_fn.sum_fn(example_factors)]
  # g * c per row (float32), 0 where c == 0 (even if g is not finite)
  weighted = [algebra.weight_rows(g, example_factors) for g in grads_w]
  if sum_fn is not None:
    grads = sum_fn(tf.nest.pack_sequence_as(unit.records[0]["watched"], weighted))
  elif unit.float32_recompute:
    grads = _float32_vjp(unit, weighted)
  else:
    weighted = [tf.cast(w, t.dtype) for w, t in zip(weighted, watched)]
    grads = tape.gradient(watched, keras_internals.gradient_sources(unit.variables),
                          output_gradients=weighted,
                          unconnected_gradients=_ZERO)
  return [_dense(g) for g in grads]


def _rows_sum(g, factors):
  """sum_j c_j g_j over the rows of a per-record tensor g [R, ...] (float32); see
  `_pinned_rows_sum` (its sum alone)."""
  return _pinned_rows_sum(g, factors)[0]


def _pinned_rows_sum(g, factors):
  """(sum_j c_j g_j over the rows of a per-record tensor g [R, ...] (float32), its block):
  the rows [R, P] summed in a pinned order by algebra.pinned_rows_product (blocks of
  algebra.pinned_block rows summed in any order, the blocks by summation.pairwise_sum), the
  rows with c_j = 0 set to 0 first (algebra.drop_rows: a non-finite g_j adds nothing; one
  elementwise op, no branch). The block is None where the trace does not know P (then one
  two-row product, algebra.factor_product: an order not pinned).

  Each row is one record's float32 gradient g~_j, its k examples' and T positions' terms
  already summed into it, and its norm is the one the clip factor was taken from (the
  registry's PerExampleGrads / PerExampleBlock contract: sqr_norms of the very g returned,
  or an upper bound of it), so c_j ||g~_j|| <= C by the norm margin (`_clip_factors`): one
  term of norm at most C per record, the plan of summation.rounding_margin (Casacuberta et
  al., "Widespread underestimation of sensitivity in differentially private libraries and
  how to fix it", CCS 2022), for records of k examples and sequence records alike. Unit: the
  L2 norm of a record's gradient."""
  rows = g.shape[0]
  p = g.shape[1:].num_elements()
  if p is None:
    return algebra.factor_product(factors, algebra.drop_rows(g, factors)), None
  flat = g if g.shape.rank == 2 else algebra.reshape(g, [-1, p])
  block = algebra.pinned_block(algebra.plan_rows(None if rows is None else int(rows)),
                               4 * p, budget.CHUNK_BYTES, small_bytes=algebra.PINNED_SMALL_BYTES)
  c = algebra.rows(tf.cast(factors, tf.float32), flat)   # [R, 1]
  s = algebra.pinned_rows_product(c, algebra.drop_rows(flat, factors), block)
  return algebra.reshape(s, g.shape[1:].as_list()), block   # [1, P] -> g's entries


def _per_example_sums(grads, factors, variables=()):
  """The clipped sums of a unit whose per-record gradients are at hand (a list aligned
  with its variables, or a registry.PerExampleBlock), each in a pinned order
  (`_pinned_rows_sum`), declared pinned for `variables` (the unit's; algebra.report_pinned,
  with the largest block of the unit's sums) so that the step charges the plan's rounding
  margin (`_with_rounding_margin`)."""
  blocks = grads.blocks if isinstance(grads, registry.PerExampleBlock) else grads
  found = [_pinned_rows_sum(b, factors) for b in blocks]
  sums = [s for s, _ in found]
  if variables and all(b is not None for _, b in found):
    for v in variables:
      algebra.report_pinned(v, max(b for _, b in found))
  if isinstance(grads, registry.PerExampleBlock):
    return list(grads.unpack(sums))
  return sums


def bookkeeping_sum(units, ghost, sources, src_grads, per_example, sum_fns,
                    factors, example_factors, tape):
  """{id(variable): clipped sum} by book-keeping (module docstring).

  A record with c = 0 (its norm not finite, or masked) adds exactly nothing: every sum
  zeroes its rows (algebra.weight_rows / drop_rows), with no branch on finiteness.

  Args:
    units: the plan's units.
    ghost: (unit, start, n) of the ghost units, their watched tensors at sources[start:start+n].
    sources: the tensors of the first backward pass.
    src_grads: the gradients of the summed loss at `sources`.
    per_example: {id(unit): per-record gradients (a list per variable, or a
      registry.PerExampleBlock)}.
    sum_fns: {id(unit): a GhostSums sum function or a registry.FactorSums}.
    factors: [R] float32 clip factors c per record (divided by the loss scale).
    example_factors: [B] float32, each example's record's c (divided by the loss scale).
    tape: the persistent tape of the forward pass.

  Returns:
    {id(variable): clipped sum tensor}.
  """
  result = {}
  for u, start, n in ghost:
    if id(u) in per_example:
      continue
    grads = _ghost_vjp(u, sources[start:start + n], src_grads[start:start + n],
                       example_factors, tape, sum_fns.get(id(u)))
    for v, g in zip(u.variables, grads):
      result[id(v)] = tf.cast(g, sum_dtype(v))
  for u in units:
    if id(u) not in per_example:
      continue
    sums = _per_example_sums(per_example[id(u)], factors, u.variables)
    for v, g in zip(u.variables, sums):
      result[id(v)] = tf.cast(g, sum_dtype(v))
  return result


def two_pass_sum(units, losses, example_factors, tape):
  """{id(variable): clipped sum} by a second backward pass of sum_i c_i L_i.

  Args:
    units: the plan's units; losses: [B] weighted losses; example_factors: [B] c_i;
    tape: the persistent tape of the forward pass.

  Returns:
    {id(variable): clipped sum tensor}.

  Raises:
    PrivacyConfigError: a unit computes in 16 bits.
  """
  if any(plan_lib.computes_in_16_bits(u.layer) for u in units):
    raise PrivacyConfigError("variant='two_pass' forms the clipped sum in the layers' "
                             "16-bit compute dtype; use variant='bookkeeping'")
  with tape:
    weighted = tf.reduce_sum(example_factors * losses)
  all_vars = [v for u in units for v in u.variables]
  grads = tape.gradient(weighted, keras_internals.gradient_sources(all_vars),
                        unconnected_gradients=_ZERO)
  return {id(v): _dense(g) for v, g in zip(all_vars, grads)}


def dense_result(model, result):
  """The clipped sums aligned with model.trainable_variables (zeros where absent).

  Args:
    model: the keras.Model; result: {id(variable): clipped sum}.

  Returns:
    a list of tensors, one per trainable variable (float32 for 16-bit variables).
  """
  return [result[id(v)] if id(v) in result else tf.zeros(v.shape, sum_dtype(v))
          for v in model.trainable_variables]


def _with_rounding_margin(result, plans, num_records, k):
  """The clipped sums times 1 / (1 + eta) where every one of them was formed in a pinned
  order with one term per record (algebra.sum_plans; a record of k examples or of T positions
  is one term where its float32 gradient was formed first and the sum is over those,
  `_pinned_rows_sum`: its norm bounds the term): eta = summation.rounding_margin of
  the plan (the records of this call, blocks of the largest block reported, the chunks of an
  enclosing summation.sequential_chunks, the strategy's replicas; 4 roundings of each term's
  products: the clip factor and a public scale on an operand, the product; one final: this
  multiply), so the sum moves by at most C when a record is added or removed (Casacuberta et
  al., "Widespread underestimation of sensitivity in differentially private libraries and
  how to fix it", CCS 2022). Multiplying the sums rather than the factors: the plans are
  known once the sums are built. Otherwise the sums unchanged (the cross-record rounding
  stays open there: docs/design.md, "Floating point")."""
  if not result or not isinstance(k, int) or any(v not in plans for v in result):
    return result
  chunk_rows = summation.current_chunk_rows()
  block = max(plans.values())
  rows = None if chunk_rows is not None else num_records   # the batch's rows, in one call
  if chunk_rows is not None:
    # one shrink for every chunk of the batch: the plan of its largest chunk, blocks of at
    # least PINNED_BLOCK rows (a chunk of rows the trace does not know takes that block;
    # rounding_margin counts at most the chunk's rows of a block: the rest is zero padding)
    num_records, block = chunk_rows, max(block, algebra.PINNED_BLOCK)
  records = tf.get_static_value(num_records)
  records = int(records) if records is not None else num_records
  # inside a summation.public_plan block (an add/remove step), the plan of the public row
  # bound (the rows of the batch checked against it where this call holds them all)
  s = summation.public_shrink(rows, records, chunks=summation.current_chunks(), block=block,
                              final=1)
  size, plan = algebra.chunk_size(), summation.current_public_plan()
  if chunk_rows is not None and size is not None and plan is not None:
    s = _min(s, _chunks_shrink(plan[0], max(size // k, 1), block))
  return {vid: g * tf.cast(s, g.dtype) for vid, g in result.items()}


def _chunks_shrink(bound, size, block):
  """The clip shrink of a public plan's `bound` rows laid out as this function's own
  physical chunks: ceil(bound / size) chunks of at most `size` records added one after the
  other, blocks of `block` rows (summation.step_shrink, shifted relation). A batch within the
  bound runs as at most that many chunks of at most `size` records, so this plan's margin
  covers its rounding depth, which the user's plan (of other records per chunk) may not: one
  chunk of 192 records charges no chunk additions, where chunks of 2 records add 95 times.
  Public: `size` follows from the model and the memory budget, not from the batch."""
  size = min(int(size), int(bound))
  return summation.step_shrink(size, chunks=-(-int(bound) // size), block=block, final=1,
                               total=int(bound), shifted=True)


def _min(a, b):
  """min of two shrinks (Python floats or float32 scalar tensors; a NaN of `a` kept)."""
  if tf.is_tensor(a) or tf.is_tensor(b):
    return tf.where(tf.math.is_nan(a), a, tf.minimum(a, b))
  return min(a, b)


# Not converted by AutoGraph (no tensor-dependent Python control flow): converting the
# library's functions made most of a large model's trace time.
@tf.autograph.experimental.do_not_convert
def clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                     l2_norm_clip=None, mask=None, examples_per_record=1,
                     return_outputs=False, clip_factors_fn=None,
                     variant=DEFAULT_VARIANT, physical_chunks=True, loss_scale=None):
  """Sum over records of per-record gradients clipped to L2 norm C.

  Computes sum_j g_j * c_j with c_j = min(1, C / ||g_j||_2) (McMahan et al.
  2018, Sec. 2, pi_C, flat clipping over all trainable variables), or with the
  factors c_j = clip_factors_fn(||g_j||) of a DPQuery (the DP models pass
  `query.record_clip_factors(params, .)`: the query clips by its own rule,
  whichever way the norms were obtained). A record is one example
  (examples_per_record=1) or k consecutive examples (a microbatch: rows
  j*k ... j*k + k - 1), whose gradient g_j is that of the mean loss of its
  real examples. Ghost norms for registered layers, vectorized per-example
  gradients for the others. No noise. Norms, clip factors and the sum are
  float32 under every dtype policy (module docstring).

  Relation. Outside a `summation.public_plan` block the records' norm bounds, the kept forms
  and the clip shrink follow the batch's own rows: a bound for replace-one (the same rows on
  both datasets). Physical chunks count min(B, m) rows (m their chunk size), as one call of
  at most m rows counts its own, never their balanced rows, which an added example lowers
  (33 copies of one record ran as 2 chunks of 17, 32 as one call: 1.0000381 C between them,
  0.9999918 C since). Under add/remove (a Poisson batch) call it inside a
  `summation.public_plan` block of a public bound on the rows (as `chunking.public_rows`
  opens for the library's steps): there they follow the plan, the same on neighbouring
  datasets. A call in one call (physical_chunks=False, or a batch that fits the function's
  chunk) may hold at most the plan's `records` (times k) examples, which the norm bounds
  count: more is refused where the trace knows the batch (PrivacyConfigError), and where it
  does not the call fails at run time (an assertion; under XLA, which drops it, the sums are
  NaN). Counting such a call's own rows moved the sum by 1.18 C (public_plan(64, 4, 16), 4 vs
  5 examples of nearly cancelling positions; so did records of k examples for k a tensor
  the trace does not know, now refused). The plan is read when the call is traced: open it
  inside the traced function (a function traced outside it and called inside keeps counting
  its calls' own rows: 1.18 C, review R29). The physical chunks (a batch over the
  function's chunk m, which the caller does not choose) count max(records, min(rows, m)) in
  the norm bounds, public (min(B, m) moved the sum by 1.18 C for a batch the trace did not
  know), the batch is checked against `rows`, and their shrink is the smaller of the plan's
  and that of the bound in chunks of m (a plan of one chunk of 2048 rows charges no chunk
  additions, where chunks of 8 rows add 255 times: eta 0.0169 charged, 0.0333 needed).

  Args:
    model: a built keras.Model; model(inputs, training=True) is run once.
    inputs, targets: a batch of B examples (leading axis); B a multiple of k.
    per_example_loss_fn: (y_true, y_pred) -> [B] per-example losses.
    l2_norm_clip: C > 0, in units of the gradient L2 norm (or None with
      clip_factors_fn).
    mask: optional [B] 0/1; rows with 0 contribute nothing. A record with no
      real example has norm 0.
    examples_per_record: k, a positive integer (or a scalar integer tensor, a dynamic
      batch's; inside a `summation.public_plan` its value must be known to the trace).
    return_outputs: also return the model outputs and the [B] losses.
    clip_factors_fn: instead of l2_norm_clip, a callable [B / k] float32
      norms -> [B / k] factors in [0, 1] (a record with a non-finite norm must
      get 0), e.g. `lambda n: query.record_clip_factors(params, n)`.
    variant: "bookkeeping" (one backward pass, the default) or "two_pass" (a
      second backward pass of sum_j c_j L_j; not under a loss scale or 16-bit
      layers). Both give the same sum.
    physical_chunks: True: where book-keeping would keep more than
      rules/budget.KEPT_BYTES for the batch, the sum is formed over physical chunks of whole
      records (module docstring; per_example_loss_fn must then be a function of each
      example's targets and outputs alone); False: the batch in one call (a caller that
      chunks the batch itself, or whose loss depends on the whole batch).
    loss_scale: the static loss scale, `runtime.loss_scale(model)`, when the caller holds it
      (the Keras train step reads it once per train function); None: read here. The loss is
      multiplied by it and the norms and the sum divided by it.

  Returns:
    (grads, per_record_norms[, outputs, losses]): grads is a list of dense
    tensors aligned with model.trainable_variables (float32 for 16-bit
    variables, else the variable's dtype); per_record_norms is
    [B / k] float32, ||g_j||_2 before clipping (not finite for a record whose
    gradient is not: that record adds nothing).

  Raises:
    PrivacyConfigError: inside a `summation.public_plan`, a call of more examples than its
      records per chunk times k (in one call), a batch of more records than its rows, or
      examples_per_record a tensor whose value the trace does not know.
    ParameterTypeError: clip_factors_fn is not callable.
    ParameterValueError: not exactly one of l2_norm_clip and clip_factors_fn, bad
      l2_norm_clip, variant, examples_per_record or loss_scale, a batch that is not
      whole records, a loss that is not [B], or a model that cannot be clipped
      per example (see supports).
    UnrecordedUsesError: a trainable variable is read outside its layer's recorded calls
      (a PrivacyConfigError; `unrecorded_variable_uses`).
  """
  # the clip factors reshaped (signed, ...) once, not per layer; traced, the integer
  # constants (shapes, axes) once per graph
  with algebra.shared_ops(), (contextlib.nullcontext() if tf.executing_eagerly() else
                              keras_internals.shared_constants()):
    return _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                             l2_norm_clip, mask=mask, variant=variant,
                             examples_per_record=examples_per_record,
                             return_outputs=return_outputs,
                             clip_factors_fn=clip_factors_fn, chunked=physical_chunks,
                             loss_scale=loss_scale)
