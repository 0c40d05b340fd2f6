"""DP versions of Keras 3 optimizers (McMahan et al., "A General Approach to Adding Differential
Privacy to Iterative Training Procedures", Section 7; DP-SGD of Abadi et al., "Deep Learning
with Differential Privacy", 2016, Algorithm 1).

`make_dp_optimizer_class(keras.optimizers.X)` returns a subclass of X whose gradients are
private: per-record gradients clipped to L2 norm S and summed, Gaussian noise of standard
deviation z S added once per logical batch, divided by the batch's denominator (records in
the batch; q n under Poisson sampling). Every step records its sampling event and its noise
draw's events in the optimizer's `ledger`. Plain gradients (`apply` from outside the private
path) are refused.

Microbatches (M): a record is a microbatch of k = ceil(B / M) examples, charged at
sensitivity 2S under replace-one sampling (step_sampling); M = B is one example per record.
Custom loops declare their sampling with `set_sampling(n, q, policy, sample_size)`.

This module is the Keras face; the DP step itself is `optimizer.private_step`
(`private_step.PrivateStep`).
"""

import gc
import weakref

import keras
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras.optimizer import custom_loops
from tf_dpiter.keras.optimizer import dp_config as dp_config_lib
from tf_dpiter.keras.optimizer import optimizer_config
from tf_dpiter.keras.optimizer import private_step as private_step_lib
from tf_dpiter.keras.optimizer import saved_ledger
from tf_dpiter.keras.optimizer import weight_fingerprints
from tf_dpiter.ledger import policies as ledger_policies

CLIPPING_MODES = dp_config_lib.CLIPPING_MODES
wide_template = chunking.wide_template   # re-exported: the dtype of the privacy arithmetic


# ---- one DP optimizer per trainable variable ------------------------------------------
# Rule: the epsilon of a model's weights is its DP optimizer's ledger's only when no other
# DP optimizer updates them (McMahan et al. 2018, Section 6: every noised step that touched
# the released weights is charged). So a DP optimizer claims the variables it updates before
# its first update and refuses one another live DP optimizer updated. One only built on them
# (`clone_model`'s copy, a loaded model's) claims nothing; a plain Keras optimizer is not
# concerned; a recompile releases the outgoing one's claims (its ledger is carried over). A
# probe whose updates are never released (auditing.check_sensitivity's) sets the class
# attribute named `UNCLAIMED`: it neither claims nor is refused.

# id(variable) -> (weakref to the variable, weakref to the DP optimizer that claimed it)
_OWNERS = {}
# The charge travels with the variables: id(variable) -> (weakref to the variable, [the
# ledger of every DP optimizer that claimed it], held strongly). A DP optimizer about to
# update a variable adopts the ledgers recorded on it (`check_variables`), so a layer's noised
# steps under a DP model that is gone are charged by the next one (once: `ledger.run_ids`).
_CHARGES = {}
# The class attribute of a probe optimizer whose updates are never released.
UNCLAIMED = "_dp_unclaimed_variables"


def _name(variable):
  return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


def fingerprints_deferred(optimizer):
  """True while a DP model's fit or train_on_batch runs `optimizer` (it checks and records the
  weights' fingerprints itself), or for an internal probe (weight_fingerprints.DEFERRED)."""
  return bool(getattr(optimizer, weight_fingerprints.DEFERRED, False))


def claim_variables(optimizer, variables):
  """Records `optimizer` as the DP optimizer updating `variables`.

  Raises:
    PrivacyConfigError: one of `variables` is updated by another live DP optimizer.
  """
  if getattr(optimizer, UNCLAIMED, False):
    return
  variables = list(variables)
  if all(_owner(v) is optimizer for v in variables):   # claimed before: every eager step
    return
  check_variables(optimizer, variables)
  if not tf.executing_eagerly() and not fingerprints_deferred(optimizer):
    # a custom loop's traced step: the weights it starts from are checked (not under a
    # distribution strategy, where they are not read here); its steps are then untracked
    # (weight_fingerprints._untracked) until the next record
    if not tf.distribute.has_strategy():
      weight_fingerprints.check(variables, "apply_private_gradients")
    weight_fingerprints.rebind(optimizer, variables)
  for v in variables:
    _OWNERS[id(v)] = (weakref.ref(v), weakref.ref(optimizer))
  _record_charges(optimizer, variables)


