"""Each sampling policy as one object: relation, unit, participation rule, event, checks.

A policy object states what a claim over its samples assumes (McMahan et al., "A General
Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5 and
Appendix A): the neighbouring relation and the unit of privacy, how often and how far apart
one unit can take part (`participations`, `steps_per_pass`), the checks a declared sampling
must pass (`check_sampling`), and the dp-accounting event of a group of its samples (`event`).
The base class is `policy_base.SamplingPolicy`. Adding a policy is one subclass here plus
`register` (and its name and code in `schema`).
`tf_dpiter.accounting.ledger_events` and `QueryWithLedger` dispatch on `get(name)`; no
if-chain over policy names is left there. Pure Python (dp-accounting loads on first use).
"""

import math

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema
from tf_dpiter.ledger.policy_base import SamplingPolicy
from tf_dpiter.ledger.policy_base import composite as _composite
from tf_dpiter.ledger.policy_base import dpa as _dpa
from tf_dpiter.ledger.policy_base import gaussian_only as _gaussian_only

_REGISTRY = {}


class Full(SamplingPolicy):
  """Every record in every sample; add or remove one example."""
  name = schema.FULL

  def gdp_mu_squared(self, group):
    return group.count / group.noise_multiplier ** 2

  def describe(self, population_size, selection_probability, sample_size):
    return (f"full batches (all n = {int(population_size)} records every step; add/remove-one "
            "adjacency, sensitivity S, no amplification)")


class Poisson(SamplingPolicy):
  """Each record joins each sample independently with probability q; add or remove one."""
  name = schema.POISSON
  expected_size_denominator = True

  def gdp_mu_squared(self, group):
    q, z = group.selection_probability, group.noise_multiplier
    if q >= 1.0:
      return group.count / z ** 2
    return group.count * q ** 2 * math.expm1(1.0 / z ** 2)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"Poisson sampling (q = {float(selection_probability):.4g} = {float(sample_size):g}"
            f" / {int(population_size)}: the stated expected batch over the stated population, "
            "fixed before sampling; add/remove-one adjacency, sensitivity S)")

  def _event(self, group, mech, accountant, passes, notes):
    q, n = group.selection_probability, group.population_size
    dpa = _dpa()
    if q >= 1:
      return super()._event(group, mech, accountant, passes, notes)
    lap = group.laplace_noise_multipliers
    if not lap or (accountant == "pld" and len(lap) == 1
                   and not math.isfinite(group.noise_multiplier)):
      notes.append(f"Poisson sampling (q={q:.6g}, n={n:.0f}): amplification by subsampling "
                   "assumes each record joined each sample independently with probability q, "
                   "q a public parameter fixed independently of the data (a neighbouring "
                   "dataset is sampled with the same q), and the sample's membership stayed "
                   f"secret; q is stated over the population size n={n:.0f}: when that is "
                   "the training data's own size (DPModel.fit's default without "
                   "population_size), the dataset's size is treated as public")
      return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, mech), group.count)
    notes.append("Poisson-sampled samples with Laplace queries: no amplification by sampling "
                 "claimed (the accountant does not support it for this mechanism)")
    return dpa.SelfComposedDpEvent(mech, group.count)


class UserPoisson(Poisson):
  """Poisson sampling of users; the unit is the user (add or remove one user)."""
  name = schema.USER_POISSON

  def describe(self, population_size, selection_probability, sample_size):
    return (f"Poisson sampling of users (q = {float(selection_probability):.4g}, expected "
            f"{float(sample_size):g} users of n = {int(population_size)}; add/remove-one-user "
            "adjacency, sensitivity S per user)")


class FixedSize(SamplingPolicy):
  """Independent samples of m records without replacement; replace one example."""
  name = schema.FIXED_SIZE
  sized = True

  def describe(self, population_size, selection_probability, sample_size):
    return (f"fixed-size samples ({float(sample_size):g} of n = {int(population_size)} without "
            "replacement, independent across steps; replace-one adjacency, sensitivity 2S)")

  def _event(self, group, mech, accountant, passes, notes):
    n, m = group.population_size, group.sample_size
    if m >= n:
      return super()._event(group, mech, accountant, passes, notes)
    dpa = _dpa()
    if group.laplace_noise_multipliers:
      notes.append("fixed-size samples with Laplace queries: no amplification claimed")
      return dpa.SelfComposedDpEvent(mech, group.count)
    notes.append(f"fixed-size sampling without replacement ({m:.0f} of {n:.0f}), samples "
                 "independent across steps")
    return dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(int(n), int(m), mech), group.count)


