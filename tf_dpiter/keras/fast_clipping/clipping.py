"""Clipped gradient sum with ghost norms (fast per-example clipping).

For a sample of B records (examples) with per-example losses L_i, returns

    sum_i g_i * min(1, C / ||g_i||_2),   g_i = d L_i / d theta,

(the clipped sum of McMahan et al. 2018, Sec. 2, pi_C) without materializing
g_i for registered layers: ||g_i||^2 is the sum over layers of per-layer
squared norms computed from the layer's inputs and the gradient at its output
(Goodfellow 2015; Li et al. 2021, Sec. 4). Trainable layers that are not
registered get vectorized per-example gradients for their own variables
(tf.vectorized_map); their squared norms are added to the ghost norms.

Two ways to form the clipped sum once the clip factors c_i are known:
  * "bookkeeping" (Bu et al. 2023, Sec. 3): one backward pass to the layer
    outputs, then per layer the vector-Jacobian product with c_i * dz_i.
  * "two_pass" (Li et al. 2021): a second backward pass of sum_i c_i L_i.
Both are exact; the default is the one measured faster
(BENCHMARKS.md). A registered layer whose norm function returns the per-example
gradients (registry.PerExampleGrads: small convolutions, LayerNorm) is summed
as sum_i c_i g_i instead of by a vector-Jacobian product.
"""

import numbers
import threading

import tensorflow as tf
import keras

from tf_dpiter.keras.fast_clipping import registry

GHOST = "ghost"
VECTORIZED = "vectorized"

# Layers whose output for one example depends on other examples of the batch:
# per-example gradients (hence clipping) are undefined for them.
_BATCH_COUPLED = (keras.layers.BatchNormalization,)

# Layers that call their sublayers in a loop or on a reshaped batch: their
# sublayers never see one row per example, so they are clipped as one block.
_OPAQUE = (keras.layers.RNN, keras.layers.TimeDistributed)

DEFAULT_VARIANT = "bookkeeping"

_CALL_LOCK = threading.RLock()


def _has_registered(layer):
  for sub in layer._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
    if sub.trainable_variables and registry.lookup(sub) is not None:
      return True
  return False


class _Unit:
  """A layer whose trainable variables are clipped as one block of g_i."""

  def __init__(self, layer, kind, norm_fn):
    self.layer = layer
    self.kind = kind
    self.norm_fn = norm_fn
    self.variables = list(layer.trainable_variables)
    self.records = []


def _children(layer):
  seen, out = set(), []
  for child in layer._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
    if id(child) not in seen:
      seen.add(id(child))
      out.append(child)
  return out


def _direct_trainable(layer):
  return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _check_deterministic(layer):
  """The vectorized path re-runs a layer per example: it must be a function
  of its inputs (no internal dropout), or the gradients would be wrong."""
  for sub in layer._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
    rates = [getattr(sub, "dropout", 0), getattr(sub, "recurrent_dropout", 0),
             getattr(sub, "_dropout", 0)]
    if isinstance(sub, keras.layers.Dropout):
      rates.append(sub.rate)
    if max(float(r) if isinstance(r, (int, float)) else 0.0
           for r in rates) > 0:
      raise ValueError(
          f"layer {layer.name!r} is not registered and contains dropout "
          f"({sub.name!r}); its per-example gradients cannot be recomputed. "
          "Register it (register_layer) or move the dropout to its own layer")


def _plan(model, grouped=False):
  """Splits the model's trainable variables into units; raises ValueError.

  grouped: records of several examples; registered layers whose norm function
  does not honour registry.examples_per_record take the vectorized path.
  """
  if not isinstance(model, keras.layers.Layer):
    raise ValueError(f"model must be a keras.Model, got {type(model).__name__}")
  if not model.built:
    raise ValueError(
        f"model must be built before clipping, got model.built=False "
        f"(model={model.name!r})")
  units, seen = [], set()

  def visit(layer):
    if id(layer) in seen:
      return
    seen.add(id(layer))
    if isinstance(layer, _BATCH_COUPLED) and layer.trainable_variables:
      raise ValueError(
          f"layer {layer.name!r} ({type(layer).__name__}) mixes examples of "
          "the batch; per-example gradient norms are undefined for it")
    if not layer.trainable_variables:
      return
    norm_fn = registry.lookup(layer)
    if grouped and not getattr(norm_fn, "supports_records", False):
      norm_fn = None
    if norm_fn is not None:
      units.append(_Unit(layer, GHOST, norm_fn))
      return
    children = _children(layer)
    if (_direct_trainable(layer) or not children or
        isinstance(layer, _OPAQUE) or not _has_registered(layer) or
        registry.lookup(layer) is not None):
      _check_deterministic(layer)
      units.append(_Unit(layer, VECTORIZED, None))
      return
    for child in children:
      visit(child)

  visit(model)
  covered = {}
  for u in units:
    for v in u.variables:
      if id(v) in covered:
        raise ValueError(
            f"variable {v.path!r} is shared by layers "
            f"{covered[id(v)]!r} and {u.layer.name!r}; not supported")
      covered[id(v)] = u.layer.name
  missing = [v.path for v in model.trainable_variables if id(v) not in covered]
  if missing:
    raise ValueError(
        f"trainable variables {missing} are not owned by any layer of model "
        f"{model.name!r}; cannot clip per example")
  return units