def _record_charges(optimizer, variables):
  """Records `optimizer`'s ledger on each of `variables` (`_CHARGES`)."""
  ledger = optimizer.private_step.existing_ledger
  if ledger is None:   # made before the first private step; nothing is charged without it
    return
  for key, (var_ref, _) in list(_CHARGES.items()):   # forget the dead variables
    if var_ref() is None:
      del _CHARGES[key]
  for v in variables:
    entry = _CHARGES.get(id(v))
    if entry is None or entry[0]() is not v:
      entry = _CHARGES[id(v)] = (weakref.ref(v), [])
    if not any(held is ledger for held in entry[1]):
      entry[1].append(ledger)


def recorded_ledgers(optimizer, variables):
  """The ledgers of DP optimizers other than `optimizer` recorded on `variables` (`_CHARGES`),
  each once: every one that charged a noised step these weights took."""
  own = optimizer.private_step.existing_ledger
  out = []
  for v in variables:
    entry = _CHARGES.get(id(v))
    if entry is None or entry[0]() is not v:
      continue
    out.extend(held for held in entry[1]
               if held is not own and not any(held is o for o in out))
  return out


def adopt_recorded_ledgers(optimizer, variables):
  """Merges into `optimizer`'s ledger, eagerly, the ledgers recorded on `variables` and those of
  the runs whose released values they hold (`weight_fingerprints.adopt_released`): every
  noised step the weights took is charged (McMahan et al. 2018, Section 6), each once
  (`ledger.run_ids`)."""
  ledgers = recorded_ledgers(optimizer, variables)
  with tf.init_scope():
    for ledger in ledgers:
      optimizer.private_step.adopt_ledger(*ledger.state())
  # and the runs whose released values they hold, copied by value (set_weights)
  weight_fingerprints.adopt_released(optimizer, variables)


def check_variables(optimizer, variables):
  """Refuses `variables` when another live DP optimizer claimed one of them (a train function
  traced before another optimizer took them over); else adopts the ledgers of the DP
  optimizers that updated them before (`adopt_recorded_ledgers`).

  Raises:
    PrivacyConfigError: as `claim_variables`.
  """
  if getattr(optimizer, UNCLAIMED, False):
    return
  variables = list(variables)
  for key, (var_ref, opt_ref) in list(_OWNERS.items()):   # forget the dead
    if var_ref() is None or opt_ref() is None:
      del _OWNERS[key]
  others = [_other(v, optimizer) for v in variables]
  if any(o is not None for o in others):   # an unreachable one (a reference cycle) is dead
    gc.collect()
    others = [_other(v, optimizer) for v in variables]
  for v, other in zip(variables, others):
    if other is not None:
      raise PrivacyConfigError(
          f"the trainable variable {_name(v)!r} is already updated by another DP optimizer "
          f"({type(other).__name__} {other.name!r}), whose ledger does not charge this "
          "optimizer's steps, nor this one's its steps: the shared weights would carry the "
          "privacy cost of both while each ledger reports one. Train one DP model holding both "
          "(e.g. one model with both outputs), give each model its own copy of the layer, or, "
          "to fine-tune a DP-trained model inside another, nest it in the new DP model and "
          "compile that one: it takes the nested model's ledger and its variables over"
          " (training the nested model on its own is then refused)")
  adopt_recorded_ledgers(optimizer, variables)


def _owner(variable):
  """The live DP optimizer that claimed `variable`, else None."""
  entry = _OWNERS.get(id(variable))
  return None if entry is None or entry[0]() is not variable else entry[1]()


def _other(variable, optimizer):
  """The live DP optimizer other than `optimizer` that claimed `variable`, else None."""
  other = _owner(variable)
  return None if other is optimizer else other


def release_variables(optimizer):
  """Forgets the claims of `optimizer` (replaced by a recompile, or its ledger taken over by an
  enclosing DP model's optimizer)."""
  for key, (_, opt_ref) in list(_OWNERS.items()):
    if opt_ref() is optimizer:
      del _OWNERS[key]


def _from_step(attr, doc):
  """A read-only property of the DP optimizer that reads `optimizer.private_step.<attr>`."""
  return property(lambda self: getattr(self.private_step, attr), doc=doc)


