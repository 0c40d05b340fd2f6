"""Epsilon over training steps, read from a ledger, and its PNG plot. No TensorFlow.

`epsilon_curve` accounts prefixes of the ledger (its first k recorded samples) at up to
`num_points` values of k; the last is `accounting.epsilon(ledger, delta)`. A prefix of k of K
samples is charged max(ceil(k / steps_per_pass), ceil(passes * k / K)) shuffled passes,
capped by the recorded passes (passes carry no step index in the ledger).
"""

import dataclasses
import math
from typing import Tuple

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import ledger_events
from tf_dpiter.errors import PrivacyConfigError


@dataclasses.dataclass(frozen=True)
class EpsilonCurve:
  """epsilon[i] is the ledger's epsilon at `delta` after its first steps[i] samples.

  Attributes:
    steps: the sample counts at which epsilon was computed, increasing.
    epsilon: epsilon after the first steps[i] samples.
    delta: the delta every epsilon is stated at.
    accountant: the accountant that computed them ("rdp", "pld" or "gdp").
  """
  steps: Tuple[int, ...]
  epsilon: Tuple[float, ...]
  delta: float
  accountant: str


def _prefix(runs, k):
  """The runs of the first k samples."""
  out, left = [], k
  for count, sample, queries in runs:
    if left <= 0:
      break
    out.append((min(count, left), sample, queries))
    left -= count
  return out


def _prefix_passes(groups, k, total_steps, passes):
  """Passes charged to the first k of total_steps samples (module docstring)."""
  if passes <= 0:
    return 0
  needed = sum(accountant_lib.shuffle_passes_needed(g) for g in groups)
  return min(passes, max(needed, math.ceil(passes * k / total_steps)))


def epsilon_curve(ledger, delta, accountant="rdp", num_points=50, key=None):
  """Epsilon at `delta` after the first k samples of the ledger, for up to num_points k.

  Args:
    ledger: a PrivacyLedger, a ledger dict or JSON string, or (samples, queries[, passes]).
    delta: in (0, 1).
    accountant: one of accounting.REPORT_ACCOUNTANTS.
    num_points: at most this many points, evenly spaced in steps, the last one all samples.
    key: HMAC key of a signed ledger dict/JSON (checked).

  Returns:
    EpsilonCurve.

  Raises:
    PrivacyConfigError: an empty ledger, num_points < 1, or what `privacy_report` refuses.
  """
  validation.check_integer("num_points", num_points, 1)
  runs, passes = accountant_lib.ledger_runs(ledger, key)
  total = sum(c for c, _, _ in runs)
  if total == 0:
    raise PrivacyConfigError("ledger is empty: no samples were recorded, so there is no curve to draw")
  ks = sorted({max(1, round(total * (i + 1) / num_points)) for i in range(num_points)})
  eps = []
  for k in ks:
    groups = ledger_events.groups_from_runs(_prefix(runs, k))
    content = accountant_lib.LedgerContent(tuple(groups),
                                           _prefix_passes(groups, k, total, passes))
    eps.append(accountant_lib.report_from_groups(content, delta=delta,
                                                 accountant=accountant).epsilon)
  return EpsilonCurve(tuple(ks), tuple(eps), float(delta), accountant)


def plot_epsilon_curve(curve, path, title=None, epoch_steps=None):
  """Writes a PNG of epsilon over steps (matplotlib, Agg backend). Returns path.

  Args:
    curve: an EpsilonCurve.
    path: output PNG path.
    title: figure title (default names delta and the accountant).
    epoch_steps: optional step counts at which epochs ended (dotted vertical lines).

  Raises:
    ImportError: matplotlib is not installed (the message says how to install it).
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("plotting epsilon needs matplotlib: pip install matplotlib (or "
                      "tf_dpiter[auditing])") from None
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(curve.steps, [e if math.isfinite(e) else float("nan") for e in curve.epsilon], "-o",
          ms=3)
  for s in epoch_steps or ():
    ax.axvline(s, color="grey", lw=0.6, ls=":")
  ax.set_xlabel("training steps (ledger samples)")
  ax.set_ylabel("ε")
  ax.set_title(title or f"ε over training at δ = {curve.delta:g} "
               f"({curve.accountant.upper()} accountant"
               + (", approximate: not an upper bound" if curve.accountant == "gdp" else "")
               + ")")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
