"""Keras callbacks reading the privacy ledger (McMahan et al. 2018, Section 6: accounting post hoc).

`PrivacyMeter` writes epsilon (and delta) into the epoch logs and can plot it;
`StopAtPrivacyBudget` stops training before a step would exceed (epsilon, delta);
`LedgerExport` and `LedgerJournal` are in `callbacks.ledger`. Epsilon is always computed from
what the ledger recorded (sampling policy, relation and passes included), never from the
settings.
"""

import math
import os
import warnings
import weakref

import dp_accounting as dpa
import keras

from tf_dpiter import accounting
from tf_dpiter import ledger as ledger_lib
from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import validation
from tf_dpiter.accounting import lookahead
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.callbacks.ledger import model_ledger
from tf_dpiter.ledger import policies as ledger_policies


def _halt_private_steps(model, halted):
  """Makes a DP model's train function refuse (or again allow) every further step; a model
  without DP train function (custom loops) only gets `stop_training`."""
  halt = getattr(model, "halt_private_steps", None)
  if halt is not None:
    halt(halted)


def _gaussian_z(queries):
  """Eq. (1) noise multiplier per unit of clip, (sum_g (S_g / sigma_g)^2)^(-1/2), or None."""
  if not queries or any(q.get("type") != "gaussian" for q in queries):
    return None
  return accounting.effective_noise_multiplier([q["l2_norm_clip"] for q in queries],
                                               [q["stddev"] for q in queries])


def epsilon_if_poisson(ledger_dict, delta, accountant="rdp"):
  """Epsilon had every shuffled step been a Poisson sample with the same q, noise and count.

  Each "shuffle" run of T steps with batch b of n and Eq. (1) multiplier z (over the clip
  S) becomes T Poisson-sampled Gaussian mechanisms (q = b / n, z) under add/remove-one
  adjacency (sensitivity S): what `fit(x, y, batch_size=b)` with sampling="poisson" would
  have cost (McMahan et al. 2018, Sections 1 and 5). Poisson runs are kept as they are. Returns None
  when the ledger has no shuffle run or a query that is not Gaussian.
  """
  events, any_shuffle = [], False
  for run in ledger_dict["runs"]:
    z = _gaussian_z(run["queries"])
    if z is None or run["policy"] not in (ledger_lib.SHUFFLE, ledger_lib.POISSON):
      return None
    any_shuffle |= run["policy"] == ledger_lib.SHUFFLE
    if z == 0:
      return math.inf
    if math.isfinite(z):
      event = dpa.PoissonSampledDpEvent(run["selection_probability"], dpa.GaussianDpEvent(z))
      events.append(dpa.SelfComposedDpEvent(event, int(run["count"])))
  if not any_shuffle:
    return None
  acc = accounting.make_accountant(accountant)
  acc.compose(dpa.ComposedDpEvent(events))
  return float(acc.get_epsilon(delta))


# The PrivacyMeters of the fit running on each model: DPModel.fit's first internal callback
# has them write their logs before any user callback runs.
_FIT_METERS = weakref.WeakKeyDictionary()


# The fit in progress on each model says how many passes / epochs its next steps start (its
# sampler knows where the pass in progress ends): `begin_fit` records it, so that this module
# (below the model sub-package) never imports the fit's machinery.
_PASSES_AHEAD = weakref.WeakKeyDictionary()


def begin_fit(model, passes_ahead=None):
  """Forgets the meters of earlier fits on `model` (called by the first callback of a fit);
  `passes_ahead`: the fit's `(model, count) -> passes / epochs the next count steps start, or
  None` (None: no sampler counts them)."""
  _FIT_METERS[model] = []
  if passes_ahead is None:
    _PASSES_AHEAD.pop(model, None)
  else:
    _PASSES_AHEAD[model] = passes_ahead


def write_privacy_logs(model, epoch, logs):
  """Has every PrivacyMeter of the running fit on `model` write its keys into the `epoch`'s
  `logs` (updated in place; None: only epsilon is computed)."""
  for meter in _FIT_METERS.get(model, ()):
    meter.write_logs(epoch, logs)


