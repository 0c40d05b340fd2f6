"""The rows the private step clips are the batch's own rows, each a function of one record.

Rule: clipping bounds one record's influence on the clipped sum by C only when the row the
step clips for record i is a function of record i alone (McMahan et al., "A General Approach
to Adding Differential Privacy to Iterative Training Procedures", Section 2: the query's
records). A transform between the batch and the private step that combines rows (inputs
centred on the batch mean, a shuffle of features across rows, rows concatenated or
duplicated, mixup) lets one record move every row: under replace-one, 16 C measured for a
batch-centred input in a `train_step` override (review R9, session 40). The batch-independence
probe covers the model's layers; this walk covers the code before the step.

`refuse_row_mixing` walks back, in the graph being traced, from the tensors handed to the
private step to where their data enters: the batch (the trace's arguments and captured
tensors, a dataset's next element, a Python function's result, a variable that is not the
model's), and arrays embedded in the program (a constant of more than one element, of any
dtype: a public table, or a dataset the step gathers its sample from). It accepts only ops
that keep rows apart: casts and identities, elementwise math (broadcasting operands that are
themselves rows or come from no data), `tf.where`, clipping, one-hot, a lookup of each row
in a table that is not the batch (a public table, a stored dataset), a slice, reversal,
padding or tiling keeping every row in place (a random or central crop, the batch's axis
whole), an image resized, its contrast, hue or saturation adjusted or projectively
transformed (translated, rotated, zoomed) alone, random draws from no data, transposes,
reductions, stacks and concatenations over axes other than the batch's, a matrix product of
rows by a matrix that is not the batch, a reshape that keeps the leading axis; branches
(tf.cond, tf.switch_case: tf.image.rot90) and nested tf.functions are walked through. A
variable that the whole trace (a train_step override's, walked after it) writes only as a
counter, from no data (a Keras augmentation layer's SeedGenerator state, advanced by a
constant at each draw), is no data; one written from the batch, its size or another
variable holding data stays other records. Anything else that depends on the data (a
reduction over the batch, a gather or slice across rows, a sort, a random shuffle, a loop, a
Python function) is refused, conservatively: do per-record transforms in the model
(preprocessing layers) or in the dataset (`dp.data.map_records`). Shape arguments
(a reshape's target, a fill's dims) carry no rows; under Poisson-type sampling the batch's
size is private (it depends on which records were sampled), so a data tensor's shape used as
a value (a row's position from `tf.range`, rows scaled by the size) is refused too (review
R10, session 41: 2.2 times the step's allowance for a row-position feature), but not the
dimensions the trace knows (tf.shape(x)[-1] of a batch of static features). A shape, bound
or axis computed from the batch's values is refused (sequences trimmed to the batch's
longest: 3.3 times the allowance, review R11, session 42).
"""

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import data_writes

# elementwise ops: each output row is a function of the same row of the inputs that are rows
_ELEMENTWISE = frozenset("""
Identity IdentityN Cast StopGradient Snapshot PreventGradient CheckNumerics EnsureShape
Neg Abs Exp Expm1 Log Log1p Sqrt Rsqrt Square Reciprocal Inv Sign Floor Ceil Round Rint
Sigmoid Tanh Relu Relu6 Elu Selu Softplus Softsign LeakyRelu Gelu Erf Erfc Sin Cos Tan
IsNan IsInf IsFinite LogicalNot Invert Real Imag Conj ComplexAbs
Add AddV2 Sub Mul MulNoNan RealDiv Div DivNoNan TruncateDiv FloorDiv FloorMod Mod Pow
Maximum Minimum SquaredDifference Atan2 BiasAdd Xdivy Xlogy Xlog1py
Equal NotEqual Less LessEqual Greater GreaterEqual LogicalAnd LogicalOr
BitwiseAnd BitwiseOr BitwiseXor LeftShift RightShift
Select SelectV2 ClipByValue OneHot ZerosLike OnesLike
""".split())
# reductions and concatenations: row-wise when their axes leave the batch's (axis 0) alone
_AXIS_OPS = {"Mean": 1, "Sum": 1, "Max": 1, "Min": 1, "Prod": 1, "All": 1, "Any": 1,
             "ArgMax": 1, "ArgMin": 1, "ExpandDims": 1, "ConcatV2": -1, "Cumsum": 1}
