"""Membership inference in TF Privacy's terms: `AttackInputData` in, `run_attacks` out.

Losses and/or logits (or probabilities) and labels on the training set (members) and held-out
data (non-members) give, per attack and per slice, the ROC curve, its AUC and the attacker
advantage max_t (TPR(t) - FPR(t)) (Yeom, Giacomelli, Fredrikson and Jha, "Privacy Risk in
Machine Learning: Analyzing the Connection to Overfitting", Section 3). Scores are "higher =
more likely a member": THRESHOLD_ATTACK scores -loss (Section 3.2); LOGISTIC_REGRESSION fits
the standardised loss and sorted log-probabilities with 2-fold cross-fitting.

`PrivacyBound`: for (epsilon, delta)-DP training every test lies in TPR <= e^eps FPR + delta,
TNR <= e^eps FNR + delta (Kairouz, Oh and Viswanath, "The Composition Theorem for
Differential Privacy", Theorem 2.1): advantage <= (e^eps - 1 + 2 delta) / (e^eps + 1), AUC at
most the area under that region's boundary (relation: the one epsilon was computed for). A
train/test split is one draw, so small slices may exceed it by sampling error; a sound test
is `auditing.epsilon_lower_bound`.
"""

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy import special

from tf_dpiter import validation
from tf_dpiter.auditing import attacks
from tf_dpiter.auditing.mia_results import AttackResults
from tf_dpiter.auditing.mia_results import AttackType
from tf_dpiter.auditing.mia_results import PrivacyBound
from tf_dpiter.auditing.mia_results import PrivacyReportMetadata
from tf_dpiter.auditing.mia_results import RocCurve
from tf_dpiter.auditing.mia_results import SingleAttackResult
from tf_dpiter.auditing.mia_results import SingleSliceSpec
from tf_dpiter.errors import ParameterValueError


@dataclasses.dataclass
class AttackInputData:
  """The model's outputs on members (train) and non-members (test), as in TF Privacy.

  Losses not given are the cross-entropy of the logits (or probabilities) and labels.

  Attributes:
    logits_train: [n, K] logits on the members, or None.
    logits_test: [m, K] logits on the non-members, or None.
    probs_train: [n, K] probabilities on the members (instead of logits), or None.
    probs_test: [m, K] probabilities on the non-members, or None.
    loss_train: [n] per-example losses of the members, or None.
    loss_test: [m] per-example losses of the non-members, or None.
    labels_train: [n] integer labels of the members, or None.
    labels_test: [m] integer labels of the non-members, or None.
  """
  logits_train: Optional[np.ndarray] = None
  logits_test: Optional[np.ndarray] = None
  probs_train: Optional[np.ndarray] = None
  probs_test: Optional[np.ndarray] = None
  loss_train: Optional[np.ndarray] = None
  loss_test: Optional[np.ndarray] = None
  labels_train: Optional[np.ndarray] = None
  labels_test: Optional[np.ndarray] = None

  def _outputs(self, split):
    """(array [n, K], from_logits) of a split, or (None, None)."""
    logits, probs = getattr(self, f"logits_{split}"), getattr(self, f"probs_{split}")
    if logits is not None and probs is not None:
      raise ParameterValueError(f"give logits_{split} or probs_{split}, not both")
    if logits is not None:
      return np.asarray(logits, np.float64), True
    if probs is not None:
      return np.asarray(probs, np.float64), False
    return None, None

  def log_probs(self, split):
    """Log-probabilities [n, K] of `split`, or None without outputs.

    Args:
      split: "train" or "test".

    Returns:
      float64 [n, K], or None.

    Raises:
      ParameterValueError: the outputs of `split` are not a matrix [n, K].
    """
    out, from_logits = self._outputs(split)
    return None if out is None else attacks._log_probs(  # pylint: disable=protected-access
        out, from_logits, f"logits_{split} / probs_{split}")

  def labels(self, split):
    """Integer labels [n] of `split`, or None.

    Args:
      split: "train" or "test".
    """
    y = getattr(self, f"labels_{split}")
    return None if y is None else np.asarray(y).reshape(-1).astype(np.int64)

  def loss(self, split):
    """Per-example losses [n] of `split`: the given ones, else cross-entropy (nats).

    Args:
      split: "train" or "test".

    Returns:
      float64 [n].

    Raises:
      ParameterValueError: `split` has neither losses nor outputs with labels, or labels
        outside [0, K).
    """
    given = getattr(self, f"loss_{split}")
    if given is not None:
      return np.asarray(given, np.float64).reshape(-1)
    lp, y = self.log_probs(split), self.labels(split)
    if lp is None or y is None:
      raise ParameterValueError(f"AttackInputData needs loss_{split}, or logits_{split} (or "
                                f"probs_{split}) with labels_{split}")
    y = attacks._labels(y, *lp.shape, f"labels_{split}")  # pylint: disable=protected-access
    return -lp[np.arange(y.size), y]

  def validate(self):
    """Checks that train and test have losses, or outputs with labels, of matching sizes.

    Raises:
      ParameterValueError: naming the missing or mismatched field.
    """
    for split in ("train", "test"):
      n = self.loss(split).size
      if n == 0:
        raise ParameterValueError(f"AttackInputData: the {split} split is empty")
      v = getattr(self, f"labels_{split}")
      if v is not None and np.asarray(v).reshape(-1).size != n:
        raise ParameterValueError(f"labels_{split} must have {n} entries (one per {split} "
                                  f"example), got {np.asarray(v).reshape(-1).size}")
      lp = self.log_probs(split)
      if lp is not None and lp.shape[0] != n:
        raise ParameterValueError(f"logits_{split} / probs_{split} must have {n} rows, got {lp.shape[0]}")