# Logs the ledger's accounting writes (post-processing of the noised steps): a callback may act
# on them.
LEDGER_LOG_KEYS = ("epsilon", "delta", "epsilon_if_poisson", "epsilon_gdp_approximate")


def _acts_on_monitor(callback):
  """Whether `callback` decides something from logs[callback.monitor]: EarlyStopping (the run's
  length, restore_best_weights), ReduceLROnPlateau (later steps' learning rate),
  ModelCheckpoint with save_best_only (the weights kept), any other callback with a `monitor`."""
  if not isinstance(getattr(callback, "monitor", None), str):
    return False
  if isinstance(callback, keras.callbacks.ModelCheckpoint):
    return bool(callback.save_best_only)
  return True


def _flattened(callbacks):
  """(position, callback) of `callbacks` and of every callback list nested in them
  (keras.callbacks.CallbackList dispatches each hook to the callbacks it holds)."""
  for i, callback in enumerate(callbacks):
    inner = getattr(callback, "callbacks", None)
    if isinstance(inner, (list, tuple)):
      yield from ((f"{i}].callbacks[{j}", c) for j, c in _flattened(inner))
    else:
      yield i, callback


def check_monitors(callbacks, has_validation_data, metric_names=()):
  """Refuses callbacks of a DP fit that act on a training metric.

  The loss and metrics fit logs are computed from the private batches without noise
  (McMahan et al. 2018, Section 6: only the noised sums are released): a decision taken from
  them (stop, restore the best weights, lower the learning rate, keep the best checkpoint) is
  not post-processing, and one record can change it (TerminateOnNaN reads the loss too). The
  user's own callbacks that read logs["loss"] cannot be seen here. Allowed: the ledger's keys
  (LEDGER_LOG_KEYS), and "val_*" metrics when fit has validation data (held-out records).

  Args:
    callbacks: the callbacks passed to fit (a list; CallbackLists inside it are searched).
    has_validation_data: whether fit is given validation data.
    metric_names: the names the compiled training metrics log under: one named like a
      ledger key or "val_*" would pass for it, so such names are refused.

  Raises:
    PrivacyConfigError: a callback acting on a training metric (TerminateOnNaN included), or
      on "val_*" without validation data; a compiled metric named like an allowed key.
  """
  taken = [n for n in metric_names if n in LEDGER_LOG_KEYS or n.startswith("val_")]
  if taken:
    raise PrivacyConfigError(
        f"a compiled metric must not be named {taken[0]!r} in a DP fit: that name is kept for "
        "the ledger's epsilon or a held-out 'val_*' metric, which callbacks may monitor, while "
        "a training metric is computed from the private batches without noise. Rename it. "
        f"Received: metric names {list(metric_names)}")
  for i, callback in _flattened(callbacks):
    if isinstance(callback, keras.callbacks.TerminateOnNaN):
      raise PrivacyConfigError(
          f"`callbacks[{i}]` must not be TerminateOnNaN in a DP fit: it stops on the un-noised "
          "training loss, which one record with a non-finite loss makes inf (the private step "
          "itself gives such a record no influence). Remove it. Received: "
          f"callbacks[{i}]=TerminateOnNaN()")
    if not _acts_on_monitor(callback):
      continue
    key = callback.monitor
    if key in LEDGER_LOG_KEYS or (key.startswith("val_") and has_validation_data):
      continue
    raise PrivacyConfigError(
        f"`callbacks[{i}]` must not act on a training metric in a DP fit: "
        f"{type(callback).__name__}(monitor={key!r}) decides from the un-noised "
        "loss or metrics of the private batches, which the privacy guarantee does not cover "
        "(one record can change the decision). Monitor a 'val_*' metric of held-out "
        "validation_data (not protected either) or 'epsilon' from dp.keras.PrivacyMeter. "
        f"Received: callbacks[{i}].monitor={key!r}"
        + ("" if has_validation_data else " and no validation data"))


