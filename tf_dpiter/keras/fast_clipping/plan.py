"""Which layers of a model get ghost norms and which get vectorized
per-example gradients: the units of fast per-example clipping.

A unit is a layer whose trainable variables are clipped as one block of g_i:
a registered layer (ghost norm, registry.py) or, for the rest, the smallest
layer that owns its variables and has no registered descendant (vectorized
per-example gradients, re-running the layer on each example).

Which variables are clipped follows what the optimizer trains,
`model.trainable_variables`, variable by variable, not the layers' `trainable`
flags. In Keras 3, `layer.trainable_variables` is empty for a layer whose own
flag is False even when a sublayer of it was set trainable again afterwards
(keras_hub's `backbone.enable_lora(r)` freezes every sublayer, then unfreezes
the LoRA targets); the model's list still holds the sublayer's variables. The
plan therefore descends into such a frozen parent, and a registered leaf
becomes a ghost unit only when its `trainable_variables` are exactly the
variables of it that the model trains (else it is clipped on the vectorized
path over those variables).

Within one DP step (`one_plan_per_step`) a model's plan is built once and reused by the
routing checks and the clipped sum; the Keras train step keeps it for its whole train
function (`_TraceFacts.plans`), rebuilt only when the model's trainable variables or the
registered rules change.
"""

import contextlib
import threading

import keras

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.fast_clipping import registry

GHOST = "ghost"
VECTORIZED = "vectorized"

# Layers whose output for one example depends on other examples of the batch:
# per-example gradients (hence clipping) are undefined for them.
_BATCH_COUPLED = (keras.layers.BatchNormalization,)

# Layers that call their sublayers in a loop or on a reshaped batch: their
# sublayers never see one row per example, so they are clipped as one block.
_OPAQUE = (keras.layers.RNN, keras.layers.TimeDistributed)

SIXTEEN_BIT = ("float16", "bfloat16")

# Inside `one_plan_per_step`: {(id(model), grouped): (model, signature, units)}, per thread
# (a tf.distribute strategy runs each replica's step in its own thread).
_STEP_PLANS = threading.local()


@contextlib.contextmanager
def one_plan_per_step(kept=None):
  """Within the block `plan(model, grouped)` is built once per model and `grouped` and then
  reused (as new `Unit` objects: a clipped sum records into its units) while the model's
  trainable variables, the registered rules and its layers with their `call` stay the same
  (a layer frozen or unfrozen, swapped in or given another `call` is planned as it is then). The block is one DP step (or its trace).

  Args:
    kept: a dict that outlives the block, holding the plans across blocks: the Keras train
      step passes its train function's (`_TraceFacts.plans`; Keras asks for a new train
      function after a change of the layers' `trainable`, `make_train_function(force=True)`).
      None: a dict of this block (or of the enclosing block).

  Yields:
    None.
  """
  outer = getattr(_STEP_PLANS, "plans", None)
  _STEP_PLANS.plans = kept if kept is not None else ({} if outer is None else outer)
  try:
    yield
  finally:
    _STEP_PLANS.plans = outer


def _sublayers(tree, layer, include_self=False, recursive=True):
  """The layers under `layer` (direct ones unless `recursive`), each once, from `tree`
  (`keras_internals.layer_children` of the model)."""
  out, seen, todo = [layer] if include_self else [], {id(layer)}, list(tree[id(layer)])
  while todo:
    sub = todo.pop(0)
    if id(sub) in seen:
      continue
    seen.add(id(sub))
    out.append(sub)
    if recursive:
      todo.extend(tree[id(sub)])
  return out


def computes_in_16_bits(layer):
  """True if the layer's compute dtype is float16 or bfloat16.

  Args:
    layer: a Keras layer.

  Returns:
    bool.
  """
  dtype = keras.backend.standardize_dtype(getattr(layer, "compute_dtype", "float32"))
  return dtype in SIXTEEN_BIT


