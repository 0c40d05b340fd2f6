"""Per-variable pipelining of the private step: sum -> noise -> divide -> apply.

Bu et al., "Differentially private optimization on large model at small cost" (book-keeping,
Section 3) keep the DP step's memory near the non-private one by never holding more than the
non-private step holds. In a traced TF step the clipped sums of all variables become ready
together (every sum needs the clip factors, hence every norm), and TF's executor runs every
ready op: all the sums (one weight-sized buffer per variable, 418 MiB for BERT-base) were
formed before the noise chain, which draws the variables' noise one after the other, reached
them. Non-private training applies each gradient as it comes and frees it.

`gate_sums_on_noise` adds, after the noised result is built, a control edge from the noised
leaf j to the op that forms the clipped sum of leaf j + 1, so sum j + 1 is formed only once
leaf j is noised: at most about one draw's worth of sums waits for its noise, and each noised
leaf goes on to its division and update (which depend on it alone) while the next sum is
formed. Nothing is computed differently: the same ops, the same noise draws from the same
generator in the same order, only an execution order is added. An edge is added only where it
cannot close a cycle (the producer is not an ancestor of the noised leaves before it), so a
sum that other sums or the noise depend on (an XLA program's outputs, a query mixing leaves)
is left as it is.
"""

import tensorflow as tf

# Ops that pass a buffer on (no new weight-sized allocation): the walk from a sum to the op
# that allocates it goes through them. SplitV (data input first) too: a layer whose sums come
# out of one product split into its variables' parts ([W; b] of the Dense rule; the parts are
# views of the product on the dimension-0 split) allocates them in the product, so that is the
# op to gate (gating the split left every such product formed at once: BERT-base's TF allocator
# peak over a DP step 809 -> 629 MiB at batch 4 x 32 with the product gated).
_FORWARDING_OPS = frozenset(["Identity", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                             "EnsureShape", "SplitV"])


def _producer(tensor):
  """The op that allocates `tensor`'s buffer: its op, or, through buffer-forwarding ops (their
  data input is the first), the first op that is not one."""
  op = tensor.op
  while op.type in _FORWARDING_OPS and op.inputs:
    op = op.inputs[0].op
  return op


def _add_ancestors(ops, seen):
  """Adds to `seen` (a set of ops) every op that `ops` depend on (data or control), them
  included; walks only ops not in `seen` yet."""
  stack = [op for op in ops if op not in seen]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs if t.op not in seen)
    stack.extend(c for c in op.control_inputs if c not in seen)


def gate_sums_on_noise(sums, noised):
  """Makes the sum of leaf j + 1 wait for the noised leaf j (module docstring).

  Works on a traced graph only (eager tensors have no ops: nothing to order). Leaves are
  taken in `tf.nest.flatten` order, the order in which the Gaussian query draws their noise.

  Args:
    sums: the clipped sums (a nest of tensors, the query's sample state).
    noised: the noised result of the same structure (the query's result).

  Returns:
    the number of control edges added (0 when the structures differ, in eager mode, or when
    every edge could close a cycle).
  """
  sums = tf.nest.flatten(sums)
  noised = tf.nest.flatten(noised)
  if (tf.executing_eagerly() or len(sums) != len(noised) or len(sums) < 2
      or not all(tf.is_tensor(t) and hasattr(t, "op") for t in sums + noised)):
    return 0
  graph = noised[0].graph
  seen = set()   # ancestors of the noised leaves so far (the edges added included)
  added = 0
  for j in range(len(sums) - 1):
    _add_ancestors([noised[j].op], seen)
    producer = _producer(sums[j + 1])
    if (producer.graph is not graph or noised[j].op.graph is not graph or producer in seen
        or producer.type == "Placeholder"):
      continue
    producer._add_control_input(noised[j].op)  # pylint: disable=protected-access
    added += 1
  return added
