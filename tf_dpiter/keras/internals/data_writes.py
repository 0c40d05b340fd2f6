"""Variables a traced computation writes from its data, found by data flow in its graph.

The private step clips and noises gradients only (McMahan et al., "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 2: the released model
is a function of the noised sums). A layer or loss that assigns a variable from its inputs
(a running mean, a range counter, a "seen a NaN" flag, a write made only when some input is
large) carries the private data into the released state unclipped and un-noised. Whether a
write depends on the data is decided here from the program, not from sample runs (two
random batches can miss a write that depends on rare values or on the call count).

Rule: trace the computation once on symbolic inputs; a value is data-dependent when it is
computed from an input tensor through data edges. Shapes: Shape, Size and Rank of a tensor
are public when its shape is (the inputs' static batch sizes), and data when its shape depends
on the data's values (tf.boolean_mask, tf.where, tf.unique, dynamic partitions, string or
ragged splits: every op not known to take its output shape from its inputs' shapes alone,
and every op fed such a tensor). A write is any stateful op that takes a resource (a
variable, hash table, queue, random generator) other than a short list of reads (default
deny); it is data-dependent when its value is, when it runs inside a branch or loop whose
predicate is, or when it reads a variable so written. A stateful op without a resource given
the data (tf.print, tf.io.write_file, a raw Save) writes it out of the step: refused too, but
for random draws, asserts, replicas' collectives and graph plumbing (`_QUIET`); so is any op,
stateful or not, with an attribute naming a destination (the v1 debugger's DebugIdentity
with its `debug_urls`). A Python function (tf.py_function,
tf.numpy_function) given the data counts as such a write: its body cannot be seen. Function
calls (nested tf.functions, tf.cond, tf.while_loop, tf.switch_case) are followed into their
bodies. A write whose value does not depend on the data (a call counter, a seed generator's
advance) is allowed.

Checked: the model's training-mode call, before any probe runs it on real rows: by a trace of
its own, or in a traced step on one replica (the train function's, which runs the
batch-independence probe after its pass; any, when fit kept no rows) by the fast path's own
pass (its writes below, the variables it reads: `refuse_unlisted_reads`); the step's own
pass (the ops the step traced for the call, the loss and, on the fast path, the backward
pass, whatever Python state or static shapes led there: `refuse_traced_writes`); on the
vectorized path the call, loss and gradient of one record in a separate trace
(`refuse_step_writes`: a custom gradient's writes); all before the step's first execution.
A custom loop's loss_fn: of a record, or of the batch it captures (`refuse_closure_writes`).

This is the library's one check of state written from the data: the model's call is checked
before any probe runs it on real rows (the probes restore only the model's non-trainable
variables; a plain tf.Variable written from the probe's real rows would keep them; a probe
of random inputs writes no record).
"""

import functools
import re

import keras
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import keras_internals

# call ops: (attributes naming the called functions, inputs before the functions' arguments)
_CALLS = {"PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0),
          "If": (("then_branch", "else_branch"), 1),
          "StatelessIf": (("then_branch", "else_branch"), 1),
          "Case": (("branches",), 1), "StatelessCase": (("branches",), 1)}
_LOOPS = ("While", "StatelessWhile")
_SHAPES = ("Shape", "ShapeN", "Size", "Rank")   # public unless their operand's shape is data
# replicas' collectives: only their first input is a value (the others: group size and keys,
# captured from the host, and an ordering token, a resource they read, no value)
_COLLECTIVES = frozenset(("CollectiveReduceV2", "CollectiveGatherV2",
                          "CollectiveReduceScatterV2", "CollectiveAllToAllV2"))
# stateful ops with a resource input that only read it (every other such op writes it)
_READS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
                    "VarIsInitializedOp", "LookupTableFindV2", "LookupTableSizeV2",
                    "LookupTableExportV2", "IsBoostedTreesEnsembleInitialized",
                    "_ReadVariablesOp", "DisableCopyOnRead")) | _COLLECTIVES
