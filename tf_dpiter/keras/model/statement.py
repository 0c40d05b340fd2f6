"""The privacy statement of the run a DP model trained: one source of truth for its epsilon.

`model.privacy_statement(delta)` reads the model's privacy ledger and states what its steps
cost: the neighbouring relation and the unit, the sampling policy with its q and n, the steps
(and shuffled passes), the noise multiplier z of Eq. (1) of McMahan et al. 2018, "A General
Approach to Adding Differential Privacy to Iterative Training Procedures", and epsilon at
delta composed over the ledger by dp-accounting (`dp.accounting.privacy_report`).

TF Privacy's `compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta)` assumes
Poisson sampling with q = batch_size / n. When the run sampled otherwise (e.g. shuffled
passes: replace-one adjacency, sensitivity 2C, no amplification) the statement says that
number is not the run's epsilon, and gives both.
"""

import dataclasses
import math
import warnings
import weakref
from typing import Optional, Tuple

import keras

from tf_dpiter import accounting
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.callbacks import privacy as privacy_callbacks
from tf_dpiter.keras.optimizer import weight_fingerprints
from tf_dpiter.ledger import records

_RELATION_TEXT = {records.ADD_OR_REMOVE: "add or remove one", records.REPLACE_ONE:
                  "replace one"}


@dataclasses.dataclass(frozen=True)
class RunStatement:
  """What a run's ledger says its private steps cost (see module docstring).

  Attributes:
    epsilon: epsilon at `delta` over every recorded step (inf if a step was not private).
    delta: the delta asked for.
    accountant: "rdp", "pld" or "gdp".
    relation: the neighbouring relation ("add or remove one" / "replace one"; several
      joined by " + " when the run changed policy).
    unit: what one neighbour differs by: "example" ("user" for user-level sampling), with
      the microbatch size when records are microbatches.
    policy: the sampling policy of the steps ("poisson", "shuffle", ...; joined by " + ").
    selection_probability: q of the last sampling group (batch / n for shuffle).
    population_size: n of the last sampling group.
    steps: private steps recorded.
    passes: shuffled passes started (policy "shuffle"), else 0.
    noise_multiplier: z of the last sampling group (noise stddev over the sensitivity C).
    epsilon_if_poisson: epsilon had every shuffled step been a Poisson sample with the same
      q, z and count (TF Privacy's `compute_dp_sgd_privacy`), or None (a Poisson run).
    notes: the accountant's assumptions and the warnings, one sentence each.
  """
  epsilon: float
  delta: float
  accountant: str
  relation: str
  unit: str
  policy: str
  selection_probability: float
  population_size: float
  steps: int
  passes: int
  noise_multiplier: float
  epsilon_if_poisson: Optional[float]
  notes: Tuple[str, ...]

  def __str__(self):
    approx = self.accountant == "gdp"
    head = (f"This run: {'approximately ' if approx else ''}({self.epsilon:.4g}, "
            f"{self.delta:.3g})-DP for one {self.unit} ({self.relation}), "
            f"{self.accountant.upper()} accountant over its ledger"
            + (" (GDP: an approximate value, not an upper bound)." if approx else "."))
    lines = [head,
             f"  sampling: {self.policy}, q = {self.selection_probability:.4g}, "
             f"n = {self.population_size:g}",
             f"  steps: {self.steps}" + (
                 f" in {self.passes} shuffled pass" + ("es" if self.passes > 1 else "")
                 if self.passes else ""),
             f"  noise multiplier z = {self.noise_multiplier:.4g}"]
    lines += [f"  - {note}" for note in self.notes]
    return "\n".join(lines)


def _unique(values):
  out = []
  for v in values:
    if v not in out:
      out.append(v)
  return " + ".join(str(v) for v in out)


def _sampling_groups(ledger):
  """The ledger's non-empty sampling groups (no selection records), and its shuffled passes."""
  content = accountant_lib.ledger_content(ledger)
  return [g for g in content.groups if not g.is_selection and g.count > 0], content.passes


