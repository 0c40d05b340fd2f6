"""Keras models whose `fit` trains with DP-SGD (seed 002, Sections 5-7).

`DPSequential`, `DPModel` (functional) and `make_private(model)` give a model whose train
step computes per-record gradients (vectorized), clips and sums them through the DP
optimizer's DPQuery, adds noise once per logical batch and writes the step to the ledger.
`fit` on arrays samples by Poisson (q = batch_size / n) unless sampling="shuffle"; see
fit_sampling for the sampling and callbacks.LedgerJournal for crash safety.

Treatment of what could leak around the clipping:
* Regularization losses (kernel/activity regularizers, add_loss) are added to every
  record's loss, so their gradient is clipped and noised with the data gradient. Prefer
  decoupled weight decay (AdamW's weight_decay), which the optimizer applies to the
  weights without touching data.
* Non-trainable weights get no update from the private step. A layer that updates
  non-trainable state from the batch in training mode (BatchNormalization) mixes examples
  and is refused; freeze it (layer.trainable = False: inference mode) or use
  LayerNormalization / GroupNormalization.
* Metrics and the reported loss are computed from the private batch without noise: they
  are for monitoring only and are not covered by the guarantee.

With `jit_compile=True` the per-record gradients and clipping run under XLA; the noise,
the ledger write (growing buffers, no XLA) and the update run right after, in the same
non-compiled train function, so every step is recorded.
"""

import inspect

import keras
import tensorflow as tf

from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.keras import batch_independence
from tf_dpiter.keras import callbacks as callbacks_lib
from tf_dpiter.keras import fit_sampling
from tf_dpiter.keras import gradients as grads_lib
from tf_dpiter.keras import optimizers as opt_lib
from tf_dpiter.keras import routing

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


def _unpack(data):
  return keras.utils.unpack_x_y_sample_weight(data)


def check_no_batch_mixing(model):
  """ValueError if a trainable BatchNormalization (training mode mixes examples) is present."""
  for layer in model._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
      raise ValueError(
          f"layer {layer.name!r} is a BatchNormalization in training mode: it mixes the examples "
          "of a batch, so per-example clipping does not bound one example's influence. Freeze it "
          "(layer.trainable = False) or use LayerNormalization/GroupNormalization")


