"""Budget look-ahead: the guarantee a ledger would give after planned samples (McMahan et al. 2018, §6).

A `PlannedSample` becomes ledger rows (`records.sensitivity_factor`), checked like recorded
ones and merged with the ledger's (read, never copied). No TensorFlow.
"""

import dataclasses
from typing import Any, Tuple

import numpy as np

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import ledger_events
from tf_dpiter.accounting.search import bisect  # pylint: disable=unused-import
from tf_dpiter.accounting.search import largest_integer
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import records as rec

__all__ = ["PlannedSample", "content_after", "report_after", "epsilon_after", "delta_after",
           "last_sample", "max_extra_samples", "StepBudget", "largest_integer", "bisect"]


def _float(x):
  """A Python float of a number, numpy scalar or eager tensor (no TensorFlow import)."""
  return float(x.numpy()) if hasattr(x, "numpy") else float(x)


@dataclasses.dataclass(frozen=True)
class PlannedSample:
  """One sample a loop is about to take, as the ledger would record it.

  Attributes:
    population_size: n.
    selection_probability: q (m / n for fixed_size and shuffle).
    events: the sum query events of the sample (`DPQuery.get_noised_result`'s third output,
      or a dry run of it), fields numbers or eager tensors.
    policy: one of `ledger.POLICIES`.
    sample_size: m (fixed_size, shuffle), 0 otherwise.
    examples_per_record: k (1: a record is an example).
    recorded_rows: None, or the query rows (kind, clip, noise, sensitivity) of a recorded
      sample (`last_sample`), used as they are in place of `events`.
  """
  population_size: float
  selection_probability: float
  events: Tuple[Any, ...]
  policy: str = rec.POISSON
  sample_size: float = 0
  examples_per_record: int = 1
  recorded_rows: Any = None

  def arrays(self):
    """The planned sample as ledger rows, checked like a recorded sample; each row's
    sensitivity is clip times `records.sensitivity_factor` (2 under replace-one, times k).

    Returns:
      (samples [1, 6], queries [Q, 5]) float64 arrays (`records.SAMPLE_COLUMNS`,
      `records.QUERY_COLUMNS`).

    Raises:
      PrivacyConfigError: an unknown policy or event (not a Gaussian, Laplace or non-private
        sum event), or values the ledger would refuse.
    """
    code = rec.policy_code(self.policy)
    k = self.examples_per_record
    factor = rec.sensitivity_factor(rec.relation_for_policy(self.policy), k)
    rows = [[0.0] + list(r) for r in self.recorded_rows or ()]
    for e in () if self.recorded_rows is not None else tuple(self.events):
      if isinstance(e, events_lib.GaussianSumEvent):
        clip = _float(e.l2_norm_clip)
        rows.append([0, rec.GAUSSIAN, clip, _float(e.stddev), factor * clip])
      elif isinstance(e, events_lib.LaplaceSumEvent):
        clip = _float(e.l1_norm_clip)
        rows.append([0, rec.LAPLACE, clip, _float(e.scale), factor * clip])
      elif isinstance(e, events_lib.NonPrivateEvent):
        rows.append([0, rec.NON_PRIVATE, 0.0, 0.0, 0.0])
      else:
        raise PrivacyConfigError(
            f"events must be GaussianSumEvent, LaplaceSumEvent or NonPrivateEvent, got {e!r}")
    sample = [[_float(self.population_size), _float(self.selection_probability),
               _float(self.sample_size), code, _float(k), len(rows)]]
    return rec.validate_arrays(np.array(sample, np.float64),
                               np.array(rows, np.float64).reshape(-1, len(rec.QUERY_COLUMNS)))


def last_sample(ledger):
  """The ledger's last recorded sample, to plan "the next step is like the last one".

  Args:
    ledger: a PrivacyLedger.

  Returns:
    a PlannedSample, or None for an empty ledger.
  """
  count = int(_float(ledger.sample_count))
  if count == 0:
    return None
  samples, queries = ledger.get_arrays(start=count - 1)
  n, q, m, code, k, _ = samples[-1]
  rows = tuple(tuple(float(v) for v in row[1:]) for row in queries)
  return PlannedSample(float(n), float(q), (), rec.policy_name(code), float(m), int(k),
                       recorded_rows=rows)


def _recorded_runs(ledger):
  """(runs, passes) of a live ledger (`accountant.ledger_runs`); ([], 0) for None."""
  if ledger is None:
    return [], 0
  if not (hasattr(ledger, "get_arrays") and hasattr(ledger, "passes")):
    raise ParameterTypeError(
        f"ledger must be a PrivacyLedger (get_arrays() and passes), got {type(ledger).__name__}")
  return accountant_lib.ledger_runs(ledger)


