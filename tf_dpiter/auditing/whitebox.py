"""White-box audit of DP-SGD from the released updates of Dirac canaries (Nasr et al. 2023).

`CanaryRecorder` turns each step's canary update into x_kt of Eq. (4) (`canaries`);
`canary_scores` gives likelihood-ratio scores of the mechanism the accountant analyses (T
Poisson-subsampled Gaussians of multiplier z):

  add/remove:  log L_kt = log(1 - q + q exp((x_kt - 1/2) / z²))                         (5)
  replace:     log L_kt = log(1 - q + q exp((x_kt - 1/2) / z²)) - log(1 - q + q exp((-x_kt - 1/2) / z²))

per="run" sums (5) over the T steps (the Neyman–Pearson test of the run); per="step" keeps
each x_kt (sound, looser). At z = 0 the score is x itself.
"""

import math

import dp_accounting
import keras
import numpy as np

from tf_dpiter import validation
from tf_dpiter.accounting import accountants
from tf_dpiter.auditing import bounds as bounds_lib
from tf_dpiter.auditing import canaries as canaries_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

PER = ("run", "step")


class CanaryRecorder(keras.callbacks.Callback):
  """Records x_kt (Eq. 4) of the canary weights of a `DiracCanaryModel` at every step.

  Before each step it reads w^t and the learning rate eta; after it, it appends
  x_kt = -(w^{t+1} - w^t) q n / (eta S) for every canary.

  Args:
    canary_model: the (DP) DiracCanaryModel being trained.
    l2_norm_clip: S of the DP optimizer.
    expected_batch_size: q·n, the Poisson denominator of the DP optimizer.

  Attributes:
    observations: float64 array [m, T] of x_kt (T steps seen so far).
  """

  def __init__(self, canary_model, l2_norm_clip, expected_batch_size):
    super().__init__()
    validation.check_instance("canary_model", canary_model, canaries_lib.DiracCanaryModel,
                              "a DiracCanaryModel")
    self._canary_model = canary_model
    self._scale = float(expected_batch_size) / float(l2_norm_clip)
    self._rows = []
    self._before = None
    self._lr = None

  def on_train_begin(self, logs=None):
    """Keras hook: checks the optimizer (plain DP SGD) and steps_per_execution = 1.

    Args:
      logs: the dict of metric values Keras passes to the callback.

    Raises:
      ParameterValueError: another optimizer, or steps_per_execution != 1 (the weights are read around
        every step).
    """
    canaries_lib.check_optimizer(self._canary_model.optimizer, self._canary_model)
    spe = int(getattr(self._canary_model, "steps_per_execution", 1) or 1)
    if spe != 1:
      raise ParameterValueError("CanaryRecorder reads the canary weights around every step; compile with "
                                f"steps_per_execution=1, got {spe}")

  def on_train_batch_begin(self, batch, logs=None):
    self._before = np.array(self._canary_model.canary_weights.numpy(), np.float64)
    self._lr = float(keras.ops.convert_to_numpy(self._canary_model.optimizer.learning_rate))

  def on_train_batch_end(self, batch, logs=None):
    after = np.array(self._canary_model.canary_weights.numpy(), np.float64)
    self._rows.append(-(after - self._before) * self._scale / self._lr)

  @property
  def observations(self):
    """x_kt so far, a float64 array [m, T] (in units of the clip S)."""
    m = self._canary_model.num_canaries
    return np.stack(self._rows, axis=1) if self._rows else np.zeros((m, 0))

  @property
  def steps(self):
    """T, the train steps recorded so far (an int)."""
    return len(self._rows)


