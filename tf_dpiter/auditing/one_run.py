"""One-run auditing (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run").

Setting: m canaries, each included in the training set independently with probability ½
(S_i = +1 included, -1 not). After one run the auditor looks at the output only and guesses
T_i ∈ {-1, 0, +1} (0: abstain); W = #{i : T_i = S_i ≠ 0} counts correct guesses among the
k = Σ|T_i| guesses, k fixed in advance.

Bound used here (our derivation of the paper's main theorem, with an explicit δ term).
Let p(ε) = e^ε / (1 + e^ε).

* Pure ε-DP: given the output O and S_<i, the likelihood ratio of S_i = ±1 (averaged over
  S_>i) lies in [e^-ε, e^ε], so P[S_i = T_i | O, S_<i] <= p(ε). The indicators of correct
  guesses, taken in index order, each succeed with conditional probability <= p(ε) given the
  past, hence W is stochastically dominated by Binomial(k, p(ε)).
* (ε, δ)-DP: for any ε' > ε call "bad" the outputs where that averaged likelihood ratio is
  outside [e^-ε', e^ε'] (the averaged pair is still (ε, δ)-indistinguishable, by joint
  convexity). Its probability is at most β(1 + e^-ε') <= 2β with β = δ / (1 - e^(ε - ε'))
  (from δ >= Σ_{LR > e^ε'} (P - e^ε Q) >= P[LR > e^ε'] (1 - e^(ε - ε'))). Correct guesses
  on good outputs are dominated by Binomial(k, p(ε')) as above; the number N of canaries
  with a bad output has E[N] <= η = 2 m δ / (1 - e^(ε - ε')). W >= v forces either at least
  v - j good correct guesses or N >= j, so by Markov, for every ε' > ε and j >= 1,

      P[W >= v] <= P[Binomial(k, p(ε')) >= v - j] + η / j.                      (3)

A value ε is rejected at level α when min over a fixed grid of ε' of the right side of (3)
at v = W is <= α (minimised over fixed grids of ε' and j); the lower bound is the largest rejected ε (the right side increases with
ε, so bisection finds it). With δ = 0, ε' = ε and η = 0.
"""

import numpy as np
from scipy import special
from scipy import stats

from tf_dpiter import validation
from tf_dpiter.auditing import bounds as bounds_lib
from tf_dpiter.errors import ParameterValueError

# Fixed slack grids for ε' - ε and for j (chosen before any data is seen; the bound is a
# minimum of valid bounds, so no multiple-testing correction is needed).
_GAPS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_JS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def _tail(k, v, eps_prime):
  """P[Binomial(k, p(ε')) >= v] (arrays broadcast)."""
  p = special.expit(np.asarray(eps_prime, np.float64))
  return stats.binom.sf(np.asarray(v) - 1, k, p)


def one_run_p_value(epsilon, num_correct, num_guesses, num_canaries, delta):
  """Upper bound (3), in [0, 1], on P[W >= num_correct] for an (ε, δ)-DP training run (ε >= 0
  in nats, δ in [0, 1)) with k = num_guesses guesses fixed in advance among m = num_canaries
  randomized canaries: the smallest bound (3) over the fixed grids of ε' > ε and j.

  Raises:
    ParameterValueError: counts out of range.
  """
  if not (0 <= num_correct <= num_guesses <= num_canaries):
    raise ParameterValueError("need 0 <= num_correct <= num_guesses <= num_canaries, got "
                              f"num_correct={num_correct!r}, num_guesses={num_guesses!r}, "
                              f"num_canaries={num_canaries!r}")
  if delta == 0:
    return float(_tail(num_guesses, num_correct, epsilon))
  gaps = np.asarray(_GAPS)[:, None]
  js = np.asarray([j for j in _JS if j <= num_correct], np.float64)[None, :]
  if js.size == 0:
    return 1.0
  eta = 2.0 * num_canaries * delta / (1.0 - np.exp(-gaps))
  bound = _tail(num_guesses, num_correct - js, epsilon + gaps) + eta / js
  return float(min(1.0, bound.min()))


def _bound_from_counts(num_correct, num_guesses, num_canaries, delta, alpha):
  if one_run_p_value(0.0, num_correct, num_guesses, num_canaries, delta) > alpha:
    return 0.0
  lo, hi = 0.0, 1.0
  while one_run_p_value(hi, num_correct, num_guesses, num_canaries, delta) <= alpha:
    lo, hi = hi, 2.0 * hi
    if hi > 1e3:
      return lo
  while hi - lo > 1e-6:
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if one_run_p_value(mid, num_correct, num_guesses, num_canaries,
                                          delta) <= alpha else (lo, mid)
  return lo


def guesses_from_scores(scores, num_guesses):
  """Guesses T: +1 for the ceil(k/2) highest scores, -1 for the floor(k/2) lowest, else 0.

  Args: scores [m] (higher = more likely included); num_guesses k in [1, m].
  Returns: int8 array [m] in {-1, 0, +1}. Ties are broken by position (stable sort).
  Raises: ValueError for k outside [1, m].
  """
  scores = np.asarray(scores, dtype=np.float64).reshape(-1)
  m = scores.size
  validation.check_integer("num_guesses", num_guesses, 1, m)
  order = np.argsort(scores, kind="stable")
  guesses = np.zeros(m, np.int8)
  k_pos = (num_guesses + 1) // 2
  guesses[order[m - k_pos:]] = 1
  guesses[order[:num_guesses - k_pos]] = -1
  return guesses


def one_run_epsilon_lower_bound(scores, included, delta, confidence=0.95, num_guesses=None):
  """ε lower bound from one training run with m randomized canaries (Steinke et al. 2023).

  Args:
    scores: [m] canary scores computed from the run's output only (higher = included).
    included: [m] booleans, whether each canary was in the training set; must have been
      drawn independently with probability ½ before training.
    delta: δ in [0, 1) of the audited claim.
    confidence: 1 - α in (0, 1).
    num_guesses: an int k or a list of k (Bonferroni over the list); default a fixed grid
      of k in {m/100, m/50, m/20, m/10, m/5, m/2, m} (at least 1).

  Returns:
    float ε lower bound (nats, >= 0): the largest ε rejected by (3) at level α / len(list).

  Raises:
    ParameterValueError: shapes differ, bad delta/confidence, or k outside [1, m].
  """
  scores = bounds_lib._scores("scores", scores)  # pylint: disable=protected-access
  inc = np.asarray(included).reshape(-1)
  if inc.shape != scores.shape:
    raise ParameterValueError(f"included must have the shape of scores {scores.shape}, got {inc.shape}")
  truth = np.where(inc.astype(bool), 1, -1)
  validation.check_params(bounds_lib.CONSTRAINTS, {"delta": delta, "confidence": confidence})
  delta, alpha = float(delta), 1.0 - float(confidence)
  m = scores.size
  ks = (sorted({max(1, int(m * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)})
        if num_guesses is None else
        [num_guesses] if np.ndim(num_guesses) == 0 else list(num_guesses))
  best = 0.0
  for k in ks:
    guesses = guesses_from_scores(scores, k)
    correct = int(np.sum(guesses == truth))
    best = max(best, _bound_from_counts(correct, int(k), m, delta, alpha / len(ks)))
  return best
