"""The update a custom loop applies is bound to the noised result its private step charged.

Rule: the ledger's epsilon holds for an update that is a function of a noised result it
charged (post-processing: Dwork and Roth, "The Algorithmic Foundations of Differential
Privacy", Proposition 2.1; the step is DP-SGD, Abadi et al., "Deep Learning with Differential
Privacy", Algorithm 1). `apply_private_gradients` therefore checks the VALUES it is given, not
only that a noised result was drawn since the last update (`PrivateStep.charged_gradients`'
count): one compute_private_gradients whose result is dropped, then a plain tape gradient,
passes the count and would apply an un-noised, unclipped update (review: w1 = w0 - lr g
exactly, epsilon 2.133 stated for it).

Traced (the usual custom loop, or a train_step override), at the trace of
`apply_private_gradients`: default deny. The applied gradients may be computed only from
(a) the noised results `noised_average` returned in that graph (post-processing), (b) the
updated weights and the optimizer's own variables (iterations, learning rate, slots),
(c) scalar constants, and integer constants of at most 16 elements (tf.split's sizes: a
vector of any length) that reach them only at a shape, axis or bound position (a reshape's
shape, a reduction's axes, a slice's bounds: `data_writes.SHAPE_ARGS`): a shape or an axis
holds no record, but for a step argument's static size where the shape sets how many values
an op outputs (`_SIZE_ARGS`: tf.ones(tf.shape(batch)) sums to the batch size). `denied_inputs` walks the graph backward from the gradients, cut at the
noised results, into nested functions, tf.cond / tf.switch_case branches (their predicate
too) and tf.while_loop bodies (all of them), and refuses everything else it reaches: a step
argument or captured tensor (the batch given to the step), an array constant of any dtype
(a numpy batch the step closes over becomes one: float features, uint8 pixels, int token ids
or labels), any other variable (a buffer of plain gradients written outside the step), a
dataset's next element, a file read, a Python function, any other stateful op but random
draws. So post-processing of the noised result (scaling, clip_by_global_norm, clip_by_norm
over axes, casts, a flatten/concat/split, a weight decay term of the weights, the learning
rate, tf.random.normal noise, a branch on `optimizer.iterations`) is accepted, and plain
tape gradients of a batch, or any mix of them, are refused. The same default deny walks back
from the VALUE of every write, earlier in the graph, to one of the allowed variables (Keras'
update reads the slots, the learning rate and iterations besides the gradients: a momentum
slot or a learning rate assigned from the batch would reach the weights un-noised; a weight
assigned from the batch too), whether or not the applied gradients are the noised results
themselves. Then a data-flow pass (`unbound_source`, data_writes' `_Flow`) refuses gradients
reached by the data, and a variable the noised results are computed from (a weight the loss
reads) that the graph writes from the data: each record's clipped gradient would be taken at
weights that are a function of the whole batch, and one record would move all of them (the
clipped sum's sensitivity is then no longer C; McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 2). These walks run at every
trace of the update (one GraphDef of the step; no per-step cost). An int32 scalar constant
in a value position equal to a step argument's static leading dimension or number of
elements (above 1) is taken as the batch size the trace folded (`tf.size(batch)` of a
statically shaped batch is a constant with no edge to the batch; the batch size of a
Poisson sample is private) and refused: a conservative refusal of a coincidence too.
Conservative refusals: a noised result passed into the step
from outside (another tf.function's output, an argument), a post-processing that uses a step
argument, an array constant in a value position (pass a public value as a Python number or a
variable of the optimizer) or a shape the trace folded into a constant (`tf.shape(g)[0]` of a
statically shaped gradient), another variable of the model (a non-trainable one). Not seen:
a record turned into a Python number at trace time (a scalar constant), or a Python branch on
one; the batch size as a Python number (`len(x)`, `x.shape[0]`), as an int64 constant, or
when it is 0 or 1.

Eager: the noised results drawn eagerly since the last update are kept (the tensors, until
the update; the latest 8), and each applied gradient must be one of them, or equal bit for bit (the digest
of `weight_fingerprints.digest`, dtype and shape). Post-processing is then refused: do it
inside a tf.function with the private step.

Writes traced AFTER the update (a learning rate or `iterations` set from the batch for the
next step) are not in the graph at its trace: each graph in which a custom loop's update was
traced is walked whole at the next statement (`NoisedResults.refuse_late_writes`: the same
data flow, the noised results cut), and a run whose step writes the updated weights or the
optimizer's variables from the batch is refused then and later. A `train_step` override is
walked whole at its first trace instead (data_writes.refuse_override_writes), before any step.

Relation/unit: those of the charged result (the declared sampling's).
"""