class Shuffle(SamplingPolicy):
  """Passes over a fresh permutation, disjoint batches; replace one; charged per pass."""
  name = schema.SHUFFLE
  sized = True
  covers = ("tree",)
  pass_charged = True

  def steps_per_pass(self, group):
    return math.ceil(group.population_size / group.sample_size)

  def pass_lengths(self, population_size, sample_size):
    n, m = int(population_size), int(sample_size)
    return tuple(sorted({n // m, -(-n // m)} - {0}))

  def describe(self, population_size, selection_probability, sample_size):
    return (f"shuffled passes (batches of {float(sample_size):g} of n = {int(population_size)}; "
            "replace-one adjacency, sensitivity 2S, no amplification: each pass started costs "
            "one mechanism)")

  def _event(self, group, mech, accountant, passes, notes):
    composite = _composite()
    if group.correlated != "tree":
      return composite.shuffle_event(group, mech, passes, notes)
    _gaussian_only(group)
    if passes <= 0:
      raise ParameterValueError("tree aggregation rows with no shuffled pass recorded: one example may "
                                "join a tree several times, which SingleEpochTreeAggregationDpEvent does "
                                "not cover; refusing to account it")
    tree = _dpa().SingleEpochTreeAggregationDpEvent(group.noise_multiplier,
                                                    2 ** group.tree_depth - 1)
    notes.append(f"tree aggregation (DP-FTRL, depth {group.tree_depth}): each example at most "
                 "once per shuffled pass and every tree restarted at a pass boundary (the query's "
                 "restart period divides the steps per pass): one SingleEpochTreeAggregation"
                 "DpEvent per pass, accounted under REPLACE_SPECIAL with the recorded "
                 "per-leaf sensitivity (the Gaussian bound depends only on it)")
    return composite.shuffle_event(group, tree, passes, notes)


class CyclicPoisson(SamplingPolicy):
  """b groups fixed by each example's identity; step p Poisson-samples group p mod b."""
  name = schema.CYCLIC_POISSON
  whole_size = True
  covers = ("banded", "matrix")
  expected_size_denominator = True
  advances_cycle = True

  def expected_records(self, population_size, selection_probability, sample_size):
    # one of the b = sample_size groups is sampled per step
    return float(population_size) * float(selection_probability) / float(sample_size)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"cyclic Poisson sampling (b = {int(sample_size)} groups fixed by a hash of each "
            f"example, q = {float(selection_probability):.4g} within the active group, n = "
            f"{int(population_size)}; add/remove-one adjacency, sensitivity S, participations "
            ">= b steps apart)")

  def participations(self, run_count, sample_size):
    # c consecutive positions of the ledger's cyclic stream hold ceil(c / b) turns of a group
    return math.ceil(run_count / sample_size)

  def participation_bound(self, group, passes):
    return int(group.participations)

  def min_gap(self, group):
    # group p mod b is sampled at step p: turns of one group are b positions apart; only the
    # correlated-noise rows (BandMF, BLT) rely on it, independent noise needs the count only
    return int(group.sample_size) if group.correlated else 1

  def _event(self, group, mech, accountant, passes, notes):
    _gaussian_only(group)
    q, m, n = group.selection_probability, group.sample_size, group.population_size
    dpa = _dpa()
    if group.correlated == "matrix":
      notes.append(f"matrix mechanism (BLT) under cyclic sampling (b={m:.0f} groups): NO "
                   "amplification by sampling claimed; each example's "
                   f"{group.participations} participations >= b steps apart each cost a "
                   "Gaussian of the strategy's equivalent per-participation sensitivity (their "
                   "mu^2 add up to at least the whole run's)")
      return dpa.SelfComposedDpEvent(mech, group.participations)
    inner = mech if q >= 1 else dpa.PoissonSampledDpEvent(q, mech)
    what = ("banded matrix mechanism (noise multiplier over the strategy's largest column "
            "norm)" if group.correlated == "banded" else "independent Gaussian noise")
    notes.append(f"cyclic Poisson sampling: n={n:.0f} split into b={m:.0f} fixed groups, each "
                 "example's group a hash of its own identity (independent of the other "
                 "examples and of n), step p of the ledger's cyclic stream samples group "
                 f"p mod b with q={q:.6g}; {what} with at most b bands, so each example's "
                 f"{group.participations} participations are >= b steps apart and the run is "
                 "as private as that many Poisson-sampled Gaussian steps (Choquette-Choo et al. "
                 "2023, Theorem 4)")
    return dpa.SelfComposedDpEvent(inner, group.participations)


class TruncatedPoisson(SamplingPolicy):
  """Poisson(q), then a uniform subset of at most B; add or remove one (PLD only)."""
  name = schema.TRUNCATED_POISSON
  whole_size = True
  expected_size_denominator = True   # q n, the mean before the cap (a public constant)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"truncated Poisson sampling (q = {float(selection_probability):.4g}, n = "
            f"{int(population_size)}, at most {int(sample_size)} records; add/remove-one "
            "adjacency, charged at sensitivity 2S when the cap binds)")

  def _event(self, group, mech, accountant, passes, notes):
    _gaussian_only(group)
    n, q, m = group.population_size, group.selection_probability, group.sample_size
    if accountant != "pld":
      raise PrivacyConfigError(f"truncated Poisson sampling is accounted by dp-accounting's PLD "
                               f"accountant only (TruncatedSubsampledGaussianDpEvent): use "
                               f"accountant='pld', got {accountant!r}")
    notes.append(f"truncated Poisson sampling (q={q:.6g}, n={n:.0f}, at most {m:.0f} records: "
                 "a uniformly random subset of a larger sample), relation add or remove one "
                 "example: assumes each record joined independently with probability q, the "
                 "subset was uniform and both stayed secret; an added example can displace "
                 "another when the cap binds, which TruncatedSubsampledGaussianDpEvent charges "
                 "as sensitivity 2")
    dpa = _dpa()
    return dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(
        int(n), q, int(m), group.noise_multiplier), group.count)