# Python bodies the graph cannot show (tf.py_function, tf.numpy_function)
_OPAQUE = frozenset(("EagerPyFunc", "PyFunc", "PyFuncStateless"))
# input positions whose VALUES decide the output's shape, for ops whose output shape is
# otherwise a function of their inputs' shapes only; any other op (tf.where, tf.unique,
# dynamic partitions, string or ragged splits, ...): every input's value may decide it
_SAME_SHAPE = frozenset((
    "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "CheckNumerics",
    "EnsureShape", "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan",
    "RealDiv", "FloorDiv", "FloorMod", "TruncateDiv", "Mod", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "Neg", "Abs", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Log1p",
    "Expm1", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign",
    "LeakyRelu", "Softmax", "LogSoftmax", "Sign", "Floor", "Ceil", "Round", "Rint",
    "Reciprocal", "Inv", "Erf", "Erfc", "Sin", "Cos", "Tan", "Atan", "Atan2", "Cast",
    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Select", "SelectV2", "IsNan", "IsFinite", "IsInf",
    "ClipByValue", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "BiasAdd", "MaxPool", "AvgPool",
    "ZerosLike", "OnesLike", "Squeeze", "L2Loss", "FusedBatchNormV3", "Pack", "Unpack",
    "ReadVariableOp", "ResourceGather", "Cumsum", "Cumprod", "TensorScatterUpdate",
    "TensorScatterAdd", "BroadcastGradientArgs", "Const", "NoOp"))
SHAPE_ARGS = {"Reshape": (1,), "Transpose": (1,), "ExpandDims": (1,), "Fill": (0,),
               "Tile": (1,), "BroadcastTo": (1,), "Pad": (1,), "PadV2": (1,),
               "MirrorPad": (1,), "OneHot": (1,), "GatherV2": (2,), "Split": (0,),
               "SplitV": (1, 2), "TopKV2": (1,), "Slice": (1, 2),
               "StridedSlice": (1, 2, 3), "ScatterNd": (2,), "Sum": (1,), "Mean": (1,),
               "Max": (1,), "Min": (1,), "Prod": (1,), "All": (1,), "Any": (1,),
               "ArgMax": (1,), "ArgMin": (1,), "StatelessRandomUniformV2": (0,),
               "StatelessRandomNormalV2": (0,), "StatelessTruncatedNormalV2": (0,),
               "RandomUniform": (0,), "RandomStandardNormal": (0,),
               "StatelessRandomUniformIntV2": (0,), "StatelessRandomUniformFullIntV2": (0,),
               "RandomUniformInt": (0,), "TruncatedNormal": (0,),
               "ImageProjectiveTransformV2": (2,), "ImageProjectiveTransformV3": (2,)}


@functools.lru_cache(maxsize=None)
def _op_def(op):
  """The registered OpDef of the op type `op`, or None (not registered)."""
  return op_def_registry.get(op)


def _input_types(node):
  """The DataType of each data input of `node`, a registered op (from its OpDef)."""
  op_def = _op_def(node.op)
  types = []
  for arg in op_def.input_arg:
    if arg.type_list_attr:
      types += list(node.attr[arg.type_list_attr].list.type)
      continue
    dtype = arg.type or node.attr[arg.type_attr].type
    types += [dtype] * (node.attr[arg.number_attr].i if arg.number_attr else 1)
  return types


# stateful ops with no resource input that release nothing of their inputs: random draws
# (their value inputs are shapes or distribution parameters; the output is a value of the
# step), the aborts of the data-dependent-abort class (CHANGELOG "Known issues"), replicas'
# collectives within the step, and graph plumbing. Every other stateful op without a
# resource input given the data is a release (default deny): a file written (WriteFile,
# Save, SaveV2), a log line (Print, PrintV2: stderr is a log), a host send, a dataset.
_QUIET = frozenset((
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "RandomCrop", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "Multinomial", "NonDeterministicInts",
    "SampleDistortedBoundingBox", "SampleDistortedBoundingBoxV2", "AnonymousSeedGenerator",
    "AnonymousRandomSeedGenerator", "Assert", "CheckNumerics", "CheckNumericsV2",
    "CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastSendV2",
    "CollectiveBcastRecvV2", "CollectivePermute", "CollectiveAssignGroupV2", "AllToAll",
    "CrossReplicaSum", "NcclAllReduce", "NcclReduce", "NcclBroadcast", "_NcclBroadcastRecv",
    "_NcclBroadcastSend", "_NcclReduceRecv", "_NcclReduceSend", "_Retval", "_DeviceRetval",
    "_Send", "Empty", "GuaranteeConst", "DeepCopy", "StackV2", "TensorArrayV3",
    "TensorArrayGradV3", "_ScopedAllocatorConcat", "_ScopedAllocatorSplit"))