def content_after(ledger, planned=None, count=1, extra_passes=None):
  """What the accountant would read once `count` samples like `planned` are recorded.

  Args:
    ledger: a `PrivacyLedger` (read, not modified), or None for an empty one.
    planned: a `PlannedSample`, or None (the ledger alone).
    count: planned samples, an int >= 0.
    extra_passes: the passes (epochs) the planned samples start, when the caller knows them
      (the sampler does: `fit_sampling.passes_ahead`); None: as many as they need at least.

  Returns:
    an `accounting.LedgerContent`. For a shuffled (balls-in-bins) plan the passes are raised
    to what the planned samples need (one more pass each ceil(n / m) samples, one more epoch
    each k samples), as a sampler would.

  Raises:
    ParameterTypeError: `ledger` or `planned` of the wrong type.
    PrivacyConfigError: bad planned values or count.
  """
  validation.check_integer("count", count, 0, error=PrivacyConfigError)
  runs, passes = _recorded_runs(ledger)
  if planned is not None and count > 0:
    validation.check_instance("planned", planned, PlannedSample, "a PlannedSample")
    samples, queries = planned.arrays()
    runs = _extend_runs(runs, int(count), samples[0], queries)
  groups = ledger_events.groups_from_runs(runs)
  recorded = passes
  if planned is not None and count > 0 and policies.get(planned.policy).pass_charged:
    key = ledger_events.groups_from_runs([(1, samples[0], queries)])[0]
    for g in groups:
      if dataclasses.replace(g, count=1, participations=0) == key:
        passes = max(passes, policies.get(g.policy).passes_needed(g))
  if extra_passes is not None:
    passes = max(passes, recorded + int(extra_passes))
  return accountant_lib.LedgerContent(tuple(groups), passes)


def _extend_runs(runs, count, sample, queries):
  """runs with `count` more samples like (sample, queries): the last run grows when it is the
  same sample (the steps continue it, as the recorded ones will: a cyclic run of c + count
  steps is charged ceil((c + count) / b) participations, not ceil(c / b) + ceil(count / b)),
  else a new run is appended."""
  if runs:
    c, s, q = runs[-1]
    if (np.array_equal(s[:5], sample[:5]) and q.shape == queries.shape
        and np.array_equal(q[:, 1:], queries[:, 1:])):
      return runs[:-1] + [(c + count, s, q)]
  return runs + [(count, sample, queries)]


def report_after(ledger, planned=None, count=1, delta=None, epsilon=None, accountant="rdp",
                 extra_passes=None):
  """`accounting.privacy_report` of the ledger with `count` planned samples added.

  Args:
    ledger: as in `content_after`.
    planned: as in `content_after`.
    count: as in `content_after`.
    extra_passes: as in `content_after`.
    delta: the delta to compute epsilon at (give exactly one of delta and epsilon).
    epsilon: the epsilon to compute delta at (give exactly one of delta and epsilon).
    accountant: "rdp" or "pld".

  Returns:
    a `PrivacyReport`; with nothing recorded nor planned, a report of epsilon 0 (at delta)
    or delta 0 (at epsilon) over 0 samples.

  Raises:
    PrivacyConfigError: bad arguments, or a ledger that cannot be accounted soundly.
  """
  content = content_after(ledger, planned, count, extra_passes)
  if not content.groups:
    if (delta is None) == (epsilon is None):
      raise PrivacyConfigError(
          f"give exactly one of delta and epsilon, got delta={delta!r}, epsilon={epsilon!r}")
    if delta is not None:
      return accountant_lib.PrivacyReport(0.0, validation.check_delta("delta", delta),
                                          accountant, 0, ("nothing recorded",))
    validation.check_nonnegative("epsilon", epsilon, allow_inf=False)
    return accountant_lib.PrivacyReport(float(epsilon), 0.0, accountant, 0,
                                        ("nothing recorded",))
  return accountant_lib.report_from_groups(content, delta=delta, epsilon=epsilon,
                                           accountant=accountant)


