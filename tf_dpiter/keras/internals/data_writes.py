"""Variables a traced computation writes from its data, found by data flow in its graph.

The private step clips and noises gradients only (McMahan et al., "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 2: the released model
is a function of the noised sums). A layer or loss that assigns a variable from its inputs
(a running mean, a range counter, a "seen a NaN" flag, a write made only when some input is
large) carries the private data into the released state unclipped and un-noised. Whether a
write depends on the data is decided here from the program, not from sample runs (two
random batches can miss a write that depends on rare values or on the call count).

Rule: trace the computation once on symbolic inputs; a value is data-dependent when it is
computed from an input tensor through data edges (shapes aside: Shape, Size and Rank of an
input are public, static batch sizes); a write (Assign*, scatter, a random generator's state
update) is data-dependent when its value is, when it runs inside a branch or loop whose
predicate is, or when it reads a variable so written. Function calls (nested tf.functions,
tf.cond, tf.while_loop, tf.switch_case) are followed into their bodies. A write whose value
does not depend on the data (a call counter, a seed generator's advance) is allowed.

This is the library's one check of state written from the data: fit (make_train_function,
or the first trace for a model it builds) and the custom loops call `refuse_model_writes`
before any probe runs the model (the probes restore only the model's non-trainable
variables; a plain tf.Variable written from the probe's real rows would keep them).
"""

import re

import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import keras_internals

# call ops: (attributes naming the called functions, inputs before the functions' arguments)
_CALLS = {"PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0),
          "If": (("then_branch", "else_branch"), 1),
          "StatelessIf": (("then_branch", "else_branch"), 1),
          "Case": (("branches",), 1), "StatelessCase": (("branches",), 1)}
_LOOPS = ("While", "StatelessWhile")
_PUBLIC = ("Shape", "ShapeN", "Size", "Rank")   # shapes of the inputs: static, public


def _is_write(op):
  return ((op.startswith("Assign") and "Variable" in op) or op.startswith("ResourceScatter")
          or op.startswith("ResourceApply") or op == "ResourceStridedSliceAssign"
          or op.startswith("Rng") or (op.startswith("Stateful") and op not in _CALLS))


def _source(name):
  """The node (or argument) an input string of a GraphDef or FunctionDef names."""
  return name.split(":")[0]


class _Flow:
  """Data-flow analysis over a GraphDef's nodes and its library's FunctionDefs."""

  def __init__(self, graph_def):
    self._library = {f.signature.name: f for f in graph_def.library.function}
    self._memo = {}

  def body(self, nodes, tainted, tainted_resources, under_data):
    """(written resources, tainted names) of one body: `nodes` NodeDefs, `tainted` the
    argument or node names whose values depend on the data, `tainted_resources` the resources
    already written from the data, `under_data`
    True when the whole body runs under a data-dependent predicate."""
    tainted, t_res, written = set(tainted), set(tainted_resources), set()
    changed = True
    while changed:   # nodes come in creation order: a second pass usually confirms
      changed = False
      for node in nodes:
        srcs = [_source(i) for i in node.input if not i.startswith("^")]
        if node.op in _PUBLIC:
          continue
        hot = any(s in tainted or s in t_res for s in srcs)
        if node.op in _CALLS or node.op in _LOOPS:
          w, out_hot = self._call(node, srcs, tainted, t_res, under_data)
        elif _is_write(node.op):
          value_hot = under_data or any(s in tainted or s in t_res for s in srcs[1:])
          w, out_hot = ({srcs[0]} if srcs and value_hot else set()), hot
        else:
          w, out_hot = set(), hot
        if w - written:
          written |= w
          t_res |= w
          changed = True
        if out_hot and node.name not in tainted:
          tainted.add(node.name)
          changed = True
    return written, tainted

  def _function(self, name, hot_args, hot_res, under_data):
    """(written argument positions, hot output positions) of the library function `name`."""
    key = (name, hot_args, hot_res, under_data)
    if key not in self._memo:
      fdef = self._library[name]
      args = [a.name for a in fdef.signature.input_arg]
      written, tainted = self.body(fdef.node_def, {args[i] for i in hot_args},
                                   {args[i] for i in hot_res}, under_data)
      outs = [fdef.ret[o.name] for o in fdef.signature.output_arg]
      self._memo[key] = ({i for i, a in enumerate(args) if a in written},
                         frozenset(i for i, o in enumerate(outs) if _source(o) in tainted))
    return self._memo[key]

  def _call(self, node, srcs, tainted, t_res, under_data):
    """(caller resources written from the data, outputs hot) of a call, branch or loop."""
    hot = [s in tainted or s in t_res for s in srcs]
    if node.op in _LOOPS:
      names = (node.attr["cond"].func.name, node.attr["body"].func.name)
      args, offset = srcs, 0
      while True:   # the loop variables' taint to a fixed point through the body
        key = frozenset(i for i, h in enumerate(hot) if h)
        _, outs = self._function(names[1], key, key, under_data)
        new = [h or i in outs for i, h in enumerate(hot)]
        if new == hot:
          break
        hot = new
      key = frozenset(i for i, h in enumerate(hot) if h)
      pred_hot = bool(self._function(names[0], key, key, under_data)[1])
      written, _ = self._function(names[1], key, key, under_data or pred_hot)
      return {args[i] for i in written}, any(hot)
    attrs, offset = _CALLS[node.op]
    funcs = [f.name for a in attrs for f in (node.attr[a].list.func or [node.attr[a].func])]
    pred_hot = offset > 0 and hot[0]
    key = frozenset(i - offset for i, h in enumerate(hot) if h and i >= offset)
    written, out_hot = set(), False
    for name in funcs:
      w, outs = self._function(name, key, key, under_data or pred_hot)
      written |= {srcs[i + offset] for i in w}
      out_hot = out_hot or bool(outs)
    return written, out_hot or any(hot)


