"""Accounting: published figures, Eq. (1) against an independent computation, policies,
speed with counts, calibration, bad input."""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import accounting as A
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.ledger import ledger_file

# Nightly tier (-m slow): the eq. 1 grid but three cases, [2.0-0.01-2], [2.0-0.2-1] and
# [0.7-1.0-5], which by default meet every level of {scale} x {q} x {groups} once (q = 1, no
# sampling, and one group among them); the rest of the pairwise cover runs with -m slow.
SLOW_CASES = {
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.01-1]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.01-5]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.2-2]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-0.2-5]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-1.0-1]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-1.0-2]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-0.01-1]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.01-2]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-0.01-5]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.2-1]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-0.2-2]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-0.2-5]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-1.0-1]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[0.7-1.0-2]",
    "test_eq1_multi_group_ledger_equals_single_gaussian[2.0-1.0-5]"}


@pytest.mark.parametrize("n,b,z,epochs,acc,expected,tol", [
    (60000, 256, 1.1, 60, "rdp", 2.597, 1e-3),
    (60000, 256, 1.1, 60, "pld", 2.38, 5e-3),
    (60000, 150, 1.3, 15, "rdp", 0.7242, 1e-4),
])
def test_published_dp_sgd_epsilons(n, b, z, epochs, acc, expected, tol):
  r = A.compute_dp_sgd_privacy(n, b, z, epochs, 1e-5, accountant=acc)
  assert r.epsilon == pytest.approx(expected, abs=tol)
  assert r.steps == math.ceil(epochs * n / b)
  assert "Poisson" in r.statement and f"{r.epsilon:.4g}" in r.statement


def direct_epsilon(q, z, steps, delta, acc="rdp"):
  """Independent computation: dp-accounting called by hand."""
  a = dpa.rdp.RdpAccountant() if acc == "rdp" else dpa.pld.PLDAccountant()
  ev = dpa.GaussianDpEvent(z)
  a.compose(dpa.PoissonSampledDpEvent(q, ev) if q < 1 else ev, steps)
  return a.get_epsilon(delta)


@pytest.mark.parametrize("num_groups", [1, 2, 5])
@pytest.mark.parametrize("q", [0.01, 0.2, 1.0])
@pytest.mark.parametrize("scale", [0.7, 2.0])
def test_eq1_multi_group_ledger_equals_single_gaussian(num_groups, q, scale):
  rng = np.random.default_rng(num_groups * 100 + int(q * 100))
  clips = rng.uniform(0.1, 5.0, num_groups)
  stds = clips * rng.uniform(0.5, 3.0, num_groups) * scale
  z = float(np.sum((clips / stds) ** 2) ** -0.5)  # Eq. (1), computed here independently
  led = L.PrivacyLedger()
  for _ in range(50):
    led.record_sample(1000.0, q, tuple(dq.GaussianSumEvent(c, s) for c, s in zip(clips, stds)),
                      policy="poisson" if q < 1 else "full")
  assert A.epsilon(led, 1e-5) == pytest.approx(direct_epsilon(q, z, 50, 1e-5), rel=1e-9)


def test_proportional_allocation_ledger_equals_target_z():
  clips = dq.per_layer_clips(1.0, 4)
  stds = dq.proportional_noise(1.1, clips)
  led = L.PrivacyLedger()
  for _ in range(100):
    led.record_sample(60000.0, 0.01, tuple(dq.GaussianSumEvent(c, s) for c, s in zip(clips, stds)))
  assert A.epsilon(led, 1e-5) == pytest.approx(direct_epsilon(0.01, 1.1, 100, 1e-5), rel=1e-9)


def million_sample_ledger_dict():
  return ledger_file.runs_to_dict(
      [(10**6, [1e7, 1e-4, 0.0, 0, 1, 1], [[0, 0, 1.0, 1.0, 1.0]])])  # Poisson, clip 1, sigma 1


