"""A malformed submit during a store outage gets the 4xx it gets with the store up.

Before: a submit refused by validation (bad JSON, wrong types or shape, out-of-range or
non-finite weights, a bad ticket, a step the acceptance rule refuses) was answered 503
store_unavailable while the store was down: the refusal's counters were written to the store
before answering, and without tickets the weights' range was checked only after reading a
snapshot. A client then took its malformed submit for a retryable fault. Now validation
answers before anything touches the store; a refusal the store's counters miss is counted
in the process metrics (refusals_uncounted_total). A valid submit still gets 503.
"""

import json

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, service
from tf_dpiter.draw_discard import store as store_lib
from tests.draw_discard.conftest import honest, http_request
from tests.draw_discard.test_adversarial import BAD_JSON, P, SPEC, TOKEN

K = 8
RAW = "application/octet-stream"


def _post(srv, body, content_type, headers=None):
  h = {"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type}
  h.update(headers or {})
  status, _, data = http_request(srv.port, "POST", "/v1/submit", body, h)
  return status, json.loads(data)["error"] if status >= 400 else None


def _outage(svc):
  """Every store call from now on raises StoreUnavailable (Redis down)."""
  async def down(*a, **kw):
    raise store_lib.StoreUnavailable("redis: ConnectionError (simulated outage)")

  for name in ("meta", "touch", "snapshot", "replace", "incr", "take_quota", "release"):
    setattr(svc.store, name, down)


def _service(start_service, **kw):
  return start_service(service.DDMLService(SPEC, K, store_lib.MemoryStore(), seed=0,
                                           tokens=auth.TokenSet([TOKEN]), **kw))


def _same_answer_in_an_outage(srv, requests):
  """Each (body, content type, headers) answered with the store up, then in an outage: the
  same 4xx status and code."""
  up = [_post(srv, *r) for r in requests]
  assert all(400 <= status < 500 for status, _ in up), up
  _outage(srv.svc)
  down = [_post(srv, *r) for r in requests]
  assert down == up
  assert "refusals_uncounted_total" in srv.svc.metrics.render()


@pytest.mark.parametrize("body,status,code", BAD_JSON,
                         ids=[f"{c}-{i}" for i, (_, _, c) in enumerate(BAD_JSON)])
def test_a_bad_json_submit_gets_its_4xx_in_an_outage(start_service, body, status, code):
  srv = _service(start_service)
  assert _post(srv, body, "application/json") == (status, code)
  _same_answer_in_an_outage(srv, [(body, "application/json")])


def test_bad_raw_submits_and_refused_steps_get_their_4xx_in_an_outage(start_service):
  srv = _service(start_service)
  status, _, data = http_request(srv.port, "GET", "/v1/draw", None,
                                 {"Authorization": f"Bearer {TOKEN}"})
  assert status == 200
  d = json.loads(data)
  w, ticket = np.array(d["weights"]), d["ticket"]
  rng = np.random.default_rng(3)
  u = honest(SPEC, w, rng)
  tick = {"X-DDML-Version": "1", "X-DDML-Ticket": ticket}

  def raw(*rows):
    return np.concatenate(rows).astype("<f8").tobytes()

  requests = [
      (raw(w, u)[:-8], RAW, tick),                                   # 422 wrong_shape
      (raw(u), RAW, tick),                                           # 422 wrong_shape
      (raw(w, u), RAW, {"X-DDML-Ticket": ticket}),                   # 400 missing_version
      (raw(w, u), RAW, dict(tick, **{"X-DDML-Version": "2"})),       # 409 wrong_version
      (raw(w, np.r_[u[:-1], 1e300]), RAW, tick),                     # 422 out_of_range
      (raw(w, np.r_[u[:-1], np.nan]), RAW, tick),                    # 422 non_finite
      (raw(w, u + 0.2), RAW, tick),                                  # 422 rejected_update
      (raw(w, u), RAW, dict(tick, **{"X-DDML-Ticket": "A" * 48})),   # 403 invalid_ticket
      (raw(w, u), "text/plain", tick),                               # 415
  ]
  _same_answer_in_an_outage(srv, requests)
  # a valid submit is not refused as malformed: the store is down, 503
  assert _post(srv, raw(w, u), RAW, tick)[0] == 503


def test_without_tickets_a_malformed_submit_gets_its_4xx_in_an_outage(start_service):
  srv = _service(start_service, tickets=False)
  ok = [0.0] * P
  requests = [
      (json.dumps({"version": "1", "weights": ok[:-1] + [1e300]}).encode(), "application/json",
       None),                                                          # 422 out_of_range
      (json.dumps({"version": "1", "weights": ok + [0.0]}).encode(), "application/json", None),
      (np.r_[ok[:-1], np.inf].astype("<f8").tobytes(), RAW, {"X-DDML-Version": "1"}),
      (np.zeros(P + 1).astype("<f8").tobytes(), RAW, {"X-DDML-Version": "1"}),
      (b'{"version": "1", "weights": [true]}', "application/json", None),
  ]
  _same_answer_in_an_outage(srv, requests)
  assert _post(srv, np.zeros(P).astype("<f8").tobytes(), RAW, {"X-DDML-Version": "1"})[0] == 503
