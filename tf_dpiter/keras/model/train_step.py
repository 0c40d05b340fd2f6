"""The private train step of the DP models (McMahan et al. 2018, Sections 2 and 7; Abadi et al. 2016).

One step: per-record gradients of the compiled loss clipped to S and summed (vectorized:
`step.clipped_sum`; fast: ghost norms, `fast_clipping.clipped_grad_sum`; chosen by
`step.resolve_clipping`), one noise draw and one ledger sample (`step.noised_average`), then
the optimizer's update. No record's value stops the step: an id an Embedding fed by an
input cannot gather, or a label outside a sparse cross-entropy's classes, makes that example
contribute zero (`total_records`). With `jit_compile=True` the clipped sum (and DP-SGD's own Gaussian
noise draw, `step.compiles_noise`, on one replica) is one XLA program; the ledger write and
the update run right after it in the non-compiled train function, so every step is
recorded. What the step reads of the model's structure and compile is read once per train
function (`_TraceFacts`); the clip, query, noise and sampling every step.
"""

import contextlib
import functools
import itertools
import time
import types
import weakref

import keras
import tensorflow as tf
from tensorflow.python.eager import context as tf_context

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import data_writes
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.fast_clipping import clipping as fast_clip
from tf_dpiter.keras.fast_clipping import plan as fast_plan
from tf_dpiter.keras.fast_clipping import registry as fast_registry
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import row_provenance
from tf_dpiter.keras.internals import runtime
from tf_dpiter.keras.internals import total_records
from tf_dpiter.keras.model import output_losses
from tf_dpiter.keras.optimizer import record_losses
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.optimizer import update_binding


class _TraceFacts:
  """What the step reads of a model's structure and compile, once per train function
  (rebuilt when an object of `_facts_key` changes); the data, clip, query, noise, sampling
  and the layers' `trainable` flags are read every step."""

  __slots__ = ("key", "optimizer", "batch_norms", "loss_unbuilt", "wants_outputs",
               "output_trackers", "loss_scale", "vectorize", "training_arg", "loss_tracker",
               "compute_loss", "plans", "seed_generators", "chunk_examples", "embedding_ids")

  def __init__(self, model, key):
    self.key = key
    self.optimizer = model._dp_optimizer()   # pylint: disable=protected-access
    layers = keras_internals.flatten_layers(model, include_self=False)
    self.batch_norms = [layer for layer in layers
                        if isinstance(layer, keras.layers.BatchNormalization)]
    self.loss_unbuilt = output_losses.needs_build(model)
    self.output_trackers = keras_internals.output_loss_trackers(model)
    self.wants_outputs = (keras_internals.compile_metrics(model) is not None
                          or bool(self.output_trackers)
                          or type(model).compute_metrics is not keras.Model.compute_metrics)
    self.loss_scale = routing.loss_scale(model)
    self.vectorize = routing.use_vectorized_map(model)
    self.training_arg = keras_internals.call_has_training_arg(model)
    self.loss_tracker = keras_internals.loss_tracker(model)
    self.compute_loss = keras_internals.compiled_loss_fn(model)
    self.plans = {}   # the fast-clipping plans of this train function (one_plan_per_step)
    self.seed_generators = keras_internals.seed_generators(model)   # keyed_layer_draws
    self.chunk_examples = {}   # `TrainStepMixin._dp_chunk_examples`
    self.embedding_ids = total_records.embedding_inputs(model)


def _facts_key(model):
  """The objects the trace facts of `model` follow from (compared by identity); a Sequential's
  functional graph too (Keras builds a new one when a layer is added or popped)."""
  return (getattr(model, "optimizer", None), getattr(model, "_compile_loss", None),
          getattr(model, "_compile_metrics", None), model.compute_dtype, model.built,
          getattr(model, "_functional", None))


# A first step (the batch-independence probe, tracing, graph optimization, first run) longer
# than this many seconds is reported in the fit log, with how long its phases took.
SLOW_FIRST_STEP_SECONDS = 10.0


def _first_step_line(model, seconds, probe_before=0.0, probe=0.0):
  """The fit log's line about a slow first step (None if not slow): `seconds` of its first
  call plus `probe_before` (the probe before it); `probe`, all this function's probe seconds."""
  total = seconds + probe_before
  if total <= SLOW_FIRST_STEP_SECONDS:
    return None
  traced = getattr(model, "_dp_trace_seconds", None)
  path = {"fast": "ghost norms", "vectorized": "vectorized per-example gradients"}.get(
      getattr(model, "_dp_traced_clipping", None), "per-example gradients")
  if traced is not None:   # the probes run in the trace are the probe's, not the trace's
    traced -= max(0.0, probe - probe_before)
  probed = f"batch-independence probe {probe:.1f} s, " if probe > 0.0 else ""
  parts = (f"{probed}tracing {traced:.1f} s, graph optimization or XLA compilation and first "
           f"run {total - probe - traced:.1f} s"
           if traced is not None and 0.0 <= traced and probe + traced <= total else
           f"{probed}tracing, graph optimization or XLA compilation and first run")
  return (f"tf_dpiter: the first private step took {total:.1f} s ({parts}) to build the "
          f"train step (clipped sum by {path}, noise, ledger write, update); later steps and "
          "later fit calls on this model reuse it")


def _probe_seconds(model):
  """Wall seconds the batch-independence probes of `model` took so far."""
  return getattr(model, batch_independence.PROBE_SECONDS_ATTR, 0.0)