def test_million_identical_samples_are_one_composed_event():
  """Counts stay counts: 10^6 identical samples become one SelfComposedDpEvent of count 10^6
  (the time this takes is measured in benchmarks/core_accounting.py, not asserted here)."""
  d = million_sample_ledger_dict()
  led = L.PrivacyLedger.from_dict(d)
  assert int(led.sample_count) == 10**6
  event = A.ledger_to_dp_event(led)
  assert isinstance(event, dpa.SelfComposedDpEvent) and event.count == 10**6
  eps = A.epsilon(led, 1e-6)
  assert eps == pytest.approx(direct_epsilon(1e-4, 1.0, 10**6, 1e-6), rel=1e-9)
  assert A.epsilon(json.dumps(d), 1e-6) == pytest.approx(eps, rel=1e-12)


def test_delta_inverts_epsilon():
  led = L.PrivacyLedger()
  for _ in range(200):
    led.record_sample(1000.0, 0.05, (dq.GaussianSumEvent(1.0, 1.0),))
  for acc in A.ACCOUNTANTS:
    eps = A.epsilon(led, 1e-5, accountant=acc)
    assert A.delta(led, eps, accountant=acc) == pytest.approx(1e-5, rel=0.05)
    assert A.delta(led, eps * 1.2, accountant=acc) < 1e-5


def test_shuffled_epochs_claim_no_amplification():
  r = A.compute_dp_sgd_privacy(60000, 256, 1.1, 10, 1e-5, sampling="shuffle")
  # 10 passes, each one un-amplified Gaussian; replace-one: sensitivity 2C, z = 1.1 / 2.
  a = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  a.compose(dpa.GaussianDpEvent(0.55), 10)
  assert r.epsilon == pytest.approx(a.get_epsilon(1e-5), rel=1e-9)
  assert any("NO amplification" in a for a in r.assumptions)


def test_fixed_size_sampling_uses_replace_one():
  led = L.PrivacyLedger()
  for _ in range(100):
    led.record_sample(1000.0, 0.05, (dq.GaussianSumEvent(1.0, 1.2),), policy="fixed_size",
                      sample_size=50)
  a = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  # dp-accounting's noise multiplier is sigma over the replace-one sensitivity 2S = 2.0
  a.compose(dpa.SampledWithoutReplacementDpEvent(1000, 50, dpa.GaussianDpEvent(0.6)), 100)
  rep = A.privacy_report(led, delta=1e-5)
  assert rep.epsilon == pytest.approx(a.get_epsilon(1e-5), rel=1e-9)
  assert "replace one" in rep.assumptions[0]
  with pytest.raises(ValueError, match="rdp"):
    A.epsilon(led, 1e-5, accountant="pld")


def test_laplace_and_non_private_events():
  led = L.PrivacyLedger()
  led.record_sample(100.0, 1.0, (dq.LaplaceSumEvent(1.0, 2.0),), policy="full")
  eps = A.epsilon(led, 1e-9, accountant="pld")
  assert 0.3 < eps <= 0.5 + 1e-3  # pure epsilon C/b = 0.5 bounds it
  led.record_sample(100.0, 0.5, (dq.NonPrivateEvent(),))
  rep = A.privacy_report(led, delta=1e-5)
  assert rep.epsilon == math.inf and any("non-private" in a for a in rep.assumptions)
  zero_noise = L.PrivacyLedger()
  zero_noise.record_sample(100.0, 0.5, (dq.GaussianSumEvent(1.0, 0.0),))
  assert A.epsilon(zero_noise, 1e-5) == math.inf


def test_calibration_is_on_the_safe_side():
  q, steps, target = 256 / 60000, 14063, 2.0
  z = A.calibrate_noise_multiplier(target, 1e-5, q, steps)
  assert direct_epsilon(q, z, steps, 1e-5) <= target
  assert direct_epsilon(q, z * (1 - 2e-4), steps, 1e-5) > target
  qq = A.calibrate_sampling_probability(target, 1e-5, 1.1, steps)
  assert direct_epsilon(qq, 1.1, steps, 1e-5) <= target < direct_epsilon(qq * 1.001, 1.1, steps, 1e-5)
  t = A.calibrate_steps(target, 1e-5, 1.1, q)
  assert direct_epsilon(q, 1.1, t, 1e-5) <= target < direct_epsilon(q, 1.1, t + 1, 1e-5)
  z2 = A.compute_noise_from_budget(60000, 256, 2.597, 60, 1e-5)
  assert z2 == pytest.approx(1.1, rel=1e-3)


