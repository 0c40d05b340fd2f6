"""Ledger -> dp-accounting events (seed 002, Eq. (1), Section 5, Appendix A). No TensorFlow.

A sample with Gaussian sum queries (Delta_g, sigma~_g) becomes one Gaussian mechanism of noise
multiplier z = (sum_g (Delta_g / sigma~_g)^2)^(-1/2) (Eq. (1)), where Delta_g is the query's
sensitivity *under the sample's neighbouring relation* as the ledger recorded it (2S for
replace-one or microbatches, S for add/remove of a whole record): dp-accounting's noise
multiplier is sigma over that sensitivity. It is placed in the sampling event of the policy:
  poisson    -> PoissonSampledDpEvent(q, .)                 add or remove one
  fixed_size -> SampledWithoutReplacementDpEvent(n, m, .)   replace one
  shuffle    -> one un-amplified mechanism per pass started  replace one
  full       -> one mechanism per sample                    add or remove one
Identical samples are composed with a count, so a ledger of 10^6 samples costs one event.
"""

import dataclasses
import math
from typing import List, Tuple

from tf_dpiter.accounting.lazy_module import LazyModule
from tf_dpiter.dp_query.events import eq1_noise_multiplier
from tf_dpiter.ledger import records as rec

dpa = LazyModule("dp_accounting")


def dpa_relation(relation):
  """dp-accounting's NeighboringRelation for records.ADD_OR_REMOVE / REPLACE_ONE."""
  if relation == rec.ADD_OR_REMOVE:
    return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
  if relation == rec.REPLACE_ONE:
    return dpa.NeighboringRelation.REPLACE_ONE
  raise ValueError(f"relation must be one of {rec.RELATIONS}, got {relation!r}")


@dataclasses.dataclass(frozen=True)
class SampleGroup:
  """All samples with the same sampling parameters and the same queries."""
  count: int
  policy: str
  population_size: float
  selection_probability: float
  sample_size: float
  noise_multiplier: float          # Eq. (1) over the Gaussian queries' sensitivities; inf if none
  laplace_noise_multipliers: Tuple[float, ...]
  non_private: bool
  examples_per_record: int = 1

  @property
  def relation(self):
    return rec.relation_for_policy(self.policy)


def _round_down(z, digits=12):
  """z rounded down to `digits` significant digits: merges samples whose Eq. (1) multiplier
  differs only by float rounding (e.g. adaptive clips), erring on the costly side."""
  if z == 0 or not math.isfinite(z):
    return z
  scale = 10.0 ** (digits - 1 - math.floor(math.log10(z)))
  return math.floor(z * scale) / scale


def groups_from_runs(runs) -> List[SampleGroup]:
  """Merges runs (count, sample_row, query_rows) with equal content into SampleGroups."""
  merged = {}
  for run in rec.to_records(runs):
    gauss = [q for q in run.queries if q.kind == "gaussian"]
    lap = [q for q in run.queries if q.kind == "laplace"]
    z = _round_down(eq1_noise_multiplier([q.sensitivity for q in gauss], [q.noise for q in gauss]))
    key = (run.policy, run.population_size, run.selection_probability, run.sample_size, z,
           tuple(sorted(q.noise / q.sensitivity for q in lap)),
           any(q.kind == "non_private" for q in run.queries) or z == 0.0,
           run.examples_per_record)
    merged[key] = merged.get(key, 0) + run.count
  return [SampleGroup(c, *k) for k, c in merged.items()]


def groups_from_arrays(samples, queries) -> List[SampleGroup]:
  samples, queries = rec.validate_arrays(samples, queries)
  return groups_from_runs(rec.run_length_encode(samples, queries))


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
  return "example" if k <= 1 else f"example (records are microbatches of {k} examples: sensitivity 2C)"


def _shuffle_event(group, mech, passes, notes):
  """One un-amplified mechanism per pass: a record is in at most one batch of a pass."""
  n, m = group.population_size, group.sample_size
  steps_per_pass = math.ceil(n / m)
  if passes <= 0:
    notes.append(f"shuffled batches of {m:.0f} from n={n:.0f} with no pass boundaries recorded: "
                 "every sample is charged as its own pass (no benefit from shuffling)")
    return dpa.SelfComposedDpEvent(mech, group.count)
  needed = math.ceil(group.count / steps_per_pass)
  if passes < needed:
    raise ValueError(
        f"ledger holds {group.count} shuffled samples of size {m:.0f} from n={n:.0f} "
        f"({steps_per_pass} per pass) but records only {passes} passes (at least {needed} "
        "needed): the data was not sampled as declared; refusing to account it")
  charged = min(passes, group.count)
  notes.append(f"shuffled passes (batches of {m:.0f} from n={n:.0f}): NO amplification by "
               f"sampling; each of the {passes} passes started (complete or partial, one "
               f"permutation each) costs one un-amplified mechanism ({charged} charged here)")
  return dpa.SelfComposedDpEvent(mech, charged)