# attributes that name a destination outside the step (the v1 debugger ops DebugIdentity,
# DebugNanCount, DebugNumericSummary publish their input to `debug_urls`; Copy and CopyHost
# run the `debug_ops_spec` debug ops; a dataset's snapshot writes to a path): an op with such
# an attribute given the data is a release, stateful or not
_DESTINATION_ATTR = re.compile(r"url|path|debug_ops_spec")


def _is_release(op):
  """True for an op that may carry its inputs out of the step (a file, a log, the host): a
  stateful op without a resource input except `_QUIET` (default-deny), and any op with an
  attribute naming a destination (`_DESTINATION_ATTR`)."""
  op_def = _op_def(op)
  if op_def is None:
    return False
  if any(_DESTINATION_ATTR.search(attr.name) for attr in op_def.attr):
    return True
  return (op_def.is_stateful and op not in _QUIET and op not in _CALLS and op not in _LOOPS
          and not op.endswith("CandidateSampler") and not _takes_resource(op_def))


def _is_write(op):
  """True for an op that may change a resource (a variable, table, queue, random generator):
  every stateful op that takes a resource, except `_READS` (default-deny)."""
  op_def = _op_def(op)
  return (op_def is not None and op_def.is_stateful and op not in _READS
          and _takes_resource(op_def))


def _takes_resource(op_def):
  """True when the OpDef `op_def` has a resource input (a variable, table, queue, ...)."""
  return any(a.type == types_pb2.DT_RESOURCE for a in op_def.input_arg)


def _shape_args(op, n):
  """Input positions (of `n`) whose values may decide `op`'s output shape."""
  if op in _SAME_SHAPE:
    return ()
  if op == "ConcatV2":
    return (n - 1,)
  return SHAPE_ARGS.get(op, range(n))


def shape_only_args(op, n):
  """Input positions of the op type `op` (of `n` inputs) whose values are a shape, axes or
  bounds only (not a value of the output): `SHAPE_ARGS`, and the axis of ConcatV2."""
  if op == "ConcatV2":
    return (n - 1,)
  return SHAPE_ARGS.get(op, ())


def _source(name):
  """The node (or argument) an input string of a GraphDef or FunctionDef names."""
  return name.split(":")[0]


