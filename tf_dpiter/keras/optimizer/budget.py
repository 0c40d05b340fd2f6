"""Noise calibration for a DP-SGD budget, shared by `DPKeras*Optimizer.from_budget` and
`make_private_with_epsilon` (McMahan et al. 2018, Section 4: the accountant inverted)."""

import logging
import math

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import calibration
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.errors import BudgetConfigError

_LOG = logging.getLogger("tf_dpiter")


def calibrated_noise(epsilon, delta, epochs, batch_size, population_size, sampling="poisson",
                     accountant="rdp", num_microbatches=None, who="from_budget"):
  """(z, calibration dict): the smallest noise multiplier for which the DP-SGD steps `fit`
  takes (`fit_steps`) at q = B / n under `sampling` give epsilon <= the target at delta
  (accounting.calibration.calibrate_noise_multiplier), logged on logger "tf_dpiter" (INFO).

  Args:
    epsilon, delta, epochs, batch_size, population_size, sampling, accountant,
      num_microbatches: as DPOptimizerBase.from_budget. who: the log line's caller name.

  Returns:
    (z, dict of the calibration's inputs and result).

  Warns:
    UserWarning: delta >= 1/population_size (`accountant.warn_if_delta_too_large`).

  Raises:
    BudgetConfigError: batch_size larger than population_size (names both values), or
      accountant="gdp" (an approximation: a calibration needs an upper bound, "pld" or "rdp").
  """
  accountant_lib.check_bound_accountant(accountant, who)
  _check_batch_fits(batch_size, population_size, who)
  accountant_lib.warn_if_delta_too_large(delta, population_size, stacklevel=4)
  calibration.compute_noise_from_budget(     # validates the arguments, names a bad one
      population_size, batch_size, epsilon, epochs, delta, accountant=accountant,
      sampling=sampling, num_microbatches=num_microbatches)
  steps = fit_steps(population_size, batch_size, epochs, sampling)
  z = calibration.calibrate_noise_multiplier(
      epsilon, delta, batch_size / population_size, steps, accountant, sampling,
      population_size=population_size, num_microbatches=num_microbatches)
  calib = {"epsilon": float(epsilon), "delta": float(delta), "epochs": epochs,
           "batch_size": batch_size, "population_size": population_size, "sampling": sampling,
           "steps": steps, "accountant": accountant, "noise_multiplier": z}
  _LOG.info("%s: noise_multiplier=%.4f calibrated by the %s accountant for epsilon=%g, "
            "delta=%g over %d steps (q=%.6g, %s sampling, n=%d)", who, z, accountant, epsilon,
            delta, steps, batch_size / population_size, sampling, population_size)
  return z, calib


def fit_steps(population_size, batch_size, epochs, sampling):
  """The steps `fit(x, y, batch_size=B, epochs=E)` takes, as the calibration must count them.

  A Poisson `fit` takes round(n / B) samples per epoch (`dp.data.poisson_batches`), which can
  exceed ceil(E n / B) (n = 55,000, B = 1,024, E = 40: 2,160 against 2,149); the calibration
  counts the larger of the two, so the ledger's epsilon stays <= the target either way.

  Args:
    population_size: n.
    batch_size: B, the expected batch size.
    epochs: E (whole or fractional).
    sampling: the ledger policy of the calibration ("poisson", "shuffle", "fixed_size").

  Returns:
    T, an int >= 1.
  """
  steps = dp_sgd.dp_sgd_steps(population_size, batch_size, epochs)
  if sampling == "poisson" and float(epochs) == int(epochs):
    per_epoch = max(1, int(round(population_size / batch_size)))
    steps = max(steps, int(epochs) * per_epoch)
  return steps


def _check_batch_fits(batch_size, population_size, who):
  """Refuses a batch larger than the data: q = B / n > 1 is no sampling rate, and fit
  would then see fewer records per step than the calibration assumed."""
  try:
    b, n = float(batch_size), float(population_size)
  except (TypeError, ValueError):
    return   # not numbers: the calibration's own checks name them
  if math.isfinite(b) and math.isfinite(n) and n > 0 and b > n:
    raise BudgetConfigError(
        f"{who}: batch_size={batch_size!r} is larger than population_size={population_size!r} "
        f"(q = batch_size / population_size = {b / n:.3g} > 1): a step cannot use more "
        "records than the data holds, and the calibrated noise would not match the run. "
        "Use batch_size <= population_size, and give population_size=len(x_train), the "
        "number of records fit trains on")
