"""The accountant: reads a privacy ledger and returns (epsilon, delta) (McMahan et al. 2018, Section 6).

RDP (default) or PLD accounting, both from dp-accounting. The report states every
assumption it rests on (adjacency, sampling policy, amplification claimed or not).
"""

import dataclasses
import json
import logging
import math
from typing import Tuple
import warnings

from absl import logging as absl_logging

from tf_dpiter import validation
from tf_dpiter.accounting import accountants
from tf_dpiter.accounting import gdp
from tf_dpiter.accounting import ledger_events
from tf_dpiter.accounting.ledger_events import dpa
from tf_dpiter.errors import BudgetConfigError
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec

# The built-in accountants (dp-accounting's RDP and PLD). Every reader takes any name of the
# registry (`accountants.register_accountant`; `accountants.accountant_names()` lists them).
ACCOUNTANTS = ("rdp", "pld")
# Names privacy_report also takes: "gdp" (mu-GDP, Poisson by a CLT: an approximation;
# accounting.gdp) and "prv" (Opacus' PRV accountant: refused, its package is not installed).
_REPORT_ONLY = ("gdp", "prv")
REPORT_ACCOUNTANTS = ACCOUNTANTS + _REPORT_ONLY
_GDP_SOURCE = "an approximate value by a central limit theorem, not an upper bound"


class _DropExcludedOrderWarnings(logging.Filter):
  """Drops dp-accounting's warning that a fractional RDP order failed to converge: that order
  is excluded (epsilon stays a valid bound over the others), and a loop asking for epsilon
  every epoch would repeat it endlessly."""

  def filter(self, record):
    return "_compute_log_a_frac failed to converge" not in str(record.msg)


absl_logging.get_absl_logger().addFilter(_DropExcludedOrderWarnings())


def make_accountant(accountant="rdp", neighboring_relation=None):
  """A fresh dp-accounting accountant of a registered name ("rdp": RdpAccountant, "pld":
  PLDAccountant, or one `register_accountant` added).

  Args:
    accountant: a registered accountant name (`accountant_names()`).
    neighboring_relation: a dp-accounting NeighboringRelation (default add or remove one).

  Returns:
    the dp-accounting accountant, empty.

  Raises:
    ParameterTypeError: `accountant` is not a str.
    PrivacyConfigError: a name not registered.
  """
  if not isinstance(accountant, str):
    raise ParameterTypeError(f"accountant must be one of {accountants.accountant_names()}, got "
                             f"{accountant!r}")
  if neighboring_relation is None:
    neighboring_relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
  return accountants.make(accountant, neighboring_relation)


def report_accountant_names():
  """The names `privacy_report` takes: the registered accountants and "gdp" (and "prv",
  which it refuses with the reason)."""
  return accountants.accountant_names() + _REPORT_ONLY


@dataclasses.dataclass(frozen=True)
class LedgerContent:
  """What the accountant reads: the SampleGroups and the shuffled passes of a ledger.

  Attributes:
    groups: the SampleGroups the accountant composes.
    passes: the shuffled passes the ledger recorded (0 without shuffling).
  """
  groups: Tuple[ledger_events.SampleGroup, ...]
  passes: int = 0


