"""Each sampling policy as one object: code, relation, unit, participation rule, checks
(what a claim over its samples assumes: `policy_base.SamplingPolicy`; McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5
and Appendix A).

Adding a policy: a subclass with an unused `code`, `register`ed, and its accounting object
registered with `tf_dpiter.accounting.policy_accounting.register`. The codes are the ledger's
stored numbers and never change (`tests/ledger/test_policy_codes.py` pins them). Pure Python
and numpy.
"""

import math

import numpy as np

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema
from tf_dpiter.ledger.policy_base import SamplingPolicy
from tf_dpiter.ledger.policy_base import check_policy

_REGISTRY = {}


def cyclic_codes():
  """The codes (a tuple of floats) of the registered policies whose samples advance the
  ledger's cycle position, read from the registry at call time ((-1.0,) when none); read
  eagerly only (a trace would keep the registry of its time)."""
  return tuple(float(p.code) for p in _REGISTRY.values() if p.advances_cycle) or (-1.0,)


class Poisson(SamplingPolicy):
  """Each record joins each sample independently with probability q; add or remove one."""
  name = schema.POISSON
  code = 0
  relation = schema.ADD_OR_REMOVE
  expected_size_denominator = True

  def describe(self, population_size, selection_probability, sample_size):
    return (f"Poisson sampling (q = {float(selection_probability):.4g} = {float(sample_size):g}"
            f" / {int(population_size)}: the stated expected batch over the stated population, "
            "fixed before sampling; add/remove-one adjacency, sensitivity S)")


class FixedSize(SamplingPolicy):
  """Independent samples of m records without replacement; replace one example."""
  name = schema.FIXED_SIZE
  code = 1
  relation = schema.REPLACE_ONE
  sized = True

  def describe(self, population_size, selection_probability, sample_size):
    return (f"fixed-size samples ({float(sample_size):g} of n = {int(population_size)} without "
            "replacement, independent across steps; replace-one adjacency, sensitivity 2S)")


class Shuffle(SamplingPolicy):
  """Passes over a fresh permutation, disjoint batches; replace one; charged per pass."""
  name = schema.SHUFFLE
  code = 2
  relation = schema.REPLACE_ONE
  sized = True
  covers = ("tree",)
  pass_charged = True

  def steps_per_pass(self, group):
    return math.ceil(group.population_size / group.sample_size)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"shuffled passes (batches of {float(sample_size):g} of n = {int(population_size)}; "
            "replace-one adjacency, sensitivity 2S, no amplification: each pass started costs "
            "one mechanism)")


class Full(SamplingPolicy):
  """Every record in every sample; add or remove one example."""
  name = schema.FULL
  code = 3
  relation = schema.ADD_OR_REMOVE
  expected_size_denominator = True   # the stated n: the realized one differs between neighbours

  def describe(self, population_size, selection_probability, sample_size):
    return (f"full batches (all n = {int(population_size)} records every step; add/remove-one "
            "adjacency, sensitivity S, no amplification)")


class CyclicPoisson(SamplingPolicy):
  """b groups fixed by each example's identity; step p Poisson-samples group p mod b."""
  name = schema.CYCLIC_POISSON
  code = 4
  relation = schema.ADD_OR_REMOVE
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


class TruncatedPoisson(SamplingPolicy):
  """Poisson(q), then a uniform subset of at most B; add or remove one (PLD only)."""
  name = schema.TRUNCATED_POISSON
  code = 5
  relation = schema.ADD_OR_REMOVE
  whole_size = True
  expected_size_denominator = True   # q n, the mean before the cap (a public constant)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"truncated Poisson sampling (q = {float(selection_probability):.4g}, n = "
            f"{int(population_size)}, at most {int(sample_size)} records; add/remove-one "
            "adjacency, charged at sensitivity 2S when the cap binds)")


class UserPoisson(Poisson):
  """Poisson sampling of users; the unit is the user (add or remove one user)."""
  name = schema.USER_POISSON
  code = 6
  unit = "user"

  def describe(self, population_size, selection_probability, sample_size):
    return (f"Poisson sampling of users (q = {float(selection_probability):.4g}, expected "
            f"{float(sample_size):g} users of n = {int(population_size)}; add/remove-one-user "
            "adjacency, sensitivity S per user)")


