"""Each sampling policy as one object: relation, unit, participation rule, event, checks.

A policy object states what a claim over its samples assumes (McMahan et al., "A General
Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5 and
Appendix A): the neighbouring relation and the unit of privacy, how often and how far apart
one unit can take part (`participations`, `steps_per_pass`), the checks a declared sampling
must pass (`check_sampling`), and the dp-accounting event of a group of its samples (`event`).
Adding a policy is one subclass here plus `register` (and its name and code in `schema`).
`tf_dpiter.accounting.ledger_events` and `QueryWithLedger` dispatch on `get(name)`; no
if-chain over policy names is left there. Pure Python (dp-accounting loads on first use).
"""

import math

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema

_REGISTRY = {}


def _dpa():
  from tf_dpiter.accounting.lazy_module import LazyModule  # pylint: disable=g-import-not-at-top
  return LazyModule("dp_accounting")


def _composite():
  from tf_dpiter.accounting import composite_events  # pylint: disable=g-import-not-at-top
  return composite_events


class SamplingPolicy:
  """Base of the policy objects; subclasses set the class attributes and override `_event`.

  Attributes:
    name: the policy name (`schema.ALL_POLICIES`).
    relation: `schema.ADD_OR_REMOVE` or `schema.REPLACE_ONE`.
    unit: "example" or "user".
    whole_size: sample_size must be a whole number in [1, n] (b, B, k).
    sized: sample_size must be in [1, n] (the batch of fixed_size / shuffle).
    covers: the correlated-noise row kinds ("banded", "matrix", "tree") its accounting covers.
    pass_charged: its samples are charged per pass / epoch the ledger counts.
  """
  name = None
  whole_size = False
  sized = False
  covers = ()
  pass_charged = False

  @property
  def relation(self):
    """The neighbouring relation of the claim (the schema's table: one source)."""
    return schema.RELATION_OF_POLICY[self.name]

  @property
  def unit(self):
    """The unit of privacy one record stands for ("example" or "user")."""
    return schema.UNIT_OF_POLICY[self.name]

  def check_sampling(self, population_size, selection_probability, sample_size):
    """Refuses a declared sampling the policy's claim cannot cover.

    Args:
      population_size: n; selection_probability: q; sample_size: the policy's size field.
    Returns:
      None, or an error message (str) naming the bad field.
    """
    n, m = float(population_size), float(sample_size)
    if (self.sized or self.whole_size) and not 1 <= m <= n:
      return (f"sample_size must be in [1, population_size={population_size}] for policy "
              f"{self.name!r}, got {sample_size!r}")
    if self.whole_size and m != int(m):
      return (f"sample_size (the cycle length b, the cap B or the steps per epoch k) must be a "
              f"whole number for policy {self.name!r}, got {sample_size!r}")
    return None

  def participations(self, run_count, sample_size):  # pylint: disable=unused-argument
    """The most samples of a run of `run_count` consecutive samples one unit can join, when
    the policy bounds it below run_count (cyclic Poisson); 0: not used by its event."""
    return 0

  def steps_per_pass(self, group):  # pylint: disable=unused-argument
    """Steps of one pass / epoch the ledger counts (pass-charged policies), else None."""
    return None

  def event(self, group, mech, accountant, passes, notes):
    """The dp-accounting event of a group of this policy's samples (mech: the per-sample
    mechanism, private); assumption strings are appended to `notes`.

    Raises:
      ValueError: correlated-noise rows this policy does not cover, or a group its rule
        refuses (see the subclass).
    """
    if group.correlated and group.correlated not in self.covers:
      raise PrivacyConfigError(f"no accounting rule for {group.correlated!r} rows under policy "
                               f"{group.policy!r}")
    return self._event(group, mech, accountant, passes, notes)

  def _event(self, group, mech, accountant, passes, notes):
    notes.append("every record in every sample: no amplification")
    return _dpa().SelfComposedDpEvent(mech, group.count)


class Full(SamplingPolicy):
  """Every record in every sample; add or remove one example."""
  name = schema.FULL


class Poisson(SamplingPolicy):
  """Each record joins each sample independently with probability q; add or remove one."""
  name = schema.POISSON

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
                   "secret")
      return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, mech), group.count)
    notes.append("Poisson-sampled samples with Laplace queries: no amplification by sampling "
                 "claimed (the accountant does not support it for this mechanism)")
    return dpa.SelfComposedDpEvent(mech, group.count)


class UserPoisson(Poisson):
  """Poisson sampling of users; the unit is the user (add or remove one user)."""
  name = schema.USER_POISSON


class FixedSize(SamplingPolicy):
  """Independent samples of m records without replacement; replace one example."""
  name = schema.FIXED_SIZE
  sized = True

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

  def participations(self, run_count, sample_size):
    # c consecutive positions of the ledger's cyclic stream hold ceil(c / b) turns of a group
    return math.ceil(run_count / sample_size)

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

  def event(self, group, mech, accountant, passes, notes):
    return _composite().balls_in_bins_event(group, mech, passes, notes)


def _gaussian_only(group):
  if group.laplace_noise_multipliers:
    raise PrivacyConfigError(f"policy {group.policy!r} / {group.correlated or 'gaussian'} rows are "
                             "accounted for Gaussian queries only; this sample has Laplace queries")


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