def ledger_runs(ledger, key=None):
  """(runs, passes) of a ledger: its recorded samples run-length encoded, [(count,
  sample_row, query_rows)] in recording order (`records.run_length_encode`), and the
  shuffled passes started (int); the one reader of ledger contents for the accountant, the
  epsilon curve and the budget look-ahead. `ledger` is a PrivacyLedger (or any object with
  `get_arrays()` and `passes`), a ledger dict or JSON string (verified: digest; HMAC with
  `key`), or (samples, queries[, passes]) arrays.

  Raises:
    ParameterTypeError: `ledger` is none of the above (a TypeError).
    ParameterValueError: unparsable JSON, a bad digest or HMAC, or rows the ledger would
      refuse.
  """
  if hasattr(ledger, "get_arrays") and hasattr(ledger, "passes"):
    passes = ledger.passes
    ledger = (*ledger.get_arrays(), passes.numpy() if hasattr(passes, "numpy") else passes)
  if isinstance(ledger, str):
    try:
      ledger = json.loads(ledger)
    except json.JSONDecodeError as e:
      raise ParameterValueError(f"ledger JSON could not be parsed: {e}") from None
  if isinstance(ledger, dict):
    return ledger_file.dict_to_runs(ledger, key)
  if isinstance(ledger, (tuple, list)) and len(ledger) in (2, 3):
    samples, queries = rec.validate_arrays(*ledger[:2])
    passes = int(ledger[2]) if len(ledger) == 3 else 0
    return rec.run_length_encode(samples, queries), passes
  raise ParameterTypeError(
      f"ledger must be a PrivacyLedger, a ledger dict/JSON or (samples, queries[, passes]), "
      f"got {type(ledger).__name__}")


def shuffle_passes_needed(group):
  """The shuffled passes a group's samples need: ceil(count / ceil(n / m)) (McMahan et al. 2018, §5).

  Args:
    group: a `ledger_events.SampleGroup`.

  Returns:
    an int >= 0 (0 for a group whose policy is not shuffle).
  """
  if group.policy != rec.SHUFFLE:
    return 0
  return math.ceil(group.count / math.ceil(group.population_size / group.sample_size))


def ledger_content(ledger, key=None):
  """The LedgerContent (sample groups and passes) the accountant reads of a ledger: a
  LedgerContent as it is, or anything `ledger_runs` reads (verified with the HMAC `key`)."""
  if isinstance(ledger, LedgerContent):
    return ledger
  runs, passes = ledger_runs(ledger, key)
  return LedgerContent(tuple(ledger_events.groups_from_runs(runs)), passes)


def ledger_to_dp_event(ledger, accountant="rdp"):
  """The dp-accounting event equivalent to the ledger (Eq. (1) of McMahan et al. 2018 per sample,
  composed with the counts of identical samples).

  Args:
    ledger: anything `ledger_runs` reads, or a LedgerContent.
    accountant: "rdp" or "pld" (which events the accountant supports).

  Returns:
    a dp_accounting.DpEvent.

  Raises:
    PrivacyConfigError: a ledger that cannot be accounted soundly (see `privacy_report`).
  """
  c = ledger_content(ledger)
  event, _, _ = ledger_events.events_from_groups(c.groups, accountant, c.passes)
  return event


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """The guarantee computed from a ledger, and the assumptions it rests on.

  Attributes:
    epsilon: the guarantee's epsilon (inf when a sample is not private).
    delta: the guarantee's delta.
    accountant: the accountant used ("rdp", "pld" or "gdp").
    num_samples: the samples (private steps) the ledger holds.
    assumptions: what the guarantee rests on (relation, unit, sampling, integrity of the ledger).
  """
  epsilon: float
  delta: float
  accountant: str
  num_samples: int
  assumptions: Tuple[str, ...]

  def __str__(self):
    approx = "approximately " if self.accountant == "gdp" else ""
    lines = [f"{approx}({self.epsilon:.4g}, {self.delta:.3g})-DP over {self.num_samples} "
             f"samples ({self.accountant.upper()} accountant, {_source(self.accountant)})."]
    lines += [f"  - {a}" for a in self.assumptions]
    return "\n".join(lines)


def _source(accountant):
  """Where a report's value comes from (a phrase of its first line)."""
  if accountant == "gdp":
    return _GDP_SOURCE
  if accountant in ACCOUNTANTS:
    return "dp-accounting"
  return "a registered accountant, dp-accounting"


