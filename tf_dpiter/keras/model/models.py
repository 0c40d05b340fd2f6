"""Keras models whose `fit` trains with DP-SGD (McMahan et al. 2018, Sections 5-7).

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
"""

import functools
import inspect
import os
import warnings

import keras
import tensorflow as tf

from tf_dpiter import files
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.data import user_sampling
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.optimizer import budget_copy
from tf_dpiter.keras.callbacks import averaging
from tf_dpiter.keras.callbacks import privacy as callbacks_lib
from tf_dpiter.keras.model import fit_sampling
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.optimizer import noise_mechanisms
from tf_dpiter.keras.callbacks import ledger as ledger_callbacks
from tf_dpiter.keras.optimizer import optimizers as opt_lib
from tf_dpiter.keras.optimizer import saved_ledger
from tf_dpiter.keras.model import statement as statement_lib
from tf_dpiter.keras.optimizer import tf_privacy_args
from tf_dpiter.keras.optimizer import weight_fingerprints
from tf_dpiter.keras.model import train_step as train_step_lib
from tf_dpiter.ledger import policies as ledger_policies
from tf_dpiter.ledger import privacy_ledger

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


check_no_batch_mixing = batch_independence.check_no_batch_mixing


# compile's optimizer when none is given: the model class' own default is used.
_OWN_DEFAULT = object()


def _check_whole_executions(steps_per_epoch, steps_per_execution):
  """Refuses an epoch of `steps_per_epoch` steps that `steps_per_execution` does not divide:
  on an endless dataset Keras runs whole executions, so the run would charge more steps than
  planned.

  Raises:
    PrivacyConfigError: steps_per_epoch % steps_per_execution != 0, or steps_per_execution
      not an integer (Keras' "auto" retunes it during the run).
  """
  if isinstance(steps_per_execution, str):
    raise PrivacyConfigError(
        "`steps_per_execution` must be an integer >= 1 for DP training: 'auto' lets Keras "
        "change the execution size during the run, so whole executions may take more steps "
        "than an epoch plans. Compile with steps_per_execution=1 or a divisor of the epoch's "
        f"steps. Received: steps_per_execution={steps_per_execution!r}")
  spe = int(steps_per_execution or 1)
  if steps_per_epoch is None or spe <= 1 or int(steps_per_epoch) % spe == 0:
    return
  steps = int(steps_per_epoch)
  divisors = [d for d in range(1, steps + 1) if steps % d == 0]
  raise PrivacyConfigError(
      f"`steps_per_execution` must divide the epoch's {steps} steps under DP training: Keras "
      f"runs whole executions on an endless dataset, {-(-steps // spe) * spe} steps an epoch "
      f"instead of {steps}, so the run would take and charge more steps than planned. Compile "
      f"with steps_per_execution in {divisors[:12]}, or pass steps_per_epoch="
      f"{-(-steps // spe) * spe} (a multiple of {spe}). Received: steps_per_execution={spe}, "
      f"steps_per_epoch={steps}")


def _refuse_optimizer_outside_strategy(model, opt):
  """Refuses a DP optimizer created outside its model's multi-replica strategy: its
  `iterations`, a variable of one device, would count every step once per replica while the
  ledger charges it once.

  Raises:
    PrivacyConfigError: several replicas and `opt.iterations` not created in the strategy.
  """
  strategy = model.distribute_strategy
  replicas = strategy.num_replicas_in_sync
  if replicas > 1 and not strategy.extended.variable_created_in_scope(opt.iterations.value):
    raise PrivacyConfigError(
        "`optimizer` must be created inside `strategy.scope()` when the model trains under a "
        f"tf.distribute strategy of {replicas} replicas: its `iterations` lives on one device, "
        f"so each of the {replicas} replicas would count every step. Create it there, as the "
        "model: `with strategy.scope(): opt = dp.keras.DPKerasSGDOptimizer(...); "
        "model.compile(optimizer=opt, ...)`. Received: optimizer="
        f"{type(opt).__name__} created outside the strategy")


