"""Ledger -> dp-accounting events (seed 002, Eq. (1) and Section 5).

Pure numpy functions. A sample with Gaussian sum queries (S_g, sigma~_g) becomes one
Gaussian mechanism with noise multiplier z = (sum_g (S_g / sigma~_g)^2)^(-1/2) (Eq. (1)),
placed inside the sampling event matching the recorded policy. Identical samples are
composed with a count, never one by one, so a ledger of 10^6 samples costs one event.
"""

import dataclasses
import math
from typing import List, Tuple

import dp_accounting as dpa
import numpy as np

from tf_dpiter.dp_query.events import eq1_noise_multiplier
from tf_dpiter.ledger import privacy_ledger as pl

ADD_OR_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dpa.NeighboringRelation.REPLACE_ONE


@dataclasses.dataclass(frozen=True)
class SampleGroup:
  """All samples with the same sampling parameters and the same queries."""
  count: int
  policy: str
  population_size: float
  selection_probability: float
  sample_size: float
  noise_multiplier: float          # Eq. (1) over the Gaussian queries; inf if none
  laplace_noise_multipliers: Tuple[float, ...]
  non_private: bool


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
  for count, s, qs in runs:
    kinds = qs[:, 1] if len(qs) else np.zeros(0)
    g = qs[kinds == pl.GAUSSIAN]
    lap = qs[kinds == pl.LAPLACE]
    z = _round_down(eq1_noise_multiplier(g[:, 2], g[:, 3]))
    key = (pl.policy_name(s[3]), float(s[0]), float(s[1]), float(s[2]), z,
           tuple(sorted(float(b / c) for c, b in lap[:, 2:4])),
           bool(np.any(kinds == pl.NON_PRIVATE)) or z == 0.0)
    merged[key] = merged.get(key, 0) + int(count)
  return [SampleGroup(c, *k) for k, c in merged.items()]


def groups_from_arrays(samples, queries) -> List[SampleGroup]:
  samples, queries = pl.validate_arrays(samples, queries)
  return groups_from_runs(pl.run_length_encode(samples, queries))


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


def group_event(group, accountant="rdp"):
  """(dp event for the whole group, assumption strings) for one SampleGroup."""
  mech = _mechanism(group)
  notes = []
  n, q, m = group.population_size, group.selection_probability, group.sample_size
  gaussian_only = not group.laplace_noise_multipliers
  if isinstance(mech, (dpa.NonPrivateDpEvent, dpa.NoOpDpEvent)):
    return dpa.SelfComposedDpEvent(mech, group.count), notes
  if group.policy == pl.POISSON and q < 1:
    if gaussian_only or (accountant == "pld" and len(group.laplace_noise_multipliers) == 1
                         and not math.isfinite(group.noise_multiplier)):
      notes.append(f"Poisson sampling (q={q:.6g}, n={n:.0f}): amplification by subsampling "
                   "assumes each record joined each sample independently with probability q "
                   "and the sample's membership stayed secret")
      return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, mech), group.count), notes
    notes.append("Poisson-sampled samples with Laplace queries: no amplification by sampling "
                 "claimed (the accountant does not support it for this mechanism)")
    return dpa.SelfComposedDpEvent(mech, group.count), notes
  if group.policy == pl.FIXED_SIZE and m < n:
    if not gaussian_only:
      notes.append("fixed-size samples with Laplace queries: no amplification claimed")
      return dpa.SelfComposedDpEvent(mech, group.count), notes
    notes.append(f"fixed-size sampling without replacement ({m:.0f} of {n:.0f}), samples "
                 "independent across steps; replace-one adjacency")
    return dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(int(n), int(m), mech), group.count), notes
  if group.policy == pl.SHUFFLE:
    steps_per_epoch = math.ceil(n / m)
    epochs = math.ceil(group.count / steps_per_epoch)
    notes.append(f"shuffled epochs (batches of {m:.0f} from n={n:.0f}): NO amplification by "
                 "sampling is claimed; each record is assumed to be in exactly one sample per "
                 f"epoch (disjoint batches), so each of the {epochs} epochs costs one "
                 "un-amplified mechanism")
    return dpa.SelfComposedDpEvent(mech, epochs), notes
  notes.append("every record in every sample (q = 1): no amplification")
  return dpa.SelfComposedDpEvent(mech, group.count), notes


def neighboring_relation(groups):
  """ADD_OR_REMOVE_ONE unless some group uses fixed-size sampling (then REPLACE_ONE)."""
  fixed = any(g.policy == pl.FIXED_SIZE and g.sample_size < g.population_size and
              not g.non_private for g in groups)
  poisson = any(g.policy == pl.POISSON and g.selection_probability < 1 and
                not g.non_private for g in groups)
  if fixed and poisson:
    raise ValueError("ledger mixes Poisson and fixed-size sampling: dp-accounting analyses "
                     "them under different adjacency relations (add/remove vs replace-one); "
                     "account them separately")
  return REPLACE_ONE if fixed else ADD_OR_REMOVE


def events_from_groups(groups, accountant="rdp"):
  """(composed DpEvent, neighboring relation, assumption strings)."""
  if not groups:
    raise ValueError("ledger is empty: no samples were recorded, so there is nothing to account")
  relation = neighboring_relation(groups)
  events, notes = [], []
  for g in groups:
    e, n = group_event(g, accountant)
    events.append(e)
    for s in n:
      if s not in notes:
        notes.append(s)
  if any(g.non_private for g in groups):
    notes.append("the ledger holds non-private queries (no noise): no finite guarantee")
  notes.insert(0, "adjacency: " + ("add or remove one record" if relation == ADD_OR_REMOVE
                                   else "replace one record"))
  event = events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
  return event, relation, notes
