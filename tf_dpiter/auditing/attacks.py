"""Black-box membership inference: loss attack and LiRA, ROC metrics (higher score = member).

* Loss attack (Yeom et al. 2018): score = -cross-entropy(y, model(x)).
* LiRA (Carlini et al., "Membership Inference Attacks From First Principles", Sections
  IV-V): N shadow models on random halves; per example, phi = log p_y - log(1 - p_y) is fit
  by N(mu_in, sigma_in^2) over models holding it and N(mu_out, sigma_out^2) over the others.
  Online: log N(phi; mu_in, sigma_in^2) - log N(phi; mu_out, sigma_out^2); offline:
  (phi - mu_out) / sigma_out. `lira_leave_one_out` takes each model in turn as the target.

`attack_metrics`: AUC (Mann-Whitney, ties 1/2), TPR at FPR 0.1 % / 1 %, per-class AUC and the
one-run epsilon lower bound (valid: membership an independent fair coin, scores from the
target and independent shadows only).
"""

import dataclasses
from typing import Dict, Optional

import numpy as np
from scipy import special

from tf_dpiter import validation
from tf_dpiter.auditing import one_run
from tf_dpiter.errors import ParameterValueError


# ---- scores ------------------------------------------------------------------------------

def _log_probs(outputs, from_logits, name="outputs"):
  out = np.asarray(outputs, np.float64)
  if out.ndim != 2:
    raise ParameterValueError(f"{name} must be [n, K] logits or probabilities, got shape {out.shape}")
  if from_logits:
    return out - special.logsumexp(out, axis=1, keepdims=True)
  return np.log(np.clip(out, 1e-300, 1.0))


def _labels(labels, n, k, name="labels"):
  y = np.asarray(labels).reshape(-1).astype(np.int64)
  if y.size != n or np.any(y < 0) or np.any(y >= k):
    raise ParameterValueError(f"{name} must be {n} integers in [0, {k}), got shape {y.shape}, "
                              f"range [{y.min() if y.size else None}, {y.max() if y.size else None}]")
  return y


def loss_scores(outputs, labels, from_logits=True):
  """Loss-attack scores -CE(y, p) (nats), [n].

  Args:
    outputs: [n, K] logits (from_logits) or probabilities.
    labels: [n] ints in [0, K).
    from_logits: whether `outputs` are logits.

  Returns:
    float64 [n].

  Raises:
    ParameterValueError: bad shapes or labels.
  """
  lp = _log_probs(outputs, from_logits)
  y = _labels(labels, lp.shape[0], lp.shape[1])
  return lp[np.arange(y.size), y]


def logit_confidence(outputs, labels, from_logits=True):
  """LiRA's statistic φ = log p_y - log(1 - p_y), computed stably (Carlini et al. 2022).

  Args:
    outputs: model outputs [n, K] (logits, or probabilities with from_logits=False).
    labels: integer labels [n] in [0, K).
    from_logits: whether `outputs` are logits.

  Returns:
    float64 [n] (nats; Gaussian-looking over training runs).

  Raises:
    ParameterValueError: labels of the wrong shape or out of range.
  """
  lp = _log_probs(outputs, from_logits)
  y = _labels(labels, lp.shape[0], lp.shape[1])
  others = lp.copy()
  others[np.arange(y.size), y] = -np.inf
  return lp[np.arange(y.size), y] - special.logsumexp(others, axis=1)


