"""Every private Keras API tf_dpiter.keras relies on, behind small named functions.

Keras 3 has no public way to do a few things the DP train step needs (nested layers, the
compiled loss and metrics, XLA off for the outer train function, a functional graph,
variables substituted in a `StatelessScope`, Keras masks, the backend's RNN loop, a layer's
`call` swapped for one pass). Each such use goes through one function here, so a Keras
upgrade breaks in one place: a missing attribute raises AttributeError naming it and the
Keras version (`_require`; tests/keras/test_keras_internals.py lists them). Three private
TensorFlow names are wrapped here too (`shared_constants`: the graph constants of a trace,
one per integer value; `plain_resource_variable`: a variable made past tf.Variable's creator
scopes; `graph_owned_gradients`: tf.custom_gradient's registrations held by their graph).
"""

import collections
import contextlib
import functools
import inspect
import threading
import types
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import constant_op
from tensorflow.python.framework import op_callbacks
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import resource_variable_ops

from tf_dpiter.errors import ParameterValueError


def keras_version():
  """The installed Keras version string (for error messages)."""
  return keras.__version__


def _require(obj, attribute, where):
  if not hasattr(obj, attribute):
    raise AttributeError(
        f"tf_dpiter needs the private Keras attribute {where}.{attribute}, which Keras "
        f"{keras_version()} does not have (tf_dpiter/keras/internals/keras_internals.py adapts to it)")
  return getattr(obj, attribute)


def call_with_captures(concrete, captures):
  """Runs the traced no-argument ConcreteFunction `concrete` with `captures` (tensors, in the
  order of its captured inputs) in place of what it captured (TensorFlow's private
  `ConcreteFunction._call_flat`); returns its flattened outputs."""
  call_flat = _require(concrete, "_call_flat", "tf.types.experimental.ConcreteFunction")
  return call_flat([], captures)


# ---- models and layers ------------------------------------------------------------------

def flatten_layers(model, include_self=True, recursive=True):
  """The layers of `model` (nested ones too when `recursive`): Keras' `_flatten_layers`."""
  fn = _require(model, "_flatten_layers", "Layer")
  return list(fn(include_self=include_self, recursive=recursive))


def seed_generators(model):
  """The keras.random.SeedGenerators the layers of `model` draw from (nested layers too), each
  once, in Keras' layer order; and Keras' global one (`keras.random.*` with seed=None) when it
  exists."""
  found, seen = [], set()
  for layer in flatten_layers(model):
    for generator in getattr(layer, "_seed_generators", ()):
      if id(generator) not in seen:
        seen.add(id(generator))
        found.append(generator)
  shared = keras.src.backend.common.global_state.get_global_attribute(
      keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR)
  if shared is not None and id(shared) not in seen:
    found.append(shared)
  return found


def closure_layers(fn, depth=3):
  """The keras Layers a callable reaches without being called, each once: its closure's cells,
  the module globals its code names, its defaults, a bound method's object, a partial's
  function and arguments, a decorator's `__wrapped__`, a tf.function's Python function, a
  callable object's `__call__`, the values of containers and the attributes of objects
  (`__dict__` and `__slots__`), following nested functions and objects up to `depth` levels."""
  found, seen = [], set()

  def visit(value, level):
    if isinstance(value, _HOLD_NO_LAYER) or id(value) in seen or level < 0:
      return
    seen.add(id(value))
    if isinstance(value, keras.layers.Layer):
      found.append(value)
    elif isinstance(value, functools.partial):
      for v in (value.func, *value.args, *value.keywords.values()):
        visit(v, level)
    elif isinstance(value, (list, tuple, dict, set, frozenset, collections.deque)):
      for v in (value.values() if isinstance(value, dict) else value):
        visit(v, level)
    elif inspect.ismethod(value):
      visit(value.__self__, level)
      visit(value.__func__, level)
    elif isinstance(value, tf.types.experimental.PolymorphicFunction):
      visit(getattr(value, "python_function", None), level)
    elif inspect.isfunction(value):
      if hasattr(value, "__wrapped__"):   # a decorator's wrapper: not a level of nesting
        visit(value.__wrapped__, level)
      cells = [c.cell_contents for c in (value.__closure__ or ()) if _filled(c)]
      names = [value.__globals__[n] for n in value.__code__.co_names
               if n in value.__globals__]
      for v in cells + names + list(value.__defaults__ or ()):
        visit(v, level - 1)
    elif not isinstance(value, (types.ModuleType, type)):   # an object holding layers
      attributes = _attributes(value)
      if attributes is not None:
        if callable(value):   # (else type(value).__call__ is the class's own: its metaclass')
          visit(type(value).__call__, level)
        for v in attributes:
          visit(v, level - 1)

  visit(fn, depth)
  return found