# outputs that carry no record: shapes (the batch's size is that of the sample, accounted)
_SHAPES = frozenset(["Shape", "ShapeN", "Rank", "Size"])
# where the batch enters a trace (constants are public: a table, a per-feature mean)
_SOURCES = frozenset(["Placeholder", "IteratorGetNext", "IteratorGetNextSync",
                      "OptionalGetValue"])
_PYTHON = frozenset(["EagerPyFunc", "PyFunc", "PyFuncStateless"])   # rows unknown: the batch
_READS = frozenset(["ReadVariableOp", "ResourceGather", "ResourceGatherNd"])
# random draws (their shape argument skipped) and the key and counter made from a seed
_DRAWS = frozenset(["StatelessRandomUniformV2", "StatelessRandomNormalV2",
                    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
                    "StatelessRandomUniformFullIntV2", "StatelessRandomGetKeyCounter",
                    "RandomUniform", "RandomStandardNormal", "RandomUniformInt",
                    "TruncatedNormal"])
_RESIZE = frozenset(["ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea",
                     "ScaleAndTranslate"])
# per-image ops and the rank from which the leading axes are the batch's: a contrast over each
# image's pixels [..., H, W, C], a hue or saturation of each pixel [..., 3], a projective
# transform (translation, rotation, zoom) of each image [B, H, W, C] by its own row of the
# transforms [B, 8] (or one row for all)
_PER_IMAGE = {"AdjustContrastv2": 4, "AdjustHue": 2, "AdjustSaturation": 2,
              "ImageProjectiveTransformV2": 4, "ImageProjectiveTransformV3": 4}
