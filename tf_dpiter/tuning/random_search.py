"""Private hyperparameter selection by repeating with a random number of trials (no TF).

Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy": K trials, K
from a distribution fixed in advance, hyperparameters drawn independently of the data, only
the best trial released. If every trial is (alpha, eps(alpha))-RDP, so is the selection with
the bound of Theorem 2 (truncated negative binomial, shape eta; geometric eta = 1,
logarithmic eta = 0) or Theorem 6 (Poisson, eta = inf): dp-accounting's
`RepeatAndSelectDpEvent(event, mean, shape)`. `selection_report` checks the trials' ledgers
describe one mechanism and writes the selected one's with a selection record. Scores must
be private (`trials.noisy_count`) or on public data.
"""

import dataclasses
import math
from typing import Callable, Optional, Tuple

import numpy as np

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import accountants
from tf_dpiter.accounting import search
from tf_dpiter.accounting import ledger_events
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import selection as selection_lib


def _gamma_for_mean(mean, shape):
  """gamma with E[K] = mean for the truncated negative binomial of `shape` (bisection)."""
  def mean_of(g):   # decreasing in g, from +inf at g -> 0 to 1 at g -> 1
    if shape == 0:
      return (1.0 - 1.0 / g) / math.log(g)
    return shape * (1.0 - g) / (g * (1.0 - g ** shape))
  return search.bisect(lambda g: mean_of(g) <= mean, 1e-12, 1.0 - 1e-12, rel_tol=1e-15)


def num_trials_distribution(mean, shape):
  """A function rng -> K drawing the number of trials: Poisson(mean) for shape = inf,
  else the truncated negative binomial of Papernot and Steinke (K >= 1) with E[K] = mean.

  Args:
    mean: E[K], the expected number of trials.
    shape: the distribution's shape (1: geometric, inf: Poisson).

  Returns:
    a function rng -> K (an int).

  Raises:
    ParameterValueError: mean < 1 (the truncated negative binomial's support is K >= 1, and
      dp-accounting's RepeatAndSelectDpEvent accounts a Poisson K only for mean >= 1), or
      shape < 0.
  """
  shape = float(validation.check_nonnegative("shape", shape, error=ParameterValueError))
  validation.check_params({"mean": validation.Interval(float, 1, None, error=ParameterValueError)},
                          {"mean": mean})
  if math.isinf(shape):
    return lambda rng: int(rng.poisson(mean))
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
  """The guarantee of releasing the best of a random number of trials.

  Attributes:
    epsilon: the epsilon of the whole selection.
    delta: the delta of the whole selection.
    mean: E[K] of the distribution the number of trials was drawn from.
    shape: the shape of that distribution (1: geometric, inf: Poisson).
    assumptions: what the guarantee rests on (relation, sampling, selection); the selection's
      line names the K trials run.
    ledger: the signed ledger dict of the selected trial with its selection record (save it
      with json.dump; `dp_ledger report` and `privacy_report` read it), or None (no trial).

  The guarantee (Papernot and Steinke, Theorems 2 and 6) is for releasing the best trial with
  K hidden: given K = k the best of k trials costs up to k trials, so the assumptions and
  the ledger, which name K, are for the accountant and the auditor; publish epsilon, delta,
  mean and shape, not K.
  """
  epsilon: float
  delta: float
  mean: float
  shape: float
  assumptions: Tuple[str, ...]
  ledger: Optional[dict] = None


def selection_ledger(trial_ledger, mean, shape, trials, key=None):
  """The ledger of a selected trial with its selection record (version 3 file dict).

  Args:
    trial_ledger: the trial's ledger (anything `accountant.ledger_runs` reads).
    mean: the distribution the number of trials K was drawn from (shape inf: Poisson).
    shape: the distribution the number of trials K was drawn from (shape inf: Poisson).
    trials: the K trials run (>= 1).
    key: optional HMAC key.

  Returns:
    the signed ledger dict; `privacy_report` on it accounts RepeatAndSelectDpEvent.

  Raises:
    ParameterValueError: bad parameters, an empty trial or one that already records a selection.
  """
  runs, passes = accountant_lib.ledger_runs(trial_ledger)
  return ledger_file.runs_to_dict(selection_lib.with_selection(runs, mean, shape, trials),
                                  passes, key)