def lira_scores(target_phi, shadow_phi, shadow_in, online=True, min_std=1e-3,
                fix_variance=False):
  """LiRA scores of the target model's examples from shadow models.

  Args:
    target_phi: [n] φ of the target model.
    shadow_phi: [N, n] φ of the shadow models.
    shadow_in: [N, n] bool, example j in shadow i's training set.
    online: use in- and out-Gaussians (True) or the out-Gaussian only (False).
    min_std: floor on the fitted standard deviations.
    fix_variance: one global standard deviation per class (in / out) instead of one per
      example; better with few shadow models (Carlini et al. 2022, Sec. VI-A).

  Returns:
    float64 [n] scores (higher = member). Examples lacking in- or out-shadows get the
    global in/out statistics.

  Raises:
    ParameterValueError: shapes disagree.
  """
  t = np.asarray(target_phi, np.float64).reshape(-1)
  s = np.asarray(shadow_phi, np.float64)
  inn = np.asarray(shadow_in, bool)
  if s.ndim != 2 or s.shape != inn.shape or s.shape[1] != t.size:
    raise ParameterValueError(f"need target_phi [n], shadow_phi and shadow_in [N, n]; got {t.shape}, "
                              f"{s.shape}, {inn.shape}")

  def fit(mask):
    cnt = mask.sum(0)
    g_mu = s[mask].mean() if mask.any() else 0.0
    g_sd = s[mask].std() if mask.sum() > 1 else 1.0
    mu = np.where(cnt > 0, (s * mask).sum(0) / np.maximum(cnt, 1), g_mu)
    var = (((s - mu) ** 2) * mask).sum(0) / np.maximum(cnt - 1, 1)
    sd = np.where(cnt > 1, np.sqrt(var), g_sd)
    if fix_variance:
      sd = np.full_like(sd, np.sqrt(np.sum(((s - mu) ** 2) * mask) / max(mask.sum() - 1, 1)))
    return mu, np.maximum(sd, min_std)

  mu_out, sd_out = fit(~inn)
  if not online:
    return (t - mu_out) / sd_out
  mu_in, sd_in = fit(inn)

  def logpdf(v, mu, sd):
    return -0.5 * ((v - mu) / sd) ** 2 - np.log(sd)

  return logpdf(t, mu_in, sd_in) - logpdf(t, mu_out, sd_out)


def lira_leave_one_out(phi, in_masks, online=True, fix_variance=False):
  """Each model as target, the others as shadows: LiRA scores [N, n].

  Args:
    phi: [N, n] φ of all models.
    in_masks: [N, n] bool memberships.
    online: as in lira_scores.
    fix_variance: as in lira_scores.

  Returns:
    float64 [N, n].

  Raises:
    ParameterValueError: N < 2, or phi and in_masks not both [N, n].
  """
  phi = np.asarray(phi, np.float64)
  masks = np.asarray(in_masks, bool)
  if phi.ndim != 2 or phi.shape != masks.shape or phi.shape[0] < 2:
    raise ParameterValueError(f"phi and in_masks must both be [N >= 2, n], got {phi.shape}, {masks.shape}")
  out = np.empty_like(phi)
  for i in range(phi.shape[0]):
    rest = np.arange(phi.shape[0]) != i
    out[i] = lira_scores(phi[i], phi[rest], masks[rest], online, fix_variance=fix_variance)
  return out


# ---- ROC ---------------------------------------------------------------------------------

def roc_curve(member_scores, nonmember_scores):
  """(fpr, tpr) of the rule "score >= t" over all thresholds t, from (0, 0) to (1, 1).

  Args:
    member_scores: [n1] scores of the members (non-empty).
    nonmember_scores: [n0] scores of the non-members (non-empty).

  Returns:
    two float64 arrays of equal length.

  Raises:
    ParameterValueError: empty scores.
  """
  pos = np.asarray(member_scores, np.float64).reshape(-1)
  neg = np.asarray(nonmember_scores, np.float64).reshape(-1)
  if pos.size == 0 or neg.size == 0:
    raise ParameterValueError(f"need members and non-members, got {pos.size} and {neg.size} scores")
  values = np.concatenate([pos, neg])
  lab = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])
  order = np.argsort(-values, kind="stable")
  values, lab = values[order], lab[order]
  last = np.r_[np.diff(values) != 0, True]          # end of each tie group
  tp = np.cumsum(lab)[last]
  fp = np.cumsum(1 - lab)[last]
  return np.r_[0.0, fp / neg.size], np.r_[0.0, tp / pos.size]


