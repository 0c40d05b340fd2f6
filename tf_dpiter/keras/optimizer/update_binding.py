"""The update a custom loop applies is bound to the noised result its private step charged.

Rule: the ledger's epsilon holds for an update that is a function of a noised result it
charged (post-processing: Dwork and Roth, "The Algorithmic Foundations of Differential
Privacy", Proposition 2.1; the step is DP-SGD, Abadi et al., "Deep Learning with Differential
Privacy", Algorithm 1). `apply_private_gradients` therefore checks the VALUES it is given, not
only that a noised result was drawn since the last update (`PrivateStep.charged_gradients`'
count): one compute_private_gradients whose result is dropped, then a plain tape gradient,
passes the count and would apply an un-noised, unclipped update (review: w1 = w0 - lr g
exactly, epsilon 2.133 stated for it).

Traced (the usual custom loop), at the trace of `apply_private_gradients`: the applied
gradients must not depend on the step's data by a path that avoids the noise. A taint
analysis over the step's graph (`unbound_source`, data_writes' data flow): the sources are
the step's inputs (its arguments and captured tensors: the batch given to
compute_private_gradients and any other; a dataset's next element; a Python function's
result; a floating array constant, as a numpy batch the step closes over becomes), the
sanitizers the noised results `noised_average` returned in that graph. So post-processing
of the noised result (scaling, clip_by_global_norm, casts, a weight decay term of the
weights, tf.random.normal noise; scalar and integer constants, variables not written from
the data) is accepted, and plain tape gradients of a batch, or any mix of them, are refused.
Conservative refusals: a noised result passed into the step from outside (another
tf.function's output, an argument), a post-processing that uses a step argument or a
floating array constant (pass a public value as a Python number or a variable), the weights
read after an update in the same traced step (written from the data as the flow sees it).
Not seen: a dataset iterator read inside a nested function, data reaching the graph through
Python state other than the tensors and constants above.

Eager: the noised results drawn eagerly since the last update are kept (the tensors, until
the update; the latest 8), and each applied gradient must be one of them, or equal bit for bit (the digest
of `weight_fingerprints.digest`, dtype and shape). Post-processing is then refused: do it
inside a tf.function with the private step.

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
# constant ops (a floating array among them is taken as data: `_embedded_array`)
_CONSTANTS = frozenset(["Const", "HostConst"])
# the graph attribute holding {NoisedResults: refs of the noised results traced in it}
_GRAPH_ATTRIBUTE = "_tf_dpiter_noised_results"


def _flat(grads):
  return [t for g in grads if g is not None
          for t in tf.nest.flatten(g, expand_composites=True)]


class NoisedResults:
  """The noised results one PrivateStep returned, per graph (traced) or since the last
  update (eager), and the check `apply_private_gradients` makes (module docstring)."""

  def __init__(self):
    # lists of eager tensors drawn since the last update (read by PrivateStep.charged_gradients)
    self.eager = []

  def add(self, result):
    """Keeps `result` (a list of tensors) as a noised, charged result.

    Args:
      result: the noised averages `noised_average` returns.
    """
    tensors = [t for t in result if t is not None]
    if not tensors:
      return
    if tf.executing_eagerly():
      # the latest few only (memory: a loop that computes without applying holds no more)
      self.eager = self.eager[-(_EAGER_KEPT - 1):] + [tensors]
      return
    graph = tensors[0].graph
    # kept on the graph (its lifetime), per NoisedResults: another optimizer's noised result
    # is not this one's
    held = getattr(graph, _GRAPH_ATTRIBUTE, None)
    if held is None:
      held = weakref.WeakKeyDictionary()
      setattr(graph, _GRAPH_ATTRIBUTE, held)
    held.setdefault(self, set()).update(t.ref() for t in tensors)

  def used(self):
    """Forgets the eager results: an update used them (with any unused one, as the count)."""
    self.eager = []

  @tf.autograph.experimental.do_not_convert   # plain Python: no AutoGraph conversion
  def require_bound(self, grads, what="apply_private_gradients"):
    """Refuses `grads` unless each is a noised result or (traced) a function of one.

    Args:
      grads: the gradients about to be applied (None entries skipped).
      what: names the caller in the message.

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
    source = unbound_source(tensors, () if held is None else held.get(self, ()))
    if source is not None:
      raise PrivacyConfigError(
          f"{what} applies the noised result of optimizer.compute_private_gradients, or a "
          "function of it only (scaling, clipping, casts): this gradient depends on "
          f"{source} by a path that avoids the noise, e.g. plain tape gradients of the "
          "batch, or a noised result passed in from outside the traced step. Apply the list "
          "compute_private_gradients returned in the same tf.function (one step: compute, "
          "post-process, apply). Received: a gradient computed from "
          f"{source}")

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


def unbound_source(tensors, sanitizers):
  """The inputs `tensors` depend on by a path avoiding `sanitizers` (module docstring), as a
  short description, or None when there are none.

  The data flow is data_writes' (`_Flow`): forward from the sources (every Placeholder that
  is not a resource: the step's arguments and captured tensors; a dataset's next element; a
  Python function's result; a floating constant of more than one element: a numpy batch the
  step closes over), through data edges, the bodies of nested functions, branches
  and loops (a predicate that depends on the data taints what the branch returns), and the
  variables the graph writes from the data (their reads); the shapes of the sources count
  as data (a Poisson batch's size is private). The sanitizers' ops (all of whose outputs are
  noised results) are cut from their inputs.

  Args:
    tensors: graph tensors of one graph (the gradients to apply).
    sanitizers: refs (`tensor.ref()`) of the noised results of that graph.

  Returns:
    a description (str) of the sources reached, or None.
  """
  if all(t.ref() in sanitizers for t in tensors):
    return None   # the list compute_private_gradients returned (the usual loop): no walk
  graph = tensors[0].graph
  clean_ops = {ref.deref().op for ref in sanitizers}
  clean = {op.name for op in clean_ops if all(o.ref() in sanitizers for o in op.outputs)}
  graph_def = graph.as_graph_def()
  sources = []
  for node in graph_def.node:
    if node.name in clean:
      del node.input[:]   # a noised result: what it was computed from does not reach past it
    elif ((node.op == "Placeholder" and node.attr["dtype"].type != types_pb2.DT_RESOURCE)
          or node.op in _OPAQUE_SOURCES or _embedded_array(node)):
      sources.append(node.name)
  flow = data_writes._Flow(graph_def)  # pylint: disable=protected-access
  _, tainted, _ = flow.body(graph_def.node, sources, set(), False, sources)
  reached = sorted({t.op.name for t in tensors if t.op.name in tainted})
  if not reached:
    return None
  return (f"the step's inputs or captured tensors ({', '.join(repr(n) for n in sources[:4])}"
          f"{', ...' if len(sources) > 4 else ''}) through {', '.join(reached[:3])}")
