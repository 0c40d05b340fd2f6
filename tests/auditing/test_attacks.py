"""Membership attacks: ROC metrics, loss attack, LiRA with shadow models, the PNG report."""

import numpy as np
import pytest
from scipy import stats

import tf_dpiter.auditing as audit


@pytest.mark.parametrize("seed", [0, 1])
def test_auc_is_mann_whitney_with_ties(seed):
  rng = np.random.default_rng(seed)
  pos = rng.integers(0, 5, 300).astype(float)      # many ties
  neg = rng.integers(0, 4, 200).astype(float)
  u = stats.mannwhitneyu(pos, neg).statistic
  assert audit.auc(pos, neg) == pytest.approx(u / (300 * 200), abs=1e-12)


def test_roc_and_tpr_at_fpr_on_a_small_example():
  fpr, tpr = audit.roc_curve([3.0, 2.0, 0.5], [1.0, 0.0])
  np.testing.assert_allclose(fpr, [0, 0, 0, 0.5, 0.5, 1.0])
  np.testing.assert_allclose(tpr, [0, 1 / 3, 2 / 3, 2 / 3, 1, 1])
  assert audit.tpr_at_fpr([3.0, 2.0, 0.5], [1.0, 0.0], 0.0) == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="fpr"):
    audit.tpr_at_fpr([1.0], [0.0], 1.5)


def test_loss_scores_are_log_likelihoods():
  logits = np.array([[2.0, 0.0], [0.0, 0.0]])
  s = audit.loss_scores(logits, [0, 1])
  np.testing.assert_allclose(s, [-np.log1p(np.exp(-2.0)), np.log(0.5)])
  phi = audit.logit_confidence(logits, [0, 1])
  np.testing.assert_allclose(phi, [2.0, 0.0], atol=1e-12)
  with pytest.raises(ValueError, match="labels"):
    audit.loss_scores(logits, [0, 2])


def _synthetic_models(num_models=16, n=2000, shift=1.0, seed=0):
  # Example j has its own difficulty b_j; membership raises its confidence by `shift`.
  rng = np.random.default_rng(seed)
  b = rng.normal(0, 3, n)
  masks = rng.random((num_models, n)) < 0.5
  phi = b + shift * masks + rng.normal(0, 0.5, (num_models, n))
  return phi, masks


def test_lira_calibrates_per_example_difficulty():
  phi, masks = _synthetic_models()
  lira = audit.lira_leave_one_out(phi, masks)
  offline = audit.lira_leave_one_out(phi, masks, online=False)
  raw_auc = np.mean([audit.auc(phi[i][masks[i]], phi[i][~masks[i]]) for i in range(len(phi))])
  lira_auc = np.mean([audit.auc(lira[i][masks[i]], lira[i][~masks[i]]) for i in range(len(phi))])
  off_auc = np.mean([audit.auc(offline[i][masks[i]], offline[i][~masks[i]])
                     for i in range(len(phi))])
  # Exact AUC of the per-example optimal test: Φ(shift / (0.5 √2)) = Φ(1.414) = 0.921.
  assert raw_auc < 0.65
  assert lira_auc > 0.85 and off_auc > 0.8


def test_attack_metrics_slices_and_one_run_bound():
  phi, masks = _synthetic_models(shift=3.0)
  scores = audit.lira_leave_one_out(phi, masks)[0]
  labels = np.arange(phi.shape[1]) % 3
  m = audit.attack_metrics(scores, masks[0], labels, delta=1e-5)
  assert set(m.auc_by_class) == {0, 1, 2}
  assert all(a > 0.9 for a in m.auc_by_class.values())
  assert m.tpr_at_1pct >= m.tpr_at_0_1pct > 0.0
  assert 0.0 < m.epsilon_lower_bound
  assert 0.0 < m.advantage <= 1.0


def test_shadow_confidences_with_a_memorizing_model():
  rng = np.random.default_rng(4)
  x = rng.normal(size=(400, 5))
  y = rng.integers(0, 2, 400)

  def train_and_predict(xt, yt):   # memorizes its training set, guesses elsewhere
    out = np.zeros((len(x), 2))
    seen = {tuple(r): c for r, c in zip(np.round(xt, 6), yt)}
    for i, r in enumerate(np.round(x, 6)):
      if tuple(r) in seen:
        out[i, seen[tuple(r)]] = 4.0
    return out + rng.normal(0, 0.1, out.shape)

  phi, masks = audit.shadow_confidences(train_and_predict, x, y, num_models=6, seed=1)
  assert phi.shape == masks.shape == (6, 400)
  scores = audit.lira_leave_one_out(phi, masks)
  assert audit.auc(scores[0][masks[0]], scores[0][~masks[0]]) > 0.99


def test_privacy_report_png(tmp_path):
  hist = [{"epoch": e, "claimed_epsilon": 0.5 * e, "whitebox_epsilon_lb": 0.2 * e,
           "attack_auc": 0.5 + 0.01 * e, "attack_epsilon_lb": 0.0} for e in (1, 2, 3)]
  path = audit.plot_privacy_report(hist, str(tmp_path / "r.png"))
  assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
  assert path.endswith("r.png")
  with pytest.raises(ValueError, match="history"):
    audit.plot_privacy_report([], str(tmp_path / "x.png"))


def test_format_summary_prints_one_line_per_model():
  """`report.format_summary`, the table tutorials/audit_mnist.py prints: a header, then one
  line per model, numbers to 3 decimals, missing entries "-", infinity "inf"."""
  rows = {"non-private": {"claimed_epsilon": float("inf"), "lira_auc": 0.61234},
          "DP-SGD": {"claimed_epsilon": 1.5, "lira_epsilon_lb": 0.25}}
  lines = audit.report.format_summary(rows).split("\n")
  assert len(lines) == 3
  assert lines[0].startswith("model") and "LiRA AUC" in lines[0]
  assert lines[1].split()[:2] == ["non-private", "inf"] and "0.612" in lines[1]
  assert lines[2].split()[:3] == ["DP-SGD", "1.500", "0.250"] and lines[2].split()[3] == "-"