import weakref

import tensorflow as tf
from tensorflow.core.framework import types_pb2

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import data_writes
from tf_dpiter.keras.optimizer import weight_fingerprints

# how many eager noised results are kept for the next update (older ones are refused)
_EAGER_KEPT = 8
# a custom loop's traced graphs kept for the walk at the next statement; beyond, the finished
# ones are walked when the next is traced (a loop retraced per Poisson batch size)
_TRACED_KEPT = 4
# constant ops (a floating array among them is taken as data: `_embedded_array`)
_CONSTANTS = frozenset(["Const", "HostConst"])
# data_writes' tables of the graph's ops
# pylint: disable=protected-access
_CALLS, _LOOPS, _READS, _QUIET, _OPAQUE = (
    data_writes._CALLS, data_writes._LOOPS, data_writes._READS, data_writes._QUIET,
    data_writes._OPAQUE)
# pylint: enable=protected-access
# the graph attribute holding {NoisedResults: refs of the noised results traced in it}
_GRAPH_ATTRIBUTE = "_tf_dpiter_noised_results"
# the name of the identity op each traced noised result passes through (`NoisedResults.add`)
NOISED_NAME = "tf_dpiter_noised_result"


def _flat(grads):
  return [t for g in grads if g is not None
          for t in tf.nest.flatten(g, expand_composites=True)]