@dataclasses.dataclass(frozen=True)
class SlicingSpec:
  """Which slices to attack besides (or instead of) the whole data, as in TF Privacy.

  Attributes:
    entire_dataset: attack the whole data.
    by_class: also attack each class apart.
    by_classification_correctness: also attack the correctly and the wrongly classified examples
      apart.
  """
  entire_dataset: bool = True
  by_class: bool = False
  by_classification_correctness: bool = False


def max_advantage(epsilon, delta=0.0):
  """(e^eps - 1 + 2 delta) / (e^eps + 1) in [0, 1]: the largest TPR - FPR under (epsilon,
  delta)-DP, epsilon >= 0 in nats (inf allowed), delta in [0, 1]. It maximises TPR - FPR
  over the region TPR <= e^eps FPR + delta, 1 - FPR <= e^eps (1 - TPR) + delta (Kairouz, Oh
  & Viswanath 2015, Theorem 2.1); the corner is at FPR = (1 - delta) / (e^eps + 1).

  Raises:
    PrivacyConfigError: `epsilon` < 0 or `delta` outside [0, 1] (or not numbers).
  """
  validation.check_params(_EPS_DELTA, {"epsilon": epsilon, "delta": delta})
  if math.isinf(epsilon):
    return 1.0
  return min(1.0, (math.expm1(epsilon) + 2.0 * delta) / (math.exp(epsilon) + 1.0))


def max_auc(epsilon, delta=0.0):
  """The largest ROC AUC, in [0.5, 1], under (epsilon, delta)-DP (epsilon >= 0 in nats, inf
  allowed; delta in [0, 1]): the area under TPR(FPR) = min(1, e^eps FPR + delta, 1 - e^-eps
  (1 - delta - FPR)), piecewise linear with corners at FPR = (1 - delta) / (e^eps + 1) and
  1 - delta (exact trapezoids).

  Raises:
    PrivacyConfigError: `epsilon` < 0 or `delta` outside [0, 1] (or not numbers).
  """
  validation.check_params(_EPS_DELTA, {"epsilon": epsilon, "delta": delta})
  if math.isinf(epsilon):
    return 1.0
  e = math.exp(epsilon)
  f = np.array(sorted({0.0, (1.0 - delta) / (e + 1.0), max(0.0, 1.0 - delta), 1.0}))
  t = np.minimum.reduce([np.ones_like(f), e * f + delta, 1.0 - (1.0 - delta - f) / e])
  t = np.clip(t, 0.0, 1.0)
  return float(np.sum(np.diff(f) * (t[1:] + t[:-1]) / 2.0))


_EPS_DELTA = {"epsilon": validation.Interval(float, 0, None, "left", allow_inf=True),
              "delta": validation.Interval(float, 0, 1)}


