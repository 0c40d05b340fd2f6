"""Calibration (McMahan et al. 2018, Section 4): find the noise multiplier, sampling rate or number of
steps that meets a target (epsilon, delta).

Privacy cost is monotone in each knob, so bisection on the accountant's epsilon
(`accounting.search`) finds it, always on the safe side: the returned setting's epsilon is
<= target_epsilon (noise rounded up; rate and steps rounded down). Only upper-bound
accountants are taken: "gdp" is refused (`accountant.check_bound_accountant`).
"""

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.accounting import search
from tf_dpiter.errors import BudgetConfigError
from tf_dpiter.errors import ParameterValueError


def _epsilon(n, batch_size, noise_multiplier, steps, delta, accountant, sampling,
             num_microbatches=None):
  groups = dp_sgd.dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling,
                                num_microbatches)
  return accountant_lib.report_from_groups(groups, delta=delta, accountant=accountant).epsilon


def _check_targets(target_epsilon, target_delta):
  validation.check_positive("target_epsilon", target_epsilon)
  return validation.check_delta("target_delta", target_delta)


def _sampling_args(sampling_probability, population_size):
  """(n, batch) whose ratio is q; n only matters for shuffle/fixed-size policies."""
  n = float(population_size) if population_size else 1e9
  return n, sampling_probability * n


def calibrate_noise_multiplier(target_epsilon, target_delta, sampling_probability, steps,
                               accountant="rdp", sampling="poisson", population_size=None,
                               tol=1e-4, num_microbatches=None):
  """Smallest noise multiplier z (within relative `tol`, rounded up) meeting the target.

  Args:
    target_epsilon: > 0.
    target_delta: in (0, 1).
    sampling_probability: q in (0, 1].
    steps: T, an int >= 1 (an integral float is accepted).
    accountant: "rdp" or "pld" (upper bounds; "gdp", an approximation, is refused).
    sampling: a ledger policy ("poisson", "fixed_size", "shuffle").
    population_size: n (matters for fixed_size and shuffle); None: 1e9.
    tol: relative tolerance of z.
    num_microbatches: M, records are microbatches of ceil(B / M) examples (sensitivity 2C
      under replace-one sampling, as the ledger records it).

  Returns:
    z, a float; its epsilon is <= target_epsilon.

  Raises:
    ParameterTypeError: steps is not an integer.
    BudgetConfigError: accountant="gdp" (an approximation, not an upper bound).
    ParameterValueError: a bad target, q or steps, or no z up to 2^20 meets the target.
  """
  accountant_lib.check_bound_accountant(accountant, "calibrate_noise_multiplier")
  target_delta = _check_targets(target_epsilon, target_delta)
  validation.check_probability("sampling_probability", sampling_probability)
  if isinstance(steps, float) and steps.is_integer():
    steps = int(steps)
  validation.check_integer("steps", steps, 1)
  n, b = _sampling_args(sampling_probability, population_size)
  ok = lambda z: _epsilon(n, b, z, steps, target_delta, accountant, sampling,
                         num_microbatches) <= target_epsilon
  bad, good = search.doubling_bracket(ok, 1.0, limit=2 ** 20)
  if good is None:
    raise BudgetConfigError(f"no noise multiplier up to 2^20 reaches target_epsilon={target_epsilon}")
  return search.bisect(ok, bad, good, rel_tol=tol)


