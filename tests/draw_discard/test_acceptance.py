"""The bounded-influence acceptance rule (acceptance.AcceptanceRule), without HTTP."""

import math

import numpy as np
import pytest

from tf_dpiter.draw_discard import acceptance, client, privacy, server
from tf_dpiter.draw_discard.cli import dense_spec

K = 20


def _setup(p, noise="laplace", seed=0):
  spec = dense_spec(p, noise=noise)
  var = privacy.noise_std(noise, spec.gamma, spec.epsilon, spec.clip, spec.delta) ** 2
  std = math.sqrt(privacy.init_variance(K, var))
  rng = np.random.default_rng(seed)
  rule = acceptance.AcceptanceRule(spec, spread_std=std)
  return spec, rule, server.initial_instances(K, p, 0.0, std, rng), rng


def _honest(spec, w, rng):
  x = {"x": rng.random((10, spec.num_weights - 1))}
  return client.spec_update(spec, w, x, rng.integers(0, 2, 10), rng=rng)


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("p", [33, 387])
def test_honest_updates_are_accepted(p, noise):
  spec, rule, slots, rng = _setup(p, noise)
  history = []
  refused = 0
  for _ in range(1500):
    j = rng.integers(K)
    u = _honest(spec, slots[j], rng)
    cands = np.concatenate([slots, np.array(history[-64:])]) if history else slots
    d = rule.check(u, cands, slots.mean(axis=0))
    refused += not d.accepted
    if d.accepted:
      i = rng.integers(K)
      history.append(slots[i].copy())
      slots[i] = u
  assert refused <= 15  # <= 1 %; the bound is alpha = 0.1 %


@pytest.mark.parametrize("noise,p", [("laplace", 387), ("gaussian", 387), ("laplace", 7850)])
def test_chernoff_thresholds_hold_for_pure_noise(noise, p):
  spec, rule, _, rng = _setup(p, noise)
  s = rule.scale
  n = (s * (rng.standard_exponential((400, p)) - rng.standard_exponential((400, p)))
       if noise == "laplace" else rng.normal(0, s, (400, p)))
  x = np.abs(n) / s
  assert np.all(x.sum(axis=1) <= rule.upper)
  assert np.all(np.minimum(x, rule.noise_cap).sum(axis=1) >= rule.lower)
  assert np.all(np.abs(n).max(axis=1) <= rule.linf)
  assert rule.lower > 0.7 * p * (1 - math.exp(-rule.noise_cap)) if noise == "laplace" else True


def _attack(kind, rule, slots, rng):
  w = slots[0]
  s, a, p = rule.scale, rule.step, rule.p
  return {
      "nan": np.r_[w[:-1], np.nan],
      "huge": np.full(p, 1e300),
      "copy": w.copy(),
      "average": slots.mean(axis=0),
      "far": w + 1.0,
      "noise_too_big": w + 5 * s * (rng.standard_exponential(p) - rng.standard_exponential(p)),
      "one_weight_spike": np.r_[w[:-1] + s * (rng.standard_exponential(p - 1)
                                              - rng.standard_exponential(p - 1)),
                                w[-1] + a + 50 * s],
      "chained_far": w + 40 * a,
  }[kind]


@pytest.mark.parametrize("kind,reason", [
    ("nan", "non_finite"), ("huge", "out_of_range"), ("copy", "too_little_noise"),
    ("average", None), ("far", None), ("noise_too_big", None), ("one_weight_spike", None),
    ("chained_far", None)])
def test_attack_updates_are_refused(kind, reason):
  _, rule, slots, rng = _setup(387)
  u = _attack(kind, rule, slots, rng)
  cands = np.concatenate([slots, u[None] - 39 * rule.step]) if kind == "chained_far" else slots
  d = rule.check(u, cands, slots.mean(axis=0))
  assert not d.accepted
  if reason:
    assert d.reason == reason


def test_ratchet_moves_the_average_by_the_stated_bound():
  spec, rule, slots, rng = _setup(387)
  avg0 = slots.mean(axis=0)
  shift = rule.step + rule.scale * rule.upper / rule.p * (1 - 1e-9)
  accepted = 0
  for _ in range(200):
    u = slots[rng.integers(K)] + shift
    if rule.check(u, slots, slots.mean(axis=0)).accepted:
      accepted += 1
      slots[rng.integers(K)] = u
  moved = (slots.mean(axis=0) - avg0).mean()
  assert accepted > 150
  # each accepted submit moves the average by (u - replaced)/k: shift/k in expectation
  assert moved <= 1.6 * accepted * shift / K
  assert shift < 2.0 * rule.step + 1.5 * rule.scale


@pytest.mark.parametrize("bad", [dict(alpha=0.0), dict(alpha=0.6), dict(max_abs_weight=0.0),
                                 dict(noise_cap=-1.0), dict(spread_std=-1.0),
                                 dict(centre_factor=0.0)])
def test_rule_arguments_are_checked(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    acceptance.AcceptanceRule(dense_spec(33), **bad)


def test_noiseless_spec_allows_only_the_clipped_step():
  spec = dense_spec(33, epsilon=None, noise="none", gamma=0.01)
  rule = acceptance.AcceptanceRule(spec)
  w = np.zeros(33)
  assert rule.check(w + 0.01, w[None]).accepted
  assert rule.check(w + 0.0101, w[None]).reason == "step_too_large"


def test_describe_states_the_bound():
  d = acceptance.AcceptanceRule(dense_spec(387), alpha=1e-3).describe()
  assert d["rule"] == "bounded_influence" and "0.001" in d["false_rejection_bound"]
  assert d["excess_max"] > 387 > d["floor_min"] > 0