def supports(model):
  """True if clipped_grad_sum can clip this (built) model exactly.

  The model may mix registered layers (ghost norms) and unregistered ones
  (vectorized per-example gradients); see unregistered_layers(model).
  False for unbuilt models, batch-coupled layers (BatchNormalization) and
  variables shared between layers.
  """
  try:
    _plan(model)
  except ValueError:
    return False
  return True


def unregistered_layers(model):
  """Names of the layers that take the vectorized per-example path."""
  return [u.layer.name for u in _plan(model) if u.kind == VECTORIZED]


def _check_clip(l2_norm_clip):
  if isinstance(l2_norm_clip, numbers.Number):
    if not (l2_norm_clip > 0 and l2_norm_clip < float("inf")):
      raise ValueError(
          f"l2_norm_clip must be a positive finite number, got {l2_norm_clip}")
    return tf.constant(float(l2_norm_clip), tf.float32)
  return tf.cast(l2_norm_clip, tf.float32)


def _install(units):
  """Replaces each unit layer's `call` by a recording wrapper."""
  installed = []
  for unit in units:
    layer = unit.layer
    orig = layer.call  # bound method of the class (or an earlier override)
    unit.orig_call = orig

    def wrapped(*args, _unit=unit, _orig=orig, **kwargs):
      rec = {"args": args, "kwargs": kwargs, "watched": None}
      outputs = None
      if _unit.kind == GHOST:
        res = _unit.norm_fn(_unit.layer, *args, **kwargs)
        if res is not None:
          outputs, watched, sqr_norm_fn = res
          rec["watched"] = watched
          rec["sqr_norm_fn"] = sqr_norm_fn
      if outputs is None:
        outputs = _orig(*args, **kwargs)
      rec["outputs"] = outputs
      _unit.records.append(rec)
      return outputs

    had_own = "call" in layer.__dict__
    object.__setattr__(layer, "call", wrapped)
    installed.append((layer, had_own, orig))
  return installed


def _uninstall(installed):
  for layer, had_own, orig in reversed(installed):
    if had_own:
      object.__setattr__(layer, "call", orig)
    else:
      object.__delattr__(layer, "call")


def _is_batched(t):
  return tf.is_tensor(t) and t.shape.rank is not None and t.shape.rank >= 1


def _vectorized_grads(unit, rec, out_grads):
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
    grads = tape.gradient(s, variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]

  return tf.vectorized_map(one, xs + list(out_grads))


def _dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _check_examples_per_record(k):
  """A positive int, or a scalar integer tensor (dynamic batch, > 0 by
  construction of the caller)."""
  if tf.is_tensor(k):
    static = tf.get_static_value(k)
    if static is None:
      return tf.cast(k, tf.int32)
    k = int(static)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(
        f"examples_per_record must be a positive integer, got {k!r}")
  return k


def _grouped(k):
  return tf.is_tensor(k) or k > 1


