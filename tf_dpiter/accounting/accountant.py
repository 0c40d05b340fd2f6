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
import dp_accounting as dpa
import numpy as np

from tf_dpiter.accounting import ledger_events
from tf_dpiter.dp_query import validation
from tf_dpiter.ledger import privacy_ledger as pl

ACCOUNTANTS = ("rdp", "pld")


class _DropExcludedOrderWarnings(logging.Filter):
  """dp-accounting warns each time a fractional RDP order fails to converge; it then excludes
  that order (epsilon is the minimum over the remaining orders, so the result stays a valid,
  conservative bound). A training loop asking for epsilon every epoch would repeat it
  endlessly, so we drop that one message."""

  def filter(self, record):
    return "_compute_log_a_frac failed to converge" not in str(record.msg)


absl_logging.get_absl_logger().addFilter(_DropExcludedOrderWarnings())


def make_accountant(accountant="rdp", neighboring_relation=ledger_events.ADD_OR_REMOVE):
  """A fresh dp-accounting accountant: 'rdp' (RdpAccountant) or 'pld' (PLDAccountant)."""
  if accountant == "rdp":
    return dpa.rdp.RdpAccountant(neighboring_relation=neighboring_relation)
  if accountant == "pld":
    if neighboring_relation != ledger_events.ADD_OR_REMOVE:
      raise ValueError("accountant='pld' cannot analyse fixed-size sampling without "
                       "replacement; use accountant='rdp'")
    return dpa.pld.PLDAccountant(neighboring_relation=neighboring_relation)
  raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _groups(ledger):
  """SampleGroups of a PrivacyLedger, a ledger dict, a JSON string or (samples, queries)."""
  if isinstance(ledger, pl.PrivacyLedger):
    return ledger_events.groups_from_arrays(*ledger.get_arrays())
  if isinstance(ledger, str):
    try:
      ledger = json.loads(ledger)
    except json.JSONDecodeError as e:
      raise ValueError(f"ledger JSON could not be parsed: {e}") from None
  if isinstance(ledger, dict):
    return ledger_events.groups_from_runs(pl.dict_to_runs(ledger))
  if isinstance(ledger, (tuple, list)) and len(ledger) == 2:
    return ledger_events.groups_from_arrays(*ledger)
  raise ValueError(f"ledger must be a PrivacyLedger, a ledger dict/JSON or (samples, queries), "
                   f"got {type(ledger).__name__}")


def ledger_to_dp_event(ledger, accountant="rdp"):
  """The dp-accounting event equivalent to the ledger (Eq. (1), composed with counts)."""
  event, _, _ = ledger_events.events_from_groups(_groups(ledger), accountant)
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
             f"({self.accountant.upper()} accountant, dp-accounting)."]
    lines += [f"  - {a}" for a in self.assumptions]
    return "\n".join(lines)


def _compose(groups, accountant):
  event, relation, notes = ledger_events.events_from_groups(groups, accountant)
  acc = make_accountant(accountant, relation)
  acc.compose(event)
  notes = notes + [("RDP accountant (dp-accounting RdpAccountant, default orders)"
                    if accountant == "rdp" else
                    "PLD accountant (dp-accounting PLDAccountant, default discretization)")]
  return acc, notes


def privacy_report(ledger, delta=None, epsilon=None, accountant="rdp"):
  """Epsilon at a given delta, or delta at a given epsilon (exactly one of them).

  `ledger`: a PrivacyLedger, a ledger dict or JSON string, or (samples, queries) arrays.
  """
  return report_from_groups(_groups(ledger), delta=delta, epsilon=epsilon, accountant=accountant)


def report_from_groups(groups, delta=None, epsilon=None, accountant="rdp"):
  """privacy_report on SampleGroups (see ledger_events)."""
  if (delta is None) == (epsilon is None):
    raise ValueError(f"give exactly one of delta and epsilon, got delta={delta!r}, epsilon={epsilon!r}")
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
  num = sum(g.count for g in groups)
  if delta is not None:
    delta = validation.check_delta("delta", delta)
    if any(g.non_private for g in groups):
      return PrivacyReport(math.inf, delta, accountant, num,
                           tuple(ledger_events.events_from_groups(groups, accountant)[2]))
    acc, notes = _compose(groups, accountant)
    return PrivacyReport(float(acc.get_epsilon(delta)), delta, accountant, num, tuple(notes))
  validation.check_nonnegative("epsilon", epsilon, allow_inf=False)
  epsilon = float(epsilon)
  if any(g.non_private for g in groups):
    return PrivacyReport(epsilon, 1.0, accountant, num,
                         tuple(ledger_events.events_from_groups(groups, accountant)[2]))
  acc, notes = _compose(groups, accountant)
  return PrivacyReport(epsilon, float(acc.get_delta(epsilon)), accountant, num, tuple(notes))


def epsilon(ledger, delta, accountant="rdp"):
  """Epsilon of everything the ledger recorded, at `delta`."""
  return privacy_report(ledger, delta=delta, accountant=accountant).epsilon


def delta(ledger, epsilon, accountant="rdp"):
  """Delta of everything the ledger recorded, at `epsilon` (seed 003 fixes epsilon)."""
  return privacy_report(ledger, epsilon=epsilon, accountant=accountant).delta
