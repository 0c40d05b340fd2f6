"""Private gradients in custom training loops (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 7).

`compute_private_gradients(step, ...)` is the noised average of clipped per-record gradients
of a `private_step.PrivateStep` (`optimizer.compute_private_gradients`, and `minimize` on
it), through the step's clipping, noise and ledger: a custom loop writes the same ledger
samples as `fit`. Declare the sampling first (`optimizer.set_sampling`); apply the result
with `optimizer.apply_private_gradients`.

The ledger records the sensitivity C of one record's clipped gradient (add/remove one
example, or one microbatch), which bounds the pre-noise sum only if record i's loss depends
on record i alone. Hence `fit`'s protections, on every form:
* oneDNN: without `model=`, a oneDNN build takes the sequential per-record loop (exact for
  every layer; oneDNN breaks the vectorized gradients of EinsumDense/MultiHeadAttention);
* batch independence: the `data` form runs each record alone (exact by construction). The
  vector-of-losses form (`data=None`, the tape form, `minimize`) needs `model=`: a trainable
  BatchNormalization, a layer not known to act per example (per_example) and a layer the
  probe sees mixing examples (batch_independence.probe_model) are refused, as is a model
  that cannot be probed. The loss must still compute loss i from example i's outputs only;
* float16: each record's loss is multiplied by a static loss scale and its gradient divided
  by it; a record that overflowed adds zero and is counted (`optimizer.overflowed_records`).
* total steps: no record's value stops a step (whether the run goes on would otherwise be a
  release outside the guarantee). A non-finite record (or float16 overflow) is clipped to
  zero in the data= form; in the loss_fn() form a non-finite batch is run again record by
  record (`_total_record_gradients`). Only the tape form (losses given as a tensor) still
  refuses such a step (`_finite_batch`): validate its data before the loop.
"""

import functools
import logging
import warnings
import weakref

import numpy as np

import keras
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import data_writes
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import per_example
from tf_dpiter.keras.internals import row_provenance
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.optimizer import saved_ledger
from tf_dpiter.ledger import policies as ledger_policies


_LOG = logging.getLogger("tf_dpiter")


def _loss_scale(model):
  return routing.loss_scale(model if model is not None else keras.config.dtype_policy())


def vectorize_records(model):
  """Whether per-record gradients may be vectorized: routing.use_vectorized_map(model); without
  a model, False on a oneDNN build (an affected layer may be behind the variables, and the
  sequential loop is exact for every layer), else True."""
  if model is not None:
    return routing.use_vectorized_map(model)
  if routing.onednn_enabled():
    if not getattr(vectorize_records, "_told", False):
      vectorize_records._told = True   # once per process
      _LOG.warning(
          "tf_dpiter: compute_private_gradients without model= on a oneDNN build: per-record "
          "gradients come from a sequential loop (exact for every layer; oneDNN breaks the "
          "vectorized gradients of EinsumDense/MultiHeadAttention). Pass model=... to let "
          "models without such layers vectorize.")
    return False
  return True


# the private steps already warned of a static private batch size
_WARNED_STATIC = weakref.WeakSet()


def _warn_static_private_size(step, b_static, mask):
  """Warns (a FutureWarning, once per optimizer) when a traced custom-loop step has a static
  batch size under a policy whose batch size is private, without a mask of padding rows: a
  Python number computed from the traced size (`x.shape[0]`) reaches the update where no
  check sees it. Such steps will be refused."""
  sampling = step.sampling
  if (b_static is None or mask is not None or sampling is None or tf.executing_eagerly()
      or not ledger_policies.get(sampling.policy).expected_size_denominator
      or step in _WARNED_STATIC):
    return
  _WARNED_STATIC.add(step)
  warnings.warn(
      f"compute_private_gradients is traced with a static batch size ({b_static} rows) under "
      f"{sampling.policy!r} sampling, whose batch size is private: a Python number computed "
      "from it (x.shape[0], len(x)) would reach the update unseen. Such steps will be refused "
      "in a future release. Trace the step with an unknown batch size (tf.function("
      "input_signature=[tf.TensorSpec([None, ...]), ...])), or feed padded batches of a public "
      "size with mask=.", FutureWarning, stacklevel=4)