class _Flow:
  """Data-flow analysis over a GraphDef's nodes and its library's FunctionDefs.

  Two taints: a node is hot when its value depends on the data, shape-hot when its output's
  shape does (the shape of tf.boolean_mask(x, x > 5) counts the records' large entries).
  `opaque` collects the Python functions (tf.py_function, tf.numpy_function) given data or
  run under a data-dependent predicate: (function, node) pairs; `released`, likewise, the
  stateful ops without a resource that carry data out (`_is_release`): (function, node, op)."""

  def __init__(self, graph_def):
    self._library = {f.signature.name: f for f in graph_def.library.function}
    self._memo = {}
    self.opaque = []
    self.released = []

  def body(self, nodes, tainted, tainted_resources, under_data, shape_tainted=(),
           where=""):
    """(written resources, tainted names, shape-tainted names) of one body: `nodes`
    NodeDefs, `tainted` the argument or node names whose values depend on the data,
    `tainted_resources` the resources already written from the data, `under_data` True when
    the whole body runs under a data-dependent predicate, `shape_tainted` the arguments whose
    shapes depend on the data, `where` the function's name (for `opaque`)."""
    tainted, t_res, written = set(tainted), set(tainted_resources), set()
    shaped = set(shape_tainted)
    changed = True
    while changed:   # nodes come in creation order: a second pass usually confirms
      changed = False
      for node in nodes:
        srcs = [_source(i) for i in node.input if not i.startswith("^")]
        hot = any(s in tainted or s in t_res
                  for s in (srcs if node.op not in _COLLECTIVES else srcs[:1]))
        shape_hot = any(s in shaped for s in srcs)
        if node.op in _SHAPES:   # the shape of an input is public; of a masked input, data
          w, out_hot, out_shaped = set(), shape_hot, False
        elif node.op in _CALLS or node.op in _LOOPS or node.op in self._library:
          w, out_hot, out_shaped = self._call(node, srcs, tainted, t_res, shaped, under_data)
        else:
          w, out_hot = set(), hot
          if (under_data or hot) and (node.op in _OPAQUE or _op_def(node.op) is None):
            if (where, node.name) not in self.opaque:
              self.opaque.append((where, node.name))
          elif (under_data or hot) and _is_write(node.op):
            w = {s for s, t in zip(srcs, _input_types(node)) if t == types_pb2.DT_RESOURCE}
          elif (under_data or hot) and _is_release(node.op):
            if (where, node.name, node.op) not in self.released:
              self.released.append((where, node.name, node.op))
          out_shaped = shape_hot or any(
              srcs[i] in tainted or srcs[i] in t_res
              for i in _shape_args(node.op, len(srcs)))
        if w - written:
          written |= w
          t_res |= w
          changed = True
        if out_hot and node.name not in tainted:
          tainted.add(node.name)
          changed = True
        if out_shaped and node.name not in shaped:
          shaped.add(node.name)
          changed = True
    return written, tainted, shaped

  def _function(self, name, hot_args, hot_res, under_data, shaped_args=frozenset()):
    """(written argument positions, hot output positions, shape-hot output positions) of
    the library function `name`."""
    key = (name, hot_args, hot_res, under_data, shaped_args)
    if key not in self._memo:
      fdef = self._library[name]
      args = [a.name for a in fdef.signature.input_arg]
      written, tainted, shaped = self.body(
          fdef.node_def, {args[i] for i in hot_args}, {args[i] for i in hot_res}, under_data,
          {args[i] for i in shaped_args}, name)
      outs = [_source(fdef.ret[o.name]) for o in fdef.signature.output_arg]
      self._memo[key] = ({i for i, a in enumerate(args) if a in written},
                         frozenset(i for i, o in enumerate(outs) if o in tainted),
                         frozenset(i for i, o in enumerate(outs) if o in shaped))
    return self._memo[key]

  def _call(self, node, srcs, tainted, t_res, shaped, under_data):
    """(caller resources written from the data, outputs hot, outputs shape-hot) of a call,
    branch or loop."""
    hot = [s in tainted or s in t_res for s in srcs]
    shp = [s in shaped for s in srcs]
    if node.op in _LOOPS:
      names = (node.attr["cond"].func.name, node.attr["body"].func.name)
      while True:   # the loop variables' taints to a fixed point through the body
        key = frozenset(i for i, h in enumerate(hot) if h)
        skey = frozenset(i for i, h in enumerate(shp) if h)
        _, outs, souts = self._function(names[1], key, key, under_data, skey)
        new = [h or i in outs for i, h in enumerate(hot)]
        new_shp = [h or i in souts for i, h in enumerate(shp)]
        if new == hot and new_shp == shp:
          break
        hot, shp = new, new_shp
      key = frozenset(i for i, h in enumerate(hot) if h)
      skey = frozenset(i for i, h in enumerate(shp) if h)
      pred_hot = bool(self._function(names[0], key, key, under_data, skey)[1])
      written = self._function(names[1], key, key, under_data or pred_hot, skey)[0]
      # the condition runs too (once more than the body): its own writes
      written |= self._function(names[0], key, key, under_data or pred_hot, skey)[0]
      # a data-dependent trip count: a variable grown by the body has a data-dependent shape
      return {srcs[i] for i in written}, any(hot), any(shp) or pred_hot
    if node.op in self._library:   # a library function called by its name
      funcs, offset = [node.op], 0
    else:
      attrs, offset = _CALLS[node.op]
      funcs = [f.name for a in attrs for f in (node.attr[a].list.func or [node.attr[a].func])]
    pred_hot = offset > 0 and hot[0]
    key = frozenset(i - offset for i, h in enumerate(hot) if h and i >= offset)
    skey = frozenset(i - offset for i, h in enumerate(shp) if h and i >= offset)
    written, out_hot, out_shaped = set(), False, False
    for name in funcs:
      w, outs, souts = self._function(name, key, key, under_data or pred_hot, skey)
      written |= {srcs[i + offset] for i in w}
      out_hot = out_hot or bool(outs)
      out_shaped = out_shaped or bool(souts)
    # branches chosen by the data may return differently shaped outputs
    return written, out_hot or any(hot), out_shaped or any(shp) or pred_hot