class DPModelMixin(train_step_lib.TrainStepMixin):
  """Private fit / train_on_batch / compile for any keras.Model subclass (the step: train_step)."""

  # ---- checks -------------------------------------------------------------------------

  def _dp_optimizer(self):
    opt = getattr(self, "optimizer", None)
    if not isinstance(opt, opt_lib.DPOptimizerBase):
      raise ParameterValueError(
          f"{type(self).__name__} needs a DP optimizer (dp.keras.DPKerasSGDOptimizer, "
          f"dp.keras.make_dp_optimizer_class(...), dp.keras.DPOptimizer(...)), got {opt!r}; "
          "dp.keras.make_private(model, l2_norm_clip=..., noise_multiplier=...) makes a "
          "compiled plain optimizer private")
    return opt

  def compile(self, optimizer=_OWN_DEFAULT, *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
    """keras.Model.compile with a DP optimizer. A LossScaleOptimizer around it is unwrapped:
    Keras' dynamic loss scale is data-dependent; the step applies a static one
    (routing.loss_scale).

    Args:
      optimizer: a DP optimizer (a LossScaleOptimizer around one is unwrapped); a plain one
        or a name after make_private was given DP settings. Not given: the model class' own
        default (Keras' "rmsprop"; a keras_hub task's "auto", its Adam).
      *args: keras.Model.compile's other positional arguments.
      **kwargs: keras.Model.compile's keyword arguments (loss, metrics, jit_compile, ...).

    Raises:
      PrivacyConfigError: a DP optimizer on a model make_private was given DP settings for
        (give the DP settings in one place), or one created outside the model's
        multi-replica tf.distribute strategy (`_refuse_optimizer_outside_strategy`).
    """
    if optimizer is _OWN_DEFAULT and (
        args or isinstance(self, tf_privacy_args.TFPrivacyArgsMixin)):
      optimizer = "rmsprop"   # keras.Model.compile's default
    if isinstance(_unscaled(optimizer), opt_lib.DPOptimizerBase):
      optimizer = _unscaled(optimizer)
    if isinstance(self, tf_privacy_args.TFPrivacyArgsMixin):
      optimizer = self._dp_private_optimizer(optimizer, kwargs)
    if getattr(self, "_dp_pending_settings", None) and isinstance(
        _unscaled(optimizer), opt_lib.DPOptimizerBase):
      raise PrivacyConfigError(
          "`optimizer` must be a plain Keras optimizer (or a name such as 'adam'): make_private "
          f"was given the DP settings {self._dp_pending_settings!r} for the optimizer this "
          "model is compiled with; give the DP settings in one place. Received: "
          f"optimizer={type(_unscaled(optimizer)).__name__}")
    if len(args) < 8:
      kwargs["auto_scale_loss"] = False
    outgoing = _unscaled(getattr(self, "optimizer", None))
    if isinstance(outgoing, opt_lib.DPOptimizerBase):   # a recompile: its steps stay charged
      self._dp_carry_ledger(saved_ledger.arrays_of(outgoing))
      if outgoing is not _unscaled(optimizer):   # the new one takes its variables over
        opt_lib.release_variables(outgoing)
    if optimizer is _OWN_DEFAULT:   # the class' own default (a keras_hub task's "auto")
      super().compile(**kwargs)
    else:
      super().compile(optimizer, *args, **kwargs)
    self._dp_apply_pending_settings()
    _refuse_optimizer_outside_strategy(self, self._dp_optimizer())
    self._dp_adopt_carried_ledger()
    check_no_batch_mixing(self)

  def _dp_apply_pending_settings(self):
    """Swaps the compiled plain optimizer for its DP copy with make_private's settings (used
    once), keeping the compiled loss and metrics and the ledger the weights carry."""
    settings = getattr(self, "_dp_pending_settings", None)
    if not settings:
      return
    with self.distribute_strategy.scope():   # its variables where the model's are
      dp_opt = opt_lib.DPOptimizer(_unscaled(self.optimizer), **settings)
    keras_internals.replace_compiled_optimizer(self, dp_opt)
    self._dp_pending_settings = None
    self._dp_adopt_carried_ledger()   # a DP optimizer replaced before (compile DP -> plain)

  def save_own_variables(self, store):
    """keras.Model.save_own_variables, plus the DP optimizer's ledger, which whatever DP
    optimizer later trains the loaded weights continues (saved_ledger.write_to_store).

    Args:
      store: the dict-like weights-file entry of this model.

    Raises:
      PrivacyConfigError: the weights changed outside the DP optimizer since its last
        recorded update (weight_fingerprints.check): the ledger would not hold for them.
    """
    self._dp_check_saved_weights()
    super().save_own_variables(store)
    saved_ledger.write_to_store(getattr(self, "optimizer", None), store)

  def _dp_check_saved_weights(self):
    """Refuses to save weights changed outside the DP optimizer (weight_fingerprints.check)."""
    opt = _unscaled(getattr(self, "optimizer", None))
    fit_state = getattr(self, "_dp_fit_fingerprints", None)
    if isinstance(opt, opt_lib.DPOptimizerBase) and (
        not opt_lib.fingerprints_deferred(opt)
        or (fit_state is not None and fit_state.open)):
      # also in a fit, while the user's callbacks run
      weight_fingerprints.check(weight_fingerprints.checked_variables(self),
                                "saving the weights with the ledger")

  def save_weights(self, filepath, *args, **kwargs):
    """keras.Model.save_weights, refused before the file is opened when the weights changed
    outside the DP optimizer. A local `.weights.h5` file is written beside `filepath` and
    renamed over it (`files.replaced`): a crash while writing leaves the earlier checkpoint,
    and its ledger, whole.

    Args:
      filepath: the weights file.
      *args: keras.Model.save_weights' other arguments.
      **kwargs: keras.Model.save_weights' other arguments.

    Returns:
      keras.Model.save_weights' result.

    Raises:
      PrivacyConfigError: the weights changed outside the DP optimizer since its last
        recorded update.
    """
    self._dp_check_saved_weights()
    suffix = _atomic_suffix(keras.Model.save_weights, self, filepath, args, kwargs,
                            (".weights.h5",))
    if suffix is None:
      return super().save_weights(filepath, *args, **kwargs)
    with files.replaced(filepath, suffix) as tmp:
      return super().save_weights(tmp, *args, **kwargs)

  def save(self, filepath, *args, **kwargs):
    """keras.Model.save, refused before the file is opened as `save_weights` is; a local
    `.keras` or `.h5` file is replaced whole as `save_weights` replaces its file.

    Args:
      filepath: the model file.
      *args: keras.Model.save's other arguments.
      **kwargs: keras.Model.save's other arguments.

    Returns:
      keras.Model.save's result.

    Raises:
      PrivacyConfigError: the weights changed outside the DP optimizer since its last
        recorded update.
    """
    self._dp_check_saved_weights()
    suffix = _atomic_suffix(keras.Model.save, self, filepath, args, kwargs,
                            (".keras", ".h5", ".hdf5"))
    if suffix is None:
      return super().save(filepath, *args, **kwargs)
    with files.replaced(filepath, suffix) as tmp:
      return super().save(tmp, *args, **kwargs)

  def get_weights(self):
    """keras.Model.get_weights; the values are registered as released by the DP run
    (`weight_fingerprints.register_read`), so a copy of them by value adopts the run's ledger.

    Returns:
      list of numpy arrays, as keras.Model.get_weights.
    """
    weight_fingerprints.register_read(_compiled_optimizer(self),
                                      weight_fingerprints.checked_variables(self))
    return super().get_weights()

  def load_own_variables(self, store):
    """keras.Model.load_own_variables; a ledger the file carries is merged into the DP
    optimizer's ledger now or when one is compiled, so trained weights never restart from an
    empty ledger.

    Args:
      store: the dict-like weights-file entry of this model.
    """
    rest, carried = saved_ledger.split_store(store)
    super().load_own_variables(rest)
    self._dp_carry_ledger(carried)
    self._dp_adopt_carried_ledger()
    if carried is not None:   # the layers' values follow: recorded by load_weights
      self._dp_loaded_ledger = True
      weight_fingerprints.note_loaded(self, _compiled_optimizer)

  def load_weights(self, filepath, *args, **kwargs):
    """keras.Model.load_weights; weights from a file carrying a privacy ledger are recorded as
    released by the DP run (weight_fingerprints.record); a file without one counts as a
    change outside the DP optimizer once a private step updated these weights.

    Args:
      filepath: the weights file.
      *args: keras.Model.load_weights' other arguments.
      **kwargs: keras.Model.load_weights' other arguments.

    Returns:
      keras.Model.load_weights' result.
    """
    self._dp_loaded_ledger = False
    checked = weight_fingerprints.checked_variables(self)
    # a variable the file does not write (skip_mismatch) keeps a change made before, unrecorded
    stale = {id(v) for v, _ in weight_fingerprints.changed(checked)}
    held = weight_fingerprints.hold(checked) if stale else []
    try:
      result = super().load_weights(filepath, *args, **kwargs)
    finally:
      loaded, self._dp_loaded_ledger = self._dp_loaded_ledger, False
    if loaded:
      opt = _unscaled(getattr(self, "optimizer", None))
      written = weight_fingerprints.moved(held)
      weight_fingerprints.record(
          opt if isinstance(opt, opt_lib.DPOptimizerBase) else None,
          [v for v in checked if id(v) not in stale or id(v) in written])
    return result

  def _dp_carry_ledger(self, arrays):
    """Adds a ledger of the weights' run (a weights file's, or a replaced DP optimizer's) to
    the one every DP optimizer of this model starts from (`merged_arrays`, by run identity)."""
    if arrays is None:
      return
    carried = getattr(self, "_dp_carried_ledger", None)
    self._dp_carried_ledger = (arrays if carried is None
                               else privacy_ledger.merged_arrays(carried, arrays))

  def _dp_adopt_carried_ledger(self):
    """Merges into the DP optimizer's ledger the weights' carried ledger and those of nested
    DP models (their files' and their own optimizers'), by run identity (`ledger.run_ids`):
    the released weights went through those steps too. A nested model's DP optimizer hands
    its variables over (`optimizers.release_variables`)."""
    opt = _unscaled(getattr(self, "optimizer", None))
    if not isinstance(opt, opt_lib.DPOptimizerBase):
      return
    carried = getattr(self, "_dp_carried_ledger", None)
    for inner in keras_internals.flatten_layers(self, include_self=False):
      if not isinstance(inner, DPModelMixin):
        continue
      inner_opt = _unscaled(getattr(inner, "optimizer", None))
      own = isinstance(inner_opt, opt_lib.DPOptimizerBase) and inner_opt is not opt
      for arrays in (getattr(inner, "_dp_carried_ledger", None),
                     saved_ledger.arrays_of(inner_opt) if own else None):
        if arrays is not None:
          carried = arrays if carried is None else privacy_ledger.merged_arrays(carried,
                                                                                arrays)
      if own:
        opt_lib.release_variables(inner_opt)
    if carried is not None:
      opt.private_step.adopt_ledger(*carried)

  def compile_from_config(self, config):
    """Re-compiles after keras.models.load_model (the DP optimizer config included).

    Args:
      config: the serialized compile config (from get_compile_config), deserialized
        and passed to `compile` as keyword arguments.
    """
    config = keras.saving.deserialize_keras_object(config)
    self.compile(**config)
    if self.built:
      self.optimizer.build(self.trainable_variables)

  @property
  def ledger(self):
    """The privacy ledger of this model's DP optimizer."""
    return self._dp_optimizer().ledger

  def privacy_statement(self, delta, accountant="rdp"):
    """The privacy statement of the run this model trained, from its ledger: relation, unit,
    sampling, q, steps, z and epsilon at `delta` (`statement.run_statement`; print it).

    Args:
      delta: the delta epsilon is stated at, in (0, 1).
      accountant: "rdp" or "pld" (dp-accounting, upper bounds), or "gdp" (an approximation).

    Returns:
      a RunStatement.
    """
    return statement_lib.run_statement(self, delta, accountant)

  # ---- fit: declare the sampling ------------------------------------------------------

  def fit(self, *args, sampling=None, population_size=None, ledger_journal=None, **kwargs):
    """keras.Model.fit with DP sampling declared to the ledger (arrays: fit_sampling).

    A dataset from dp.data.poisson_batches / shuffled_batches declares its own sampling;
    other data needs `optimizer.set_sampling` first. With BackupAndRestore or
    `ledger_journal=path` every step is appended to a journal the next fit resumes: every
    noised step ever taken is charged.

    Args:
      *args: keras.Model.fit's arguments (`shuffle` is not used for DP).
      **kwargs: keras.Model.fit's arguments (`shuffle` is not used for DP).
      sampling: None, "poisson" or "shuffle" (arrays only).
      population_size: N, the public population size Poisson sampling on arrays states q over
        (q = batch_size / N, round(N / batch_size) steps an epoch; N may exceed len(x), e.g.
        a public bound): the guarantee then holds whatever the dataset's size. None: N is the
        run's, else len(x), and the dataset's size is treated as public (fit_sampling).
      ledger_journal: path of the ledger journal to resume and append (None: the
        optimizer's ledger_journal, else only with BackupAndRestore, at
        backup_dir/privacy_ledger.journal).

    Returns:
      The History object of keras.Model.fit.

    Raises:
      PrivacyConfigError: undeclared data, sampling given for a dataset, microbatches with Poisson,
        more microbatches than examples in a batch, a ledger with fewer samples than the
        optimizer's iterations, or a journal that ends before them; a callback acting on
        a training metric (callbacks.privacy.check_monitors); trainable weights changed
        outside the DP optimizer since its last recorded update (a plain optimizer on a
        shared layer, set_weights of other values: weight_fingerprints.check).
    """
    opt = self._dp_optimizer()
    self._dp_adopt_carried_ledger()   # nested DP models loaded or trained since compile
    opt_lib.check_variables(opt, self.trainable_variables)   # taken over since its trace?
    check_no_batch_mixing(self)
    batch_independence.warn_adapted_layers(self)
    fingerprints = not opt_lib.fingerprints_deferred(opt)
    if fingerprints:   # weights changed outside the DP optimizer since its last update?
      weight_fingerprints.check(weight_fingerprints.checked_variables(self), "fit",
                                record_with=opt)
    a = dict(_FIT_SIGNATURE.bind(self, *args, **kwargs).arguments)
    a.pop("self")
    spec, reason = sampling_lib.get_sampling_spec(a.get("x")), None
    if spec is None and fit_sampling.num_rows(a.get("x")) is not None:
      # padded to a static size under XLA and under several replicas (equal shards)
      pad = bool(self.jit_compile) or self.distribute_strategy.num_replicas_in_sync > 1
      batch_independence.keep_probe_rows(self, a["x"])   # the probe runs on real rows too
      spec, reason = fit_sampling.arrays_to_dataset(a, opt, sampling, pad=pad,
                                                    population_size=population_size)
    elif population_size is not None:
      raise PrivacyConfigError(
          "`population_size` must be None when fit is given a dataset: it applies to arrays "
          "(a dataset declares its own sampling; dp.data.poisson_batches(x, y, "
          "expected_batch_size=B, population_size=N) declares N for one). Received: "
          f"population_size={population_size!r}")
    elif sampling is not None and (spec is None or spec.policy != sampling):
      raise PrivacyConfigError(
          f"sampling={sampling!r} applies to arrays only; this data declares "
          f"{'no sampling' if spec is None else repr(spec.policy)}")
    self._dp_declare(opt.private_step, spec)
    _check_whole_executions(a.get("steps_per_epoch"), self.steps_per_execution)
    if isinstance(a.get("x"), tf.data.Dataset):
      replicas = self.distribute_strategy.num_replicas_in_sync
      if replicas > 1:   # equal replica shards (a batch already a multiple: unchanged)
        a["x"] = fit_sampling.pad_for_replicas(a["x"], replicas)
      if not all(layer.built for layer in keras_internals.flatten_layers(self)):
        # built from the data's shapes before the trace: the probe then runs eagerly
        keras_internals.symbolic_build(self, a["x"].element_spec)
      a["shuffle"] = False   # Keras ignores it for datasets (and would warn it does)
    opt.private_step.prepare_mechanism(self.trainable_variables)   # noise != "iid": query needs the shapes
    if fingerprints:   # the weights built since the check, frozen ones too
      weight_fingerprints.record(opt, self.weights, only_new=True)
    callbacks = list(a.get("callbacks") or [])
    callbacks_lib.check_monitors(callbacks, a.get("validation_data") is not None,
                                 keras_internals.compiled_metric_names(self))
    internal = [fit_sampling.SamplingSync(
        None if spec is None or user_sampling.user_grouping(spec) else spec.sampler,
        self._dp_log_line(spec, reason, callbacks, a.get("verbose", "auto")))]
    # the user's callbacks sandwiched: the steps' output recorded before them, checked after
    guard = _FitFingerprints(opt, self, callbacks) if fingerprints else None
    if guard is not None:
      internal.append(guard.recorder)
    path = fit_sampling.journal_path(callbacks, ledger_journal or opt.ledger_journal)
    if path is not None and not any(isinstance(c, ledger_callbacks.LedgerJournal)
                                    for c in callbacks):
      internal.append(ledger_callbacks.LedgerJournal(path))
    # last: before the first step, after every restore and every journal's own check
    a["callbacks"] = internal + callbacks + [ledger_callbacks.LedgerCoverage()] + (
        [guard.checker] if guard is not None else [])
    self._dp_fit_fingerprints = guard
    self._dp_in_fit = True   # a final batch smaller than M is fine in fit (empty ones masked)
    self._dp_fit_verbose = a.get("verbose", "auto")   # a slow first step is reported then
    deferred = opt_lib.fingerprints_deferred(opt)   # put back after (a probe's stays True)
    setattr(opt, weight_fingerprints.DEFERRED, True)
    try:
      history = super().fit(**a)
    except tf.errors.OpError as err:
      # a pass the sampler refused before its first batch, wrapped by tf.data
      refusal = getattr(getattr(spec, "sampler", None), "refusal", None)
      if refusal is None or str(refusal) not in str(err):
        raise
      raise PrivacyConfigError(str(refusal)) from err
    finally:   # a raising step skips on_train_end: its execution's passes are charged here
      self._dp_in_fit = False
      self._dp_fit_verbose = 0
      internal[0].close()
      setattr(opt, weight_fingerprints.DEFERRED, deferred)
      self._dp_fit_fingerprints = None
      # after the callbacks' on_train_end; if one raised before its check, the guard settles
      if fingerprints and guard.evaluation_cut_short():
        pass   # its evaluation wrote the weights: nothing recorded, every later check refuses
      elif fingerprints and not guard.open:
        weight_fingerprints.record(opt, weight_fingerprints.checked_variables(self))
      elif fingerprints:
        guard.settle()
    statement_lib.warn_if_past_target(self)   # more steps than the noise was calibrated for
    return history

  def train_on_batch(self, *args, **kwargs):
    """keras.Model.train_on_batch, one private step (the sampling must be declared with
    `optimizer.set_sampling` first); an unbuilt model is built eagerly on the batch.

    Raises:
      PrivacyConfigError: a sampling not declared with optimizer.set_sampling (undeclared,
        or declared by fit for its own sampler: PrivateStep.require_user_sampling), under a
        tf.distribute strategy with several replicas, a ledger with
        fewer samples than the optimizer's iterations (saved_ledger.require_covers), or
        trainable weights changed outside the DP optimizer since its last recorded update
        (weight_fingerprints.check).
    """
    opt = self._dp_optimizer()
    saved_ledger.require_covers(opt)   # restored without its ledger: refuse
    # the batch is the user's: charged under the sampling the user declared, never fit's
    opt.private_step.require_user_sampling("train_on_batch")
    n_rep = self.distribute_strategy.num_replicas_in_sync
    if n_rep > 1:
      raise PrivacyConfigError(
          f"train_on_batch under a tf.distribute strategy with {n_rep} replicas would give "
          "every replica the whole batch (the clipped sum counted once per replica); train "
          "with model.fit on a tf.data.Dataset, which the strategy splits among replicas")
    x = args[0] if args else kwargs.get("x")
    # trace facts exist and the model was not made unbuilt since: no layer to build
    built = getattr(self, "_dp_facts", None) is not None and self.built
    if x is not None and not built and not all(
        layer.built for layer in keras_internals.flatten_layers(self)):
      # built eagerly on the batch's first example (output unused), not inside the trace
      self(keras.tree.map_structure(lambda t: t[:1], x), training=False)
    if opt_lib.fingerprints_deferred(opt):
      return super().train_on_batch(*args, **kwargs)
    # weights changed outside the DP optimizer since its last update? (built: all of them)
    weight_fingerprints.check(weight_fingerprints.checked_variables(self), "train_on_batch",
                              record_with=opt)
    weight_fingerprints.record(opt, self.weights, only_new=True)   # frozen ones too
    setattr(opt, weight_fingerprints.DEFERRED, True)
    try:
      return super().train_on_batch(*args, **kwargs)
    finally:
      setattr(opt, weight_fingerprints.DEFERRED, False)
      weight_fingerprints.record(opt, weight_fingerprints.checked_variables(self))

  def _dp_declare(self, step, spec):
    """Writes the data's SamplingSpec into the optimizer's private step (or checks that
    set_sampling was called)."""
    if spec is None:
      if (step.sampling or step.pending_query()) is None or step.sampling_source != "user":
        raise ParameterValueError(fit_sampling.UNDECLARED_DATA_MESSAGE)
      self._dp_declare_users(None, step.num_microbatches)
      return
    m = step.num_microbatches
    grouping = user_sampling.user_grouping(spec)
    if grouping is None and ledger_policies.get(spec.policy).unit == "user":
      raise PrivacyConfigError(
          f"The data's sampling has policy {spec.policy!r}, whose record is a user, but no "
          "user grouping: the step would clip each example while the ledger states the "
          "sensitivity S per user. Make user-level batches with dp.data.poisson_user_batches "
          "(it groups each user's rows into one record)")
    self._dp_declare_users(grouping, m)
    if m is not None and spec.sample_size and m > spec.sample_size:
      raise PrivacyConfigError(f"num_microbatches={m} is more than the batch size {int(spec.sample_size)}: "
                               "each microbatch needs at least one example")
    if step.set_sampling(spec.population_size, spec.selection_probability, spec.policy,
                        spec.sample_size, getattr(spec.sampler, "steps_per_pass", None)):
      self.train_function = None
    step.mark_sampling_from_fit()

  def _dp_declare_users(self, grouping, num_microbatches):
    """Records are users (data.user_sampling) or examples; retraces the step on a change."""
    per_user = None if grouping is None else grouping.examples_per_user
    if per_user is not None and num_microbatches is not None:
      raise PrivacyConfigError(
          f"num_microbatches={num_microbatches} cannot be used with user-level batches "
          "(dp.data.poisson_user_batches): the record is already the user")
    if getattr(self, "_dp_examples_per_user", None) != per_user:
      self._dp_examples_per_user = per_user
      self.train_function = None

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
          "step is charged as its own pass" if ledger_policies.get(spec.policy).pass_charged
          else "")
    return fit_sampling.describe(spec, reason or "the dataset's own sampling",
                                 meters[0] if meters else None)