def check_accountant(accountant):
  """Checks that `accountant` is one `privacy_report` can use here.

  Args:
    accountant: the name (a registered one, e.g. "rdp" or "pld"; "gdp"; "prv" is refused
      with the reason).

  Raises:
    ParameterTypeError: `accountant` is not a str.
    PrivacyConfigError: an unknown or unavailable accountant (names it).
  """
  names = report_accountant_names()
  if not isinstance(accountant, str):
    raise ParameterTypeError(validation.message("accountant", f"one of {names}", accountant))
  if accountant not in names:
    raise PrivacyConfigError(validation.message("accountant", f"one of {names}", accountant))
  if accountant == "prv":
    try:
      import prv_accountant  # pylint: disable=g-import-not-at-top,unused-import
      why = "tf_dpiter does not call the installed prv-accountant package yet"
    except ImportError:
      why = "the prv-accountant package (Opacus' PRV accountant) is not installed"
    raise PrivacyConfigError(f"accountant='prv' is not available: {why}. Use accountant='pld' "
                             "(dp-accounting's privacy loss distribution accountant, numerically tight "
                             "like PRV) or 'rdp'")


def is_bound_accountant(accountant):
  """Whether an accountant name's epsilon is an upper bound (a registered dp-accounting
  accountant; not "gdp", an approximation)."""
  return isinstance(accountant, str) and accountant in accountants.accountant_names()


def check_bound_accountant(accountant, who):
  """The accountant name, checked to give an upper bound on epsilon (`is_bound_accountant`:
  GDP's approximation is refused); `who` is the caller's public name for the message (e.g.
  "StopAtPrivacyBudget").

  Raises:
    ParameterTypeError: `accountant` is not a str.
    BudgetConfigError: accountant='gdp' (an approximation), or an unknown or unavailable one.
  """
  check_accountant(accountant)
  if not is_bound_accountant(accountant):
    raise BudgetConfigError(
        f"`accountant` must be 'pld' or 'rdp' (or another registered accountant: "
        f"{accountants.accountant_names()}) for {who}: accountant={accountant!r} gives an "
        "approximation (a central limit theorem), not an upper bound on epsilon, so a budget, "
        "a stopping rule or a calibration resting on it can be exceeded without notice. Use "
        f"accountant='pld' or 'rdp'. Received: accountant={accountant!r}")
  return accountant


def warn_if_delta_too_large(delta, population_size, stacklevel=3):
  """Warns (UserWarning, at `stacklevel`) when delta in (0, 1) is >= 1/n for a finite
  population n > 0, and returns True when it warned: publishing each record with
  probability delta is (0, delta)-DP (Dwork and Roth, "The Algorithmic Foundations of
  Differential Privacy", Section 2.3)."""
  try:
    n, d = float(population_size), float(delta)
  except (TypeError, ValueError):
    return False   # not numbers: the callers' own checks name them
  if not (math.isfinite(n) and n > 0) or not 0.0 < d < 1.0 or d < 1.0 / n:
    return False
  warnings.warn(
      f"delta={d:g} is >= 1/n = 1/{n:g} = {1.0 / n:.3g} (n = population_size, the {n:g} "
      "records the guarantee protects): an (epsilon, delta) guarantee with delta >= 1/n "
      "allows revealing about one record outright. Use delta well below 1/n, e.g. "
      f"delta={1.0 / n ** 1.1:.2g} (1/n^1.1) or smaller", UserWarning, stacklevel=stacklevel)
  return True


def _gdp_report(content, delta, epsilon):
  """PrivacyReport by the GDP accountant (accounting.gdp; an approximation, labelled so)."""
  groups = content.groups
  mu = gdp.mu_of_groups(groups)
  notes = tuple(ledger_events.events_from_groups(groups, "rdp", content.passes)[2]) + (
      f"{gdp.CAVEAT}; mu = {mu:.6g}",)
  num = sum(g.count for g in groups)
  if delta is not None:
    return PrivacyReport(gdp.epsilon_from_mu(mu, delta), delta, "gdp", num, notes)
  return PrivacyReport(epsilon, gdp.delta_from_mu(mu, epsilon), "gdp", num, notes)