def data_dependent_writes(fn, specs):
  """Names of the variables `fn` writes from its inputs (module docstring's rule).

  Args:
    fn: a callable of one argument, traced once (its Python runs once, symbolically).
    specs: a nest of tf.TensorSpec, the argument's structure.

  Returns:
    list of the written variables' names (their resources' names; "an untracked resource
    <node>" when the written resource is not a captured variable), in graph order.
  """
  return _graph_writes(*_traced(fn, specs))


def _traced(fn, specs):
  """(the FuncGraph of `fn` traced once on `specs`, the names of its data inputs' nodes)."""
  def traced(x):
    with tf.name_scope("data_writes"):   # a root scope (a model named "_sub") must be valid
      return fn(x)

  graph = tf.function(traced).get_concrete_function(specs).graph
  given = [spec for spec in tf.nest.flatten(specs) if spec is not None]
  return graph, {t.op.name for t in graph.inputs[:len(given)]}


def closure_data_writes(fn):
  """Names of the variables the zero-argument `fn` writes from the tensors it captures.

  The data of a closure (a custom loop's `loss_fn()` of the batch) reaches it as captured
  tensors: every captured tensor that is not a resource (a variable's handle) counts as data.

  Args:
    fn: a callable of no argument, traced once (its Python runs once, symbolically).

  Returns:
    list of names, as `data_dependent_writes`.
  """
  def traced():
    with tf.name_scope("data_writes"):
      return fn()

  graph = tf.function(traced).get_concrete_function().graph
  return _graph_writes(graph, {internal.op.name for _, internal in graph.captures
                               if internal.dtype != tf.resource})


@tf.autograph.experimental.do_not_convert   # plain Python over the graph
def _graph_writes(graph, data, exempt=frozenset(), clean=frozenset(), only=None,
                  clean_name=None, by_id=False):
  """The variables the FuncGraph `graph` writes from its nodes named in `data` (names of
  the written variables, then of the opaque Python functions given the data), less those
  whose eager handle's id is in `exempt`; the nodes named in `clean` (noised results) are
  cut from their inputs, and in the functions the graph calls those whose name (after its
  scope) starts with `clean_name`. only: None, or ids of eager handles: only those
  variables, and no opaque function or release, are reported. by_id: every captured
  variable (`only` unused), no opaque function or release, each as a pair of the eager
  handle's id and the name."""
  names, skip, ids = {}, set(), {}
  for external, internal in getattr(graph, "captures", ()):
    if internal.dtype == tf.resource:
      outer = outermost(external)
      names[internal.op.name] = _variable_name(outer)
      ids[internal.op.name] = id(outer)
      if id(outer) in exempt or (only is not None and id(outer) not in only):
        skip.add(internal.op.name)
  graph_def = graph.as_graph_def()
  for node in graph_def.node:
    if node.name in clean:
      del node.input[:]
  for function in graph_def.library.function if clean_name else ():
    for node in function.node_def:
      if node.name.rsplit("/", 1)[-1].startswith(clean_name):
        del node.input[:]
  flow = _Flow(graph_def)
  written, _, _ = flow.body(graph_def.node, data, set(), False)
  order = [n.name for n in graph_def.node if n.name in written and n.name not in skip
           and (only is None and not by_id or n.name in names)]
  if by_id:
    return [(ids[n], names[n]) for n in order]
  if only is not None:
    return [names[n] for n in order]
  opaque = [f"a Python function (tf.py_function, tf.numpy_function: its body cannot be "
            f"analysed) at node {node!r}" + (f" of {where!r}" if where else "")
            for where, node in flow.opaque]
  released = [f"a {op} op (it writes its input out of the step: a file, a log, the host) "
              f"at node {node!r}" + (f" of {where!r}" if where else "")
              for where, node, op in flow.released]
  return [names.get(n, f"an untracked resource {n!r}") for n in order] + opaque + released


def outermost(handle):
  """The eager handle a captured handle of nested graphs stands for (itself if none)."""
  while not isinstance(handle, tf.__internal__.EagerTensor):
    outer = {id(i): e for e, i in getattr(handle.graph, "captures", ())}
    if id(handle) not in outer:
      return handle
    handle = outer[id(handle)]
  return handle