def _declared_rows_check(step, b):
  """1.0, or NaN behind a failed run-time assertion, when a sized policy's batch (fixed size,
  shuffled passes) has more than the declared sample_size rows (the ledger charges
  q = m / n); a static row count is checked at trace time; None for other policies
  (Poisson's size is private).

  Raises:
    ParameterValueError: a static row count above the declared sample_size.
  """
  sampling = step.sampling
  if sampling is None or not ledger_policies.get(sampling.policy).sized:
    return None
  with tf.init_scope():
    declared = int(sampling.sample_size.numpy())
  static = tf.get_static_value(b)
  if static is not None and int(static) > declared:
    raise ParameterValueError(
        f"the batch must have at most sample_size={declared} rows, as set_sampling declared "
        f"for {sampling.policy!r} sampling (the ledger charges q = {declared} / n per step). "
        f"Declare the batch size the loop feeds. Received: {int(static)} rows")
  return grads_lib.one_or_nan(tf.cast(b, tf.float64) <= tf.cast(sampling.sample_size, tf.float64), [
      "compute_private_gradients: the batch has more rows than the sample_size set_sampling "
      "declared:", b])


def _random_layers(model, loss_fn):
  """The keras.random.SeedGenerators of `model` and of the layers `loss_fn` reaches outside it
  (`keras_internals.closure_layers`), each once."""
  generators = [] if model is None else keras_internals.seed_generators(model)
  for layer in keras_internals.closure_layers(loss_fn):
    generators += [g for g in keras_internals.seed_generators(layer)
                   if all(g is not h for h in generators)]
  return generators


def _keyed_calls(step, generators, loss_fn):
  """`loss_fn` whose every call draws its random layers from fresh secret keys
  (PrivateStep.keyed_layer_draws)."""
  def keyed():
    with step.keyed_layer_draws(generators):
      return loss_fn()
  return keyed


def _refuse_unkeyed_draws(step, model):
  """Refuses form (b) with a tape under a private batch size (Poisson-type sampling) when
  `model` has random layers: its losses were computed before the call, from the layers'
  own SeedGenerator states, so each row's draws follow its position in the batch (a
  function of the user's seed) and removing one record changes the other records' draws."""
  generators = keras_internals.seed_generators(model)
  if generators and step.private_batch_size:
    layers = [layer.name for layer in keras_internals.flatten_layers(model)
              if any(g in generators for g in getattr(layer, "_seed_generators", ()))]
    raise PrivacyConfigError(
        f"{_TAPE_CALL}: model={model.name!r} has random layers {layers} (Dropout, "
        "GaussianNoise, random augmentation: keras.random.SeedGenerator draws), and the "
        "losses were computed before the call under Poisson-type sampling: each row's draws "
        "are a function of its position in the batch and of the seed, so removing one record "
        "changes the others' draws and the clipped sum moves by more than the clip norm. "
        "Pass the losses as a callable, compute_private_gradients(lambda: losses_of(x, y), "
        "variables, model=model), or the batch as data=... with model=model: the library "
        "then runs the model with fresh secret keys for its random layers. Received: "
        f"model={model.name!r}, tape=<GradientTape>")


def _binary_mask(mask, b):
  """The example mask: ones [b] for None, else `mask` as float32 when every entry is 0 or 1.

  The mask weights each clipped record: a weight w moves the sum by |w| C where the ledger
  states C. A constant mask is checked at trace time; any other behind a run-time assertion
  whose failure also makes the mask NaN (XLA drops assertions).

  Raises:
    ParameterValueError: a constant mask with an entry other than 0 or 1.
  """
  if mask is None:
    return tf.ones([b], tf.float32)
  mask = tf.cast(mask, tf.float32)
  static = tf.get_static_value(mask)
  if static is not None:
    bad = np.unique(static[(static != 0) & (static != 1)])
    if bad.size:
      raise ParameterValueError(
          "`mask` must hold 0 (padding) or 1 (an example) per row: it weights each clipped "
          "record, so a weight w would move the sum by |w| times the clip while the ledger "
          "states one clip. Pass sample weights through the loss instead. Received: mask "
          f"values {bad[:5].tolist()}")
    return mask
  ok = tf.reduce_all(tf.logical_or(tf.equal(mask, 0.0), tf.equal(mask, 1.0)))
  return mask * grads_lib.one_or_nan(ok, [
      "compute_private_gradients: `mask` must hold 0 (padding) or 1 (an example) per row"])


