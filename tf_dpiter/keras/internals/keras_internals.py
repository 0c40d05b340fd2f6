"""Every private Keras API tf_dpiter.keras relies on, behind small named functions.

Keras 3 has no public way to do a few things the DP train step needs (nested layers, the
compiled loss and metrics, XLA off for the outer train function, a functional graph,
variables substituted in a `StatelessScope`, Keras masks, the backend's RNN loop, a layer's
`call` swapped for one pass). Each such use goes through one function here, so a Keras
upgrade breaks in one place: tests/keras/test_keras_internals.py lists what the installed
Keras lacks, naming the attribute and the version. Two private TensorFlow names are wrapped
here too (`shared_constants`: the graph constants of a trace, one per integer value;
`plain_resource_variable`: a variable made past tf.Variable's creator scopes;
`graph_owned_gradients`: tf.custom_gradient's registrations held by their graph).
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
  """Runs the traced ConcreteFunction `concrete` of no argument with `captures` (tensors, in
  the order of its captured inputs) in place of the tensors it captured (TensorFlow's private
  `ConcreteFunction._call_flat`; a custom loop's loss_fn re-run on one record's rows).

  Args:
    concrete: a tf.function's ConcreteFunction traced with no argument.
    captures: a list of tensors, one per captured input, of the captured tensors' dtypes.

  Returns:
    the function's outputs, flattened.
  """
  call_flat = _require(concrete, "_call_flat", "tf.types.experimental.ConcreteFunction")
  return call_flat([], captures)


# ---- models and layers ------------------------------------------------------------------

def flatten_layers(model, include_self=True, recursive=True):
  """The layers of `model` (nested ones too when `recursive`), as Keras tracks them.

  Args:
    model: a keras.Layer or keras.Model.
    include_self: include `model` itself.
    recursive: descend into nested layers and models.

  Returns:
    a list of layers (Keras' `_flatten_layers`).
  """
  fn = _require(model, "_flatten_layers", "Layer")
  return list(fn(include_self=include_self, recursive=recursive))


def seed_generators(model):
  """The keras.random.SeedGenerators the layers of `model` draw from (nested layers too),
  each once, in Keras' layer order; and Keras' global one (the draws of `keras.random.*`
  called with seed=None) when it exists.

  Args:
    model: a keras.Layer or keras.Model.

  Returns:
    a list of keras.random.SeedGenerator.
  """
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
  """The keras Layers a callable reaches without being called: its closure's cells, the
  module globals its code names, its defaults, a bound method's object, a
  functools.partial's function and arguments, a decorator's wrapped function (`__wrapped__`:
  functools.wraps, AutoGraph's tf_convert), a tf.function's Python function and a callable
  object's `__call__` at the same level, the values of a list, tuple, dict, set or deque,
  the attributes of an object (its `__dict__`'s and `__slots__`': a callable loss object's, a
  bound method's, a dataclass(slots=True)'s; one level deeper), and (up to
  `depth` levels) the same of the functions and objects among them.

  Args:
    fn: a callable.
    depth: how many levels of nested functions to follow.

  Returns:
    a list of keras.Layer, each once.
  """
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
      attributes = _attributes(value)   # (reviews R16, R18)
      if attributes is not None:
        if callable(value):   # (else type(value).__call__ is the class's own: its metaclass')
          visit(type(value).__call__, level)
        for v in attributes:
          visit(v, level - 1)

  visit(fn, depth)
  return found


# Values `closure_layers` passes over at once: they hold no layer (a dict of 30,000 str keys
# and ints and a list of 60,000 arrays an object held took 0.18 CPU s a walk without this).
_HOLD_NO_LAYER = (str, bytes, int, float, complex, type(None), np.ndarray, np.generic,
                  tf.Tensor)


def _attributes(value):
  """The values of an object's instance attributes, its `__dict__`'s and its `__slots__`'
  (read through the slots' member descriptors: no property or other user code runs), or None
  for an object with neither (a number, an array)."""
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
  """[the value `value`'s slot holds], or [] for an unassigned slot (it raises
  AttributeError)."""
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
  """The layers of `model` whose random draw serves several rows of the batch: a Dropout
  (SpatialDropout, GaussianDropout, ...) whose `noise_shape` is 1 on the batch axis.

  Args:
    model: a keras.Layer or keras.Model.

  Returns:
    a list of layer names.
  """
  return [layer.name for layer in flatten_layers(model)
          if getattr(layer, "_seed_generators", None)
          and (getattr(layer, "noise_shape", None) or (None,))[0] == 1]


def layer_children(layer):
  """The direct sublayers of `layer` and of every layer under it, in one walk.

  Args:
    layer: a keras.Layer or keras.Model.

  Returns:
    {id(l): [its direct sublayers, as `flatten_layers(l, include_self=False,
    recursive=False)` lists them]} for `layer` and each layer nested in it.
  """
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
  """Keras' `Model._compute_loss` bound to `model`, for a caller that evaluates it many times.

  Args:
    model: a compiled keras.Model.

  Returns:
    a callable taking the keyword arguments x, y, y_pred, sample_weight and training.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  return _require(model, "_compute_loss", "Model")


def call_has_training_arg(model):
  """True if `model.call` takes a `training` argument (Keras' `_call_has_training_arg`).

  Args:
    model: a keras.Layer or keras.Model.

  Returns:
    bool.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  return bool(_require(model, "_call_has_training_arg", "Layer"))


def symbolic_build(model, data_spec):
  """Builds an unbuilt compiled model from the shapes of a batch spec (Keras'
  `_symbolic_build`).

  Args:
    model: a compiled keras.Model; data_spec: the (x, y[, sample_weight]) specs of a batch
      (a tf.data.Dataset's element_spec).
  """
  _require(model, "_symbolic_build", "Model")(data_batch=data_spec)


def loss_tracker(model):
  """The model's loss metric (`logs["loss"]`), a keras.metrics.Mean (Keras' `_loss_tracker`).

  Args:
    model: a compiled keras.Model.

  Returns:
    the metric.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  return _require(model, "_loss_tracker", "Model")


@contextlib.contextmanager
def jit_compile_off(model):
  """Within the block `model` makes its train function without XLA; `jit_compile` is restored
  after (Keras' `_jit_compile`, which `make_train_function` reads).

  Args:
    model: a compiled keras.Model.

  Yields:
    None.
  """
  old = _require(model, "_jit_compile", "Model")
  model._jit_compile = False  # pylint: disable=protected-access
  try:
    yield
  finally:
    model._jit_compile = old  # pylint: disable=protected-access


def compile_metrics(model):
  """The compiled metrics container of `model`, or None (Keras' `_compile_metrics`).

  Args:
    model: a keras.Model.

  Returns:
    the container, or None (not compiled, or detached).
  """
  return getattr(model, "_compile_metrics", None)


def compiled_metric_names(model):
  """The names the user's compiled metrics log under (Keras' CompileMetrics' user metrics,
  weighted ones too; a string metric by its string).

  Args:
    model: a keras.Model.

  Returns:
    list of names (empty when not compiled with metrics).
  """
  container = compile_metrics(model)
  given = [getattr(container, attr, None) for attr in ("_user_metrics", "_user_weighted_metrics")]
  return [getattr(m, "name", m) for m in tf.nest.flatten([g for g in given if g is not None])
          if isinstance(getattr(m, "name", m), str)]


def update_compiled_metrics(model, y, y_pred, sample_weight, example_mask):
  """Updates `model`'s compiled metrics as Keras' CompileMetrics.update_state does, but with
  the unweighted metrics weighted by `example_mask`, so padding rows reach no metric
  (weighted metrics get `sample_weight`, already 0 there).

  Args:
    model: a compiled keras.Model.
    y: the batch's targets (a nest).
    y_pred: the batch's outputs (a nest).
    sample_weight: the batch's sample weights (a nest or None).
    example_mask: [B] float 0/1, 1 for the batch's real examples.

  Raises:
    AttributeError: the installed Keras lacks the container's attributes (names them).
  """
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
  """The per-output loss metrics (`logs["<output>_loss"]`) of `model`'s compiled loss, in its
  outputs' order (Keras' `CompileLoss.metrics`).

  Args:
    model: a compiled keras.Model.

  Returns:
    a list of metrics (empty: no compiled loss, or a single output).
  """
  compiled = getattr(model, "_compile_loss", None)
  return list(compiled.metrics) if compiled is not None else []


@contextlib.contextmanager
def output_loss_trackers_swapped(model, stand_ins):
  """Within the block `model`'s compiled loss updates `stand_ins[i]` in place of its i-th
  per-output loss metric (Keras' `CompileLoss._metrics`); a None stand-in updates nothing.

  Args:
    model: a compiled keras.Model whose compiled loss is built.
    stand_ins: a list as long as `output_loss_trackers(model)`: objects with
      `update_state(value, sample_weight)`, or None.

  Yields:
    None.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  compiled = model._compile_loss  # pylint: disable=protected-access
  old = _require(compiled, "_metrics", "CompileLoss")
  compiled._metrics = list(stand_ins)  # pylint: disable=protected-access
  try:
    yield
  finally:
    compiled._metrics = old  # pylint: disable=protected-access


def compile_loss_unbuilt(model):
  """True if `model` has a compiled loss not built yet (no per-output trackers yet).

  Args:
    model: a keras.Model.

  Returns:
    bool.
  """
  compiled = getattr(model, "_compile_loss", None)
  return compiled is not None and not compiled.built


def build_compile_loss(model, y, y_pred, sample_weight):
  """Builds `model`'s compiled loss (its per-output trackers) from a batch's shapes, as Keras'
  `_symbolic_build` does, without running the model symbolically.

  Args:
    model: a compiled keras.Model; y, y_pred, sample_weight: nests of tensors or numpy
      arrays (or None).

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
  """Evaluates `model`'s compiled loss (Keras' `CompileLoss`, no layer losses) on a batch.

  Args:
    model: a compiled keras.Model; y, y_pred, sample_weight: the batch's nests.

  Returns:
    the weighted total of the outputs' losses.
  """
  return _require(model, "_compile_loss", "Model")(y, y_pred, sample_weight)


def unscale_loss_for_distribution(value):
  """Keras' undoing of a loss's 1/replicas scaling (what its per-output loss metrics log)."""
  return keras.src.losses.loss.unscale_loss_for_distribution(value)


def set_compile_metrics(model, metrics):
  """Replaces the compiled metrics container of `model` (None detaches it).

  Args:
    model: a compiled keras.Model; metrics: a container from `compile_metrics`, or None.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  _require(model, "_compile_metrics", "Model")
  model._compile_metrics = metrics  # pylint: disable=protected-access


def replace_compiled_optimizer(model, optimizer):
  """Puts `optimizer` in place of a compiled model's optimizer, keeping everything else
  `compile` set (compiling again could rebuild what a subclass resolved itself); the compile
  config names the new one.

  Args:
    model: a compiled keras.Model.
    optimizer: the keras.optimizers.Optimizer instance to train with.

  Raises:
    AttributeError: the installed Keras lacks the attribute (names it and the version).
  """
  config = _require(model, "_compile_config", "Model")
  _require(config, "config", "SerializableDict")["optimizer"] = optimizer
  model.optimizer = optimizer
  model.train_function = None   # traced with the old optimizer


def functional_class():
  """The class of functional models, `keras.Model(inputs, outputs)` (not exported publicly)."""
  return keras.src.models.functional.Functional


def functional_graph(model):
  """(graph, {depth: [nodes]}) of a functional (or built Sequential) model: the model or its
  `_functional`, and Keras' `_nodes_by_depth`; None for a subclassed model.

  Args:
    model: a keras.Model.

  Returns:
    (graph, {depth: [nodes]}), or None.
  """
  graph = model if hasattr(model, "_nodes_by_depth") else getattr(model, "_functional", None)
  if graph is None or not hasattr(graph, "_nodes_by_depth"):
    return None
  return graph, graph._nodes_by_depth  # pylint: disable=protected-access


def functional_inputs_struct(graph):
  """The nested structure a functional model was built on (`keras.Model(inputs, ...)`:
  a dict of inputs, a list, one input), Keras' `Functional._inputs_struct`.

  Args:
    graph: a functional model (`functional_graph(model)[0]`).

  Returns:
    the structure of its `keras.Input` tensors (a dict, list, tuple or one tensor).

  Raises:
    AttributeError: the installed Keras has no `Functional._inputs_struct` (named, with the
      version).
  """
  return _require(graph, "_inputs_struct", "Functional")


# ---- tensors, scopes, backend -----------------------------------------------------------

def keras_mask(tensor):
  """The Keras mask a layer attached to `tensor` (`_keras_mask`), or None.

  Args:
    tensor: a tensor.

  Returns:
    the mask tensor, or None.
  """
  return getattr(tensor, "_keras_mask", None)


def set_keras_mask(tensor, mask):
  """Attaches `mask` to `tensor` as Keras layers do, so losses and metrics apply it.

  Args:
    tensor: a tensor; mask: a boolean (or 0/1) tensor shaped like tensor's leading axes.
  """
  tensor._keras_mask = mask  # pylint: disable=protected-access


def map_variables(scope, variables, values):
  """Makes a `keras.StatelessScope` read `variables[i]` as `values[i]` (any dtype: set after
  construction, since the constructor casts values to the variables' dtype).

  Args:
    scope: an entered keras.StatelessScope.
    variables: keras Variables; values: tensors, one per variable.
  """
  state = _require(scope, "state_mapping", "StatelessScope")
  state.update({id(v): value for v, value in zip(variables, values)})


def rnn(*args, **kwargs):
  """Keras' backend RNN loop (`keras.src.backend.rnn`; no public alias), same arguments."""
  return _require(keras.src.backend, "rnn", "keras.src.backend")(*args, **kwargs)


# ---- layer.call swapping (fast clipping's recording forward pass) -------------------------

def swap_call(layer, call):
  """Makes `layer(...)` run `call` in place of its own call method, until `restore_call`.

  Args:
    layer: a keras.Layer; call: a callable with the layer's call signature.

  Returns:
    the token for `restore_call`: (layer, whether it had an instance `call`, that call).
  """
  had_own = "call" in layer.__dict__
  token = (layer, had_own, layer.__dict__.get("call"))
  object.__setattr__(layer, "call", call)
  return token


def restore_call(token):
  """Undoes `swap_call`.

  Args:
    token: what `swap_call` returned.
  """
  layer, had_own, own = token
  if had_own:
    object.__setattr__(layer, "call", own)
  else:
    object.__delattr__(layer, "call")


# ---- TensorFlow: one graph constant per integer value in a trace -------------------------
#
# Tracing a step creates one `Const` operation per `tf.constant` call and per Python value
# converted to a tensor, and TensorFlow's own functions create many more: every static shape
# (`tf.shape` of a fully defined shape), reduction axis, slice bound and broadcast shape of a
# gradient function. BERT-base's DP train step at seq 32 (batch 4) had 3,504 Consts of 184
# distinct values, most of them int32 shapes and axes; each costs its creation in the trace,
# its conversion into the function's graph and its Grappler passes, before Grappler merges the
# duplicates again. Inside a `shared_constants` block (the clipped sum's trace), a constant of
# an integer or boolean dtype of at most _SHARED_CONST_BYTES created in the graph being traced
# is created once per graph and reused. Only where the result is the same tensor either way:
# no control dependency, device, colocation or control-flow context open at the call, no op
# callbacks; each graph (a function body, a cond branch, a loop body) has its own. Floating
# constants are never shared: a floating tensor can be watched by a gradient tape, and a
# watched tensor used in two places gets the gradient of both (the ghost norms' first
# backward pass watches the layers' floating inputs); integer and boolean tensors carry no
# gradient. A shared constant keeps the first caller's name. TensorFlow has no public hook for
# this: `constant_op._constant_impl` (every `tf.constant` and every conversion of a Python or
# NumPy value; not an EagerTensor captured by value) is wrapped while some thread is inside a
# block, and the wrapper acts only in those threads.

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
  """Within the block (this thread, graph mode), integer and boolean constants are created
  once per graph being traced (the section's comment above); nested blocks share one memo,
  forgotten when the outermost ends. TensorFlow's function is wrapped only while a block is
  open in some thread.

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
  """A non-trainable resource variable holding `value`, made eagerly (under tf.init_scope,
  also while a tf.function is being traced) by TensorFlow's `ResourceVariable` class itself
  (the private `tensorflow.python.ops.resource_variable_ops`), not by `tf.Variable`: a
  tf.function's variable creator scope refuses a tf.Variable made on any trace but the first
  (a step traced again, or for another subset of variables), and a distribution strategy's
  scope would make a mirrored one. The variable is in no Keras or TF object graph but the
  caller's.

  Args:
    value: its initial value (a NumPy array or a tensor).
    name: its name.

  Returns:
    a tf.Variable (ResourceVariable) on the default device, trainable=False.
  """
  with tf.init_scope():
    return resource_variable_ops.ResourceVariable(value, trainable=False, name=name)


# ---- the upgrade check ------------------------------------------------------------------

def gradient_sources(variables):
  """The backend variables behind Keras variables, as `GradientTape.gradient` sources (with
  unconnected_gradients=ZERO a Keras 3 variable the computation does not use fails).

  Args:
    variables: a list of keras.Variable (other entries are passed through).

  Returns:
    a list of the same length.
  """
  return [v.value if isinstance(v, keras.Variable) else v for v in variables]


# the names tf.custom_gradient registers under, and the graph attribute holding them
_CUSTOM_GRADIENT_PREFIX = "CustomGradient-"
_OWNED_GRADIENTS = "_tf_dpiter_custom_gradients"


def graph_owned_gradients(fn, *args):
  """fn(*args), the tf.custom_gradient functions it registered held by the current graph.

  TensorFlow's `tf.custom_gradient`, traced in a graph, registers its gradient function in
  the process-wide gradient registry (`ops.gradient_registry`, private) and never removes
  it: the registry would keep every traced DP step alive for the process's life. Each such
  function is moved onto the graph it was traced in; the registry keeps a forwarder holding
  the graph weakly, removed (a finalizer) when the graph is collected.

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
