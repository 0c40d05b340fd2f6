"""What `run_attacks` returns, in TF Privacy's terms, and how it is kept across epochs.

`SingleAttackResult` is one attack on one slice; `AttackResults` every attack on every slice
with the DP bound (`PrivacyBound`) and the model's `PrivacyReportMetadata`, saved as a NumPy
`.npz` archive with no pickled object (loading never runs code); `AttackResultsCollection`
holds several epochs or model variants for the plots of `mia_plotting`.
"""

import collections
import dataclasses
import enum
import glob
import json
import os
import re
import zipfile
from typing import List, Optional, Tuple

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

_FORMAT = "tf_dpiter.auditing.AttackResults/1"
ENTIRE_DATASET_SLICE_STR = "Entire dataset"


class AttackType(enum.Enum):
  """The attacks `run_attacks` runs (TF Privacy's names); `str()` gives the name."""
  THRESHOLD_ATTACK = "threshold"
  LOGISTIC_REGRESSION = "lr"

  def __str__(self):
    return self.name


class PrivacyMetric(enum.Enum):
  """The metrics the privacy-report plots can show; `str()` is the data-frame column."""
  AUC = "AUC"
  ATTACKER_ADVANTAGE = "Attacker advantage"
  PPV = "Positive predictive value"

  def __str__(self):
    return self.value


DataSize = collections.namedtuple("DataSize", "ntrain ntest")


@dataclasses.dataclass(frozen=True)
class SingleSliceSpec:
  """One slice: feature None (entire dataset), "class" or "correctly_classified"."""
  feature: Optional[str] = None
  value: object = None

  @property
  def entire_dataset(self):
    """Whether this is the whole data (no feature)."""
    return self.feature is None

  def __str__(self):
    return ENTIRE_DATASET_SLICE_STR if self.feature is None else f"{self.feature}={self.value}"


def _same(a, b):
  """Equality of two optional arrays (None only equals None)."""
  if a is None or b is None:
    return a is None and b is None
  return np.array_equal(a, b)


@dataclasses.dataclass(frozen=True, eq=False)
class RocCurve:
  """ROC of the rule "score >= t": false- and true-positive rates over all thresholds.

  `test_train_ratio` is gamma = (number of non-members) / (number of members), the prior odds
  the positive predictive value needs (Jayaraman, Wang, Knipmeyer, Gu & Evans 2021,
  "Revisiting Membership Inference Under Realistic Assumptions", Section 3).
  """
  fpr: np.ndarray
  tpr: np.ndarray
  test_train_ratio: float = 1.0

  def get_auc(self):
    """Area under the curve (trapezoids; ties are diagonal segments, so it is the
    Mann-Whitney AUC P[member score > non-member score] + 1/2 P[tie]).

    Returns:
      a float in [0, 1].
    """
    return float(np.trapezoid(self.tpr, self.fpr))

  def get_attacker_advantage(self):
    """max over thresholds of TPR - FPR (Yeom et al. 2018, Definition 4).

    Returns:
      a float in [0, 1].
    """
    return float(np.max(np.asarray(self.tpr) - np.asarray(self.fpr)))

  def get_ppv(self):
    """Positive predictive value: the largest TP / (TP + FP) over thresholds.

    With n members and gamma n non-members, TP / (TP + FP) = TPR / (TPR + gamma FPR). At the
    threshold that accepts nothing (TPR = FPR = 0) it is taken as 1 / (1 + gamma), the
    fraction of members (the value of guessing).

    Returns:
      a float in [0, 1].
    """
    tpr, fpr = np.asarray(self.tpr, np.float64), np.asarray(self.fpr, np.float64)
    den = tpr + self.test_train_ratio * fpr
    ppv = np.divide(tpr, den, out=np.full_like(den, 1.0 / (1.0 + self.test_train_ratio)),
                    where=den > 0)
    return float(np.max(ppv))

  def __eq__(self, other):
    return (isinstance(other, RocCurve) and self.test_train_ratio == other.test_train_ratio
            and _same(self.fpr, other.fpr) and _same(self.tpr, other.tpr))

  __hash__ = None