# The hooks of a fit's callbacks (keras.callbacks.Callback), and the legacy names Keras'
# train-batch hooks call.
_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end")
_ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}
# hooks run at every step: the weights around them are held, not digested (`_FitFingerprints`)
_BATCH_HOOKS = frozenset(h for h in _HOOKS if "_batch_" in h)
# Keras callbacks that write no weight at any hook (exact types: a subclass may)
_READ_ONLY = tuple(getattr(keras.callbacks, name) for name in (
    "History", "ProgbarLogger", "CSVLogger", "TensorBoard", "TerminateOnNaN",
    "ReduceLROnPlateau", "LearningRateScheduler", "RemoteMonitor"))
# hooks at which these Keras callbacks only read the weights (to save them with the ledger,
# which `load_weights` then accepts): no record or check is needed around them there
_READS_AT = {keras.callbacks.ModelCheckpoint: {"on_train_batch_end", "on_epoch_begin",
                                               "on_epoch_end"},
             keras.callbacks.BackupAndRestore: {"on_train_batch_end", "on_epoch_end",
                                                "on_train_end"}}


def _overridden_hooks(callback):
  """The hooks of `callback` that may run the user's code (overridden on its class or
  instance), less those of tf_dpiter's callbacks and of Keras' read-only ones."""
  cls = type(callback)
  if cls.__module__.startswith("tf_dpiter.") or cls in _READ_ONLY:
    return set()
  out = set()
  for name in _HOOKS + tuple(_ALIASES) + ("set_model", "set_params"):
    method = getattr(callback, name, None)
    if getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, name):
      out.add(_ALIASES.get(name, name))
  if out & {"on_test_batch_begin", "on_test_batch_end"}:   # checked once evaluation ends
    out.add("on_test_end")
  if out & {"set_model", "set_params"}:   # run as fit starts: checked before the first step
    out = (out - {"set_model", "set_params"}) | {"on_train_begin"}
  return out - _READS_AT.get(cls, set())