class DPOptimizerBase:
  """The Keras face of every DP optimizer class (module docstring); the DP step itself
  (query, clipping, noise, ledger) is `self.private_step` (private_step.PrivateStep)."""

  def __init__(self, l2_norm_clip=None, noise_multiplier=None, num_microbatches=None, *args,
               dp_query=None, max_physical_batch_size=None, clipping="auto", normalize=True,
               seed=None, ledger_journal=None, secure_mode=False, noise="iid",
               restart_every=None, num_bands=None, num_steps=None, band_strategy=None,
               num_buffers=None, min_separation=None, dp_config=None, plan=None, flags=None,
               sampling=None, accountant="rdp", **kwargs):
    """A DP optimizer: Keras' optimizer on the noised average of clipped per-record gradients.

    Args:
      l2_norm_clip: S, the L2 norm every record's gradient is clipped to (loss-gradient units).
      noise_multiplier: z: Gaussian noise of standard deviation z S is added to the clipped sum
        (for noise != "iid", the mechanism's multiplier).
      num_microbatches: M (None: one example per record).
      dp_query: instead of S, z: any DPQuery whose result is a sum over records.
      max_physical_batch_size: P, examples per physical chunk (noise once per logical batch).
      clipping: "auto" | "vectorized" | "fast".
      normalize: divide the noised sum by the denominator (the batch's records, or q n under
        Poisson sampling); False keeps the sum.
      seed: seeds the noise, for tests only (a seeded run is NOT private).
      ledger_journal: path of a ledger journal that DPModel.fit resumes and appends.
      secure_mode: the default GaussianSumQuery draws from os.urandom; no seed.
      noise: a `dp.keras.noise` mechanism, or its shorthand "iid" (DP-SGD) | "tree" | "band_mf"
        | "blt" with the flat keywords below (noise_mechanisms.from_shorthand).
      restart_every: "tree": steps between restarts of the tree (None: never).
      num_bands: "band_mf": the bands b of the banded matrix factorization.
      num_steps: "band_mf" / "blt": the steps n the strategy is optimized for.
      band_strategy: "band_mf": the banded strategy's name, or its matrix.
      num_buffers: "blt": the buffers d of the buffered linear Toeplitz strategy.
      min_separation: "band_mf" / "blt": the fewest steps between two participations of a
        record (cyclic sampling).
      dp_config: a `dp.keras.DPConfig` instead of the privacy keywords above.
      plan: alias of dp_config.
      flags: a `dp.keras.PerformanceFlags` instead of max_physical_batch_size and clipping.
      sampling: the sampling policy the run must declare (None: the one fit declares).
      accountant: "rdp" or "pld" (the plan's `epsilon`).
      *args: the Keras optimizer's own positional arguments (after the DP ones).
      **kwargs: the Keras optimizer's own keyword arguments (e.g. learning_rate).

    Raises:
      ParameterValueError: a bad setting, named with its value, or a plan given with privacy
        keywords.
    """
    plan = dp_config_lib.plan_of_arguments(
        dp_config, plan, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        num_microbatches=num_microbatches, dp_query=dp_query, normalize=normalize, seed=seed,
        secure_mode=secure_mode, noise=noise, sampling=sampling, accountant=accountant,
        noise_params=dict(restart_every=restart_every, num_bands=num_bands,
                          num_steps=num_steps, band_strategy=band_strategy,
                          num_buffers=num_buffers, min_separation=min_separation))
    flags = dp_config_lib.flags_of_arguments(flags, max_physical_batch_size=max_physical_batch_size,
                                             clipping=clipping)
    optimizer_config.check_ledger_journal(ledger_journal)
    optimizer_config.check_no_gradient_accumulation(kwargs.get("gradient_accumulation_steps"))
    super().__init__(*args, **kwargs)
    self._ledger_journal = ledger_journal
    self._private_apply = False
    self.private_step = private_step_lib.PrivateStep(self, plan, flags)

  @classmethod
  def from_budget(cls, epsilon, delta, epochs, batch_size, population_size, sampling="poisson",
                  *args, accountant="rdp", **kwargs):
    """An optimizer whose noise multiplier the accountant calibrated to (epsilon, delta).

    z is the smallest noise multiplier (relative 1e-4, rounded up) for which
    ceil(epochs * n / B) steps at q = B / n under `sampling` give epsilon <= the target at delta
    (budget.calibrated_noise; McMahan et al. 2018, Section 4). Train with the same batch_size,
    epochs and sampling. The calibration is logged and kept in `optimizer.calibration`.

    Args:
      epsilon: the target epsilon, > 0.
      delta: the target delta, in (0, 1).
      epochs: E, the passes over the data the run will train.
      batch_size: B, the (expected) batch size.
      population_size: n, the records in the training data.
      sampling: "poisson", "shuffle" or "fixed_size" (ledger.POLICIES).
      *args: the class' other positional arguments.
      accountant: "rdp" or "pld".
      **kwargs: the class' other keyword arguments: l2_norm_clip is required, noise_multiplier
        and dp_query are not accepted (nor Adam's own `epsilon`: use
        `dp.keras.make_private_with_epsilon`).

    Returns:
      an instance of cls.

    Raises:
      PrivacyConfigError: no l2_norm_clip, a noise_multiplier or dp_query given, or a bad target.
    """
    z, calib, args, kwargs = optimizer_config.calibrated_arguments(
        cls.__name__, epsilon, delta, epochs, batch_size, population_size, sampling,
        accountant, args, kwargs)
    opt = cls(*args, **kwargs)
    opt.calibration = calib
    return opt

  # ---- read-only views of the step's settings (PrivateStep attributes) ----------------
  l2_norm_clip = _from_step(
      "l2_norm_clip", "S, the per-record L2 clip (None with a custom dp_query).")
  noise_multiplier = _from_step(
      "noise_multiplier", "z, the noise multiplier (None with a custom dp_query).")
  num_microbatches = _from_step(
      "num_microbatches", "M, microbatches per batch (None: one example per record).")
  max_physical_batch_size = _from_step(
      "max_physical_batch_size", "P, examples per physical chunk (None: the whole batch).")
  clipping = _from_step("clipping", 'The clipping path: "auto", "vectorized" or "fast".')
  noise = _from_step("noise", 'The noise mechanism\'s name: "iid", "tree", "band_mf", "blt"...')
  noise_mechanism = _from_step("mechanism", "The noise mechanism object (dp.keras.noise).")
  dp_config = _from_step("plan", "The frozen DP plan (dp.keras.DPConfig).")
  plan = _from_step("plan", "The frozen DP plan (alias of dp_config).")
  flags = _from_step("flags", "The performance flags (dp.keras.PerformanceFlags).")
  ledger = _from_step("ledger", "The PrivacyLedger every private step writes to.")
  noise_generator = _from_step(
      "noise_generator", "The noise source of the query (PrivateStep.noise_generator).")
  uses_custom_query = _from_step(
      "custom_query", "True when the optimizer was built with a user's `dp_query` (not S, z).")

  @property
  def ledger_journal(self):
    """Path of the ledger journal DPModel.fit keeps (None: none unless fit is given one)."""
    return self._ledger_journal

  @property
  def noise_params(self):
    """The mechanism's parameters, defaults filled in (a copy; {} for "iid")."""
    return dict(self.private_step.noise_params)

  @property
  def dp_query(self):
    """The step's query in a QueryWithLedger recording in the optimizer's ledger (None until
    the sampling is known; a placeholder raising on use while a correlated noise waits for
    the build)."""
    return self.private_step.query or self.private_step.pending_query()

  @property
  def overflowed_records(self):
    """Records whose float16 gradient overflowed and were zeroed (chunking.unscale_records)."""
    return int(self.private_step.overflow_counter.numpy())

  @property
  def sampling_policy(self):
    """The sampling policy the ledger records (ledger.POLICIES), None before set_sampling."""
    sampling = self.private_step.sampling
    return None if sampling is None else sampling.policy

  def noise_state(self):
    """The correlated mechanism's state as numpy values (PrivateStep.noise_state)."""
    return self.private_step.noise_state()

  def save_noise_state(self, path):
    """Writes the correlated mechanism's noise state (tree, BandMF, BLT) to `path`, an .npz
    file: the one way to resume such a run in another process (`restore_noise_state`).

    THE FILE IS AS SECRET AS THE TRAINING DATA: it holds the noise added to the released
    weights (the tree's open nodes sum to its cumulative noise, Kairouz et al., "Practical
    and Private (Deep) Learning without Sampling or Shuffling", Section 3; BandMF's history
    and BLT's buffers hold past noise), so whoever holds it and the model can remove the
    noise (epsilon infinite). Keep it with the data, never with the model; delete it when
    the run ends. One implementation: `PrivateStep.save_noise_state`.

    Args:
      path: the file to write (a str or os.PathLike; numpy adds ".npz" if missing).

    Raises:
      PrivacyConfigError: the mechanism is not correlated (noise="iid") or not built yet.
    """
    self.private_step.save_noise_state(path)

  def restore_noise_state(self, path):
    """Restores the noise state `save_noise_state` wrote, so a correlated run restored from
    a model file or checkpoint of the same step continues exactly. Call it once the optimizer
    is built (load_model builds it; else `optimizer.build(model.trainable_variables)`). The
    next private step checks that the ledger holds exactly the samples this state drew: a
    state of another step is refused there. The file is as secret as the data
    (`save_noise_state`). One implementation: `PrivateStep.restore_noise_state`.

    Args:
      path: the .npz file `save_noise_state` wrote.

    Raises:
      PrivacyConfigError: the mechanism is not correlated or not built, or the file holds
        another mechanism's state or other shapes.
    """
    self.private_step.restore_noise_state(path)

  # ---- the step, for users (thin delegations) -----------------------------------------

  def set_sampling(self, population_size, selection_probability, policy="poisson",
                   sample_size=0, steps_per_pass=None):
    """Declares how batches are sampled; the ledger records it with every step.

    Args:
      population_size: n, the records batches are drawn from (public).
      selection_probability: q (Poisson), or B / n for the other policies.
      policy: one of ledger.POLICIES ("poisson", "shuffle", "fixed_size", ...).
      sample_size: the batch size B (expected under Poisson, 0 when unknown; the groups under
        "cyclic_poisson").
      steps_per_pass: under "shuffle", the steps of one pass as the loop makes them
        (floor(n / B) with drop_remainder), or None: ceil(n / B).

    Returns:
      True when the recorded policy or record unit changed (the step must be retraced).

    Raises:
      ParameterTypeError: `sample_size` (or n, q) is not a number, e.g. None.
      PrivacyConfigError: a value out of range, microbatches under add/remove, a sampling
        the mechanism is not accounted under, or a policy whose record is a user
        ("user_poisson"), or a client ("client_poisson", "client_fixed_size":
        `step_sampling.check_unit`): the step would clip each example while the ledger
        states S per user or client.
    """
    if ledger_policies.get(policy).unit == "user":
      raise PrivacyConfigError(validation.message(
          "policy", "a policy whose record is an example or a microbatch when declared by "
          "hand (the step would clip each example, while \"user_poisson\" states the "
          "sensitivity S per user). For user-level DP train with model.fit on "
          "dp.data.poisson_user_batches, which groups each user's rows into one record", policy))
    return self.private_step.set_sampling(population_size, selection_probability, policy,
                                          sample_size, steps_per_pass)

  def resolve_clipping(self, model=None, input_specs=None):
    """"vectorized" or "fast": the per-example clipping the step uses for `model`.

    Args:
      model: the keras.Model the optimizer trains.
      input_specs: optional nest of tensors/specs shaped like a batch (for the probe).

    Returns:
      "vectorized" or "fast".
    """
    return self.private_step.resolve_clipping(model, input_specs)

  def prepare_mechanism(self, variables):
    """Builds a correlated mechanism on `variables` (PrivateStep.prepare_mechanism).

    Args:
      variables: the model's trainable variables.
    """
    self.private_step.prepare_mechanism(variables)

  def compute_private_gradients(self, loss_fn, variables, data=None, mask=None, tape=None,
                                model=None):
    """Noised average of clipped per-record gradients, aligned with `variables`
    (custom_loops.compute_private_gradients).

    Args:
      loss_fn: with `data`: loss_fn(record_data) gives one record's losses; without: loss_fn()
        (or, with `tape`, the tensor itself) is the vector [B] of per-example losses.
      variables: the variables to differentiate.
      data: a nest of [B, ...] tensors, or None (the second form).
      mask: float [B] of 0/1, padding rows 0 (None: every row is a record).
      tape: the GradientTape the loss tensor was computed under (second form).
      model: the keras.Model loss_fn runs, probed for batch mixing (required by the second form).

    Returns:
      the noised averages, one per variable.
    """
    return custom_loops.compute_private_gradients(self.private_step, loss_fn, variables, data,
                                                  mask, tape, model)

  def minimize(self, loss, var_list, tape=None, mask=None, model=None):
    """One private step on a vector loss [B] (per-example losses).

    Args:
      loss: a tensor computed under `tape`, or a callable returning it (tape made here).
      var_list: the variables (or a callable returning them).
      tape: as compute_private_gradients.
      mask: as compute_private_gradients.
      model: required: the keras.Model that computed the losses, probed for batch mixing.

    Returns:
      the base optimizer's `apply` result.

    Raises:
      ParameterValueError: a loss tensor without its tape, a scalar loss, no model=, a model
        that mixes examples or cannot be probed, or see compute_private_gradients.
    """
    var_list = list(var_list() if callable(var_list) and not isinstance(var_list, list)
                    else var_list)
    if not callable(loss) and tape is None:
      raise ParameterValueError("minimize with a loss tensor needs the tape it was computed under "
                                "(tape=...), or pass a callable loss")
    grads = self.compute_private_gradients(loss, var_list, mask=mask,
                                           tape=None if callable(loss) else tape, model=model)
    return self.apply_private_gradients(grads, var_list)

  def restore_ledger(self, ledger, key=None):
    """Supplies the run's ledger to a restored optimizer (see saved_ledger.restore_ledger).

    Args:
      ledger: a PrivacyLedger, a signed ledger dict or a ledger JSON path.
      key: its HMAC key.

    Returns:
      the optimizer's ledger.
    """
    return saved_ledger.restore_ledger(self, ledger, key)

  # ---- build and update ---------------------------------------------------------------

  def build(self, variables):
    """Keras' build, then (noise != "iid") the mechanism's query and state variables.

    Args:
      variables: the trainable variables the optimizer updates.
    """
    super().build(variables)
    self.private_step.build_mechanism(variables)

  def synchronize_noise(self, strategy):
    """Makes the noise generator on every worker of a MultiWorkerMirroredStrategy a copy of
    the chief's, so that the workers add one noise, not W (PrivateStep.synchronize_noise).
    `fit` does it; a custom loop calls it once on every worker before training, outside
    `strategy.scope()` and any tf.function; its private step is refused until then.

    Args:
      strategy: the tf.distribute strategy.

    Raises:
      PrivacyConfigError: secure_mode noise (no state to share).
    """
    self.private_step.synchronize_noise(strategy)

  # not converted by AutoGraph: no user callable, no tensor-dependent Python control flow
  @tf.autograph.experimental.do_not_convert
  def apply_private_gradients(self, grads, trainable_variables):
    """Applies gradients that came out of `noised_average`, or (traced) a function of them.

    Args:
      grads: the noised averages, one per variable.
      trainable_variables: the variables.

    Returns:
      the base optimizer's `apply` result.

    Raises:
      PrivacyConfigError: another live DP optimizer updated one of `trainable_variables`
        (`claim_variables`; checked before the first update, eagerly or when traced), or
        their values changed outside the DP optimizer since its last recorded update
        (weight_fingerprints.check: eagerly before every step, when traced before the
        first).
      tf.errors.InvalidArgumentError: the ledger holds no sample for this update (plain
        gradients; under XLA the update is NaN instead).
      PrivacyConfigError: outside the library's own train step, a gradient that is not a
        noised result of `compute_private_gradients` or, traced, a function of one, of the
        updated weights, of the optimizer's own variables and of scalar constants
        (update_binding: plain tape gradients after a dropped private result, a closed-over
        batch of any dtype, a file read, another variable; eagerly, any post-processing).
    """
    deferred = fingerprints_deferred(self)   # fit, train_on_batch
    eager = tf.executing_eagerly() and not deferred
    if eager:   # a custom loop's eager step: weights changed since its last step are refused
      weight_fingerprints.check(trainable_variables, "apply_private_gradients",
                                record_with=self)
    claim_variables(self, trainable_variables)
    # bound to a noised result (update_binding): every update but the library's own train
    # step's (a custom loop's, a train_step override's under fit or train_on_batch)
    if not (getattr(self, "_dp_own_step", False) or getattr(self, UNCLAIMED, False)):
      self.private_step.require_bound_update(grads, variables=trainable_variables)
    # a custom loop's traced update: the digests of the values it starts from and leaves,
    # written in the graph (weight_fingerprints.traced_update)
    traced = None if eager or deferred else weight_fingerprints.traced_update(
        self, trainable_variables)
    if traced is not None:   # what the step traces after the update: walked at a statement
      self.private_step.note_traced_update(trainable_variables)
    self._private_apply = True
    # one charged sample per update
    grads, charged = self.private_step.charged_gradients(
        [g if g is None else tf.cast(g, v.dtype) for g, v in zip(grads, trainable_variables)])
    # `iterations` waits for the gradients, as the ledger's write for the clipped sum (a
    # failed get_next at an epoch's end counts no iteration)
    data = [] if tf.executing_eagerly() else [g for g in grads if g is not None][:1] + charged
    try:
      with tf.control_dependencies(data):
        result = super().apply(grads, trainable_variables)
    finally:
      self._private_apply = False
    if traced is not None:
      traced()
    if eager:
      weight_fingerprints.record(self, trainable_variables)
    return result

  def _all_reduce_sum_gradients(self, grads_and_vars):
    """Keras' sum of the gradients over the replicas before the update, kept under several
    replicas (`noised_average` divides by their number for it) and skipped under one, where it
    is the value itself formed through one Identity op per variable. The same values are
    applied."""
    if (getattr(self, "_private_apply", False)
        and tf.distribute.get_strategy().num_replicas_in_sync == 1):
      return list(grads_and_vars)
    return super()._all_reduce_sum_gradients(grads_and_vars)  # pylint: disable=no-member

  def finalize_variable_values(self, var_list):
    """Keras' end of training: with `use_ema=True` the weights become the optimizer's moving
    average of the iterates (Keras' `fit` calls this after its last epoch), a function of the
    run's checked states (post-processing: Dwork and Roth, "The Algorithmic Foundations of
    Differential Privacy", Proposition 2.1). When the weights and the averages were states of
    the run just before (weight_fingerprints.changed), the averaged weights are recorded as
    one, so the checks after it (a callback's on_train_end, a statement) accept them.

    Args:
      var_list: the model's trainable variables.
    """
    if not self.use_ema:
      super().finalize_variable_values(var_list)  # pylint: disable=no-member
      return
    var_list = list(var_list)
    unrecorded = weight_fingerprints.changed(var_list)   # the averages too (optimizer_state)
    super().finalize_variable_values(var_list)  # pylint: disable=no-member
    if not unrecorded:
      weight_fingerprints.record(self, var_list)

  def apply(self, grads, trainable_variables=None):
    """Refuses plain gradients (the private path goes through apply_private_gradients).

    Args:
      grads: as keras.optimizers.Optimizer.apply.
      trainable_variables: as keras.optimizers.Optimizer.apply.

    Returns:
      the base optimizer's `apply` result (inside the private path only).

    Raises:
      PrivacyConfigError: called from outside the private path.
    """
    if not self._private_apply:
      raise PrivacyConfigError(
          f"{type(self).__name__}.apply/apply_gradients received plain (non-private) "
          "gradients, outside the private path. Gradients from optimizer.compute_private_gradients are applied with "
          "optimizer.apply_private_gradients(grads, variables) (not apply_gradients); "
          "otherwise train a DP model (dp.keras.DPSequential / dp.keras.make_private) or use "
          "optimizer.minimize with per-example losses")
    return super().apply(grads, trainable_variables)

  # ---- serialization ------------------------------------------------------------------

  def get_config(self):
    """Keras config plus the DP entries (optimizer_config.dp_config): the settings, a custom
    dp_query with its global state ("dp_global_state"), the mechanism's parameters, and
    "dp_ledger", the ledger's signed dict that from_config loads (saved_ledger).

    Returns:
      the config dict.
    """
    config = super().get_config()
    config.update(optimizer_config.dp_config(self))
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """Inverse of get_config (a serialized dp_query is rebuilt; the query state resumed).

    Args:
      config: a get_config dict.
      custom_objects: for Keras deserialization.

    Returns:
      the optimizer.
    """
    config, state, ledger = optimizer_config.split_config(config, custom_objects)
    opt = super().from_config(config, custom_objects=custom_objects)
    opt.private_step.restore_saved(state, ledger)
    return opt


