"""The base of the sampling policy objects (`tf_dpiter.ledger.policies`).

`SamplingPolicy` states what a claim over a policy's samples assumes (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Section 5
and Appendix A): its stable code, the neighbouring relation, the unit, the participation rule,
the pass length, the denominator, the log line, the public row bound of a step's batch
(`public_row_bound`) and the checks of a declared sampling, on one sampling (`check_sampling`)
and on a ledger's arrays (`sampling_checks`). The dp-accounting event is built on the
accounting side (`accounting.policy_accounting`). `default_max_batch_size` is the padded size
of a Poisson sample (data.sampling pads to it). Pure Python and numpy.
"""

import math

import numpy as np

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema

# The probability, per step, the public row bound R leaves to a Poisson-type batch of the
# declared n and q being larger than R (and so refused): `SamplingPolicy.public_row_bound`.
P_REFUSE = 1e-18


def default_max_batch_size(population_size, selection_probability, num_sd=4.0, multiple=8):
  """Static padded size: E[|R|] + num_sd * sd(|R|), |R| ~ Binomial(n, q), rounded up to `multiple`.

  A sample larger than this (probability about 3e-5 per step for num_sd=4) is padded to the
  next multiple of it instead: records are never dropped, only XLA retraces once.

  Args:
    population_size: n.
    selection_probability: q.
    num_sd: the standard deviations of |R| above its mean the size covers.
    multiple: the size is rounded up to a multiple of this.

  Returns:
    the padded batch size, an int.
  """
  mean = population_size * selection_probability
  sd = math.sqrt(population_size * selection_probability * (1.0 - selection_probability))
  size = int(math.ceil(mean + num_sd * sd))
  size = max(1, int(math.ceil(size / multiple) * multiple))
  return min(size, int(math.ceil(population_size / multiple) * multiple))


def _binomial_kl(a, q):
  """KL(a || q) in nats of Bernoulli(a) from Bernoulli(q), a in (q, 1], q in (0, 1), float64:
  a log(a / q) + (1 - a) log((1 - a) / (1 - q)), the (1 - a) term 0 at a = 1."""
  head = a * (math.log(a) - math.log(q))
  tail = 0.0 if a >= 1.0 else (1.0 - a) * (math.log1p(-a) - math.log1p(-q))
  return head + tail


def binomial_tail_bound(trials, selection_probability, rows):
  """A Chernoff upper bound of P[X > rows], X ~ Binomial(trials, q) (a float in [0, 1]).

  P[X >= r] <= exp(-N KL(r / N || q)) for r / N > q (the relative-entropy form of the Chernoff
  bound: Hoeffding, "Probability inequalities for sums of bounded random variables", JASA
  1963, Theorem 1; Arratia and Gordon, "Tutorial on large deviations for the binomial
  distribution", Bull. Math. Biol. 1989, Theorem 1), taken at r = rows + 1; 0 past N trials;
  1 when rows + 1 <= N q (no bound). Computed in float64 from public values only.

  Args:
    trials: N, the number of independent records (an int >= 1).
    selection_probability: q in [0, 1].
    rows: the bound on X (an int >= 0).

  Returns:
    a float upper bound of P[X > rows].
  """
  n, q, r = float(trials), float(selection_probability), float(rows) + 1.0
  if r > n or q <= 0.0:
    return 0.0
  if q >= 1.0 or r <= n * q:
    return 1.0
  return math.exp(-n * _binomial_kl(r / n, q))


