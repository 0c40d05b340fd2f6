"""Noise calibration and the privacy analyses of Draw and Discard (Pihur et al. 2018, Section IV).

All guarantees are feature-level (per weight) local DP, as the paper states (Section VII).
Units and the noise calibration: calibration.py (its names are re-exported here).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard.calibration import (  # re-exported
    gaussian_sigma, init_variance, laplace_scale, laplace_variance, noise_std, sensitivity)
from tf_dpiter.draw_discard.calibration import DELTA_RANGE
from tf_dpiter.validation import check_positive

__all__ = [
    "gaussian_sigma", "init_variance", "laplace_scale", "laplace_variance", "noise_std",
    "sensitivity",
    "epsilon_adversary_one", "epsilon_adversary_one_composed", "epsilon_adversary_two",
    "adversary_two_loss", "discard_probability", "discard_probability_chain",
    "epsilon_adversary_three", "epsilon_adversary_three_accounted",
    "expected_epsilon_adversary_three", "ADVERSARY_TWO_ASSUMPTION", "PrivacyStatement",
    "privacy_statement", "print_privacy_statement",
]

# Lemma 3's sensitivity w in units of gamma: the update's own, sensitivity(gamma, 1) / gamma
# (2: a clipped coordinate in [-c, c] moves a weight by at most 2 gamma c, Section III-E).
SENSITIVITY_OVER_GAMMA = sensitivity(1.0)


# Adversary I (channel listener), Section IV-B

def epsilon_adversary_one(epsilon: float) -> float:
  """Adversary I sees the pre-image and the update: epsilon-DP per weight and update.

  Args:
    epsilon: the calibration epsilon (nats).

  Returns:
    epsilon (per weight, per update).

  Raises:
    ParameterValueError: for epsilon not a finite number > 0.
  """
  return float(check_positive("epsilon", epsilon))


def epsilon_adversary_one_composed(epsilon: float, num_updates: int, delta: float = 0.0) -> float:
  """Adversary I over `num_updates` updates by the same user (Section VII: composition).

  delta == 0: basic composition, n * epsilon; delta > 0: PLD accounting of n Laplace
  mechanisms of noise multiplier 1/epsilon (policy "full").

  Args:
    epsilon: per-update epsilon (nats).
    num_updates: updates by the same user (integer >= 1).
    delta: target delta; 0 for basic composition.

  Returns:
    The composed epsilon (nats), never above n * epsilon.

  Raises:
    ParameterValueError: for a bad epsilon, num_updates or delta.
    PrivacyConfigError: epsilon <= 0 (validation.check_positive), or delta outside [0, 1).
  """
  check_positive("epsilon", epsilon)
  validation.check_integer("num_updates", num_updates, 1)
  if delta == 0:
    return num_updates * epsilon
  validation.check_delta("delta", delta)
  group = _full_group(int(num_updates), laplace_noise_multipliers=(1.0 / epsilon,))
  return min(num_updates * epsilon, _core_epsilon(group, delta))


def _full_group(count: int, noise_multiplier: float = math.inf, laplace_noise_multipliers=()):
  """A privacy-core SampleGroup: one user's record in every one of `count` mechanisms."""
  from tf_dpiter.accounting import ledger_events  # pylint: disable=g-import-not-at-top
  return ledger_events.SampleGroup(
      count=count, policy="full", population_size=1.0, selection_probability=1.0,
      sample_size=1.0, noise_multiplier=float(noise_multiplier),
      laplace_noise_multipliers=tuple(laplace_noise_multipliers), non_private=False)


def _core_epsilon(group, delta: float) -> float:
  from tf_dpiter.accounting import accountant  # pylint: disable=g-import-not-at-top
  return float(accountant.report_from_groups([group], delta=delta, accountant="pld").epsilon)


# Adversary II (internal threat), Lemma 1

def epsilon_adversary_two(epsilon: float, k: int) -> float:
  """Expected privacy loss against adversary II: (k-1)/k * epsilon/2 (Lemma 1).

  With prob. 1/k the pre-image was discarded (loss 0); otherwise loss <= epsilon/2.

  Args:
    epsilon: per-update epsilon (nats).
    k: number of instances.

  Returns:
    The expected loss (nats).

  Raises:
    ParameterValueError: for a bad epsilon or k.
  """
  validation.check_integer("k", k, 1)
  return (k - 1) / k * 0.5 * check_positive("epsilon", epsilon)


