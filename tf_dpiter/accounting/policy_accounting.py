"""The accounting of each sampling policy: its dp-accounting event and its GDP term.

One object per policy builds the event of a group of identical samples (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5,
Appendix A):
  poisson, user_poisson,
  client_poisson        -> PoissonSampledDpEvent(q, .) per sample   add or remove one
  fixed_size,
  client_fixed_size     -> SampledWithoutReplacementDpEvent(n, m, .)  replace one
  shuffle               -> one un-amplified mechanism per pass started (tree rows: one
                           SingleEpochTreeAggregationDpEvent per pass)   replace one
  full                  -> one mechanism per sample                   add or remove one
  cyclic_poisson        -> participations x PoissonSampledDpEvent (Choquette-Choo et al.,
                           "(Amplified) Banded Matrix Factorization", Theorem 4; matrix
                           (BLT) rows: participations x Gaussian, no amplification)
  truncated_poisson     -> TruncatedSubsampledGaussianDpEvent (PLD only)
  balls_in_bins         -> one un-amplified mechanism per epoch started
`event` is final: it checks the group against its ledger policy, then calls the `_event`
hook, so no policy returns an event for rows its accounting does not cover. New policy: a
subclass naming `policy`, then `register`.
"""

import math

from tf_dpiter.accounting import composite_events
from tf_dpiter.accounting.lazy_module import LazyModule
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import schema

dpa = LazyModule("dp_accounting")

_REGISTRY = {}


class PolicyAccounting:
  """Base of the accounting objects (abstract: a subclass names its `policy`). `event` is
  final (module docstring): a subclass that defines it is refused when the class is created.

  Attributes:
    policy: the name of the ledger policy (`tf_dpiter.ledger.policies`) it accounts.
  """
  policy = None

  def __init_subclass__(cls, **kwargs):
    """Refuses a subclass that overrides the final `event` (it would skip the checks).

    Args:
      **kwargs: passed on to `object.__init_subclass__`.

    Raises:
      PrivacyConfigError: the subclass defines `event`.
    """
    super().__init_subclass__(**kwargs)
    if "event" in vars(cls):
      raise PrivacyConfigError(
          f"`event` must not be overridden by a policy's accounting (it is final: it runs the "
          f"coverage check, then the `_event` hook); override `_event` instead. Received: "
          f"class {cls.__qualname__} defining event")

  @property
  def sampling(self):
    """The ledger's policy object of `policy` (code, relation, unit, checks)."""
    return policies.get(self.policy)

  def event(self, group, mech, accountant, passes, notes):
    """The dp-accounting DpEvent of a whole `ledger_events.SampleGroup` of this policy's
    samples, of its private per-sample mechanism `mech`, for accountant "rdp" or "pld", with
    the passes / epochs the ledger recorded; assumption strings are appended to `notes`.
    Checked first: the group is this policy's, `covers` lists its correlated-noise rows and
    its sampling passes `check_sampling`.

    Raises:
      PrivacyConfigError: a group of another policy, correlated-noise rows this policy does
        not cover, a sampling `check_sampling` refuses, or a group its rule refuses (see the
        subclass's `_event`).
    """
    if group.policy != self.policy:
      raise PrivacyConfigError(f"`group.policy` must be {self.policy!r} for this policy object. "
                               f"Received: group.policy={group.policy!r}")
    sampling = self.sampling
    if group.correlated and group.correlated not in sampling.covers:
      raise PrivacyConfigError(
          f"`group.correlated` must be one of the rows policy {group.policy!r} covers "
          f"({', '.join(sampling.covers) or 'independent noise only'}): no accounting rule for "
          f"{group.correlated!r} rows under it. Received: group.correlated={group.correlated!r}")
    bad = sampling.check_sampling(group.population_size, group.selection_probability,
                                  group.sample_size)
    if bad is not None:
      raise PrivacyConfigError(f"a group of policy {group.policy!r} must have the sampling the "
                               f"policy's claim covers: {bad}")
    return self._event(group, mech, accountant, passes, notes)

  def _event(self, group, mech, accountant, passes, notes):
    """The hook `event` calls after its checks (same arguments): the dp-accounting DpEvent of
    the whole group; the default charges every sample, unamplified."""
    del accountant, passes
    notes.append("every record in every sample: no amplification")
    return dpa.SelfComposedDpEvent(mech, group.count)

  def gdp_mu_squared(self, group):
    """mu^2 (a float) of a Gaussian `ledger_events.SampleGroup` of this policy with a finite
    noise multiplier under Gaussian DP (Dong, Roth and Su, "Gaussian Differential Privacy",
    Section 5: the CLT of Poisson-subsampled Gaussian steps); only Poisson-type and full-batch
    policies have one.

    Raises:
      PrivacyConfigError: a policy GDP does not account.
    """
    raise PrivacyConfigError(f"accountant='gdp' accounts Poisson-sampled (or full-batch) steps "
                             f"only, the ledger has policy {group.policy!r} ({group.relation} "
                             "adjacency): use accountant='rdp' or 'pld'")


