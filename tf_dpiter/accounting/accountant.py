"""The accountant: reads a privacy ledger and returns (epsilon, delta) (seed 002, Section 6).

RDP (default) or PLD accounting, both from dp-accounting. The report states every
assumption it rests on (adjacency, sampling policy, amplification claimed or not).
"""

import dataclasses
import json
import logging
import math
from typing import Tuple

from absl import logging as absl_logging

from tf_dpiter.accounting import gdp
from tf_dpiter.accounting import ledger_events
from tf_dpiter.accounting.ledger_events import dpa
from tf_dpiter.dp_query import validation
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec

ACCOUNTANTS = ("rdp", "pld")
# Accountants privacy_report also takes: "gdp" (mu-GDP, Poisson by a CLT: an approximation;
# accounting.gdp) and "prv" (Opacus' PRV accountant: refused, its package is not installed).
REPORT_ACCOUNTANTS = ACCOUNTANTS + ("gdp", "prv")
_SOURCE = {"rdp": "dp-accounting", "pld": "dp-accounting",
           "gdp": "CLT approximation, not an upper bound"}


class _DropExcludedOrderWarnings(logging.Filter):
  """dp-accounting warns each time a fractional RDP order fails to converge; it then excludes
  that order (epsilon is the minimum over the remaining orders, so the result stays a valid,
  conservative bound). A training loop asking for epsilon every epoch would repeat it
  endlessly, so we drop that one message."""

  def filter(self, record):
    return "_compute_log_a_frac failed to converge" not in str(record.msg)


absl_logging.get_absl_logger().addFilter(_DropExcludedOrderWarnings())


def make_accountant(accountant="rdp", neighboring_relation=None):
  """A fresh dp-accounting accountant: 'rdp' (RdpAccountant) or 'pld' (PLDAccountant).

  neighboring_relation: a dp-accounting NeighboringRelation (default add or remove one).
  """
  if neighboring_relation is None:
    neighboring_relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == "rdp":
    return dpa.rdp.RdpAccountant(neighboring_relation=neighboring_relation)
  if accountant == "pld":
    return dpa.pld.PLDAccountant(neighboring_relation=neighboring_relation)
  raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


@dataclasses.dataclass(frozen=True)
class LedgerContent:
  """What the accountant reads: the SampleGroups and the shuffled passes of a ledger."""
  groups: Tuple[ledger_events.SampleGroup, ...]
  passes: int = 0


def ledger_runs(ledger, key=None):
  """(runs [(count, sample_row, query_rows)] in recording order, passes) of a PrivacyLedger,
  a ledger dict or JSON string (verified: digest; HMAC with key) or (samples, queries[,
  passes]) arrays."""
  if hasattr(ledger, "get_arrays") and hasattr(ledger, "passes"):
    samples, queries = rec.validate_arrays(*ledger.get_arrays())
    return rec.run_length_encode(samples, queries), int(ledger.passes.numpy())
  if isinstance(ledger, str):
    try:
      ledger = json.loads(ledger)
    except json.JSONDecodeError as e:
      raise ValueError(f"ledger JSON could not be parsed: {e}") from None
  if isinstance(ledger, dict):
    return ledger_file.dict_to_runs(ledger, key)
  if isinstance(ledger, (tuple, list)) and len(ledger) in (2, 3):
    samples, queries = rec.validate_arrays(*ledger[:2])
    passes = int(ledger[2]) if len(ledger) == 3 else 0
    return rec.run_length_encode(samples, queries), passes
  raise ValueError(f"ledger must be a PrivacyLedger, a ledger dict/JSON or (samples, queries"
                   f"[, passes]), got {type(ledger).__name__}")


def _content(ledger, key=None):
  """LedgerContent of a LedgerContent or of anything `ledger_runs` reads."""
  if isinstance(ledger, LedgerContent):
    return ledger
  runs, passes = ledger_runs(ledger, key)
  return LedgerContent(tuple(ledger_events.groups_from_runs(runs)), passes)


def ledger_to_dp_event(ledger, accountant="rdp"):
  """The dp-accounting event equivalent to the ledger (Eq. (1), composed with counts)."""
  c = _content(ledger)
  event, _, _ = ledger_events.events_from_groups(c.groups, accountant, c.passes)
  return event


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """The guarantee computed from a ledger, and the assumptions it rests on."""
  epsilon: float
  delta: float
  accountant: str
  num_samples: int
  assumptions: Tuple[str, ...]

  def __str__(self):
    lines = [f"({self.epsilon:.4g}, {self.delta:.3g})-DP over {self.num_samples} samples "
             f"({self.accountant.upper()} accountant, {_SOURCE[self.accountant]})."]
    lines += [f"  - {a}" for a in self.assumptions]
    return "\n".join(lines)