class PrivacyMeter(keras.callbacks.Callback):
  """Adds logs['epsilon'] and logs['delta'] at the end of every epoch (and on train end).

  Inside `DPModel.fit` the logs are written before any other callback sees them. With
  shuffled passes in the ledger, logs['epsilon_if_poisson'] is what Poisson sampling with the
  same q, noise and steps would have cost. Under accountant="gdp" (an approximation, not an
  upper bound) the value goes to logs['epsilon_gdp_approximate'], never logs['epsilon'].

  Args:
    delta: the delta of the (epsilon, delta) statement, in (0, 1).
    accountant: a registered accountant ("rdp", "pld": upper bounds) or "gdp" (an
      approximation, labelled so).
    verbose: print epsilon after every epoch.
    plot: optional PNG path: at the end of training, epsilon over steps
      (`accounting.epsilon_curve`, up to `plot_points` points; dotted lines at epoch ends).
    plot_points: points of the plotted curve.

  Raises:
    ParameterValueError: `plot` is neither None nor a PNG file path.
    PrivacyConfigError: delta outside (0, 1) (validation.check_delta).
  """

  def __init__(self, delta, accountant="rdp", verbose=0, plot=None, plot_points=50):
    super().__init__()
    self.delta = validation.check_delta("delta", delta)
    accounting.check_accountant(accountant)
    self.accountant = accountant
    self.epsilon_key = "epsilon" if accounting.accountant.is_bound_accountant(accountant) else (
        "epsilon_gdp_approximate")
    self.verbose = verbose
    if plot is not None and (not isinstance(plot, (str, os.PathLike)) or not os.fspath(plot)):
      raise ParameterValueError(f"plot must be None or a PNG file path, got {plot!r}")
    self.plot = plot
    self.plot_points = plot_points
    self.epsilon = None
    self.epoch_steps = []
    self._written = None
    self._pending = None

  def _epsilon(self):
    ledger = model_ledger(self.model)
    if int(ledger.sample_count.numpy()) == 0:
      return 0.0
    return float(accounting.epsilon(ledger, self.delta, accountant=self.accountant))

  def on_train_begin(self, logs=None):
    """keras.callbacks.Callback.on_train_begin: registers the meter with DPModel.fit.

    Args:
      logs: the dict of metric values Keras passes to the callback.
    """
    self._written = None
    self.epoch_steps = []
    _FIT_METERS.setdefault(self.model, []).append(self)

  def write_logs(self, epoch, logs):
    """Writes epsilon, delta (and epsilon_if_poisson) for `epoch` into `logs` (once).

    Args:
      epoch: the epoch index (from 0); epsilon is computed once per epoch.
      logs: the epoch's logs dict, updated in place, or None.
    """
    if self._written is None or self._written[0] != epoch:
      self.epsilon = self._epsilon()
      if_poisson = None
      if self.epsilon > 0 and accounting.accountant.is_bound_accountant(self.accountant):
        if_poisson = epsilon_if_poisson(model_ledger(self.model).to_dict(), self.delta,
                                        self.accountant)
      self._written = (epoch, if_poisson)
      self.epoch_steps.append(int(model_ledger(self.model).sample_count.numpy()))
    if logs is not None:
      logs[self.epsilon_key] = self.epsilon
      logs["delta"] = self.delta
      if self._written[1] is not None:
        logs["epsilon_if_poisson"] = self._written[1]

  def on_epoch_end(self, epoch, logs=None):
    """Writes epsilon into `logs`; with `verbose`, prints it once Keras' progress bar has
    ended its line.

    Args:
      epoch: the index of the epoch, from 0 (Keras).
      logs: the dict of metric values Keras passes to the callback.
    """
    self.write_logs(epoch, logs)
    if self.verbose:
      if_poisson = self._written[1]
      extra = "" if if_poisson is None else f" (Poisson sampling would give {if_poisson:.4g})"
      if accounting.accountant.is_bound_accountant(self.accountant):
        value = f"epsilon = {self.epsilon:.4g}"
      else:
        value = (f"epsilon ~ {self.epsilon:.4g} (GDP: approximate, not an upper bound; use "
                 "accountant='pld' or 'rdp' for a guarantee)")
      self._pending = f"epoch {epoch + 1}: {value} at delta = {self.delta:g}{extra}"
      if (self.params or {}).get("verbose") not in (1, "auto"):   # no progress bar on its line
        self._print_pending()

  def on_epoch_begin(self, epoch, logs=None):
    self._print_pending()

  def _print_pending(self):
    if getattr(self, "_pending", None):
      print(self._pending, flush=True)
    self._pending = None

  def on_train_end(self, logs=None):
    """keras.callbacks.Callback.on_train_end: prints a pending epsilon line, unregisters the
    meter, writes the plot.

    Args:
      logs: the dict of metric values Keras passes to the callback.
    """
    self._print_pending()
    meters = _FIT_METERS.get(self.model, [])
    if self in meters:
      meters.remove(self)
    if self.plot is not None:
      self.write_plot(self.plot)

  def write_plot(self, path):
    """Writes the PNG of epsilon over the steps the ledger holds; returns path (None if empty).

    Args:
      path: the PNG file to write (str or path-like).

    Returns:
      What accounting.plot_epsilon_curve returns for `path`, or None (with a UserWarning)
      when the ledger holds no step.

    Raises:
      PrivacyConfigError: the model has no privacy ledger.
    """
    ledger = model_ledger(self.model)
    if int(ledger.sample_count.numpy()) == 0:
      warnings.warn(f"PrivacyMeter(plot={path!r}): the ledger holds no step, nothing drawn",
                    UserWarning, stacklevel=2)
      return None
    curve = accounting.epsilon_curve(ledger, self.delta, accountant=self.accountant,
                                     num_points=self.plot_points)
    return accounting.plot_epsilon_curve(curve, path, epoch_steps=self.epoch_steps)


