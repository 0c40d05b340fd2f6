"""Privacy of DP-SGD from its hyperparameters, through the same path as a ledger.

steps = ceil(epochs * n / batch_size); each step is one sample (q = batch_size / n) with one
Gaussian sum query of noise multiplier z. The event is built by the same code that reads
ledgers (`ledger_events`), so the two can never disagree.
"""

import dataclasses
import math
from typing import Tuple

import numpy as np

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import ledger_events
from tf_dpiter.dp_query import validation
from tf_dpiter.ledger import privacy_ledger as pl


def dp_sgd_steps(n, batch_size, epochs):
  """Number of steps of `epochs` passes at `batch_size` over n records (rounded up)."""
  return int(math.ceil(epochs * n / batch_size))


def _check(n, batch_size, noise_multiplier, epochs, sampling):
  validation.check_positive("n", n, allow_inf=False)
  validation.check_positive("batch_size", batch_size, allow_inf=False)
  if batch_size > n:
    raise ValueError(f"batch_size must be <= n={n}, got {batch_size!r}")
  validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
  validation.check_positive("epochs", epochs, allow_inf=False)
  if sampling not in pl.POLICIES:
    raise ValueError(f"sampling must be one of {pl.POLICIES}, got {sampling!r}")


def dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling="poisson"):
  """The ledger content (as SampleGroups) of `steps` identical DP-SGD steps."""
  sample = np.array([float(n), batch_size / n, float(batch_size), pl.policy_code(sampling), 1.0])
  query = np.array([[0.0, pl.GAUSSIAN, 1.0, float(noise_multiplier)]])
  return ledger_events.groups_from_runs([(int(steps), sample, query)])


@dataclasses.dataclass(frozen=True)
class DpSgdPrivacy:
  epsilon: float
  delta: float
  steps: int
  sampling_probability: float
  statement: str
  assumptions: Tuple[str, ...]

  def __str__(self):
    return self.statement


def compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta, accountant="rdp",
                           sampling="poisson"):
  """(epsilon, statement) of DP-SGD over n records, batch size B, noise z, `epochs` at delta."""
  _check(n, batch_size, noise_multiplier, epochs, sampling)
  delta = validation.check_delta("delta", delta)
  steps = dp_sgd_steps(n, batch_size, epochs)
  groups = dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling)
  report = accountant_lib.report_from_groups(groups, delta=delta, accountant=accountant)
  q = batch_size / n
  statement = (
      f"DP-SGD on n={n} records, batch size {batch_size} (q={q:.4g}), noise multiplier "
      f"{noise_multiplier}, {epochs} epochs = {steps} steps satisfies "
      f"({report.epsilon:.4g}, {delta:.3g})-DP ({accountant.upper()} accountant).\n"
      + "\n".join(f"  - {a}" for a in report.assumptions))
  return DpSgdPrivacy(report.epsilon, delta, steps, q, statement, report.assumptions)