def tail_row_bound(population_size, selection_probability, p_refuse=P_REFUSE, multiple=8):
  """The smallest multiple r of `multiple` with `binomial_tail_bound(n + 1, q, r) <= p_refuse`:
  a bound on the rows of a Poisson sample of n + 1 records (add/remove's larger neighbour)
  that a sample passes with probability at most p_refuse (an int >= multiple).

  Args:
    population_size: n.
    selection_probability: q.
    p_refuse: the probability allowed above r.
    multiple: r is a multiple of this.

  Returns:
    r, an int.
  """
  trials = int(math.ceil(float(population_size))) + 1
  lo, hi = 1, -(-trials // multiple)   # hi * multiple >= trials: the tail is 0 there
  while lo < hi:
    mid = (lo + hi) // 2
    if binomial_tail_bound(trials, selection_probability, mid * multiple) <= p_refuse:
      hi = mid
    else:
      lo = mid + 1
  return lo * multiple


class SamplingPolicy:
  """Base of the policy objects (abstract: a subclass sets `name`, `code` and `relation`).

  Attributes:
    name: the policy name, as the ledger's files and the `policy` arguments spell it.
    code: the policy's number in the ledger's sample rows (column "policy"): stable, never
      reused or renumbered, since checkpoints store it (a new policy takes a new number).
    relation: `schema.ADD_OR_REMOVE` or `schema.REPLACE_ONE`, the neighbouring relation of
      the claim.
    unit: the unit of privacy one record stands for, "example", "user" or "client".
    whole_size: sample_size must be a whole number in [1, n] (b, B, k).
    sized: sample_size must be in [1, n] (the batch of fixed_size / shuffle).
    covers: the correlated-noise row kinds ("banded", "matrix", "tree") its accounting covers;
      the ledger refuses such rows under any other policy.
    pass_charged: its samples are charged per pass / epoch the ledger counts.
    advances_cycle: each of its samples advances the ledger's cycle position (the schedule
      the ledger owns: cyclic Poisson).
    expected_size_denominator: the noised sum is divided by the public expected size
      (`expected_records`), never by the realized size, which the noise does not protect
      under add or remove one (every add/remove policy).
  """
  name = None
  code = None
  relation = None
  unit = "example"
  whole_size = False
  sized = False
  covers = ()
  pass_charged = False
  expected_size_denominator = False
  advances_cycle = False

  def sampling_checks(self, population_size, selection_probability, sample_size):
    """The rules a declared sampling of this policy must meet, one row per element of the
    float arrays n (records), q and the size field, all of one shape: a list of (bad, field,
    rule), bad a bool array (True where the rule fails), field the name of the field the rule
    is about, rule the requirement (a str with `{n}`, `{q}` and `{m}` placeholders for the
    failing row's values).

    The one statement of the policy's sampling rules: `check_sampling` runs it on one
    sampling, `records.validate_arrays` on every row of a ledger of this policy.
    """
    n, m = np.asarray(population_size, np.float64), np.asarray(sample_size, np.float64)
    checks = []
    if self.sized or self.whole_size:
      checks.append((~((m >= 1) & (m <= n)), "sample_size", "must be in [1, population_size={n:g}]"))
    if self.whole_size:
      checks.append((m != np.floor(m), "sample_size",
                     "(the cycle length b, the cap B or the steps per epoch k) must be a whole "
                     "number"))
    return checks

  def check_sampling(self, population_size, selection_probability, sample_size):
    """None, or the error message (str) naming the bad field and its value, of a declared
    sampling (n records, q, the size field) the policy's claim cannot cover
    (`sampling_checks`)."""
    n, q, m = (np.asarray([float(v)]) for v in (population_size, selection_probability,
                                                  sample_size))
    for bad, field, rule in self.sampling_checks(n, q, m):
      if bad[0]:
        return self.sampling_message(field, rule, population_size, selection_probability,
                                     sample_size)
    return None

  def sampling_message(self, field, rule, population_size, selection_probability, sample_size):
    """The message "`field` must be ... for policy 'name' ... Received: field=value" of a failed
    sampling rule (see `sampling_checks`; field "sample_size" or "selection_probability",
    rule with `{n}`, `{q}`, `{m}` placeholders) at one row (n, q, size field)."""
    values = {"population_size": population_size, "selection_probability": selection_probability,
              "sample_size": sample_size}
    text = rule.format(n=float(population_size), q=float(selection_probability),
                       m=float(sample_size))
    return (f"`{field}` {text} for policy {self.name!r} (n = {float(population_size):g}, q = "
            f"{float(selection_probability):g}, sample_size = {float(sample_size):g}): declare "
            f"the sampling the data pipeline runs. Received: {field}={values[field]!r}")

  def participations(self, run_count, sample_size):  # pylint: disable=unused-argument
    """The most samples (an int >= 0) of a run of `run_count` consecutive samples one unit can
    join, when the policy bounds it below run_count (cyclic Poisson, from the size field);
    0: not used by its event."""
    return 0

  def steps_per_pass(self, group):  # pylint: disable=unused-argument
    """The steps (an int) of one pass / epoch of a `SampleGroup` of this policy the ledger
    counts (pass-charged policies), else None."""
    return None

  def public_row_bound(self, population_size, selection_probability):
    """R (an int >= 1), a public bound on the rows of a step's batch (all replicas) of the
    declared n and q under an add/remove relation; None under replace-one (every batch has
    the same rows on both neighbours).

    R = max(2 `default_max_batch_size`(n, q), r), r the smallest multiple of 8 with
    exp(-(n + 1) KL((r + 1) / (n + 1) || q)) <= P_REFUSE = 1e-18 (`tail_row_bound`, Hoeffding
    1963, Theorem 1). The first term covers a sample padded to twice the padded size; the
    second makes a refused batch (a data-dependent event: the batch size is private)
    negligibly likely: at most 1e-18 per step for a Poisson sample of n or n + 1 records, it
    is not charged and adds at most T 1e-18 (1 + e^eps) to delta over T steps. Under P
    replicas each replica's rows are checked against `replica_row_bound` instead.

    Under add/remove, neighbouring batches differ in rows unless padded to a size fixed in
    advance, so the float32 sum's clip shrink (Casacuberta et al., CCS 2022, Secs. 3-5) is
    taken from the plan of R rows (dp_query.summation.public_plan), the same on both. A
    function of public declared values only, never stored (a restored ledger forms it again).

    Args:
      population_size: n, the declared population (records, or users under user_poisson).
      selection_probability: q.

    Returns:
      R, an int (a multiple of 8), or None under replace-one.
    """
    if self.relation != schema.ADD_OR_REMOVE:
      return None
    n = max(float(population_size), 1.0)
    q = min(max(float(selection_probability), 0.0), 1.0)
    return max(2 * default_max_batch_size(n, q), tail_row_bound(n, q))

  def replica_row_bound(self, population_size, selection_probability, replicas):
    """R_P (an int >= 1), the public bound on the rows of ONE replica's batch under P replicas
    (add/remove; None under replace-one): a replica's batch past R_P is refused.

    R_P = max(ceil(R / P), tail_row_bound(ceil(n / P), q)), R = `public_row_bound`(n, q).
    The first term is the share of a global sample of at most R rows split evenly among the
    replicas (Keras splits one batch); the second covers a sampler that samples each
    replica's own part of at most ceil(n / P) records (data.distributed_poisson_batches,
    parts by indexed_sampling.part_range): a Chernoff bound (Hoeffding 1963, Theorem 1) of
    P[Binomial(ceil(n / P) + 1, q) > R_P] <= P_REFUSE = 1e-18 per replica and step, n / P + 1
    records for add/remove's larger neighbour (ceil(R / P) alone is passed with probability
    2.4e-4 per replica and step at n = 1e7, E = 16, P = 8). Over P replicas and T steps the
    uncharged refusal adds at most P T 1e-18 (1 + e^eps) to delta.

    Design: the clip shrink's plan (dp_query.summation.public_plan, keras.optimizer.chunking.
    public_rows) is a replica's plan, taken from R_P rows on each replica, so it bounds every
    batch that is not refused; the rows the step allows in all are P R_P >= R, so R itself
    (the global bound) is left as it is and only the per-replica check and plan use R_P. With
    P = 1, R_P = R (R >= tail_row_bound(n, q)).

    Args:
      population_size: n, the declared population.
      selection_probability: q.
      replicas: P >= 1, the replicas in sync.

    Returns:
      R_P, an int, or None under replace-one.
    """
    rows = self.public_row_bound(population_size, selection_probability)
    if rows is None:
      return None
    replicas = max(int(replicas), 1)
    if replicas == 1:
      return rows
    n = max(float(population_size), 1.0)
    q = min(max(float(selection_probability), 0.0), 1.0)
    return max(1, -(-rows // replicas), tail_row_bound(math.ceil(n / replicas), q))

  def expected_records(self, population_size, selection_probability, sample_size):  # pylint: disable=unused-argument
    """The public expected batch size of one sample, a float in records: q n (cyclic Poisson:
    q n / b)."""
    return float(population_size) * float(selection_probability)

  def describe(self, population_size, selection_probability, sample_size):
    """One line (str) for the start-of-fit log of a sampling (n, q, size field): the sampling,
    its adjacency and sensitivity."""
    del sample_size
    return (f"policy {self.name!r} (n = {int(population_size)}, q = "
            f"{float(selection_probability):.4g}; {self.relation} adjacency)")

  def passes_needed(self, group):
    """The passes / epochs (an int >= 0) a `SampleGroup`'s samples start at least
    (pass-charged policies: ceil(count / steps_per_pass)); 0 for the others."""
    per = self.steps_per_pass(group)
    return -(-int(group.count) // int(per)) if self.pass_charged and per else 0

  def participation_bound(self, group, passes):
    """The most samples (an int >= 0) of a `SampleGroup` one unit may join under the claim its
    event makes, given the ledger's passes. Every sample is charged (Poisson, fixed size, full,
    truncated, user level): the group's count. Pass-charged policies charge min(passes, count)
    un-amplified mechanisms (each unit at most once per pass / epoch); cyclic Poisson charges
    `group.participations`."""
    if self.pass_charged and passes > 0:
      return min(int(passes), int(group.count))
    return int(group.count)

  def min_gap(self, group):  # pylint: disable=unused-argument
    """The fewest steps (an int >= 1; 1: none) between two samples of a `SampleGroup` one unit
    joins that the claim assumes."""
    return 1


def check_policy(policy):
  """Checks a SamplingPolicy instance's stated fields before it is registered.

  Raises:
    PrivacyConfigError: not a SamplingPolicy, or a name, code, relation, unit or covers the
      ledger cannot store or account.
  """
  if not isinstance(policy, SamplingPolicy):
    raise PrivacyConfigError(f"`policy` must be a SamplingPolicy instance. Received: "
                             f"policy={policy!r}")
  if not isinstance(policy.name, str) or not policy.name or policy.name == schema.REPEAT_AND_SELECT:
    raise PrivacyConfigError(f"`name` must be a non-empty str other than "
                             f"{schema.REPEAT_AND_SELECT!r} (the selection marker). Received: "
                             f"name={policy.name!r}")
  code = policy.code
  if isinstance(code, bool) or not isinstance(code, int) or code < 0 or code > schema.MAX_POLICY_CODE:
    raise PrivacyConfigError(f"`code` of policy {policy.name!r} must be an int in [0, "
                             f"{schema.MAX_POLICY_CODE}] (exactly representable in the ledger's "
                             f"float rows). Received: code={code!r}")
  if code == schema.REPEAT_AND_SELECT_CODE:
    raise PrivacyConfigError(f"`code` of policy {policy.name!r} must not be "
                             f"{schema.REPEAT_AND_SELECT_CODE}, the selection marker's; take an "
                             f"unused number. Received: code={code!r}")
  if policy.relation not in schema.RELATIONS:
    raise PrivacyConfigError(f"`relation` of policy {policy.name!r} must be one of "
                             f"{schema.RELATIONS}. Received: relation={policy.relation!r}")
  if policy.unit not in schema.UNITS:
    raise PrivacyConfigError(f"`unit` of policy {policy.name!r} must be one of {schema.UNITS}. "
                             f"Received: unit={policy.unit!r}")
  unknown = set(policy.covers) - set(schema.CORRELATED_KIND_OF_ROWS)
  if unknown:
    raise PrivacyConfigError(f"`covers` of policy {policy.name!r} must hold only "
                             f"{tuple(schema.CORRELATED_KIND_OF_ROWS)}. Received: "
                             f"covers={tuple(policy.covers)!r}")
