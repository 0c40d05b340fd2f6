"""The ledger's record of a private hyperparameter selection. Pure Python/numpy.

Papernot and Steinke 2022 ("Hyperparameter tuning with Renyi differential privacy"): run K
trials, K drawn from a distribution fixed in advance and independent of the data (a truncated
negative binomial of `shape` in [0, inf) with K >= 1, or Poisson for shape = inf), each a DP
run with data-independent hyperparameters, and release only the best trial; dp-accounting's
`RepeatAndSelectDpEvent(trial_event, mean, shape)` bounds the whole (RDP accountant only: the
others refuse a ledger with a selection).

In a ledger the selection is one *marker* row (policy `records.REPEAT_AND_SELECT`,
[mean, 1, shape (-1 for infinity), code, trials run, 0]) after the trial's samples; later
samples compose as usual. In the file it is the field "selection" (version 3, refused by
older readers, so no reader drops it and reports one trial's epsilon).
"""

import dataclasses
import math

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import schema

SELECTION_VERSION = 3
_POISSON, _TNB = "poisson", "truncated_negative_binomial"


@dataclasses.dataclass(frozen=True)
class Selection:
  """A private selection: best of K trials, K ~ distribution(mean, shape).

  Attributes:
    mean: E[K] (>= 1 for a truncated negative binomial, > 0 for Poisson).
    shape: eta in [0, inf): truncated negative binomial (1 geometric, 0 logarithmic);
      math.inf: Poisson.
    trials: the number of trials actually run (K). K is drawn independently of the data,
      but Papernot and Steinke's bound (Theorem 2) is for releasing the best trial with K
      kept hidden: a reader who also learns K is not covered by it. A file holding this
      record is for the accountant and the auditor, not for publication with the model.
    after_samples: the samples of the ledger before the marker (the trial).
  """
  mean: float
  shape: float
  trials: int
  after_samples: int = 0

  def __post_init__(self):
    check(self.mean, self.shape, self.trials)


def check(mean, shape, trials):
  """Checks a selection's parameters: mean E[K], shape eta >= 0 or inf, trials K run (an
  integer >= 1).

  Raises:
    ParameterTypeError: mean not a number (a bool included) or trials not an integer.
    ParameterValueError: naming the parameter and its value.
  """
  shape = float(shape)
  if math.isnan(shape) or shape < 0:
    raise ParameterValueError(f"shape must be >= 0 (inf for Poisson), got {shape!r}")
  # a truncated negative binomial's support is K >= 1; dp-accounting accounts a Poisson K
  # (RepeatAndSelectDpEvent) only for mean >= 1: refused here, not after the trials ran
  mean_value = validation.check_number("mean", mean)   # a bool (np.True_ too) is no mean
  if not (math.isfinite(mean_value) and mean_value >= 1):
    raise ParameterValueError(validation.message("mean", "finite and >= 1", mean))
  validation.check_integer("trials", trials, 1)   # the trials run


def marker_row(selection):
  """The float64 sample row (`records.SAMPLE_COLUMNS`) of the marker of a Selection (see
  module doc)."""
  shape = -1.0 if math.isinf(selection.shape) else float(selection.shape)
  return np.array([selection.mean, 1.0, shape, schema.REPEAT_AND_SELECT_CODE,
                   float(selection.trials), 0.0])


def is_marker(sample_row):
  """Whether a sample row (`records.SAMPLE_COLUMNS`) is a selection marker (a bool)."""
  return int(sample_row[3]) == schema.REPEAT_AND_SELECT_CODE


def from_row(sample_row, after_samples=0):
  """The Selection a marker row (`is_marker`) stands for, after_samples samples before it."""
  shape = math.inf if sample_row[2] == -1 else float(sample_row[2])
  return Selection(float(sample_row[0]), shape, int(sample_row[4]), int(after_samples))


def with_selection(runs, mean, shape, trials):
  """runs + [(1, marker row, no queries)]: the runs [(count, sample_row, query_rows)] of one
  trial (no marker yet) followed by the marker of its selection (mean, shape, trials: see
  Selection).

  Raises:
    ParameterValueError: bad parameters, or `runs` already holds a selection marker or no
      sample.
  """
  if any(is_marker(s) for _, s, _ in runs):
    raise ParameterValueError("this ledger already records a selection; a trial cannot be selected twice")
  total = int(sum(c for c, _, _ in runs))
  if total == 0:
    raise PrivacyConfigError("the trial's ledger is empty: record the trial's samples first")
  sel = Selection(float(mean), float(shape), trials, total)
  return list(runs) + [(1, marker_row(sel), np.zeros([0, len(schema.QUERY_COLUMNS)]))]