class NoisedResults:
  """The noised results one PrivateStep returned, per graph (traced) or since the last
  update (eager), and the check `apply_private_gradients` makes (module docstring)."""

  def __init__(self):
    # lists of eager tensors drawn since the last update (read by PrivateStep.charged_gradients)
    self.eager = []
    # (FuncGraph, ids of the variables' handles) of the custom loop's traced updates, until
    # walked whole (`refuse_late_writes`), and the refusal that walk made, kept
    self._traced = []
    self._refused = None
    # {id of an eager variable handle: name} of the variables the walked graphs write from
    # the batch
    self._written = {}

  def add(self, result):
    """Keeps `result` (a list of tensors) as a noised, charged result.

    Args:
      result: the noised averages `noised_average` returns.

    Returns:
      `result`; traced, each tensor through an identity named `NOISED_NAME`, so that a walk
      of a graph calling this one's function finds the noised results in its body
      (`late_writes`).
    """
    if not tf.executing_eagerly():
      result = [None if t is None else tf.identity(t, name=NOISED_NAME) for t in result]
    tensors = [t for t in result if t is not None]
    if not tensors:
      return result
    if tf.executing_eagerly():
      # the latest few only (memory: a loop that computes without applying holds no more)
      self.eager = self.eager[-(_EAGER_KEPT - 1):] + [tensors]
      return result
    graph = tensors[0].graph
    # kept on the graph (its lifetime), per NoisedResults: another optimizer's noised result
    # is not this one's
    held = getattr(graph, _GRAPH_ATTRIBUTE, None)
    if held is None:
      held = weakref.WeakKeyDictionary()
      setattr(graph, _GRAPH_ATTRIBUTE, held)
    held.setdefault(self, set()).update(t.ref() for t in tensors)
    return result

  def used(self):
    """Forgets the eager results: an update used them (with any unused one, as the count)."""
    self.eager = []

  @tf.autograph.experimental.do_not_convert   # plain Python: no AutoGraph conversion
  def require_bound(self, grads, what="apply_private_gradients", variables=()):
    """Refuses `grads` unless each is a noised result or (traced) a function of one.

    Args:
      grads: the gradients about to be applied (None entries skipped).
      what: names the caller in the message.
      variables: (traced) the variables the gradients may read besides the noised results:
        the updated weights and the optimizer's own (iterations, learning rate, slots).

    Raises:
      PrivacyConfigError: a gradient that is not bound to a noised result (the message names
        what it depends on and what to do).
    """
    tensors = [tf.convert_to_tensor(t) for t in _flat(grads)]
    if not tensors:
      return
    if tf.executing_eagerly():
      self._require_eager(tensors, what)
      return
    graph = tensors[0].graph
    held = getattr(graph, _GRAPH_ATTRIBUTE, None)
    source = unbound_source(tensors, () if held is None else held.get(self, ()), variables)
    if source is not None:
      raise PrivacyConfigError(
          f"{what} applies the noised result of optimizer.compute_private_gradients, or a "
          "function of it only (scaling, clipping, casts): this gradient depends on "
          f"{source} by a path that avoids the noise, e.g. plain tape gradients of the "
          "batch, or a noised result passed in from outside the traced step. Apply the list "
          "compute_private_gradients returned in the same tf.function (one step: compute, "
          "post-process, apply). Received: a gradient computed from "
          f"{source}")

  @tf.autograph.experimental.do_not_convert   # plain Python over the graph
  def note_traced_update(self, variables):
    """Keeps the graph being traced (a custom loop's step, its update traced now) for
    `refuse_late_writes`: what the step traces after the update is not in the graph yet.

    Args:
      variables: the variables the update writes and the optimizer's own (learning rate,
        iterations, slots).
    """
    graph = tf.compat.v1.get_default_graph()
    if len(self._traced) >= _TRACED_KEPT:   # the finished traces walked now: graphs not kept
      tracing, outer = set(), graph
      while outer is not None:
        tracing.add(id(outer))
        outer = getattr(outer, "outer_graph", None)
      self._walk([t for t in self._traced if id(t[0]) not in tracing])
      self._traced = [t for t in self._traced if id(t[0]) in tracing]
    allowed = frozenset(id(v.handle) for v in variables)
    self._traced.append((graph, allowed))
    # the outermost function being traced around it (a loop's function calling the step
    # function; a while loop's body): its ops after the call are walked whole too
    outer = graph
    while isinstance(getattr(outer, "outer_graph", None), tf.__internal__.FuncGraph):
      outer = outer.outer_graph
    if outer is not graph and all(g is not outer for g, _ in self._traced):
      self._traced.append((outer, allowed))

  def refuse_late_writes(self, what, also=()):
    """Refuses the run when one of its traced custom-loop steps writes, anywhere in the
    step (after its update too), one of the variables `note_traced_update` named from the
    batch: a learning rate or `iterations` set from the batch after the update scales the
    next step's signal and noise by a function of one record (no epsilon bounds it). Each
    graph is walked once, whole (data_writes' flow, the noised results cut from their
    inputs); a refusal is kept: every later call refuses.

    Args:
      what: what is refused, for the message.
      also: more variables no step may write from the batch (a DP model's own, non-trainable
        ones too, when its statement is asked).

    Raises:
      PrivacyConfigError: naming the variable and what to do.
    """
    pending, self._traced = self._traced, []
    self._walk(pending, also)
    if self._refused is not None:
      raise PrivacyConfigError(f"{what} refused: {self._refused}")

  def _walk(self, pending, also=()):
    """Walks the (graph, allowed) pairs whole (`late_writes`), keeping every variable written
    from the data (`self._written`); refuses (the first refusal kept) when one is allowed in
    its pair or is one of `also` (the variables of the model a statement covers)."""
    for graph, allowed in pending:
      if self._refused is None:
        self._written.update(late_writes(graph))
      self._refuse_written(allowed)
    self._refuse_written({id(v.handle) for v in also})

  def _refuse_written(self, allowed):
    written = [name for i, name in self._written.items() if i in allowed]
    if written and self._refused is None:
      self._refused = (
          f"a traced step of this custom loop writes {written[0]!r} from the batch "
          "(after apply_private_gradients, or in a nested function): that variable (the "
          "learning rate or iterations, which scale the next update; a weight of the "
          "model) then holds a function of the records no noise covers, which the ledger "
          "does not account. Write the model's weights only through "
          "apply_private_gradients, and the learning rate and iterations only from public "
          "values (a schedule, a Python number, between steps). Received: variables "
          f"written from the batch: {written}")

  def _require_eager(self, tensors, what):
    pending = [t for result in self.eager for t in result]
    ids = {id(t) for t in pending}
    digests = None
    for t in tensors:
      if id(t) in ids:
        continue
      if digests is None:
        digests = {(p.dtype, tuple(p.shape), weight_fingerprints.digest(p)) for p in pending}
      if (t.dtype, tuple(t.shape), weight_fingerprints.digest(t)) not in digests:
        raise PrivacyConfigError(
            f"{what} (eager) applies a noised result of optimizer.compute_private_gradients "
            "drawn eagerly since the last update, unchanged: this gradient is none of them "
            f"({len(self.eager)} pending), e.g. a plain tape gradient, or a result "
            "post-processed eagerly or computed inside a tf.function. Do the "
            "post-processing inside tf.function, with compute_private_gradients and "
            "apply_private_gradients in the same traced step. Received: a gradient of "
            f"shape {tuple(t.shape)} and dtype {t.dtype.name} not drawn by the private step")