def _flat_records(t):
  """[R, k, ...] -> [R * k, ...] (record-major examples)."""
  return None if t is None else _reshaped(t, [-1], t.shape[2:], lambda: tf.shape(t)[2:])


def _reshaped(t, lead, rest, rest_of):
  """t reshaped to `lead` then `rest`: a constant shape where the trace knows `rest` (no shape
  ops), else `rest_of()`'s (also for zero-element dims, where -1 is ambiguous)."""
  if rest.is_fully_defined() and rest.num_elements() > 0:
    return tf.reshape(t, list(lead) + rest.as_list())
  return tf.reshape(t, tf.concat([lead, rest_of()], 0))


# Stateful op types that only read state: an abandoned traced pass holding no other stateful
# op changes nothing when the function runs.
_READS_ONLY = frozenset({"ReadVariableOp", "VarHandleOp", "ResourceGather", "ResourceGatherNd",
                         "VariableShape", "VarIsInitializedOp", "Placeholder"})


class _RetraceStep(PrivacyConfigError):
  """Raised in a trace whose fast pass changed the route or the chunk size (kept): the train
  function is traced again, so the abandoned pass's state updates do not run."""

  batches = None   # the batches to give the new train function (`_call_retracing`)


def _abandon_fast_pass(model, graph, start):
  """After a traced fast pass whose route became "vectorized": inside the train function
  abandons the trace; outside it keeps tracing only if the pass changes no state.

  Args:
    model: the DP keras.Model being traced.
    graph: the traced graph, or None (eager: the pass checked its uses before any op).
    start: the graph's number of operations before the pass.

  Raises:
    _RetraceStep: inside the train function (it traces the step again).
    PrivacyConfigError: outside it, the abandoned pass holds a stateful operation.
  """
  if graph is None:
    return
  if getattr(model, "_dp_retrace", False):
    raise _RetraceStep("the DP step's route changed to clipping='vectorized' while it was "
                       "traced; the train function traces it again (caught by the train "
                       "function: report this error if you see it)")
  # pylint: disable-next=protected-access
  writes = sorted({op.type for op in graph.get_operations()[start:]
                   if op._is_stateful and op.type not in _READS_ONLY})
  if writes:
    raise PrivacyConfigError(
        "clipping='auto' found trainable variables used outside their layer's own call after "
        f"tracing the fast forward pass, whose stateful operations ({', '.join(writes)}: a "
        "counter, a moving statistic or a seed) would run besides the vectorized pass's in "
        "this graph. Received: a train step traced outside model.fit/train_on_batch. Use "
        "clipping='vectorized' for this model, or train it with fit / train_on_batch")


class _Replay:
  """A Python iterator of batches that can give its last batch again (`again`)."""

  def __init__(self, iterator):
    self._iterator = iter(iterator)
    self._last = ()

  def __iter__(self):
    return self

  def __next__(self):
    self._last = (next(self._iterator),)
    return self._last[0]

  def again(self):
    """The last batch taken (if any), then the batches not taken yet."""
    return itertools.chain(self._last, self._iterator)


def _call_retracing(model, train_function, iterator):
  """The logs of train_function(iterator); an abandoned trace raises _RetraceStep carrying the
  batches for a new train function (a tf.function whose trace raised may run nothing).

  Raises:
    _RetraceStep: the trace was abandoned (the caller builds a new train function).
  """
  replay = (None if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))
            else _Replay(iterator))
  model._dp_retrace = True   # pylint: disable=protected-access
  try:
    return train_function(iterator if replay is None else replay)
  except _RetraceStep as abandoned:
    abandoned.batches = iterator if replay is None else replay.again()
    raise
  finally:
    model._dp_retrace = False   # pylint: disable=protected-access


_STEP_WRITES = "the model's training-mode call or its loss in the private step"
# Traces of the train function that may be abandoned in a row (_RetraceStep): one for its
# chunk size, then one for its route; each keeps what it decided, so a third never is.
_RETRACES = 3


class _Eager:
  """The trace key of code run eagerly (`_trace`)."""
  name = "eager execution"


_EAGER = _Eager()


def _trace():
  """The graph being traced, or `_EAGER`: the key of the checks made once per trace."""
  return _EAGER if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class _Checked:
  """The graphs (held weakly) where a once-per-trace check passed. Eagerly nothing is kept:
  the user's Python may take another branch at every step, so each eager call is checked."""

  def __init__(self):
    self.graphs = weakref.WeakSet()

  def holds(self):
    trace = _trace()
    return trace is not _EAGER and trace in self.graphs

  def add(self):
    trace = _trace()
    if trace is not _EAGER:
      self.graphs.add(trace)


def _checked_in_this_trace(model, attr):
  """True when the check kept in `model.attr` (a `_Checked`) ran in the graph being traced:
  a retrace for a new input structure may take another branch, so each trace is checked."""
  done = getattr(model, attr, None)
  return done is not None and done.holds()


def _mark_checked_in_this_trace(model, attr):
  """Records in `model.attr` that its check passed in the graph being traced."""
  if getattr(model, attr, None) is None:
    object.__setattr__(model, attr, _Checked())
  getattr(model, attr).add()


def _replica():
  """The replica id (an int) of the current replica context, or None."""
  ctx = tf.distribute.get_replica_context()
  replica = tf.get_static_value(ctx.replica_id_in_sync_group) if ctx is not None else None
  return None if replica is None else int(replica)


