"""TF Privacy-style membership inference (`dp.auditing.run_attacks`) on synthetic scores whose
AUC and advantage are known, each checked against a value computed here independently."""

import math

import numpy as np
import pytest
from scipy import stats

import tf_dpiter as dp
from tf_dpiter.auditing import membership_inference as mia


def _pairwise_auc(pos, neg):
  """P[pos > neg] + 1/2 P[tie], by counting all pairs."""
  pos, neg = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
  return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


def _brute_advantage(pos, neg):
  """max over thresholds t of P[pos >= t] - P[neg >= t] (and t = +inf: 0)."""
  ts = np.unique(np.r_[pos, neg])
  return max(0.0, max(np.mean(pos >= t) - np.mean(neg >= t) for t in ts))


def test_names_resolve_where_the_docs_say():
  assert dp.auditing.check_sensitivity is dp.auditing.sensitivity.check_sensitivity
  assert dp.auditing.run_attacks is mia.run_attacks
  assert dp.auditing.AttackInputData is mia.AttackInputData


def test_identical_loss_distributions_give_auc_one_half():
  rng = np.random.default_rng(0)
  data = mia.AttackInputData(loss_train=rng.exponential(size=20000),
                             loss_test=rng.exponential(size=20000))
  r = mia.run_attacks(data).single_attack_results[0]
  # AUC of two independent samples of one law: mean 1/2, sd sqrt((n1 + n0 + 1)/(12 n1 n0))
  assert abs(r.auc - 0.5) < 4 * math.sqrt(40001 / (12 * 20000 * 20000))
  # advantage ~ the two-sample Kolmogorov-Smirnov statistic (one-sided), small
  assert r.attacker_advantage < 0.03


def test_separated_losses_give_auc_one_and_advantage_one():
  data = mia.AttackInputData(loss_train=np.linspace(0.0, 1.0, 50),
                             loss_test=np.linspace(2.0, 3.0, 70))
  r = mia.run_attacks(data).single_attack_results[0]
  assert r.auc == 1.0 and r.attacker_advantage == 1.0 and (r.num_train, r.num_test) == (50, 70)


def test_gaussian_shift_matches_closed_form_and_pair_count():
  rng = np.random.default_rng(1)
  d = 1.0
  lin, lout = rng.normal(0.0, 1.0, 4000), rng.normal(d, 1.0, 4000)
  r = mia.run_attacks(mia.AttackInputData(loss_train=lin, loss_test=lout)).single_attack_results[0]
  assert r.auc == pytest.approx(_pairwise_auc(-lin, -lout), abs=1e-12)
  assert r.attacker_advantage == pytest.approx(_brute_advantage(-lin, -lout), abs=1e-12)
  # population values: AUC = Phi(d / sqrt 2), advantage = 2 Phi(d / 2) - 1
  assert r.auc == pytest.approx(stats.norm.cdf(d / math.sqrt(2)), abs=0.02)
  assert r.attacker_advantage == pytest.approx(2 * stats.norm.cdf(d / 2) - 1, abs=0.04)


def test_losses_from_logits_and_slices_by_class_and_correctness():
  rng = np.random.default_rng(2)
  k, n_in, n_out = 3, 300, 400
  y_in, y_out = rng.integers(0, k, n_in), rng.integers(0, k, n_out)
  z_in = rng.normal(size=(n_in, k)) + 2.0 * np.eye(k)[y_in]   # members: fitted better
  z_out = rng.normal(size=(n_out, k)) + 0.5 * np.eye(k)[y_out]
  data = mia.AttackInputData(logits_train=z_in, logits_test=z_out, labels_train=y_in,
                             labels_test=y_out)
  ce = lambda z, y: np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]
  l_in, l_out = ce(z_in, y_in), ce(z_out, y_out)
  res = mia.run_attacks(data, mia.SlicingSpec(entire_dataset=True, by_class=True,
                                              by_classification_correctness=True))
  got = {str(r.slice_spec): r for r in res.single_attack_results}
  assert got["Entire dataset"].auc == pytest.approx(_pairwise_auc(-l_in, -l_out), abs=1e-12)
  for c in range(k):
    r = got[f"class={c}"]
    assert (r.num_train, r.num_test) == (np.sum(y_in == c), np.sum(y_out == c))
    assert r.auc == pytest.approx(_pairwise_auc(-l_in[y_in == c], -l_out[y_out == c]),
                                  abs=1e-12)
  ok_in, ok_out = z_in.argmax(1) == y_in, z_out.argmax(1) == y_out
  for v, m_in, m_out in ((True, ok_in, ok_out), (False, ~ok_in, ~ok_out)):
    r = got[f"correctly_classified={v}"]
    assert r.attacker_advantage == pytest.approx(_brute_advantage(-l_in[m_in], -l_out[m_out]),
                                                 abs=1e-12)
  assert res.get_result_with_max_auc().auc == max(r.auc for r in res.single_attack_results)