@pytest.mark.parametrize("call,match", [
    (lambda: A.compute_dp_sgd_privacy(60000, 256, -1.0, 60, 1e-5), "noise_multiplier"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, float("nan"), 60, 1e-5), "noise_multiplier"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 0.0), "delta"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1.5), "delta"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, float("nan")), "delta"),
    (lambda: A.compute_dp_sgd_privacy(100, 256, 1.1, 60, 1e-5), "batch_size"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5, accountant="moments"), "accountant"),
    (lambda: A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5, sampling="sometimes"), "sampling"),
    (lambda: A.epsilon(L.PrivacyLedger(), 1e-5), "empty"),
    (lambda: A.epsilon("{not json", 1e-5), "JSON"),
    (lambda: A.calibrate_noise_multiplier(1.0, 1e-5, 1.5, 100), "sampling_probability"),
    (lambda: A.calibrate_noise_multiplier(-1.0, 1e-5, 0.1, 100), "target_epsilon"),
])
def test_bad_input_names_the_parameter(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def _gdp_epsilon_by_hand(mu, delta):
  """mu-GDP -> epsilon at delta (Dong, Roth & Su 2019, Cor. 2.13), scipy root finding."""
  from scipy import optimize, stats  # pylint: disable=g-import-not-at-top
  f = lambda e: (stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)
                 - delta)
  return optimize.brentq(f, 0.0, 100.0, xtol=1e-12)


@pytest.mark.parametrize("n,b,z,epochs", [(60000, 256, 1.1, 60), (800167, 10000, 1.0, 5)])
def test_gdp_accountant_matches_the_clt_formula_by_hand(n, b, z, epochs):
  """TF Privacy's GDP accountant (MovieLens tutorial): mu = q sqrt(T (e^(1/z^2) - 1))."""
  steps = math.ceil(epochs * n / b)
  mu = (b / n) * math.sqrt(steps * (math.exp(1 / z ** 2) - 1))
  r = A.compute_dp_sgd_privacy(n, b, z, epochs, 1e-5, accountant="gdp")
  assert r.epsilon == pytest.approx(_gdp_epsilon_by_hand(mu, 1e-5), rel=1e-7)
  assert "APPROXIMATION, not an upper bound" in r.statement
  led = L.PrivacyLedger()
  led.record_sample(float(n), b / n, (dq.GaussianSumEvent(1.0, z),))
  report = A.privacy_report(led, epsilon=1.0, accountant="gdp")
  mu1 = (b / n) * math.sqrt(math.exp(1 / z ** 2) - 1)
  from scipy import stats  # pylint: disable=g-import-not-at-top
  expected = stats.norm.cdf(-1 / mu1 + mu1 / 2) - math.e * stats.norm.cdf(-1 / mu1 - mu1 / 2)
  assert report.delta == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_gdp_full_batch_is_exact_composition_and_other_policies_are_refused():
  # full batch: T Gaussian mechanisms of multiplier z are exactly sqrt(T)/z-GDP
  groups = A.dp_sgd.dp_sgd_groups(1000, 1000, 2.0, 16, sampling="full")
  eps = A.report_from_groups(groups, delta=1e-5, accountant="gdp").epsilon
  assert eps == pytest.approx(_gdp_epsilon_by_hand(math.sqrt(16) / 2.0, 1e-5), rel=1e-7)
  for sampling in ("shuffle", "fixed_size"):
    with pytest.raises(ValueError, match=f"accountant='gdp' accounts Poisson-sampled .* "
                       f"policy '{sampling}'"):
      A.compute_dp_sgd_privacy(1000, 100, 1.0, 2, 1e-5, accountant="gdp", sampling=sampling)


def test_prv_accountant_is_refused_with_a_clear_error():
  with pytest.raises(ValueError, match="accountant='prv' is not available: .*Use accountant='pld'"):
    A.compute_dp_sgd_privacy(60000, 256, 1.1, 1, 1e-5, accountant="prv")