class _FitFingerprints:
  """The weights' fingerprints in a DP fit, around the user's callbacks (weight_fingerprints).

  At every hook some user callback implements (`_overridden_hooks`), `recorder`, first in
  the list, records the weights the private steps left, and `checker`, last, checks them: a
  callback may put back a recorded state (restore_best_weights) or a tf_dpiter weight
  average of checked iterates (post-processing), nothing else. `open` is True between the
  two: a fit that raises then records nothing.

  Fit's own evaluation runs between on_test_begin and on_test_end: `checker` holds the
  weights there and `recorder` refuses any that moved (a layer keeping a statistic of its
  inference inputs would carry them unclipped and un-noised).
  """

  def __init__(self, optimizer, model, callbacks):
    self._optimizer = optimizer
    self._model = model
    self.hooks = set()
    for callback in callbacks:
      self.hooks |= _overridden_hooks(callback)
    self._averages = [c for c in callbacks if isinstance(c, averaging._WeightAveraging)]  # pylint: disable=protected-access
    self._progress = self._steps()
    self.open = False
    self._held = None
    self._evaluated = None   # the weights held while fit's evaluation runs
    first = {name: [functools.partial(self._begin, name)] for name in self.hooks}
    first.setdefault("on_test_end", []).insert(0, self._evaluation_end)
    self.recorder = type("FingerprintsRecord", (keras.callbacks.Callback,),
                         {name: self._hook(fns) for name, fns in first.items()})()
    last = {name: [functools.partial(self._end, name)] for name in self.hooks}
    last.setdefault("on_test_begin", []).append(self._evaluation_begin)
    self.checker = type("FingerprintsCheck", (keras.callbacks.Callback,),
                        {name: self._hook(fns) for name, fns in last.items()})()

  @staticmethod
  def _hook(fns):
    def hook(self, *unused_args, **unused_kwargs):  # pylint: disable=unused-argument
      for fn in fns:
        fn()
    return hook

  def settle(self):
    """After a fit that raised between `recorder` and `checker`: weights held at a batch hook
    that nothing moved are recorded; moved ones are refused by every later check."""
    held, self._held = self._held, None
    if held is None:
      return
    if weight_fingerprints.changed_since(held):
      weight_fingerprints.mark_seen(self._optimizer)
    else:
      weight_fingerprints.record(self._optimizer,
                                 weight_fingerprints.checked_variables(self._model))

  def evaluation_cut_short(self):
    """After a fit: True when its evaluation was interrupted and the weights held at its start
    moved; every later check then refuses them (`mark_seen`)."""
    held, self._evaluated = self._evaluated, None
    if held is None or not weight_fingerprints.changed_since(held):
      return False
    self._held = None
    weight_fingerprints.mark_seen(self._optimizer)
    return True

  def _evaluation_begin(self):
    self._evaluated = weight_fingerprints.hold(weight_fingerprints.checked_variables(
        self._model))

  def _evaluation_end(self):
    held, self._evaluated = self._evaluated, None
    bad = weight_fingerprints.changed_since(held) if held is not None else []
    if bad:   # nothing the evaluation left may be recorded or stated
      self.open = True
      weight_fingerprints.mark_seen(self._optimizer)
      weight_fingerprints.refuse(bad, "fit (its evaluation of the validation data)")

  def _steps(self):
    return weight_fingerprints.progress(self._optimizer)

  def _begin(self, hook):
    self.open = True
    progress = self._steps()
    if progress == self._progress:
      return
    variables = weight_fingerprints.checked_variables(self._model)
    if hook in _BATCH_HOOKS:   # held, not digested: a pass only if a callback moves them
      self._held = weight_fingerprints.hold(variables)
      return
    # the private steps' output, before any callback runs
    weight_fingerprints.record(self._optimizer, variables)
    self._progress = progress

  def _end(self, hook):
    if self._held is not None:
      held, self._held = self._held, None   # released: the next update writes in place
      bad = weight_fingerprints.changed_since(held)
    else:
      held = None
      bad = weight_fingerprints.changed(weight_fingerprints.checked_variables(self._model))
      self._progress = self._steps()
    if bad:
      bad = self._not_averaged(bad)
    if bad and held is not None:   # the held state was never recorded: later checks refuse
      weight_fingerprints.mark_seen(self._optimizer)
    weight_fingerprints.refuse(bad, f"fit (after the callbacks' {hook})")
    self.open = False

  def _not_averaged(self, bad):
    """`bad` less the variables holding a tf_dpiter weight average (of checked iterates)."""
    held = {}
    for callback in self._averages:
      average = callback._avg if callback._raw is not None else None  # pylint: disable=protected-access
      for var, avg in zip(callback.model.trainable_weights, average or ()):
        held.setdefault(id(var), []).append(weight_fingerprints.digest(avg.read_value()))
    return [(v, s) for v, s in bad if weight_fingerprints.digest(v) not in held.get(id(v), ())]