@tf.autograph.experimental.do_not_convert   # plain Python over the graph
def late_writes(graph):
  """The variables the whole FuncGraph `graph` writes from its data: its non-resource inputs
  (arguments, captured tensors), a dataset's next element, a Python function's result, a
  floating array constant; the noised results (`noised_ops`, and in the functions it calls
  the ops named `NOISED_NAME`) cut from their inputs.

  Args:
    graph: a FuncGraph whose trace has ended.

  Returns:
    list of (the id of the variable's eager handle, its name), in graph order.
  """
  graph_def = graph.as_graph_def()
  sources = {node.name for node in graph_def.node if _data_source(node)}
  return data_writes._graph_writes(graph, sources, clean=noised_ops(graph),  # pylint: disable=protected-access
                                   clean_name=NOISED_NAME, by_id=True)


def noised_ops(graph):
  """The names of the ops of `graph` all of whose outputs are noised results a private step
  returned in it (any optimizer's): what they were computed from reaches no further than
  them (the noise and the ledger's charge bound it).

  Args:
    graph: a FuncGraph.

  Returns:
    set of op names.
  """
  held = getattr(graph, _GRAPH_ATTRIBUTE, None) or {}
  refs = set().union(*held.values()) if held else set()
  ops = {ref.deref().op for ref in refs}
  return {op.name for op in ops if all(o.ref() in refs for o in op.outputs)}


# ops whose outputs are data the graph does not show the origin of: a dataset's next element,
# a Python function's result (its body cannot be analysed)
_OPAQUE_SOURCES = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "OptionalGetValue",
    "EagerPyFunc", "PyFunc", "PyFuncStateless"])


def _embedded_array(node):
  """True for a constant of floating values with more than one element: an array embedded in
  the program (a numpy batch the step closes over is converted to one), taken as data; a
  scalar (a scale, a clip norm) and integer constants (shapes, axes) are public."""
  if node.op not in _CONSTANTS:
    return False
  dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
  dims = node.attr["value"].tensor.tensor_shape.dim
  size = 1
  for d in dims:
    size *= max(d.size, 0)
  return (dtype.is_floating or dtype.is_complex) and size > 1


def _data_source(node):
  """True for a node whose outputs are the step's data: a Placeholder that is not a resource
  (the step's arguments, captured tensors), a dataset's next element, a Python function's
  result, a floating array constant (`_embedded_array`)."""
  return ((node.op == "Placeholder" and node.attr["dtype"].type != types_pb2.DT_RESOURCE)
          or node.op in _OPAQUE_SOURCES or _embedded_array(node))


def unbound_source(tensors, sanitizers, variables=()):
  """The inputs `tensors` depend on by a path avoiding `sanitizers` (module docstring), as a
  short description, or None when there are none.

  Three questions, over the graph built so far (the step up to the update), walked at every
  trace (also when `tensors` are the noised results themselves):
  1. default deny (`denied_inputs`) from `tensors` and from the VALUE of every write to one
     of `variables` (the updated weights and the optimizer's own: its slots, learning rate
     and iterations, which Keras' update reads): a momentum slot or learning rate written
     from the batch reaches the weights un-noised;
  2. the data flow (data_writes' `_Flow`): forward from the sources (every Placeholder that
     is not a resource: the step's arguments and captured tensors; a dataset's next element;
     a Python function's result; a floating constant of more than one element: a numpy batch
     the step closes over), through data edges, the bodies of nested functions, branches
     and loops (a predicate that depends on the data taints what the branch returns), and
     the variables the graph writes from the data (their reads); the shapes of the sources
     count as data (a Poisson batch's size is private). The sanitizers' ops (all of whose
     outputs are noised results) are cut from their inputs. `tensors` reached are refused;
  3. a variable that the noised results are computed from (a weight the loss reads) and that
     the graph writes from the data: each record's clipped gradient is then evaluated at
     weights that are a function of the whole batch, so one record moves all B of them and
     the clipped sum's sensitivity is no longer C (a weight moved from the batch before
     compute_private_gradients and put back before the update).

  Args:
    tensors: graph tensors of one graph (the gradients to apply).
    sanitizers: refs (`tensor.ref()`) of the noised results of that graph.
    variables: the variables whose reads are allowed (`denied_inputs`).

  Returns:
    a description (str) of the sources reached, or None.
  """
  graph = tensors[0].graph
  clean_ops = {ref.deref().op for ref in sanitizers}
  clean = {op.name for op in clean_ops if all(o.ref() in sanitizers for o in op.outputs)}
  graph_def = graph.as_graph_def()
  denied = denied_inputs(tensors, sanitizers, variables, graph_def)
  if denied:
    return "; ".join(denied[:3]) + (f"; and {len(denied) - 3} more" if len(denied) > 3 else "")
  noised_from = _resources_read(graph_def, {ref.deref().op.name for ref in sanitizers})
  sources = []
  for node in graph_def.node:
    if node.name in clean:
      del node.input[:]   # a noised result: what it was computed from does not reach past it
    elif _data_source(node):
      sources.append(node.name)
  flow = data_writes._Flow(graph_def)  # pylint: disable=protected-access
  written, tainted, _ = flow.body(graph_def.node, sources, set(), False, sources)
  shown = f"{', '.join(repr(n) for n in sources[:4])}{', ...' if len(sources) > 4 else ''}"
  shifted = sorted(n for n in written & noised_from
                   if not _internal_state(graph_def, n))
  if shifted:
    names = _capture_names(graph)
    return (f"the variable {names.get(shifted[0], shifted[0])!r} written from the step's "
            f"inputs or captured tensors ({shown}) in the same traced step that computes the "
            "noised result from it (a weight the loss reads, moved from the batch before "
            "compute_private_gradients: every record's clipped gradient then depends on the "
            "whole batch, and the clipping bound no longer bounds one record's effect)")
  reached = sorted({t.op.name for t in tensors if t.op.name in tainted})
  if not reached:
    return None
  return (f"the step's inputs or captured tensors ({shown}) through {', '.join(reached[:3])}")


