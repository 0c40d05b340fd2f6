"""Draw tickets and the per-token influence budget, without HTTP (tickets.py, influence.py)."""

import math

import numpy as np
import pytest

from tf_dpiter.draw_discard import acceptance, client, influence, tickets
from tf_dpiter.draw_discard.cli import dense_spec


def _rule(p, noise="laplace", **kw):
  return acceptance.AcceptanceRule(dense_spec(p, noise=noise, **kw))


def _noise(rule, rng, shape):
  if rule.noise == "laplace":
    return rule.scale * (rng.standard_exponential(shape) - rng.standard_exponential(shape))
  return rng.normal(0.0, rule.scale, shape)


# ---- tickets ----

def test_ticket_round_trip_and_refusals():
  now = [1000.0]
  t = tickets.Tickets(b"k" * 32, ttl_s=60, clock=lambda: now[0])
  h = np.arange(5.0)
  tk = t.issue("alice", h)
  assert len(tk) == 48 and len(t.verify(tk, "alice", h)) == 24
  cases = [(None, "alice", h, "missing_ticket"), ("abc", "alice", h, "bad_ticket"),
           (tk, "mallory", h, "invalid_ticket"), (tk, "alice", h + 1e-12, "invalid_ticket"),
           (tickets.Tickets(b"x" * 32).issue("alice", h), "alice", h, "invalid_ticket")]
  for ticket, who, inst, code in cases:
    with pytest.raises(tickets.TicketError) as e:
      t.verify(ticket, who, inst)
    assert e.value.code == code
  now[0] += 61
  with pytest.raises(tickets.TicketError) as e:
    t.verify(tk, "alice", h)
  assert e.value.code == "ticket_expired" and e.value.status == 409


def test_tickets_are_distinct_and_arguments_checked():
  t = tickets.Tickets(b"k" * 16)
  h = np.zeros(3)
  assert len({t.issue("a", h) for _ in range(50)}) == 50
  with pytest.raises(ValueError, match="key"):
    tickets.Tickets(b"short")
  with pytest.raises(ValueError, match="ttl_s"):
    tickets.Tickets(b"k" * 16, ttl_s=0)


# ---- envelope (Chernoff bounds against Monte Carlo) ----

@pytest.mark.parametrize("noise,p,n", [("laplace", 387, 1), ("laplace", 387, 30),
                                       ("laplace", 50, 200), ("gaussian", 387, 30)])
def test_envelope_holds_for_sums_of_noise(noise, p, n):
  rule = _rule(p, noise)
  rng = np.random.default_rng(0)
  x, u = influence.envelope(noise, p, n, 1e-3 / 300)  # P(any of 300 sums fails) <= 1e-3
  w = sum(_noise(rule, rng, (300, p)) for _ in range(n)) / rule.scale  # 300 honest sums
  assert np.abs(w).max() <= x
  assert np.abs(w).sum(axis=1).max() <= u
  # not vacuous: within 3x of the typical maximum (a tail at 1e-3 / (300 p)) and 2x of
  # the typical L1 norm
  assert x < 3 * np.abs(w).max(axis=1).mean() and u < 2 * np.abs(w).sum(axis=1).mean()


def test_envelope_is_sqrt_n_and_tends_to_the_honest_step():
  rule = _rule(387)
  budget = influence.InfluenceBudget(rule)
  per_weight = [budget.limits(n)[0] / (n * rule.step) for n in (1, 10, 100, 1000, 10000)]
  assert all(a > b for a, b in zip(per_weight, per_weight[1:])) and per_weight[-1] < 1.1
  agg = budget.limits(1000)[1] / (387 * 1000 * rule.step)
  assert agg < 0.04  # aggregate excess: < 4 % of N a per weight at N = 1000


def test_lifetime_alphas_sum_to_alpha():
  assert math.isclose(sum(influence.lifetime_alpha(1e-3, n) for n in range(1, 200000)), 1e-3,
                      rel_tol=1e-4)


# ---- budget ----

@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_honest_token_is_never_refused(noise):
  """One honest token, 2,000 Algorithm 1 steps whose clipped gradients all point one way."""
  spec = dense_spec(33, noise=noise)
  rule = acceptance.AcceptanceRule(spec)
  budget = influence.InfluenceBudget(rule, max_steps=None, half_life_s=None)
  rng = np.random.default_rng(1)
  refused = 0
  for _ in range(2000):
    h = rng.normal(0, 0.01, 33)
    x = {"x": rng.random((10, 32))}
    u = client.spec_update(spec, h, x, np.zeros(10), rng=rng)
    refused += bool(rule.check_step(u, h).reason or budget.reserve("honest", u - h))
  assert refused <= 4  # bounds: alpha (1e-3 per step) + 1e-3 lifetime


@pytest.mark.parametrize("shape", ["all_weights", "one_weight"])
def test_biased_token_is_held_to_the_envelope(shape):
  rule = _rule(387)
  budget = influence.InfluenceBudget(rule, max_steps=None, half_life_s=None)
  rng = np.random.default_rng(2)
  n_acc, total = 0, np.zeros(387)
  for _ in range(400):
    d = _noise(rule, rng, 387)
    if shape == "all_weights":
      d = np.abs(d) + rule.step  # every weight pushed up: noise made coherent
    else:
      d[0] = rule.step + 5 * rule.scale
    if not budget.reserve("mallory", d):
      n_acc, total = n_acc + 1, total + d
  lim_w, lim_u = budget.limits(n_acc)
  assert n_acc < 400  # the budget binds
  assert np.abs(total).max() <= lim_w * (1 + 1e-9)
  assert np.maximum(np.abs(total) - n_acc * rule.step, 0).sum() <= lim_u * (1 + 1e-9)
  assert budget.state("mallory")[0] == n_acc