def _refuse_xla():
  """Refuses a trace inside `tf.function(jit_compile=True)`: the ledger's buffers grow, which
  XLA cannot compile (fit writes its ledger outside the compiled program)."""
  if routing.in_xla_context():
    raise PrivacyConfigError(
        "compute_private_gradients cannot run inside tf.function(jit_compile=True): it writes "
        "the privacy ledger (growing buffers), which XLA cannot compile. Wrap the custom step "
        "in tf.function without jit_compile, or train with model.fit on a DP model compiled "
        "with jit_compile=True (its clipping runs under XLA, its ledger write outside). "
        "Received: jit_compile=True")


def _records_and_masks(step, data, mask):
  b_static = grads_lib.static_batch_size(data)
  _warn_static_private_size(step, b_static, mask)
  grads_lib.check_num_microbatches(step.record_microbatches, b_static)
  b = grads_lib.dynamic_batch_size(data)
  example_mask = _binary_mask(mask, b)
  rows_ok = _declared_rows_check(step, b)
  if rows_ok is not None:
    example_mask = example_mask * rows_ok
  return grads_lib.to_records(data, example_mask, step.record_microbatches)


def compute_private_gradients(step, loss_fn, variables, data=None, mask=None, tape=None,
                              model=None):
  """Noised average of clipped per-record gradients, aligned with `variables`.

  Two forms. (a) data given: loss_fn(record_data) returns the losses of one record's examples
  (a vector [k] or a scalar mean); each record runs alone. (b) data None: loss_fn() (or, with
  `tape`, the tensor loss_fn) is the vector [B] of per-example losses of the whole batch;
  per-record gradients come from a batched jacobian, exact only if no layer mixes examples:
  needs `model`, which is probed (module docstring). A record's non-finite loss or gradient
  (or float16 overflow) makes it contribute zero in form (a) and in form (b) with a callable
  loss_fn (the batch is then run record by record); form (b) with `tape` refuses that step.

  Args:
    step: the optimizer's PrivateStep.
    loss_fn: see the two forms above.
    variables: the variables to differentiate (the result is aligned with them).
    data: a nest of [B, ...] tensors (form a), or None (form b).
    mask: float [B] of 0/1, padding rows 0 (another value is refused: it would weight a
      clipped record).
    tape: the GradientTape the loss tensor was computed under (form b with a tensor).
    model: the keras.Model that loss_fn runs; required by form (b).

  Returns:
    list of noised, averaged gradients (float32, or float64 for float64 variables).

  Raises:
    ParameterValueError: undeclared sampling, a scalar loss in form (b), more microbatches
      than examples, form (b) without `model` or with a model that mixes examples or cannot
      be probed, or an optimizer restored without its ledger (`restore_ledger`).
    PrivacyConfigError: a sampling declared by model.fit, not set_sampling
      (`PrivateStep.require_user_sampling`); a trace inside tf.function(jit_compile=True)
      (the ledger write cannot compile); form (b) with a trainable BatchNormalization; a
      loss_fn (form (a): from its record; form (b): from the tensors it captures) or a
      `model` whose training-mode call writes a variable from the data
      (data_writes.refuse_data_writes).
  """
  # AutoGraph: under a caller with AutoGraph enabled the user's loss_fn is converted with
  # the caller's status (as Keras 2 converted a layer's `call`) and the library's code is
  # not (`_compute_private_gradients`). A functools.partial: AutoGraph forwards a partial's
  # call under the caller's status (a lambda of converted code would run unconverted).
  caller = tf.__internal__.autograph.control_status_ctx()
  if callable(loss_fn) and caller.status.name == "ENABLED":
    loss_fn = tf.__internal__.autograph.tf_convert(functools.partial(loss_fn), caller)
  return _compute_private_gradients(step, loss_fn, variables, data, mask, tape, model)