def _resources_read(graph_def, names):
  """The resource Placeholders of the graph (captured variables) the top-level nodes `names`
  are computed from (backward through data inputs; a call's captured resources are its
  inputs)."""
  nodes = {n.name: n for n in graph_def.node}
  out, seen, stack = set(), set(), list(names)
  while stack:
    name = stack.pop()
    if name in seen or name not in nodes:
      continue
    seen.add(name)
    node = nodes[name]
    if node.op == "Placeholder" and node.attr["dtype"].type == types_pb2.DT_RESOURCE:
      out.add(name)
      continue
    stack += [i.split(":")[0] for i in node.input if not i.startswith("^")]
  return out


def _internal_state(graph_def, name):
  """Whether the captured resource Placeholder `name` is a collective op's ordering token:
  under a tf.distribute strategy the replicas' all-reduce writes it before another reduction
  the noised result depends on; it orders the collectives and holds no value the loss reads.
  Every other resource written from the data is kept (refused), weights frozen or not."""
  users = {n.op for n in graph_def.node if any(i.split(":")[0].lstrip("^") == name
                                                for i in n.input)}
  return bool(users) and all(op.startswith("Collective") for op in users)


def _capture_names(graph):
  """{captured resource Placeholder's name: the variable's name} of a FuncGraph."""
  return {internal.op.name: data_writes._variable_name(  # pylint: disable=protected-access
      data_writes.outermost(external))
          for external, internal in getattr(graph, "captures", ())
          if internal.dtype == tf.resource}


# ---- default deny: what the applied gradients may be computed from -----------------------

# ops that read outside the program without a resource input or a stateful mark: a file
# (its name a scalar constant), a memory-mapped constant
_EXTERNAL_READS = frozenset(["ReadFile", "MatchingFiles", "ImmutableConst"])
# integer dtypes a shape, an axis or an index list has
_INDEX_TYPES = frozenset([types_pb2.DT_INT32, types_pb2.DT_INT64])
# a shape, axes, paddings or slice bounds: at most this many elements (rank <= 8, two per
# axis); an integer array reaching a shape position with more is taken as data (but
# tf.split's sizes: a vector, one per piece)
_MAX_INDEX_ELEMENTS = 16
# how a walked tensor reaches the gradients: as a value, as a shape, axes or bounds only, or
# as tf.split's sizes (the larger, the more permissive)
_VALUE, _SHAPE, _SPLITS, _SIZE = 0, 1, 2, 3
# shape arguments that set how many values an op outputs (`tf.ones(tf.shape(batch))` sums to
# the batch's size): an integer constant there holding a step argument's static size is the
# batch's folded shape, refused as its folded size is (`_static_sizes`)
_SIZE_ARGS = {"Fill": (0,), "Tile": (1,), "BroadcastTo": (1,), "Pad": (1,), "PadV2": (1,),
              "MirrorPad": (1,), "ScatterNd": (2,), "Slice": (2,), "StridedSlice": (2,),
              "OneHot": (1,), "StatelessRandomUniformV2": (0,),
              "StatelessRandomNormalV2": (0,), "StatelessTruncatedNormalV2": (0,),
              "RandomUniform": (0,), "RandomStandardNormal": (0,)}