def refuse_traced_writes(sources, what, call_of=None):
  """Refuses the ops built so far in the graph being traced when one of them writes a
  variable from `sources` (module docstring's rule): the step's own forward pass and loss
  (and backward pass, when built), analysed in the trace that runs them, before the step's
  first execution, whatever Python state or static shapes led the layers there.

  Args:
    sources: a nest of tensors of the current graph (the step's records); leaves that are
      not tensors (None) are ignored. Eagerly (no graph being built) nothing is checked.
    what: how the user calls it, for the message.
    call_of: None, or (model, lists of the ops of its traced calls in this graph): the
      variables those calls read are checked as well (`refuse_unlisted_reads`: for a model
      whose call no trace of its own checked, `refuse_model_writes`).

  Raises:
    PrivacyConfigError: naming the variables written from the data and what to do, or as
      `refuse_unlisted_reads`.
  """
  if tf.executing_eagerly():
    return
  graph = tf.compat.v1.get_default_graph()
  data = {t.op.name for t in tf.nest.flatten(sources) if isinstance(t, tf.Tensor)}
  _refuse(_graph_writes(graph, data), what)
  if call_of is not None:
    model, calls = call_of
    for ops in calls:
      refuse_unlisted_reads(model, ops)


def _variable_name(handle):
  """A captured resource handle's variable name (its resource's shared name without the
  unique suffix: "sequential/running_mean/mean")."""
  found = re.search(r'name="([^"]*)"', repr(handle))
  return re.sub(r"/\d+$", "", found.group(1)) if found else repr(handle)


@tf.autograph.experimental.do_not_convert   # plain Python over the graph
def refuse_data_writes(fn, specs, what):
  """Refuses `fn` when it writes a variable from its inputs (`data_dependent_writes`).

  Args:
    fn: a callable of one argument (the data).
    specs: a nest of tf.TensorSpec for that argument.
    what: how the user calls it, for the message (e.g. "the model's training-mode call").

  Raises:
    PrivacyConfigError: naming the variables written from the data and what to do.
  """
  _refuse(data_dependent_writes(fn, specs), what)


def refuse_closure_writes(fn, what):
  """Refuses the zero-argument `fn` when it writes a variable from the tensors it captures
  (`closure_data_writes`).

  Args:
    fn: a callable of no argument (e.g. a custom loop's loss_fn of the batch).
    what: how the user calls it, for the message.

  Raises:
    PrivacyConfigError: naming the variables written from the data and what to do.
  """
  _refuse(closure_data_writes(fn), what)


def _refuse(written, what):
  """Raises PrivacyConfigError when `written` (names of variables written from the data)
  is not empty."""
  if written:
    raise PrivacyConfigError(
        f"{what} writes the variable {written[0]!r} from the data (a running statistic, a "
        "counter of some inputs, a flag set by some values): the private step clips and "
        "noises gradients only, so that state would carry the records unclipped and "
        "un-noised. Update it only when training is False, compute it outside the private "
        "step from public data, or make it a trainable weight. Received: variables written "
        f"from the data: {written}")


def refuse_override_writes(train_step, data, exempt, what, clean=None, traced=None):
  """Refuses a `train_step` override when its own code writes a variable from the batch,
  before or after the library's step (which `train_step` stands in for by a function that
  writes nothing: the library's own writes are checked by its own rules), or gives the batch
  to a Python function or writes it out of the step (module docstring's rule). A running
  statistic of the training inputs, or a learning rate set from the batch, kept beside the
  weights would be released unclipped and un-noised (McMahan et al., "A General Approach to
  Adding Differential Privacy to Iterative Training Procedures", Section 2: the released model
  is a function of the noised sums only).

  Args:
    train_step: a callable of one argument (the batch as Keras hands it), traced once.
    data: the batch (tensors of the train function's trace, or eager tensors).
    exempt: the variables it may write from the batch (the metrics' own: Keras' train step
      logs the batch's loss and metrics too).
    what: how the user calls it, for the message.
    clean: None, or a function of the traced graph giving the names of its ops whose
      outputs are noised results (a private step's, which the override applies itself):
      cut from their inputs.
    traced: None, or a function of no argument called once the override is traced, before
      its writes are checked (the walk of the rows it hands the step, which needs the
      whole trace: row_provenance.refuse_row_mixing's `exempt_writes`).

  Raises:
    PrivacyConfigError: naming the variables written from the data and what to do.
  """
  specs = tf.nest.map_structure(
      lambda t: tf.type_spec_from_value(t) if isinstance(t, tf.__internal__.CompositeTensor)
      or tf.is_tensor(t) else t, data)

  graph, _ = _traced(train_step, specs)
  if traced is not None:
    traced()
  # every input that is not a variable's handle is data: the batch's tensors (composite ones
  # as their components) and any tensor the override captures from outside
  sources = {t.op.name for t in graph.inputs if t.dtype != tf.resource}
  _refuse(_graph_writes(graph, sources, {id(v.handle) for v in exempt},
                       clean(graph) if clean is not None else frozenset()), what)