class StopAtPrivacyBudget(keras.callbacks.Callback):
  """Stops training before the next step would make epsilon (at delta) exceed the budget.

  After each execution it asks whether the ledger extended by steps_per_execution copies of
  its last sample (before the first step: the optimizer's Gaussian settings; a custom query
  is not checked) would exceed `epsilon`; if so, training stops, so the ledger never holds a
  step past the budget (assuming the next step is like the last one).

  Args:
    epsilon: the budget, a finite number > 0.
    delta: the delta of the budget, in (0, 1).
    accountant: "rdp" or "pld" (upper bounds); "gdp", an approximation, is refused.
    verbose: print the line saying why training stopped.

  Raises:
    ParameterTypeError: a non-numeric epsilon or delta.
    PrivacyConfigError: a bad epsilon or delta.
    BudgetConfigError: accountant="gdp" (or an accountant that is not available).
  """

  def __init__(self, epsilon, delta, accountant="rdp", verbose=0):
    super().__init__()
    self.epsilon = float(validation.check_positive("epsilon", epsilon))
    self.delta = validation.check_delta("delta", delta)
    self.accountant = accounting.accountant.check_bound_accountant(accountant,
                                                                   "StopAtPrivacyBudget")
    self.verbose = verbose
    self.stopped_at_step = None
    self._hidden_metrics = None
    self._budget = lookahead.StepBudget(self.epsilon, self.delta, self.accountant)

  def _predicted_sample(self):
    """The first step, from the optimizer's Gaussian settings, as a PlannedSample; None when
    no sampling is declared yet or the optimizer has a custom query."""
    opt = self.model.optimizer
    query = getattr(opt, "dp_query", None)
    if query is None or getattr(opt, "uses_custom_query", True):
      return None
    s = opt.l2_norm_clip
    event = dp_query_lib.GaussianSumEvent(s, dp_query_lib.gaussian_stddev(s, opt.noise_multiplier))
    return lookahead.PlannedSample(
        float(query.population_size), float(query.selection_probability), (event,),
        query.policy, float(query.sample_size), query.examples_per_record)

  def _planned(self):
    """(ledger, the next step like the last one (or predicted), steps per execution)."""
    ledger = model_ledger(self.model)
    planned = lookahead.last_sample(ledger) or self._predicted_sample()
    return ledger, planned, int(getattr(self.model, "steps_per_execution", 1) or 1)

  def _passes_ahead(self, planned, ahead):
    """The passes / epochs the next `ahead` steps start, from the fit's sampler (it knows
    where the pass in progress ends); None outside fit or for other policies."""
    if not ledger_policies.get(planned.policy).pass_charged:
      return None
    count = _PASSES_AHEAD.get(self.model)
    return None if count is None else count(self.model, ahead)

  def next_step_epsilon(self):
    """Epsilon if the next execution (steps_per_execution steps like the last one) is run."""
    ledger, planned, ahead = self._planned()
    if planned is None:
      return None
    return lookahead.epsilon_after(ledger, self.delta, planned, ahead, self.accountant,
                                   extra_passes=self._passes_ahead(planned, ahead))

  def _exceeds(self):
    ledger, planned, ahead = self._planned()
    if planned is None:
      return False
    extra = self._passes_ahead(planned, ahead)
    if extra is not None:
      # pass-charged policies: the next steps cost only the passes they start (none while
      # the pass in progress lasts), which the sampler knows and a step count does not.
      eps = lookahead.epsilon_after(ledger, self.delta, planned, ahead, self.accountant,
                                    extra_passes=extra)
      return eps > self.epsilon
    return self._budget.exceeds(ledger, planned, ahead)

  def _check(self, step_label):
    if not self._exceeds():
      return False
    eps = self.next_step_epsilon()
    # stop_training ends fit after this step; the halt makes the DP model's train function
    # refuse any further step (also the first one, when checked before it).
    self.model.stop_training = True
    _halt_private_steps(self.model, True)
    self.stopped_at_step = int(model_ledger(self.model).sample_count.numpy())
    message = (f"StopAtPrivacyBudget: stopping {step_label}: the next step would reach epsilon "
               f"{eps:.4g} > {self.epsilon:g} (delta {self.delta:g})")
    if self.stopped_at_step == 0:
      # fit then ends without a step: always say so, and keep Keras from reading metrics that
      # no step has built.
      self._hide_unbuilt_metrics()
      warnings.warn(message + "; no training step was taken", UserWarning, stacklevel=2)
    elif self.verbose:
      print(message)
    return True

  def _hide_unbuilt_metrics(self):
    """Keras reads the compiled metrics at the end of the (empty) epoch and fails when no
    step built them; they are detached until train end."""
    compiled = keras_internals.compile_metrics(self.model)
    if compiled is not None and not compiled.built:
      self._hidden_metrics = compiled
      keras_internals.set_compile_metrics(self.model, None)

  def on_train_begin(self, logs=None):
    """keras.callbacks.Callback.on_train_begin: a fresh budget; halts before the first step
    if that step would already exceed it."""
    self.stopped_at_step = None
    self._budget = lookahead.StepBudget(self.epsilon, self.delta, self.accountant)
    self._hidden_metrics = None
    _halt_private_steps(self.model, False)
    self._check("before training")

  def on_train_batch_end(self, batch, logs=None):
    """keras.callbacks.Callback.on_train_batch_end: halts if the next step would exceed."""
    self._check(f"after step {int(model_ledger(self.model).sample_count.numpy())}")

  def on_train_end(self, logs=None):
    """keras.callbacks.Callback.on_train_end: re-attaches the metrics hidden at step 0."""
    if self._hidden_metrics is not None:
      keras_internals.set_compile_metrics(self.model, self._hidden_metrics)
      self._hidden_metrics = None
