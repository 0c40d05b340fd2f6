"""A trial of a private selection: its noisy score in the ledger and its calibrated noise.

Relation: add or remove one example. The noisy count is the Gaussian mechanism of multiplier
z on a count (sensitivity 1); the selection is dp-accounting's RepeatAndSelectDpEvent over one
trial (Poisson-sampled DP-SGD then the count), computed here by hand with dp-accounting.
"""

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import tuning
from tf_dpiter.accounting import accountant
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger import records as rec


def _by_hand(z, q, steps, mean, shape, z_score, delta=1e-5):
  trial = dpa.ComposedDpEvent([
      dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps),
      dpa.GaussianDpEvent(z_score)])
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.dp_event.RepeatAndSelectDpEvent(trial, mean, shape))
  return acc.get_epsilon(delta)


def test_noisy_count_records_a_gaussian_mechanism_of_sensitivity_one():
  ledger = privacy_ledger.PrivacyLedger()
  out = tuning.noisy_count(ledger, 40, 100, 5.0, rng=np.random.default_rng(0))
  samples, queries = ledger.get_arrays()
  assert samples.shape[0] == 1 and samples[0, 0] == 100 and samples[0, 1] == 1.0
  assert samples[0, 3] == rec.policy_code(rec.POISSON)
  # query row: (sample, kind, clip, stddev, sensitivity)
  np.testing.assert_allclose(queries[0, 1:], [rec.GAUSSIAN, 1.0, 5.0, 1.0])
  by_hand = dpa.rdp.RdpAccountant()
  by_hand.compose(dpa.GaussianDpEvent(5.0))
  assert accountant.privacy_report(ledger, delta=1e-5).epsilon == pytest.approx(
      by_hand.get_epsilon(1e-5), rel=1e-6)
  assert out != 40.0


def test_noisy_count_noise_has_the_stated_spread():
  rng = np.random.default_rng(1)
  ledger = privacy_ledger.PrivacyLedger()
  draws = np.array([tuning.noisy_count(ledger, 7, 10, 3.0, rng=rng) for _ in range(400)])
  # mean 7 and sd 3: 5-sigma bounds of the sample mean and sd over 400 draws
  assert abs(draws.mean() - 7.0) < 5 * 3.0 / np.sqrt(400)
  assert abs(draws.std() - 3.0) < 5 * 3.0 / np.sqrt(2 * 400)
  assert int(ledger.sample_count.numpy()) == 400


@pytest.mark.parametrize("bad", [dict(count=11), dict(count=-1), dict(noise_multiplier=0.0)])
def test_noisy_count_refuses_bad_arguments(bad):
  args = dict(count=3, population_size=10, noise_multiplier=1.0)
  args.update(bad)
  with pytest.raises(ValueError, match=next(iter(bad))):
    tuning.noisy_count(privacy_ledger.PrivacyLedger(), **args)


@pytest.mark.parametrize("mean,shape", [(3.0, 0.0), (2.0, 1.0)])
def test_trial_noise_is_the_smallest_that_meets_the_target(mean, shape):
  q, steps, z_s = 0.02, 200, 10.0
  z = tuning.trial_noise_multiplier(2.0, 1e-5, q, steps, mean, shape, z_s)
  assert _by_hand(z, q, steps, mean, shape, z_s) <= 2.0
  assert _by_hand(z * (1 - 1e-3), q, steps, mean, shape, z_s) > 2.0
  assert tuning.selection_epsilon(z, q, steps, mean, shape, 1e-5, z_s) == pytest.approx(
      _by_hand(z, q, steps, mean, shape, z_s), rel=1e-12)


def test_a_target_the_score_alone_exceeds_is_refused():
  with pytest.raises(PrivacyConfigError, match="cannot be met"):
    tuning.trial_noise_multiplier(0.5, 1e-5, 0.02, 10, 3.0, 0.0, score_noise_multiplier=0.3)
