"""dp-accounting events of ledger rows that span many samples (`shuffle_event`,
`balls_in_bins_event`, `selection_events`), for `ledger_events`. No TensorFlow."""

import math

from tf_dpiter.accounting.lazy_module import LazyModule
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

dpa = LazyModule("dp_accounting")


def shuffle_event(group, mech, passes, notes):
  """The SelfComposedDpEvent of one shuffle SampleGroup: its per-sample (or per-tree)
  mechanism `mech` once per pass started, un-amplified (passes: those the ledger recorded;
  0: none, every sample is charged); the assumption is appended to `notes`. Relation:
  replace one example; a record is in at most one batch of a pass.

  Raises:
    PrivacyConfigError: fewer passes recorded than the samples need.
  """
  n, m = group.population_size, group.sample_size
  charged = _passes_charged(group, passes, math.ceil(n / m),
                            f"shuffled samples of size {m:.0f} from n={n:.0f}")
  if charged is None:
    notes.append(f"shuffled batches of {m:.0f} from n={n:.0f} with no pass boundaries recorded: "
                 "every sample is charged as its own pass (no benefit from shuffling)")
    return dpa.SelfComposedDpEvent(mech, group.count)
  notes.append(f"shuffled passes (batches of {m:.0f} from n={n:.0f}): NO amplification by "
               f"sampling; each of the {passes} passes started (complete or partial, one "
               f"permutation each) costs one un-amplified mechanism ({charged} charged here)")
  return dpa.SelfComposedDpEvent(mech, charged)


def _passes_charged(group, passes, steps_per_pass, what):
  """Mechanisms a group is charged: min(passes, count); None when no pass was recorded.

  Raises:
    PrivacyConfigError: fewer passes than the group's samples need (ceil(count / steps_per_pass)).
  """
  if passes <= 0:
    return None
  needed = math.ceil(group.count / steps_per_pass)
  if passes < needed:
    raise PrivacyConfigError(
        f"ledger holds {group.count} {what} ({steps_per_pass} per pass) but records only "
        f"{passes} passes (at least {needed} needed): the data was not sampled as declared; "
        "refusing to account it")
  return min(passes, group.count)


def balls_in_bins_event(group, mech, passes, notes):
  """The SelfComposedDpEvent of one balls-in-bins `ledger_events.SampleGroup` (sample_size
  = k): its per-step mechanism `mech` once per epoch started (passes: the epochs the ledger
  recorded), un-amplified; the assumption is appended to `notes`. Relation: add or remove
  one example, in exactly one uniform step j of an epoch: the law with it is a mixture over
  j of laws differing in step j only, so by joint convexity of hockey-stick divergences the
  epoch costs at most one step's mechanism (a bound, not tight; a Poisson rate 1/k would not
  be one).

  Raises:
    PrivacyConfigError: fewer epochs recorded than the samples need.
  """
  k, n = int(group.sample_size), group.population_size
  charged = _passes_charged(group, passes, k, f"balls-in-bins samples from n={n:.0f}")
  if charged is None:
    notes.append(f"balls-in-bins sampling (k={k} steps per epoch, n={n:.0f}) with no epoch "
                 "boundaries recorded: every step is charged as its own epoch")
    return dpa.SelfComposedDpEvent(mech, group.count)
  notes.append(
      f"balls-in-bins sampling (random allocation; n={n:.0f}, k={k} steps per epoch): each "
      "example is in exactly one step of each epoch, drawn uniformly and independently of the "
      "other examples and of the data (adding or removing an example moves no other one); "
      "relation add or remove one example. NO amplification claimed (none is needed from the "
      f"allocation's secrecy): each of the {passes} epochs started costs one un-amplified step "
      f"mechanism ({charged} charged here; joint convexity over the example's step)")
  return dpa.SelfComposedDpEvent(mech, charged)


def selection_events(groups, accountant, passes, events_from_groups):
  """(event, NeighboringRelation, assumption strings), as `events_from_groups` (passed in:
  `ledger_events.events_from_groups`), of SampleGroups with one selection record
  (`SampleGroup.is_selection`): RepeatAndSelectDpEvent over the trial (the samples before
  the record), composed with the samples after it; accountant "rdp" only.

  Raises:
    ParameterValueError: more than one record, an empty trial, accountant other than "rdp",
      or relations that differ.
  """
  marks = [g for g in groups if g.is_selection]
  trial = [g for g in groups if g.selected]
  rest = [g for g in groups if not g.selected and not g.is_selection]
  if len(marks) != 1 or not trial:
    raise ParameterValueError(f"a ledger holds one selection record after a non-empty trial, got "
                              f"{len(marks)} records and {len(trial)} trial groups")
  if accountant != "rdp":
    raise PrivacyConfigError(f"this ledger records a private selection (RepeatAndSelectDpEvent), which "
                             f"dp-accounting accounts with its RDP accountant only: use "
                             f"accountant='rdp', got {accountant!r}")
  sel = marks[0]
  shape = math.inf if sel.sample_size == -1 else sel.sample_size
  event, relation, notes = events_from_groups(trial, accountant, passes)
  event = dpa.dp_event.RepeatAndSelectDpEvent(event, sel.population_size, shape)
  dist = "Poisson" if math.isinf(shape) else f"truncated negative binomial (shape {shape:g})"
  notes.append(
      f"private selection: the samples before the selection record are one trial, and the "
      f"best of K trials was released, K ~ {dist} with mean {sel.population_size:g} drawn "
      f"before any trial ({sel.examples_per_record} run); assumes every trial ran this same "
      "mechanism (sampling and noise) with hyperparameters drawn independently of the data, "
      "scores computed privately or on public data, only the best trial released "
      "(Papernot and Steinke 2022; dp-accounting RepeatAndSelectDpEvent)")
  if rest:
    more, rel2, notes2 = events_from_groups(rest, accountant, passes)
    if rel2 != relation:
      raise PrivacyConfigError(f"the selected trial is accounted under {relation.name} and the later "
                               f"samples under {rel2.name}: account them separately")
    event = dpa.ComposedDpEvent([event, more])
    notes += [n for n in notes2 if n not in notes]
  return event, relation, notes