def test_probabilities_give_the_same_results_as_logits():
  rng = np.random.default_rng(3)
  z_in, z_out = rng.normal(size=(50, 4)), rng.normal(size=(60, 4))
  y_in, y_out = rng.integers(0, 4, 50), rng.integers(0, 4, 60)
  soft = lambda z: np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  a = mia.run_attacks(mia.AttackInputData(logits_train=z_in, logits_test=z_out,
                                          labels_train=y_in, labels_test=y_out))
  b = mia.run_attacks(mia.AttackInputData(probs_train=soft(z_in), probs_test=soft(z_out),
                                          labels_train=y_in, labels_test=y_out))
  assert a.single_attack_results[0].auc == pytest.approx(b.single_attack_results[0].auc)


def test_logistic_regression_attack_separates_and_stays_near_chance():
  rng = np.random.default_rng(4)
  sep = mia.AttackInputData(loss_train=rng.normal(0, 0.3, 500), loss_test=rng.normal(3, 0.3, 500))
  same = mia.AttackInputData(loss_train=rng.normal(0, 1, 2000), loss_test=rng.normal(0, 1, 2000))
  lr = (mia.AttackType.LOGISTIC_REGRESSION,)
  assert mia.run_attacks(sep, attack_types=lr).single_attack_results[0].auc > 0.99
  assert abs(mia.run_attacks(same, attack_types=lr).single_attack_results[0].auc - 0.5) < 0.04


@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 3.0])
def test_bounds_at_delta_zero_have_closed_forms(eps):
  # delta = 0: advantage <= tanh(eps / 2), AUC <= e^eps / (1 + e^eps)
  assert mia.max_advantage(eps) == pytest.approx(math.tanh(eps / 2), abs=1e-12)
  assert mia.max_auc(eps) == pytest.approx(math.exp(eps) / (1 + math.exp(eps)), abs=1e-12)


@pytest.mark.parametrize("eps,delta", [(0.5, 0.01), (1.0, 1e-5), (2.0, 0.1)])
def test_bounds_with_delta_match_the_region_on_a_grid(eps, delta):
  f = np.linspace(0.0, 1.0, 400001)
  t = np.minimum.reduce([np.ones_like(f), math.exp(eps) * f + delta,
                         1 - math.exp(-eps) * (1 - delta - f)])
  t = np.clip(t, 0, 1)
  assert mia.max_auc(eps, delta) == pytest.approx(np.trapezoid(t, f), abs=1e-6)
  assert mia.max_advantage(eps, delta) == pytest.approx(np.max(t - f), abs=1e-5)


def test_results_carry_the_dp_bound_and_a_summary():
  rng = np.random.default_rng(5)
  data = mia.AttackInputData(loss_train=rng.normal(size=100), loss_test=rng.normal(size=100))
  res = mia.run_attacks(data, epsilon=1.0, delta=1e-5)
  assert res.privacy_bound.max_advantage == pytest.approx(mia.max_advantage(1.0, 1e-5))
  assert "(epsilon=1, delta=1e-05)-DP bound: AUC <= 0.7311" in res.summary()
  assert mia.run_attacks(data).privacy_bound is None


def test_incomplete_inputs_are_refused_with_the_field_named():
  with pytest.raises(ValueError, match="needs loss_train, or logits_train"):
    mia.run_attacks(mia.AttackInputData(loss_test=np.ones(3)))
  with pytest.raises(ValueError, match="labels_test must have 2 entries"):
    mia.run_attacks(mia.AttackInputData(loss_train=np.ones(3), loss_test=np.ones(2),
                                        labels_test=np.zeros(5, int)))
  with pytest.raises(ValueError, match=r"by_class=True\) needs labels"):
    mia.run_attacks(mia.AttackInputData(loss_train=np.ones(3), loss_test=np.ones(2)),
                    mia.SlicingSpec(by_class=True))
  with pytest.raises(ValueError, match=r"`epsilon` must be a number >= 0. Received: epsilon=-1"):
    mia.max_advantage(-1)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_the_gaussian_mechanism_attack_stays_inside_its_dp_bound(mu):
  """Scores N(mu, 1) against N(0, 1) are the optimal attack on a mu-GDP mechanism: its
  population AUC Phi(mu / sqrt 2) and advantage 2 Phi(mu / 2) - 1 must lie within the
  bounds at the (epsilon, delta) that mu-GDP implies (Dong, Roth & Su 2019, Cor. 2.13)."""
  for delta in (1e-5, 1e-2):
    eps = dp.auditing.gdp_epsilon(mu, delta)
    assert stats.norm.cdf(mu / math.sqrt(2)) <= mia.max_auc(eps, delta)
    assert 2 * stats.norm.cdf(mu / 2) - 1 <= mia.max_advantage(eps, delta) + 1e-12