def _mismatch_note(policy, eps_poisson, epsilon, num_microbatches):
  """The sentence saying that TF Privacy's hyperparameter epsilon is not this run's."""
  why = (f"TF Privacy's num_microbatches={num_microbatches} made fit sample shuffled passes"
         if num_microbatches else f"this run sampled by {policy!r}, not by Poisson")
  return (f"compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta) assumes "
          f"Poisson sampling (q = batch_size / n, add or remove one example) and gives "
          f"{eps_poisson:.4g} for these steps; that is NOT this run's epsilon: {why}, whose "
          f"epsilon is {epsilon:.4g}. Report {epsilon:.4g}, or train with Poisson sampling "
          "(fit(x, y, batch_size=B) without num_microbatches) to earn the smaller number.")


def run_statement(model, delta, accountant="rdp"):
  """The statement of the run `model` trained, from its ledger.

  Args:
    model: a DP keras.Model (or a DP optimizer: anything with a `ledger`).
    delta: in (0, 1).
    accountant: "rdp" or "pld" (dp-accounting, upper bounds), or "gdp" (an approximation).

  Returns:
    a RunStatement (print it for the multi-line statement).

  Warns:
    UserWarning: delta >= 1/n for the ledger's population n.

  Raises:
    ParameterValueError: the ledger has no private step yet (`model.ledger` is empty), a bad delta or
      accountant (named), or a ledger that cannot be accounted soundly.
    PrivacyConfigError: the weights changed outside the DP optimizer since its last recorded
      update (`check_weights`): the ledger's epsilon does not hold for them.
  """
  ledger = model.ledger
  groups, passes = _sampling_groups(ledger)
  if not groups:
    raise PrivacyConfigError("the model took no private step yet: privacy_statement(delta) states "
                             "the cost of the steps its ledger recorded. Call it after fit.")
  check_weights(model, "privacy_statement")
  report = accounting.privacy_report(ledger, delta=delta, accountant=accountant)
  last = groups[-1]
  policy = _unique(g.policy for g in groups)
  eps_poisson = None
  if any(g.policy != "poisson" for g in groups):
    eps_poisson = privacy_callbacks.epsilon_if_poisson(ledger.to_dict(), report.delta,
                                                       accountant if accountant != "gdp"
                                                       else "rdp")
  notes = list(report.assumptions)
  from tf_dpiter.keras.model import fit_sampling  # pylint: disable=g-import-not-at-top
  population = fit_sampling.population_note(getattr(model, "optimizer", model))
  if population is not None and any(g.policy == "poisson" for g in groups):
    notes.insert(0, population)
  held_out = fit_sampling.validation_note(getattr(model, "optimizer", model))
  if held_out is not None:
    notes.insert(0, held_out)
  if eps_poisson is not None and not math.isclose(eps_poisson, report.epsilon, rel_tol=1e-9):
    opt = getattr(model, "optimizer", model)
    notes.insert(0, _mismatch_note(policy, eps_poisson, report.epsilon,
                                   getattr(opt, "num_microbatches", None)))
  k = _unique(g.examples_per_record for g in groups)
  unit = _unique(records.unit_of_policy(g.policy) for g in groups)
  return RunStatement(
      epsilon=report.epsilon, delta=report.delta, accountant=report.accountant,
      relation=_unique(_RELATION_TEXT.get(g.relation, g.relation) for g in groups),
      unit=unit if k == "1" else f"{unit} (records: microbatches of {k} examples)",
      policy=policy, selection_probability=float(last.selection_probability),
      population_size=float(last.population_size), steps=int(sum(g.count for g in groups)),
      passes=int(passes), noise_multiplier=float(last.noise_multiplier),
      epsilon_if_poisson=eps_poisson, notes=tuple(notes))