# Values `closure_layers` passes over at once: they hold no layer.
_HOLD_NO_LAYER = (str, bytes, int, float, complex, type(None), np.ndarray, np.generic,
                  tf.Tensor)


def _attributes(value):
  """The values of an object's `__dict__` and `__slots__` (read through the slots' member
  descriptors: no user code runs), or None for an object with neither."""
  own = getattr(value, "__dict__", None)
  values = list(own.values()) if isinstance(own, dict) else None
  for klass in type(value).__mro__[:-1]:
    slots = klass.__dict__.get("__slots__")
    if slots is None:
      continue
    values = [] if values is None else values
    for name in (slots,) if isinstance(slots, str) else slots:
      if name.startswith("__") and not name.endswith("__"):   # a private name, mangled
        name = f"_{klass.__name__.lstrip('_')}{name}"
      slot = klass.__dict__.get(name)
      if isinstance(slot, types.MemberDescriptorType):
        values.extend(_slot_value(slot, value))
  return values


def _slot_value(slot, value):
  """[the value `value`'s slot holds], or [] for an unassigned slot."""
  try:
    return [slot.__get__(value, type(value))]
  except AttributeError:
    return []


def _filled(cell):
  """Whether a closure cell holds a value (an unassigned one raises ValueError)."""
  try:
    cell.cell_contents   # pylint: disable=pointless-statement
  except ValueError:
    return False
  return True


def batch_shared_draws(model):
  """The names of the layers of `model` whose random draw serves several rows of the batch (a
  Dropout whose `noise_shape` is 1 on the batch axis)."""
  return [layer.name for layer in flatten_layers(model)
          if getattr(layer, "_seed_generators", None)
          and (getattr(layer, "noise_shape", None) or (None,))[0] == 1]


def layer_children(layer):
  """{id(l): l's direct sublayers} for `layer` and every layer nested in it, in one walk."""
  children, todo = {}, [layer]
  while todo:
    current = todo.pop()
    if id(current) in children:
      continue
    subs = flatten_layers(current, include_self=False, recursive=False)
    children[id(current)] = subs
    todo.extend(subs)
  return children


def compiled_loss_fn(model):
  """Keras' `Model._compute_loss` bound to `model` (keywords x, y, y_pred, sample_weight,
  training)."""
  return _require(model, "_compute_loss", "Model")


def call_has_training_arg(model):
  """True if `model.call` takes a `training` argument (Keras' `_call_has_training_arg`)."""
  return bool(_require(model, "_call_has_training_arg", "Layer"))


def symbolic_build(model, data_spec):
  """Builds an unbuilt compiled model from a batch spec's shapes (Keras' `_symbolic_build`)."""
  _require(model, "_symbolic_build", "Model")(data_batch=data_spec)


def loss_tracker(model):
  """The model's loss metric (`logs["loss"]`), Keras' `_loss_tracker`."""
  return _require(model, "_loss_tracker", "Model")


@contextlib.contextmanager
def jit_compile_off(model):
  """Within the block `model` makes its train function without XLA (Keras' `_jit_compile`,
  restored after)."""
  old = _require(model, "_jit_compile", "Model")
  model._jit_compile = False  # pylint: disable=protected-access
  try:
    yield
  finally:
    model._jit_compile = old  # pylint: disable=protected-access


def compile_metrics(model):
  """The compiled metrics container of `model` (Keras' `_compile_metrics`), or None."""
  return getattr(model, "_compile_metrics", None)


def compiled_metric_names(model):
  """The names the user's compiled metrics (weighted ones too) log under; [] when none."""
  container = compile_metrics(model)
  given = [getattr(container, attr, None) for attr in ("_user_metrics", "_user_weighted_metrics")]
  return [getattr(m, "name", m) for m in tf.nest.flatten([g for g in given if g is not None])
          if isinstance(getattr(m, "name", m), str)]