def _const_size(node):
  size = 1
  for d in node.attr["value"].tensor.tensor_shape.dim:
    size *= max(d.size, 0)
  return size


def _const_shape(node):
  return [d.size for d in node.attr["value"].tensor.tensor_shape.dim]


def _output_index(name, in_function):
  """The output index an input string names (`op:i` in a graph, `op:arg:i` in a function
  body), or None (every output: a multi-argument output list, not resolved)."""
  parts = name.split(":")
  if in_function:
    return int(parts[2]) if len(parts) == 3 else None
  return int(parts[1]) if len(parts) == 2 else 0


class _Reach:
  """The ancestors of the applied gradients in a traced step, checked against the allowed
  inputs (module docstring's default deny): walked backward from the gradients, cut at the
  noised results, into the bodies of nested functions, branches and loops. `found` collects
  descriptions of what is not allowed."""

  def __init__(self, graph_def, allowed_resources, resource_names, stops, sizes=()):
    self._sizes = frozenset(sizes)
    self._library = {f.signature.name: f for f in graph_def.library.function}
    self._top = {n.name: n for n in graph_def.node}
    self._allowed = allowed_resources
    self._names = resource_names
    self._stops = stops
    self._memo = {}
    self.found = []

  def _deny(self, what):
    if what not in self.found:
      self.found.append(what)

  def top(self, names):
    """Walks from the graph tensors `names` ("op:i")."""
    self._walk(self._top, [(n, _VALUE) for n in names], None, None)

  def _function(self, name, outputs, mode):
    """{argument position: mode (`_VALUE`, `_SHAPE`, `_SPLITS`)} the outputs `outputs`
    (None: all) of the library function `name` are computed from (its violations added to
    `found`)."""
    key = (name, outputs, mode)
    if key not in self._memo:
      self._memo[key] = {}   # a recursive call: nothing more
      fdef = self._library[name]
      outs = [o.name for o in fdef.signature.output_arg]
      chosen = range(len(outs)) if outputs is None else [i for i in outputs if i < len(outs)]
      args = [a.name for a in fdef.signature.input_arg]
      self._memo[key] = self._walk({n.name: n for n in fdef.node_def},
                                   [(fdef.ret[outs[i]], mode) for i in chosen],
                                   args, name)
    return self._memo[key]

  def _walk(self, nodes, starts, args, where):
    """Walks back from `starts` ((input string, mode) pairs) through `nodes`; returns
    {argument position: mode} of the function arguments `args` reached (the strictest mode
    wins)."""
    reached, seen, stack = {}, set(), list(starts)
    in_function = args is not None
    while stack:
      name, mode = stack.pop()
      if name.startswith("^"):
        continue
      src = name.split(":")[0]
      if not in_function and (name if ":" in name else name + ":0") in self._stops:
        continue   # a noised result: what it was computed from does not reach past it
      if in_function and src in args:
        i = args.index(src)
        reached[i] = min(reached.get(i, mode), mode)
        continue
      key = (name if src in nodes and self._is_call(nodes[src]) else src, mode)
      if key in seen or src not in nodes:
        continue
      seen.add(key)
      stack += self._node(nodes[src], name, mode, in_function, where)
    return reached

  def _is_call(self, node):
    return node.op in _CALLS or node.op in _LOOPS or node.op in self._library

  def _node(self, node, name, mode, in_function, where):
    """Checks one reached node (reached in `mode`); returns the (input, mode) pairs to walk
    next."""
    at = f" at node {node.name!r}" + (f" of {where!r}" if where else "")
    inputs = [i for i in node.input if not i.startswith("^")]
    if node.op == "Placeholder":
      if node.attr["dtype"].type == types_pb2.DT_RESOURCE:
        if node.name not in self._allowed:
          self._deny(f"a variable that is neither the updated weights nor the optimizer's "
                     f"own ({self._names.get(node.name, node.name)!r}), "
                     "e.g. a buffer of plain gradients written outside the step")
      else:
        self._deny(f"a step argument or captured tensor {node.name!r} (the batch given to "
                   "the step, or a tensor from outside it)")
      return []
    if node.op in _CONSTANTS:
      size = _const_size(node)
      index = node.attr["dtype"].type in _INDEX_TYPES and (
          (mode >= _SHAPE and size <= _MAX_INDEX_ELEMENTS)
          or (mode == _SPLITS and len(_const_shape(node)) <= 1))
      if size > 1 and not index:
        dtype = tf.dtypes.as_dtype(node.attr["dtype"].type).name
        self._deny(f"an array constant of shape {_const_shape(node)} and dtype {dtype}{at} "
                   "(a numpy batch the step closes over becomes one)")
      elif (mode == _SIZE and self._sizes and node.attr["dtype"].type in _INDEX_TYPES
            and self._sizes & {int(d) for d in tf.make_ndarray(
                node.attr["value"].tensor).reshape(-1)}):
        self._deny(f"the shape constant {tf.make_ndarray(node.attr['value'].tensor).tolist()}"
                   f"{at}, holding the static size of a step argument, as the shape of "
                   "values (tf.ones(tf.shape(batch)) of a statically shaped batch sums to the "
                   "batch size, which is private under Poisson sampling: use the expected "
                   "batch size, a Python float, or trace the step with "
                   "input_signature=[tf.TensorSpec([None, ...])])")
      elif (size == 1 and mode == _VALUE and self._sizes
            and node.attr["dtype"].type == types_pb2.DT_INT32):
        value = int(tf.make_ndarray(node.attr["value"].tensor).reshape(-1)[0])
        if value in self._sizes:
          self._deny(f"the integer constant {value}{at}, the static size of a step argument "
                     "(tf.size or tf.shape of a statically shaped batch is folded into a "
                     "constant at trace time; under Poisson sampling the batch size is "
                     "private: use the expected batch size, a Python float, or trace the "
                     "step with input_signature=[tf.TensorSpec([None, ...])])")
      return []
    if self._is_call(node):
      return self._call(node, name, inputs, mode, in_function)
    op_def = data_writes._op_def(node.op)   # pylint: disable=protected-access
    if op_def is None or node.op in _OPAQUE:
      self._deny(f"a Python function or unknown op {node.op}{at} (its body cannot be "
                 "analysed)")
      return []
    if node.op in _EXTERNAL_READS or (
        op_def.is_stateful and node.op not in _READS and node.op not in _QUIET):
      self._deny(f"a {node.op} op{at} (a file, a dataset or other state read outside the "
                 "noised result)")
      return []
    shape_args = data_writes.shape_only_args(node.op, len(inputs))
    size_args = _SIZE_ARGS.get(node.op, ())
    return [(s, mode or (_SPLITS if (node.op, i) == ("SplitV", 1)
                         else _SIZE if i in size_args
                         else _SHAPE if i in shape_args else _VALUE))
            for i, s in enumerate(inputs)]

  def _call(self, node, name, inputs, mode, in_function):
    """The caller inputs a reached call, branch or loop output is computed from."""
    if node.op in _LOOPS:
      # every loop variable may feed every other through the iterations: all of both bodies
      for attr in ("cond", "body"):
        self._function(node.attr[attr].func.name, None, mode)
      return [(s, mode) for s in inputs]
    if node.op in self._library:
      funcs, offset = [node.op], 0
    else:
      attrs, offset = _CALLS[node.op]
      funcs = [f.name for a in attrs for f in (node.attr[a].list.func or [node.attr[a].func])]
    index = _output_index(name, in_function)
    outputs = None if index is None else frozenset([index])
    nxt = [(s, _VALUE) for s in inputs[:offset]]   # a branch's predicate or index: a value
    for f in funcs:
      for i, arg_mode in self._function(f, outputs, mode).items():
        if i + offset < len(inputs):
          nxt.append((inputs[i + offset], arg_mode))
    return nxt