def epsilon_after(ledger, delta, planned=None, extra_steps=1, accountant="rdp",
                  extra_passes=None):
  """Epsilon at `delta` once `extra_steps` samples like `planned` are recorded.

  Args:
    ledger: a `PrivacyLedger` (read, not modified), or None for an empty one.
    delta: the delta epsilon is stated at.
    planned: a `PlannedSample`, or None (the ledger alone).
    extra_steps: the samples about to run (`report_after`'s `count`).
    accountant: "rdp" or "pld".
    extra_passes: the passes those samples start (as `content_after`; None: as many as they
      need at least).

  Returns:
    epsilon, a float (inf when a sample is not private).

  Raises:
    PrivacyConfigError: see `report_after`.
  """
  return float(report_after(ledger, planned, extra_steps, delta=delta,
                            accountant=accountant, extra_passes=extra_passes).epsilon)


def delta_after(ledger, epsilon, planned=None, extra_steps=1, accountant="rdp"):
  """Delta at `epsilon` once `extra_steps` samples like `planned` are recorded.

  Args:
    ledger: a `PrivacyLedger` (read, not modified), or None for an empty one.
    epsilon: the epsilon delta is stated at.
    planned: a `PlannedSample`, or None (the ledger alone).
    extra_steps: the samples about to run (`report_after`'s `count`).
    accountant: "rdp" or "pld".

  Returns:
    delta, a float.

  Raises:
    PrivacyConfigError: see `report_after`.
  """
  return float(report_after(ledger, planned, extra_steps, epsilon=epsilon,
                            accountant=accountant).delta)


def max_extra_samples(ledger, planned, max_epsilon, delta, accountant="rdp", limit=10**9):
  """The most samples like `planned` that keep epsilon(delta) <= `max_epsilon`.

  Args:
    ledger: as in `content_after`.
    planned: as in `content_after`.
    max_epsilon: the budget, a number > 0.
    delta: the delta of the statement.
    accountant: "rdp" or "pld" ("gdp", an approximation, is refused: a budget needs a bound).
    limit: the search stops there (returns at most `limit`).

  Returns:
    an int >= 0 (-1 when the ledger alone already exceeds the budget).

  Raises:
    BudgetConfigError: accountant="gdp".
    PrivacyConfigError: see `report_after`.
  """
  accountant_lib.check_bound_accountant(accountant, "max_extra_samples")
  validation.check_positive("max_epsilon", max_epsilon)
  ok = lambda n: epsilon_after(ledger, delta, planned, n, accountant) <= max_epsilon
  return largest_integer(ok, 0, limit)


class StepBudget:
  """Stops a loop before its next steps would pass (max_epsilon, delta); for callbacks.

  One `max_extra_samples` search per kind of step (cached).

  Args:
    max_epsilon: the budget, > 0 and finite.
    delta: in (0, 1).
    accountant: "rdp" or "pld" (an upper bound; "gdp", an approximation, is refused).

  Raises:
    BudgetConfigError: accountant="gdp" (`accountant.check_bound_accountant`).
    PrivacyConfigError: a bad budget.
  """

  def __init__(self, max_epsilon, delta, accountant="rdp"):
    self.accountant = accountant_lib.check_bound_accountant(accountant, "StepBudget")
    validation.check_positive("max_epsilon", max_epsilon)
    self.max_epsilon = float(max_epsilon)
    self.delta = validation.check_delta("delta", delta)
    self._allowed = {}

  def allowed_total(self, ledger, planned):
    """How many samples like `planned` the ledger holds, and the most the budget allows.

    Args:
      ledger: a PrivacyLedger.
      planned: a PlannedSample.

    Returns:
      (recorded, allowed), ints; allowed < recorded when the budget is already passed.
    """
    content = content_after(ledger)
    samples, queries = planned.arrays()
    kind = dataclasses.replace(ledger_events.groups_from_runs([(1, samples[0], queries)])[0],
                               count=0)
    recorded = sum(g.count for g in content.groups if dataclasses.replace(g, count=0) == kind)
    others = tuple(sorted((g for g in content.groups
                           if dataclasses.replace(g, count=0) != kind), key=repr))
    key = (kind, others, content.passes)
    if key not in self._allowed:
      self._allowed[key] = recorded + max_extra_samples(ledger, planned, self.max_epsilon,
                                                        self.delta, self.accountant)
    return recorded, self._allowed[key]

  def exceeds(self, ledger, planned, ahead=1):
    """Whether `ahead` more samples like `planned` would pass the budget.

    Args:
      ledger: a PrivacyLedger.
      planned: a PlannedSample.
      ahead: samples about to run (>= 1).

    Returns:
      bool.
    """
    recorded, allowed = self.allowed_total(ledger, planned)
    return recorded + int(ahead) > allowed