# ---- attacks -----------------------------------------------------------------------------

def _features(data, split, idx):
  """[m, d] LR features of the records `idx` of `split`: loss, and sorted log-probs."""
  cols = [data.loss(split)[idx, None]]
  lp = data.log_probs(split)
  if lp is not None:
    cols.append(-np.sort(-lp[idx], axis=1))
  return np.concatenate(cols, axis=1)


def _fit_logistic(x, y, l2=1e-2, max_iter=100, tol=1e-10):
  """Weights float64 [d + 1] (intercept last) of an L2-penalised logistic regression on x
  [n, d], y [n] in {0, 1}: the minimiser of mean(log(1 + e^z) - y z) + l2/2 |w[:-1]|^2 with
  z = x w[:-1] + w[-1], by at most max_iter Newton steps halved until the objective
  decreases, until no weight moves by more than tol. The products are einsums: no
  multithreaded BLAS call, which on a loaded machine costs more than this small arithmetic."""
  xb = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
  n, d = xb.shape
  # the intercept gets a negligible ridge so that a fold of one class stays solvable
  reg = np.full(d, l2)
  reg[-1] = 1e-10

  def objective(w):
    z = np.einsum("ij,j->i", xb, w)
    return np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * np.dot(reg * w, w), z

  w = np.zeros(d)
  f, z = objective(w)
  for _ in range(max_iter):
    p = special.expit(z)
    g = np.einsum("ij,i->j", xb, p - y) / n + reg * w
    h = np.einsum("ij,i,ik->jk", xb, p * (1.0 - p), xb) / n + np.diag(reg)
    step = np.linalg.solve(h, g)
    t = 1.0
    while True:
      f_new, z_new = objective(w - t * step)
      if f_new <= f or t < 1e-8:
        break
      t *= 0.5
    w, f, z = w - t * step, f_new, z_new
    if np.max(np.abs(t * step)) < tol:
      break
  return w


def _lr_scores(x_in, x_out, seed):
  """Out-of-fold LR scores of members and non-members (2-fold cross-fitting)."""
  x = np.concatenate([x_in, x_out])
  y = np.r_[np.ones(len(x_in)), np.zeros(len(x_out))]
  mu, sd = x.mean(axis=0), x.std(axis=0)
  x = (x - mu) / np.where(sd > 0, sd, 1.0)
  fold = np.random.default_rng(seed).permutation(len(x)) % 2
  scores = np.empty(len(x))
  for k in (0, 1):
    w = _fit_logistic(x[fold != k], y[fold != k])
    scores[fold == k] = np.einsum("ij,j->i", x[fold == k], w[:-1]) + w[-1]
  return scores[:len(x_in)], scores[len(x_in):]


def _attack(data, attack_type, spec, idx_in, idx_out, seed, with_indices):
  """`SingleAttackResult` of one attack on the slice (members idx_in, non-members idx_out)."""
  if attack_type == AttackType.THRESHOLD_ATTACK:
    s_in, s_out = -data.loss("train")[idx_in], -data.loss("test")[idx_out]
  elif attack_type == AttackType.LOGISTIC_REGRESSION:
    s_in, s_out = _lr_scores(_features(data, "train", idx_in), _features(data, "test", idx_out),
                             seed)
  else:
    raise ParameterValueError(validation.message(
        "attack_types", "a sequence of AttackType members", attack_type))
  fpr, tpr = attacks.roc_curve(s_in, s_out)
  return SingleAttackResult(
      spec, attack_type, RocCurve(fpr, tpr, len(s_out) / len(s_in)), attacks.auc(s_in, s_out),
      float(np.max(tpr - fpr)), int(len(s_in)), int(len(s_out)),
      membership_scores_train=s_in, membership_scores_test=s_out,
      train_indices=idx_in if with_indices else None,
      test_indices=idx_out if with_indices else None)


def _filled_metadata(metadata, data):
  """`metadata` (or a default one) with its missing accuracies and mean losses computed."""
  meta = PrivacyReportMetadata() if metadata is None else metadata
  filled = {}
  for split in ("train", "test"):
    lp, y = data.log_probs(split), data.labels(split)
    if getattr(meta, f"accuracy_{split}") is None and lp is not None and y is not None:
      filled[f"accuracy_{split}"] = float(np.mean(lp.argmax(axis=1) == y))
    if getattr(meta, f"loss_{split}") is None:
      filled[f"loss_{split}"] = float(np.mean(data.loss(split)))
  return dataclasses.replace(meta, **filled)