def check_weights(model, what):
  """Refuses to state the ledger's epsilon for weights changed outside the DP optimizer
  since its last recorded update (a plain optimizer on a shared layer, set_weights of other
  values, a weights file without a ledger: weight_fingerprints.check).

  Args:
    model: a DP keras.Model (its trainable variables and every other one with digests
      recorded: weight_fingerprints.checked_variables), or a DP optimizer (the variables it
      recorded).
    what: what is refused, for the message.

  Raises:
    PrivacyConfigError: a variable holds values no private step of the run produced, or a
      custom loop's traced step wrote the learning rate, iterations, a slot or a weight from
      the batch after its update (PrivateStep.refuse_late_writes).
  """
  opt = model if not isinstance(model, keras.Model) else getattr(model, "optimizer", None)
  if getattr(opt, "private_step", None) is not None:   # a custom loop's traced steps, whole
    opt.private_step.refuse_late_writes(
        what, model.variables if isinstance(model, keras.Model) else ())
  if isinstance(model, keras.Model):
    weight_fingerprints.check(weight_fingerprints.checked_variables(model), what)
  else:
    weight_fingerprints.check(None, what, optimizer=model)


_WARNED_PAST_TARGET = weakref.WeakSet()   # optimizers already warned


def warn_if_past_target(model):
  """Warns once per optimizer when the ledger's epsilon went past the target z was calibrated
  to (`from_budget`: T steps at q = batch_size / population_size; the optimizer's
  `calibration`): more steps than T, a larger q, or another policy. The ledger still
  accounts the run exactly. Returns the ledger's epsilon when it exceeds the target, else None.
  """
  opt = getattr(model, "optimizer", None)
  calib = getattr(opt, "calibration", None)
  if not calib or opt in _WARNED_PAST_TARGET:
    return None
  report = accounting.privacy_report(opt.ledger, delta=calib["delta"],
                                     accountant=calib.get("accountant", "rdp"))
  if report.epsilon <= calib["epsilon"] * (1 + 1e-6):
    return None
  _WARNED_PAST_TARGET.add(opt)
  warnings.warn(past_target_message(opt.ledger, calib, report), UserWarning, stacklevel=3)
  return report.epsilon


def past_target_message(ledger, calib, report):
  """The text of `warn_if_past_target`: which way the run left its calibration `calib` (the
  optimizer's dict), both numbers; `report` is the ledger's at the calibration's delta."""
  groups, _ = _sampling_groups(ledger)
  steps, planned = int(report.num_samples), calib.get("steps")
  batch, population = calib.get("batch_size"), calib.get("population_size")
  planned_q = batch / population if batch and population else None
  run_q = max((float(g.selection_probability) for g in groups), default=None)
  run_n = min((float(g.population_size) for g in groups), default=None)
  policies = sorted({g.policy for g in groups})
  head = (f"the run's epsilon went past the calibrated target: the ledger's "
          f"epsilon={report.epsilon:.4g} at delta={calib['delta']:g} exceeds "
          f"epsilon={calib['epsilon']:g}, the target the noise was calibrated to (for "
          f"{planned} steps at q={planned_q:.6g} = batch_size {batch} / population_size "
          f"{population}, {calib.get('sampling')!r} sampling). ")
  same_q = run_q is None or planned_q is None or run_q <= planned_q * (1 + 1e-9)
  if planned is not None and steps > planned:
    why = (f"The run took MORE private steps than calibrated: {steps} against {planned}"
           + ("" if same_q else f", and at a larger q={run_q:.6g} (n={run_n:g})") + ". To stay "
           "within the target, train the calibrated epochs")
  elif not same_q:
    why = (f"The run took FEWER private steps than calibrated ({steps} against {planned}), but "
           f"at a LARGER sampling probability: q={run_q:.6g} with population n={run_n:g}, "
           f"against the calibrated q={planned_q:.6g} with n={population} (a smaller dataset or "
           "a larger batch than calibrated), and each step costs more. To stay within the "
           "target, calibrate with the batch_size and population_size the run uses")
  else:
    why = (f"The run took {steps} private steps against {planned} calibrated, at q={run_q:.6g} "
           f"(n={run_n:g}), sampled by {', '.join(map(repr, policies))}. To stay within the "
           "target, train with the calibrated sampling, batch size and epochs")
  return (head + why + ", or add dp.keras.callbacks.StopAtPrivacyBudget(epsilon, delta). "
          "The run's guarantee is the ledger's epsilon")