def _trained(layer, trained):
  """The variables of `layer` (its sublayers' included) that the model trains:
  those whose id is in `trained`, in the order of `layer.variables`."""
  return [v for v in layer.variables if id(v) in trained]


def _has_registered(tree, layer, trained, rules):
  return any(rules[id(sub)] is not None and _trained(sub, trained)
             for sub in _sublayers(tree, layer))


class Unit:
  """A layer and the variables of it clipped as one block of g_i.

  Args:
    layer: the Keras layer.
    kind: GHOST (the layer's registered norm function) or VECTORIZED.
    norm_fn: the norm function of a GHOST unit, else None.
    variables: the variables clipped in this unit; by default
      `layer.trainable_variables` (what a norm function sums over).
  """

  def __init__(self, layer, kind, norm_fn, variables=None):
    self.layer = layer
    self.kind = kind
    self.norm_fn = norm_fn
    self.variables = list(layer.trainable_variables if variables is None else variables)
    self.records = []
    self.orig_call = None

  @property
  def float32_recompute(self):
    """A ghost unit computing in 16 bits: its clipped sum is the vector-Jacobian
    product of the norm function's float32 recomputation of `watched`."""
    return (self.kind == GHOST and computes_in_16_bits(self.layer) and
            not getattr(self.norm_fn, "float32_sums", False))


def _direct_trained(layer, children, trained):
  """The trained variables of `layer` that none of its children owns."""
  in_children = {id(v) for child in children for v in child.variables}
  return [v for v in _trained(layer, trained) if id(v) not in in_children]


def _check_deterministic(tree, layer):
  """The vectorized path re-runs a layer per example (so does a ghost unit
  whose rule declines the call): it must be a function of its inputs (no
  internal dropout), or the gradients would be wrong."""
  for sub in _sublayers(tree, layer, include_self=True):
    rates = [getattr(sub, "dropout", 0), getattr(sub, "recurrent_dropout", 0),
             getattr(sub, "_dropout", 0)]
    if isinstance(sub, keras.layers.Dropout):
      rates.append(sub.rate)
    if max(float(r) if isinstance(r, (int, float)) else 0.0 for r in rates) > 0:
      raise PrivacyConfigError(
          f"layer {layer.name!r} contains dropout ({sub.name!r}) and no "
          "registered rule clips it in one pass; its per-example gradients "
          "cannot be recomputed. Move the dropout to its own layer (or "
          "register a rule that handles it)")


def _ghost_norm_fn(layer, grouped, variables, norm_fn):
  """`norm_fn`, the layer's registered norm function (or None), if it can serve this plan,
  else None.

  A norm function sums over `layer.trainable_variables`: it serves only if
  those are exactly `variables`, the layer's variables the model trains.
  """
  declines = (norm_fn is None or
              {id(v) for v in layer.trainable_variables} != {id(v) for v in variables} or
              (grouped and not getattr(norm_fn, "supports_records", False)) or
              (computes_in_16_bits(layer) and not (getattr(norm_fn, "float32_watched", False) or
                                                   getattr(norm_fn, "float32_sums", False))))
  return None if declines else norm_fn


def _check_coverage(model, units, trained):
  covered = {}
  for u in units:
    for v in u.variables:
      if id(v) in covered:
        raise ParameterValueError(
            f"variable {v.path!r} is shared by layers "
            f"{covered[id(v)]!r} and {u.layer.name!r}; not supported")
      covered[id(v)] = u.layer.name
  missing = [v.path for v in model.trainable_variables if id(v) not in covered]
  if missing:
    raise PrivacyConfigError(
        f"trainable variables {missing} are not owned by any layer of model "
        f"{model.name!r}; cannot clip per example")
  extra = [v.path for u in units for v in u.variables if id(v) not in trained]
  if extra:
    raise PrivacyConfigError(
        f"variables {extra} would be clipped but are not in "
        f"{model.name!r}.trainable_variables (the optimizer does not train them)")