@tf.autograph.experimental.do_not_convert   # loss_fn is converted by the caller's status
def _compute_private_gradients(step, loss_fn, variables, data, mask, tape, model):
  """compute_private_gradients' body, loss_fn already converted as the caller's code."""
  _refuse_xla()
  step.require_user_sampling("a custom loop's compute_private_gradients")
  variables = list(variables)
  step.prepare_mechanism(variables)   # a correlated mechanism needs the variables' shapes
  saved_ledger.require_covers(step.optimizer)   # a restored optimizer needs its ledger
  scale = _loss_scale(model)
  vectorize = vectorize_records(model)
  if model is not None:   # fit's check of the model's training-mode call
    data_writes.refuse_model_writes(model)
  if data is not None:
    row_provenance.refuse_row_mixing(
        data, "compute_private_gradients(data=...)",
        public=list(variables) + list(model.variables if model is not None else ()),
        private_size=step.private_batch_size)
    # the random layers of the model and of the loss draw from the step's secret keys
    with step.keyed_layer_draws(_random_layers(model, loss_fn)):
      return _private_gradients_of_records(step, loss_fn, variables, data, mask, scale,
                                           vectorize)
  _check_batch_independent(model, tape is not None)
  if tape is None:   # the batch reaches loss_fn() as the tensors it captures
    data_writes.refuse_closure_writes(
        loss_fn, "compute_private_gradients(loss_fn, variables) without data=: loss_fn")
    loss_fn = _keyed_calls(step, _random_layers(model, loss_fn), loss_fn)
    with tf.GradientTape(persistent=True) as tape:
      losses = _vector_loss(loss_fn())
      rec_losses, rmask, example_mask = _record_losses(step, losses, mask, scale)
    grads = grads_lib.jacobian_record_gradients(tape, rec_losses, variables,
                                                use_pfor=vectorize)
    # a non-finite batch: each record's gradient from a pass of that record alone
    grads = _total_record_gradients(step, loss_fn, variables, rec_losses, grads,
                                    example_mask, scale)
    finite_batch = 1.0
  else:   # the losses are a tensor: no pass can be run again (`_finite_batch`)
    _refuse_unkeyed_draws(step, model)
    losses = _vector_loss(loss_fn)
    with tape:
      rec_losses, rmask, _ = _record_losses(step, losses, mask, scale)
    grads = grads_lib.jacobian_record_gradients(tape, rec_losses, variables,
                                                use_pfor=vectorize)
    finite_batch = _finite_batch(rec_losses, grads)
  grads, finite = chunking.unscale_records(grads, scale)
  deps = step.count_overflowed(finite, rmask)
  params = step.sample_params()   # raises while the sampling is undeclared
  query = step.base_query
  state = query.initial_sample_state(chunking.wide_template(variables))
  # each record's weight times the pinned sum's shrink, as PrivateStep.clipped_sum
  with chunking.public_rows(step, 1):
    shrink = summation.public_shrink(chunking.batch_rows(rmask), *chunking.sum_plan(None, rmask))
  with tf.control_dependencies(deps):
    state = query.accumulate_records(params, state, grads, mask=rmask * shrink * finite_batch)
  return step.noised_average(state, tf.cast(tf.size(rmask), tf.float32))   # records formed


def _all_finite(rec_losses, grads):
  """A bool scalar: every per-record loss [M] and gradient [M, ...] is finite."""
  parts = [tf.reduce_all(tf.math.is_finite(rec_losses))]
  parts += [tf.reduce_all(tf.math.is_finite(g)) for g in grads]
  return tf.reduce_all(tf.stack(parts))


def _batch_captures(concrete, b_static):
  """A bool per captured input of `concrete`: True for a tensor whose leading dimension is the
  batch's (static `b_static`, or unknown when the batch size is unknown)."""
  def is_batch(t):
    if t.dtype in (tf.resource, tf.variant) or not t.shape.rank:
      return False
    return t.shape[0] == b_static if b_static is not None else t.shape[0] is None
  return [is_batch(t) for t in concrete.captured_inputs]


def _gather_rows(t, at, b):
  """t's rows `at` when t's leading dimension is the batch's `b`, else t itself (never an
  out-of-range gather)."""
  if t.shape[0] is not None:
    return tf.gather(t, at)
  return tf.cond(tf.equal(tf.shape(t)[0], b), lambda: tf.gather(t, at), lambda: tf.identity(t))


