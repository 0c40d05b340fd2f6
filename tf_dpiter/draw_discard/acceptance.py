"""Bounded-influence acceptance rule for submitted instances.

An honest update (Pihur et al., "Differentially-Private Draw and Discard Machine Learning",
Algorithm 1) moves each weight of the drawn instance h by d_j = u_j - h_j = s_j + n_j,
|s_j| <= a = gamma * clip, n_j iid noise of scale s (Laplace(0, b): s = b = 2 gamma c / eps;
Gaussian: N(0, s^2)). With X_j = |n_j| / s, whatever the client's data:

  * L-infinity:  max_j |d_j| <= a + q s                (union bound),
  * excess:      sum_j max(|d_j| - a, 0) / s <= U      (<= sum_j X_j, Chernoff),
  * noise floor: sum_j min(|d_j| / s, m) >= L          (|s_j + n_j| stochastically dominates
                 |n_j| for symmetric unimodal noise, Anderson's inequality; Chernoff lower tail),

each failing for an honest update with probability <= alpha/3. With draw tickets (the
service's default) `check_step` tests against the served h: P(honest update refused) <=
alpha exactly, and influence.py bounds N accepted steps. Without tickets `check` accepts an
update if *some* candidate h (the k instances and the last `history` replaced ones) passes,
P(refused) <= alpha + P(its pre-image left the history), and a fourth, empirical test
refuses an update whose mean squared distance to the instances' average exceeds
`centre_factor` times an honest one's (spread^2 + noise variance + a^2; Theorem 1) against
chaining. With no noise (epsilon None) only |d_j| <= a is checked.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import special

from tf_dpiter import validation
from tf_dpiter.draw_discard import calibration
from tf_dpiter.draw_discard import glm
from tf_dpiter.errors import ParameterValueError

_LAMBDAS_UPPER = np.concatenate([np.geomspace(1e-4, 0.999, 400), np.geomspace(1.0, 40.0, 200)])
_LAMBDAS_LOWER = np.geomspace(1e-4, 40.0, 600)


def _log_mgf_abs(noise: str, lam: np.ndarray) -> np.ndarray:
  """ln E[exp(lam X)] for X = |n|/s (Exp(1) for Laplace, half-normal for Gaussian)."""
  if noise == "laplace":
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.where(lam < 1.0, -np.log1p(-np.minimum(lam, 1 - 1e-12)), np.inf)
  return lam**2 / 2 + np.log(2.0 - special.erfc(lam / math.sqrt(2.0)))


def _log_mgf_capped_neg(noise: str, lam: np.ndarray, cap: float) -> np.ndarray:
  """ln E[exp(-lam min(X, cap))]."""
  if noise == "laplace":
    tail = np.exp(-(1.0 + lam) * cap)
    return np.log((1.0 - tail) / (1.0 + lam) + tail)
  r2 = math.sqrt(2.0)
  body = np.exp(lam**2 / 2) * (special.erfc(lam / r2) - special.erfc((cap + lam) / r2))
  return np.log(body + np.exp(-lam * cap) * math.erfc(cap / r2))


def upper_quantile(noise: str, p: int, alpha: float) -> float:
  """U with P(sum of p iid X >= U) <= alpha in (0, 1) (Chernoff), X = |noise| / scale for
  noise "laplace" or "gaussian"."""
  lam = _LAMBDAS_UPPER if noise == "laplace" else _LAMBDAS_LOWER
  lam = lam[lam < 1.0] if noise == "laplace" else lam
  vals = (p * _log_mgf_abs(noise, lam) + math.log(1.0 / alpha)) / lam
  return float(np.min(vals))


def lower_quantile(noise: str, p: int, alpha: float, cap: float) -> float:
  """L >= 0 with P(sum of p iid min(X, cap) <= L) <= alpha in (0, 1) (Chernoff), X = |noise|
  / scale, cap the per-weight cap m of the statistic; 0 when none applies."""
  lam = _LAMBDAS_LOWER if noise == "laplace" else _LAMBDAS_LOWER[_LAMBDAS_LOWER <= 20.0]
  vals = (math.log(alpha) - p * _log_mgf_capped_neg(noise, lam, cap)) / lam
  return float(max(0.0, np.max(vals)))


def per_weight_quantile(noise: str, p: int, alpha: float) -> float:
  """q with p P(X > q) <= alpha (exact tails), X = |noise| / scale for noise "laplace" or
  "gaussian"."""
  target = alpha / p
  if noise == "laplace":
    return math.log(1.0 / target)
  return math.sqrt(2.0) * float(special.erfcinv(target))


@dataclasses.dataclass(frozen=True)
class Decision:
  """Outcome of AcceptanceRule.check: accepted, and the reason code when refused."""
  accepted: bool
  reason: str = ""
  candidate: int = -1


class AcceptanceRule:
  """Decides from the served spec whether an update is a plausible honest update.

  Args:
    spec: the served glm.ModelSpec (gamma, clip, noise, epsilon, delta).
    alpha: total false-rejection probability of the three tests, in (0, 0.5).
    max_abs_weight: no weight may exceed this magnitude (belt and braces).
    noise_cap: per-weight cap m of the noise-floor statistic (in units of the scale).
    prefilter_columns: leading columns on which every candidate's L1 distance is computed.
    max_full_checks: this many nearest candidates (on those columns) get the full tests
      first; when none passes, every candidate is tested, so the bound is exact.
    spread_std: the instances' stationary spread (Theorem 1), which enables the fourth test
      (distance to the instances' average); None: that test is off.
    centre_factor: the fourth test refuses an update whose mean squared distance to the
      instances' average exceeds this many times an honest update's (> 0).

  Raises:
    ParameterValueError: alpha outside (0, 0.5), non-positive max_abs_weight or
      centre_factor, or a negative spread_std.
    PrivacyConfigError: a non-positive noise_cap (validation.check_positive).
  """

  def __init__(self, spec: glm.ModelSpec, alpha: float = 1e-3, max_abs_weight: float = 1e6,
               noise_cap: float = 2.0, prefilter_columns: int = 32, max_full_checks: int = 16,
               spread_std: float | None = None, centre_factor: float = 36.0):
    if spread_std is not None:
      validation.check_nonnegative("spread_std", spread_std, True, ParameterValueError)
    validation.check_positive("centre_factor", centre_factor, allow_inf=True,
                              error=ParameterValueError)
    validation.check_params(
        {"alpha": validation.Interval(float, 0, 0.5, "neither", False, ParameterValueError)},
        {"alpha": alpha})
    validation.check_positive("max_abs_weight", max_abs_weight, allow_inf=True,
                              error=ParameterValueError)
    validation.check_positive("noise_cap", noise_cap, allow_inf=True)
    self.p = spec.num_weights
    self.alpha = float(alpha)
    self.max_abs_weight = float(max_abs_weight)
    self.step = spec.gamma * spec.clip
    noise = "none" if spec.epsilon is None else spec.noise
    self.noise = noise
    self.scale = calibration.noise_std(noise, spec.gamma, spec.epsilon, spec.clip, spec.delta)
    if noise == "laplace":
      self.scale /= math.sqrt(2.0)  # Laplace scale b; std is sqrt(2) b
    self.noise_cap = float(noise_cap)
    if noise == "none":
      self.linf = self.step * (1 + 1e-9) + 1e-12
      self.upper = self.lower = None
    else:
      a3 = self.alpha / 3
      self.linf = self.step + self.scale * per_weight_quantile(noise, self.p, a3)
      self.upper = upper_quantile(noise, self.p, a3)
      self.lower = lower_quantile(noise, self.p, a3, self.noise_cap)
    self.centre_factor = float(centre_factor)
    self.centre_var = None
    if spread_std is not None:  # E (u_j - mean_j)^2 of an honest update, at Theorem 1's spread
      noise_var = 2 * self.scale**2 if noise == "laplace" else self.scale**2
      self.centre_var = spread_std**2 + noise_var + self.step**2
    self._prefilter = max(1, min(self.p, int(prefilter_columns)))
    validation.check_integer("max_full_checks", max_full_checks, 1)
    self.max_full_checks = int(max_full_checks)

  def describe(self) -> dict:
    """The rule's parameters and its false-rejection bound, for /v1/spec and logs.

    Returns:
      A JSON-serializable dict.
    """
    return dict(rule="bounded_influence", alpha=self.alpha, noise=self.noise, step=self.step,
                scale=self.scale, linf=self.linf, excess_max=self.upper, floor_min=self.lower,
                noise_cap=self.noise_cap, max_abs_weight=self.max_abs_weight,
                centre_rms_max=(math.sqrt(self.centre_factor * self.centre_var)
                                if self.centre_var is not None else None),
                false_rejection_bound=f"<= {self.alpha:g} + P(pre-image evicted from history)")

  def _full(self, d: np.ndarray) -> str:
    if d.max() > self.linf:
      return "step_too_large"
    if self.upper is None:
      return ""
    if np.maximum(d - self.step, 0.0).sum() > self.upper * self.scale:
      return "excess_too_large"
    if np.minimum(d, self.noise_cap * self.scale).sum() < self.lower * self.scale:
      return "too_little_noise"
    return ""

  def _exhaustive(self, update: np.ndarray, candidates: np.ndarray, chunk: int = 64) -> int:
    """Index of the first candidate passing all tests, or -1 (vectorized, in chunks)."""
    for lo in range(0, len(candidates), chunk):
      d = np.abs(candidates[lo:lo + chunk] - update)
      ok = d.max(axis=1) <= self.linf
      if self.upper is not None:
        ok &= np.maximum(d - self.step, 0.0).sum(axis=1) <= self.upper * self.scale
        ok &= np.minimum(d, self.noise_cap * self.scale).sum(axis=1) >= self.lower * self.scale
      hit = np.flatnonzero(ok)
      if len(hit):
        return int(lo + hit[0])
    return -1

  def check_step(self, update: np.ndarray, drawn: np.ndarray) -> Decision:
    """Accepts `update` if it is a plausible honest update of the served instance `drawn`.

    Args:
      update: [p] float64 weights.
      drawn: [p] the instance the server served (verified by its ticket).

    Returns:
      A Decision; reason is one of "non_finite", "out_of_range", "step_too_large",
      "excess_too_large", "too_little_noise". P(refusing an honest update) <= alpha.

    Raises:
      ParameterValueError: if the shapes do not match the spec.
    """
    if update.shape != (self.p,) or drawn.shape != (self.p,):
      raise ParameterValueError(f"update and drawn must be [{self.p}], got {update.shape} and "
                                f"{drawn.shape}")
    reason = self.value_reason(update) or self._full(np.abs(update - drawn))
    return Decision(not reason, reason)

  def value_reason(self, update: np.ndarray) -> str:
    """The refusal reason of the values alone: non_finite, out_of_range or "" (admissible).

    Args:
      update: [p] weights.

    Returns:
      "non_finite", "out_of_range" or "".
    """
    top = np.max(np.abs(update))
    if not np.isfinite(top):
      return "non_finite"
    return "out_of_range" if top > self.max_abs_weight else ""

  def check(self, update: np.ndarray, candidates: np.ndarray,
            centre: np.ndarray | None = None, n_slots: int | None = None) -> Decision:
    """Accepts `update` if it is a plausible honest update of one of `candidates`.

    Args:
      update: [p] float64 weights.
      candidates: [n, p] instances it may have been drawn from (current + recent).
      centre: [p] mean of the k current instances, for the fourth test (with spread_std
        set; "far_from_centre").
      n_slots: the first n_slots candidates are the current instances; they are searched
        before the history (None: one block).

    Returns:
      A Decision; reason is one of "non_finite", "out_of_range", "far_from_centre",
      "step_too_large", "excess_too_large", "too_little_noise", "no_candidates".

    Raises:
      ParameterValueError: if the shapes do not match the spec.
    """
    if update.shape != (self.p,) or candidates.ndim != 2 or candidates.shape[1] != self.p:
      raise ParameterValueError(f"update must be [{self.p}] and candidates [n, {self.p}], got "
                                f"{update.shape} and {candidates.shape}")
    bad = self.value_reason(update)
    if bad:
      return Decision(False, bad)
    if centre is not None and self.centre_var is not None:
      off = update - centre
      if np.dot(off, off) > self.centre_factor * self.centre_var * self.p:
        return Decision(False, "far_from_centre")
    if candidates.shape[0] == 0:
      return Decision(False, "no_candidates")
    first = ""
    # fast path: the nearest candidates on the leading columns (slots first: the pre-image
    # usually still is one), then an exhaustive vectorized search, so the bound is exact
    for lo, hi in ((0, min(n_slots or len(candidates), len(candidates))),
                   (n_slots or len(candidates), len(candidates))):
      if hi <= lo:
        continue
      block = candidates[lo:hi]
      score = np.abs(block[:, :self._prefilter] - update[:self._prefilter]).sum(axis=1)
      for j in np.argsort(score, kind="stable")[:self.max_full_checks]:
        reason = self._full(np.abs(update - block[j]))
        if not reason:
          return Decision(True, "", int(lo + j))
        first = first or reason  # the reason for the nearest candidate
    j = self._exhaustive(update, candidates)
    return Decision(True, "", j) if j >= 0 else Decision(False, first or "step_too_large")
