"""Privacy of DP-SGD from its hyperparameters, through the same path as a ledger.

steps = ceil(epochs * n / batch_size), each a sample (q = batch_size / n) with one Gaussian
sum query of multiplier z, built as the ledger records a run and read by `ledger_events`.
"""

import collections
import math

import numpy as np

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import ledger_events
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records as rec


def dp_sgd_steps(n, batch_size, epochs):
  """Number of steps of `epochs` passes at `batch_size` over n records.

  Args:
    n: records.
    batch_size: B (expected batch size).
    epochs: passes (may be fractional).

  Returns:
    ceil(epochs * n / B), an int.
  """
  return int(math.ceil(epochs * n / batch_size))


def _check(n, batch_size, num_microbatches=None):
  """What depends on two arguments (each alone: DP_SGD_PRIVACY_CONSTRAINTS): B <= n, M <= B."""
  if batch_size > n:
    raise ParameterValueError(validation.message("batch_size", f"<= n={n}", batch_size))
  if num_microbatches is not None:
    validation.check_integer("num_microbatches", num_microbatches, 1, batch_size)


# Each argument of compute_dp_sgd_privacy alone (`validation.check_params`).
DP_SGD_PRIVACY_CONSTRAINTS = {
    "n": validation.Interval(float, 0, None, closed="neither"),
    "batch_size": validation.Interval(float, 0, None, closed="neither"),
    "noise_multiplier": validation.Interval(float, 0, None, closed="left"),
    "epochs": validation.Interval(float, 0, None, closed="neither"),
    "delta": validation.Interval(float, 0, 1, closed="neither"),
    "sampling": validation.OneOf(rec.POLICIES, error=PrivacyConfigError),
    "num_microbatches": validation.Optional(validation.Integer(min=1)),
}


def examples_per_record(batch_size, num_microbatches):
  """k = ceil(B / M) examples per microbatch (the ledger's examples per record), an int; 1
  without microbatches (M None)."""
  return 1 if num_microbatches is None else int(math.ceil(batch_size / num_microbatches))


def dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling="poisson",
                  num_microbatches=None):
  """The `accountant.LedgerContent` of T = `steps` identical DP-SGD steps (n records, batch
  size B, noise multiplier z, a ledger policy `sampling`, M microbatches or None), as the
  ledger would record them. Sensitivity of the policy's relation (McMahan et al., "A General
  Approach to Adding Differential Privacy to Iterative Training Procedures", Appendix A);
  shuffle: a partial pass costs a whole one.

  Raises:
    ParameterValueError: microbatches with a policy that does not allow them.
  """
  k = examples_per_record(batch_size, num_microbatches)
  rec.check_examples_per_record(sampling, k)
  factor = rec.sensitivity_factor(rec.relation_for_policy(sampling), k)
  sample = np.array([float(n), batch_size / n, float(batch_size), rec.policy_code(sampling),
                     float(k), 1.0])
  query = np.array([[0.0, rec.GAUSSIAN, 1.0, float(noise_multiplier), factor]])
  groups = ledger_events.groups_from_runs([(int(steps), sample, query)])
  passes = sum(accountant_lib.shuffle_passes_needed(g) for g in groups)
  return accountant_lib.LedgerContent(tuple(groups), passes)


class DpSgdPrivacy(collections.namedtuple("DpSgdPrivacy", ["epsilon", "opt_order"])):
  """Epsilon of a DP-SGD run; unpacks as TF Privacy's `eps, opt_order = ...`.

  Fields: epsilon, opt_order (None but for RDP); also delta, steps, sampling_probability,
  statement (relation and unit; str()), assumptions.
  """

  def __new__(cls, epsilon, opt_order, delta, steps, sampling_probability, statement,
              assumptions):
    self = super().__new__(cls, epsilon, opt_order)
    self.delta = delta
    self.steps = steps
    self.sampling_probability = sampling_probability
    self.statement = statement
    self.assumptions = tuple(assumptions)
    return self

  def __str__(self):
    return self.statement

  def __repr__(self):
    return (f"DpSgdPrivacy(epsilon={self.epsilon!r}, opt_order={self.opt_order!r}, "
            f"delta={self.delta!r}, steps={self.steps!r})")


@validation.validates(DP_SGD_PRIVACY_CONSTRAINTS, also_raises=(ParameterValueError,))
def compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta, accountant="rdp",
                           sampling="poisson", num_microbatches=None):
  """Epsilon of DP-SGD over n records, batch size B, noise multiplier z, `epochs`, at delta.

  Args:
    n: the records of the training data.
    batch_size: B, the (expected) batch size.
    noise_multiplier: z (noise stddev z*C on the clipped sum).
    epochs: the passes over the data.
    delta: the delta epsilon is stated at.
    accountant: "rdp" or "pld" (upper bounds), or "gdp" (an approximation, labelled so in
      the statement: Poisson or full sampling only).
    sampling: "poisson" (q = B/n, add/remove one example), "fixed_size" (B of n without
      replacement, replace one), "shuffle" (ceil(epochs) passes, replace one) or "full".
    num_microbatches: M, or None; with M, one example moves its microbatch by 2C.

  Returns:
    DpSgdPrivacy: unpacks as TF Privacy's (eps, opt_order); .statement names the relation
    and the unit (and, when delta >= 1/n, says what that allows).

  Warns:
    UserWarning: delta >= 1/n (`accountant.warn_if_delta_too_large`).

  Raises:
    ParameterTypeError: an argument that is not a number (num_microbatches: an int).
    PrivacyConfigError: n, B or epochs <= 0, z < 0, delta outside (0, 1), NaN or infinite
      values, an unknown sampling or accountant.
    ParameterValueError: B > n, M < 1 or > B, or microbatches with an add/remove sampling.
  """
  _check(n, batch_size, num_microbatches)
  delta = float(delta)
  # stacklevel 4: the user's line is behind this function and its `validates` wrapper.
  large_delta = accountant_lib.warn_if_delta_too_large(delta, n, stacklevel=4)
  steps = dp_sgd_steps(n, batch_size, epochs)
  groups = dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling, num_microbatches)
  report = accountant_lib.report_from_groups(groups, delta=delta, accountant=accountant)
  q = batch_size / n
  statement = (
      f"DP-SGD on n={n} records, batch size {batch_size} (q={q:.4g}), noise multiplier "
      f"{noise_multiplier}, {epochs} epochs = {steps} steps, {sampling} sampling"
      + (f", {num_microbatches} microbatches" if num_microbatches else "")
      + (" satisfies " if accountant != "gdp" else " satisfies approximately ")
      + f"({report.epsilon:.4g}, {delta:.3g})-DP ({accountant.upper()} accountant"
      + (": an approximate value, not an upper bound" if accountant == "gdp" else "") + ").\n"
      + "\n".join(f"  - {a}" for a in report.assumptions)
      + (f"\n  - delta = {delta:g} >= 1/n = {1.0 / n:.3g}: such a guarantee allows revealing "
         "about one record outright; use delta well below 1/n" if large_delta else ""))
  order = accountant_lib.optimal_rdp_order(groups, delta) if accountant == "rdp" else None
  return DpSgdPrivacy(report.epsilon, order, delta, steps, q, statement, report.assumptions)
