"""Draw tickets, the influence budget and cluster quotas through the HTTP service."""

import json
import time
import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, client_lib, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_factory
from tf_dpiter.draw_discard.cli import dense_spec

from tests.draw_discard.conftest import honest, http_request

SPEC = dense_spec(33, epsilon=1.0, gamma=0.01)
P = SPEC.num_weights
ALICE = "alice-token-0123456789abcdef"
MALLORY = "mallory-token-0123456789abcdef"


def _svc(store=None, **kw):
  return service.DDMLService(SPEC, 10, store or store_lib.MemoryStore(),
                             tokens=auth.TokenSet([ALICE, MALLORY]), seed=0,
                             secret=b"tickets-test-shared-secret-0123456789", **kw)


def _state(srv):
  snap = srv.call(srv.svc.store.snapshot())
  return snap.seq, snap.slots.tobytes()


def _post(port, drawn_w, ticket, u, token=ALICE):
  status, _, data = http_request(
      port, "POST", "/v1/submit", np.r_[drawn_w, u].astype("<f8").tobytes(),
      {"Authorization": f"Bearer {token}", "X-DDML-Version": "1",
       "Content-Type": "application/octet-stream", "X-DDML-Ticket": ticket})
  return status, json.loads(data)


def _refused(srv, before, got, status, code):
  assert got[0] == status and got[1]["error"] == code and got[1]["message"]
  assert _state(srv) == before


def test_ticket_is_single_use(start_service):
  srv = start_service(_svc())
  with client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
    d = c.draw()
    u = honest(SPEC, d.weights, np.random.default_rng(0))
    assert c.submit(d, u)["accepted"]
    before = _state(srv)
    _refused(srv, before, _post(srv.port, d.weights, d.ticket, u), 409, "ticket_used")
    assert c.metrics()["rejected_invalid"] == 1


def test_ticket_of_another_token_or_instance_is_refused(start_service):
  srv = start_service(_svc())
  rng = np.random.default_rng(1)
  with client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
    d = c.draw()
    before = _state(srv)
    u = honest(SPEC, d.weights, rng)
    _refused(srv, before, _post(srv.port, d.weights, d.ticket, u, MALLORY), 403, "invalid_ticket")
    # chaining: a real ticket, but the claimed pre-image is the client's own earlier update
    assert c.submit(d, u)["accepted"]
    d2 = c.draw()
    before = _state(srv)
    _refused(srv, before, _post(srv.port, u, d2.ticket, honest(SPEC, u, rng)), 403,
             "invalid_ticket")
    assert c.submit(d2, honest(SPEC, d2.weights, rng))["accepted"]


def test_expired_ticket_is_refused(start_service):
  srv = start_service(_svc(ticket_ttl_s=0.2))
  with client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
    d = c.draw()
    time.sleep(0.3)
    before = _state(srv)
    u = honest(SPEC, d.weights, np.random.default_rng(2))
    _refused(srv, before, _post(srv.port, d.weights, d.ticket, u), 409, "ticket_expired")


def test_biased_token_hits_its_budget_others_do_not(start_service):
  srv = start_service(_svc(influence_steps=None, influence_half_life_s=None))  # the envelope
  rng = np.random.default_rng(3)
  a, b = srv.svc.rule.step, srv.svc.rule.scale
  refused = {}
  with client_lib.DDMLClient(srv.url, token=MALLORY, insecure=True) as m, \
       client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
    for _ in range(60):  # every weight pushed up by the step plus |noise|: passes one by one
      d = m.draw()
      noise = b * (rng.standard_exponential(P) - rng.standard_exponential(P))
      try:
        m.submit(d, d.weights + a + np.abs(noise))
      except client_lib.DDMLError as e:
        refused[e.code] = refused.get(e.code, 0) + 1
      d = c.draw()
      assert c.submit(d, honest(SPEC, d.weights, rng))["accepted"]
    assert refused.get("rejected_update", 0) > 10
    st, _, text = _get(srv.port, "/metrics")
    assert 'reason="cumulative_excess_too_large"' in text
  n, total = srv.svc.budget.state(auth.token_digest(MALLORY)[:12])
  assert np.maximum(np.abs(total) - n * a, 0).sum() <= srv.svc.budget.limits(n)[1] * (1 + 1e-9)


