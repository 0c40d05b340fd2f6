"""Ledger -> dp-accounting events (McMahan et al. 2018, Eq. (1), Section 5, Appendix A). No TensorFlow.

A sample's Gaussian sum queries (Delta_g, sigma~_g) make one Gaussian of noise multiplier
z = (sum_g (Delta_g / sigma~_g)^2)^(-1/2) (Eq. (1)), Delta_g the sensitivity under the
sample's recorded relation (2S replace-one or microbatches, S add/remove). Identical samples
compose with a count; each policy (`policy_accounting`) makes the group's sampling event;
tree rows (Kairouz et al. 2021, Appendix D) use REPLACE_SPECIAL; a selection record makes a
RepeatAndSelectDpEvent (Papernot and Steinke 2022; RDP only).
"""

import dataclasses
import math
from typing import List, Tuple

from tf_dpiter.accounting import accountants
from tf_dpiter.accounting import composite_events
from tf_dpiter.accounting import policy_accounting
from tf_dpiter.accounting.lazy_module import LazyModule
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import records as rec

dpa = LazyModule("dp_accounting")


def dpa_relation(relation):
  """dp-accounting's NeighboringRelation.ADD_OR_REMOVE_ONE or REPLACE_ONE of one of
  `records.RELATIONS`.

  Raises:
    PrivacyConfigError: an unknown relation.
  """
  if relation == rec.ADD_OR_REMOVE:
    return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
  if relation == rec.REPLACE_ONE:
    return dpa.NeighboringRelation.REPLACE_ONE
  raise PrivacyConfigError(f"relation must be one of {rec.RELATIONS}, got {relation!r}")


@dataclasses.dataclass(frozen=True)
class SampleGroup:
  """All samples with the same sampling parameters and the same queries.

  Attributes:
    count: the number of samples in the group.
    policy: their sampling policy.
    population_size: n.
    selection_probability: q.
    sample_size: the recorded batch size (0 for Poisson).
    noise_multiplier: Eq. (1) over the Gaussian queries' sensitivities; inf if none.
    laplace_noise_multipliers: the Laplace queries' scale over sensitivity, one per query.
    non_private: True when a query of the samples adds no noise.
    examples_per_record: k, the examples in one record.
    correlated: "banded" / "tree" / "matrix" for correlated rows, else "".
    tree_depth: nodes one participation touches (tree rows).
    participations: cyclic_poisson: most steps one example can join.
    selected: a sample of the trial a selection record covers.
  """
  count: int
  policy: str
  population_size: float
  selection_probability: float
  sample_size: float
  noise_multiplier: float          # Eq. (1) over the Gaussian queries' sensitivities; inf if none
  laplace_noise_multipliers: Tuple[float, ...]
  non_private: bool
  examples_per_record: int = 1
  correlated: str = ""             # "banded" / "tree" / "matrix" for correlated rows, else ""
  tree_depth: int = 0              # nodes one participation touches (tree rows)
  participations: int = 0          # cyclic_poisson: most steps one example can join
  selected: bool = False           # a sample of the trial a selection record covers

  @property
  def relation(self):
    """The neighbouring relation of the group's policy (`records.relation_for_policy`)."""
    return rec.relation_for_policy(self.policy)

  @property
  def is_selection(self):
    """Whether this is a selection record (count 0; mean, shape and trials in its fields)."""
    return self.policy == rec.REPEAT_AND_SELECT


def effective_noise_multiplier(clips, stddevs):
  """The noise multiplier of one sample's Gaussian queries taken together (McMahan et al. 2018, Eq. (1)).

  z = (sum_g (S_g / sigma~_g)^2)^(-1/2) over the groups g of a sample (per-layer clipping,
  Section 2). Groups with S_g = 0 cost nothing; S_g > 0 with sigma~_g = 0 gives z = 0 (no
  privacy); no costly group gives z = inf.

  Args:
    clips: the sensitivities S_g (clips, or clips times the relation's factor).
    stddevs: the noise standard deviations sigma~_g, same length.

  Returns:
    z, a float in [0, inf].
  """
  inv = 0.0
  for s, sd in zip(clips, stddevs):
    if s == 0:
      continue
    if sd == 0:
      return 0.0
    inv += (s / sd) ** 2
  return math.inf if inv == 0 else inv ** -0.5


def _round_down(z, digits=12):
  """z rounded down to `digits` significant digits: merges samples whose Eq. (1) multiplier
  differs only by float rounding (e.g. adaptive clips), erring on the costly side."""
  if z == 0 or not math.isfinite(z):
    return z
  scale = 10.0 ** (digits - 1 - math.floor(math.log10(z)))
  return math.floor(z * scale) / scale


