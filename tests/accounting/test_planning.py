"""accounting.planning against dp-accounting called by hand (RDP, Poisson-sampled Gaussian)."""

import math

import dp_accounting
import pytest

from tf_dpiter.accounting import planning

EPS, DELTA, N, BUDGET = 2.0, 1e-5, 10000, 10000 * 10


def _rdp_epsilon(q, z, steps):
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(event)
  return acc.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def planned():
  return planning.plan_batch_size(EPS, DELTA, N, BUDGET, min_steps=50,
                                  batch_sizes=[50, 200, 800, 2000])


def test_every_plan_meets_the_budget_and_its_noise_is_tight(planned):
  _, plans = planned
  assert [p.batch_size for p in plans] == [50, 200, 800, 2000]   # 2000: T = 50 = min_steps
  for p in plans:
    assert p.steps == BUDGET // p.batch_size and p.steps >= 50
    assert p.example_gradients == p.batch_size * p.steps <= BUDGET
    q = p.batch_size / N
    assert p.sampling_probability == pytest.approx(q)
    eps = _rdp_epsilon(q, p.noise_multiplier, p.steps)
    assert eps <= EPS * (1 + 1e-9)
    assert p.epsilon == pytest.approx(eps, rel=1e-6)
    assert _rdp_epsilon(q, p.noise_multiplier * 0.995, p.steps) > EPS   # z is not loose
    assert p.total_noise == pytest.approx(p.noise_multiplier / (q * math.sqrt(p.steps)))
    assert p.noise_per_step == pytest.approx(p.noise_multiplier / p.batch_size)


def test_best_plan_minimizes_total_noise_and_is_a_large_batch(planned):
  best, plans = planned
  etas = [p.noise_multiplier / (p.sampling_probability * math.sqrt(p.steps)) for p in plans]
  assert best.total_noise == pytest.approx(min(etas))
  # De et al.'s guidance at fixed compute: the smallest batch is not the best.
  assert etas[0] > min(etas) and best.batch_size > plans[0].batch_size


def test_refusals():
  with pytest.raises(ValueError, match="compute_budget"):
    planning.plan_batch_size(EPS, DELTA, N, 100, min_steps=50, batch_sizes=[64])
  with pytest.raises(ValueError):
    planning.plan_batch_size(-1.0, DELTA, N, BUDGET)