@dataclasses.dataclass(frozen=True, eq=False)
class SingleAttackResult:
  """One attack on one slice, as in TF Privacy.

  The scores are -loss (nats) for the threshold attack and the cross-fitted log-odds for
  logistic regression; the ROC curve and AUC are computed from exactly these, and
  `auditing.epsilon_lower_bound(scores_train, scores_test, delta)` turns them into a sound
  epsilon lower bound.

  Attributes:
    slice_spec: the slice attacked.
    attack_type: the attack (an AttackType).
    roc_curve: its ROC curve (fpr, tpr, thresholds).
    auc: the area under that curve.
    attacker_advantage: max |TPR - FPR| over the thresholds (TF Privacy's; bounded by
      `max_advantage`).
    num_train: the members in the slice.
    num_test: the non-members in the slice.
    membership_scores_train: the attack's scores of the slice's members (higher = member).
    membership_scores_test: the attack's scores of the slice's non-members.
    train_indices: the rows of the members' input the slice holds, or None
      (`run_attacks(..., return_slice_indices=True)`).
    test_indices: the rows of the non-members' input the slice holds, or None.
  """
  slice_spec: SingleSliceSpec
  attack_type: AttackType
  roc_curve: RocCurve
  auc: float
  attacker_advantage: float
  num_train: int
  num_test: int
  membership_scores_train: Optional[np.ndarray] = None
  membership_scores_test: Optional[np.ndarray] = None
  train_indices: Optional[np.ndarray] = None
  test_indices: Optional[np.ndarray] = None

  @property
  def data_size(self):
    """`DataSize(ntrain, ntest)`: the slice's numbers of members and non-members."""
    return DataSize(self.num_train, self.num_test)

  def get_auc(self):
    """The ROC AUC (a float in [0, 1])."""
    return self.auc

  def get_attacker_advantage(self):
    """max over thresholds of TPR - FPR (a float in [0, 1])."""
    return self.attacker_advantage

  def get_ppv(self):
    """The positive predictive value (`RocCurve.get_ppv`), a float in [0, 1]."""
    return self.roc_curve.get_ppv()

  def __eq__(self, other):
    if not isinstance(other, SingleAttackResult):
      return False
    for f in dataclasses.fields(self):
      a, b = getattr(self, f.name), getattr(other, f.name)
      arrays = isinstance(a, np.ndarray) or isinstance(b, np.ndarray)
      if not (_same(a, b) if arrays else a == b):
        return False
    return True

  __hash__ = None


@dataclasses.dataclass(frozen=True)
class PrivacyBound:
  """The most an attack can achieve against (epsilon, delta)-DP training (see
  `membership_inference.max_advantage` and `max_auc`)."""
  epsilon: float
  delta: float
  max_advantage: float
  max_auc: float


@dataclasses.dataclass(frozen=True)
class PrivacyReportMetadata:
  """The model under attack, for privacy reports across epochs (TF Privacy's fields).

  `run_attacks(..., privacy_report_metadata=m)` fills in its missing accuracies and mean
  losses from the attack input.

  Attributes:
    accuracy_train: accuracy on the members (training data), or None.
    accuracy_test: accuracy on the non-members, or None.
    loss_train: mean loss on the members (nats), or None.
    loss_test: mean loss on the non-members (nats), or None.
    model_variant_label: the label of the model variant in reports.
    epoch_num: the epoch the model was attacked at, or None.
  """
  accuracy_train: Optional[float] = None
  accuracy_test: Optional[float] = None
  loss_train: Optional[float] = None
  loss_test: Optional[float] = None
  model_variant_label: str = "Default model variant"
  epoch_num: Optional[int] = None

  def __post_init__(self):
    validation.check_instance("model_variant_label", self.model_variant_label, str, "a str")
    validation.check_params({"epoch_num": validation.Optional(validation.Integer(0))},
                            {"epoch_num": self.epoch_num})
    for name in ("accuracy_train", "accuracy_test", "loss_train", "loss_test"):
      if getattr(self, name) is not None:
        validation.check_number(name, getattr(self, name))


_DF_COLUMNS = ("slice feature", "slice value", "train size", "test size", "attack type",
               str(PrivacyMetric.ATTACKER_ADVANTAGE), str(PrivacyMetric.PPV),
               str(PrivacyMetric.AUC))


def _pandas():
  try:
    import pandas  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("AttackResults.calculate_pd_dataframe needs pandas: "
                      "pip install \"tf_dpiter[report]\" (or pip install pandas)") from None
  return pandas