def adversary_two_loss(b1, b2, a, a_prime, gamma: float, epsilon: float) -> np.ndarray:
  """The log-likelihood ratio (nats, broadcast shape) of Lemma 1's second scenario for k = 2
  (vectorized) at instance values b1, b2 (arrays broadcast together) between the clipped
  gradients a and a' in [-1, 1] of the two hypotheses:
  ln [ (f(B1-B2+g a) + f(B2-B1+g a)) / (f(B1-B2+g a') + f(B2-B1+g a')) ],
  f the Laplace(0, 2 gamma/epsilon) density, epsilon per update (nats)."""
  s = laplace_scale(gamma, epsilon)
  b1, b2, a, ap = (np.asarray(v, dtype=np.float64) for v in (b1, b2, a, a_prime))
  num = np.logaddexp(-np.abs(b1 - b2 + gamma * a) / s, -np.abs(b2 - b1 + gamma * a) / s)
  den = np.logaddexp(-np.abs(b1 - b2 + gamma * ap) / s, -np.abs(b2 - b1 + gamma * ap) / s)
  return num - den


# Adversary III (opportunistic threat), Lemmas 2 and 3

def discard_probability(k: int) -> float:
  """Long-term share of updates discarded: 1 - 1/k (Lemma 2).

  Args:
    k: number of instances (integer >= 1).

  Returns:
    1 - 1/k.

  Raises:
    ParameterValueError: for k not an integer >= 1.
  """
  return 1.0 - 1.0 / validation.check_integer("k", k, 1)


def discard_probability_chain(k: int) -> float:
  """Lemma 2 by solving its Markov chain numerically (checks the closed form).

  State i = instances descending from the update; p_i = i (k - i) / k^2 up and the same down;
  0 and k absorb (the paper's printed p_i is a text-extraction garble; equal rates suffice).

  Args:
    k: number of instances (integer >= 1).

  Returns:
    q_1 (0 for k = 1).

  Raises:
    ParameterValueError: for k not an integer >= 1.
  """
  k = validation.check_integer("k", k, 1)
  if k == 1:
    return 0.0
  # q_i for i = 1..k-1: p_i q_{i-1} + p_i q_{i+1} - 2 p_i q_i = 0, q_0 = 1, q_k = 0.
  i = np.arange(1, k)
  p = i * (k - i) / k**2
  a = np.diag(-2 * p) + np.diag(p[1:], -1) + np.diag(p[:-1], 1)
  rhs = np.zeros(k - 1)
  rhs[0] = -p[0]  # q_0 = 1
  return float(np.linalg.solve(a, rhs)[0])


def epsilon_adversary_three(epsilon: float, num_later_updates: float, delta_t: float = 1e-8,
                            w_over_gamma: float = SENSITIVITY_OVER_GAMMA, exact: bool = False) -> float:
  """(epsilon_T, delta_T) against adversary III after T later updates (Lemma 3).

  CLT: T Laplace(2 gamma/epsilon) noises ~ N(0, T 8 gamma^2 / epsilon^2), then Lemma 1 of
  Kenthapadi et al. (sensitivity w). exact=False: the paper's large-T form
  epsilon_T = epsilon w / (2 gamma sqrt(T)) sqrt(ln(1/(2 delta_T))); exact=True: the positive
  root of T (4 gamma^2/epsilon^2) e_T^2 - w^2 e_T - w^2 ln(1/(2 delta_T)) = 0 (rederived).
  The default w = 2 gamma is the mechanism's own sensitivity (a clipped coordinate in [-c, c]
  moves a weight by at most 2 gamma c, Section III-E; the Laplace noise is calibrated to it).
  Section IV-D evaluates w = sqrt(2) gamma, which understates it (at epsilon = 1, T = 1000,
  delta_T = 1e-8 the PLD value at sqrt(2) reaches delta 4.3e-6 at 2 gamma): pass
  w_over_gamma=math.sqrt(2) only to reproduce the paper's figure.

  Args:
    epsilon: per-update epsilon (nats).
    num_later_updates: T, updates after the user's (> 0).
    delta_t: delta_T, in (0, 1/2).
    w_over_gamma: the sensitivity w in units of gamma (default 2, the mechanism's own).
    exact: keep the "+1" under the root.

  Returns:
    epsilon_T (nats).

  Raises:
    PrivacyConfigError: for a bad epsilon, T, delta_t or w_over_gamma.
  """
  check_positive("epsilon", epsilon)
  t = check_positive("num_later_updates", num_later_updates)
  validation.check_params({"delta_t": DELTA_RANGE}, {"delta_t": delta_t})
  w = check_positive("w_over_gamma", w_over_gamma)  # in units of gamma
  log_term = math.log(1.0 / (2.0 * delta_t))
  if not exact:
    return epsilon * w / (2.0 * math.sqrt(t)) * math.sqrt(log_term)
  a = t * 4.0 / epsilon**2
  return (w**2 + math.sqrt(w**4 + 4.0 * a * w**2 * log_term)) / (2.0 * a)


