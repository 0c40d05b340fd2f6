"""Noise calibration of Draw and Discard clients (Pihur et al. 2018, Algorithm 1 and Section IV-B).

Units: epsilon in nats; gamma the learning rate; clip c bounds each gradient coordinate, so a
weight moves by at most 2 gamma c (Section III-E). Laplace(2 gamma c / epsilon) makes each
weight epsilon-DP; the Gaussian uses Lemma 1 of Kenthapadi et al.
"""

from __future__ import annotations

import math

from tf_dpiter import validation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.validation import check_positive

DELTA_RANGE = validation.Interval(float, 0, 0.5, closed="neither")   # the Gaussian's delta


# Noise calibration (Algorithm 1, Section IV-B)

def sensitivity(gamma: float, clip: float = 1.0) -> float:
  """2 gamma c (weight units): the per-weight sensitivity of the update B - gamma clip(G)
  (Section III-E), gamma > 0 the learning rate, c > 0 the per-coordinate clip of the average
  gradient.

  Raises:
    PrivacyConfigError: for a gamma or clip that is not a finite number > 0.
  """
  return 2.0 * check_positive("gamma", gamma) * check_positive("clip", clip)


def laplace_scale(gamma: float, epsilon: float, clip: float = 1.0) -> float:
  """Laplace scale b = 2*gamma*c/epsilon of Algorithm 1 (epsilon-DP per weight).

  Args:
    gamma: the learning rate.
    epsilon: per-update, per-weight epsilon (nats).
    clip: the per-coordinate clip c.

  Returns:
    The Laplace scale b, in weight units.

  Raises:
    PrivacyConfigError: for a gamma, epsilon or clip that is not a finite number > 0.
  """
  return sensitivity(gamma, clip) / check_positive("epsilon", epsilon)


def laplace_variance(gamma: float, epsilon: float, clip: float = 1.0) -> float:
  """Variance 2 b^2 = 8 gamma^2 c^2 / epsilon^2 of the client noise (Section IV-D).

  Args:
    gamma: the learning rate.
    epsilon: per-update, per-weight epsilon (nats).
    clip: the per-coordinate clip c.

  Returns:
    The variance, in squared weight units.

  Raises:
    PrivacyConfigError: for a gamma, epsilon or clip that is not a finite number > 0.
  """
  return 2.0 * laplace_scale(gamma, epsilon, clip) ** 2


def gaussian_sigma(epsilon: float, delta: float, sens: float) -> float:
  """Gaussian noise std for (epsilon, delta)-DP, Lemma 1 of Kenthapadi et al. [30] (Section IV-B).

  sigma >= w sqrt(2 (ln(1/(2 delta)) + epsilon)) / epsilon (valid for epsilon > 1).

  Args:
    epsilon: per-update epsilon (nats).
    delta: per-update delta, in (0, 1/2).
    sens: the sensitivity w (weight units).

  Returns:
    The noise std sigma, in weight units.

  Raises:
    PrivacyConfigError: for epsilon or sens not a finite number > 0, or delta outside (0, 1/2).
  """
  check_positive("epsilon", epsilon)
  validation.check_params({"delta": DELTA_RANGE}, {"delta": delta})
  return check_positive("sensitivity", sens) * math.sqrt(2.0 * (math.log(1.0 / (2.0 * delta)) + epsilon)) / epsilon


def noise_std(noise: str, gamma: float, epsilon: float | None, clip: float = 1.0,
              delta: float = 1e-6) -> float:
  """Per-weight std of the client noise (0 for noise 'none' or epsilon None).

  Args:
    noise: "laplace", "gaussian" or "none".
    gamma: the learning rate.
    epsilon: per-update epsilon (nats), or None (no noise).
    clip: the per-coordinate clip c.
    delta: delta of the Gaussian calibration.

  Returns:
    The std, in weight units.

  Raises:
    PrivacyConfigError: for an unknown noise law or a bad parameter.
  """
  if noise == "none" or epsilon is None:
    return 0.0
  if noise == "laplace":
    return math.sqrt(laplace_variance(gamma, epsilon, clip))
  if noise == "gaussian":
    return gaussian_sigma(epsilon, delta, sensitivity(gamma, clip))
  raise PrivacyConfigError(f"noise must be 'laplace', 'gaussian' or 'none', got {noise!r}")


def init_variance(k: int, noise_variance: float) -> float:
  """Initial intra-model variance sigma_k^2 = k/2 * sigma^2 (Section III-C a, Theorem 1).

  Args:
    k: number of instances (>= 1).
    noise_variance: the client noise variance sigma^2 (weight units squared, >= 0).

  Returns:
    k/2 * sigma^2.

  Raises:
    PrivacyConfigError: for k not an integer >= 1 or a negative variance.
  """
  validation.check_integer("k", k, 1)
  validation.check_nonnegative("noise_variance", noise_variance)
  return 0.5 * k * noise_variance