DPOptimizerMixin = DPOptimizerBase   # the older name (existing code and saved models)


_CLASS_CACHE = {}
_READY_NAMES = {"SGD": "DPKerasSGDOptimizer", "Adam": "DPKerasAdamOptimizer",
                "Adagrad": "DPKerasAdagradOptimizer", "RMSprop": "DPKerasRMSpropOptimizer",
                "AdamW": "DPKerasAdamWOptimizer"}


def make_dp_optimizer_class(cls):
  """DP subclass of any keras.optimizers.Optimizer subclass (a user's own too), taking
  DPOptimizerBase's arguments before the base class' own; registered for Keras serialization.

  Args:
    cls: a keras.optimizers.Optimizer subclass.

  Returns:
    the DP subclass (cached: the same class for the same cls).

  Raises:
    ParameterValueError: cls is not an Optimizer subclass.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
    raise ParameterValueError(f"cls must be a keras.optimizers.Optimizer subclass, got {cls!r}")
  if issubclass(cls, DPOptimizerBase):
    return cls
  if cls in _CLASS_CACHE:
    return _CLASS_CACHE[cls]
  name = _READY_NAMES.get(cls.__name__) if cls.__module__.startswith("keras") else None
  name = name or f"DP{cls.__name__}"
  new_cls = type(name, (DPOptimizerBase, cls), {
      "__doc__": f"DP version of {cls.__module__}.{cls.__qualname__} (see DPOptimizerBase).",
      "__module__": __name__,
  })
  new_cls = keras.saving.register_keras_serializable(package="tf_dpiter", name=name)(new_cls)
  _CLASS_CACHE[cls] = new_cls
  return new_cls


def DPOptimizer(optimizer, l2_norm_clip=None, noise_multiplier=None, num_microbatches=None,  # pylint: disable=invalid-name
                dp_query=None, max_physical_batch_size=None, clipping="auto", normalize=True,
                seed=None, ledger_journal=None, secure_mode=False, noise="iid", *, dp_config=None,
                plan=None, flags=None, sampling=None, accountant="rdp", **noise_params):
  """DP copy of a Keras optimizer instance (same hyperparameters; fresh state).

  Either (l2_norm_clip, noise_multiplier) or dp_query (a sum query, e.g. a NestedQuery
  over the trainable variables' list) must be given.

  Args:
    optimizer: a plain keras.optimizers.Optimizer instance.
    l2_norm_clip: S, the per-record L2 clip (as DPOptimizerBase.__init__).
    noise_multiplier: z, the noise standard deviation over S.
    num_microbatches: M (None: one example per record).
    dp_query: instead of S, z: any DPQuery whose result is a sum over records.
    max_physical_batch_size: P, examples per physical chunk.
    clipping: "auto" | "vectorized" | "fast".
    normalize: divide the noised sum by the denominator.
    seed: seeds the noise, for tests only (NOT private).
    ledger_journal: path of a ledger journal DPModel.fit resumes and appends.
    secure_mode: draw the noise from os.urandom (no seed).
    noise: a dp.keras.noise mechanism, or "iid" | "tree" | "band_mf" | "blt".
    dp_config: a dp.keras.DPConfig instead of the privacy arguments.
    plan: alias of dp_config.
    flags: a dp.keras.PerformanceFlags instead of max_physical_batch_size and clipping.
    sampling: the sampling policy the run must declare (None: fit's).
    accountant: "rdp" or "pld".
    **noise_params: the shorthand's flat parameters (keras.noise_mechanisms).

  Returns:
    an instance of make_dp_optimizer_class(type(optimizer)).

  Raises:
    ParameterValueError: not a plain Keras optimizer instance, or a bad DP setting.
  """
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    raise ParameterValueError(f"optimizer must be a keras.optimizers.Optimizer instance, got {optimizer!r}")
  if isinstance(optimizer, DPOptimizerBase):
    raise ParameterValueError(f"optimizer is already a DP optimizer ({type(optimizer).__name__})")
  cls = make_dp_optimizer_class(type(optimizer))
  config = optimizer_config.constructor_config(optimizer)
  return cls(l2_norm_clip, noise_multiplier, num_microbatches, dp_query=dp_query,
             max_physical_batch_size=max_physical_batch_size, clipping=clipping,
             normalize=normalize, seed=seed, ledger_journal=ledger_journal,
             secure_mode=secure_mode, noise=noise, dp_config=dp_config, plan=plan, flags=flags,
             sampling=sampling, accountant=accountant, **noise_params, **config)


DPKerasSGDOptimizer = make_dp_optimizer_class(keras.optimizers.SGD)
DPKerasAdamOptimizer = make_dp_optimizer_class(keras.optimizers.Adam)
DPKerasAdagradOptimizer = make_dp_optimizer_class(keras.optimizers.Adagrad)
DPKerasRMSpropOptimizer = make_dp_optimizer_class(keras.optimizers.RMSprop)
DPKerasAdamWOptimizer = make_dp_optimizer_class(keras.optimizers.AdamW)