def data_dependent_writes(fn, specs):
  """Names of the variables `fn` writes from its inputs (module docstring's rule).

  Args:
    fn: a callable of one argument, traced once (its Python runs once, symbolically).
    specs: a nest of tf.TensorSpec, the argument's structure.

  Returns:
    list of the written variables' names (their resources' names; "an untracked resource
    <node>" when the written resource is not a captured variable), in graph order.
  """
  def traced(x):
    with tf.name_scope("data_writes"):   # a root scope (a model named "_sub") must be valid
      return fn(x)

  graph = tf.function(traced).get_concrete_function(specs).graph
  given = [spec for spec in tf.nest.flatten(specs) if spec is not None]
  data = {t.op.name for t in graph.inputs[:len(given)]}
  names = {}
  for external, internal in graph.captures:
    if internal.dtype == tf.resource:
      names[internal.op.name] = _variable_name(external)
  graph_def = graph.as_graph_def()
  written, _ = _Flow(graph_def).body(graph_def.node, data, set(), False)
  order = [n.name for n in graph_def.node if n.name in written]
  return [names.get(n, f"an untracked resource {n!r}") for n in order]


def _variable_name(handle):
  """A captured resource handle's variable name (its resource's shared name without the
  unique suffix: "sequential/running_mean/mean")."""
  found = re.search(r'name="([^"]*)"', repr(handle))
  return re.sub(r"/\d+$", "", found.group(1)) if found else repr(handle)


def refuse_data_writes(fn, specs, what):
  """Refuses `fn` when it writes a variable from its inputs (`data_dependent_writes`).

  Args:
    fn: a callable of one argument (the data).
    specs: a nest of tf.TensorSpec for that argument.
    what: how the user calls it, for the message (e.g. "the model's training-mode call").

  Raises:
    PrivacyConfigError: naming the variables written from the data and what to do.
  """
  written = data_dependent_writes(fn, specs)
  if written:
    raise PrivacyConfigError(
        f"{what} writes the variable {written[0]!r} from the data (a running statistic, a "
        "counter of some inputs, a flag set by some values): the private step clips and "
        "noises gradients only, so that state would carry the records unclipped and "
        "un-noised. Update it only when training is False, compute it outside the private "
        "step from public data, or make it a trainable weight. Received: variables written "
        f"from the data: {written}")


def refuse_model_writes(model, inputs=None):
  """Refuses `model` when its training-mode call writes a variable from its inputs.

  Args:
    model: a built keras.Model.
    inputs: a nest of tensors or specs giving the input structure and shapes (None: the
      model's own symbolic inputs).

  Returns:
    True if the model was checked, False if its inputs are unknown (not built, subclassed
    without inputs): the caller checks again when it has a batch.

  Raises:
    PrivacyConfigError: as `refuse_data_writes`.
  """
  if inputs is None:
    inputs = batch_independence._model_inputs(model)   # pylint: disable=protected-access
    if inputs is None:
      return False
  specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
  call = ((lambda x: model(x, training=True)) if keras_internals.call_has_training_arg(model)
          else model)
  refuse_data_writes(call, specs, f"the model {model.name!r} in training mode")
  return True