def _compose(content, accountant):
  event, relation, notes = ledger_events.events_from_groups(content.groups, accountant,
                                                            content.passes)
  acc = make_accountant(accountant, relation)
  if not acc.supports(event):
    raise PrivacyConfigError(f"accountant={accountant!r} cannot analyse this ledger under "
                             f"{relation.name} (e.g. PLD has no fixed-size sampling without "
                             "replacement); use accountant='rdp'")
  acc.compose(event)
  notes = notes + [accountants.get_accountant(accountant).description]
  return acc, notes


# Each of privacy_report's numbers alone (`validation.check_params`); the accountant is checked
# against the registry (`check_accountant`), and exactly one of delta and epsilon is required.
PRIVACY_REPORT_CONSTRAINTS = {
    "delta": validation.Optional(validation.Interval(float, 0, 1, closed="neither")),
    "epsilon": validation.Optional(validation.Interval(float, 0, None, closed="left")),
}


@validation.validates(PRIVACY_REPORT_CONSTRAINTS)
def privacy_report(ledger, delta=None, epsilon=None, accountant="rdp", key=None):
  """Epsilon at a given delta, or delta at a given epsilon (exactly one of them).

  Args:
    ledger: a PrivacyLedger, a ledger dict or JSON string (verified; `key` checks its HMAC),
      a LedgerContent, or (samples, queries[, passes]) arrays.
    delta: exactly one.
    epsilon: exactly one.
    accountant: "rdp" or "pld" (dp-accounting, upper bounds); "gdp" (an approximation,
      labelled so: `accounting.gdp`); "prv" is refused (not installed): use "pld".
    key: the HMAC key a signed ledger dict or JSON string is verified with (None: its
      SHA-256 digest only).

  Returns:
    PrivacyReport, whose assumptions name the relation, the unit, the sampling and for a
    ledger dict/JSON what its integrity check proves (a digest detects accidents, not forgery).

  Warns:
    UserWarning: delta >= 1/n for the ledger's population n (`warn_if_delta_too_large`).

  Raises:
    ParameterTypeError: delta, epsilon or the accountant of the wrong type.
    PrivacyConfigError: bad arguments, an altered file (a wrong digest; with `key`, a wrong or
      missing HMAC), or a ledger that cannot be accounted soundly.
  """
  content = ledger_content(ledger, key)
  if delta is not None and epsilon is None:
    # stacklevel 4: the user's line is behind this function and its `validates` wrapper.
    population = max([g.population_size for g in content.groups
                      if not g.is_selection and g.count > 0] or [0])   # selection rows: none
    warn_if_delta_too_large(delta, population, stacklevel=4)
  report = report_from_groups(content, delta=delta, epsilon=epsilon, accountant=accountant)
  if isinstance(ledger, (str, dict)):
    report = dataclasses.replace(report, assumptions=report.assumptions + (
        _integrity_note(key),))
  return report


def _integrity_note(key):
  """What the verification of a ledger dict/JSON proves (a line of the report)."""
  if key is not None:
    return ("integrity: HMAC-SHA256 under the given key verified; a file changed without "
            "the key is refused")
  return ("integrity: SHA-256 digest only (no key given): it detects accidental changes, "
          "NOT forgery; anyone can edit the file and recompute the digest, so this epsilon "
          "is only as trustworthy as the file's custody. Save with save_json(path, key=...) "
          "and report with key=... to refuse a forged file")


