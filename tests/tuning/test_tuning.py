"""Private selection: the number of trials has its law, epsilon equals dp-accounting by hand."""

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import tuning
from tf_dpiter.ledger import records as rec


def _ledger(z, steps=100, q=0.01):
  samples = np.array([[1000, q, 10, rec.policy_code(rec.POISSON), 1, 1]] * steps, float)
  queries = np.array([[i, rec.GAUSSIAN, 1.0, z, 1.0] for i in range(steps)], float)
  return samples, queries


@pytest.mark.parametrize("mean,shape", [(5.0, 1.0), (10.0, 0.5), (4.0, 0.0), (3.0, float("inf"))])
def test_number_of_trials_has_the_requested_mean(mean, shape):
  draw = tuning.num_trials_distribution(mean, shape)
  rng = np.random.default_rng(0)
  k = np.array([draw(rng) for _ in range(20000)])
  if not np.isinf(shape):
    assert k.min() >= 1
  assert abs(k.mean() - mean) <= 5 * k.std() / np.sqrt(len(k))


@pytest.mark.parametrize("mean,shape", [(5.0, 1.0), (8.0, 0.5), (3.0, float("inf"))])
def test_selection_epsilon_equals_dp_accounting_by_hand(mean, shape):
  report = tuning.selection_report([_ledger(1.1), _ledger(1.1)], mean, shape, 1e-5)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.dp_event.RepeatAndSelectDpEvent(
      dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 100),
      mean, shape))
  assert report.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  assert any("Papernot and Steinke" in a for a in report.assumptions)


def test_trials_of_different_mechanisms_are_refused():
  with pytest.raises(ValueError, match="another mechanism"):
    tuning.selection_report([_ledger(1.1), _ledger(2.0)], 5.0, 1.0, 1e-5)
  with pytest.raises(ValueError, match="mean"):
    tuning.num_trials_distribution(0.5, 1.0)


def test_random_search_returns_the_best_trial():
  search = tuning.RandomSearch(4.0, shape=1.0, seed=3)
  best_params, result, score, report = search.run(
      lambda rng: {"lr": float(rng.uniform())}, lambda p: (p["lr"], "model", _ledger(1.1)), 1e-5)
  assert score == best_params["lr"] and result == "model"
  assert report.epsilon > 0 and report.mean == 4.0
