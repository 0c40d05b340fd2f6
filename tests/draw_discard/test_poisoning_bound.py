"""The poisoning bound: a decaying, rate-capped influence budget per identity (influence.py).

Time is simulated (the budget's clock); steps go through the real per-submit rule and budget.
"""

import math

import numpy as np
import pytest

from tf_dpiter.draw_discard import acceptance, auth, client, client_lib, influence, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_factory
from tf_dpiter.draw_discard.cli import dense_spec

P = 387


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def _attack(budget, rule, clock, submits, period_s, identities=1):
  """Noiseless attacker steps of -a on every weight, `period_s` apart, round robin."""
  accepted = 0
  d = np.full(P, -rule.step)
  for i in range(submits):
    clock.t += period_s
    assert rule.check_step(d, np.zeros(P)).accepted  # each step alone is a plausible update
    ident = f"mallory-{i % identities}"
    if budget.reserve(ident, d):
      continue
    accepted += 1
    if budget.max_steps is not None:  # decayed displacement <= m a + x(S2) s, x(S2) <= x(n)
      n, c = budget.state(ident)
      noise_allowance = budget.limits(n)[0] - n * rule.step
      assert np.abs(c).max() <= budget.max_steps * rule.step + noise_allowance + 1e-12
  return accepted


def test_without_decay_one_identity_moves_the_model_one_step_per_submit():
  rule, clock = acceptance.AcceptanceRule(dense_spec(P)), Clock()
  budget = influence.InfluenceBudget(rule, max_steps=None, half_life_s=None, clock=clock)
  assert _attack(budget, rule, clock, 400, 0.5) == 400  # the reproduced poisoning (before)


@pytest.mark.parametrize("identities", [1, 5])
def test_rate_bound_holds_for_noiseless_attackers(identities):
  rule, clock = acceptance.AcceptanceRule(dense_spec(P)), Clock()
  budget = influence.InfluenceBudget(rule, clock=clock)  # defaults: 8 steps, 300 s half-life
  window = 400 * 0.5
  bound = identities * budget.max_steps * (1 + window * math.log(2) / budget.half_life_s)
  accepted = _attack(budget, rule, clock, 400, 0.5, identities)
  assert identities * budget.max_steps <= accepted <= bound  # 11.7 per identity at most
  assert budget.wait_s("mallory-0") > 0


def test_honest_token_within_the_rate_is_not_refused():
  spec = dense_spec(33)
  rule, clock = acceptance.AcceptanceRule(spec), Clock()
  budget = influence.InfluenceBudget(rule, clock=clock)
  rng = np.random.default_rng(4)
  refused = 0
  for _ in range(1000):  # one update a minute, every clipped gradient the same way
    clock.t += 60.0
    h = rng.normal(0, 0.01, 33)
    u = client.spec_update(spec, h, {"x": rng.random((10, 32))}, np.zeros(10), rng=rng)
    refused += bool(rule.check_step(u, h).reason or budget.reserve("honest", u - h))
  assert refused <= 3  # per-step alpha 1e-3 and the lifetime 1e-3


def test_budget_memory_is_bounded_and_active_identities_are_kept():
  rule, clock = acceptance.AcceptanceRule(dense_spec(P)), Clock()
  per_identity = 16 * P + 160
  budget = influence.InfluenceBudget(rule, max_memory_bytes=10 * per_identity, clock=clock)
  assert budget.max_identities == 10
  d = np.full(P, rule.step)
  for i in range(10):
    assert budget.reserve(f"id{i}", d) == ""
  assert budget.reserve("newcomer", d) == "influence_table_full"  # nobody is forgotten early
  clock.t += 1.0  # id0 now weighs 2^(-1/300) < 1 update: forgettable
  assert budget.reserve("id0-again", d) == "" and budget.state("id0")[0] == 0
  for i in range(1, 10):
    assert budget.reserve(f"id{i}", d) == ""  # active again: S1 > 1
  assert budget.reserve("newcomer", d) == "influence_table_full"
  clock.t += 10 * budget.half_life_s
  assert budget.reserve("newcomer", d) == ""
  assert budget.state("id0-again")[0] == 0 and len(budget._state) == 10


def test_http_answers_429_with_retry_after_past_the_rate(start_service):
  token = "mallory-token-0123456789abcdef"
  svc = service.DDMLService(dense_spec(33, epsilon=1.0, gamma=0.01), 5, store_lib.MemoryStore(),
                            tokens=auth.TokenSet([token]), seed=0, influence_steps=3)
  srv = start_service(svc)
  rng = np.random.default_rng(5)
  codes = []
  with client_lib.DDMLClient(srv.url, token=token, insecure=True) as c:
    for _ in range(5):
      d = c.draw()
      u = client.spec_update(svc.spec, d.weights, {"x": rng.random((8, 32))}, np.zeros(8),
                             rng=rng)
      try:
        codes.append(c.submit(d, u)["accepted"])
      except client_lib.DDMLError as e:
        codes.append((e.status, e.code, e.retry_after is not None and e.retry_after > 0))
  assert codes[:3] == [True] * 3
  assert codes[3:] == [(429, "influence_rate_exceeded", True)] * 2


def test_budget_arguments_are_checked():
  rule = acceptance.AcceptanceRule(dense_spec(P))
  for bad, match in ((dict(max_steps=0.5), "max_steps"), (dict(half_life_s=0), "half_life_s"),
                     (dict(max_memory_bytes=10), "max_memory_bytes")):
    with pytest.raises(ValueError, match=match):
      influence.InfluenceBudget(rule, **bad)


def test_influence_rate_holds_across_redis_servers(start_service, redis_url):
  import uuid
  token = "mallory-token-0123456789abcdef"
  prefix = f"t{uuid.uuid4().hex[:8]}"
  spec = dense_spec(33, epsilon=1.0, gamma=0.01)
  srvs = [start_service(service.DDMLService(
      spec, 5, store_factory.make_store(redis_url, prefix), tokens=auth.TokenSet([token]), seed=0,
      influence_steps=3, secret=b"poisoning-test-shared-secret-0123456789"))
      for _ in range(2)]
  rng = np.random.default_rng(6)
  codes = []
  clients = [client_lib.DDMLClient(s.url, token=token, insecure=True) for s in srvs]
  for i in range(6):  # alternate servers: each process alone would allow 3
    c = clients[i % 2]
    d = c.draw()
    u = client.spec_update(spec, d.weights, {"x": rng.random((8, 32))}, np.zeros(8), rng=rng)
    try:
      codes.append(c.submit(d, u)["accepted"])
    except client_lib.DDMLError as e:
      codes.append((e.status, e.code))
  for c in clients:
    c.close()
  assert codes[:3] == [True] * 3
  assert codes[3:] == [(429, "influence_rate_exceeded")] * 3