def _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                      l2_norm_clip, mask=None, variant=DEFAULT_VARIANT,
                      examples_per_record=1, return_outputs=False):
  """Implementation of clipped_grad_sum with a choice of `variant`."""
  if variant not in ("bookkeeping", "two_pass"):
    raise ValueError(f"variant must be 'bookkeeping' or 'two_pass', got "
                     f"{variant!r}")
  clip = _check_clip(l2_norm_clip)
  k = _check_examples_per_record(examples_per_record)
  units = _plan(model, grouped=_grouped(k))

  with tf.GradientTape(persistent=True) as tape:
    # The lock keeps replica threads (tf.distribute) from interleaving their
    # wrappers on the shared layers.
    with _CALL_LOCK:
      installed = _install(units)
      try:
        outputs = model(inputs, training=True)
      finally:
        _uninstall(installed)
    raw_losses = per_example_loss_fn(targets, outputs)
    raw_losses = tf.cast(raw_losses, tf.float32)
    if raw_losses.shape.rank != 1:
      raise ValueError(
          f"per_example_loss_fn must return a [B] tensor, got shape "
          f"{raw_losses.shape}")
    b_static = raw_losses.shape[0]
    if not tf.is_tensor(k) and k > 1 and b_static is not None and b_static % k:
      raise ValueError(
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

  # First backward pass: gradients at the watched tensors of ghost units and
  # at the outputs of vectorized units (one pass through the network).
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
  if True:  # pylint: disable=using-constant-test  (tape not recording)
    src_grads = tape.gradient(
        total, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    sq = tf.zeros([batch // k], tf.float32)
    per_example = {}  # unit -> list of [M, ...] per-record grads
    normed = set()  # units whose squared norms are already in sq
    for u, start, n in ghost:
      grads_w = src_grads[start:start + n]
      watched = u.records[0]["watched"]
      grads_w = tf.nest.pack_sequence_as(watched, grads_w)
      with registry.examples_per_record(k):
        res = u.records[0]["sqr_norm_fn"](grads_w)
      if isinstance(res, registry.PerExampleGrads):
        per_example[id(u)] = list(res.grads)
        normed.add(id(u))
        res = res.sqr_norms
      sq += tf.cast(res, tf.float32)
    ghost_vjp = [(u, start, n) for u, start, n in ghost
                 if id(u) not in per_example]
    for u, rec, start, n in vect:
      g = _vectorized_grads(u, rec, src_grads[start:start + n])
      with registry.examples_per_record(k):
        g = [registry.record_sum(t) for t in g]
      if id(u) in per_example:
        per_example[id(u)] = [a + b for a, b in zip(per_example[id(u)], g)]
      else:
        per_example[id(u)] = g
    for uid, gs in per_example.items():
      if uid in normed:
        continue
      for g in gs:
        sq += tf.reduce_sum(
            tf.reshape(tf.square(tf.cast(g, tf.float32)), [batch // k, -1]),
            axis=1)
    norms = tf.sqrt(tf.maximum(sq, 0.0))
    factors = tf.minimum(1.0, clip / tf.maximum(norms, 1e-30))
    if mask is not None or _grouped(k):
      factors = factors * record_mask
    factors = tf.stop_gradient(factors)
    example_factors = tf.repeat(factors, k) if _grouped(k) else factors

  result = {}
  if variant == "two_pass":
    with tape:
      weighted = tf.reduce_sum(example_factors * losses)
    all_vars = [v for u in units for v in u.variables]
    grads = tape.gradient(weighted, all_vars,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    for v, g in zip(all_vars, grads):
      result[id(v)] = _dense(g)
  else:
    for u, start, n in ghost_vjp:
      w = src_grads[start:start + n]
      targets_w = sources[start:start + n]
      weighted_w = []
      for g in w:
        f = tf.reshape(example_factors, [-1] + [1] * (g.shape.rank - 1))
        weighted_w.append(g * tf.cast(f, g.dtype))
      grads = tape.gradient(targets_w, u.variables, output_gradients=weighted_w,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      for v, g in zip(u.variables, grads):
        result[id(v)] = _dense(g)
    for u in units:
      gs = per_example.get(id(u))
      if gs is None:
        continue
      for v, g in zip(u.variables, gs):
        result[id(v)] = tf.cast(
            tf.tensordot(factors, tf.cast(g, tf.float32), axes=1), v.dtype)
  del tape
  out = []
  for v in model.trainable_variables:
    g = result.get(id(v))
    out.append(tf.zeros(v.shape, v.dtype) if g is None else g)
  if return_outputs:
    return out, norms, outputs, raw_losses
  return out, norms


def clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                     l2_norm_clip, mask=None, examples_per_record=1,
                     return_outputs=False):
  """Sum over records of per-record gradients clipped to L2 norm C.

  Computes sum_j g_j * min(1, C / ||g_j||_2) (McMahan et al. 2018, Sec. 2,
  pi_C, flat clipping over all trainable variables). A record is one example
  (examples_per_record=1) or k consecutive examples (a microbatch: rows
  j*k ... j*k + k - 1), whose gradient g_j is that of the mean loss of its
  real examples. Ghost norms for registered layers, vectorized per-example
  gradients for the others. No noise.

  Args:
    model: a built keras.Model; model(inputs, training=True) is run once.
    inputs, targets: a batch of B examples (leading axis); B a multiple of k.
    per_example_loss_fn: (y_true, y_pred) -> [B] per-example losses.
    l2_norm_clip: C > 0, in units of the gradient L2 norm.
    mask: optional [B] 0/1; rows with 0 contribute nothing. A record with no
      real example has norm 0.
    examples_per_record: k, a positive integer.
    return_outputs: also return the model outputs and the [B] losses.

  Returns:
    (grads, per_record_norms[, outputs, losses]): grads is a list of dense
    tensors aligned with model.trainable_variables; per_record_norms is
    [B / k] float32, ||g_j||_2 before clipping.
  """
  return _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                           l2_norm_clip, mask=mask, variant=DEFAULT_VARIANT,
                           examples_per_record=examples_per_record,
                           return_outputs=return_outputs)