@dataclasses.dataclass(frozen=True)
class AttackResults:
  """All attacks on all slices, the DP bound they are compared with (or None) and the
  model's `PrivacyReportMetadata` (or None).

  Attributes:
    single_attack_results: the SingleAttackResults, one per attack and slice.
    privacy_bound: the DP bound they are compared with, or None.
    privacy_report_metadata: the model's PrivacyReportMetadata, or None.
  """
  single_attack_results: Tuple[SingleAttackResult, ...]
  privacy_bound: Optional[PrivacyBound] = None
  privacy_report_metadata: Optional[PrivacyReportMetadata] = None

  def get_result_with_max_auc(self):
    """The `SingleAttackResult` with the largest AUC."""
    return max(self.single_attack_results, key=lambda r: r.auc)

  def get_result_with_max_attacker_advantage(self):
    """The `SingleAttackResult` with the largest attacker advantage."""
    return max(self.single_attack_results, key=lambda r: r.attacker_advantage)

  def get_result_with_max_ppv(self):
    """The `SingleAttackResult` with the largest positive predictive value."""
    return max(self.single_attack_results, key=lambda r: r.get_ppv())

  def summary(self, by_slices=False):
    """Text: the best AUC and advantage (every result with by_slices), and the DP bound.

    Args:
      by_slices: one line per attack and slice instead of the best two.

    Returns:
      the summary, a str.
    """
    results = self.single_attack_results if by_slices else (
        self.get_result_with_max_auc(), self.get_result_with_max_attacker_advantage())
    lines = [f"{r.attack_type.name} on {r.slice_spec} ({r.num_train} train, {r.num_test} "
             f"test): AUC {r.auc:.4f}, attacker advantage {r.attacker_advantage:.4f}"
             for r in results]
    b = self.privacy_bound
    if b is not None:
      lines.append(f"(epsilon={b.epsilon:g}, delta={b.delta:g})-DP bound: AUC <= "
                   f"{b.max_auc:.4f}, attacker advantage <= {b.max_advantage:.4f}")
    return "\n".join(lines)

  def __str__(self):
    return self.summary(by_slices=True)

  def calculate_pd_dataframe(self):
    """One row per result: slice, sizes, attack and metrics (TF Privacy's column names).

    With a `privacy_bound` also "epsilon", "delta", "AUC bound" and "Attacker advantage
    bound" (the most (epsilon, delta)-DP allows).

    Returns:
      a `pandas.DataFrame`.

    Raises:
      ImportError: pandas is not installed (`pip install "tf_dpiter[report]"`).
    """
    pd = _pandas()
    rows = []
    for r in self.single_attack_results:
      s = r.slice_spec
      rows.append((str(s) if s.entire_dataset else s.feature,
                   "" if s.entire_dataset else str(s.value), r.num_train, r.num_test,
                   str(r.attack_type), r.attacker_advantage, r.get_ppv(), r.auc))
    columns = {c: [row[i] for row in rows] for i, c in enumerate(_DF_COLUMNS)}
    b = self.privacy_bound
    if b is not None:
      columns.update({"epsilon": b.epsilon, "delta": b.delta, "AUC bound": b.max_auc,
                      "Attacker advantage bound": b.max_advantage})
    return pd.DataFrame(columns, index=pd.RangeIndex(len(rows)))

  def save(self, filepath):
    """Writes the results to `filepath` (a NumPy .npz archive of one JSON description and
    numeric arrays; `load` reads it with pickling disabled).

    Args:
      filepath: the file to write (overwritten).

    Returns:
      filepath.
    """
    description, arrays = _encode(self)
    with open(filepath, "wb") as f:
      np.savez(f, __description__=np.array(json.dumps(description)), **arrays)
    return filepath

  @classmethod
  def load(cls, filepath):
    """Reads results written by `save` (no pickle: a TF Privacy pickle file is refused).

    Args:
      filepath: a file written by `AttackResults.save`.

    Returns:
      the `AttackResults`, equal (==) to the saved ones.

    Raises:
      ParameterValueError: the file is not one `save` wrote.
    """
    try:
      with np.load(filepath, allow_pickle=False) as z:
        description = json.loads(str(z["__description__"]))
        arrays = {k: z[k] for k in z.files if k != "__description__"}
      return _decode(description, arrays)
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
      raise ParameterValueError(validation.message(
          "filepath", f"a file written by AttackResults.save ({e}); a TF Privacy pickle "
          "cannot be read: re-run the attacks", filepath)) from None