def epsilon_adversary_three_accounted(epsilon: float, num_later_updates: float,
                                      delta_t: float = 1e-8,
                                      w_over_gamma: float = SENSITIVITY_OVER_GAMMA) -> float:
  """Lemma 3's CLT Gaussian, accounted exactly (PLD, privacy core) instead of by [30].

  A Gaussian of noise multiplier 2 sqrt(2T) / (epsilon w/gamma) (same CLT assumption).

  Args:
    epsilon: per-update epsilon (nats).
    num_later_updates: T (> 0).
    delta_t: delta_T, in (0, 1/2).
    w_over_gamma: the sensitivity w in units of gamma (default 2, the mechanism's own).

  Returns:
    epsilon_T (nats) from the PLD accountant.

  Raises:
    PrivacyConfigError: for a bad epsilon, T, delta_t or w_over_gamma.
  """
  check_positive("epsilon", epsilon)
  t = check_positive("num_later_updates", num_later_updates)
  validation.check_params({"delta_t": DELTA_RANGE}, {"delta_t": delta_t})
  z = 2.0 * math.sqrt(2.0 * t) / (epsilon * check_positive("w_over_gamma", w_over_gamma))
  return _core_epsilon(_full_group(1, noise_multiplier=z), delta_t)


def expected_epsilon_adversary_three(epsilon: float, k: int, num_later_updates: float,
                                     delta_t: float = 1e-8, **kwargs) -> float:
  """Expected loss against adversary III: (1/k) * epsilon_T (Lemmas 2 and 3; the table's
  epsilon / (k sqrt T) up to the log factor): with prob. 1 - 1/k the update is discarded.

  Args:
    epsilon: per-update epsilon (nats).
    k: number of instances.
    num_later_updates: T (> 0).
    delta_t: delta_T, in (0, 1/2).
    **kwargs: passed to epsilon_adversary_three (w_over_gamma, exact).

  Returns:
    epsilon_T / k (nats).

  Raises:
    ParameterValueError: for a bad parameter.
  """
  k = validation.check_integer("k", k, 1)
  return epsilon_adversary_three(epsilon, num_later_updates, delta_t, **kwargs) / k


# Statement

ADVERSARY_TWO_ASSUMPTION = (
    "  assumption of II and III: nobody snapshots the k instances at every update. Whoever\n"
    "    sees the instance a client drew and the one it returned has adversary I's view\n"
    "    (epsilon). The service upholds it by reading the store obliviously (whole snapshots,\n"
    "    the drawn index is never stored), requiring a token (serve --tokens) and limiting\n"
    "    draws per token (--draw-quota), which must stay far below the store's update rate:\n"
    "    with 100 updates/s, an attacker token recovered 0 of 40 victim steps at 2 draws/s,\n"
    "    8 of 40 at 20/s and 38 of 40 at 200/s (BENCHMARKS.md). It does not hold against\n"
    "    many colluding tokens.")