def _handles(variables):
  """The eager resource handles of `variables` (Keras or tf variables, distributed ones'
  components too)."""
  out = []
  for v in variables:
    stack = [v]
    while stack:
      x = stack.pop()
      inner = getattr(x, "_value", None)
      if inner is not None and inner is not x and not isinstance(inner, tf.Tensor):
        stack.append(inner)
      for part in (getattr(x, "values", None) or ()) if not isinstance(x, tf.Tensor) else ():
        if part is not x:
          stack.append(part)
      handle = getattr(x, "handle", None)
      if isinstance(handle, tf.Tensor):
        out.append(handle)
  return out


def denied_inputs(tensors, sanitizers, variables, graph_def):
  """What `tensors` are computed from that is neither a noised result in `sanitizers`, nor
  one of `variables`, nor a scalar constant (nor a short integer constant at a shape, axis
  or bound position), as descriptions (module docstring's default deny); [] when nothing.

  Args:
    tensors: graph tensors of one FuncGraph (the gradients to apply).
    sanitizers: refs (`tensor.ref()`) of the noised results of that graph.
    variables: the variables whose reads are allowed (the updated weights, the optimizer's
      own: iterations, learning rate, slots).
    graph_def: the graph's GraphDef (with its function library).

  Returns:
    a list of str.
  """
  graph = tensors[0].graph
  handles = {id(h) for h in _handles(variables)}
  allowed, names = set(), {}
  for external, internal in getattr(graph, "captures", ()):
    if internal.dtype != tf.resource:
      continue
    outer = data_writes.outermost(external)
    if id(outer) in handles:
      allowed.add(internal.op.name)
    else:   # for the message
      names[internal.op.name] = (
          data_writes._variable_name(outer))  # pylint: disable=protected-access
  stops = {ref.deref().name for ref in sanitizers}
  sizes = _static_sizes(graph_def)
  reach = _Reach(graph_def, allowed, names, stops, sizes)
  reach.top([t.name for t in tensors if t.ref() not in sanitizers])
  found = list(reach.found)
  # the values the graph writes to the allowed variables: Keras' update reads the slots, the
  # learning rate and iterations (and the weights) besides the gradients
  all_names = _capture_names(graph)
  for resource, inputs in _allowed_writes(graph_def, allowed):
    reach = _Reach(graph_def, allowed, names, stops, sizes)
    reach.top(inputs)
    found += [f"the value written to {all_names.get(resource, resource)!r} (a variable the "
              f"update reads) from {what}" for what in reach.found]
  return list(dict.fromkeys(found))   # each once (an assign_add and its assign_sub)