def _gaussian_only(group):
  """Refuses a group with Laplace queries (its rows' rule is for Gaussian queries only)."""
  if group.laplace_noise_multipliers:
    raise PrivacyConfigError(f"policy {group.policy!r} / {group.correlated or 'gaussian'} rows are "
                             "accounted for Gaussian queries only; this sample has Laplace queries")


# add/remove policies of no sampling probability to state n by: the noised sum is divided by
# the stated size, which a neighbour shares only if n is public
_STATED_SIZE = ("the noised sum is divided by {size} of the stated population n={n:.0f}, "
                "never by the realized batch size: when n is the training data's own size, "
                "the dataset's size is treated as public")


class FullAccounting(PolicyAccounting):
  """Every record in every sample: one mechanism per sample."""
  policy = schema.FULL

  def _event(self, group, mech, accountant, passes, notes):
    notes.append(_STATED_SIZE.format(n=group.population_size, size="n"))
    return super()._event(group, mech, accountant, passes, notes)

  def gdp_mu_squared(self, group):
    return group.count / group.noise_multiplier ** 2


class PoissonAccounting(PolicyAccounting):
  """Poisson sampling: PoissonSampledDpEvent(q, mechanism) per sample."""
  policy = schema.POISSON

  def gdp_mu_squared(self, group):
    q, z = group.selection_probability, group.noise_multiplier
    if q >= 1.0:
      return group.count / z ** 2
    return group.count * q ** 2 * math.expm1(1.0 / z ** 2)

  def _event(self, group, mech, accountant, passes, notes):
    q, n = group.selection_probability, group.population_size
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


class UserPoissonAccounting(PoissonAccounting):
  """Poisson sampling of users: the Poisson rule, the unit being the user."""
  policy = schema.USER_POISSON


class FixedSizeAccounting(PolicyAccounting):
  """Fixed-size samples without replacement: SampledWithoutReplacementDpEvent per sample."""
  policy = schema.FIXED_SIZE

  def _event(self, group, mech, accountant, passes, notes):
    n, m = group.population_size, group.sample_size
    if m >= n:
      return super()._event(group, mech, accountant, passes, notes)
    if group.laplace_noise_multipliers:
      notes.append("fixed-size samples with Laplace queries: no amplification claimed")
      return dpa.SelfComposedDpEvent(mech, group.count)
    notes.append(f"fixed-size sampling without replacement ({m:.0f} of {n:.0f}), samples "
                 "independent across steps")
    return dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(int(n), int(m), mech), group.count)


class ClientPoissonAccounting(PoissonAccounting):
  """Poisson sampling of clients: the Poisson rule, the unit being the client."""
  policy = schema.CLIENT_POISSON


class ClientFixedSizeAccounting(FixedSizeAccounting):
  """Fixed-size samples of clients: the fixed-size rule, the unit being the client."""
  policy = schema.CLIENT_FIXED_SIZE