def canary_scores(observations, sampling_probability, noise_multiplier,
                  neighbouring=canaries_lib.ADD_REMOVE, per="run"):
  """Scores (higher = canary included / sign +1) from x_kt, Eq. (5).

  Args:
    observations: [m, T] array of x_kt.
    sampling_probability: q in (0, 1].
    noise_multiplier: z >= 0 (z = 0: raw x).
    neighbouring: "add_remove" or "replace" (see canaries.canary_records).
    per: "run" ([m] scores) or "step" ([m, T] scores).

  Returns:
    float64 array of scores, [m] or [m, T].

  Raises:
    ParameterValueError: q, z, neighbouring or per out of range.
    PrivacyConfigError: sampling_probability must be in (0, 1]; or noise_multiplier must be >= 0.
  """
  x = np.asarray(observations, np.float64)
  q, z = float(sampling_probability), float(noise_multiplier)
  validation.check_probability("sampling_probability", q)
  validation.check_nonnegative("noise_multiplier", z)
  validation.check_one_of("neighbouring", neighbouring, canaries_lib.NEIGHBOURING,
                          PrivacyConfigError)
  validation.check_one_of("per", per, PER)
  if z == 0.0:
    s = x
  else:
    def log_mix(v):
      if q == 1.0:
        return (v - 0.5) / z**2
      return np.logaddexp(math.log1p(-q), math.log(q) + (v - 0.5) / z**2)
    s = log_mix(x) - (log_mix(-x) if neighbouring == canaries_lib.REPLACE else 0.0)
  return s.sum(axis=1) if per == "run" else s


def whitebox_lower_bound(observations, included, sampling_probability, noise_multiplier, delta,
                         confidence=0.95, neighbouring=canaries_lib.ADD_REMOVE, per="run",
                         **kwargs):
  """(ε, δ) lower bound (bounds.LowerBound) from the canaries' recorded updates.

  Args:
    observations: [m, T] from CanaryRecorder.observations.
    included: bool [m] from canaries.draw_membership.
    sampling_probability: see `canary_scores`.
    noise_multiplier: see `canary_scores`.
    neighbouring: see `canary_scores`.
    per: see `canary_scores`.
    delta: the delta of the bound.
    confidence: the confidence of the bound (further keyword arguments go to
      bounds.lower_bound).

  Returns:
    bounds.LowerBound.

  Raises:
    ParameterValueError: shapes or arguments out of range, or no canary in one of the two classes.
  """
  inc = np.asarray(included, bool).reshape(-1)
  x = np.asarray(observations, np.float64)
  if x.ndim != 2 or x.shape[0] != inc.size:
    raise ParameterValueError(f"observations must be [m={inc.size}, T], got shape {x.shape}")
  if inc.all() or not inc.any():
    raise ParameterValueError("included must mark at least one canary in and one out, got "
                              f"{int(inc.sum())} of {inc.size} in")
  s = canary_scores(x, sampling_probability, noise_multiplier, neighbouring, per)
  return bounds_lib.lower_bound(s[inc].ravel(), s[~inc].ravel(), delta, confidence, **kwargs)


def claimed_epsilon(sampling_probability, noise_multiplier, steps, delta, accountant="pld",
                    sensitivity=1.0):
  """ε of `steps` Poisson-subsampled Gaussian steps from dp_accounting (the claim audited).

  The event is SelfComposed(PoissonSampled(q, Gaussian(z / sensitivity)), steps) under
  add/remove adjacency; passing sensitivity 1 where 2 is true is the "halved sensitivity"
  bug an audit must catch.

  Args:
    sampling_probability: q in (0, 1].
    noise_multiplier: z >= 0.
    steps: T >= 1.
    delta: in (0, 1).
    accountant: "pld", "rdp" or another registered accountant
      (`accounting.register_accountant`).
    sensitivity: > 0, in units of S (1: add/remove one record; 2: replace one).

  Returns:
    float ε (inf for z = 0).

  Raises:
    PrivacyConfigError: unknown accountant or arguments out of range.
  """
  validation.check_one_of("accountant", accountant, accountants.accountant_names(),
                          PrivacyConfigError)
  if not (0.0 < sampling_probability <= 1.0 and noise_multiplier >= 0 and steps >= 1
          and sensitivity > 0 and 0.0 < delta < 1.0):
    raise PrivacyConfigError("need q in (0, 1], z >= 0, steps >= 1, sensitivity > 0, delta in (0, 1); got "
                             f"q={sampling_probability!r}, z={noise_multiplier!r}, steps={steps!r}, "
                             f"sensitivity={sensitivity!r}, delta={delta!r}")
  if noise_multiplier == 0:
    return math.inf
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)),
      int(steps))
  acc = accountants.make(accountant, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  return float(acc.compose(event).get_epsilon(delta))
