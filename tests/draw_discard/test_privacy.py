"""Theorem 1, Lemmas 1-3 and the privacy statement (Pihur et al. 2018, Sections III-D1, IV)."""

import math

import numpy as np
import pytest

from tf_dpiter.draw_discard import privacy, simulate


@pytest.mark.parametrize("k", [2, 5, 20])
def test_lemma2_chain_matches_closed_form(k):
  assert privacy.discard_probability_chain(k) == pytest.approx(1 - 1 / k, abs=1e-12)


@pytest.mark.parametrize("k", [3, 10])
def test_lemma2_simulation_survival_share_is_one_over_k(k):
  # 4000 tracked updates; fixation indicators are dependent through shared genealogy, so use a
  # tolerance of 6 binomial SE: 6*sqrt(p(1-p)/4000) (0.045 for k=3, 0.028 for k=10).
  n = 4000
  share = simulate.survival_share(k, n, rng=np.random.default_rng(k))
  se = math.sqrt((1 / k) * (1 - 1 / k) / n)
  assert abs(share - 1 / k) < 6 * se


@pytest.mark.parametrize("k,init", [(4, "stabilized"), (10, "stabilized"), (10, "zero")])
def test_theorem1_variance_is_stable_at_k_over_2_sigma2(k, init):
  # 300 independent servers x 4 weights, 1e4 updates (the 1e5-update run is slow-marked below).
  # Tolerance: 5 standard errors of the replicate mean (SE from the 300 replicates).
  steps, var = simulate.variance_trajectory(k, 1.0, 10_000, replicates=300, checkpoints=5,
                                            init=init, rng=np.random.default_rng(k))
  mean = var.mean(axis=1)
  se = var.std(axis=1, ddof=1) / math.sqrt(var.shape[1])
  assert np.all(np.abs(mean - k / 2) < 5 * se), (mean, se)


@pytest.mark.slow
def test_theorem1_over_1e5_updates():
  k = 20
  steps, var = simulate.variance_trajectory(k, 0.7, 100_000, replicates=300, checkpoints=10,
                                            rng=np.random.default_rng(0))
  mean, se = var.mean(axis=1), var.std(axis=1, ddof=1) / math.sqrt(300)
  assert np.all(np.abs(mean - k / 2 * 0.49) < 5 * se)


def test_lemma1_worst_case_is_half_epsilon():
  eps, gamma = 1.3, 0.01
  b = np.linspace(-0.05, 0.05, 201)
  a = np.linspace(-1, 1, 21)
  b1, b2, aa, ap = np.meshgrid(b, [0.0], a, a, indexing="ij")
  loss = privacy.adversary_two_loss(b1, b2, aa, ap, gamma, eps)
  assert loss.max() == pytest.approx(eps / 2, rel=1e-9)
  assert privacy.adversary_two_loss(0.0, 0.0, 0.0, 1.0, gamma, eps) == pytest.approx(eps / 2)


@pytest.mark.parametrize("k", [1, 2, 20])
def test_lemma1_expected_loss(k):
  assert privacy.epsilon_adversary_two(2.0, k) == pytest.approx((k - 1) / k)


def test_lemma3_matches_paper_example():
  # At the paper's w = sqrt(2) gamma, delta_T = 1e-8 gives epsilon_T ~ 3 epsilon / sqrt(T)
  # (Section IV-D); the default is the mechanism's own sensitivity 2 gamma, sqrt(2) larger.
  paper = math.sqrt(2.0)
  e = privacy.epsilon_adversary_three(1.0, 10_000, 1e-8, w_over_gamma=paper)
  assert e * math.sqrt(10_000) == pytest.approx(2.98, abs=0.01)
  ex = privacy.epsilon_adversary_three(1.0, 10_000, 1e-8, w_over_gamma=paper, exact=True)
  assert ex > e and ex == pytest.approx(e, rel=0.05)
  assert privacy.epsilon_adversary_three(1.0, 10_000, 1e-8) == pytest.approx(e * math.sqrt(2))


