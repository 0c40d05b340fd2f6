"""Private hyperparameter selection by repeating with a random number of trials (no TF).

Papernot and Steinke 2022 ("Hyperparameter tuning with Renyi differential privacy",
arXiv:2110.03620): run K trials, K drawn from a distribution fixed in advance, each trial
a DP training run with its hyperparameters drawn independently of the data, and release only
the best trial (its model and score). If every trial is (alpha, eps(alpha))-RDP, the selection
is too, with the bound of their Theorem 2 (truncated negative binomial, shape eta in (0, inf);
geometric eta = 1; logarithmic eta = 0) or Theorem 6 (Poisson, eta = inf), which
dp-accounting implements as `RepeatAndSelectDpEvent(event, mean, shape)`.

The trials' ledgers are the input: `selection_report` checks they all describe the same
mechanism and composes RepeatAndSelectDpEvent over it. The trials' scores must themselves be
computed privately or on public data: the analysis covers releasing the best trial, not a
score computed from private data outside the trial's ledger.
"""

import dataclasses
import math
from typing import Callable, Tuple

import numpy as np

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import ledger_events
from tf_dpiter.accounting.ledger_events import dpa
from tf_dpiter.dp_query import validation


def _gamma_for_mean(mean, shape):
  """gamma with E[K] = mean for the truncated negative binomial of `shape` (bisection)."""
  def mean_of(g):
    if shape == 0:
      return (1.0 - 1.0 / g) / math.log(g)
    return shape * (1.0 - g) / (g * (1.0 - g ** shape))
  lo, hi = 1e-12, 1.0 - 1e-12
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if mean_of(mid) > mean:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def num_trials_distribution(mean, shape):
  """A function rng -> K drawing the number of trials: Poisson(mean) for shape = inf,
  else the truncated negative binomial of Papernot and Steinke (K >= 1) with E[K] = mean.

  Raises:
    ValueError: mean < 1 (or <= 0 for Poisson), or shape < 0.
  """
  shape = float(shape)
  if math.isnan(shape) or shape < 0:
    raise ValueError(f"shape must be >= 0 (inf for Poisson), got {shape!r}")
  if math.isinf(shape):
    validation.check_positive("mean", mean)
    return lambda rng: int(rng.poisson(mean))
  if not mean >= 1:
    raise ValueError(f"mean must be >= 1 for the truncated negative binomial, got {mean!r}")
  if mean == 1:
    return lambda rng: 1
  gamma = _gamma_for_mean(float(mean), shape)
  if shape == 0:
    return lambda rng: int(rng.logseries(1.0 - gamma))

  def draw(rng):
    while True:
      k = int(rng.negative_binomial(shape, gamma))
      if k >= 1:
        return k
  return draw


@dataclasses.dataclass(frozen=True)
class SelectionReport:
  """The guarantee of releasing the best of a random number of trials."""
  epsilon: float
  delta: float
  mean: float
  shape: float
  assumptions: Tuple[str, ...]


def _groups_and_passes(ledger):
  """(SampleGroups, passes) of anything `accountant.ledger_runs` reads."""
  runs, passes = accountant_lib.ledger_runs(ledger)
  return ledger_events.groups_from_runs(runs), passes


def selection_report(trial_ledgers, mean, shape, delta, accountant="rdp"):
  """Epsilon at `delta` of RepeatAndSelectDpEvent over the trials' common mechanism.

  Args:
    trial_ledgers: the ledgers of the trials run (PrivacyLedger, ledger dict/JSON or
      (samples, queries[, passes]) arrays); all must convert to the same dp-accounting
      event (a trial with other sampling or noise would need the worst case: refused).
    mean, shape: the distribution the number of trials was drawn from.
    delta: target delta. accountant: only "rdp" (dp-accounting implements the event there).
  Raises:
    ValueError: no ledger, ledgers of different mechanisms, or an unsupported accountant.
  """
  if accountant != "rdp":
    raise ValueError(f"RepeatAndSelectDpEvent is accounted by dp-accounting's RDP accountant "
                     f"only: use accountant='rdp', got {accountant!r}")
  delta = validation.check_delta("delta", delta)
  if not trial_ledgers:
    raise ValueError("trial_ledgers is empty: record at least one trial's ledger")
  events = []
  for ledger in trial_ledgers:
    groups, passes = _groups_and_passes(ledger)
    events.append(ledger_events.events_from_groups(groups, accountant, passes))
  first, relation, notes = events[0]
  for i, (e, r, _) in enumerate(events[1:], 1):
    if e != first or r != relation:
      raise ValueError(f"trial {i}'s ledger describes another mechanism than trial 0's "
                       f"({e} vs {first}); the selection bound needs one mechanism per trial")
  acc = accountant_lib.make_accountant(accountant, relation)
  acc.compose(dpa.dp_event.RepeatAndSelectDpEvent(first, float(mean), float(shape)))
  dist = "Poisson" if math.isinf(shape) else f"truncated negative binomial (shape {shape:g})"
  notes = tuple(notes) + (
      f"best of K trials released, K ~ {dist} with mean {mean:g} drawn before any trial, "
      "hyperparameters drawn independently of the data, only the best trial released "
      "(Papernot and Steinke 2022; dp-accounting RepeatAndSelectDpEvent)",)
  return SelectionReport(float(acc.get_epsilon(delta)), delta, float(mean), float(shape), notes)


class RandomSearch:
  """Random search with a random number of trials; returns the best trial and its ledgers."""

  def __init__(self, mean_trials, shape=1.0, seed=None):
    """mean_trials: E[K]; shape: of K's distribution (1: geometric, inf: Poisson);
    seed: tests only (a reproducible K is not private)."""
    self._draw = num_trials_distribution(mean_trials, shape)
    self._mean, self._shape = float(mean_trials), float(shape)
    self._rng = np.random.default_rng(seed) if seed is not None else np.random.default_rng()

  def run(self, sample_params: Callable, train: Callable, delta: float):
    """Draws K, runs `train(params)` for K independent `sample_params(rng)`.

    `train` returns (score, result, ledger) with a privately computed score (higher is better).
    Returns (best_params, best_result, best_score, SelectionReport); (None, None, None, report)
    when K = 0 (Poisson only).
    """
    k = self._draw(self._rng)
    best = (None, None, None)
    ledgers = []
    for _ in range(k):
      params = sample_params(self._rng)
      score, result, ledger = train(params)
      ledgers.append(ledger)
      if best[2] is None or score > best[2]:
        best = (params, result, score)
    report = (selection_report(ledgers, self._mean, self._shape, delta) if ledgers else
              SelectionReport(0.0, delta, self._mean, self._shape, ("no trial was run",)))
    return best + (report,)