# the writes of a variable whose value `_counters` follows (its value input: position 1)
_ASSIGNS = frozenset(["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])


def _axes(op):
  """The axes `op` (a table `_AXIS_OPS` op) acts on, made non-negative; None if not known."""
  axes = tf.get_static_value(op.inputs[_AXIS_OPS[op.type]])
  rank = op.inputs[0].shape.rank
  if axes is None or rank is None:
    return None
  if op.type == "ExpandDims":
    rank += 1
  return {int(a) % rank for a in tf.nest.flatten(axes.tolist())}


def _keeps_rows(op, rows):
  """True when `op` keeps each row of its row inputs apart (module docstring); `rows(t)`
  tells whether tensor t depends on the batch."""
  if op.type in _ELEMENTWISE:
    return True
  if op.type in ("Softmax", "LogSoftmax"):   # over the last axis: the batch's when rank 1
    rank = op.inputs[0].shape.rank
    return rank is not None and rank >= 2
  if op.type == "ExpandDims" and tf.get_static_value(op.inputs[1]) == -1:
    return True   # a new last axis (on a scalar: a batch of one row)
  if op.type in _AXIS_OPS:
    axes = _axes(op)
    return axes is not None and 0 not in axes
  if op.type in ("Transpose", "ReverseV2"):
    # per-record when axis 0 stays the batch's, whole and in order: a transpose with
    # perm[0] == 0, a reversal of other axes
    arg = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    if arg is None or rank is None or rank == 0:
      return False
    arg = np.asarray(arg)
    if op.type == "Transpose":
      return int(arg[0]) == 0
    return 0 not in {int(a) % rank for a in arg.ravel()}
  if op.type in ("Pad", "PadV2", "MirrorPad", "Tile"):   # no padding or tiling of axis 0:
    # paddings [[0, 0], ...], multiples [1, ...] (the other axes' may come from shapes)
    head = _leading(op.inputs[1], 1 if op.type == "Tile" else 2)
    rank = op.inputs[0].shape.rank
    if head is None or rank is None or rank == 0:
      return False
    return list(head) == [1] if op.type == "Tile" else not head.any()
  if op.type == "Slice":
    return _slice_keeps_rows(op)
  if op.type in _PER_IMAGE:   # each image alone, by factors from no data (a transform's rows
    rank = op.inputs[0].shape.rank   # its image's own)
    aligned = (1,) if op.type.startswith("ImageProjectiveTransform") else ()
    return (rank is not None and rank >= _PER_IMAGE[op.type]
            and not any(rows(t) for i, t in _Provenance.value_inputs(op)
                        if i and i not in aligned))
  if op.type in ("Pack", "Unpack"):   # tf.stack / tf.unstack on an axis other than 0
    rank = op.inputs[0].shape.rank
    return rank is not None and op.get_attr("axis") % (rank + (op.type == "Pack")) != 0
  if op.type == "Squeeze":   # with no dims: drops axis 0 only for a batch of one row
    dims = op.get_attr("squeeze_dims")
    rank = op.inputs[0].shape.rank
    return not dims or (rank is not None and 0 not in {d % rank for d in dims})
  if op.type == "Reshape":
    before, after = op.inputs[0].shape, op.outputs[0].shape
    return (before.rank is not None and after.rank is not None and before.rank >= 1
            and after.rank >= 1 and before[1:].is_fully_defined()
            and after[1:].is_fully_defined()
            and before[1:].num_elements() == after[1:].num_elements()
            and (before[0] == after[0] or before[0] is None or after[0] is None))
  if op.type == "StridedSlice":   # x[:, j], x[..., :k]: every row kept, in order
    strides = tf.get_static_value(op.inputs[3])
    if op.get_attr("ellipsis_mask") & 1:
      # a leading ellipsis keeps axis 0 only when it covers it: the specs after it that
      # consume an input axis (not new axes) are fewer than the rank (x[..., :1, :] on a
      # rank-2 batch slices axis 0)
      rank, specs = op.inputs[0].shape.rank, op.inputs[1].shape[0]
      if rank is None or specs is None:
        return False
      new_axes = op.get_attr("new_axis_mask")
      consumed = sum(1 for i in range(1, specs) if not new_axes >> i & 1)
      return consumed < rank
    return (strides is not None and len(strides) > 0 and int(strides[0]) == 1
            and op.get_attr("begin_mask") & 1 and op.get_attr("end_mask") & 1
            and not op.get_attr("shrink_axis_mask") & 1
            and not op.get_attr("new_axis_mask") & 1)
  # a draw of a Poisson batch's size from a seed is refused before (`_positional`)
  if op.type == "Fill" or op.type in _DRAWS:   # rows of a constant, or independent draws
    return not any(rows(t) for _, t in _Provenance.value_inputs(op))   # of a public key
  if op.type in _RESIZE:   # each image [B, H, W, C] resized alone, to a size not the batch's
    return op.inputs[0].shape.rank == 4 and not rows(op.inputs[1])
  if op.type in ("GatherV2", "ResourceGather"):   # a lookup of each row in a data-free table
    table = op.inputs[0]
    axis = tf.get_static_value(op.inputs[2]) if op.type == "GatherV2" else 0
    rank = table.shape.rank
    if axis is None or op.get_attr("batch_dims") != 0:
      return False
    if rank is not None and rank > 0 and int(axis) % rank != 0:   # columns taken from each
      return not rows(op.inputs[1])   # row, the same ones for every row
    return int(axis) == 0 and (table.dtype == tf.resource or not rows(table))
  if op.type in ("MatMul", "BatchMatMulV2"):
    a, b = op.inputs[0], op.inputs[1]
    transposed = (op.get_attr("transpose_a") if op.type == "MatMul"
                  else op.get_attr("adj_x"))
    # [B, ..., K] x [K, N] keeps the rows; a batched right operand would move them
    return not rows(b) and not transposed and (op.type == "MatMul" or b.shape.rank == 2)
  return False


def _positional(op, rows):
  """True when `op`, a random draw, is of a Poisson batch's size (its shape argument is data:
  `rows`) from a seed that is not fresh entropy: a stateless draw (a function of its key: a
  literal seed, a Keras SeedGenerator's state) or a stateful one given a seed (an op's
  seed=, tf.random.set_seed, keras.utils.set_random_seed). Row i then gets the i-th draws, a
  function of its position in the batch, which removing an earlier sampled record shifts
  for every later row (as tf.range of the size, review R10; review R12, session 43: 1.9
  times the clip). A stateful draw without a seed takes fresh secret entropy at every run:
  the rows' draws are then exchangeable."""
  if not any(rows(t) for t in _Provenance.shape_args(op)):
    return False
  return op.type.startswith("Stateless") or bool(op.get_attr("seed") or op.get_attr("seed2"))


def _leading(t, count):
  """The first `count` elements of the 1-D or 2-D integer tensor `t` (flattened), when the
  trace knows them though not all of t (a tf.stack of zeros and sizes computed from shapes,
  the pieces of a concatenation, a fill); None otherwise."""
  value = tf.get_static_value(t)
  if value is not None:
    value = np.ravel(value)
    return value[:count] if value.size >= count else None
  op = t.op
  if op.type in ("Identity", "Reshape"):   # a reshape keeps the flat order
    return _leading(op.inputs[0], count)
  if op.type == "Fill":
    value, size = tf.get_static_value(op.inputs[1]), t.shape.num_elements()
    return None if value is None or size is None or size < count else np.full(count, value)
  axis = (tf.get_static_value(op.inputs[-1]) if op.type == "ConcatV2"
          else op.get_attr("axis") if op.type == "Pack" else None)
  if axis is None or int(axis) != 0:   # pieces one after the other in the flat order
    return None
  out = []
  for piece in op.inputs[:-1] if op.type == "ConcatV2" else op.inputs:
    size = piece.shape.num_elements()
    if size is None:
      return None
    head = _leading(piece, min(size, count - len(out))) if size else []
    if head is None:
      return None
    out.extend(head)
    if len(out) >= count:
      return np.asarray(out)
  return None


def _slice_keeps_rows(op):
  """True when a Slice op takes axis 0 of its input whole: size -1 from 0, or a size equal to
  the input's dim 0 (static, or tf.shape(x)[0] of the same x: the begin is then 0, or the
  slice fails), as tf.image.random_crop(x, [tf.shape(x)[0], h, w, c]) and central_crop."""
  x, begin, size = op.inputs
  head = _leading(size, 1)
  if head is not None and int(head[0]) == -1:
    start = _leading(begin, 1)
    return start is not None and int(start[0]) == 0
  if x.shape.rank is None or x.shape.rank == 0:
    return False
  if head is not None:
    return x.shape[0] is not None and int(head[0]) == x.shape[0]
  first = size
  while first.op.type == "Identity":
    first = first.op.inputs[0]
  if first.op.type != "Pack" or first.op.get_attr("axis"):
    return False
  dim = first.op.inputs[0].op   # tf.shape(x)[0]
  if (dim.type != "StridedSlice" or dim.inputs[0].op.type != "Shape"
      or dim.inputs[0].op.inputs[0].name != x.name or dim.get_attr("shrink_axis_mask") != 1):
    return False
  start = _leading(dim.inputs[1], 1)
  return start is not None and int(start[0]) == 0


def _static_dims(op):
  """True when `op`, a StridedSlice, takes dimensions of a Shape that the trace knows
  (tf.shape(x)[-1], tf.shape(x)[1:] of a batch whose other axes are static): a constant of
  the program, whatever the batch's size."""
  source = op.inputs[0].op
  if source.type != "Shape" or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
    return False
  dims = source.inputs[0].shape
  bounds = [tf.get_static_value(op.inputs[i]) for i in (1, 2, 3)]
  if dims.rank is None or any(b is None or np.size(b) != 1 for b in bounds):
    return False
  dims = dims.as_list()
  begin, end, stride = (int(np.ravel(b)[0]) for b in bounds)
  if op.get_attr("shrink_axis_mask") & 1:
    taken = [dims[begin]] if -len(dims) <= begin < len(dims) else [None]
  else:
    taken = dims[None if op.get_attr("begin_mask") & 1 else begin:
                 None if op.get_attr("end_mask") & 1 else end:stride]
  return all(d is not None for d in taken)


def _held_rows_mixed(op, data):
  """True when `op` combines the batch with rows held in a variable that is not public (the
  previous batch kept in a metric's variable: mixup across batches, 1.9 times the step's
  allowance, review R11, session 42): such a read holds other records, not this batch's
  row i; it may be looked up (a Gather's table) or broadcast over the rows, not aligned
  with them."""
  ins = [t for _, t in data.value_inputs(op)]
  if len(ins) < 2 or not any(data.kind(t) == 3 for t in ins):
    return False
  out_rank = op.outputs[0].shape.rank if op.outputs else None
  held = {t.ref() for t in ins if data.kind(t) == 3 and (
      t.shape.rank is None or out_rank is None
      or (t.shape.rank == out_rank and t.shape.rank >= 1 and t.shape[0] != 1))}
  return bool(held) and any(data.kind(t) for t in ins if t.ref() not in held)


class _Provenance:
  """What each tensor of a trace is computed from: 0 no data, 1 an array embedded in the
  program (a constant of more than one element, of any dtype: a table, or a dataset the step
  gathers its sample from, uint8 images or token ids too), 2 the batch (the trace's arguments
  and captured tensors, a dataset's next element, a Python function's result), 3 rows held
  in a variable that is not `public` (other records, maybe an earlier batch: taken as the
  batch, and never aligned with it, `_held_rows_mixed`), 4 records held in a variable
  `held` names (a metric's, written from this batch or earlier ones: a running mean, a
  previous batch; refused wherever it reaches the step, broadcast or not: review R12,
  session 43). Shape arguments (a reshape's target, a fill's dims) carry no rows unless computed from the batch's values; a data
  tensor's shape is data when the batch size is private (Poisson-type sampling: its size
  depends on which records were sampled, so a row's position or the size used as a value
  moves every row), but not its dimensions the trace knows."""

  def __init__(self, public, private_size, counters=(), aliases=None, held=()):
    self._public = {id(v.handle) for v in public} | set(counters)   # `_counters`: no data
    self._held = {id(v.handle) for v in held}
    self.aliases = {} if aliases is None else aliases   # `_aliases`
    self._private_size = private_size
    self._memo = {}

  @staticmethod
  def value_inputs(op):
    """`op`'s (position, input) pairs that can carry rows into its output (not its shape
    arguments, not variables' handles)."""
    skip = data_writes.shape_only_args(op.type, len(op.inputs))
    return [(i, t) for i, t in enumerate(op.inputs) if i not in skip and t.dtype != tf.resource]

  def _public_read(self, op):
    return id(data_writes.outermost(op.inputs[0])) in self._public

  def _leaf(self, t):
    """The kind of a tensor decided by its op alone, or None when its inputs decide it."""
    op = t.op
    if t.dtype == tf.resource:
      return 0
    if t.ref() in self.aliases or _bodies(op) is not None:   # a function's argument or result
      return None
    if op.type in _SHAPES:
      return None if self._private_size else 0
    if op.type in _SOURCES or op.type in _PYTHON:
      return 2
    if op.type in _READS:   # a gather from a public variable: its indices decide
      if id(data_writes.outermost(op.inputs[0])) in self._held:
        return 4
      return 3 if not self._public_read(op) else (0 if op.type == "ReadVariableOp" else None)
    if not op.inputs:   # an array of any dtype (uint8 images, token ids, strings)
      size = t.shape.num_elements()
      return int(op.type == "Const" and (size is None or size > 1))
    if op.type == "StridedSlice" and _static_dims(op):
      return 0
    return None

  def kind(self, t):
    """0 to 4 (class docstring), iteratively: graphs can be deep. A shape argument from the
    batch (a one_hot's depth, a slice's bound from its values; a fill's dims from a private
    batch size: ones made tf.cumsum a row's position) makes its op's output the batch's."""
    memo, stack = self._memo, [t]
    while stack:
      u = stack[-1]
      if u.ref() in memo:
        stack.pop()
        continue
      leaf = self._leaf(u)
      if leaf is None:
        bounds = []
        bodies = _bodies(u.op)
        if u.ref() in self.aliases:
          ins = self.aliases[u.ref()]
        elif bodies is not None:   # each body's result, and the branch's predicate or index
          ins = ([g.outputs[u.value_index] for g in bodies[0]]
                 + list(u.op.inputs[:bodies[1]]))
        elif u.op.type in _SHAPES:
          ins = list(u.op.inputs)
        elif u.op.type in _READS:
          ins = [u.op.inputs[1]]
        else:
          ins = [i for _, i in self.value_inputs(u.op)]
          bounds = self.shape_args(u.op)
        todo = [i for i in ins + bounds if i.ref() not in memo]
        if todo:
          stack.extend(todo)
          continue
        leaf = max([memo[i.ref()] for i in ins]
                   + [2 for b in bounds if memo[b.ref()] >= 2], default=0)
      memo[u.ref()] = leaf
      stack.pop()
    return memo[t.ref()]

  @staticmethod
  def shape_args(op):
    """`op`'s inputs that are a shape, bounds or axes only (`data_writes.shape_only_args`)."""
    return [op.inputs[i] for i in data_writes.shape_only_args(op.type, len(op.inputs))
            if op.inputs[i].dtype != tf.resource]


def _bodies(op):
  """(the FuncGraphs, the position of the first argument) of a call op whose bodies the
  trace holds (a nested tf.function's, tf.cond's branches, tf.switch_case's); else None."""
  if op.type in ("If", "StatelessIf"):
    graphs, first = [getattr(op, "_true_graph", None), getattr(op, "_false_graph", None)], 1
  elif op.type in ("Case", "StatelessCase"):
    graphs, first = list(getattr(op, "_branch_graphs", None) or [None]), 1
  elif op.type in ("PartitionedCall", "StatefulPartitionedCall"):
    function = op.graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
    graphs, first = [getattr(function, "graph", None)], 0
  else:
    return None
  if any(g is None or len(g.inputs) != len(op.inputs) - first
         or len(g.outputs) != len(op.outputs) for g in graphs):
    return None
  return graphs, first


def _aliases(graph):
  """{a function body's argument (ref): the tensors its call ops pass it}, for the call ops
  of `graph` and of the bodies they run (`_bodies`)."""
  aliases, stack, seen = {}, list(graph.get_operations()), set()
  while stack:
    op = stack.pop()
    found = _bodies(op)
    for g in found[0] if found is not None else ():
      for inner, outer in zip(g.inputs, op.inputs[found[1]:]):
        aliases.setdefault(inner.ref(), []).append(outer)
      if id(g) not in seen:
        seen.add(id(g))
        stack.extend(g.get_operations())
  return aliases


def _passed(op, data):
  """The ops whose data `op` only passes on, or None: a body's argument, its call's inputs;
  a call, each body's results and the predicate or index that picks the body (`_bodies`)."""
  if op.outputs and op.outputs[0].ref() in data.aliases:
    return [t.op for t in data.aliases[op.outputs[0].ref()] if data.kind(t)]
  bodies = _bodies(op)
  if bodies is None:
    return None
  return ([g.outputs[o.value_index].op for g in bodies[0] for o in op.outputs if data.kind(o)]
          + [t.op for t in op.inputs[:bodies[1]] if data.kind(t)])


def _counters(graph, public, exempt, private_size):
  """The ids of the variables (outermost handles) that are not `public` nor `exempt` and that
  the ops of `graph` so far write only as a counter (a Keras SeedGenerator's state, advanced
  by [0, 1] at each draw): by AssignVariableOp, AssignAddVariableOp or AssignSubVariableOp of
  a value computed elementwise from the counters' own reads, constants no larger than the
  variable and no data (not from a Poisson batch's size either), and taken by no other op
  but reads (not into a function, branch or loop whose body is not followed). The largest
  such set: a counter may advance from another. Their reads are then no data."""
  values, other = {}, set()
  listed = {id(v.handle) for v in list(public) + list(exempt)}
  for op in graph.get_operations():
    for i, t in enumerate(op.inputs):
      key = id(data_writes.outermost(t)) if t.dtype == tf.resource else None
      if key is None or key in listed or op.type in data_writes._READS:  # pylint: disable=protected-access
        continue
      if op.type in _ASSIGNS and i == 0:
        values.setdefault(key, []).append(op.inputs[1])
      else:
        other.add(key)
  quiet = set(values) - other
  while True:
    data = _Provenance(public, private_size, quiet)
    mixed = {key for key in quiet if not all(_advance(t, data) for t in values[key])}
    if not mixed:
      return quiet
    quiet -= mixed


def _advance(t, data):
  """True when `t`, a counter's new value, is computed elementwise from no data (under
  `data`, where the counters' reads are none) and constants no larger than t."""
  size, stack, seen = t.shape.num_elements(), [t], set()
  while stack:
    u = stack.pop()
    if u.ref() in seen or data.kind(u) == 0:
      continue
    seen.add(u.ref())
    if u.op.type == "Const" and size is not None and u.shape.num_elements() <= size:
      continue
    if u.op.type not in _ELEMENTWISE:
      return False
    stack.extend(i for _, i in data.value_inputs(u.op))
  return True


@tf.autograph.experimental.do_not_convert   # plain Python over the graph
def refuse_row_mixing(tensors, what, public=(), private_size=True, exempt_writes=None):
  """Refuses tensors handed to the private step that are computed from the batch by an op
  that can combine records (module docstring). Eagerly nothing is checked.

  Args:
    tensors: a nest of tensors of the graph being traced (the batch as handed to the step);
      other leaves are ignored.
    what: how the user hands them, for the message.
    public: the variables whose values are the model's, not data (the model's weights and
      the optimizer's); a read of any other variable is taken as the batch.
    private_size: the batch's size is private (Poisson-type sampling): a value computed
      from a data tensor's shape is data.
    exempt_writes: None, or, when the trace is whole (walked after it), the variables the
      caller lets it write from the data (a train_step override's metrics:
      data_writes.refuse_override_writes refuses any other written from the batch). Given,
      a variable neither public nor exempt that the trace writes only as a counter
      (`_counters`: a Keras augmentation layer's seed state) is no data, and a read of an
      exempt variable reaching the step is refused, broadcast or not; without it, a
      variable not public is other records.

  Raises:
    PrivacyConfigError: naming the op, what it can do and what to do instead.
  """
  flat = [t for t in tf.nest.flatten(tensors, expand_composites=True)
          if isinstance(t, tf.Tensor) and not isinstance(t, tf.__internal__.EagerTensor)]
  if not flat:
    return
  counters = (() if exempt_writes is None
              else _counters(flat[0].graph, public, exempt_writes, private_size))
  aliases = _aliases(flat[0].graph)
  held = () if exempt_writes is None else exempt_writes
  values = _Provenance(public, False, counters, aliases, held)   # what the batch's values reach
  data = _Provenance(public, True, counters, aliases, held) if private_size else values
  stored = next((t for t in flat if data.kind(t) == 4), None)
  if stored is not None:   # x - metric.result(), the previous batch as an input of its own
    raise PrivacyConfigError(
        f"{what} computes the records it hands to the private step ({stored.name!r}) from a "
        "variable written from the batch (a metric's: a running mean, a previous batch): "
        "each row would then carry other records, broadcast or aligned, and the clipped sum "
        "would no longer bound one record's influence by the clip. Compute such statistics "
        "from public data, or keep them in the model (its layers are checked). Received: a "
        "read of a metric's variable")
  seen, stack = set(), [t.op for t in flat]
  while stack:
    op = stack.pop()
    if (id(op.graph), op.name) in seen:
      continue
    seen.add((id(op.graph), op.name))
    passed = _passed(op, data)
    if passed is not None:
      stack.extend(passed)
      continue
    if not op.inputs or op.type in _SOURCES or op.type == "ReadVariableOp":
      continue
    if not any(data.kind(o) for o in op.outputs):
      continue
    if op.type in _DRAWS and _positional(op, lambda t: data.kind(t) >= 2):
      raise PrivacyConfigError(
          f"{what} draws random numbers of a Poisson batch's size by a {op.type} op "
          f"({op.name!r}) from a seed (a stateless seed, a Keras SeedGenerator's state, an "
          "op's seed=, tf.random.set_seed or keras.utils.set_random_seed): row i then gets "
          "the i-th draws, a function of its position in the batch, which adding or removing "
          "one sampled record shifts for every later row, and the clipped sum would no longer "
          "bound its influence by the clip. Draw them with tf.random ops and no seed set "
          "(fresh entropy at every run), or sample fixed-size batches (sampling=\"shuffle\"). "
          f"Received: a seeded {op.type} draw of the batch's size")
    if not _keeps_rows(op, lambda t: data.kind(t) >= 2) or _held_rows_mixed(op, data):
      raise PrivacyConfigError(
          f"{what} computes the records it hands to the private step from the batch by a "
          f"{op.type} op ({op.name!r}), which can combine rows (a batch mean, a slice or "
          "gather across examples, a shuffle, a concatenation of rows, the size of a "
          "Poisson batch used as a value): one record would then move the rows of others, "
          "and the clipped sum would no longer bound its influence by the clip. Do "
          "per-record transforms in the model (its preprocessing layers) or in the dataset "
          "(dp.data.map_records), and hand the batch to the step as it comes. Received: a "
          f"{op.type} op between the batch and the private step")
    bound = next((b for b in data.shape_args(op) if values.kind(b) >= 2), None)
    if bound is not None:   # x[:, :tf.reduce_max(lengths)]: one record sets every row's
      raise PrivacyConfigError(   # length, padding or depth
          f"{what} gives the {op.type} op {op.name!r} a shape, bound or axis computed from "
          f"the batch's values ({bound.op.type} op {bound.op.name!r}: e.g. sequences trimmed "
          "or padded to the batch's longest, one_hot to the batch's largest label): one "
          "record would then change every other record's row, and the clipped sum would no "
          "longer bound its influence by the clip. Use a bound fixed in advance (the "
          "dataset's maximum length, the class count) or a mask. Received: a bound from "
          f"the batch for a {op.type} op")
    # a lookup table and a matrix product's right operand were checked free of the batch
    table = {"GatherV2": 0, "MatMul": 1, "BatchMatMulV2": 1}.get(op.type)
    stack.extend(t.op for i, t in data.value_inputs(op) if i != table and data.kind(t))