def _slices(data, slicing_spec):
  """[(SingleSliceSpec, train indices, test indices)] of the slicing spec."""
  n_in, n_out = data.loss("train").size, data.loss("test").size
  out = []
  if slicing_spec.entire_dataset:
    out.append((SingleSliceSpec(), np.arange(n_in), np.arange(n_out)))
  y_in, y_out = data.labels("train"), data.labels("test")
  if slicing_spec.by_class:
    if y_in is None or y_out is None:
      raise ParameterValueError("SlicingSpec(by_class=True) needs labels_train and labels_test")
    for c in np.unique(np.r_[y_in, y_out]):
      out.append((SingleSliceSpec("class", int(c)), np.flatnonzero(y_in == c),
                  np.flatnonzero(y_out == c)))
  if slicing_spec.by_classification_correctness:
    lp_in, lp_out = data.log_probs("train"), data.log_probs("test")
    if lp_in is None or lp_out is None or y_in is None or y_out is None:
      raise ParameterValueError("SlicingSpec(by_classification_correctness=True) needs logits (or "
                                "probs) and labels for train and test")
    ok_in, ok_out = lp_in.argmax(axis=1) == y_in, lp_out.argmax(axis=1) == y_out
    for v in (True, False):
      out.append((SingleSliceSpec("correctly_classified", v), np.flatnonzero(ok_in == v),
                  np.flatnonzero(ok_out == v)))
  return out


def run_attacks(attack_input, slicing_spec=None, attack_types=(AttackType.THRESHOLD_ATTACK,),
                privacy_report_metadata=None, *, return_slice_indices=False, epsilon=None,
                delta=0.0, min_num_samples=1, seed=0):
  """Runs membership-inference attacks on every slice (TF Privacy's `run_attacks`).

  Args:
    attack_input: an `AttackInputData`.
    slicing_spec: a `SlicingSpec` (default: the entire dataset only).
    attack_types: `AttackType` members.
    privacy_report_metadata: a `PrivacyReportMetadata` of the model or None; the results
      carry it with the accuracies and mean losses it lacks computed from `attack_input`.
    return_slice_indices: whether each result of a slice other than the entire dataset
      carries `train_indices` / `test_indices`, the rows of `attack_input` in the slice.
    epsilon: the training run's epsilon (nats, e.g. `model.ledger`'s epsilon at `delta`);
      with it, the results carry the `PrivacyBound` to compare with.
    delta: the delta of that guarantee, in [0, 1].
    min_num_samples: slices with fewer train or test records are skipped.
    seed: of the logistic-regression attack's fold split.

  Returns:
    `AttackResults`: per attack and slice the ROC curve, AUC, attacker advantage and the
    per-example membership scores (`membership_scores_train` / `membership_scores_test`).

  Raises:
    ParameterTypeError: `privacy_report_metadata` is not a `PrivacyReportMetadata`.
    ParameterValueError: incomplete or mismatched inputs or a bad attack type.
    PrivacyConfigError: a bad epsilon or delta.
  """
  attack_input.validate()
  if privacy_report_metadata is not None:
    validation.check_instance("privacy_report_metadata", privacy_report_metadata,
                              PrivacyReportMetadata, "a PrivacyReportMetadata or None")
  spec = SlicingSpec() if slicing_spec is None else slicing_spec
  results = []
  for slice_spec, idx_in, idx_out in _slices(attack_input, spec):
    if min(len(idx_in), len(idx_out)) < max(1, min_num_samples):
      continue
    with_indices = bool(return_slice_indices) and not slice_spec.entire_dataset
    for attack_type in attack_types:
      results.append(_attack(attack_input, attack_type, slice_spec, idx_in, idx_out, seed,
                             with_indices))
  bound = None
  if epsilon is not None:
    bound = PrivacyBound(float(epsilon), float(delta), max_advantage(epsilon, delta),
                         max_auc(epsilon, delta))
  return AttackResults(tuple(results), bound,
                       _filled_metadata(privacy_report_metadata, attack_input))
