"""Sound (ε, δ) lower bounds from attack scores (empirical privacy auditing).

(ε, δ)-DP for neighbours D (with a target record) and D' (without): for every (possibly
randomized) test with rejection region A,

    P[M(D) ∈ A] <= e^ε P[M(D') ∈ A] + δ   and   P[M(D') ∈ A] <= e^ε P[M(D) ∈ A] + δ.   (1)

With A = {score > t}: TPR <= e^ε FPR + δ and TNR <= e^ε FNR + δ, so

    ε >= max( log((TPR - δ) / FPR), log((TNR - δ) / FNR) ).                             (2)

`epsilon_lower_bound` puts one-sided Clopper–Pearson lower limits on TPR, TNR and upper
limits on FPR, FNR (i.i.d. member and non-member scores) and returns the best threshold's
(2) (Jagielski et al., "Auditing Differentially Private Machine Learning: How Private is
Private SGD?", Section 4). Thresholds are sound by method="bonferroni" (default: fixed ranks
of the other class' order statistics, whose FPR is Beta(j, m - j + 1), exactly the
Clopper–Pearson limit; ties broken by uniform keys; α / (4K) per direction, rate and
threshold) or "split" (one part picks, the other evaluates). ε in nats; confidence 1 - α.
"""

import dataclasses
import math

import numpy as np
from scipy import special
from scipy import stats

from tf_dpiter import validation
from tf_dpiter.accounting import search
from tf_dpiter.errors import ParameterValueError

METHODS = ("bonferroni", "split")


# ---- argument checks -------------------------------------------------------------------

def _scores(name, values):
  arr = np.asarray(values, dtype=np.float64).reshape(-1)
  if arr.size == 0:
    raise ParameterValueError(f"{name} must hold at least one score, got an empty array")
  if not np.all(np.isfinite(arr)):
    raise ParameterValueError(f"{name} must be finite numbers, got {int(np.sum(~np.isfinite(arr)))} "
                              "non-finite values (NaN or inf)")
  return arr


_OPEN_UNIT = validation.Interval(float, 0, 1, closed="neither", error=ParameterValueError)
CONSTRAINTS = {   # of lower_bound's arguments (one_run's delta and confidence too)
    "delta": validation.Interval(float, 0, 1, closed="left"),
    "confidence": _OPEN_UNIT,
    "method": validation.OneOf(METHODS),
    "num_thresholds": validation.Integer(1)}


# ---- Clopper–Pearson ---------------------------------------------------------------------

def clopper_pearson(successes, trials, alpha, side):
  """One-sided exact (Clopper–Pearson) binomial confidence limit.

  lower: largest p with P[Bin(n, p) >= k] <= alpha, i.e. Beta(alpha; k, n - k + 1) (0 if k = 0);
  upper: smallest p with P[Bin(n, p) <= k] <= alpha, i.e. Beta(1 - alpha; k + 1, n - k)
  (1 if k = n). Each limit covers the true p with probability >= 1 - alpha.

  Args:
    successes: k, counts (int or array), 0 <= k <= n.
    trials: n >= 1 (int or array broadcasting with k).
    alpha: one-sided error probability in (0, 1).
    side: "lower" or "upper".

  Returns:
    float64 array (or float) of limits in [0, 1].

  Raises:
    ParameterValueError: for k outside [0, n], n < 1, alpha outside (0, 1) or an unknown side.
  """
  k = np.asarray(successes, dtype=np.float64)
  n = np.asarray(trials, dtype=np.float64)
  if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
    raise ParameterValueError(f"need 0 <= successes <= trials and trials >= 1, got successes={successes!r}, "
                              f"trials={trials!r}")
  validation.check_params({"alpha": _OPEN_UNIT}, {"alpha": alpha})
  with np.errstate(invalid="ignore", divide="ignore"):
    if side == "lower":
      out = np.where(k > 0, special.betaincinv(np.maximum(k, 1e-300), n - k + 1, alpha), 0.0)
    elif side == "upper":
      out = np.where(k < n, special.betaincinv(k + 1, np.maximum(n - k, 1e-300), 1.0 - alpha), 1.0)
    else:
      raise ParameterValueError(f"side must be 'lower' or 'upper', got {side!r}")
  return out if out.ndim else float(out)