def _common_mechanism(trial_ledgers, accountant):
  """Raises ValueError unless every trial's ledger converts to the same event and relation."""
  events = []
  for ledger in trial_ledgers:
    content = accountant_lib.ledger_content(ledger)
    events.append(ledger_events.events_from_groups(content.groups, accountant, content.passes))
  first, relation, _ = events[0]
  for i, (e, r, _) in enumerate(events[1:], 1):
    if e != first or r != relation:
      raise ParameterValueError(f"trial {i}'s ledger describes another mechanism than trial 0's "
                                f"({e} vs {first}); the selection bound needs one mechanism per trial")


def selection_report(trial_ledgers, mean, shape, delta, accountant="rdp", selected=0):
  """Epsilon at `delta` of releasing the best of the trials (RepeatAndSelectDpEvent).

  Args:
    trial_ledgers: the ledgers of the trials run (PrivacyLedger, ledger dict/JSON or
      (samples, queries[, passes]) arrays); all must convert to the same dp-accounting
      event (a trial with other sampling or noise would need the worst case: refused).
    mean: E[K] of the distribution the number of trials was drawn from.
    shape: the shape of that distribution (1: geometric, inf: Poisson).
    delta: target delta.
    accountant: "rdp" or a registered accountant of the RDP family (dp-accounting
      implements the event for RDP only).
    selected: index of the released trial (its ledger carries the selection record).

  Returns:
    a SelectionReport whose `ledger` is `selection_ledger` of the selected trial; epsilon is
    `privacy_report` of that ledger.

  Raises:
    ParameterValueError: no ledger, ledgers of different mechanisms, or an unsupported accountant.
    PrivacyConfigError: an accountant that is not of the RDP family.
  """
  accountant_lib.check_accountant(accountant)
  if accountants.event_family(accountant) != "rdp":
    raise PrivacyConfigError(f"RepeatAndSelectDpEvent is accounted by dp-accounting's RDP accountant "
                             f"only: use accountant='rdp' (or a registered RDP-family one), got "
                             f"{accountant!r}")
  delta = validation.check_delta("delta", delta)
  if not trial_ledgers:
    raise ParameterValueError("trial_ledgers is empty: record at least one trial's ledger")
  _common_mechanism(trial_ledgers, accountant)
  ledger = selection_ledger(trial_ledgers[selected], mean, shape, len(trial_ledgers))
  report = accountant_lib.privacy_report(ledger, delta=delta, accountant=accountant)
  return SelectionReport(report.epsilon, delta, float(mean), float(shape), report.assumptions,
                         ledger)


class RandomSearch:
  """Random search with a random number of trials; returns the best trial and its ledgers."""

  def __init__(self, mean_trials, shape=1.0, seed=None):
    """A random search whose number of trials K is drawn at random.

    Args:
      mean_trials: E[K].
      shape: the shape of K's distribution (1: geometric, inf: Poisson).
      seed: tests only (a reproducible K is not private).
    """
    self._draw = num_trials_distribution(mean_trials, shape)
    self._mean, self._shape = float(mean_trials), float(shape)
    self._rng = np.random.default_rng(seed) if seed is not None else np.random.default_rng()

  def run(self, sample_params: Callable, train: Callable, delta: float):
    """Draws K, runs `train(params)` for K independent `sample_params(rng)`.

    `train` returns (score, result, ledger) with a privately computed score (higher is better).

    Args:
      sample_params: callable(rng) -> the hyperparameters of one trial.
      train: callable(params) -> (score, result, ledger) of one private training run.
      delta: the delta the selection's epsilon is stated at.

    Returns:
      (best_params, best_result, best_score, SelectionReport); (None, None, None, report)
      when K = 0 (Poisson only).
    """
    k = self._draw(self._rng)
    best, best_index = (None, None, None), 0
    ledgers = []
    for i in range(k):
      params = sample_params(self._rng)
      score, result, ledger = train(params)
      ledgers.append(ledger)
      if best[2] is None or score > best[2]:
        best, best_index = (params, result, score), i
    report = (selection_report(ledgers, self._mean, self._shape, delta, selected=best_index)
              if ledgers else
              SelectionReport(0.0, delta, self._mean, self._shape, ("no trial was run",)))
    return best + (report,)