def update_compiled_metrics(model, y, y_pred, sample_weight, example_mask):
  """Updates `model`'s compiled metrics as Keras' CompileMetrics.update_state does, with the
  unweighted metrics weighted by `example_mask` ([B] 0/1), so padding rows reach no metric
  (weighted metrics get `sample_weight`, already 0 there)."""
  cm = compile_metrics(model)
  if cm is None:
    return
  if not cm.built:
    cm.build(y, y_pred)
  flat_metrics = _require(cm, "_flat_metrics", "CompileMetrics")
  flat_weighted = _require(cm, "_flat_weighted_metrics", "CompileMetrics")
  y_true, y_pred = cm._flatten_y(y), cm._flatten_y(y_pred)  # pylint: disable=protected-access
  for m, y_t, y_p in zip(flat_metrics, y_true, y_pred):
    if m:
      m.update_state(y_t, y_p, sample_weight=example_mask)
  if sample_weight is not None:
    sample_weight = cm._flatten_y(sample_weight)  # pylint: disable=protected-access
    if len(sample_weight) < len(y_true):   # one weight for every output, as Keras does
      sample_weight = [sample_weight[0]] * len(y_true)
  else:
    sample_weight = [None] * len(y_true)
  for m, y_t, y_p, s_w in zip(flat_weighted, y_true, y_pred, sample_weight):
    if m:
      m.update_state(y_t, y_p, s_w)


def output_loss_trackers(model):
  """The per-output loss metrics of `model`'s compiled loss, in its outputs' order (Keras'
  `CompileLoss.metrics`); [] with no compiled loss or a single output."""
  compiled = getattr(model, "_compile_loss", None)
  return list(compiled.metrics) if compiled is not None else []


@contextlib.contextmanager
def output_loss_trackers_swapped(model, stand_ins):
  """Within the block `model`'s compiled loss updates `stand_ins[i]` (an object with
  `update_state(value, sample_weight)`, or None: nothing) in place of its i-th per-output loss
  metric (Keras' `CompileLoss._metrics`)."""
  compiled = model._compile_loss  # pylint: disable=protected-access
  old = _require(compiled, "_metrics", "CompileLoss")
  compiled._metrics = list(stand_ins)  # pylint: disable=protected-access
  try:
    yield
  finally:
    compiled._metrics = old  # pylint: disable=protected-access


def compile_loss_unbuilt(model):
  """True if `model` has a compiled loss not built yet (no per-output trackers yet)."""
  compiled = getattr(model, "_compile_loss", None)
  return compiled is not None and not compiled.built


def build_compile_loss(model, y, y_pred, sample_weight):
  """Builds `model`'s compiled loss (its per-output trackers) from a batch's shapes, as Keras'
  `_symbolic_build` does, without running the model.

  Raises:
    ParameterValueError: a tensor of unknown rank (Keras builds from static shapes).
  """
  compiled = _require(model, "_compile_loss", "Model")

  def symbolic(t):   # a tensor, or a numpy array (an eager train_on_batch hands those)
    if t is not None and tf.TensorShape(t.shape).rank is None:
      raise ParameterValueError(
          "The labels, predictions and sample weights of a batch must have a known rank for "
          "the model's compiled loss to be built (the labels after tf.squeeze with no axis "
          "have none). Give them one (tf.ensure_shape(y, [None, 1]), or squeeze a named "
          f"axis). Received: a {t.dtype.name} tensor of unknown rank")
    return None if t is None else keras.KerasTensor(
        t.shape, keras.backend.standardize_dtype(t.dtype))

  y, y_pred, sample_weight = tf.nest.map_structure(symbolic, (y, y_pred, sample_weight))
  keras.src.backend.compute_output_spec(compiled, y, y_pred, sample_weight)


def call_compile_loss(model, y, y_pred, sample_weight):
  """The weighted total of `model`'s compiled losses on a batch (Keras' `CompileLoss`, no layer
  losses)."""
  return _require(model, "_compile_loss", "Model")(y, y_pred, sample_weight)


def unscale_loss_for_distribution(value):
  """Keras' undoing of a loss's 1/replicas scaling (what its per-output loss metrics log)."""
  return keras.src.losses.loss.unscale_loss_for_distribution(value)


def set_compile_metrics(model, metrics):
  """Replaces the compiled metrics container of `model` (None detaches it)."""
  _require(model, "_compile_metrics", "Model")
  model._compile_metrics = metrics  # pylint: disable=protected-access


def replace_compiled_optimizer(model, optimizer):
  """Puts `optimizer` in place of a compiled model's optimizer, keeping everything else
  `compile` set; the compile config names the new one."""
  config = _require(model, "_compile_config", "Model")
  _require(config, "config", "SerializableDict")["optimizer"] = optimizer
  model.optimizer = optimizer
  model.train_function = None   # traced with the old optimizer


def functional_class():
  """The class of functional models, `keras.Model(inputs, outputs)` (not exported publicly)."""
  return keras.src.models.functional.Functional