def _get(port, path):
  status, h, data = http_request(port, "GET", path, headers={"Authorization": f"Bearer {ALICE}"})
  return status, h.get("Content-Type"), data.decode()


def test_two_redis_servers_share_tickets(start_service, redis_url):
  prefix = f"t{uuid.uuid4().hex[:8]}"
  a = start_service(_svc(store_factory.make_store(redis_url, prefix)))
  b = start_service(_svc(store_factory.make_store(redis_url, prefix)))
  rng = np.random.default_rng(4)
  with client_lib.DDMLClient(a.url, token=ALICE, insecure=True) as ca, \
       client_lib.DDMLClient(b.url, token=ALICE, insecure=True) as cb:
    d = ca.draw()
    u = honest(SPEC, d.weights, rng)
    assert cb.submit(d, u)["accepted"]  # drawn on A, submitted to B
    with pytest.raises(client_lib.DDMLError) as e:
      ca.submit(d, u)
    assert e.value.status == 409 and e.value.code == "ticket_used"
    d = cb.draw()
    answer, nxt = cb.submit_and_draw(d, honest(SPEC, d.weights, rng))
    assert answer["accepted"] and nxt.ticket
    assert ca.submit(nxt, honest(SPEC, nxt.weights, rng))["seq"] == 3


@pytest.mark.parametrize("where", ["memory", "redis"])
def test_tickets_do_not_cross_models_that_share_the_secret(start_service, where, request):
  """Model A's ticket is refused by model B (same secret, another
  prefix or process) and still admits exactly one update on A; with --no-rebase on B, B's
  slot never becomes A's instance plus the step."""
  def store():
    if where == "memory":
      return store_lib.MemoryStore()
    return store_factory.make_store(request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:8]}")

  a, b = start_service(_svc(store())), start_service(_svc(store(), rebase=False))
  rng = np.random.default_rng(6)
  d = client_lib.DDMLClient(a.url, token=ALICE, insecure=True).draw()
  u = honest(SPEC, d.weights, rng)
  before = _state(b)
  _refused(b, before, _post(b.port, d.weights, d.ticket, u), 403, "invalid_ticket")
  assert not any(np.array_equal(row, u) for row in b.call(b.svc.store.snapshot()).slots)
  assert _post(a.port, d.weights, d.ticket, u)[0] == 200  # one draw, one submit
  _refused(a, _state(a), _post(a.port, d.weights, d.ticket, u), 409, "ticket_used")


def test_without_tickets_the_candidate_rule_applies(start_service):
  srv = start_service(_svc(tickets=False))
  with client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
    d = c.draw()
    assert c.submit(d.version, honest(SPEC, d.weights, np.random.default_rng(5)))["accepted"]
    assert srv.svc.history == 256


@pytest.mark.parametrize("cluster", [False, True])
def test_cluster_quotas_hold_across_redis_servers(start_service, redis_url, cluster):
  prefix = f"t{uuid.uuid4().hex[:8]}"
  servers = [start_service(_svc(store_factory.make_store(redis_url, prefix),
                                quotas=auth.Quotas({"draw": 0.5}, {"draw": 1}, cluster=cluster)))
             for _ in range(2)]
  statuses = []
  for srv in servers:
    with client_lib.DDMLClient(srv.url, token=ALICE, insecure=True) as c:
      try:
        statuses.append(c.draw() is not None and 200)
      except client_lib.DDMLError as e:
        statuses.append((e.status, e.code, e.retry_after))
  # per process: each server allows its own burst; cluster: the second server's bucket is
  # the first one's (one draw per 2 s for the token, whichever server it asks)
  assert statuses == ([200, 200] if not cluster else [200, (429, "quota_exceeded", 2.0)])