def auc(member_scores, nonmember_scores):
  """Area under the ROC curve = P[member score > non-member score] + ½ P[tie].

  Args:
    member_scores: 1-D array of the members' finite scores (higher = member).
    nonmember_scores: 1-D array of the non-members' finite scores.

  Returns:
    the AUC, a float in [0, 1].

  Raises:
    ParameterValueError: an empty or non-finite score array.
  """
  fpr, tpr = roc_curve(member_scores, nonmember_scores)
  return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def tpr_at_fpr(member_scores, nonmember_scores, fpr):
  """Largest true-positive rate among thresholds whose false-positive rate is <= fpr.

  Args:
    member_scores: 1-D array of the members' finite scores (higher = member).
    nonmember_scores: 1-D array of the non-members' finite scores.
    fpr: the false-positive budget, in [0, 1].

  Returns:
    the TPR, a float in [0, 1].

  Raises:
    ParameterValueError: fpr outside [0, 1], or an empty or non-finite score array.
  """
  validation.check_params({"fpr": validation.Interval(float, 0, 1, error=ParameterValueError)},
                          {"fpr": fpr})
  f, t = roc_curve(member_scores, nonmember_scores)
  return float(t[f <= fpr].max())


@dataclasses.dataclass
class AttackMetrics:
  """auc, tpr_at_0.1%, tpr_at_1%, advantage (max TPR - FPR), auc_by_class {label: auc},
  epsilon_lower_bound (one-run bound, or None when membership was not a fair coin)."""
  auc: float
  tpr_at_0_1pct: float
  tpr_at_1pct: float
  advantage: float
  auc_by_class: Dict[int, float]
  epsilon_lower_bound: Optional[float]


def attack_metrics(scores, is_member, labels=None, delta=1e-5, confidence=0.95,
                   fair_coin_membership=True):
  """Metrics of one attack on one target model.

  Args:
    scores: [n] scores (higher = member).
    is_member: [n] bools.
    labels: optional [n] class labels for the per-class slices.
    delta: the delta of the one-run bound.
    confidence: the confidence of the one-run bound.
    fair_coin_membership: True if each example was a member by an independent fair coin
      drawn before training (then the one-run bound is sound and computed).

  Returns:
    AttackMetrics.

  Raises:
    ParameterValueError: is_member does not have the shape of scores.
  """
  s = np.asarray(scores, np.float64).reshape(-1)
  mem = np.asarray(is_member, bool).reshape(-1)
  if mem.shape != s.shape:
    raise ParameterValueError(f"is_member must have the shape of scores {s.shape}, got {mem.shape}")
  fpr, tpr = roc_curve(s[mem], s[~mem])
  by_class = {}
  if labels is not None:
    lab = np.asarray(labels).reshape(-1)
    for c in np.unique(lab):
      sel = lab == c
      if mem[sel].any() and (~mem[sel]).any():
        by_class[int(c)] = auc(s[sel & mem], s[sel & ~mem])
  eps = one_run.one_run_epsilon_lower_bound(s, mem, delta, confidence) if (
      fair_coin_membership) else None
  return AttackMetrics(auc(s[mem], s[~mem]), tpr_at_fpr(s[mem], s[~mem], 1e-3),
                       tpr_at_fpr(s[mem], s[~mem], 1e-2), float(np.max(tpr - fpr)), by_class, eps)


def shadow_confidences(train_and_predict, x, y, num_models, seed=0, from_logits=True):
  """Trains `num_models` models on fair-coin halves of (x, y); returns their φ on all of x.

  Args:
    train_and_predict: callable(x_train, y_train) -> outputs [n, K] on the full x (logits if
      from_logits, else probabilities); called once per model.
    x: the features, an array with n examples.
    y: their integer labels [n].
    num_models: N >= 2.
    seed: seeds the memberships (audit design).
    from_logits: how to read the outputs.

  Returns:
    (phi [N, n] logit-scaled confidences, in_masks [N, n] bool memberships).

  Raises:
    ParameterValueError: num_models < 2.
  """
  validation.check_integer("num_models", num_models, 2)
  n = len(y)
  masks = np.random.default_rng(seed).random((num_models, n)) < 0.5
  phi = np.stack([logit_confidence(train_and_predict(x[m], y[m]), y, from_logits)
                  for m in masks])
  return phi, masks
