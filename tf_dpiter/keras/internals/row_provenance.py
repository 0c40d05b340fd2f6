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
private step to the batch (the trace's arguments, a dataset's next element, captured
tensors; constants are public) and accepts only ops that keep rows apart: casts and identities,
elementwise math (broadcasting operands that are themselves rows or depend on no data),
`tf.where`, clipping, one-hot, a lookup of each row in a data-free table, a slice keeping every row, reductions and concatenations over axes other than the
batch's, a matrix product of rows by a data-free matrix, a reshape that keeps the leading
axis. Anything else that depends on the batch (a reduction over the batch, a gather, a
slice, a sort, a transpose, a random shuffle, a Python function) is refused, conservatively:
do per-record transforms in the model (preprocessing layers) or in the dataset
(`dp.data.map_records`).
"""

import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError

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
  if op.type in _AXIS_OPS:
    axes = _axes(op)
    return axes is not None and 0 not in axes
  if op.type == "Squeeze":
    dims = op.get_attr("squeeze_dims")
    rank = op.inputs[0].shape.rank
    return rank is not None and bool(dims) and 0 not in {d % rank for d in dims}
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
      return True
    return (strides is not None and len(strides) > 0 and int(strides[0]) == 1
            and op.get_attr("begin_mask") & 1 and op.get_attr("end_mask") & 1
            and not op.get_attr("shrink_axis_mask") & 1
            and not op.get_attr("new_axis_mask") & 1)
  if op.type in ("GatherV2", "ResourceGather"):   # a lookup of each row in a data-free table
    table = op.inputs[0]
    axis = tf.get_static_value(op.inputs[2]) if op.type == "GatherV2" else 0
    return ((table.dtype == tf.resource or not rows(table)) and axis is not None
            and int(axis) == 0 and op.get_attr("batch_dims") == 0)
  if op.type in ("MatMul", "BatchMatMulV2"):
    a, b = op.inputs[0], op.inputs[1]
    transposed = (op.get_attr("transpose_a") if op.type == "MatMul"
                  else op.get_attr("adj_x"))
    # [B, ..., K] x [K, N] keeps the rows; a batched right operand would move them
    return not rows(b) and not transposed and (op.type == "MatMul" or b.shape.rank == 2)
  return False


def refuse_row_mixing(tensors, what):
  """Refuses tensors handed to the private step that are computed from the batch by an op
  that can combine records (module docstring). Eagerly nothing is checked.

  Args:
    tensors: a nest of tensors of the graph being traced (the batch as handed to the step);
      other leaves are ignored.
    what: how the user hands them, for the message.

  Raises:
    PrivacyConfigError: naming the op, what it can do and what to do instead.
  """
  flat = [t for t in tf.nest.flatten(tensors, expand_composites=True)
          if isinstance(t, tf.Tensor) and not isinstance(t, tf.__internal__.EagerTensor)]
  memo = {}

  def rows(t):   # t depends on the batch (iteratively: graphs can be deep)
    stack = [t]
    while stack:
      u = stack[-1]
      if u.ref() in memo:
        stack.pop()
        continue
      if u.dtype == tf.resource or u.op.type in _SHAPES:
        memo[u.ref()] = False
      elif u.op.type in _SOURCES or not u.op.inputs:
        memo[u.ref()] = u.op.type in _SOURCES
      else:
        todo = [i for i in u.op.inputs if i.ref() not in memo]
        if todo:
          stack.extend(todo)
          continue
        memo[u.ref()] = any(memo[i.ref()] for i in u.op.inputs)
      stack.pop()
    return memo[t.ref()]

  seen, stack = set(), [t.op for t in flat]
  while stack:
    op = stack.pop()
    if op.name in seen or op.type in _SOURCES or op.type in _SHAPES:
      continue
    seen.add(op.name)
    if not any(rows(o) for o in op.outputs):
      continue
    if not _keeps_rows(op, rows):
      raise PrivacyConfigError(
          f"{what} computes the records it hands to the private step from the batch by a "
          f"{op.type} op ({op.name!r}), which can combine rows (a batch mean, a slice or "
          "gather across examples, a shuffle, a concatenation of rows): one record would "
          "then move the rows of others, and the clipped sum would no longer bound its "
          "influence by the clip. Do per-record transforms in the model (its preprocessing "
          "layers) or in the dataset (dp.data.map_records), and hand the batch to the step "
          f"as it comes. Received: a {op.type} op between the batch and the private step")
    stack.extend(i.op for i in op.inputs if i.dtype != tf.resource and rows(i))
