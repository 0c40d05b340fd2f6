"""The pieces of a private selection's trial: a noisy score in its ledger and its noise.

Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", Section 3:
releasing the best trial is private (Theorems 2 and 6) if every trial, score included, is
(lambda, eps(lambda))-RDP. `noisy_count` releases a 0/1 count over the scoring examples plus
N(0, z^2), recorded as one Gaussian sum query (q = 1, clip 1) composed with the training
(sequential composition, an upper bound); `trial_noise_multiplier` calibrates the training
noise so the whole selection meets an epsilon target.

Relation: add or remove one example; unit: one example of the training or scoring split.
"""

import dp_accounting as dpa
import numpy as np

from tf_dpiter import validation
from tf_dpiter.accounting import accountants
from tf_dpiter.accounting import search
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import privacy_ledger


def noisy_count(ledger, count, population_size, noise_multiplier, rng=None):
  """`count` (of 0/1 values per scoring example) plus N(0, z^2), recorded in `ledger`.

  Args:
    ledger: the trial's PrivacyLedger (e.g. `model.ledger`).
    count: the exact count (0 <= count <= population_size).
    population_size: the number of scoring examples.
    noise_multiplier: z > 0, the noise standard deviation in counts.
    rng: a numpy Generator (default: a fresh one seeded from the OS).

  Returns:
    the noisy count (float).

  Raises:
    ParameterValueError: z <= 0, population_size <= 0, or count outside [0, population_size].
  """
  validation.check_positive("noise_multiplier", noise_multiplier)
  validation.check_positive("population_size", population_size)
  validation.check_params({"count": validation.Interval(
      float, 0, population_size, error=ParameterValueError)}, {"count": count})
  rng = rng if rng is not None else np.random.default_rng()
  event = events_lib.GaussianSumEvent(l2_norm_clip=1.0, stddev=float(noise_multiplier))
  ledger.record_sample(float(population_size), 1.0, (event,), policy=privacy_ledger.POISSON)
  return float(count) + float(rng.normal(0.0, noise_multiplier))


def trial_event(noise_multiplier, sampling_probability, steps, score_noise_multiplier=None):
  """dp-accounting event of one trial: `steps` Poisson-sampled Gaussian steps (rate q,
  multiplier z), then, if given, the noisy score (Gaussian mechanism of multiplier z_s).

  Args:
    noise_multiplier: z of the trial's training steps.
    sampling_probability: q of the trial's Poisson sampling.
    steps: the trial's training steps.
    score_noise_multiplier: z_s of the noisy score, or None (no score released).

  Returns:
    a dp_accounting DpEvent.
  """
  train = dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(sampling_probability, dpa.GaussianDpEvent(noise_multiplier)),
      int(steps))
  return train if score_noise_multiplier is None else dpa.ComposedDpEvent(
      [train, dpa.GaussianDpEvent(score_noise_multiplier)])


def selection_epsilon(noise_multiplier, sampling_probability, steps, mean, shape, delta,
                      score_noise_multiplier=None):
  """Epsilon at `delta` of releasing the best of K trials (RDP; Papernot and Steinke).

  Args:
    noise_multiplier: z of every trial's training steps.
    sampling_probability: q of every trial's Poisson sampling.
    steps: the training steps of one trial.
    mean: E[K], the expected number of trials.
    shape: the shape of K's distribution (1: geometric, inf: Poisson).
    delta: the delta epsilon is stated at.
    score_noise_multiplier: z_s of each trial's noisy score, or None.

  Returns:
    epsilon, a float.
  """
  event = trial_event(noise_multiplier, sampling_probability, steps, score_noise_multiplier)
  accountant = accountants.make("rdp", dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
  accountant.compose(dpa.dp_event.RepeatAndSelectDpEvent(event, float(mean), float(shape)))
  return accountant.get_epsilon(delta)


def trial_noise_multiplier(epsilon, delta, sampling_probability, steps, mean, shape,
                           score_noise_multiplier=None, tolerance=1e-4):
  """The smallest DP-SGD noise multiplier z (to `tolerance`, rounded up) for which releasing
  the best of K trials has epsilon <= `epsilon` at `delta`.

  Args:
    epsilon: target epsilon of the whole selection.
    delta: its delta.
    sampling_probability: q in (0, 1].
    steps: DP-SGD steps of one trial.
    mean: the distribution of the number of trials (`num_trials_distribution`).
    shape: the distribution of the number of trials (`num_trials_distribution`).
    score_noise_multiplier: z_s of each trial's noisy score, or None (no score in the ledger).
    tolerance: relative precision of z.

  Returns:
    z (float).

  Raises:
    PrivacyConfigError: the target cannot be met with any z (the score and the selection
      alone cost more than `epsilon`).
  """
  validation.check_positive("epsilon", epsilon)
  validation.check_probability("sampling_probability", sampling_probability)
  ok = lambda z: selection_epsilon(z, sampling_probability, steps, mean, shape, delta,
                                   score_noise_multiplier) <= epsilon
  bad, good = search.doubling_bracket(ok, 1.0, limit=1e4)
  if good is None:
    raise PrivacyConfigError(
        f"`epsilon`={epsilon} cannot be met by a selection of mean {mean} trials (shape "
        f"{shape}) with a noisy score of multiplier {score_noise_multiplier}, whatever the "
        "training noise: raise epsilon, lower the mean or raise the score's noise")
  if not bad and ok(0.1):   # z is never taken below 0.1
    return 0.1
  return search.bisect(ok, bad or 0.1, good, rel_tol=tolerance) * (1.0 + 1e-5)


__all__ = ["noisy_count", "selection_epsilon", "trial_event", "trial_noise_multiplier"]