def _within_row_bound(step, counts, nest):
  """`nest` (the ledger write's and update's tensors) after the step's records counts[1] are
  checked against the public row bound R of an add/remove step (chunking.public_row_bound),
  outside the XLA-compiled sum, which drops assertions. A batch past R (probability at most
  1e-18 per step, a Chernoff bound: policy_base.P_REFUSE) fails its step, neither charged
  nor applied, with an error naming R."""
  bound = chunking.public_row_bound(step)
  if bound is None:
    return nest
  within = counts[1] <= float(bound)
  # one Assert op, as summation.within_public_rows'
  check = tf.raw_ops.Assert(condition=within, data=[
      f"`rows` must be at most {bound}, the public bound of an add/remove step's plan "
      "(the public row bound R of the declared sampling). Received: rows =", counts[1]])
  with tf.control_dependencies([check]):
    return summation.after_row_check(tf.identity(within), nest)


def _refuse_second_step(model):
  """Refuses a second private step inside one call of a user's `train_step` (per replica):
  two noised sums of one sampled batch would be charged as two independent samples, where
  one subsample ran a mechanism of two Gaussians (optimistic epsilon).

  Raises:
    PrivacyConfigError: the step ran once already in this call of the override.
  """
  runs = model.__dict__.get("_dp_steps_in_override")
  replica = _replica()
  if runs is None or replica not in runs:
    return   # Keras' own call of the step: once per batch
  graph = _trace()
  if graph is not runs[replica][1]:
    name = type(model).__name__
    raise PrivacyConfigError(
        f"{name}'s train_step runs the private step inside a control-flow construct of its "
        "own (a tf.while_loop's body, a tf.cond's branch, a nested tf.function): a loop runs "
        "it several times on one sampled batch, which the ledger would charge as "
        "independently sampled steps, and a condition on the batch decides from the records "
        "whether a step runs. Call super().train_step(data) once, unconditionally, in the "
        f"override itself. Received: a private step traced in {graph.name!r}, not in the "
        "override's own graph")
  if runs[replica][0]:
    name = type(model).__name__
    raise PrivacyConfigError(
        f"{name}'s train_step runs the private step twice on one batch: each run noises a "
        "sum of the same sampled records, and the ledger would charge them as two "
        "independently sampled steps (an optimistic epsilon). Call super().train_step(data) "
        "once per batch; for more updates per batch use more epochs or steps "
        f"(steps_per_execution). Received: a second private step in one train step of {name}")
  runs[replica][0] = 1


def _checked_override(step_fn):
  """`step_fn(model, data)`, a user's train_step, made to check its own code first, once per
  train function (`TrainStepMixin._dp_check_override`), whether or not it calls the library's
  step; marked so that it is wrapped once."""
  @functools.wraps(step_fn)
  def train_step(self, data):
    if getattr(self, "_dp_override_probe", False):
      return step_fn(self, data)
    self._dp_check_override(data, step_fn)
    runs = self.__dict__.get("_dp_steps_in_override")
    if runs is None:
      runs = {}
      object.__setattr__(self, "_dp_steps_in_override", runs)
    replica = _replica()
    runs[replica] = [0, _trace()]   # steps run, and the graph (`_refuse_second_step`)
    try:
      return step_fn(self, data)
    finally:
      runs.pop(replica, None)

  train_step.dp_checked_override = True
  return train_step