def calibrate_sampling_probability(target_epsilon, target_delta, noise_multiplier, steps,
                                   accountant="rdp", sampling="poisson", population_size=None,
                                   tol=1e-4):
  """Largest sampling probability q in (0, 1] (rounded down) meeting the target (a
  geometric `search.bisect` in log q).

  Args:
    target_epsilon: > 0.
    target_delta: in (0, 1).
    noise_multiplier: z > 0.
    steps: T, the number of samples.
    accountant: as `calibrate_noise_multiplier`.
    sampling: as `calibrate_noise_multiplier`.
    population_size: as `calibrate_noise_multiplier`.
    tol: as `calibrate_noise_multiplier`.

  Returns:
    q, a float in (0, 1]; its epsilon is <= target_epsilon.

  Raises:
    BudgetConfigError: accountant="gdp" (an approximation, not an upper bound).
    PrivacyConfigError: a bad target or z, or even q = 1/n exceeds the target.
  """
  accountant_lib.check_bound_accountant(accountant, "calibrate_sampling_probability")
  target_delta = _check_targets(target_epsilon, target_delta)
  validation.check_positive("noise_multiplier", noise_multiplier)
  n, _ = _sampling_args(1.0, population_size)
  eps = lambda q: _epsilon(n, q * n, noise_multiplier, steps, target_delta, accountant, sampling)
  if eps(1.0) <= target_epsilon:
    return 1.0
  lo = 1.0 / n
  if eps(lo) > target_epsilon:
    raise BudgetConfigError(f"even q={lo:.3g} exceeds target_epsilon={target_epsilon} with "
                            f"noise_multiplier={noise_multiplier} over {steps} steps")
  # in log q: the rate spans orders of magnitude
  return search.bisect(lambda q: eps(q) <= target_epsilon, 1.0, lo, rel_tol=tol,
                          geometric=True)


def calibrate_steps(target_epsilon, target_delta, noise_multiplier, sampling_probability,
                    accountant="rdp", sampling="poisson", population_size=None, max_steps=10**9):
  """Largest number of steps T meeting the target (0 if even one step exceeds it).

  Args:
    target_epsilon: > 0.
    target_delta: in (0, 1).
    noise_multiplier: z > 0.
    sampling_probability: q in (0, 1].
    accountant: as `calibrate_noise_multiplier`.
    sampling: as `calibrate_noise_multiplier`.
    population_size: as `calibrate_noise_multiplier`.
    max_steps: the search stops there.

  Returns:
    T, an int in [0, max_steps].

  Raises:
    BudgetConfigError: accountant="gdp" (an approximation, not an upper bound).
    PrivacyConfigError: a bad target, z or q.
  """
  accountant_lib.check_bound_accountant(accountant, "calibrate_steps")
  target_delta = _check_targets(target_epsilon, target_delta)
  validation.check_positive("noise_multiplier", noise_multiplier)
  validation.check_probability("sampling_probability", sampling_probability)
  n, b = _sampling_args(sampling_probability, population_size)
  ok = lambda t: _epsilon(n, b, noise_multiplier, t, target_delta, accountant,
                         sampling) <= target_epsilon
  return max(0, search.largest_integer(ok, 1, max_steps))


def compute_noise_from_budget(n, batch_size, epsilon, epochs, delta, accountant="rdp",
                              sampling="poisson", num_microbatches=None):
  """Noise multiplier for DP-SGD over n records meeting (epsilon, delta) after `epochs`.

  steps = ceil(epochs * n / batch_size), q = batch_size / n; see `calibrate_noise_multiplier`
  (TF Privacy's `compute_noise_from_budget`).

  Args:
    n: records.
    batch_size: expected batch size (<= n).
    epsilon: the target, > 0.
    epochs: > 0.
    delta: in (0, 1).
    accountant: as `calibrate_noise_multiplier`.
    sampling: as `calibrate_noise_multiplier`.
    num_microbatches: as `calibrate_noise_multiplier`.

  Returns:
    z, a float.

  Raises:
    BudgetConfigError: accountant="gdp" (an approximation, not an upper bound).
    ParameterValueError: a bad argument (named).
  """
  accountant_lib.check_bound_accountant(accountant, "compute_noise_from_budget")
  validation.check_positive("n", n, allow_inf=False)
  validation.check_positive("batch_size", batch_size, allow_inf=False)
  validation.check_positive("epochs", epochs, allow_inf=False)
  if batch_size > n:
    raise ParameterValueError(f"batch_size must be <= n={n}, got {batch_size!r}")
  steps = dp_sgd.dp_sgd_steps(n, batch_size, epochs)
  return calibrate_noise_multiplier(epsilon, delta, batch_size / n, steps, accountant,
                                    sampling, population_size=n,
                                    num_microbatches=num_microbatches)