def report_from_groups(groups, delta=None, epsilon=None, accountant="rdp", passes=0):
  """`privacy_report` on SampleGroups (see ledger_events) or a LedgerContent.

  Args:
    groups: SampleGroups, or a LedgerContent (then `passes` is ignored).
    delta: the delta to compute epsilon at (give exactly one of delta and epsilon).
    epsilon: the epsilon to compute delta at (give exactly one of delta and epsilon).
    accountant: one of REPORT_ACCOUNTANTS.
    passes: shuffled passes started (policy shuffle).

  Returns:
    a PrivacyReport (epsilon inf, or delta 1, when a sample is not private).

  Raises:
    PrivacyConfigError: both or neither of delta and epsilon, a bad value, a bad accountant, or
      groups that cannot be accounted soundly.
  """
  content = groups if isinstance(groups, LedgerContent) else LedgerContent(tuple(groups), passes)
  groups = content.groups
  if (delta is None) == (epsilon is None):
    raise PrivacyConfigError(f"give exactly one of delta and epsilon, got delta={delta!r}, epsilon={epsilon!r}")
  check_accountant(accountant)
  num = sum(g.count for g in groups)
  if delta is not None:
    delta = validation.check_delta("delta", delta)
  else:
    epsilon = float(validation.check_nonnegative("epsilon", epsilon, allow_inf=False))
  if any(g.non_private for g in groups):
    notes = ledger_events.events_from_groups(groups, accountant)[2]
    return PrivacyReport(math.inf if epsilon is None else epsilon, 1.0 if delta is None else delta,
                         accountant, num, tuple(notes))
  if accountant == "gdp":
    return _gdp_report(content, delta, epsilon)
  acc, notes = _compose(content, accountant)
  if delta is not None:
    return PrivacyReport(float(acc.get_epsilon(delta)), delta, accountant, num, tuple(notes))
  return PrivacyReport(epsilon, float(acc.get_delta(epsilon)), accountant, num, tuple(notes))


def epsilon_function(groups, accountant="rdp"):
  """A function delta -> epsilon (a float; inf when a sample is not private) of SampleGroups
  or a LedgerContent under one of REPORT_ACCOUNTANTS, the events composed once (fast for
  many deltas, e.g. group privacy).

  Raises:
    PrivacyConfigError: a bad accountant (at once) or delta (when called).
  """
  content = groups if isinstance(groups, LedgerContent) else LedgerContent(tuple(groups))
  check_accountant(accountant)
  if any(g.non_private for g in content.groups):
    return lambda d: math.inf
  if accountant == "gdp":
    mu = gdp.mu_of_groups(content.groups)
    return lambda d: gdp.epsilon_from_mu(mu, validation.check_delta("delta", d))
  acc, _ = _compose(content, accountant)
  return lambda d: float(acc.get_epsilon(validation.check_delta("delta", d)))


def optimal_rdp_order(groups, delta):
  """The RDP order at which the RDP accountant's epsilon at `delta` is reached (TF Privacy's
  `opt_order`).

  Args:
    groups: SampleGroups or a LedgerContent.
    delta: in (0, 1).

  Returns:
    the order, a float; None when epsilon is 0 or infinite.

  Raises:
    PrivacyConfigError: delta outside (0, 1).
  """
  content = groups if isinstance(groups, LedgerContent) else LedgerContent(tuple(groups))
  delta = validation.check_delta("delta", delta)
  if any(g.non_private for g in content.groups):
    return None
  acc, _ = _compose(content, "rdp")
  eps, order = acc.get_epsilon_and_optimal_order(delta)
  return float(order) if math.isfinite(eps) and eps > 0 else None


def epsilon(ledger, delta, accountant="rdp", key=None):
  """Epsilon of everything the ledger recorded, at `delta` (`privacy_report(...).epsilon`).

  Args:
    ledger: a PrivacyLedger, a ledger dict/JSON, (samples, queries[, passes]) or a
      LedgerContent.
    delta: in (0, 1).
    accountant: one of REPORT_ACCOUNTANTS.
    key: HMAC key of a signed ledger dict/JSON.

  Returns:
    epsilon, a float (inf when a sample is not private).

  Raises:
    PrivacyConfigError: see `privacy_report`.
  """
  return privacy_report(ledger, delta=delta, accountant=accountant, key=key).epsilon


def delta(ledger, epsilon, accountant="rdp", key=None):
  """Delta of everything the ledger recorded, at `epsilon` (Geyer et al. 2017 fixes epsilon).

  Args:
    ledger: as `epsilon`.
    epsilon: >= 0, finite.
    accountant: as `epsilon`.
    key: as `epsilon`.

  Returns:
    delta, a float in [0, 1].

  Raises:
    PrivacyConfigError: see `privacy_report`.
  """
  return privacy_report(ledger, epsilon=epsilon, accountant=accountant, key=key).delta