def _selection_group(run):
  """The count-0 SampleGroup of a selection record run (mean, shape, trials in its fields).
  Its noise multiplier 1 is a finite placeholder, so a reader that does not know selection
  records (e.g. GDP) reaches its policy check and refuses the ledger, not reading it as free.
  """
  return SampleGroup(0, run.policy, run.population_size, 1.0, run.sample_size, 1.0, (),
                     False, examples_per_record=run.examples_per_record)


def groups_from_runs(runs) -> List[SampleGroup]:
  """The SampleGroups, in first-seen order, of runs [(count, sample_row, query_rows)]
  (`records.run_length_encode`), runs with equal content merged (the samples before a
  selection record get `selected=True`; the record is a count-0 group).

  Raises:
    PrivacyConfigError: rows no accounting rule covers (see `_correlated_fields`).
  """
  merged = {}
  participations = {}
  records = rec.to_records(runs)
  selected = any(r.policy == rec.REPEAT_AND_SELECT for r in records)
  marker = []
  for run in records:
    if run.policy == rec.REPEAT_AND_SELECT:
      marker.append(_selection_group(run))
      selected = False
      continue
    gauss = [q for q in run.queries if q.kind == "gaussian"]
    lap = [q for q in run.queries if q.kind == "laplace"]
    extra = _correlated_fields(run)
    if extra[0]:
      gauss = extra[2]
    z = _round_down(effective_noise_multiplier([q.sensitivity for q in gauss], [q.noise for q in gauss]))
    key = (run.policy, run.population_size, run.selection_probability, run.sample_size, z,
           tuple(sorted(q.noise / q.sensitivity for q in lap)),
           any(q.kind == "non_private" for q in run.queries) or z == 0.0,
           run.examples_per_record) + extra[:2] + (selected,)
    merged[key] = merged.get(key, 0) + run.count
    per_run = policies.get(run.policy).participations(run.count, run.sample_size)
    if per_run:
      participations[key] = participations.get(key, 0) + per_run
  return [SampleGroup(c, *k[:-1], participations=participations.get(k, 0), selected=k[-1])
          for k, c in merged.items()] + marker


def _correlated_fields(run):
  """(kind, tree depth, leaf-level QueryRecords) of a run's correlated rows; ("", 0, ()) if none.

  Raises:
    PrivacyConfigError: correlated rows mixed with other queries in one sample, or unequal depths.
  """
  kinds = {q.kind for q in run.queries}
  corr = kinds & {"banded_gaussian", "tree_gaussian", "matrix_gaussian"}
  if not corr:
    return "", 0, ()
  if len(kinds) > 1:
    raise PrivacyConfigError(f"a sample mixes correlated-noise queries with others ({sorted(kinds)}): "
                             "no accounting rule covers it; record them in separate ledgers")
  if corr == {"banded_gaussian"}:
    return "banded", 0, tuple(run.queries)
  if corr == {"matrix_gaussian"}:
    return "matrix", 0, tuple(run.queries)
  factor = rec.sensitivity_factor(run.relation, run.examples_per_record)
  depths = {round((q.sensitivity / (factor * q.clip)) ** 2) for q in run.queries}
  if len(depths) != 1 or min(depths) < 1:
    raise PrivacyConfigError(f"tree rows of one sample must share one depth >= 1, got {sorted(depths)}")
  leaves = tuple(dataclasses.replace(q, sensitivity=factor * q.clip) for q in run.queries)
  return "tree", int(depths.pop()), leaves


def _mechanism(group):
  """The per-sample mechanism (before sampling) of a group."""
  if group.non_private:
    return dpa.NonPrivateDpEvent()
  parts = []
  if math.isfinite(group.noise_multiplier):
    parts.append(dpa.GaussianDpEvent(group.noise_multiplier))
  parts.extend(dpa.LaplaceDpEvent(m) for m in group.laplace_noise_multipliers)
  if not parts:
    return dpa.NoOpDpEvent()
  return parts[0] if len(parts) == 1 else dpa.ComposedDpEvent(parts)


def _unit(group):
  k = group.examples_per_record
  unit = policies.get(group.policy).unit
  if unit == "user":
    return "user (a record is all of one user's examples, up to max_examples_per_user)"
  if unit == "client":
    return "client (a record is one client's model update)"
  return "example" if k <= 1 else f"example (records are microbatches of {k} examples: sensitivity 2C)"


def group_event(group, accountant="rdp", passes=0):
  """(dp_accounting DpEvent of the whole group, list of assumption strings) of one
  SampleGroup (not a selection record), for accountant "rdp" or "pld"; `passes` are the
  shuffled passes / balls-in-bins epochs the ledger recorded (used by policies shuffle and
  balls_in_bins only).

  Raises:
    PrivacyConfigError: a sampling recorded inconsistently (too few passes) or rows no rule
      covers.
  """
  accountant = accountants.event_family(accountant)
  mech = _mechanism(group)
  notes = []
  if isinstance(mech, (dpa.NonPrivateDpEvent, dpa.NoOpDpEvent)):
    return dpa.SelfComposedDpEvent(mech, group.count), notes
  return policy_accounting.get(group.policy).event(group, mech, accountant, passes, notes), notes