@keras.saving.register_keras_serializable(package="tf_dpiter", name="DPSequential")
class DPSequential(tf_privacy_args.TFPrivacyArgsMixin, DPModelMixin, keras.Sequential):
  """keras.Sequential trained with DP-SGD by `fit` (see module docstring).

  Compile with a DP optimizer, or give TF Privacy's (l2_norm_clip, noise_multiplier,
  num_microbatches) here and compile with a plain Keras optimizer (tf_privacy_args).
  """


_FUNCTIONAL = keras_internals.functional_class()


@keras.saving.register_keras_serializable(package="tf_dpiter", name="DPModel")
class DPModel(tf_privacy_args.TFPrivacyArgsMixin, DPModelMixin, _FUNCTIONAL):
  """Functional keras.Model(inputs, outputs) trained with DP-SGD by `fit` (TF Privacy's
  model arguments accepted, as DPSequential)."""


_PRIVATE_CLASSES = {keras.Sequential: DPSequential, _FUNCTIONAL: DPModel}


def private_class(cls):
  """The DP version of a keras.Model subclass: `DP<Name>(DPModelMixin, cls)`, made once.

  Keras.Sequential and functional models map to `DPSequential` and `DPModel`. Another class
  gets a subclass registered for Keras serialization as "tf_dpiter.private>" + the name Keras
  saves `cls` under, so `model.save` works; before `keras.models.load_model` in a new
  process, call `private_class(YourModel)` (as you import YourModel) so Keras finds it.

  Args:
    cls: a keras.Model subclass.

  Returns:
    the DP class (cls itself if it is one already).

  Raises:
    ParameterValueError: cls is not a keras.Model subclass.
    PrivacyConfigError: cls (or a class it inherits from) overrides `train_step`, which the
      DP class's private step would shadow.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
    raise ParameterValueError(f"cls must be a keras.Model subclass, got {cls!r}")
  if issubclass(cls, DPModelMixin):
    return cls
  own_step = next((c for c in cls.__mro__ if "train_step" in vars(c)
                   and c.__module__.split(".")[0] not in ("keras", "tf_keras")), None)
  if own_step is not None:   # the DP class's step comes first: the override would never run
    raise PrivacyConfigError(
        f"{own_step.__name__}.train_step would not run in the DP version of "
        f"{cls.__name__} (the private step replaces Keras' step before it). Subclass "
        "dp.keras.DPModel instead of keras.Model and keep the override there: its "
        f"super().train_step(data) is the private step. Received: cls={cls.__name__}")
  new_cls = _PRIVATE_CLASSES.get(cls)
  if new_cls is None:
    new_cls = type(f"DP{cls.__name__}", (DPModelMixin, cls), {"__module__": cls.__module__})
    keras.saving.register_keras_serializable(
        package="tf_dpiter.private", name=keras.saving.get_registered_name(cls))(new_cls)
    _PRIVATE_CLASSES[cls] = new_cls
  return new_cls


_TFP_CLASSES = {}


def make_dp_model_class(cls):
  """TF Privacy's `make_dp_model_class`: the DP version of a keras.Model subclass whose
  constructor takes TF Privacy's (l2_norm_clip, noise_multiplier, num_microbatches=None,
  use_xla=None, layer_registry=None) before the class' own arguments, and which is compiled
  with a plain Keras optimizer (made private with these settings; tf_privacy_args).
  keras.Sequential and keras.Model (functional) give DPSequential and DPModel.

  Args:
    cls: a keras.Model subclass.

  Returns:
    the DP class taking TF Privacy's arguments.

  Raises:
    ParameterTypeError: cls is not a keras.Model subclass.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
    raise ParameterTypeError(f"cls must be a keras.Model subclass, got {cls!r}")
  if cls is keras.Model:
    return DPModel
  dp_cls = private_class(cls)
  if issubclass(dp_cls, tf_privacy_args.TFPrivacyArgsMixin):
    return dp_cls
  if cls not in _TFP_CLASSES:
    new_cls = type(dp_cls.__name__, (tf_privacy_args.TFPrivacyArgsMixin, dp_cls),
                   {"__module__": cls.__module__})
    keras.saving.register_keras_serializable(
        package="tf_dpiter.tf_privacy", name=keras.saving.get_registered_name(cls))(new_cls)
    _TFP_CLASSES[cls] = new_cls
  return _TFP_CLASSES[cls]