def _static_sizes(graph_def):
  """The static sizes of the step's data (every non-resource Placeholder of rank >= 1: its
  leading dimension and its number of elements), those above 1: an int32 scalar constant
  equal to one of them reaching the update in a value position is taken as a batch size
  that the trace folded (`tf.size(batch)`); 0 and 1 are too common to tell."""
  out = set()
  for node in graph_def.node:
    if node.op != "Placeholder" or node.attr["dtype"].type == types_pb2.DT_RESOURCE:
      continue
    dims = [d.size for d in node.attr["shape"].shape.dim]
    if node.attr["shape"].shape.unknown_rank or not dims:
      continue
    if dims[0] > 1:
      out.add(dims[0])
    if all(d >= 0 for d in dims):
      total = 1
      for d in dims:
        total *= d
      if total > 1:
        out.add(total)
  return out


def _allowed_writes(graph_def, allowed):
  """[(resource, its value inputs)] for each top-level op of `graph_def` that writes one of
  the resource Placeholders `allowed` (an assign, a scatter; a call, branch or loop whose
  body writes it: then every input of the call)."""
  out = []
  flow = None
  for node in graph_def.node:
    inputs = [i for i in node.input if not i.startswith("^")]
    srcs = [i.split(":")[0] for i in inputs]
    if not any(s in allowed for s in srcs):
      continue
    if data_writes._is_write(node.op):   # pylint: disable=protected-access
      types = data_writes._input_types(node)   # pylint: disable=protected-access
      for s, t in zip(srcs, types):
        if t == types_pb2.DT_RESOURCE and s in allowed:
          out.append((s, [i for i, ti in zip(inputs, types) if ti != types_pb2.DT_RESOURCE]))
      continue
    if node.op in _LOOPS:
      funcs, offset = [node.attr["cond"].func.name, node.attr["body"].func.name], 0
    elif node.op in _CALLS:
      attrs, offset = _CALLS[node.op]
      funcs = [f.name for a in attrs for f in (node.attr[a].list.func or [node.attr[a].func])]
    elif node.op in {f.signature.name for f in graph_def.library.function}:
      funcs, offset = [node.op], 0
    else:
      continue
    if flow is None:
      flow = data_writes._Flow(graph_def)   # pylint: disable=protected-access
    written = set()
    for f in funcs:   # every write of the body (as under a data-dependent predicate)
      # pylint: disable-next=protected-access
      written |= flow._function(f, frozenset(), frozenset(), True)[0]
    for i in sorted(written):
      if i + offset < len(srcs) and srcs[i + offset] in allowed:
        out.append((srcs[i + offset], inputs))
  return out