class BallsInBins(SamplingPolicy):
  """Every example in one uniform step of each epoch of k; add or remove one; per epoch."""
  name = schema.BALLS_IN_BINS
  code = 7
  relation = schema.ADD_OR_REMOVE
  whole_size = True
  pass_charged = True
  expected_size_denominator = True   # n / k: a step's realized size differs between neighbours

  def sampling_checks(self, population_size, selection_probability, sample_size):
    q, m = (np.asarray(v, np.float64) for v in (selection_probability, sample_size))
    return super().sampling_checks(population_size, selection_probability, sample_size) + [
        (np.abs(q * m - 1.0) > 1e-9, "selection_probability",
         "must be 1 / sample_size (1 / k = 1 / {m:g})")]

  def steps_per_pass(self, group):
    return int(group.sample_size)

  def describe(self, population_size, selection_probability, sample_size):
    return (f"balls in bins (every example in one uniform step of each epoch of "
            f"{int(sample_size)} steps, n = {int(population_size)}; add/remove-one adjacency, "
            "sensitivity S, each epoch started costs one mechanism)")


class ClientPoisson(Poisson):
  """Poisson sampling of clients (federated averaging, Geyer et al., "Differentially Private
  Federated Learning: A Client Level Perspective", Section 2): a record is one client's model
  update; add or remove one client."""
  name = schema.CLIENT_POISSON
  code = 9
  unit = "client"

  def describe(self, population_size, selection_probability, sample_size):
    return (f"Poisson sampling of clients (q = {float(selection_probability):.4g} of K = "
            f"{int(population_size)} clients; add/remove-one-client adjacency, sensitivity S "
            "per client update)")


class ClientFixedSize(FixedSize):
  """m of K clients without replacement each round (federated averaging, Geyer et al.,
  Section 2): a record is one client's model update; replace one client."""
  name = schema.CLIENT_FIXED_SIZE
  code = 10
  unit = "client"

  def describe(self, population_size, selection_probability, sample_size):
    return (f"fixed-size samples of clients ({float(sample_size):g} of K = "
            f"{int(population_size)} without replacement, independent across rounds; "
            "replace-one-client adjacency, sensitivity 2S)")


def register(policy):
  """Registers and returns a SamplingPolicy instance under its name and its code, which no
  other registered policy may have (`policy_base.check_policy` states the rest).

  Raises:
    PrivacyConfigError: a field `check_policy` refuses, or a name or code already taken.
  """
  check_policy(policy)
  if policy.name in _REGISTRY:
    raise PrivacyConfigError(f"`name` must be a policy name not registered yet ({names()}); "
                             f"`unregister` the old one first. Received: name={policy.name!r}")
  taken = {p.code: p.name for p in _REGISTRY.values()}
  if policy.code in taken:
    raise PrivacyConfigError(f"`code` of policy {policy.name!r} must be unused: {policy.code} is "
                             f"policy {taken[policy.code]!r}'s (codes are stored in checkpoints "
                             f"and never reused). Received: code={policy.code!r}")
  _REGISTRY[policy.name] = policy
  return policy


def unregister(name):
  """Removes and returns a registered policy (e.g. one a test registered).

  Raises:
    PrivacyConfigError: a name not registered.
  """
  get(name)
  return _REGISTRY.pop(name)


def names():
  """The registered sampling policy names, in registration order (a tuple of str)."""
  return tuple(_REGISTRY)


def get(name):
  """The registered SamplingPolicy of a policy name.

  Raises:
    PrivacyConfigError: an unknown name, or the selection marker (it samples nothing).
  """
  if name not in _REGISTRY:
    raise PrivacyConfigError(f"policy must be one of {tuple(_REGISTRY)}, got {name!r}")
  return _REGISTRY[name]


def by_code(code):
  """The registered SamplingPolicy whose code (int or float) is `code` (a sample row's policy
  column); None when no policy has that code (the selection marker's code, or an unknown
  one)."""
  for policy in _REGISTRY.values():
    if policy.code == code:
      return policy
  return None


for _cls in (Poisson, FixedSize, Shuffle, Full, CyclicPoisson, TruncatedPoisson, UserPoisson,
             BallsInBins, ClientPoisson, ClientFixedSize):
  register(_cls())