class ShuffleAccounting(PolicyAccounting):
  """Shuffled passes: one un-amplified mechanism per pass (tree rows: one tree per pass)."""
  policy = schema.SHUFFLE

  def _event(self, group, mech, accountant, passes, notes):
    if group.correlated != "tree":
      return composite_events.shuffle_event(group, mech, passes, notes)
    _gaussian_only(group)
    if passes <= 0:
      raise ParameterValueError("tree aggregation rows with no shuffled pass recorded: one example may "
                                "join a tree several times, which SingleEpochTreeAggregationDpEvent does "
                                "not cover; refusing to account it")
    tree = dpa.SingleEpochTreeAggregationDpEvent(group.noise_multiplier,
                                                 2 ** group.tree_depth - 1)
    notes.append(f"tree aggregation (DP-FTRL, depth {group.tree_depth}): each example at most "
                 "once per shuffled pass and every tree restarted at a pass boundary (the query's "
                 "restart period divides the steps per pass): one SingleEpochTreeAggregation"
                 "DpEvent per pass, accounted under REPLACE_SPECIAL with the recorded "
                 "per-leaf sensitivity (the Gaussian bound depends only on it)")
    return composite_events.shuffle_event(group, tree, passes, notes)


class CyclicPoissonAccounting(PolicyAccounting):
  """Cyclic Poisson: each example's participations, Poisson-sampled (BLT: unamplified)."""
  policy = schema.CYCLIC_POISSON

  def _event(self, group, mech, accountant, passes, notes):
    _gaussian_only(group)
    q, m, n = group.selection_probability, group.sample_size, group.population_size
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


class TruncatedPoissonAccounting(PolicyAccounting):
  """Truncated Poisson: TruncatedSubsampledGaussianDpEvent per sample (PLD only)."""
  policy = schema.TRUNCATED_POISSON

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
    return dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(
        int(n), q, int(m), group.noise_multiplier), group.count)


class BallsInBinsAccounting(PolicyAccounting):
  """Balls in bins: one un-amplified step mechanism per epoch started."""
  policy = schema.BALLS_IN_BINS

  def _event(self, group, mech, accountant, passes, notes):
    notes.append(_STATED_SIZE.format(n=group.population_size, size="n / k"))
    return composite_events.balls_in_bins_event(group, mech, passes, notes)


def register(accounting):
  """Registers and returns a PolicyAccounting instance whose `policy` is registered in
  `tf_dpiter.ledger.policies` and has no accounting object yet.

  Raises:
    PrivacyConfigError: not a PolicyAccounting, an unknown policy, or one already registered.
  """
  if not isinstance(accounting, PolicyAccounting):
    raise PrivacyConfigError(f"`accounting` must be a PolicyAccounting instance. Received: "
                             f"accounting={accounting!r}")
  policies.get(accounting.policy)
  if accounting.policy in _REGISTRY:
    raise PrivacyConfigError(f"`accounting.policy` must be a policy without an accounting object "
                             f"yet; `unregister` the old one first. Received: "
                             f"accounting.policy={accounting.policy!r}")
  _REGISTRY[accounting.policy] = accounting
  return accounting


def unregister(policy):
  """Removes and returns the accounting object of a policy name (e.g. one a test registered).

  Raises:
    PrivacyConfigError: a policy without one.
  """
  get(policy)
  return _REGISTRY.pop(policy)


def get(policy):
  """The PolicyAccounting of a registered policy name.

  Raises:
    PrivacyConfigError: a policy with no accounting object (or an unknown one).
  """
  if policy not in _REGISTRY:
    raise PrivacyConfigError(f"`policy` must be one with an accounting rule {tuple(_REGISTRY)}; "
                             f"register a PolicyAccounting for it. Received: policy={policy!r}")
  return _REGISTRY[policy]


for _cls in (PoissonAccounting, FixedSizeAccounting, ShuffleAccounting, FullAccounting,
             CyclicPoissonAccounting, TruncatedPoissonAccounting, UserPoissonAccounting,
             BallsInBinsAccounting, ClientPoissonAccounting, ClientFixedSizeAccounting):
  register(_cls())