def plan(model, grouped=False):
  """Splits `model.trainable_variables` into units (module docstring).

  Args:
    model: a built keras.Model.
    grouped: records of several examples; registered layers whose norm function
      does not honour algebra.examples_per_record take the vectorized path, as
      do 16-bit layers whose norm function is neither registry.float32_watched
      nor registry.float32_sums.

  Returns:
    a list of Unit whose variables are exactly model.trainable_variables, each once.

  Raises:
    ParameterValueError: unbuilt model, a batch-coupled layer with trained variables, an
      unregistered layer with internal dropout, a variable shared by two units,
      or a trained variable no layer owns.
  """
  if not isinstance(model, keras.layers.Layer):
    raise ParameterValueError(f"model must be a keras.Model, got {type(model).__name__}")
  if not model.built:
    raise PrivacyConfigError(
        f"model must be built before clipping, got model.built=False "
        f"(model={model.name!r})")
  memo = getattr(_STEP_PLANS, "plans", None)
  trainable = model.trainable_variables
  # what a kept plan must still match: the trained variables, the registered rules, and
  # each layer with the forward it runs (a rule serves a class whose `call` it knows: a
  # layer swapped in, or a `call` replaced on the class or the instance, is planned anew)
  signature = (tuple(id(v) for v in trainable), registry.RULES_VERSION,
               tuple((id(l), type(l).call, vars(l).get("call"))
                     for l in keras_internals.flatten_layers(model)))
  hit = memo.get((id(model), grouped)) if memo is not None else None
  if hit is not None and hit[0] is model and hit[1] == signature:
    # fresh units (a clipped sum records its forward pass into them, one chunk at a time)
    return [Unit(u.layer, u.kind, u.norm_fn, u.variables) for u in hit[2]]
  units, seen = [], set()
  trained = {id(v) for v in trainable}
  tree = keras_internals.layer_children(model)
  # every layer's registered rule, looked up once per plan (the rules do not change in it)
  rules = registry.lookup_all(_sublayers(tree, model, include_self=True))

  def visit(layer):
    if id(layer) in seen:
      return
    seen.add(id(layer))
    variables = _trained(layer, trained)
    if isinstance(layer, _BATCH_COUPLED) and variables:
      raise ParameterValueError(
          f"layer {layer.name!r} ({type(layer).__name__}) mixes examples of "
          "the batch; per-example gradient norms are undefined for it")
    if not variables:
      return
    norm_fn = _ghost_norm_fn(layer, grouped, variables, rules[id(layer)])
    if norm_fn is not None:
      _check_deterministic(tree, layer)   # a rule may decline the call at run time
      units.append(Unit(layer, GHOST, norm_fn))
      return
    children = _sublayers(tree, layer, recursive=False)
    if (_direct_trained(layer, children, trained) or not children or
        isinstance(layer, _OPAQUE) or not _has_registered(tree, layer, trained, rules) or
        rules[id(layer)] is not None):
      _check_deterministic(tree, layer)
      units.append(Unit(layer, VECTORIZED, None, variables))
      return
    for child in children:
      visit(child)

  visit(model)
  _check_coverage(model, units, trained)
  if memo is not None:
    memo[(id(model), grouped)] = (model, signature,
                                  [Unit(u.layer, u.kind, u.norm_fn, u.variables) for u in units])
  return units


def supports(model):
  """True if clipped_grad_sum can clip this (built) model exactly.

  The model may mix registered layers (ghost norms) and unregistered ones
  (vectorized per-example gradients); see unregistered_layers(model).
  False for unbuilt models, batch-coupled layers (BatchNormalization),
  unregistered layers with internal dropout and variables shared between
  layers.
  """
  try:
    plan(model)
  except ValueError:
    return False
  return True


def unregistered_layers(model):
  """Names of the layers that take the vectorized per-example path.

  Args:
    model: a built keras.Model.

  Returns:
    list of layer names (str).
  """
  return [u.layer.name for u in plan(model) if u.kind == VECTORIZED]