def group_event(group, accountant="rdp", passes=0):
  """(dp event for the whole group, assumption strings) for one SampleGroup.

  `passes`: the shuffled passes the ledger recorded (used by policy shuffle only).
  """
  mech = _mechanism(group)
  notes = []
  n, q, m = group.population_size, group.selection_probability, group.sample_size
  gaussian_only = not group.laplace_noise_multipliers
  if isinstance(mech, (dpa.NonPrivateDpEvent, dpa.NoOpDpEvent)):
    return dpa.SelfComposedDpEvent(mech, group.count), notes
  if group.policy == rec.POISSON and q < 1:
    if gaussian_only or (accountant == "pld" and len(group.laplace_noise_multipliers) == 1
                         and not math.isfinite(group.noise_multiplier)):
      notes.append(f"Poisson sampling (q={q:.6g}, n={n:.0f}): amplification by subsampling "
                   "assumes each record joined each sample independently with probability q "
                   "and the sample's membership stayed secret")
      return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, mech), group.count), notes
    notes.append("Poisson-sampled samples with Laplace queries: no amplification by sampling "
                 "claimed (the accountant does not support it for this mechanism)")
    return dpa.SelfComposedDpEvent(mech, group.count), notes
  if group.policy == rec.FIXED_SIZE and m < n:
    if not gaussian_only:
      notes.append("fixed-size samples with Laplace queries: no amplification claimed")
      return dpa.SelfComposedDpEvent(mech, group.count), notes
    notes.append(f"fixed-size sampling without replacement ({m:.0f} of {n:.0f}), samples "
                 "independent across steps")
    return dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(int(n), int(m), mech), group.count), notes
  if group.policy == rec.SHUFFLE:
    return _shuffle_event(group, mech, passes, notes), notes
  notes.append("every record in every sample: no amplification")
  return dpa.SelfComposedDpEvent(mech, group.count), notes


def relation_of(groups):
  """The relation (records.RELATIONS) all private groups share; ValueError if they differ."""
  relations = {g.relation for g in groups if not g.non_private}
  if len(relations) > 1:
    policies = sorted({g.policy for g in groups if not g.non_private})
    raise ValueError(f"ledger mixes policies {policies} whose claims use different neighbouring "
                     "relations (add/remove one vs replace one); dp-accounting cannot compose "
                     "them: account them separately")
  return relations.pop() if relations else rec.ADD_OR_REMOVE


def neighboring_relation(groups):
  """dp-accounting's NeighboringRelation for the ledger (see relation_of)."""
  return dpa_relation(relation_of(groups))


def events_from_groups(groups, accountant="rdp", passes=0):
  """(composed DpEvent, dp-accounting neighboring relation, assumption strings)."""
  if not groups:
    raise ValueError("ledger is empty: no samples were recorded, so there is nothing to account")
  relation = relation_of(groups)
  shuffled = [g for g in groups if g.policy == rec.SHUFFLE and not g.non_private]
  needed = math.ceil(sum(g.count / math.ceil(g.population_size / g.sample_size) for g in shuffled))
  if passes > 0 and passes < needed:
    raise ValueError(f"ledger holds {sum(g.count for g in shuffled)} shuffled samples, which "
                     f"need at least {needed} passes, but records {passes}: the data was not "
                     "sampled as declared; refusing to account it")
  events, notes = [], []
  for g in groups:
    e, n = group_event(g, accountant, passes)
    events.append(e)
    for s in n:
      if s not in notes:
        notes.append(s)
  if any(g.non_private for g in groups):
    notes.append("the ledger holds non-private queries (no noise): no finite guarantee")
  units = sorted({_unit(g) for g in groups if not g.non_private}) or ["example"]
  notes.insert(0, "neighbouring relation: " + ("add or remove one " if relation == rec.ADD_OR_REMOVE
                                              else "replace one ") + "; ".join(units)
               + "; noise multipliers are sigma over the sensitivity under this relation")
  event = events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
  return event, dpa_relation(relation), notes
