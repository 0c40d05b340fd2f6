"""Where a DP step runs, for the choice of its per-example clipping path (no model routing here).

oneDNN: on CPUs where TensorFlow runs oneDNN kernels, per-example gradients of
`EinsumDense`/`MultiHeadAttention` under `tf.vectorized_map` come out wrong or crash
(TensorFlow's bug), so `use_vectorized_map` sends such models to a sequential per-record loop.
XLA: `in_xla_context` lets the ghost-norm rules pick XLA-friendly forms. Grappler:
`step_call_options` leaves out, for the DP train function's calls only, what on a CPU costs
much Grappler time and does little on its graph. float16: the static
`loss_scale`. A bound on a batch the trace does not know: `examples_at_most` (the rules' memory
budget, fast_clipping/rules/budget.py, then builds no chunk loop a batch within it cannot run).
Used by `optimizer.routing` (which path a step takes) and by `fast_clipping` (which builds on
this module, not on the optimizer).
"""

import contextlib
import functools
import os
import threading

import keras
import tensorflow as tf

from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

from tf_dpiter.errors import DPiterError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.dp_query.summation import in_xla_context  # noqa: F401  (re-exported)


# Layers whose per-example gradients through tf.vectorized_map are wrong under oneDNN.
ONEDNN_AFFECTED = (keras.layers.EinsumDense, keras.layers.MultiHeadAttention)


@functools.lru_cache(maxsize=None)
def onednn_enabled():
  """True when TensorFlow's oneDNN CPU kernels are on (TF_ENABLE_ONEDNN_OPTS, or TF's default
  for this build and CPU); read once per process, as TensorFlow does."""
  flag = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return flag not in (None, "0", "false", "False")


class ListLoop(DPiterError):
  """The signal (raised inside a tf.vectorized_map body, caught by its caller) that the
  per-record computation runs a while loop over a TensorList, which pfor's conversion gets
  wrong at run time (TensorListPushBack of an incompatible shape): the records are looped
  over instead (tf.map_fn)."""


def loops_over_lists(first):
  """The names of the While operations with a TensorList input (keras.ops.scan's stacked
  outputs) created since the default graph's `version` was `first`."""
  created = tf.compat.v1.get_default_graph().get_operations()[first:]
  return tuple(op.name for op in created if op.type in ("While", "StatelessWhile") and
               any(t.dtype == tf.variant for t in op.inputs))


def refuse_list_loops_under_xla(loops):
  """Refuses per-example gradients through while loops over a TensorList (`loops`) under XLA,
  which cannot compile their gradient inside a loop over records.

  Raises:
    PrivacyConfigError: `loops` is not empty and the graph is compiled by XLA.
  """
  if loops and in_xla_context():
    raise PrivacyConfigError(
        f"per-example gradients through keras.ops.scan (the while loops {list(loops)} over a "
        "TensorList, in the layers their names begin with) cannot be formed under XLA: "
        "tf.vectorized_map converts them wrongly and XLA cannot compile their gradient inside "
        "a loop over records. Received: jit_compile=True. Compile the model with "
        "jit_compile=False (the records are then looped over), or replace the scan by "
        "keras.ops.fori_loop")


def model_layers(model):
  """The layers of `model` (nested ones too, not the model itself)."""
  return keras_internals.flatten_layers(model, include_self=False)


def onednn_affected_layers(model):
  """Names of the layers of `model` whose vectorized per-example gradients oneDNN breaks (empty
  when oneDNN is off or `model` is None)."""
  if model is None or not onednn_enabled():
    return ()
  return tuple(layer.name for layer in model_layers(model) if isinstance(layer, ONEDNN_AFFECTED))


def use_vectorized_map(model):
  """False if per-record gradients must come from a sequential loop: a Keras RNN layer with
  unroll=False (pfor cannot vectorize its while_loop) or oneDNN-affected layers."""
  return model is None or not (
      any(isinstance(layer, keras.layers.RNN) and not getattr(layer, "unroll", False)
          for layer in model_layers(model)) or onednn_affected_layers(model))