def functional_graph(model):
  """(graph, {depth: [nodes]}) of a functional (or built Sequential) model: the model or its
  `_functional`, and Keras' `_nodes_by_depth`; None for a subclassed model."""
  graph = model if hasattr(model, "_nodes_by_depth") else getattr(model, "_functional", None)
  if graph is None or not hasattr(graph, "_nodes_by_depth"):
    return None
  return graph, graph._nodes_by_depth  # pylint: disable=protected-access


def functional_inputs_struct(graph):
  """The structure of `keras.Input` tensors a functional model was built on (Keras'
  `Functional._inputs_struct`)."""
  return _require(graph, "_inputs_struct", "Functional")


# ---- tensors, scopes, backend -----------------------------------------------------------

def keras_mask(tensor):
  """The Keras mask a layer attached to `tensor` (`_keras_mask`), or None."""
  return getattr(tensor, "_keras_mask", None)


def set_keras_mask(tensor, mask):
  """Attaches `mask` to `tensor` as Keras layers do, so losses and metrics apply it."""
  tensor._keras_mask = mask  # pylint: disable=protected-access


def map_variables(scope, variables, values):
  """Makes an entered `keras.StatelessScope` read `variables[i]` as `values[i]` (any dtype: set
  after construction, since the constructor casts values to the variables' dtype)."""
  state = _require(scope, "state_mapping", "StatelessScope")
  state.update({id(v): value for v, value in zip(variables, values)})


def rnn(*args, **kwargs):
  """Keras' backend RNN loop (`keras.src.backend.rnn`; no public alias), same arguments."""
  return _require(keras.src.backend, "rnn", "keras.src.backend")(*args, **kwargs)


# ---- layer.call swapping (fast clipping's recording forward pass) -------------------------

def swap_call(layer, call):
  """Makes `layer(...)` run `call` in place of its own call method; returns the token for
  `restore_call`."""
  had_own = "call" in layer.__dict__
  token = (layer, had_own, layer.__dict__.get("call"))
  object.__setattr__(layer, "call", call)
  return token


def restore_call(token):
  """Undoes `swap_call` (`token`: what it returned)."""
  layer, had_own, own = token
  if had_own:
    object.__setattr__(layer, "call", own)
  else:
    object.__delattr__(layer, "call")


# ---- TensorFlow: one graph constant per integer value in a trace -------------------------
#
# Tracing a step creates one `Const` op per `tf.constant` and per Python value converted
# (shapes, axes, slice bounds: 3,504 Consts of 184 values in BERT-base's step), each costing
# trace, conversion and Grappler time. Inside a `shared_constants` block an integer or
# boolean constant of at most _SHARED_CONST_BYTES made in the graph being traced is made once
# per graph, only where the result is the same tensor either way (no control dependency,
# device, colocation or control-flow context, no op callbacks). Floating constants are never
# shared: a tape may watch a floating tensor, and a watched tensor used twice gets both
# gradients. TensorFlow has no public hook: `constant_op._constant_impl` is wrapped while a
# block is open in some thread, and acts only in those threads.

_SHARED_CONST_BYTES = 256
_SHARED_CONST_DTYPES = frozenset([types_pb2.DT_INT32, types_pb2.DT_INT64, types_pb2.DT_BOOL])
_CONSTS = threading.local()   # .memo: {(id(graph), serialized value): tensor}, in a block
_CONSTS_LOCK = threading.Lock()
_CONSTS_PATCH = {"original": None, "blocks": 0}   # the wrapped function, the open blocks


def _plain_graph_context(graph):
  """True when a Const created now in `graph` gets no control input, device, colocation or
  control-flow context: the same tensor whichever call creates it."""
  # pylint: disable=protected-access
  return (not graph._control_dependencies_for_inputs([])
          and not len(graph._device_function_stack)
          and not len(graph._colocation_stack)
          and graph._get_control_flow_context() is None
          and not op_callbacks.should_invoke_op_callbacks())