class DPModelMixin:
  """Private train_step / make_train_function / fit for any keras.Model subclass."""

  # ---- checks -------------------------------------------------------------------------

  def _dp_optimizer(self):
    opt = getattr(self, "optimizer", None)
    if not isinstance(opt, opt_lib.DPOptimizerMixin):
      raise ValueError(
          f"{type(self).__name__} needs a DP optimizer (dp.keras.DPKerasSGDOptimizer, "
          f"dp.keras.make_dp_optimizer_class(...), dp.keras.DPOptimizer(...)), got {opt!r}")
    return opt

  def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
    """keras.Model.compile with a DP optimizer. Under `mixed_float16` Keras' dynamic loss
    scaling (a data-dependent scale) is not used: a LossScaleOptimizer around a DP optimizer
    is unwrapped, and the private step applies a static loss scale itself
    (routing.loss_scale)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
        optimizer.inner_optimizer, opt_lib.DPOptimizerMixin):
      optimizer = optimizer.inner_optimizer
    if len(args) < 8:
      kwargs["auto_scale_loss"] = False
    super().compile(optimizer, *args, **kwargs)
    self._dp_optimizer()
    check_no_batch_mixing(self)

  def compile_from_config(self, config):
    """Re-compiles after keras.models.load_model (the DP optimizer config included)."""
    config = keras.saving.deserialize_keras_object(config)
    self.compile(**config)
    if self.built:
      self.optimizer.build(self.trainable_variables)

  @property
  def ledger(self):
    """The privacy ledger of this model's DP optimizer."""
    return self._dp_optimizer().ledger

  # ---- fit: declare the sampling ------------------------------------------------------

  def fit(self, *args, sampling=None, ledger_journal=None, **kwargs):
    """keras.Model.fit with DP sampling declared to the ledger (see fit_sampling).

    On arrays, batches are Poisson samples of expected size `batch_size` (q = B / n) unless
    `sampling="shuffle"` (the default with num_microbatches): shuffled passes. A dataset from
    dp.data.poisson_batches / shuffled_batches declares its own sampling; other data needs
    `optimizer.set_sampling` first. Crash safety: with keras.callbacks.BackupAndRestore among
    the callbacks, or `ledger_journal=path`, every step is appended to an append-only journal
    that the next fit resumes; every noised step ever taken is charged, re-runs after a
    restore included, so the ledger's samples >= the restored optimizer's iterations.

    Args:
      *args, **kwargs: keras.Model.fit's arguments (`shuffle` is not used for DP).
      sampling: None, "poisson" or "shuffle" (arrays only).
      ledger_journal: path of the ledger journal to resume and append (None: the
        optimizer's ledger_journal, else only with BackupAndRestore, at
        backup_dir/privacy_ledger.journal).

    Returns:
      The History object of keras.Model.fit.

    Raises:
      ValueError: undeclared data, sampling given for a dataset, microbatches with Poisson,
        or more microbatches than examples in a batch.
    """
    opt = self._dp_optimizer()
    check_no_batch_mixing(self)
    a = dict(_FIT_SIGNATURE.bind(self, *args, **kwargs).arguments)
    a.pop("self")
    spec, reason = sampling_lib.get_sampling_spec(a.get("x")), None
    if spec is None and fit_sampling.num_rows(a.get("x")) is not None:
      spec, reason = fit_sampling.arrays_to_dataset(a, opt, sampling)
    elif sampling is not None and (spec is None or spec.policy != sampling):
      raise ValueError(
          f"sampling={sampling!r} applies to arrays only; this data declares "
          f"{'no sampling' if spec is None else repr(spec.policy)}")
    self._dp_declare(opt, spec)
    if isinstance(a.get("x"), tf.data.Dataset):
      self._dp_build_for_probe(a["x"].element_spec)
      a["shuffle"] = False   # Keras ignores it for datasets (and would warn it does)
    callbacks = list(a.get("callbacks") or [])
    internal = [fit_sampling.SamplingSync(
        None if spec is None else spec.sampler,
        self._dp_log_line(spec, reason, callbacks, a.get("verbose", "auto")))]
    path = fit_sampling.journal_path(callbacks, ledger_journal or opt.ledger_journal)
    if path is not None and not any(isinstance(c, callbacks_lib.LedgerJournal) for c in callbacks):
      internal.append(callbacks_lib.LedgerJournal(path))
    a["callbacks"] = internal + callbacks
    # Inside fit a final partial batch smaller than num_microbatches is fine: its empty
    # microbatches are masked out (the batch size was checked in _dp_declare).
    self._dp_in_fit = True
    try:
      return super().fit(**a)
    finally:
      self._dp_in_fit = False

  def _dp_build_for_probe(self, data_spec):
    """Builds an unbuilt model from the data's shapes before the train function is traced,
    so the batch-independence probe can run eagerly (Keras would build it inside the trace,
    where the new variables cannot be read yet)."""
    if not all(layer.built for layer in self._flatten_layers()):
      self._symbolic_build(data_batch=data_spec)

  def train_on_batch(self, *args, **kwargs):  # pylint: disable=missing-function-docstring
    n_rep = self.distribute_strategy.num_replicas_in_sync
    if n_rep > 1:
      # Keras hands every replica the whole batch here: the all-reduced clipped sum would be
      # n_rep times the batch's (one example moving it by n_rep * C) under noise drawn once.
      raise ValueError(
          f"train_on_batch under a tf.distribute strategy with {n_rep} replicas would give "
          "every replica the whole batch (the clipped sum counted once per replica); train "
          "with model.fit on a tf.data.Dataset, which the strategy splits among replicas")
    x = args[0] if args else kwargs.get("x")
    if x is not None and not all(layer.built for layer in self._flatten_layers()):
      # built eagerly on the batch's first example (output unused), not inside the trace
      self(keras.tree.map_structure(lambda t: t[:1], x), training=False)
    return super().train_on_batch(*args, **kwargs)

  def _dp_declare(self, opt, spec):
    """Writes the data's SamplingSpec into the optimizer (or checks set_sampling was called)."""
    if spec is None:
      if opt.dp_query is None or getattr(opt, "_dp_sampling_source", None) != "user":
        raise ValueError(fit_sampling.UNDECLARED_DATA_MESSAGE)
      return
    m = opt.num_microbatches
    if m is not None and spec.sample_size and m > spec.sample_size:
      raise ValueError(f"num_microbatches={m} is more than the batch size {int(spec.sample_size)}: "
                       "each microbatch needs at least one example")
    if opt.set_sampling(spec.population_size, spec.selection_probability, spec.policy,
                        spec.sample_size):
      self.train_function = None
    opt._dp_sampling_source = "fit"  # pylint: disable=protected-access

  def _dp_log_line(self, spec, reason, callbacks, verbose):
    if verbose == 0:
      return None
    meters = [c for c in callbacks if isinstance(c, callbacks_lib.PrivacyMeter)]
    if spec is None:   # declared by hand: read it back from the optimizer's query
      cfg = self.optimizer.dp_query.get_config()
      spec = sampling_lib.SamplingSpec(cfg["policy"], cfg["population_size"],
                                       cfg["selection_probability"], cfg["sample_size"])
      reason = "declared by optimizer.set_sampling" + (
          "; record each new permutation with model.ledger.record_passes(1), else every "
          "step is charged as its own pass" if spec.policy == "shuffle" else "")
    return fit_sampling.describe(spec, reason or "the dataset's own sampling",
                                 meters[0] if meters else None)

  # ---- the private step ---------------------------------------------------------------

  def make_train_function(self, force=False):  # pylint: disable=missing-function-docstring
    if self.train_function is not None and not force:
      return self.train_function
    jit = bool(self.jit_compile) and not self.run_eagerly
    opt = self._dp_optimizer()
    if opt.clipping != "vectorized" and self.built:
      batch_independence.probe_model(self)   # eagerly, cached (None: probed in the trace)
    if jit:
      self._dp_core_fn = tf.function(self._dp_clipped_sum_step, jit_compile=True,
                                     reduce_retracing=True)
      self._jit_compile = False   # outer function (noise + ledger + update) without XLA
      try:
        super().make_train_function(force=True)
      finally:
        self._jit_compile = True
    else:
      self._dp_core_fn = self._dp_clipped_sum_step
      super().make_train_function(force=True)
    inner = self.train_function

    def guarded(iterator):
      # Set by StopAtPrivacyBudget: no step may start past the privacy budget.
      if getattr(self, "_dp_halt", False):
        raise StopIteration
      return inner(iterator)

    self.train_function = guarded
    return self.train_function

  def _dp_call(self, x):
    if self._call_has_training_arg:
      return self(x, training=True)
    return self(x)

  def _dp_clipped_sum_step(self, x, y, sample_weight):
    """Per-record gradients, clipped and summed: (sample_state, loss sum, records, y_pred)."""
    opt = self._dp_optimizer()
    b_static = grads_lib.static_batch_size(x)
    b = grads_lib.dynamic_batch_size(x)
    m = opt.num_microbatches
    if not getattr(self, "_dp_in_fit", False):
      grads_lib.check_num_microbatches(m, b_static)
    if sample_weight is None:
      example_mask = tf.ones([b], tf.float32)
    else:
      example_mask = tf.cast(tf.reshape(sample_weight, [b, -1])[:, 0] > 0, tf.float32)
    n_rep = tf.distribute.get_strategy().num_replicas_in_sync
    variables = self.trainable_variables

    if opt.resolve_clipping(self, input_specs=x) == "fast":
      return self._dp_fast_step(opt, x, y, sample_weight, example_mask, variables)

    recs, em, rmask = grads_lib.to_records((x, y, sample_weight), example_mask, m)

    def record_loss(rec):
      (xr, yr, wr), emr = rec
      k = tf.cast(tf.shape(emr)[0], tf.float32)
      w = emr * (k / tf.maximum(tf.reduce_sum(emr), 1.0))
      if wr is not None:
        w = w * tf.cast(tf.reshape(wr, tf.shape(emr)), tf.float32)
      y_pred = self._dp_call(xr)
      loss = self._compute_loss(x=xr, y=yr, y_pred=y_pred, sample_weight=w, training=True)
      return tf.cast(loss, tf.float32) * (float(n_rep) * scale), y_pred

    scale = routing.loss_scale(self)
    k = grads_lib.examples_per_record(m, b_static, em)
    state, loss_sum, aux = opt.clipped_sum(record_loss, variables, (recs, em), rmask, k,
                                           vectorize=routing.use_vectorized_map(self),
                                           loss_scale=scale)
    if aux is None:
      y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
    else:
      y_pred = tf.nest.map_structure(lambda t: grads_lib.from_records(t, b, m), aux)
    return state, loss_sum, tf.reduce_sum(rmask), y_pred

  def _dp_fast_step(self, opt, x, y, sample_weight, example_mask, variables):
    """Clipped sum by tf_dpiter.keras.fast_clipping (ghost norms); noise as usual.

    Records (examples or microbatches) are laid out record-major, k examples
    each, and clipped in physical chunks of whole records when
    max_physical_batch_size is set; the clipped sums of the chunks add up.
    """
    fc = opt_lib._load_fast_clipping()  # pylint: disable=protected-access
    loss_obj = self._dp_per_example_loss()
    m = opt.num_microbatches
    b = grads_lib.dynamic_batch_size(x)
    b_static = grads_lib.static_batch_size(x)
    recs, em, rmask = grads_lib.to_records((x, y, sample_weight), example_mask, m)
    k = grads_lib.examples_per_record(m, b_static, em)

    def flat(t):  # [R, k, ...] -> [R * k, ...]
      return None if t is None else tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))

    def chunk_sum(chunk, chunk_em):
      xc, yc, wc = tf.nest.map_structure(flat, chunk)

      def per_example_loss_fn(y_true, y_pred):
        losses = loss_obj(y_true, y_pred)
        if wc is not None:
          losses = losses * tf.cast(tf.reshape(wc, tf.shape(losses)), losses.dtype)
        return losses

      grads, _, outputs, losses = fc.clipped_grad_sum(
          self, xc, yc, per_example_loss_fn, opt.l2_norm_clip, mask=flat(chunk_em),
          examples_per_record=k, return_outputs=True)
      losses = tf.reshape(tf.cast(losses, tf.float32), tf.shape(chunk_em))
      rec_loss = tf.reduce_sum(losses * chunk_em, 1) / tf.maximum(tf.reduce_sum(chunk_em, 1), 1.0)
      return list(grads), tf.reduce_sum(rec_loss), outputs

    def batch_order(t):  # record-major outputs [>= M * k, ...] -> batch order [B, ...]
      n = em.shape.num_elements()
      t = t[:n if n is not None else tf.size(em)]
      return grads_lib.from_records(
          tf.reshape(t, tf.concat([tf.shape(em), tf.shape(t)[1:]], 0)), b, m)

    p = opt.max_physical_batch_size
    m_static = tf.TensorShape(rmask.shape)[0]
    per_chunk = None if p is None else (
        max(1, p // k) if isinstance(k, int) else tf.maximum(1, p // k))
    if per_chunk is None or (m_static is not None and isinstance(per_chunk, int)
                             and per_chunk >= m_static):
      grad_sum, loss_sum, outputs = chunk_sum(recs, em)
      y_pred = tf.nest.map_structure(batch_order, outputs)
    else:
      chunks, cmask, nchunks = grads_lib.chunked((recs, em), rmask, per_chunk)
      static_chunks = tf.get_static_value(nchunks)
      if static_chunks is not None:
        grad_sum, loss_sum, outs = None, 0.0, []
        for i in range(int(static_chunks)):
          c_recs, c_em = tf.nest.map_structure(lambda t, i=i: None if t is None else t[i], chunks)
          g, l, o = chunk_sum(c_recs, c_em)
          grad_sum = g if grad_sum is None else [a + c for a, c in zip(grad_sum, g)]
          loss_sum += l
          outs.append(o)
        y_pred = tf.nest.map_structure(lambda *ts: batch_order(tf.concat(ts, 0)), *outs)
      else:
        def body(i, acc, loss_acc):
          c_recs, c_em = tf.nest.map_structure(lambda t: None if t is None else t[i], chunks)
          g, l, _ = chunk_sum(c_recs, c_em)
          return i + 1, [a + c for a, c in zip(acc, g)], loss_acc + l

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, grad_sum, loss_sum = tf.while_loop(
            lambda i, *_: i < nchunks, body, [tf.constant(0), zeros, tf.constant(0.0)])
        y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
    query = opt.dp_query
    template = opt_lib.wide_template(variables)
    state = query.initial_sample_state(template)
    state = query.accumulate_preprocessed_record(
        state, [tf.cast(g, t.dtype) for g, t in zip(grad_sum, template)])
    return state, loss_sum, tf.reduce_sum(rmask), y_pred

  def _dp_per_example_loss(self):
    """Unreduced version of the compiled loss: (y_true, y_pred) -> [B]."""
    loss = self.loss
    if isinstance(loss, (list, dict, tuple)):
      raise ValueError("clipping='fast' supports a single compiled loss; use 'vectorized'")
    loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
      config = loss.get_config()
      config["reduction"] = None
      loss = type(loss).from_config(config)
      return lambda yt, yp: loss(yt, yp)
    return lambda yt, yp: loss(yt, yp)

  def train_step(self, data):  # pylint: disable=missing-function-docstring
    opt = self._dp_optimizer()
    x, y, sample_weight = _unpack(data)
    if not all(layer.built for layer in self._flatten_layers()):
      # Keras builds an unbuilt (e.g. subclassed) model on the first trace of the train
      # function; the per-record gradients need its variables first: one forward pass.
      self._dp_call(x)
    check_no_batch_mixing(self)
    core = getattr(self, "_dp_core_fn", None) or self._dp_clipped_sum_step
    state, loss_sum, num_records, y_pred = core(x, y, sample_weight)
    grads = opt.noised_average(state, num_records)
    opt.apply_private_gradients(grads, self.trainable_variables)
    self._loss_tracker.update_state(loss_sum / tf.maximum(num_records, 1.0),
                                    sample_weight=num_records)
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


@keras.saving.register_keras_serializable(package="tf_dpiter", name="DPSequential")
class DPSequential(DPModelMixin, keras.Sequential):
  """keras.Sequential trained with DP-SGD by `fit` (see module docstring)."""


_FUNCTIONAL = keras.src.models.functional.Functional


@keras.saving.register_keras_serializable(package="tf_dpiter", name="DPModel")
class DPModel(DPModelMixin, _FUNCTIONAL):
  """Functional keras.Model(inputs, outputs) trained with DP-SGD by `fit`."""


_PRIVATE_CLASSES = {keras.Sequential: DPSequential, _FUNCTIONAL: DPModel}


def private_class(cls):
  """The DP version of a keras.Model subclass: `DP<Name>(DPModelMixin, cls)`, made once.

  Keras.Sequential and functional models map to `DPSequential` and `DPModel`. Another class
  gets a subclass registered for Keras serialization as "tf_dpiter.private>" + the name Keras
  saves `cls` under, so `model.save` works; before `keras.models.load_model` in a new
  process, call `private_class(YourModel)` (as you import YourModel) so Keras finds it.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
    raise ValueError(f"cls must be a keras.Model subclass, got {cls!r}")
  if issubclass(cls, DPModelMixin):
    return cls
  new_cls = _PRIVATE_CLASSES.get(cls)
  if new_cls is None:
    new_cls = type(f"DP{cls.__name__}", (DPModelMixin, cls), {"__module__": cls.__module__})
    keras.saving.register_keras_serializable(
        package="tf_dpiter.private", name=keras.saving.get_registered_name(cls))(new_cls)
    _PRIVATE_CLASSES[cls] = new_cls
  return new_cls


def make_private(model):
  """Turns a built or unbuilt keras.Model (sequential, functional or subclassed) into its
  DP version in place (its class becomes `private_class(type(model))`) and returns it.
  Compile it with a DP optimizer afterwards (or again)."""
  if not isinstance(model, keras.Model):
    raise ValueError(f"model must be a keras.Model, got {model!r}")
  if isinstance(model, DPModelMixin):
    return model
  new_cls = private_class(type(model))
  model.__class__ = new_cls
  opt = getattr(model, "optimizer", None)
  if isinstance(opt, keras.optimizers.LossScaleOptimizer) and isinstance(
      opt.inner_optimizer, opt_lib.DPOptimizerMixin):
    model.optimizer = opt.inner_optimizer   # compiled under mixed_float16 before make_private
  if getattr(model, "optimizer", None) is not None and getattr(model, "compiled", False):
    model._dp_optimizer()  # pylint: disable=protected-access
    model.train_function = None
  check_no_batch_mixing(model)
  return model