def test_release_undoes_a_reservation_and_identities_are_bounded():
  rule = _rule(33)
  budget = influence.InfluenceBudget(rule, max_identities=2, half_life_s=None)
  d = np.full(33, rule.step)
  assert budget.reserve("a", d) == "" and budget.reserve("a", d) == ""
  budget.release("a", d)
  n, c = budget.state("a")
  assert n == 1 and np.allclose(c, d)
  budget.reserve("b", d)
  budget.reserve("c", d)
  assert budget.state("a")[0] == 0  # least recently used forgotten


@pytest.mark.parametrize("bad", [dict(alpha=0.0), dict(alpha=0.7), dict(max_identities=0)])
def test_budget_arguments_are_checked(bad):
  with pytest.raises(ValueError, match=next(iter(bad))):
    influence.InfluenceBudget(_rule(33), **bad)


def test_noiseless_spec_budget_is_exactly_n_steps():
  rule = acceptance.AcceptanceRule(dense_spec(33, epsilon=None, noise="none", gamma=0.01))
  budget = influence.InfluenceBudget(rule)
  assert budget.reserve("a", np.full(33, 0.01)) == ""
  assert budget.reserve("a", np.full(33, 0.0101)) == "cumulative_step_too_large"


def test_check_step_tests_against_the_served_instance():
  rule = _rule(387)
  rng = np.random.default_rng(3)
  h = rng.normal(0, 0.01, 387)
  assert rule.check_step(h + _noise(rule, rng, 387), h).accepted
  assert rule.check_step(h.copy(), h).reason == "too_little_noise"
  assert rule.check_step(h + 40 * rule.step, h).reason == "step_too_large"
  assert rule.check_step(np.r_[h[:-1], np.nan], h).reason == "non_finite"


# ---- eviction: no head-of-line block ----

def test_busy_oldest_identity_does_not_block_newcomers_over_http(start_service):
  """Table of 5: the least recently used identity has 3 recent updates, four one-shot
  clients follow; 6 newcomers (distinct /24 prefixes, tokens off) must all get in by
  forgetting the one-shot clients, while the busy identity is kept."""
  from tf_dpiter.draw_discard import service
  from tf_dpiter.draw_discard import store as store_lib
  from tests.draw_discard import loopback
  spec = dense_spec(9, epsilon=1.0, gamma=0.01)
  svc = service.DDMLService(spec, 4, store_lib.MemoryStore(), seed=0, max_identities=5)
  srv = start_service(svc)
  rng = np.random.default_rng(2)
  outcomes = []
  for i in [0, 0, 0, 1, 2, 3, 4] + list(range(5, 11)):
    with loopback.BoundClient(srv.url, loopback.prefix_source(i)) as c:
      ok, code, _, _ = loopback.honest_submit(c, rng)
      outcomes.append(code if not ok else "ok")
  assert outcomes == ["ok"] * 13
  assert svc.budget.state("127.20.0.0/24")[0] == 3  # the busy identity was not forgotten
  assert len(svc.budget._state) == 5


def test_eviction_picks_the_identity_that_became_forgettable_first():
  clock = [0.0]
  rule = _rule(33)
  budget = influence.InfluenceBudget(rule, max_identities=3, clock=lambda: clock[0])
  d = np.zeros(33)
  for _ in range(4):
    assert budget.reserve("busy", d) == ""
  clock[0] = 1.0
  assert budget.reserve("once-a", d) == "" and budget.reserve("once-b", d) == ""
  clock[0] = 2.0
  assert budget.reserve("new-1", d) == ""  # forgets once-a (forgettable since t = 1)
  assert budget.state("busy")[0] == 4 and budget.state("once-a")[0] == 0
  assert budget.reserve("new-1", d) == "" and budget.reserve("once-b", d) == ""
  assert budget.reserve("new-2", d) == "influence_table_full"  # S1 >= 1 for all three now
  clock[0] = 2.0 + budget.half_life_s * math.log2(2.0) + 1e-6  # new-1 and once-b decayed
  assert budget.reserve("new-2", d) == ""


def test_a_full_table_says_when_room_frees():
  clock = [0.0]
  budget = influence.InfluenceBudget(_rule(33), max_identities=2, clock=lambda: clock[0])
  d = np.zeros(33)
  assert budget.room_in_s() == 0.0
  for ident in ("a", "a", "b", "b"):
    assert budget.reserve(ident, d) == ""
  assert budget.reserve("c", d) == "influence_table_full"
  assert budget.room_in_s() == pytest.approx(budget.half_life_s)  # S1 = 2 halves to 1


def test_a_ticket_has_one_spelling():
  """base64 decoding skips characters outside its alphabet: before, the ticket with junk
  appended, inserted or in standard-alphabet form still verified (one ticket, many strings).
  Now only the 48 URL-safe characters issued are accepted (400 bad_ticket)."""
  t = tickets.Tickets(b"k" * 32, ttl_s=60)
  h = np.arange(5.0)
  tk = t.issue("alice", h)
  assert len(t.verify(tk, "alice", h)) == 24
  variants = [tk + "!!", "\n" + tk, tk[:10] + " " + tk[10:], tk + "====", tk + "\u00e9",
              tk.replace("-", "+").replace("_", "/") if ("-" in tk or "_" in tk) else tk + "+"]
  for bad in variants:
    with pytest.raises(tickets.TicketError) as e:
      t.verify(bad, "alice", h)
    assert e.value.code == "bad_ticket" and e.value.status == 400, repr(bad)