class TrainStepMixin:
  """make_train_function / train_step of a DP model (see module docstring)."""

  def make_train_function(self, force=False):
    """keras.Model.make_train_function for the private step (with jit_compile only the
    clipped sum is compiled); it refuses to start a step after `halt_private_steps()`.

    Args:
      force: rebuild the function even when one exists.

    Returns:
      the train function.
    """
    if self.train_function is not None and not force:
      return self.train_function
    self._dp_facts = None   # a new train function: its trace reads the model afresh
    jit = bool(self.jit_compile) and not self.run_eagerly
    step = self._dp_optimizer().private_step
    probed_from = time.perf_counter()
    probe_start = _probe_seconds(self)
    # writes from the data refused before any probe runs the model (unless the fast pass
    # checks the call: _dp_pass_checks_call)
    passed = self._dp_pass_checks_call(in_train_function=True)
    self._dp_writes_checked = (self.built and not passed
                               and data_writes.refuse_model_writes(self))
    self._dp_step_writes_checked = False   # the step's backward pass: at its first trace
    self._dp_override_checked = self._dp_metrics_checked = None
    self._dp_wrap_override()
    if step.clipping != "vectorized" and self.built and not passed:
      # eagerly, cached, at the declared batch sizes (the trace finds them cached)
      batch_independence.probe_at_batch_size(self, None, step)
    probe_before = time.perf_counter() - probed_from
    self._dp_noise_inside = (jit and step.compiles_noise
                             and self.distribute_strategy.num_replicas_in_sync == 1)
    self._dp_core_xla = jit   # read by chunking.chunk_layout

    def keras_function():   # Keras' train function, new tf.functions (not traced yet)
      if jit:
        # autograph=False: no tensor-dependent Python control flow in the step
        self._dp_core_fn = tf.function(self._dp_clipped_sum_step, jit_compile=True,
                                       reduce_retracing=True, autograph=False)
        with keras_internals.jit_compile_off(self):   # outer function (noise, ledger, update)
          super(TrainStepMixin, self).make_train_function(force=True)
      else:
        self._dp_core_fn = self._dp_clipped_sum_step
        super(TrainStepMixin, self).make_train_function(force=True)
      return self.train_function

    inner = [keras_function()]
    first = [True]

    options = {}   # the thread's call options -> this function's (runtime.step_call_options)

    def run(iterator):
      ctx = tf_context.context()
      outer = ctx.function_call_options
      key = (outer.executor_type, outer.config_proto_serialized)
      if key not in options:
        options[key] = runtime.step_call_options(outer)
      ours = options[key]
      if ours is not None:
        ctx.function_call_options = ours
      try:
        for _ in range(_RETRACES):
          try:
            return _call_retracing(self, inner[0], iterator)
          except _RetraceStep as abandoned:   # a trace abandoned: new functions, what it
            inner[0] = keras_function()         # decided kept (a route, a chunk size)
            self.train_function = guarded
            iterator = abandoned.batches
        return inner[0](iterator)   # (no trace is abandoned outside _call_retracing)
      finally:
        # (options replaced within the call, by a configuration change, are kept)
        if ours is not None and ctx.function_call_options is ours:
          ctx.function_call_options = outer

    def guarded(iterator):
      # Set by StopAtPrivacyBudget: no step may start past the privacy budget.
      if self.private_steps_halted:
        raise StopIteration
      if not first[0]:
        return run(iterator)
      start = time.perf_counter()
      logs = run(iterator)
      first[0] = False
      line = _first_step_line(self, time.perf_counter() - start, probe_before,
                              _probe_seconds(self) - probe_start)
      if line is not None and getattr(self, "_dp_fit_verbose", 0) not in (0, None):
        print(line)   # the fit log (as the sampling line)
      return logs

    self.train_function = guarded
    return self.train_function

  def halt_private_steps(self, halted=True):
    """Makes the train function refuse every further step (it raises StopIteration, so fit
    ends), or allow them again (halted=False); used by `callbacks.StopAtPrivacyBudget`.

    Args:
      halted: bool.
    """
    self._dp_halt = bool(halted)

  @property
  def private_steps_halted(self):
    """True after `halt_private_steps()`: no private step may start."""
    return bool(getattr(self, "_dp_halt", False))

  def _dp_trace_facts(self):
    """The model's `_TraceFacts` (rebuilt when `_facts_key` changed); None while a layer is
    unbuilt."""
    facts = getattr(self, "_dp_facts", None)
    key = _facts_key(self)
    if facts is not None and facts.key == key:   # tuple ==: `is` first, element by element
      return facts
    if not all(layer.built for layer in keras_internals.flatten_layers(self)):
      return None
    if facts is not None:   # the model changed under this train function (a Sequential's
      # pop/add, eagerly): the writes from the data are checked again on the new model
      self._dp_writes_checked = self._dp_step_writes_checked = False
    self._dp_facts = _TraceFacts(self, key)
    return self._dp_facts

  def _dp_built_facts(self, x):
    """The trace facts; a model with an unbuilt layer is first built by a forward pass on `x`.

    Raises:
      PrivacyConfigError: a layer that pass does not build (a later call building it would
        not be seen: the facts are read once per train function).
    """
    facts = self._dp_trace_facts()
    if facts is None:
      _ = self(x, training=True) if keras_internals.call_has_training_arg(self) else self(x)
      facts = self._dp_trace_facts()
    if facts is None:
      unbuilt = [layer.name for layer in keras_internals.flatten_layers(self)
                 if not layer.built]
      raise PrivacyConfigError(
          f"every layer of `model` must be built before its private step: the step reads "
          "the model's layers once per train function, and the training call on the batch "
          f"did not build {unbuilt} (a layer the call does not reach, e.g. one used only "
          "under a Python flag or in inference). Build each (`layer.build(input_shape)`, or "
          "call it once on an example) before fit, or remove it from the model. Received: "
          f"unbuilt layers {unbuilt} of {type(self).__name__}")
    # once per train function (unless the fast pass checks the call: _dp_pass_checks_call)
    if not getattr(self, "_dp_writes_checked", False) and not self._dp_pass_checks_call():
      self._dp_writes_checked = data_writes.refuse_model_writes(self, x)
    return facts

  def _dp_pass_checks_call(self, in_train_function=None):
    """True when the model's training-mode call is checked by the step's own fast pass (its
    writes and reads, before the first execution) rather than by a trace of its own: when no
    probe runs the model on real rows before that pass (no rows kept by fit, or the step
    traced by the train function, which probes after its pass) and the step is traced on one
    replica outside a strategy. `in_train_function`: None reads `_dp_retrace`.
    """
    if in_train_function is None:
      in_train_function = getattr(self, "_dp_retrace", False)
    return (not self.run_eagerly
            and (in_train_function
                 or getattr(self, batch_independence.PROBE_ROWS_ATTR, None) is None)
            and not tf.distribute.has_strategy()
            and self.distribute_strategy.num_replicas_in_sync == 1)

  def _dp_clipped_sum_step(self, x, y, sample_weight, params, global_state=None,
                           outputs=True):
    """Per-record gradients, clipped and summed: (sample_state, loss sum, [records of positive
    weight, records formed], y_pred); with global_state, the noise is drawn here and the
    noised average replaces the sample state. `params`: the query's sample params, read by
    the caller (an XLA step reads no query variable); outputs=False: y_pred None."""
    facts = self._dp_built_facts(x)
    step = facts.optimizer.private_step
    b_static = grads_lib.static_batch_size(x)
    b = grads_lib.dynamic_batch_size(x)
    m = step.record_microbatches   # None: one example per record (also M == batch size)
    if not getattr(self, "_dp_in_fit", False):
      grads_lib.check_num_microbatches(m, b_static)
    example_mask = grads_lib.example_mask_from_weights(sample_weight, b)
    if facts.embedding_ids:   # an id outside the vocabulary contributes zero (total_records)
      x, ids_ok = total_records.guard_embedding_ids(self, x, facts.embedding_ids)
      if ids_ok is not None:
        example_mask = example_mask * ids_ok
    variables = self.trainable_variables
    per_user = getattr(self, "_dp_examples_per_user", None)
    if per_user is not None:   # user-level batches: a record is one user's k rows
      recs, em, rmask = grads_lib.consecutive_records((x, y, sample_weight), example_mask,
                                                      per_user)
      k, m = per_user, None
    else:
      recs, em, rmask = grads_lib.to_records((x, y, sample_weight), example_mask, m)
      k = grads_lib.examples_per_record(m, b_static, em)
    # the layers planned once per train function; clipping="vectorized": no routing
    routes = step.flags.clipping != "vectorized"
    with (fast_plan.one_plan_per_step(facts.plans) if routes else contextlib.nullcontext()):
      # records of positive weight (the loss metric's), records formed (the denominator's)
      counts = tf.stack([tf.reduce_sum(rmask), tf.cast(tf.size(rmask), tf.float32)])
      # the sum formed already divided by the denominator (PrivateStep.folds_denominator)
      scale = step.sum_scale(counts[1]) if step.folds_denominator else None
      expected = step.expected_records   # the fast sum's chunk size follows from it
      graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
      # in the train function the probe runs after the fast pass checked the call
      probe_later = routes and graph is not None and getattr(self, "_dp_retrace", False)
      self._dp_traced_clipping = step.resolve_clipping(self, input_specs=x,
                                                       checked_by_the_step=routes,
                                                       probe=not probe_later)
      if self._dp_traced_clipping == "fast":
        start = 0 if graph is None else len(graph.get_operations())
        try:
          state, loss_sum, records_out = self._dp_fast_sum(step, facts, recs, em, rmask, k,
                                                           variables, params, scale, expected)
        except fast_clip.UnrecordedUsesError as found:   # raised before any sum is formed
          self._dp_traced_clipping = step.route_unrecorded(self, x, found.uses)
          _abandon_fast_pass(self, graph, start)
        except fast_clip.ChunkedPassNeeded as found:   # likewise, in the train function only
          raise _RetraceStep("the DP step's physical chunks were measured while it was "
                             "traced; the train function traces it again in chunks (caught "
                             "by the train function: report this error if you see it)"
                             ) from found   # the chunk size is kept in the facts
        if probe_later and self._dp_traced_clipping == "fast":
          self._dp_traced_clipping = step.route_probed(self, x)
          if self._dp_traced_clipping == "vectorized":
            _abandon_fast_pass(self, graph, start)
      if self._dp_traced_clipping == "vectorized":
        if not getattr(self, "_dp_writes_checked", False):   # no separate trace yet
          self._dp_writes_checked = data_writes.refuse_model_writes(self, x)
        if probe_later:   # the call checked: the probe's warning about a layer that sees a
          batch_independence.probe_at_batch_size(self, x, step)   # batch of one example
        state, loss_sum, records_out = self._dp_vectorized_sum(step, facts, recs, em, rmask,
                                                               k, variables, params, scale)
    if not outputs:
      y_pred = None
    elif records_out is None:
      y_pred = self(x, training=False) if facts.training_arg else self(x)
    else:
      y_pred = tf.nest.map_structure(lambda t: grads_lib.from_records(t, b, m), records_out)
    if global_state is not None:
      state = step.compiled_noised_average(state, counts[1], global_state,
                                           scaled=step.folds_denominator)
    return state, loss_sum, counts, y_pred

  def _dp_vectorized_sum(self, step, facts, recs, em, rmask, k, variables, params,
                         sum_scale):
    """Clipped sum by the step's vectorized path: (state, loss sum, outputs [M, k, ...])."""
    n_rep = tf.distribute.get_strategy().num_replicas_in_sync
    scale = facts.loss_scale
    # one record's backward pass (a custom gradient's writes), traced once per train function
    if not getattr(self, "_dp_step_writes_checked", False):
      data_writes.refuse_step_writes(self, *[
          tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), part)
          if part is not None else None for part in recs])
      self._dp_step_writes_checked = True

    def record_loss(rec):
      (xr, yr, wr), emr = rec
      w = grads_lib.record_weights(emr, wr)
      y_pred = self(xr, training=True) if facts.training_arg else self(xr)
      with total_records.sparse_labels_guarded(self, yr, y_pred, w):
        loss = facts.compute_loss(x=xr, y=yr, y_pred=y_pred, sample_weight=w, training=True)
      # the writes of this very pass (its Python state, its static shapes), before any run
      if not tf.executing_eagerly():   # eagerly there is no trace to read
        data_writes.refuse_traced_writes(rec, _STEP_WRITES)
      return tf.cast(loss, tf.float32) * (float(n_rep) * scale), y_pred

    return step.clipped_sum(record_loss, variables, (recs, em), rmask, k,
                           vectorize=facts.vectorize, loss_scale=scale, params=params,
                           sum_scale=sum_scale, xla=getattr(self, "_dp_core_xla", None))

  def _dp_fast_sum(self, step, facts, recs, em, rmask, k, variables, params, sum_scale,
                   expected):
    """Clipped sum by fast_clipping (ghost norms): (state, loss sum, outputs [M, k, ...]), in
    physical chunks of whole records whose clipped sums add up. `expected`: the step's
    expected records variable."""
    n_rep = float(tf.distribute.get_strategy().num_replicas_in_sync)

    scaled = facts.loss_scale != 1.0   # fast_clipping applies the scale itself
    # norms -> clip factors of this sample, by the query's own rule
    clip_factors_fn = functools.partial(step.base_query.record_clip_factors, params)
    if sum_scale is not None:   # the sum comes out divided: a [R] multiply, not a weight pass
      factors_of = clip_factors_fn
      clip_factors_fn = lambda norms: factors_of(norms) * sum_scale  # noqa: E731

    def chunk_fn(acc, chunk, chunk_rmask):
      c_recs, c_em = chunk
      xc, yc, _ = tf.nest.map_structure(_flat_records, c_recs)
      mask = _flat_records(c_em)
      per_record = tf.TensorShape(c_em.shape)[1]   # k, where the trace knows it
      # an add/remove step's public row bound (chunking.public_rows): no chunk loop traced
      # that a batch within it cannot run (runtime.examples_at_most)
      bound = rows_bound * k if rows_bound is not None and isinstance(k, int) else None
      weights = grads_lib.record_weights(c_em, c_recs[2])

      def grouped(a):  # [R * k, ...] -> [R, k, ...]
        if per_record:   # R = -1 beside the static k (k >= 1)
          return _reshaped(a, [-1, per_record], a.shape[1:], lambda: tf.shape(a)[1:])
        return tf.reshape(a, tf.concat([tf.shape(c_em), tf.shape(a)[1:]], 0))

      def regroup(t):  # grouped, the Keras mask too
        out = grouped(t)
        t_mask = keras_internals.keras_mask(t)
        if t_mask is not None:
          keras_internals.set_keras_mask(out, grouped(t_mask))
        return out

      def per_example_loss_fn(y_true, y_pred):
        # every example of a record carries the record's loss: their masked mean is it
        losses = record_losses.compiled_record_losses(
            self, tf.nest.map_structure(grouped, y_true), tf.nest.map_structure(regroup, y_pred),
            weights)
        if isinstance(k, int) and k == 1:   # no tf.repeat: its shape ops run at every step
          return losses * n_rep
        return tf.repeat(losses * n_rep, k)

      # the ops of the pass's call of the model, when no trace of its own checked the call
      calls = None if getattr(self, "_dp_writes_checked", False) else []
      object.__setattr__(self, fast_clip.CALL_OPS_ATTR, calls)
      object.__setattr__(self, fast_clip.CHUNK_CHECK_ATTR,
                         None if pending is None else pending[1])
      try:
        with runtime.examples_at_most(bound):
          grads, norms, outputs, losses = fast_clipping.clipped_grad_sum(
              self, xc, yc, per_example_loss_fn, mask=mask, examples_per_record=k,
              return_outputs=True, clip_factors_fn=clip_factors_fn, physical_chunks=False,
              loss_scale=facts.loss_scale)   # the loss reads the batch's weights; chunked here
      finally:
        object.__setattr__(self, fast_clip.CALL_OPS_ATTR, None)
        object.__setattr__(self, fast_clip.CHUNK_CHECK_ATTR, None)
      # the writes of this very pass and the variables its call reads, before any run
      if not tf.executing_eagerly():   # eagerly there is no trace to read
        data_writes.refuse_traced_writes(chunk, _STEP_WRITES,
                                         call_of=(self, calls) if calls else None)
        if calls is not None and not calls:   # no traced call seen: the call's own trace
          self._dp_writes_checked = data_writes.refuse_model_writes(self, xc)
      losses = tf.reshape(tf.cast(losses, tf.float32), tf.shape(c_em))
      rec_loss = grads_lib.masked_record_mean(losses, c_em)
      # a record whose norm is not finite (float16 overflow) added nothing: count it
      with tf.control_dependencies(step.count_overflowed(
          tf.math.is_finite(norms) if scaled else None, chunk_rmask)):
        # one Identity per variable: private_step.gate_sums_on_noise gates each producer
        grads = [tf.identity(g) for g in grads]
      grads = [tf.cast(g, t.dtype) for g, t in zip(grads, template)]
      if acc is not None:   # a later chunk: added into the first chunk's sums
        grads = [a + g for a, g in zip(acc, grads)]
      return grads, tf.reduce_sum(rec_loss), tf.nest.map_structure(regroup, outputs)

    template = chunking.wide_template(variables)
    m_static = tf.TensorShape(rmask.shape)[0]
    xla = getattr(self, "_dp_core_xla", None)   # None: chunking asks the graph
    per_chunk = chunking.chunk_layout(step, k, m_static, xla=xla)
    pending = None   # (key, ChunkCheck) of a chunk size the pass itself measures
    public = None   # examples per chunk of the clip shrink's public plan (add/remove)
    if per_chunk is None and step.flags.max_physical_batch_size is None and isinstance(k, int):
      # chunks within the memory budget (fast_clipping.physical_chunk_examples); under
      # add/remove decided without the batch's own rows (one plan on D and D')
      by_size = chunking.public_row_bound(step) is None
      m_ex, public, pending = self._dp_chunk_examples(expected, facts, recs[0], k, xla,
                                                      by_size)
      per_chunk = None if m_ex is None else m_ex // k
    if per_chunk is not None and step.draws_keyed:
      step.refuse_grouped_draws(per_chunk, keras_internals.batch_shared_draws(self))
    # the first chunk's sums are the accumulator; add/remove: the public plan's clip shrink
    public = (per_chunk if isinstance(per_chunk, int) else
              None if public is None else public // k)
    try:
      with chunking.public_rows(step, k, chunk=public, xla=xla) as rows_bound:
        grad_sum, loss_sum, outputs = chunking.sum_over_chunks(
            chunk_fn, None, (recs, em), rmask, per_chunk, template=template)
    except fast_clip.ChunkedPassNeeded as found:   # kept for the step's next trace
      facts.chunk_examples[pending[0]] = (found.examples, found.public)
      raise
    if pending is not None:   # the pass kept within the budget in one call, in its plan
      facts.chunk_examples[pending[0]] = (None, pending[1].planned)
    if outputs is not None:
      outputs = tf.nest.map_structure(lambda t: t[:tf.shape(rmask)[0]], outputs)
    state = step.base_query.sample_state_of_sum(template, grad_sum)
    return state, loss_sum, outputs

  def _dp_chunk_examples(self, expected_records, facts, inputs, k, xla, by_size=True):
    """(m, public m, None): m = fast_clipping.clipping.physical_chunk_examples of the records'
    inputs at this replica's expected examples, the public m the same without the batch's
    own size (`by_size` False: add/remove), kept in the trace facts by what they follow
    from. Not kept yet and traced by the train function: (None, None, (key, ChunkCheck)),
    the answer left to the step's own pass."""
    with tf.init_scope():   # read when the step is traced: it sets a shape, not a value
      expected = float(expected_records.numpy()) * k
    expected /= tf.distribute.get_strategy().num_replicas_in_sync   # this replica's share
    inputs = tf.nest.map_structure(_flat_records, inputs)
    key = (tuple((tuple(t.shape), t.dtype) for t in tf.nest.flatten(inputs)), k, expected,
           xla, tuple(id(v) for v in self.trainable_variables), fast_registry.RULES_VERSION,
           by_size)
    if xla is not None and key in facts.chunk_examples:   # None: the graph decides XLA
      return (*facts.chunk_examples[key], None)
    if (xla is not None and not tf.executing_eagerly() and getattr(self, "_dp_retrace", False)
        and self._dp_pass_checks_call()):
      return None, None, (key, fast_clip.ChunkCheck(expected, by_size=by_size))
    public = fast_clip.physical_chunk_examples(self, inputs, k, expected, by_size)
    static_b = tf.nest.flatten(inputs)[0].shape[0]
    found = (public, public) if by_size else (
        None if public is None or (static_b is not None and static_b <= public) else public,
        public)
    facts.chunk_examples[key] = found
    return (*found, None)

  def _dp_metrics(self, x, y, y_pred, sample_weight):
    """The metrics' logs after this batch, weighted by the example mask under sample weights
    (Keras' values on the real examples); an override of `compute_metrics` is called."""
    if sample_weight is None or type(self).compute_metrics is not keras.Model.compute_metrics:
      return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    mask = grads_lib.example_mask_from_weights(sample_weight, grads_lib.dynamic_batch_size(x))
    keras_internals.update_compiled_metrics(self, y, y_pred, sample_weight, mask)
    return self.get_metrics_result()

  def _dp_wrap_override(self):
    """Wraps a user's train_step (on the class, or an instance attribute on the instance) by
    `_checked_override`; library steps are not wrapped."""
    own = self.__dict__.get("train_step")
    if own is not None:   # model.train_step = ..., a bound method or a function of the batch
      if getattr(own, "dp_checked_override", False):
        return
      if getattr(own, "__self__", None) is self:
        fn = own.__func__
      else:
        def fn(model, data):   # pylint: disable=unused-argument
          return own(data)
      if getattr(fn, "dp_checked_override", False):
        return
      object.__setattr__(self, "train_step", types.MethodType(_checked_override(fn), self))
      return
    fn = type(self).train_step
    if (fn is TrainStepMixin.train_step or getattr(fn, "dp_checked_override", False)
        or getattr(fn, "__module__", "").startswith("tf_dpiter.")):
      return
    type(self).train_step = _checked_override(fn)

  @tf.autograph.experimental.do_not_convert   # plain Python, run once per train function
  def _dp_check_override(self, data, step_fn):
    """Once per train function, a user's `train_step(model, batch)` traced alone (this step
    replaced by `_dp_metrics_from`) may write no variable but the metrics' from the batch
    (data_writes.refuse_override_writes), and the rows it hands this step must each be a
    function of one record (row_provenance), walked once its trace is whole."""
    if _checked_in_this_trace(self, "_dp_override_checked"):
      return
    metrics = keras_internals.compile_metrics(self)
    if metrics is not None and not metrics.built:   # the stand-in reads them: build them
      keras_internals.symbolic_build(self, data)   # from the batch's shapes, as Keras does

    what = f"the train_step override of {type(self).__name__}"
    handed = []   # the batches the override hands this step (`_dp_metrics_from`)

    def override_alone(batch):
      self._dp_override_probe = True
      object.__setattr__(self, "_dp_override_rows", handed)
      try:
        return step_fn(self, batch)
      finally:
        self._dp_override_probe = False

    def walk_rows():   # once the override's trace is whole: its writes after the step too
      for rows in handed:
        row_provenance.refuse_row_mixing(
            rows, what, public=list(self.variables) + list(self.optimizer.variables),
            private_size=self._dp_optimizer().private_step.private_batch_size,
            exempt_writes=self.metrics_variables)

    try:
      data_writes.refuse_override_writes(override_alone, data, self.metrics_variables, what,
                                         clean=update_binding.noised_ops, traced=walk_rows)
    finally:
      handed.clear()   # the probe's graph is not kept alive by the model
    _mark_checked_in_this_trace(self, "_dp_override_checked")

  @tf.autograph.experimental.do_not_convert   # plain Python, run once per train function
  def _dp_check_metrics_override(self, x, y, y_pred, sample_weight):
    """Once per train function, an override of `compute_metrics` traced alone may write no
    variable but the metrics' from the batch (data_writes.refuse_override_writes)."""
    if (type(self).compute_metrics is keras.Model.compute_metrics
        or _checked_in_this_trace(self, "_dp_metrics_checked")):
      return
    data_writes.refuse_override_writes(
        lambda b: self.compute_metrics(b[0], b[1], b[2], sample_weight=b[3]),
        (x, y, y_pred, sample_weight), self.metrics_variables,
        f"the compute_metrics override of {type(self).__name__}")
    _mark_checked_in_this_trace(self, "_dp_metrics_checked")

  def _dp_metrics_from(self, data):
    """The library's step as `_dp_check_override` traces it: keeps the batch handed (walked by
    row_provenance) and writes every metric variable from it, as the step's logs do."""
    self._dp_override_rows.append(data)
    parts = [tf.reduce_sum(tf.cast(tf.strings.length(t) if t.dtype == tf.string else t,
                                   tf.float32))
             for t in tf.nest.flatten(data, expand_composites=True)
             if tf.is_tensor(t) and t.dtype != tf.resource and t.dtype != tf.variant]
    touched = tf.add_n(parts) if parts else tf.constant(0.0)
    for v in self.metrics_variables:
      v.assign(tf.cast(tf.fill(tf.shape(v), touched), v.dtype))
    return self.get_metrics_result()

  @tf.autograph.experimental.do_not_convert   # no tensor-dependent Python control flow
  def train_step(self, data):
    """keras.Model.train_step, private: clipped sum, one noise draw and ledger sample,
    update (module docstring).

    Args:
      data: one batch as Keras hands it: x, (x, y) or (x, y, sample_weight).

    Returns:
      the metrics' logs.
    """
    if getattr(self, "_dp_override_probe", False):   # an override's own code, checked alone
      return self._dp_metrics_from(data)
    _refuse_second_step(self)
    traced_from = time.perf_counter()   # runs when the step is traced
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    facts = self._dp_built_facts(x)
    if facts.loss_unbuilt:   # build its per-output trackers (on gatherable ids)
      output_losses.build(self, (total_records.guard_embedding_ids(self, x)[0], y,
                                 sample_weight))
      self._dp_facts = None
      facts = self._dp_trace_facts()
    opt = facts.optimizer
    step = opt.private_step
    if tf.executing_eagerly() and step.flags.clipping != "vectorized":
      # eagerly no traced pass can be read and the user's Python may branch at every step:
      # each eager step's call is checked before it runs
      self._dp_writes_checked = data_writes.refuse_model_writes(self, x)
    if any(layer.trainable for layer in facts.batch_norms):   # read every step
      batch_independence.check_no_batch_mixing(self)
    core = getattr(self, "_dp_core_fn", None) or self._dp_clipped_sum_step
    # the library's own step needs no update binding (an override's apply is bound)
    opt._dp_own_step = True   # pylint: disable=protected-access
    try:
      # no per-output tracker update inside the clipped sum; random layers keyed
      silenced = (output_losses.silenced(self, facts.output_trackers) if facts.output_trackers
                  else contextlib.nullcontext())
      keyed = (step.keyed_layer_draws(facts.seed_generators) if facts.seed_generators
               else contextlib.nullcontext())
      with silenced, keyed:
        want = facts.wants_outputs
        # the ledger write waits for the clipped sum: a failed batch is neither applied
        # nor charged
        if getattr(self, "_dp_noise_inside", False):
          (grads, events), loss_sum, counts, y_pred = core(
              x, y, sample_weight, step.sample_params(), step.global_state(), outputs=want)
          if getattr(self, "_dp_core_xla", False):   # the XLA core's row check: here
            grads, events = _within_row_bound(step, counts, (grads, events))
          grads = step.record_compiled_sample(grads, events)   # the ledger append, outside XLA
        else:
          state, loss_sum, counts, y_pred = core(x, y, sample_weight, step.sample_params(),
                                                 outputs=want)
          if getattr(self, "_dp_core_xla", False):   # the XLA core's row check: here
            state = _within_row_bound(step, counts, state)
          grads = step.noised_average(state, counts[1], scaled=step.folds_denominator)
      opt.apply_private_gradients(grads, self.trainable_variables)
    finally:
      opt._dp_own_step = False   # pylint: disable=protected-access
    facts.loss_tracker.update_state(loss_sum / tf.maximum(counts[0], 1.0),
                                    sample_weight=counts[0])
    if facts.output_trackers:   # per-output epoch means
      with total_records.sparse_labels_guarded(self, y, y_pred, sample_weight):
        output_losses.update(self, facts.output_trackers, y, y_pred, sample_weight)
    logs = self._dp_metrics(x, y, y_pred, sample_weight)
    self._dp_check_metrics_override(x, y, y_pred, sample_weight)
    if facts.loss_scale != 1.0:
      logs = dict(logs)
      logs["dp_overflowed_records"] = step.overflow_counter
    self._dp_trace_seconds = time.perf_counter() - traced_from
    return logs