@dataclasses.dataclass(frozen=True)
class PrivacyStatement:
  """All three guarantees of Section IV for one configuration.

  Attributes:
    epsilon: the local epsilon of one update.
    k: the server's number of instances.
    num_later_updates: T, the updates adversary III observes after the target's.
    delta_t: delta_T of adversary III's guarantee.
    adversary_one: epsilon against a channel listener, per update.
    adversary_two_expected: expected epsilon against the internal threat, (k - 1) / (2k) epsilon
      (Lemma 1).
    adversary_three: epsilon_T against the opportunistic adversary (Lemma 3, large-T CLT).
    adversary_three_expected: expected epsilon_T / k (Lemma 2).
    discard_probability: 1 - 1/k (Lemma 2).
    noise: the noise law.
    adversary_three_accounted: epsilon_T of the same Gaussian by the PLD accountant, or None.
  """
  epsilon: float
  k: int
  num_later_updates: float
  delta_t: float
  adversary_one: float
  adversary_two_expected: float
  adversary_three: float
  adversary_three_expected: float
  discard_probability: float
  noise: str
  adversary_three_accounted: float | None = None

  def __str__(self) -> str:
    return (
        f"Draw and Discard privacy (feature-level local DP, {self.noise} noise, k={self.k}):\n"
        f"  unit: one client record's effect on ONE weight; a record that moves all p weights "
        f"has up to p x these epsilons for the whole update (composition)\n"
        f"  adversary I   (channel listener):       epsilon = {self.adversary_one:.4g} per weight "
        f"per update\n"
        f"  adversary II  (internal threat):        expected epsilon = (k-1)/(2k)*eps = "
        f"{self.adversary_two_expected:.4g} (Lemma 1)\n"
        f"  adversary III (opportunistic, T={self.num_later_updates:g}): "
        f"(epsilon_T, delta_T) = ({self.adversary_three:.4g}, {self.delta_t:.1e}) (Lemma 3, large-T CLT)\n"
        + (f"                same Gaussian, PLD-accounted: epsilon_T = "
           f"{self.adversary_three_accounted:.4g}\n" if self.adversary_three_accounted else "")
        + f"                discard probability 1-1/k = {self.discard_probability:.4g} (Lemma 2); "
        f"expected epsilon_T/k = {self.adversary_three_expected:.4g}\n"
        + ADVERSARY_TWO_ASSUMPTION)


def privacy_statement(epsilon: float, k: int, num_later_updates: float = 1000,
                      delta_t: float = 1e-8, noise: str = "laplace",
                      w_over_gamma: float = SENSITIVITY_OVER_GAMMA,
                      accounted: bool = True) -> PrivacyStatement:
  """Guarantees against adversaries I, II and III (Section IV, summary table).

  Lemmas 1-3 are proven for Laplace noise; for 'gaussian' II/III use the same formulas
  (not proven in the paper).

  Args:
    epsilon: per-update epsilon (nats).
    k: number of instances.
    num_later_updates: T for adversary III.
    delta_t: delta_T for adversary III.
    noise: the noise law's name (reported).
    w_over_gamma: Lemma 3's sensitivity in units of gamma (default 2, the mechanism's own).
    accounted: also give Lemma 3's Gaussian accounted by the PLD accountant.

  Returns:
    A PrivacyStatement (str() prints the summary).

  Raises:
    PrivacyConfigError: for a bad parameter.
  """
  eps_t = epsilon_adversary_three(epsilon, num_later_updates, delta_t, w_over_gamma)
  return PrivacyStatement(
      epsilon=float(epsilon), k=int(k), num_later_updates=float(num_later_updates),
      delta_t=float(delta_t),
      adversary_one=epsilon_adversary_one(epsilon),
      adversary_two_expected=epsilon_adversary_two(epsilon, k),
      adversary_three=eps_t,
      adversary_three_expected=eps_t / k,
      discard_probability=discard_probability(k),
      noise=noise,
      adversary_three_accounted=(epsilon_adversary_three_accounted(
          epsilon, num_later_updates, delta_t, w_over_gamma) if accounted else None))


def print_privacy_statement(*args, **kwargs) -> PrivacyStatement:
  """Prints and returns privacy_statement(*args, **kwargs).

  Args:
    *args: as privacy_statement.
    **kwargs: as privacy_statement.

  Returns:
    The PrivacyStatement.
  """
  s = privacy_statement(*args, **kwargs)
  print(s)
  return s
