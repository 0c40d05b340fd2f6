"""Large-batch planning: batch size, steps and noise for a privacy budget and a compute budget.

Each candidate batch size B gets T = floor(C / B) steps of a compute budget C (example
gradients) under Poisson sampling (q = B / n; add/remove one example, unit: one example) and
the smallest z reaching (epsilon, delta) (`calibrate_noise_multiplier`; z rounded up, so never
above the target). Candidates are ranked by the total noise eta = z / (q sqrt(T)) of Sander,
Stock and Sablayrolles, "TAN without a burn: Scaling laws of DP-SGD", Section 3 (lower is
better); at fixed C, eta = z / sqrt(q C / n) favours large batches (De et al., "Unlocking
High-Accuracy Differentially Private Image Classification through Scale", Section 3.2).
`min_steps` keeps enough steps for TAN's scaling to hold.
"""

import dataclasses
import math
from typing import Tuple

from tf_dpiter import validation
from tf_dpiter.accounting import calibration
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.errors import ParameterValueError


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """One (B, T, z) with its cost and noise figures (module docstring).

  Attributes:
    batch_size: B, the expected batch size (Poisson).
    steps: T.
    noise_multiplier: z (noise stddev z S on the clipped sum).
    sampling_probability: q = B / n.
    epochs: B T / n.
    example_gradients: B T <= the compute budget.
    noise_per_step: z / B: noise stddev on the averaged gradient, units of S.
    total_noise: eta = z / (q sqrt(T)) (Sander et al. 2023).
    epsilon: the accountant's epsilon of this plan (<= the target).
  """
  batch_size: int             # B, the expected batch size (Poisson)
  steps: int                  # T
  noise_multiplier: float     # z (noise stddev z S on the clipped sum)
  sampling_probability: float  # q = B / n
  epochs: float               # B T / n
  example_gradients: int      # B T <= the compute budget
  noise_per_step: float       # z / B: noise stddev on the averaged gradient, units of S
  total_noise: float          # eta = z / (q sqrt(T)) (Sander et al. 2023)
  epsilon: float              # the accountant's epsilon of this plan (<= the target)


def _candidates(n, budget, batch_sizes, max_batch_size, min_steps):
  if batch_sizes is None:
    batch_sizes = [2 ** i for i in range(4, 40) if 2 ** i <= n]
  cap = min(n, max_batch_size or n, budget // min_steps)
  out = sorted({int(b) for b in batch_sizes if 1 <= int(b) <= cap})
  if not out:
    raise ParameterValueError(f"no batch size fits: B <= min(n={n}, max_batch_size={max_batch_size}, "
                              f"compute_budget // min_steps = {budget // min_steps}). Raise "
                              "`compute_budget` or lower `min_steps`")
  return out


def plan_for(epsilon, delta, population_size, batch_size, steps, accountant="rdp"):
  """The BatchPlan of a given batch size B <= n = population_size and steps T >= 1: z
  calibrated to the target (epsilon, delta) under Poisson sampling, accountant "rdp" or
  "pld"."""
  q = batch_size / population_size
  z = calibration.calibrate_noise_multiplier(epsilon, delta, q, steps, accountant=accountant)
  groups = dp_sgd.dp_sgd_groups(population_size, batch_size, z, steps, "poisson")
  eps = accountant_lib.report_from_groups(groups, delta=delta, accountant=accountant).epsilon
  return BatchPlan(batch_size, steps, z, q, batch_size * steps / population_size,
                   batch_size * steps, z / batch_size, z / (q * math.sqrt(steps)), eps)


def plan_batch_size(epsilon, delta, population_size, compute_budget, min_steps=100,
                    batch_sizes=None, max_batch_size=None,
                    accountant="rdp") -> Tuple[BatchPlan, Tuple[BatchPlan, ...]]:
  """Proposes (B, T, z) for a privacy budget and a compute budget (module docstring).

  Args:
    epsilon: target epsilon > 0.
    delta: target delta in (0, 1).
    population_size: n, examples in the data set.
    compute_budget: C, the number of per-example gradients the run may compute (B T <= C).
    min_steps: the fewest optimizer steps a plan may have (T >= min_steps).
    batch_sizes: candidate B (default: the powers of two from 16 up to n).
    max_batch_size: an upper bound on B (e.g. memory with max_physical_batch_size unset).
    accountant: "rdp" (default) or "pld".

  Returns:
    (the plan with the smallest total noise eta, all candidate plans by increasing B).

  Raises:
    ParameterValueError: a bad argument, or no candidate B with T = C // B >= min_steps.
  """
  validation.check_positive("epsilon", epsilon)
  validation.check_delta("delta", delta)
  n = validation.check_integer("population_size", population_size, 1)
  budget = validation.check_integer("compute_budget", compute_budget, 1)
  min_steps = validation.check_integer("min_steps", min_steps, 1)
  plans = tuple(plan_for(epsilon, delta, n, b, budget // b, accountant)
                for b in _candidates(n, budget, batch_sizes, max_batch_size, min_steps))
  return min(plans, key=lambda p: p.total_noise), plans