def loss_scale(model):
  """Static loss scale for float16 compute (2^7; 1 otherwise). Both paths divide the gradients
  by it, and a record whose gradient is not finite adds zero (a function of that record alone,
  so the sensitivity bound holds). Dynamic scaling would make the scale depend on the data."""
  dtype = keras.backend.standardize_dtype(getattr(model, "compute_dtype", "float32"))
  return 2.0 ** 7 if dtype == "float16" else 1.0


@functools.lru_cache(maxsize=None)
def _has_gpu():
  """True when the process sees a GPU (its logical devices are fixed once TF initialized)."""
  return bool(tf.config.list_logical_devices("GPU"))


def _step_config(serialized):
  """The ConfigProto `serialized` (bytes) with Grappler's memory optimizer off and one round
  of its passes, each where the configuration has TensorFlow's default (a user's choice is
  kept); None when neither is the default."""
  config = config_pb2.ConfigProto.FromString(serialized)
  rewrite = config.graph_options.rewrite_options
  options = rewriter_config_pb2.RewriterConfig
  changed = False
  if rewrite.memory_optimization == options.DEFAULT_MEM_OPT:
    rewrite.memory_optimization = options.NO_MEM_OPT
    changed = True
  if rewrite.meta_optimizer_iterations == options.DEFAULT_NUM_ITERS:
    rewrite.meta_optimizer_iterations = options.ONE
    changed = True
  return config if changed else None


def step_call_options(outer):
  """The function-call options for a call of the DP train function, given the thread's `outer`
  ones: on a machine without a GPU, Grappler without its memory optimizer and with one round
  of passes, each where the configuration has TensorFlow's default; None elsewhere. The
  process's configuration is not changed.

  Both are optimizations only (the step computes the same function up to rounding). On a CPU
  the memory optimizer only runs its scheduling pass, which on BERT-base's DP step took 1.3 of
  about 8 s of Grappler and changed neither the allocator peak nor the step; the second round
  took about 40 % of Grappler's time for 37 pruned and 83 merged of 7,847 nodes."""
  if _has_gpu():
    return None
  config = _step_config(outer.config_proto_serialized)
  return None if config is None else context.FunctionCallOptions(outer.executor_type, config)


# The innermost examples_at_most bound of this thread (a replica's trace runs in its thread).
_EXAMPLES_BOUND = threading.local()


@contextlib.contextmanager
def examples_at_most(n):
  """Within the block (a trace), every batch a rule of the clipped sum sees holds at most n
  examples, a public bound the caller enforces at run time (summation.within_public_rows);
  the memory budget's chunk choices are then made at trace time. n None: the enclosing bound
  stays.

  Raises:
    ParameterValueError: `n` is not None nor an int >= 0.
  """
  if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
    raise ParameterValueError(f"`n` must be None or an int >= 0. Received: n={n!r}")
  outer = getattr(_EXAMPLES_BOUND, "n", None)
  _EXAMPLES_BOUND.n = outer if n is None else (n if outer is None else min(n, outer))
  try:
    yield
  finally:
    _EXAMPLES_BOUND.n = outer


def examples_bound():
  """The innermost `examples_at_most` bound (an int), or None outside one."""
  return getattr(_EXAMPLES_BOUND, "n", None)


def num_workers(strategy):
  """The "chief" and "worker" tasks of `strategy`'s cluster spec (1 for one process)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None:
    return 1
  spec = resolver.cluster_spec().as_dict()
  return max(1, sum(len(spec.get(job, [])) for job in ("chief", "worker")))


def is_chief(strategy):
  """Whether this process is the chief (task "chief", or worker 0 without one; True for a
  single-process strategy)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or num_workers(strategy) == 1:
    return True
  spec = resolver.cluster_spec().as_dict()
  if "chief" in spec:
    return resolver.task_type == "chief"
  return resolver.task_type == "worker" and int(resolver.task_id) == 0


def broadcast_from_chief(strategy, value):
  """The chief's `value` (a tensor of one shape and dtype on every worker) on every worker:
  an all-reduce SUM to which only global replica 0 contributes. Cross-replica context."""
  value = tf.convert_to_tensor(value)

  def contribute():
    ctx = tf.distribute.get_replica_context()
    keep = tf.cast(tf.equal(ctx.replica_id_in_sync_group, 0), value.dtype)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value * keep)

  return strategy.experimental_local_results(strategy.run(contribute))[0]
