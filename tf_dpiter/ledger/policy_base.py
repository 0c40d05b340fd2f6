"""The base of the sampling policy objects (`tf_dpiter.ledger.policies`) and their helpers.

`SamplingPolicy` states what a claim over a policy's samples assumes (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5
and Appendix A): relation, unit, participation rule, pass length, denominator, log line, the
checks a declared sampling must pass and the dp-accounting event. Pure Python (dp-accounting
loads on first use).
"""

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema


def dpa():
  from tf_dpiter.accounting.lazy_module import LazyModule  # pylint: disable=g-import-not-at-top
  return LazyModule("dp_accounting")


def composite():
  from tf_dpiter.accounting import composite_events  # pylint: disable=g-import-not-at-top
  return composite_events


class SamplingPolicy:
  """Base of the policy objects; subclasses set the class attributes and override `_event`.

  `event` is final: it runs the coverage check (correlated-noise rows the policy's `covers`
  does not list are refused) and then the subclass's `_event` hook, so no policy can return
  an event for rows its accounting does not cover. A subclass that defines `event` is
  refused when the class is created (`__init_subclass__`).

  Attributes:
    name: the policy name (`schema.ALL_POLICIES`).
    relation: `schema.ADD_OR_REMOVE` or `schema.REPLACE_ONE`.
    unit: "example" or "user".
    whole_size: sample_size must be a whole number in [1, n] (b, B, k).
    sized: sample_size must be in [1, n] (the batch of fixed_size / shuffle).
    covers: the correlated-noise row kinds ("banded", "matrix", "tree") its accounting covers.
    pass_charged: its samples are charged per pass / epoch the ledger counts.
    advances_cycle: each of its samples advances the ledger's cycle position (the schedule
      the ledger owns: cyclic Poisson).
    expected_size_denominator: the batch size is random, so the noised sum is divided by its
      public expected size (`expected_records`), never by the realized size (which the noise
      does not protect under add or remove one).
  """
  name = None
  whole_size = False
  sized = False
  covers = ()
  pass_charged = False
  expected_size_denominator = False
  advances_cycle = False

  def __init_subclass__(cls, **kwargs):
    """Refuses a subclass that overrides the final `event` (it would skip the coverage check).

    Args:
      **kwargs: passed on to `object.__init_subclass__`.
    Raises:
      PrivacyConfigError: the subclass defines `event`.
    """
    super().__init_subclass__(**kwargs)
    if "event" in vars(cls):
      raise PrivacyConfigError(
          f"`event` must not be overridden by a sampling policy (it is final: it runs the "
          f"coverage check, then the `_event` hook); override `_event` instead. Received: "
          f"class {cls.__qualname__} defining event")

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

  def expected_records(self, population_size, selection_probability, sample_size):  # pylint: disable=unused-argument
    """The public expected batch size of one sample: q n (cyclic Poisson: q n / b).

    Args:
      population_size: n; selection_probability: q; sample_size: the policy's size field.
    Returns:
      a float (records).
    """
    return float(population_size) * float(selection_probability)

  def pass_lengths(self, population_size, sample_size):
    """The steps a pass / epoch can have (pass-charged policies; else ()): batches of B of n
    make ceil(n / B) steps, floor(n / B) with drop_remainder (one length when B divides n).

    Args:
      population_size: n; sample_size: B (the steps k of an epoch under balls in bins).
    Returns:
      a tuple of ints, shortest first.
    """
    del population_size, sample_size
    return ()

  def describe(self, population_size, selection_probability, sample_size):
    """One line for the start-of-fit log: the sampling, its adjacency and sensitivity.

    Args:
      population_size: n; selection_probability: q; sample_size: the policy's size field.
    Returns:
      a str.
    """
    return (f"policy {self.name!r} (n = {int(population_size)}, q = "
            f"{float(selection_probability):.4g}; {self.relation} adjacency)")

  def passes_needed(self, group):
    """The passes / epochs a group's samples start at least (pass-charged policies:
    ceil(count / steps_per_pass)); 0 for the others.

    Args:
      group: a `ledger_events.SampleGroup` of this policy.
    Returns:
      an int >= 0.
    """
    per = self.steps_per_pass(group)
    return -(-int(group.count) // int(per)) if self.pass_charged and per else 0

  def gdp_mu_squared(self, group):
    """mu^2 of a group under Gaussian DP (Dong, Roth and Su, "Gaussian Differential Privacy",
    Section 5: the CLT of Poisson-subsampled Gaussian steps); only Poisson-type and full-batch
    policies have one.

    Args:
      group: a Gaussian `ledger_events.SampleGroup` of this policy, finite noise multiplier.
    Returns:
      a float.
    Raises:
      ValueError: a policy GDP does not account.
    """
    raise PrivacyConfigError(f"accountant='gdp' accounts Poisson-sampled (or full-batch) steps only, the "
                             f"ledger has policy {group.policy!r} ({group.relation} adjacency): use "
                             "accountant='rdp' or 'pld'")

  def participation_bound(self, group, passes):
    """The most samples of `group` one unit may join under the claim its event makes.

    Every sample is charged (Poisson, fixed size, full, truncated, user level): the group's
    count. Pass-charged policies charge min(passes, count) un-amplified mechanisms (each
    unit at most once per pass / epoch); cyclic Poisson charges `group.participations`.

    Args:
      group: a `ledger_events.SampleGroup` of this policy. passes: the ledger's passes.
    Returns:
      an int >= 0.
    """
    if self.pass_charged and passes > 0:
      return min(int(passes), int(group.count))
    return int(group.count)

  def min_gap(self, group):  # pylint: disable=unused-argument
    """The fewest steps between two samples one unit joins that the claim assumes (1: none)."""
    return 1

  def event(self, group, mech, accountant, passes, notes):
    """The dp-accounting event of a group of this policy's samples (final: see the class).

    Checks first that the group is this policy's, that its correlated-noise rows are ones the
    policy's accounting covers (`covers`) and that its sampling passes `check_sampling` (the
    check a declared sampling passes when it is recorded: a group built by hand, e.g. for
    `report_from_groups`, meets it too), then calls the `_event` hook.

    Args:
      group: a `ledger_events.SampleGroup` of this policy.
      mech: the per-sample dp-accounting mechanism (private).
      accountant: "rdp" or "pld".
      passes: the passes / epochs the ledger recorded (pass-charged policies).
      notes: a list the assumption strings are appended to.
    Returns:
      a dp-accounting DpEvent for the whole group.
    Raises:
      PrivacyConfigError: a group of another policy, correlated-noise rows this policy does
        not cover, a sampling `check_sampling` refuses, or a group its rule refuses (see the
        subclass's `_event`).
    """
    if group.policy != self.name:
      raise PrivacyConfigError(f"`group.policy` must be {self.name!r} for this policy object. "
                               f"Received: group.policy={group.policy!r}")
    if group.correlated and group.correlated not in self.covers:
      raise PrivacyConfigError(
          f"`group.correlated` must be one of the rows policy {group.policy!r} covers "
          f"({', '.join(self.covers) or 'independent noise only'}): no accounting rule for "
          f"{group.correlated!r} rows under it. Received: group.correlated={group.correlated!r}")
    bad = self.check_sampling(group.population_size, group.selection_probability,
                              group.sample_size)
    if bad is not None:
      raise PrivacyConfigError(f"a group of policy {group.policy!r} must have the sampling the "
                               f"policy's claim covers: {bad}")
    return self._event(group, mech, accountant, passes, notes)

  def _event(self, group, mech, accountant, passes, notes):
    """The hook `event` calls after its checks: the default charges every sample, unamplified.

    Args:
      group: a `ledger_events.SampleGroup` of this policy (checked by `event`).
      mech: the per-sample dp-accounting mechanism.
      accountant: "rdp" or "pld".
      passes: the passes / epochs the ledger recorded.
      notes: a list the assumption strings are appended to.
    Returns:
      a dp-accounting DpEvent for the whole group.
    """
    del accountant, passes
    notes.append("every record in every sample: no amplification")
    return dpa().SelfComposedDpEvent(mech, group.count)


def gaussian_only(group):
  if group.laplace_noise_multipliers:
    raise PrivacyConfigError(f"policy {group.policy!r} / {group.correlated or 'gaussian'} rows are "
                             "accounted for Gaussian queries only; this sample has Laplace queries")