def relation_of(groups):
  """The relation, one of `records.RELATIONS`, all private SampleGroups share (selection
  records have none; ADD_OR_REMOVE when no group is private).

  Raises:
    PrivacyConfigError: the groups' relations differ.
  """
  relations = {g.relation for g in groups if not g.non_private and not g.is_selection}
  if len(relations) > 1:
    policies = sorted({g.policy for g in groups if not g.non_private})
    raise PrivacyConfigError(f"ledger mixes policies {policies} whose claims use different neighbouring "
                             "relations (add/remove one vs replace one); dp-accounting cannot compose "
                             "them: account them separately")
  return relations.pop() if relations else rec.ADD_OR_REMOVE


def neighboring_relation(groups):
  """dp-accounting's NeighboringRelation of the SampleGroups (see relation_of).

  Raises:
    PrivacyConfigError: the groups' relations differ.
  """
  return dpa_relation(relation_of(groups))


def _check_units(groups):
  """Refuses private groups of different record units (a user, an example): their rows'
  sensitivities hold for their own unit only (a user's record moves by up to 2S when one of
  its examples goes; an example-level step samples each of a user's examples), so their
  composition is neither unit's guarantee.

  Raises:
    PrivacyConfigError: the groups' units differ.
  """
  units = {policies.get(g.policy).unit for g in groups if not g.non_private
           and not g.is_selection}
  if len(units) > 1:
    mixed = sorted({g.policy for g in groups if not g.non_private and not g.is_selection})
    raise PrivacyConfigError(
        f"ledger mixes policies {mixed} whose records are different units "
        f"({', '.join(sorted(units))}): no guarantee of one unit follows from their rows (the "
        "user-level rows state S per user, the example-level rows S per example); account "
        "each run separately")


def _check_epochs(groups, passes):
  """ValueError when the shuffled passes / balls-in-bins epochs recorded are too few."""
  pooled = [g for g in groups if policies.get(g.policy).pass_charged and not g.non_private]
  per_pass = [policies.get(g.policy).steps_per_pass(g) for g in pooled]
  needed = math.ceil(sum(g.count / p for g, p in zip(pooled, per_pass)))
  if passes > 0 and passes < needed:
    raise PrivacyConfigError(f"ledger holds {sum(g.count for g in pooled)} shuffled / balls-in-bins "
                             f"samples, which need at least {needed} passes (epochs), but records "
                             f"{passes}: the data was not sampled as declared; refusing to account it")


def events_from_groups(groups, accountant="rdp", passes=0):
  """(composed DpEvent, dp-accounting NeighboringRelation, assumption strings stating
  relation, unit and sampling) of SampleGroups (`groups_from_runs`), the events built for
  the registered accountant's family ("rdp" or "pld": `accountants.event_family`); `passes`
  are the shuffled passes / balls-in-bins epochs the ledger recorded.

  Raises:
    ParameterValueError: an empty ledger, mixed relations, too few passes, or rows no rule
      covers.
  """
  accountant = accountants.event_family(accountant)
  if not groups:
    raise PrivacyConfigError("ledger is empty: no samples were recorded, so there is nothing to account")
  if any(g.is_selection for g in groups):
    return composite_events.selection_events(groups, accountant, passes, events_from_groups)
  relation = relation_of(groups)
  _check_units(groups)
  _check_epochs(groups, passes)
  events, notes = [], []
  for g in groups:
    e, n = group_event(g, accountant, passes)
    events.append(e)
    notes += [s for s in dict.fromkeys(n) if s not in notes]
  if any(g.non_private for g in groups):
    notes.append("the ledger holds non-private queries (no noise): no finite guarantee")
  units = sorted({_unit(g) for g in groups if not g.non_private}) or ["example"]
  notes.insert(0, "neighbouring relation: " + ("add or remove one " if relation == rec.ADD_OR_REMOVE
                                              else "replace one ") + "; ".join(units)
               + "; noise multipliers are sigma over the sensitivity under this relation")
  event = events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
  if any(g.correlated == "tree" for g in groups):
    return event, dpa.NeighboringRelation.REPLACE_SPECIAL, notes
  if accountant == "pld" and relation == rec.REPLACE_ONE:
    # The ledger's noise multipliers are sigma over the whole replace-one shift 2S (RDP's
    # convention: its Gaussian is relation-blind); dp-accounting's PLD under REPLACE_ONE reads
    # them as sigma over half the shift (the mean moves by -S and +S), which charged 4S. The
    # events PLD takes under replace one are un-amplified (no fixed-size sampling in PLD), and
    # an un-amplified Gaussian's PLD depends only on the shift: add/remove with the whole shift.
    return event, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, notes
  return event, dpa_relation(relation), notes
