"""A DP copy of a plain Keras optimizer, its noise calibrated to a budget.

The shared body of `dp.keras.from_budget` and `make_private_with_epsilon`: above both the
calibration (`budget`) and the optimizers (`optimizers`), so that neither imports the other.
"""

import keras

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.optimizer import budget
from tf_dpiter.keras.optimizer import optimizers as opt_lib


def dp_copy_for_budget(optimizer, epsilon, delta, epochs, batch_size, population_size,
                       l2_norm_clip, sampling, accountant, dp_kwargs, who):
  """A DP copy of the plain Keras `optimizer` with the noise multiplier `budget.calibrated_noise`
  finds (the shared body of `dp.keras.from_budget` and `make_private_with_epsilon`).

  Args:
    optimizer: a plain keras.optimizers.Optimizer instance (its hyperparameters are kept).
    epsilon: the target epsilon (as `budget.calibrated_noise`).
    delta: the target delta.
    epochs: the epochs of the planned run.
    batch_size: the expected batch size B.
    population_size: n, the records the guarantee protects.
    l2_norm_clip: the clipping norm S.
    sampling: the sampling policy of the planned run.
    accountant: the accountant the calibration uses (an upper bound: "rdp", "pld" or another
      registered one).
    dp_kwargs: dict of the other DP optimizer arguments.
    who: the caller's public name (messages and the log line).

  Returns:
    the DP optimizer, its calibration in `.calibration`.

  Raises:
    ParameterValueError: a DP or non-Keras optimizer.
    BudgetConfigError: a target the calibration refuses (calibrated_noise).
  """
  if not isinstance(optimizer, keras.optimizers.Optimizer) or isinstance(
      optimizer, opt_lib.DPOptimizerBase):
    raise ParameterValueError(f"{who}: `optimizer` must be a plain keras.optimizers.Optimizer instance "
                              f"(not a DP optimizer). Received: optimizer={optimizer!r}")
  z, calib = budget.calibrated_noise(epsilon, delta, epochs, batch_size, population_size,
                                     sampling, accountant, dp_kwargs.get("num_microbatches"),
                                     who=who)
  dp_opt = opt_lib.DPOptimizer(optimizer, l2_norm_clip, z, **dp_kwargs)
  dp_opt.calibration = calib
  return dp_opt