def make_private_with_epsilon(model, optimizer, epsilon, delta, epochs, batch_size,
                              population_size, l2_norm_clip, sampling="poisson",
                              accountant="rdp", **dp_kwargs):
  """Opacus' `make_private_with_epsilon` for Keras: the model made private and a DP copy of
  `optimizer` with z calibrated to (epsilon, delta) as `dp.keras.from_budget` (relation and
  unit there); a model compiled with a plain optimizer gets it now, its loss and metrics kept.

  Args:
    model: a keras.Model (see make_private).
    optimizer: a plain keras.optimizers.Optimizer instance (its hyperparameters are kept).
    epsilon: the target.
    delta: the target.
    epochs: E.
    batch_size: B (expected batch size).
    population_size: n.
    l2_norm_clip: the clipping norm S.
    sampling: as in `from_budget`.
    accountant: as in `from_budget`.
    **dp_kwargs: other DP optimizer arguments (num_microbatches, clipping, ...).

  Returns:
    (model, dp_optimizer).

  Raises:
    ParameterTypeError: `model` is not a keras.Model.
    ParameterValueError: a DP or non-Keras optimizer (budget.dp_copy_for_budget).
    BudgetConfigError: a target the calibration refuses (as from_budget).
  """
  if not isinstance(model, keras.Model):
    raise ParameterTypeError(
        f"`model` must be a keras.Model instance. Received: model={model!r}")
  dp_opt = budget_copy.dp_copy_for_budget(optimizer, epsilon, delta, epochs, batch_size,
                                          population_size, l2_norm_clip, sampling, accountant,
                                          dp_kwargs, who="make_private_with_epsilon")
  compiled = _compiled_optimizer(model)
  if compiled is not None and not isinstance(compiled, opt_lib.DPOptimizerBase):
    check_no_batch_mixing(model)   # refused before anything changes
    keras_internals.replace_compiled_optimizer(model, dp_opt)
  return make_private(model), dp_opt