class BallsInBins(SamplingPolicy):
  """Every example in one uniform step of each epoch of k; add or remove one; per epoch."""
  name = schema.BALLS_IN_BINS
  whole_size = True
  pass_charged = True

  def check_sampling(self, population_size, selection_probability, sample_size):
    bad = super().check_sampling(population_size, selection_probability, sample_size)
    if bad is None and abs(float(selection_probability) * float(sample_size) - 1.0) > 1e-9:
      return (f"selection_probability must be 1 / sample_size (1 / k) for policy "
              f"{self.name!r}, got {selection_probability!r} with sample_size {sample_size!r}")
    return bad

  def steps_per_pass(self, group):
    return int(group.sample_size)

  def pass_lengths(self, population_size, sample_size):
    del population_size
    return (int(sample_size),)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"balls in bins (every example in one uniform step of each epoch of "
            f"{int(sample_size)} steps, n = {int(population_size)}; add/remove-one adjacency, "
            "sensitivity S, each epoch started costs one mechanism)")

  def _event(self, group, mech, accountant, passes, notes):
    return _composite().balls_in_bins_event(group, mech, passes, notes)


def register(policy):
  """Registers a policy object under its name (its code must be in `schema.ALL_POLICIES`).

  Args:
    policy: a SamplingPolicy instance.
  Returns:
    the policy.
  Raises:
    ValueError: a name the schema does not know.
  """
  if policy.name not in schema.POLICY_CODE:
    raise PrivacyConfigError(f"policy name must be one of {schema.ALL_POLICIES}, got {policy.name!r}")
  _REGISTRY[policy.name] = policy
  return policy


def names():
  """The registered sampling policy names, in registration order (a tuple of str)."""
  return tuple(_REGISTRY)


def get(name):
  """The policy object of a sampling policy name.

  Args:
    name: a policy name.
  Returns:
    the registered SamplingPolicy.
  Raises:
    ValueError: an unknown name, or the selection marker (it samples nothing).
  """
  if name not in _REGISTRY:
    raise PrivacyConfigError(f"policy must be one of {tuple(_REGISTRY)}, got {name!r}")
  return _REGISTRY[name]


for _cls in (Poisson, FixedSize, Shuffle, Full, CyclicPoisson, TruncatedPoisson, UserPoisson,
             BallsInBins):
  register(_cls())