def _shared_constant_impl(value, dtype, shape, name, verify_shape, allow_broadcast):
  """constant_op._constant_impl, an integer or boolean constant shared per graph in a
  `shared_constants` block of this thread."""
  original = _CONSTS_PATCH["original"]
  memo = getattr(_CONSTS, "memo", None)
  if memo is None or tf.executing_eagerly():
    return original(value, dtype, shape, name, verify_shape, allow_broadcast)
  graph = tf_ops.get_default_graph()
  if not _plain_graph_context(graph):
    return original(value, dtype, shape, name, verify_shape, allow_broadcast)
  proto = tensor_util.make_tensor_proto(value, dtype=dtype, shape=shape,
                                        verify_shape=verify_shape,
                                        allow_broadcast=allow_broadcast)
  if proto.dtype not in _SHARED_CONST_DTYPES or proto.ByteSize() > _SHARED_CONST_BYTES:
    return original(proto, None, None, name, False, True)
  key = (id(graph), proto.SerializeToString())
  got = memo.get(key)
  if got is None or got.graph is not graph:   # a graph's id reused after the first's end
    got = memo[key] = original(proto, None, None, name, False, True)
  return got


@contextlib.contextmanager
def shared_constants():
  """Within the block (this thread, graph mode), integer and boolean constants are created once
  per graph being traced (the section's comment above); nested blocks share one memo.

  Raises:
    AttributeError: the installed TensorFlow has no constant_op._constant_impl.
  """
  if not hasattr(constant_op, "_constant_impl"):
    raise AttributeError(
        "tf_dpiter needs the private TensorFlow function "
        "tensorflow.python.framework.constant_op._constant_impl, which TensorFlow "
        f"{tf.__version__} does not have (tf_dpiter/keras/internals/keras_internals.py, "
        "shared_constants, adapts to it)")
  with _CONSTS_LOCK:
    if _CONSTS_PATCH["blocks"] == 0:
      _CONSTS_PATCH["original"] = constant_op._constant_impl   # pylint: disable=protected-access
      constant_op._constant_impl = _shared_constant_impl   # pylint: disable=protected-access
    _CONSTS_PATCH["blocks"] += 1
  outer = getattr(_CONSTS, "memo", None)
  if outer is None:
    _CONSTS.memo = {}
  try:
    yield
  finally:
    if outer is None:
      _CONSTS.memo = None
    with _CONSTS_LOCK:
      _CONSTS_PATCH["blocks"] -= 1
      if _CONSTS_PATCH["blocks"] == 0:
        constant_op._constant_impl = _CONSTS_PATCH["original"]   # pylint: disable=protected-access
        _CONSTS_PATCH["original"] = None


def plain_resource_variable(value, name):
  """A non-trainable ResourceVariable holding `value`, made under tf.init_scope by TensorFlow's
  private `resource_variable_ops`, not `tf.Variable`: a tf.function's creator scope refuses a
  tf.Variable made on any trace but the first, and a strategy's scope would mirror it. It is
  in no Keras or TF object graph but the caller's."""
  with tf.init_scope():
    return resource_variable_ops.ResourceVariable(value, trainable=False, name=name)


# ---- the upgrade check ------------------------------------------------------------------

def gradient_sources(variables):
  """The backend variables behind Keras variables, as `GradientTape.gradient` sources (with
  unconnected_gradients=ZERO a Keras 3 variable the computation does not use fails)."""
  return [v.value if isinstance(v, keras.Variable) else v for v in variables]


# the names tf.custom_gradient registers under, and the graph attribute holding them
_CUSTOM_GRADIENT_PREFIX = "CustomGradient-"
_OWNED_GRADIENTS = "_tf_dpiter_custom_gradients"


def graph_owned_gradients(fn, *args):
  """fn(*args), the tf.custom_gradient functions it registered held by the current graph.

  `tf.custom_gradient` traced in a graph registers its gradient function in the process-wide
  registry (private) and never removes it, keeping every traced DP step alive. Each such
  function is moved onto its graph; the registry keeps a forwarder holding the graph weakly,
  removed when the graph is collected."""
  registry = getattr(getattr(tf_ops, "gradient_registry", None), "_registry", None)
  if tf.executing_eagerly() or not isinstance(registry, dict):
    return fn(*args)
  before = set(registry)
  out = fn(*args)
  graph = tf_ops.get_default_graph()
  owned = getattr(graph, _OWNED_GRADIENTS, None)
  if owned is None:
    owned = {}
    setattr(graph, _OWNED_GRADIENTS, owned)
  graph_ref = weakref.ref(graph)
  for name in [k for k in registry if k not in before and k.startswith(_CUSTOM_GRADIENT_PREFIX)]:
    entry = registry[name]
    owned[name] = entry["type"]
    registry[name] = dict(entry, type=functools.partial(_forward_gradient, graph_ref, name))
    weakref.finalize(graph, registry.pop, name, None)
  return out


def _forward_gradient(graph_ref, name, op, *grads):
  return getattr(graph_ref(), _OWNED_GRADIENTS)[name](op, *grads)