def check_accountant(accountant):
  """Raises ValueError unless `accountant` is one privacy_report can use here (names it)."""
  if accountant not in REPORT_ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {REPORT_ACCOUNTANTS}, got {accountant!r}")
  if accountant == "prv":
    try:
      import prv_accountant  # pylint: disable=g-import-not-at-top,unused-import
      why = "tf_dpiter does not call the installed prv-accountant package yet"
    except ImportError:
      why = "the prv-accountant package (Opacus' PRV accountant) is not installed"
    raise ValueError(f"accountant='prv' is not available: {why}. Use accountant='pld' "
                     "(dp-accounting's privacy loss distribution accountant, numerically tight "
                     "like PRV) or 'rdp'")


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
    raise ValueError(f"accountant={accountant!r} cannot analyse this ledger under "
                     f"{relation.name} (e.g. PLD has no fixed-size sampling without "
                     "replacement); use accountant='rdp'")
  acc.compose(event)
  notes = notes + [("RDP accountant (dp-accounting RdpAccountant, default orders)"
                    if accountant == "rdp" else
                    "PLD accountant (dp-accounting PLDAccountant, default discretization)")]
  return acc, notes


def privacy_report(ledger, delta=None, epsilon=None, accountant="rdp", key=None):
  """Epsilon at a given delta, or delta at a given epsilon (exactly one of them).

  Args:
    ledger: a PrivacyLedger, a ledger dict or JSON string (verified; `key` checks its HMAC),
      a LedgerContent, or (samples, queries[, passes]) arrays.
    delta / epsilon: exactly one.
    accountant: "rdp" or "pld" (dp-accounting, upper bounds); "gdp" (mu-GDP with Poisson
      subsampling by a central limit theorem, as TF Privacy's GDP accountant: an
      approximation, labelled so; Poisson or full-batch Gaussian steps only); "prv" is
      refused (Opacus' PRV accountant is not installed): use "pld".
  Returns:
    PrivacyReport, whose assumptions name the relation, the unit and the sampling.
  Raises:
    ValueError: bad arguments, an altered file, or a ledger that cannot be accounted soundly.
  """
  return report_from_groups(_content(ledger, key), delta=delta, epsilon=epsilon,
                            accountant=accountant)


def report_from_groups(groups, delta=None, epsilon=None, accountant="rdp", passes=0):
  """privacy_report on SampleGroups (see ledger_events) or a LedgerContent."""
  content = groups if isinstance(groups, LedgerContent) else LedgerContent(tuple(groups), passes)
  groups = content.groups
  if (delta is None) == (epsilon is None):
    raise ValueError(f"give exactly one of delta and epsilon, got delta={delta!r}, epsilon={epsilon!r}")
  check_accountant(accountant)
  num = sum(g.count for g in groups)
  if delta is not None:
    delta = validation.check_delta("delta", delta)
    if any(g.non_private for g in groups):
      return PrivacyReport(math.inf, delta, accountant, num,
                           tuple(ledger_events.events_from_groups(groups, accountant)[2]))
    if accountant == "gdp":
      return _gdp_report(content, delta, None)
    acc, notes = _compose(content, accountant)
    return PrivacyReport(float(acc.get_epsilon(delta)), delta, accountant, num, tuple(notes))
  validation.check_nonnegative("epsilon", epsilon, allow_inf=False)
  epsilon = float(epsilon)
  if any(g.non_private for g in groups):
    return PrivacyReport(epsilon, 1.0, accountant, num,
                         tuple(ledger_events.events_from_groups(groups, accountant)[2]))
  if accountant == "gdp":
    return _gdp_report(content, None, epsilon)
  acc, notes = _compose(content, accountant)
  return PrivacyReport(epsilon, float(acc.get_delta(epsilon)), accountant, num, tuple(notes))


def epsilon_function(groups, accountant="rdp"):
  """delta -> epsilon of SampleGroups or a LedgerContent, the events composed once (fast
  for many deltas, e.g. group privacy); privacy_report's checks and accountants."""
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
  `opt_order`), for SampleGroups or a LedgerContent; None when epsilon is 0 or infinite."""
  content = groups if isinstance(groups, LedgerContent) else LedgerContent(tuple(groups))
  delta = validation.check_delta("delta", delta)
  if any(g.non_private for g in content.groups):
    return None
  acc, _ = _compose(content, "rdp")
  eps, order = acc.get_epsilon_and_optimal_order(delta)
  return float(order) if math.isfinite(eps) and eps > 0 else None


def epsilon(ledger, delta, accountant="rdp", key=None):
  """Epsilon of everything the ledger recorded, at `delta`."""
  return privacy_report(ledger, delta=delta, accountant=accountant, key=key).epsilon


def delta(ledger, epsilon, accountant="rdp", key=None):
  """Delta of everything the ledger recorded, at `epsilon` (seed 003 fixes epsilon)."""
  return privacy_report(ledger, epsilon=epsilon, accountant=accountant, key=key).delta