def _gaussian_delta(eps, mu):
  """Exact delta(eps) of N(0, 1) against N(mu, 1) (Balle and Wang, "Improving the Gaussian
  mechanism for differential privacy", ICML 2018, Theorem 8), float64."""
  phi = lambda t: 0.5 * math.erfc(-t / math.sqrt(2.0))
  return phi(-eps / mu + mu / 2.0) - math.exp(eps) * phi(-eps / mu - mu / 2.0)


@pytest.mark.parametrize("eps,t", [(1.0, 1000), (0.5, 200), (2.0, 10_000)])
def test_adversary_three_holds_at_the_mechanisms_own_sensitivity(eps, t):
  # Replace one client: clipped coordinates +c and -c move an instance 2 gamma c apart
  # (calibration.sensitivity); under the statement's CLT model (T later Laplace(b) noises,
  # N(0, 2 T b^2)) the printed (epsilon_T, delta_T) must hold for that pair.
  gamma, delta_t = 0.1, 1e-8
  statement = privacy.privacy_statement(eps, 20, num_later_updates=t, delta_t=delta_t)
  b = privacy.laplace_scale(gamma, eps)
  mu = privacy.sensitivity(gamma) / math.sqrt(2.0 * t * b * b)
  assert _gaussian_delta(statement.adversary_three, mu) <= delta_t
  assert _gaussian_delta(statement.adversary_three_accounted, mu) <= delta_t * (1 + 1e-6)


def test_lemma3_exact_root_solves_the_quadratic():
  eps, t, d, w = 2.0, 50.0, 1e-6, 2.0
  e_t = privacy.epsilon_adversary_three(eps, t, d, exact=True)
  a = t * 4 / eps**2
  assert a * e_t**2 - w**2 * e_t - w**2 * math.log(1 / (2 * d)) == pytest.approx(0, abs=1e-9)


def test_gaussian_calibration_kenthapadi():
  s = privacy.gaussian_sigma(1.0, 1e-5, 2.0)
  assert s == pytest.approx(2.0 * math.sqrt(2 * (math.log(1 / 2e-5) + 1.0)))
  with pytest.raises(ValueError, match="delta"):
    privacy.gaussian_sigma(1.0, 0.7, 1.0)


def test_composition_adversary_one():
  assert privacy.epsilon_adversary_one_composed(0.5, 4) == 2.0
  pld = privacy.epsilon_adversary_one_composed(0.1, 400, delta=1e-6)
  assert pld < 40.0  # PLD composition beats basic composition for many small epsilons


def test_privacy_statement_prints_all_three(capsys):
  s = privacy.print_privacy_statement(math.log(32), 20, 1000)
  out = capsys.readouterr().out
  assert "adversary I " in out and "adversary II " in out and "adversary III" in out
  assert s.adversary_two_expected == pytest.approx(19 / 40 * math.log(32))
  assert s.discard_probability == pytest.approx(0.95)


@pytest.mark.parametrize("bad", [dict(epsilon=0.0), dict(epsilon=float("nan")), dict(k=0)])
def test_statement_rejects_bad_values(bad):
  kw = dict(epsilon=1.0, k=10)
  kw.update(bad)
  with pytest.raises(ValueError, match=next(iter(bad))):
    privacy.privacy_statement(**kw)


@pytest.mark.parametrize("t", [100, 10_000])
def test_lemma3_pld_accounting_is_tighter_than_kenthapadi(t):
  # [30]'s bound is sufficient, not tight: exact Gaussian accounting must not exceed it.
  bound = privacy.epsilon_adversary_three(1.0, t, 1e-8, exact=True)
  pld = privacy.epsilon_adversary_three_accounted(1.0, t, 1e-8)
  assert 0 < pld <= bound


def test_statement_names_its_unit_one_weight():
  """The guarantees are per weight (feature-level, Section VII); the statement said
  "epsilon = ... per update", read as the whole update's. It now names the unit and the
  composition over the p weights; the client step's noise is measured against the per-weight
  epsilon in test_client_noise_review."""
  text = str(privacy.privacy_statement(math.log(32), 20))
  assert "per weight per update" in text
  assert "unit: one client record's effect on ONE weight" in text and "p x" in text