def test_compute_dp_sgd_privacy_unpacks_as_tf_privacy():
  eps, opt_order = A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(256 / 60000, dpa.GaussianDpEvent(1.1)), math.ceil(60 * 60000 / 256)))
  ref_eps, ref_order = acc.get_epsilon_and_optimal_order(1e-5)
  assert (eps, opt_order) == (pytest.approx(ref_eps, rel=1e-12), ref_order)
  r = A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
  assert r.epsilon == eps and r.steps == 14063 and "add or remove one example" in str(r)
  assert A.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5, accountant="pld").opt_order is None


def test_privacy_statement_names_relation_unit_and_both_samplings():
  text = A.compute_dp_sgd_privacy_statement(60000, 256, 3, 1.1, 1e-5, used_microbatching=False,
                                            max_examples_per_user=2)
  shuffled = A.compute_dp_sgd_privacy(60000, 256, 1.1, 3, 1e-5, sampling="shuffle").epsilon
  poisson = A.compute_dp_sgd_privacy(60000, 256, 1.1, 3, 1e-5).epsilon
  assert (f"once per epoch (replace-one adjacency, sensitivity 2C, no amplification): "
          f"{shuffled:.4g}") in text
  assert f"Poisson sampling (*) (add/remove-one adjacency, sensitivity C): {poisson:.4g}" in text
  assert "User-level DP (a user is up to 2 examples" in text
  user_poisson = float(text.split("User-level")[1].split("Poisson sampling (*): ")[1].split()[0])
  assert 2 * poisson < user_poisson   # group privacy costs more than twice epsilon
  with_mb = A.compute_dp_sgd_privacy_statement(60000, 256, 3, 1.1, 1e-5)
  assert "not given: with microbatches" in with_mb and "No user-level guarantee" in with_mb


def test_group_epsilon_meets_the_group_privacy_lemma():
  from tf_dpiter.accounting import statement  # pylint: disable=g-import-not-at-top
  acc = dpa.rdp.RdpAccountant()   # per-example epsilon(delta) by dp-accounting, by hand
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(256 / 60000, dpa.GaussianDpEvent(1.1)), math.ceil(3 * 60000 / 256)))
  eps_at = acc.get_epsilon
  k, delta = 3, 1e-5
  e = statement.group_epsilon(eps_at, k, delta)
  # some per-example delta d gives (e / k, d) with k e^((k-1) e/k) d <= delta
  d = delta / k * math.exp(-(k - 1) * e / k)
  assert eps_at(d) <= e / k * (1 + 1e-6)


def test_epsilon_curve_matches_prefixes_composed_by_hand():
  led = L.PrivacyLedger()
  for q, count in ((0.01, 6), (0.05, 4)):
    for _ in range(count):
      led.record_sample(1000.0, q, (dq.GaussianSumEvent(1.0, 1.0),))
  c = A.epsilon_curve(led, 1e-5, num_points=5)
  assert c.steps == (2, 4, 6, 8, 10)
  for k, eps in zip(c.steps, c.epsilon):
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)),
                                        min(k, 6)))
    if k > 6:
      acc.compose(dpa.SelfComposedDpEvent(
          dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.0)), k - 6))
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
  assert c.epsilon[-1] == A.epsilon(led, 1e-5)
  with pytest.raises(ValueError, match="ledger is empty"):
    A.epsilon_curve(L.PrivacyLedger(), 1e-5)


def test_epsilon_curve_charges_shuffled_passes_pro_rata():
  """8 shuffled steps of 25 of n = 100 (4 per pass), 2 passes recorded: the prefix of k steps
  is charged max(ceil(k / 4), ceil(2 k / 8)) passes, each one un-amplified Gaussian of
  z = 1.0 / 2 under replace-one (sensitivity 2C)."""
  led = L.PrivacyLedger()
  for _ in range(8):
    led.record_sample(100.0, 0.25, (dq.GaussianSumEvent(1.0, 1.0),), policy=L.SHUFFLE,
                      sample_size=25.0)
  led.record_passes(2)
  c = A.epsilon_curve(led, 1e-5, num_points=4)
  assert c.steps == (2, 4, 6, 8)
  for k, eps in zip(c.steps, c.epsilon):
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.GaussianDpEvent(0.5), 1 if k <= 4 else 2)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  assert c.epsilon[-1] == A.epsilon(led, 1e-5)