def _atomic_suffix(method, model, filepath, args, kwargs, suffixes):
  """The suffix under which `filepath` is written through `files.replaced`, or None to let
  Keras write it in place (remote, a directory or shards, another extension, or
  overwrite=False with a file there)."""
  given = inspect.signature(method).bind(model, filepath, *args, **kwargs).arguments
  path = str(filepath)
  if (not files.is_local_file_path(filepath) or given.get("zipped") is False
      or given.get("max_shard_size") is not None
      or (not given.get("overwrite", True) and os.path.exists(path))):
    return None
  return next((s for s in suffixes if path.endswith(s)), None)


def _unscaled(optimizer):
  """`optimizer` without a Keras LossScaleOptimizer around it (routing.loss_scale)."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.inner_optimizer
  return optimizer


def _compiled_optimizer(model):
  """The optimizer `model` is compiled with (a LossScaleOptimizer's inner one), or None."""
  if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
    return None
  return _unscaled(model.optimizer)


def _private_settings(l2_norm_clip, noise_multiplier, dp_kwargs):
  """make_private's DP settings (DPOptimizer keywords), checked now, or None."""
  takes = tuple(name for name, p in inspect.signature(opt_lib.DPOptimizer).parameters.items()
                if name != "optimizer" and p.kind != p.VAR_KEYWORD) + tuple(
                    noise_mechanisms.PARAM_NAMES)
  for name, value in dp_kwargs.items():
    if name not in takes:
      raise ParameterTypeError(
          f"`{name}` must be one of make_private's DP settings {takes} (the arguments of "
          f"dp.keras.DPOptimizer). Received: {name}={value!r}")
  if l2_norm_clip is None and noise_multiplier is None and not dp_kwargs:
    return None
  settings = dict(dp_kwargs, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier)
  with warnings.catch_warnings():   # the optimizer made from them warns (noise 0) when used
    warnings.simplefilter("ignore")
    opt_lib.DPOptimizer(keras.optimizers.SGD(), **settings)   # its checks, before any change
  return settings


def make_private(model, *, l2_norm_clip=None, noise_multiplier=None, **dp_kwargs):
  """Turns a keras.Model (sequential, functional, subclassed, a keras_hub task) into its DP
  version in place (class `private_class(type(model))`) and returns it.

  By what the model is compiled with:
    * nothing: compile it later with a DP optimizer or, given the DP settings here, with a
      plain optimizer (or a name), which the first `compile` turns into its DP copy;
    * a plain Keras optimizer: the DP settings are required, and it is replaced now by its
      DP copy (`dp.keras.DPOptimizer`: same hyperparameters, fresh slots and step count),
      the compiled loss and metrics kept. Steps it took before are not private;
    * a DP optimizer: kept (giving DP settings too is refused).

  The step adds N(0, (z S)^2) noise to the sum of per-example gradients clipped to S, once per
  batch (McMahan et al. 2018, Section 7); the ledger records every step.

  Args:
    model: a keras.Model instance.
    l2_norm_clip: S, the clipping norm of each example's gradient (loss-gradient units), or
      None (no DP settings; give it with `noise_multiplier`).
    noise_multiplier: z, the noise standard deviation in units of S, or None.
    **dp_kwargs: dp.keras.DPOptimizer's other arguments (num_microbatches, clipping,
      max_physical_batch_size, dp_query instead of S and z, noise and its parameters, ...).

  Returns:
    the same object, now a DPModelMixin.

  Raises:
    ParameterTypeError: not a keras.Model, or an argument DPOptimizer does not take.
    PrivacyConfigError: a model compiled with a plain optimizer and no DP settings, DP
      settings with a model compiled with a DP optimizer or given TF Privacy's model
      arguments, a bad DP setting, or a trainable BatchNormalization (check_no_batch_mixing).
  """
  if not isinstance(model, keras.Model):
    raise ParameterTypeError(
        f"`model` must be a keras.Model instance. Received: model={model!r}")
  settings = _private_settings(l2_norm_clip, noise_multiplier, dp_kwargs)
  opt = _compiled_optimizer(model)
  compiled = opt is not None
  if opt is not None and not isinstance(opt, opt_lib.DPOptimizerBase) and settings is None:
    raise PrivacyConfigError(
        "`l2_norm_clip` and `noise_multiplier` must be given to make_private for a model "
        f"compiled with a plain Keras optimizer ({type(opt).__name__}): make_private(model, "
        "l2_norm_clip=1.0, noise_multiplier=1.1) turns it into its DP copy, keeping its "
        "hyperparameters, loss and metrics. Received: l2_norm_clip=None, noise_multiplier=None")
  given = None if settings is None else ", ".join(
      f"{k}={v!r}" for k, v in sorted(settings.items()) if v is not None)
  if settings is not None and isinstance(opt, opt_lib.DPOptimizerBase):
    raise PrivacyConfigError(
        "the DP settings must not be given to make_private for a model compiled with a DP "
        f"optimizer ({type(opt).__name__}), which holds them: call make_private(model) alone, "
        f"or compile with a plain Keras optimizer first. Received: {given}")
  if settings is not None and getattr(model, "_dp_tfp_settings", None):
    raise PrivacyConfigError(
        f"the DP settings must not be given to make_private for a {type(model).__name__} given "
        "TF Privacy's DP model arguments (l2_norm_clip, noise_multiplier) already: give them in "
        f"one place. Received: {given}")
  check_no_batch_mixing(model)
  if not isinstance(model, DPModelMixin):
    model.__class__ = private_class(type(model))
  if isinstance(opt, opt_lib.DPOptimizerBase) and opt is not model.optimizer:
    model.optimizer = opt   # compiled under mixed_float16 before make_private
  if settings is not None:
    model._dp_pending_settings = settings  # pylint: disable=protected-access
    if compiled:
      model._dp_apply_pending_settings()  # pylint: disable=protected-access
  if compiled:
    model._dp_optimizer()  # pylint: disable=protected-access
    model.train_function = None
  return model