def _total_record_gradients(step, loss_fn, variables, rec_losses, grads, example_mask, scale):
  """The per-record gradients of the losses form, made a function of each record alone when the
  batch is not finite.

  The batched jacobian's rows come from one backward pass over the whole batch: a NaN or inf
  in one record reaches every row (0 x NaN), so zeroing the non-finite rows would drop all of
  them (a move of up to B C), and refusing the step would let one record decide whether the
  run goes on (a release outside the guarantee: Dwork and Roth, "The Algorithmic Foundations
  of Differential Privacy", Definition 2.4, applied to the run's outcome). So when a loss or
  gradient is not finite (`tf.cond`), record r's gradient is taken from loss_fn run again on a
  batch all of whose rows are record r's examples (its captured batch tensors gathered at
  record r's rows): a function of record r alone, clipped to zero by the query if not finite.
  That costs M sequential passes on non-finite steps only (a step's duration is not released).
  Without a captured batch tensor no pass can run on one record: the step is refused
  (`_finite_batch`). Returns per-record gradients [M, ...] aligned with `variables`."""
  ok = _all_finite(rec_losses, grads)
  m = step.record_microbatches

  def alone():
    concrete = tf.function(loss_fn).get_concrete_function()
    captures = concrete.captured_inputs
    b_static = example_mask.shape[0]
    batch = _batch_captures(concrete, b_static)
    if not any(batch):
      return [g * _finite_batch(rec_losses, grads) for g in grads]
    b = tf.shape(example_mask)[0]
    rows = tf.range(b_static if b_static is not None else b)
    stride = b if m is None else m   # record r holds examples r, r + m, r + 2m, ... (to_records)

    def record_gradient(r):
      at = (rows // stride) * stride + r
      at = tf.where(at < b, at, r)   # every row one of record r's examples
      feeds = [_gather_rows(t, at, b) if is_b else t for t, is_b in zip(captures, batch)]
      with tf.GradientTape() as tape:
        losses = _vector_loss(keras_internals.call_with_captures(concrete, feeds))
        per_example = tf.reduce_mean(
            tf.reshape(tf.cast(losses, tf.float32), tf.stack([b, -1])), axis=1) * scale
        if m is None:
          loss = per_example[r] * example_mask[r]
        else:
          recs, em, _ = grads_lib.to_records(per_example, example_mask, m)
          loss = grads_lib.masked_record_mean(recs, em)[r]
      return tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    # one record's pass at a time: the memory of one batched pass (running out of memory
    # on a non-finite batch would stop the run on one record again)
    return tf.map_fn(record_gradient, tf.range(tf.shape(rec_losses)[0]),
                     fn_output_signature=[tf.TensorSpec(v.shape, v.dtype) for v in variables],
                     parallel_iterations=1)

  return tf.cond(ok, lambda: [tf.identity(g) for g in grads], alone)


def _finite_batch(rec_losses, grads):
  """1.0, or NaN behind a failed run-time assertion (XLA drops assertions, so the NaN spoils the
  release instead) when a per-record loss or gradient of the losses form is not finite and
  its pass cannot be run again on one record (the tape form, or a loss_fn capturing no batch
  tensor). A step refused so is a release outside the guarantee: validate the data first.

  One record's NaN or inf reaches every row of the batched backward pass, so no row is then
  a function of its own record. Also refused under a float16 loss scale: an overflowed
  activation with a finite loss spoils every row too, so an overflowed row cannot be told
  from a spoiled one. The data= form runs each record alone and needs no such check."""
  return grads_lib.one_or_nan(_all_finite(rec_losses, grads), [
      "compute_private_gradients(losses form given as a tensor, or a loss_fn capturing no "
      "tensor of the batch): a record's loss or gradient is not finite. The losses form "
      "differentiates the whole batch at once, so one record's NaN or inf reaches every "
      "record's gradient, and this loss cannot be run again on one record; the step is "
      "refused (also a float16 overflow under a loss scale). Pass loss_fn as a callable of "
      "no argument that captures the batch (a non-finite batch is then run record by "
      "record), or the batch as data=... with a loss_fn of one record (each record is run "
      "alone and a non-finite one is clipped to zero), or remove the non-finite examples"])


def _private_gradients_of_records(step, loss_fn, variables, data, mask, scale, vectorize):
  """Form (a) of compute_private_gradients: each record run alone through loss_fn."""
  recs, em, rmask = _records_and_masks(step, data, mask)

  # a loss_fn writing a variable from its record (eagerly or traced, nested functions too)
  data_writes.refuse_data_writes(
      loss_fn, tf.nest.map_structure(
          lambda t: None if t is None else tf.TensorSpec(t.shape[1:], t.dtype), recs),
      "compute_private_gradients(loss_fn, variables, data=...): loss_fn")

  def record_loss(rec):
    r_data, r_em = rec
    loss = tf.convert_to_tensor(loss_fn(r_data))
    if loss.shape.rank:
      loss = grads_lib.masked_record_mean(tf.reshape(loss, [-1]), r_em)
    return tf.cast(loss, tf.float32) * scale, ()

  k = grads_lib.examples_per_record(step.record_microbatches, grads_lib.static_batch_size(data),
                                    em)
  state, _, _ = step.clipped_sum(record_loss, variables, (recs, em), rmask, k,
                                 vectorize=vectorize, loss_scale=scale)
  return step.noised_average(state, tf.cast(tf.size(rmask), tf.float32))   # records formed


_VECTOR_CALL = ("optimizer.compute_private_gradients(loss_fn, variables) without data= (or "
                "optimizer.minimize(loss_fn, var_list))")
_TAPE_CALL = ("optimizer.compute_private_gradients(losses, variables, tape=tape) (or "
              "optimizer.minimize(loss, var_list, tape=tape), TF Privacy's spelling)")
_WHAT_TO_DO = ("Pass model=<the keras.Model that computed the losses> (it is probed for "
               "layers that mix examples) or pass the batch as data=... with a loss_fn of one "
               "record (each record is then run alone; minimize has no data form: use "
               "compute_private_gradients(loss_fn, variables, data=...) and "
               "apply_private_gradients)")


def _check_batch_independent(model, with_tape):
  """Refuses the vector form (b) unless `model` is given, has no trainable BatchNormalization,
  has only layers known to act per example and its probe finds no layer that mixes examples."""
  call = _TAPE_CALL if with_tape else _VECTOR_CALL
  if model is None:
    raise ParameterValueError(
        f"{call} takes per-example losses computed on the whole batch; without model= "
        "nothing shows that example i's loss depends on example i alone (a "
        "BatchNormalization in training mode, or any layer that mixes the examples of a "
        "batch, lets one example move the other examples' losses, and the recorded "
        f"sensitivity would not bound it). {_WHAT_TO_DO}. Received: model=None, data=None")
  norms = [layer.name for layer in batch_independence.trainable_batch_norms(model)]
  if norms:
    raise PrivacyConfigError(
        f"{call}: layers {norms} are BatchNormalization in training mode: they mix the "
        "examples of a batch, so per-example losses computed on the whole batch do not bound "
        "one example's influence. Freeze them (layer.trainable = False), use "
        "LayerNormalization/GroupNormalization, or pass the batch as data=... with a loss_fn "
        f"of one record (each record is then run alone). Received: model={model.name!r}")
  unknown = per_example.undeclared_layers(model)
  if unknown:
    raise ParameterValueError(
        f"{call}: layers {list(unknown)} are not known to act on each example alone (a custom "
        "or Lambda layer, a subclassed model's call or a graph operation), so per-example "
        "losses computed on the whole batch may not bound one example's influence. Pass the "
        "batch as data=... with a loss_fn of one record (each record is then run alone), or "
        "declare each such layer with dp.keras.declare_per_example(layer, reason). "
        f"Received: model={model.name!r}")
  mixing = batch_independence.probe_model(model)   # inference and training mode
  if mixing is None:
    raise ParameterValueError(
        f"{call}: model={model.name!r} could not be probed for layers that mix the "
        "examples of a batch (its inputs are unknown: a subclassed model, or one not built "
        "yet). Build it on keras.Input(...) (a functional or Sequential model, called once "
        "before the loop), or pass the batch as data=... with a loss_fn of one record. "
        f"Received: model={model.name!r}")
  if mixing:
    raise ParameterValueError(
        f"{call}: layers {list(mixing)} make one example's outputs depend on other examples "
        "of the batch, so per-example losses computed on the whole batch do not bound one "
        "example's influence. Pass the batch as data=... with a loss_fn of one record "
        f"(each record is then run alone). Received: model={model.name!r}")


def _vector_loss(loss):
  loss = tf.convert_to_tensor(loss)
  if loss.shape.rank == 0:
    raise ParameterValueError(
        "a scalar loss was given where a vector of per-example losses [batch] is needed: "
        "compute the loss with reduction='none' (e.g. keras.losses.X(reduction=None))")
  return loss


def _record_losses(step, losses, mask, scale=1.0):
  b = tf.shape(losses)[0]
  losses = tf.reshape(tf.cast(losses, tf.float32), tf.stack([b, -1]))
  losses = tf.reduce_mean(losses, axis=1) * scale
  grads_lib.check_num_microbatches(step.record_microbatches, losses.shape[0])
  _warn_static_private_size(step, losses.shape[0], mask)
  example_mask = _binary_mask(mask, b)
  rows_ok = _declared_rows_check(step, b)
  if rows_ok is not None:
    example_mask = example_mask * rows_ok
  if step.record_microbatches is None:
    return losses * example_mask, example_mask, example_mask
  recs, em, rmask = grads_lib.to_records(losses, example_mask, step.record_microbatches)
  return grads_lib.masked_record_mean(recs, em), rmask, example_mask