def refuse_step_writes(model, x, y, sample_weight):
  """Refuses `model` when its training-mode call, its loss or their gradient writes a
  variable from the batch: the call, `Model.compute_loss` (the compiled loss, a
  `compute_loss` override, the layers' `add_loss` terms) and the gradient of the loss (a
  tf.custom_gradient's function) are traced as the private step runs them, at the step's
  own (static) shapes, with the inputs, targets and sample weights as data.

  Call it inside the step's trace, before the step's first execution (nothing has run: no
  step, no charge) and with the compiled loss's per-output trackers silenced (they log the
  loss, as the step does after its own pass).

  Args:
    model: a built keras.Model with a compiled loss.
    x, y, sample_weight: the batch as the step's pass gets it (nests of tensors or
      tf.TensorSpec; y, sample_weight may be None).

  Raises:
    PrivacyConfigError: as `refuse_data_writes`.
  """
  def spec(t):
    return None if t is None else tf.TensorSpec(t.shape, t.dtype)

  training = keras_internals.call_has_training_arg(model)
  compute_loss = keras_internals.compiled_loss_fn(model)

  def step(batch):
    bx, by, bw = batch
    with tf.GradientTape() as tape:   # the backward pass too (a tf.custom_gradient's writes)
      y_pred = model(bx, training=True) if training else model(bx)
      loss = compute_loss(x=bx, y=by, y_pred=y_pred, sample_weight=bw, training=True)
    return loss, tape.gradient(loss, model.trainable_variables)

  refuse_data_writes(step, tf.nest.map_structure(spec, (x, y, sample_weight)),
                     f"the model {model.name!r} in training mode with its loss")


# how deep `_attribute_variables` looks into a layer's attributes (containers, tf.Modules,
# plain objects holding other objects)
_ATTRIBUTE_DEPTH = 4
# top-level packages whose objects `_attribute_variables` does not enter (but a bare tf.Module)
_LIBRARIES = frozenset(["tf_dpiter", "keras", "tensorflow", "tf_keras"])