def to_field(selection):
  """The file form of a Selection (JSON-able; no infinity): a dict with distribution, mean,
  shape (None for Poisson), trials, after_samples."""
  poisson = math.isinf(selection.shape)
  return {"distribution": _POISSON if poisson else _TNB, "mean": float(selection.mean),
          "shape": None if poisson else float(selection.shape), "trials": int(selection.trials),
          "after_samples": int(selection.after_samples)}


def from_field(field):
  """The Selection of a ledger file's "selection" dict (inverse of `to_field`).

  Raises:
    ParameterValueError: a malformed field, named.
  """
  if not isinstance(field, dict):
    raise ParameterValueError(f"ledger field 'selection' must be an object, got {type(field).__name__}")
  dist = field.get("distribution")
  if dist not in (_POISSON, _TNB):
    raise ParameterValueError(f"selection 'distribution' must be {_POISSON!r} or {_TNB!r}, got {dist!r}")
  if (dist == _POISSON) != (field.get("shape") is None):
    raise ParameterValueError(f"selection 'shape' must be null for {_POISSON!r} and a number for "
                              f"{_TNB!r}, got {field.get('shape')!r}")
  after = field.get("after_samples")
  if isinstance(after, bool) or not isinstance(after, int) or after < 1:
    raise PrivacyConfigError(f"selection 'after_samples' must be an integer >= 1, got {after!r}")
  shape = math.inf if dist == _POISSON else field["shape"]
  if isinstance(shape, bool) or not isinstance(shape, (int, float)):
    raise ParameterValueError(f"selection 'shape' must be a number, got {shape!r}")
  return Selection(field.get("mean"), float(shape), field.get("trials"), after)


def split_runs(runs):
  """(sample runs without the marker, its Selection with after_samples set or None) of runs
  [(count, sample_row, query_rows)] that may hold one marker."""
  out, found, seen = [], None, 0
  for count, s, qs in runs:
    if is_marker(s):
      found = from_row(s, seen)
    else:
      out.append((count, s, qs))
      seen += int(count)
  return out, found


def insert_marker(runs, selection):
  """Runs [(count, sample_row, query_rows)] without a marker, with the marker of `selection`
  inserted after `selection.after_samples` samples (a run that straddles that point is split
  in two; inverse of `split_runs`).

  Raises:
    PrivacyConfigError: after_samples is beyond the ledger's samples.
  """
  out, seen, placed = [], 0, False
  marker = (1, marker_row(selection), np.zeros([0, len(schema.QUERY_COLUMNS)]))
  for count, s, qs in runs:
    if not placed and seen + count > selection.after_samples:
      head = selection.after_samples - seen
      if head:
        out.append((head, s, qs))
      out.append(marker)
      out.append((count - head, s, qs))
      placed = True
    else:
      out.append((count, s, qs))
    seen += count
    if not placed and seen == selection.after_samples:
      out.append(marker)
      placed = True
  if not placed:
    raise PrivacyConfigError(f"selection 'after_samples' is {selection.after_samples} but the ledger "
                             f"holds {seen} samples")
  return out


def marker_checks(samples):
  """[(bad-row mask, message, column)]: the checks of the marker rows (code
  `schema.REPEAT_AND_SELECT_CODE`) among [N, 6] float64 ledger sample rows, for
  `records.validate_arrays`."""
  n, q, m, pol, k, nq = samples.T
  marker = pol == schema.REPEAT_AND_SELECT_CODE
  return [
      (marker & (np.cumsum(marker) > 1), "a ledger holds at most one selection record", pol),
      (marker & ((q != 1) | (nq != 0)),
       "a selection record has selection_probability 1 and no query", q),
      (marker & ~((m >= 0) | (m == -1)),
       "a selection record's shape must be >= 0 or -1 (infinity: Poisson)", m),
      (marker & (m != -1) & (n < 1),
       "a selection record's mean must be >= 1 for a truncated negative binomial", n),
      (marker & (k < 1), "a selection record's trials run must be >= 1", k),
  ]