def _eps_from_rates(tpr_lo, fpr_hi, delta):
  """Elementwise log((tpr_lo - delta) / fpr_hi), 0 where not positive (Eq. 2)."""
  tpr_lo = np.asarray(tpr_lo, dtype=np.float64)
  fpr_hi = np.asarray(fpr_hi, dtype=np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    eps = np.log(np.maximum(tpr_lo - delta, 0.0)) - np.log(fpr_hi)
  return np.where(np.isfinite(eps) & (eps > 0), eps, 0.0)


# ---- result ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LowerBound:
  """An (ε, δ) lower bound and the test that gives it.

  Attributes:
    epsilon: the bound (nats, >= 0).
    delta: the delta it is stated at.
    confidence: 1 - alpha, the probability the bound holds.
    threshold: the score threshold of the best test.
    direction: "member" (a score above the threshold is the evidence) or "nonmember" (at or below
      it, ties broken at random).
    tpr_lower: the Clopper-Pearson lower limit of the test's true-positive rate.
    fpr_upper: the Clopper-Pearson upper limit of its false-positive rate.
    num_tests: the thresholds alpha was divided over.
    method: the interval method.
  """
  epsilon: float
  delta: float
  confidence: float
  threshold: float
  direction: str
  tpr_lower: float
  fpr_upper: float
  num_tests: int
  method: str


def _rank_grid(m, num_thresholds):
  """Ranks 1..m, geometrically spaced (fixed before seeing the scores)."""
  if num_thresholds >= m:
    return np.arange(1, m + 1)
  return np.unique(np.round(np.geomspace(1, m, num_thresholds)).astype(np.int64))


def _ranked_direction(pos, neg, num_thresholds, alpha_each, delta, rng):
  """Best (ε, t, tpr_lo, fpr_hi) with thresholds at ranks of neg (rule: pos > t)."""
  keys = rng.random(pos.size + neg.size)
  values = np.concatenate([pos, neg])
  is_pos = np.concatenate([np.ones(pos.size, bool), np.zeros(neg.size, bool)])
  order = np.lexsort((keys, values))[::-1]           # descending in (score, key)
  pos_sorted = is_pos[order]
  pos_above = np.cumsum(pos_sorted) - pos_sorted     # positives strictly above each element
  neg_pos_above = pos_above[~pos_sorted]             # for the j-th largest negative (j = 1..m)
  neg_values = values[order][~pos_sorted]
  ranks = _rank_grid(neg.size, num_thresholds)
  tpr_lo = clopper_pearson(neg_pos_above[ranks - 1], pos.size, alpha_each, "lower")
  fpr_hi = clopper_pearson(ranks - 1, neg.size, alpha_each, "upper")
  eps = _eps_from_rates(tpr_lo, fpr_hi, delta)
  i = int(np.argmax(eps))
  return float(eps[i]), float(neg_values[ranks[i] - 1]), float(tpr_lo[i]), float(fpr_hi[i])


def _fixed_thresholds(pos, neg, thresholds, alpha_each, delta):
  """Best bound over fixed thresholds, both directions sharing the same two limits."""
  t = np.asarray(thresholds, dtype=np.float64).reshape(-1)
  tp = (pos[None, :] > t[:, None]).sum(1)
  fp = (neg[None, :] > t[:, None]).sum(1)
  tpr_lo = clopper_pearson(tp, pos.size, alpha_each, "lower")
  fpr_hi = clopper_pearson(fp, neg.size, alpha_each, "upper")
  eps_m = _eps_from_rates(tpr_lo, fpr_hi, delta)
  eps_n = _eps_from_rates(1.0 - fpr_hi, 1.0 - tpr_lo, delta)   # TNR_lo / FNR_hi
  best = []
  for eps, name, a, b in ((eps_m, "member", tpr_lo, fpr_hi),
                          (eps_n, "nonmember", 1.0 - fpr_hi, 1.0 - tpr_lo)):
    i = int(np.argmax(eps))
    best.append((float(eps[i]), float(t[i]), name, float(a[i]), float(b[i])))
  return max(best, key=lambda r: r[0])


def _bonferroni(pos, neg, delta, alpha, thresholds, num_thresholds, rng):
  if thresholds is not None:
    k = int(np.size(thresholds))
    eps, t, name, a, b = _fixed_thresholds(pos, neg, thresholds, alpha / (2 * k), delta)
    return eps, t, name, a, b, k
  k = max(_rank_grid(neg.size, num_thresholds).size, _rank_grid(pos.size, num_thresholds).size)
  each = alpha / (4 * k)        # 2 directions x 2 rates x k thresholds
  e1, t1, a1, b1 = _ranked_direction(pos, neg, num_thresholds, each, delta, rng)
  e2, t2, a2, b2 = _ranked_direction(-neg, -pos, num_thresholds, each, delta, rng)
  if e1 >= e2:
    return e1, t1, "member", a1, b1, 2 * k
  return e2, -t2, "nonmember", a2, b2, 2 * k


def _split(pos, neg, delta, alpha, split_fraction, num_thresholds, rng):
  validation.check_params({"split_fraction": _OPEN_UNIT}, {"split_fraction": split_fraction})
  pos, neg = rng.permutation(pos), rng.permutation(neg)
  i_pos, i_neg = int(round(pos.size * split_fraction)), int(round(neg.size * split_fraction))
  if min(i_pos, i_neg, pos.size - i_pos, neg.size - i_neg) < 1:
    raise ParameterValueError(f"method='split' needs at least one score of each class in each part; got "
                              f"{pos.size} member and {neg.size} non-member scores with "
                              f"split_fraction={split_fraction}")
  # Selection part: any rule may be used; here the Bonferroni bound on that part.
  _, t, _, _, _, _ = _bonferroni(pos[:i_pos], neg[:i_neg], delta, alpha, None, num_thresholds, rng)
  eps, t, name, a, b = _fixed_thresholds(pos[i_pos:], neg[i_neg:], [t], alpha / 2, delta)
  return eps, t, name, a, b, 1


def lower_bound(member_scores, nonmember_scores, delta, confidence=0.95, *, method="bonferroni",
                thresholds=None, num_thresholds=64, split_fraction=0.5, seed=0):
  """(ε, δ) lower bound from scores, with the test that attains it (see module docstring).

  Args:
    member_scores: scores of outputs of M(D) (target present), i.i.d.; higher = member.
    nonmember_scores: scores of outputs of M(D') (target absent), i.i.d.
    delta: δ of the (ε, δ) statement audited, in [0, 1).
    confidence: 1 - α, in (0, 1); the bound is <= the true ε with this probability.
    method: "bonferroni" (thresholds at fixed ranks of the other class, or at the fixed
      `thresholds`) or "split" (choose on a split, evaluate on the rest).
    thresholds: optional fixed threshold values chosen before seeing the scores.
    num_thresholds: ranks per direction (geometric grid over 1..m) for "bonferroni".
    split_fraction: share of each class used to choose the threshold ("split").
    seed: seeds the tie-breaking keys and the split (not a privacy parameter).

  Returns:
    LowerBound (epsilon in nats, >= 0).

  Raises:
    ParameterValueError: empty or non-finite scores, delta/confidence/method/thresholds out of range.
  """
  pos = _scores("member_scores", member_scores)
  neg = _scores("nonmember_scores", nonmember_scores)
  validation.check_params(CONSTRAINTS, dict(
      delta=delta, confidence=confidence, method=method, num_thresholds=num_thresholds))
  delta, alpha = float(delta), 1.0 - float(confidence)
  if thresholds is not None:
    if method != "bonferroni":
      raise ParameterValueError(f"thresholds are used by method='bonferroni' only, got method={method!r}")
    if np.size(thresholds) == 0 or not np.all(np.isfinite(thresholds)):
      raise ParameterValueError(f"thresholds must be a non-empty array of finite values, got {thresholds!r}")
  rng = np.random.default_rng(seed)
  if method == "bonferroni":
    eps, t, name, a, b, k = _bonferroni(pos, neg, delta, alpha, thresholds, num_thresholds, rng)
  else:
    eps, t, name, a, b, k = _split(pos, neg, delta, alpha, split_fraction, num_thresholds, rng)
  return LowerBound(eps, delta, 1.0 - alpha, t, name, a, b, k, method)


def epsilon_lower_bound(member_scores, nonmember_scores, delta, confidence=0.95, **kwargs):
  """ε lower bound (nats) at confidence 1 - α from member / non-member scores.

  Sound when each class' scores are i.i.d. outputs of M(D) and M(D') (one score per run, or
  independent canaries); for many records of one model use `one_run_epsilon_lower_bound`.
  Keyword arguments go to `lower_bound`.

  Args:
    member_scores: 1-D array of member scores.
    nonmember_scores: 1-D array of non-member scores.
    delta: δ in [0, 1).
    confidence: 1 - α in (0, 1).

  Returns:
    float ε >= 0 such that P[ε_true < returned] <= α if M is (ε_true, δ)-DP.

  Raises:
    ParameterValueError: see `lower_bound`.
  """
  return lower_bound(member_scores, nonmember_scores, delta, confidence, **kwargs).epsilon


# ---- μ-GDP reference ---------------------------------------------------------------------

def gdp_delta(mu, epsilon):
  """δ(ε) in [0, 1] of μ-GDP, μ > 0 the mean shift of N(μ, 1) against N(0, 1), ε >= 0 in
  nats (Dong, Roth & Su 2019, Cor. 2.13): Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).

  Raises:
    ParameterValueError: mu <= 0.
  """
  validation.check_positive("mu", mu, error=ParameterValueError)
  return float(stats.norm.cdf(-epsilon / mu + mu / 2)
               - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


def gdp_epsilon(mu, delta):
  """Smallest ε with δ(ε) <= delta for μ-GDP, i.e. the true ε of the pair N(μ,1), N(0,1),
  from this module's own `gdp_delta` (independent of the accountant it audits).

  Args:
    mu: μ > 0 (the mean shift, in units of the noise's standard deviation).
    delta: in (0, 1).

  Returns:
    ε in nats.

  Raises:
    PrivacyConfigError: mu <= 0 or delta outside (0, 1).
  """
  validation.check_delta("delta", delta)
  ok = lambda eps: gdp_delta(mu, eps) <= delta
  if ok(0.0):
    return 0.0
  bad, good = search.doubling_bracket(ok, 1.0)
  return search.bisect(ok, bad, good, rel_tol=1e-10)   # the side where delta(eps) <= delta