def _attribute_variables(model):
  """The tf.Variables the layers of `model` hold in their attributes: directly, or inside
  lists, tuples, sets, dicts, tf.Modules and the user's objects' attributes, to a depth of
  `_ATTRIBUTE_DEPTH`; Keras' own variables excluded (they are not tf.Variable), other layers
  not entered (each is walked as a layer of the model), nor the libraries' objects
  (`_LIBRARIES`: the optimizer, its ledger)."""
  out, seen = [], set()

  def visit(value, depth):
    if id(value) in seen or depth > _ATTRIBUTE_DEPTH or isinstance(value, keras.layers.Layer):
      return
    seen.add(id(value))
    if isinstance(value, tf.Variable):
      out.append(value)
    elif isinstance(value, dict):
      for item in list(value.values()):
        visit(item, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
      for item in list(value):
        visit(item, depth + 1)
    elif type(value).__module__.split(".")[0] in _LIBRARIES and type(value) is not tf.Module:
      return   # the libraries' own objects (the optimizer, the ledger, a strategy)
    elif isinstance(value, tf.Module):
      out.extend(value.variables)
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
      for item in list(vars(value).values()):
        visit(item, depth + 1)

  for layer in keras_internals.flatten_layers(model):
    for value in list(vars(layer).values()):
      visit(value, 1)
  return out


def refuse_model_writes(model, inputs=None):
  """Refuses `model` when its training-mode call writes a variable from its inputs, or reads
  one the model does not list.

  Args:
    model: a built keras.Model.
    inputs: a nest of tensors or specs giving the input structure and shapes (None: the
      model's own symbolic inputs).

  Returns:
    True if the model was checked, False if its inputs are unknown (not built, subclassed
    without inputs): the caller checks again when it has a batch.

  Raises:
    PrivacyConfigError: as `refuse_data_writes`, or when the call reads a variable that is
      not in `model.variables` (nor the optimizer's), or a layer holds one as an attribute
      (read in inference only, it escapes the training-mode trace): the weights' checks
      (weight_fingerprints) cover the model's variables only.
  """
  if inputs is None:
    inputs = batch_independence._model_inputs(model)   # pylint: disable=protected-access
    if inputs is None:
      return False
  specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
  call = ((lambda x: model(x, training=True)) if keras_internals.call_has_training_arg(model)
          else model)
  what = f"the model {model.name!r} in training mode"
  graph, data = _traced(call, specs)
  _refuse(_graph_writes(graph, data), what)
  _refuse_unlisted(model, graph.variables, what)
  return True


def refuse_unlisted_reads(model, ops):
  """Refuses `model` when the ops of its training-mode call, traced by the step itself (the
  fast path's forward pass: fast_clipping.clipping.CALL_OPS_ATTR), read a variable that is not
  in `model.variables` (nor the optimizer's), or a layer holds one as an attribute: the check
  `refuse_model_writes` makes of its own trace, without a trace of its own. The variables read
  are the variables accessed in the trace so far whose handles the ops take as captured
  inputs (nested function calls, branches and loops take them as inputs too).

  Args:
    model: a built keras.Model.
    ops: the ops its call created, in the graph being traced (empty: only the attributes).

  Raises:
    PrivacyConfigError: as `refuse_model_writes`'s check of unlisted variables.
  """
  read = []
  if ops:
    graph = ops[0].graph
    outer = {internal.op.name: external for external, internal in getattr(graph, "captures", ())
             if internal.dtype == tf.resource}
    # the variables accessed so far in the trace (FuncGraph.variables is set when it ends)
    watched = getattr(graph, "_watched_variables", None)
    variables = {id(v.handle): v for v in (graph.variables if watched is None else watched)}
    seen = set()
    for op in ops:
      for t in op.inputs:
        if t.dtype != tf.resource or t.op.name not in outer:
          continue
        v = variables.get(id(outermost(outer[t.op.name])))
        if v is not None and id(v) not in seen:
          seen.add(id(v))
          read.append(v)
  _refuse_unlisted(model, read, f"the model {model.name!r} in training mode")


def _refuse_unlisted(model, read, what):
  """Raises PrivacyConfigError when a variable of `read` (the variables the model's call
  reads) or a tf.Variable a layer holds as an attribute is not in `model.variables` nor the
  optimizer's."""
  listed = {id(v.handle) for v in model.variables}
  listed |= {id(v.handle) for v in getattr(getattr(model, "optimizer", None), "variables", ())}
  unlisted = [v for v in read if id(v.handle) not in listed]
  if unlisted:   # but Keras' SeedGenerator states (its layers' and the global one of
    # keras.random.* with seed=None): a counter the random ops advance, no record's value; a
    # write from the data into one in the step is refused as any other (`refuse_model_writes`)
    listed |= {id(g.state.handle) for g in keras_internals.seed_generators(model)}
  unlisted = [v.name for v in unlisted if id(v.handle) not in listed]
  # and a layer's tf.Variable attribute, read in inference only (a calibration temperature):
  # not in the training-mode trace, but served by predict and export
  unlisted += [v.name for v in _attribute_variables(model) if id(v.handle) not in listed
               and v.name not in unlisted]
  if unlisted:
    raise PrivacyConfigError(
        f"{what} reads (or a layer holds) the variable {unlisted[0]!r}, which is not one "
        "of the model's "
        "variables (a tf.Variable held as a layer attribute or in a closure: Keras does not "
        "list, save or restore it): tf_dpiter cannot check that what it holds comes from "
        "the DP run, and a value written into it from the training data between steps "
        "would be released unclipped and un-noised. Make it a weight "
        "(`self.add_weight(..., trainable=False)`, assigned only when training is False or "
        "from public data) or a constant. Received: variables read or held outside "
        f"model.variables: {unlisted}")