def _encode(results):
  """(JSON-able description, {name: array}) of `AttackResults`."""
  arrays, entries = {}, []
  for i, r in enumerate(results.single_attack_results):
    value = r.slice_spec.value
    entries.append({
        "slice_feature": r.slice_spec.feature,
        "slice_value": value.item() if isinstance(value, np.generic) else value,
        "attack_type": r.attack_type.name, "auc": float(r.auc),
        "attacker_advantage": float(r.attacker_advantage), "num_train": int(r.num_train),
        "num_test": int(r.num_test), "test_train_ratio": float(r.roc_curve.test_train_ratio)})
    arrays[f"r{i}_fpr"], arrays[f"r{i}_tpr"] = r.roc_curve.fpr, r.roc_curve.tpr
    for name in _ARRAY_FIELDS:
      if getattr(r, name) is not None:
        arrays[f"r{i}_{name}"] = np.asarray(getattr(r, name))
  bound, meta = results.privacy_bound, results.privacy_report_metadata
  description = {
      "format": _FORMAT, "results": entries,
      "privacy_bound": None if bound is None else {
          k: float(v) for k, v in dataclasses.asdict(bound).items()},
      "privacy_report_metadata": None if meta is None else {
          k: _plain(v) for k, v in dataclasses.asdict(meta).items()}}
  return description, arrays


def _plain(v):
  """A JSON value of a metadata field: None, str, int (NumPy integers too) or float."""
  if v is None or isinstance(v, str):
    return v
  if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
    return int(v)
  return float(v)


_ARRAY_FIELDS = ("membership_scores_train", "membership_scores_test", "train_indices",
                 "test_indices")


def _decode(description, arrays):
  if description.get("format") != _FORMAT:
    raise ParameterValueError(f"format {description.get('format')!r}, expected {_FORMAT!r}")
  results = []
  for i, e in enumerate(description["results"]):
    optional = {n: arrays.get(f"r{i}_{n}") for n in _ARRAY_FIELDS}
    results.append(SingleAttackResult(
        SingleSliceSpec(e["slice_feature"], e["slice_value"]), AttackType[e["attack_type"]],
        RocCurve(arrays[f"r{i}_fpr"], arrays[f"r{i}_tpr"], e["test_train_ratio"]), e["auc"],
        e["attacker_advantage"], e["num_train"], e["num_test"], **optional))
  bound, meta = description["privacy_bound"], description["privacy_report_metadata"]
  return AttackResults(tuple(results), None if bound is None else PrivacyBound(**bound),
                       None if meta is None else PrivacyReportMetadata(**meta))


@dataclasses.dataclass
class AttackResultsCollection:
  """`AttackResults` of several epochs or model variants (TF Privacy's collection), e.g. one
  per evaluation during training, for `plot_by_epochs` and `plot_privacy_vs_accuracy`.

  Attributes:
    attack_results_list: the AttackResults, one per epoch or model variant.
  """
  attack_results_list: List[AttackResults] = dataclasses.field(default_factory=list)

  def append(self, attack_results):
    """Adds one `AttackResults` at the end.

    Args:
      attack_results: an `AttackResults`.

    Raises:
      ParameterTypeError: `attack_results` is not an `AttackResults`.
    """
    validation.check_instance("attack_results", attack_results, AttackResults,
                              "an AttackResults (returned by run_attacks)")
    self.attack_results_list.append(attack_results)

  def save(self, dirname):
    """Writes each `AttackResults` to "<index>_<model variant>_epoch_<epoch>.npz" in
    `dirname` (created if missing; a zero-padded index, so `load` keeps the order).

    Args:
      dirname: the directory.

    Returns:
      the list of the paths written.
    """
    os.makedirs(dirname, exist_ok=True)
    paths = []
    for i, results in enumerate(self.attack_results_list):
      meta = results.privacy_report_metadata
      name = f"{i:05d}" if meta is None else (
          f"{i:05d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', meta.model_variant_label)}"
          f"_epoch_{meta.epoch_num}")
      paths.append(results.save(os.path.join(dirname, name + ".npz")))
    return paths

  @classmethod
  def load(cls, dirname):
    """Reads every .npz file of `dirname` (in name order) written by `save`.

    Args:
      dirname: a directory written by `AttackResultsCollection.save`.

    Returns:
      the `AttackResultsCollection`.

    Raises:
      ParameterValueError: `dirname` is not a directory, or one of its .npz files was not
        written by `AttackResults.save`.
    """
    if not os.path.isdir(dirname):
      raise ParameterValueError(validation.message(
          "dirname", "a directory written by AttackResultsCollection.save", dirname))
    paths = sorted(glob.glob(os.path.join(glob.escape(dirname), "*.npz")))
    return cls([AttackResults.load(p) for p in paths])
