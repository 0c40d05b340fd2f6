"""Adversarial suite of the Draw and Discard service: bad input, HTTP abuse, tokens, quotas.

Every refusal is checked for its status, its JSON error code, the server still answering
/healthz, and the store (slots, history, sequence number) byte-identical.
"""

import base64
import json
import logging
import socket
import time

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, client_lib, http_server, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard.cli import dense_spec

from tests.draw_discard.conftest import honest, http_request

SPEC = dense_spec(33, epsilon=1.0, gamma=0.01)
P = SPEC.num_weights
K = 20
TOKEN = "alice-token-0123456789abcdef"
OTHER = "mallory-token-0123456789abcdef"


def state(srv):
  """Bytes of everything an accepted update would change."""
  snap = srv.call(srv.svc.store.snapshot())
  return snap.seq, snap.slots.tobytes(), snap.history.tobytes()


def request(srv, method, path, body=None, headers=None, token=TOKEN):
  h = {} if token is None else {"Authorization": f"Bearer {token}"}
  h.update(headers or {})
  status, hdrs, data = http_request(srv.port, method, path, body, h)
  return status, dict(hdrs.items()), data


def assert_refused(srv, before, status, code, got):
  st, headers, body = got
  assert st == status, body[:300]
  assert headers["Content-Type"].startswith("application/json")
  err = json.loads(body)
  assert err["error"] == code and err["message"]
  assert request(srv, "GET", "/healthz", token=None)[0] == 200
  assert state(srv) == before


@pytest.fixture
def srv(start_service):
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), tokens=auth.TokenSet([TOKEN]),
                            seed=0, body_timeout_s=1.0)
  return start_service(svc)


def _drawn_with_ticket(srv):
  st, _, body = request(srv, "GET", "/v1/draw")
  assert st == 200
  d = json.loads(body)
  return np.array(d["weights"]), d["ticket"]


def _json(d):
  return json.dumps(d).encode()


def _list_body(weights_json: str) -> bytes:
  return b'{"version": "1", "weights": ' + weights_json.encode() + b"}"


NUMS = ", ".join(["0.0"] * (P - 1))
BAD_JSON = [
    (_list_body("[" + NUMS + ', "0.5"]'), 400, "bad_weights"),            # numeric string
    (_list_body("[" + NUMS + ", true]"), 400, "bad_weights"),             # boolean
    (_list_body("[" + NUMS + ", null]"), 400, "bad_weights"),
    (_list_body("[" + NUMS + ", [0.0]]"), 400, "bad_weights"),            # nested
    (_list_body('"0,0,0"'), 400, "bad_weights"),
    (_list_body("[" + NUMS + ", 1" + "0" * 5000 + "]"), 422, "non_finite"),  # huge integer
    (_list_body("[" + NUMS + ", 1e400]"), 422, "non_finite"),
    (_list_body("[" + NUMS + ", -Infinity]"), 422, "non_finite"),
    (_list_body("[" + NUMS + ", NaN]"), 422, "non_finite"),
    (_list_body("[" + NUMS + ", 1e308]"), 422, "out_of_range"),
    (b"[" * 30000 + b"]" * 30000, 400, "bad_json"),                      # deep nesting
    (b'{"version": "1", "weights": ' + b"[" * 30000 + b"]" * 30000 + b"}", 400, "bad_json"),
    (_json({"version": "1", "weights": [0.0] * P, "weights_b64": "AAAA"}), 400,
     "ambiguous_weights"),
    (_json({"version": "1", "weights": [0.0] * P, "slot": 3}), 400, "unknown_field"),
    (_json({"version": 1, "weights": [0.0] * P}), 400, "bad_version"),
    (_json({"version": ["1"], "weights": [0.0] * P}), 400, "bad_version"),
    (_json({"version": "1", "weights_b64": 12}), 400, "bad_weights"),
    (_json({"version": "1", "weights_b64": base64.b64encode(b"\0" * 8 * P).decode() + "!"}), 400,
     "bad_weights"),
    (b"\xff\xfe{}", 400, "bad_json"),
    (b"", 400, "bad_json"),
    (b"null", 400, "bad_json"),
    (_json({"version": "1", "weights": [0.0] * (P + 1)}), 422, "wrong_shape"),
    (_json({"version": "1", "weights": []}), 422, "wrong_shape"),
    (_json({"version": "2", "weights": [0.0] * P}), 409, "wrong_version"),
    (_json({"version": "1", "weights": [1e3] * P}), 400, "missing_ticket"),  # no draw ticket
    (_json({"version": "1", "weights": [0.0] * P, "drawn": [0.0] * P}), 400, "missing_ticket"),
    (_json({"version": "1", "weights": [0.0] * P, "ticket": 5}), 400, "bad_ticket"),
    (_json({"version": "1", "weights": [0.0] * P, "ticket": "x!", "drawn": [0.0] * P}), 400,
     "bad_ticket"),
    (_json({"version": "1", "weights": [0.0] * P, "ticket": "A" * 48, "drawn": [0.0] * P}), 403,
     "invalid_ticket"),
]


@pytest.mark.parametrize("body,status,code", BAD_JSON,
                         ids=[f"{c}-{i}" for i, (_, _, c) in enumerate(BAD_JSON)])
def test_bad_json_submissions_refused_store_untouched(srv, body, status, code):
  before = state(srv)
  assert_refused(srv, before, status, code, request(
      srv, "POST", "/v1/submit", body, {"Content-Type": "application/json"}))


@pytest.mark.parametrize("ctype,status,code", [
    (None, 415, "unsupported_media_type"),
    ("text/plain", 415, "unsupported_media_type"),
    ("application/x-www-form-urlencoded", 415, "unsupported_media_type"),
])
def test_content_type_is_strict(srv, ctype, status, code):
  before = state(srv)
  headers = {} if ctype is None else {"Content-Type": ctype}
  body = _json({"version": "1", "weights": [0.0] * P})
  assert_refused(srv, before, status, code, request(srv, "POST", "/v1/submit", body, headers))


@pytest.mark.parametrize("attack", ["copy", "average", "shifted", "one_weight", "scaled_noise",
                                    "takeover"])
def test_attack_updates_refused(srv, attack):
  rng = np.random.default_rng(7)
  w, ticket = _drawn_with_ticket(srv)
  snap = srv.call(srv.svc.store.snapshot())
  bad = {"copy": w, "average": snap.slots.mean(axis=0),
         "shifted": honest(SPEC, w, rng) + 0.2,
         "one_weight": np.r_[w[:-1], w[-1] + 0.5],
         "scaled_noise": w + 10 * (honest(SPEC, w, rng) - w),
         "takeover": np.full(P, 1e3)}[attack]
  before = state(srv)
  got = request(srv, "POST", "/v1/submit", np.r_[w, bad].astype("<f8").tobytes(),
                {"Content-Type": "application/octet-stream", "X-DDML-Version": "1",
                 "X-DDML-Ticket": ticket})
  assert_refused(srv, before, 422, "rejected_update", got)
  assert json.loads(got[2])["reason"] in ("step_too_large", "excess_too_large", "too_little_noise")


def test_honest_update_accepted_and_changes_one_slot(srv):
  w, ticket = _drawn_with_ticket(srv)
  before = state(srv)
  st, _, body = request(srv, "POST", "/v1/submit", _json({"version": "1", "weights": honest(SPEC,
      w, np.random.default_rng(1)).tolist(), "ticket": ticket, "drawn": w.tolist()}),
      {"Content-Type": "application/json"})
  assert st == 200 and json.loads(body) == {"accepted": True, "seq": 1}
  after = state(srv)
  assert after[0] == 1 and after[1] != before[1]


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/nope", 404, "not_found"),
    ("GET", "/v1/submit", 405, "method_not_allowed"),
    ("DELETE", "/v1/draw", 405, "method_not_allowed"),
    ("GET", "/v1/draw?encoding=xml", 400, "bad_encoding"),
])
def test_http_errors_are_json(srv, method, path, status, code):
  assert_refused(srv, state(srv), status, code, request(srv, method, path))


@pytest.mark.parametrize("token,status,code", [
    (None, 401, "missing_token"),
    ("wrong-token-0123456789abcdef", 403, "invalid_token"),
])
@pytest.mark.parametrize("path", ["/v1/draw", "/v1/submit", "/v1/model", "/v1/metrics", "/metrics"])
def test_tokens_required(srv, token, status, code, path):
  method = "POST" if path == "/v1/submit" else "GET"
  got = request(srv, method, path, _json({"version": "1", "weights": [0.0] * P}),
                {"Content-Type": "application/json"}, token=token)
  assert_refused(srv, state(srv), status, code, got)
  assert got[1]["WWW-Authenticate"].startswith("Bearer")


def test_server_keeps_only_token_hashes(tmp_path):
  path = tmp_path / "tokens.txt"
  path.write_text(f"# clients\n{TOKEN}\n\n{OTHER}\n")
  ts = auth.TokenSet.from_file(str(path))
  assert len(ts) == 2 and TOKEN not in repr(vars(ts))
  assert ts.identify(f"Bearer {TOKEN}")[0] == auth.token_digest(TOKEN)[:12]
  with pytest.raises(ValueError, match="16 characters"):
    auth.TokenSet(["short"])


@pytest.mark.parametrize("op,path", [("draw", "/v1/draw"), ("submit", "/v1/submit")])
def test_quota_gives_429_with_retry_after(start_service, op, path):
  now = [0.0]
  quotas = auth.Quotas({op: 1.0}, {op: 2}, clock=lambda: now[0])
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), tokens=auth.TokenSet([TOKEN, OTHER]),
                            quotas=quotas, seed=0)
  srv = start_service(svc)
  method = "POST" if op == "submit" else "GET"
  body, h = _json({"version": "2", "weights": [0.0] * P}), {"Content-Type": "application/json"}
  first = [request(srv, method, path, body, h)[0] for _ in range(2)]
  assert 429 not in first
  before = state(srv)
  got = request(srv, method, path, body, h)
  assert_refused(srv, before, 429, "quota_exceeded", got)
  assert got[1]["Retry-After"] == "1"
  assert request(srv, method, path, body, h, token=OTHER)[0] != 429  # quotas are per token
  now[0] += 1.0
  assert request(srv, method, path, body, h)[0] != 429
  st, _, text = request(srv, "GET", "/metrics")
  assert st == 200 and f'ddml_quota_refused_total{{op="{op}"}} 1' in text.decode()


def test_prometheus_metrics(srv):
  request(srv, "GET", "/v1/draw")
  request(srv, "GET", "/nope")
  st, headers, text = request(srv, "GET", "/metrics")
  text = text.decode()
  assert st == 200 and headers["Content-Type"].startswith("text/plain")
  assert "# TYPE ddml_requests_total counter" in text
  assert 'ddml_requests_total{endpoint="/v1/draw",status="200"} 1' in text
  assert 'ddml_errors_total{status="404"} 1' in text
  assert "ddml_request_seconds_bucket" in text


def test_logs_hold_no_client_data_and_no_tracebacks(srv, caplog):
  caplog.set_level(logging.DEBUG)
  for body, _, _ in BAD_JSON:
    request(srv, "POST", "/v1/submit", body, {"Content-Type": "application/json"})
  w, ticket = _drawn_with_ticket(srv)
  st, _, _ = request(srv, "POST", "/v1/submit", _json({"version": "1", "weights": honest(SPEC,
      w, np.random.default_rng(2)).tolist(), "ticket": ticket, "drawn": w.tolist()}),
      {"Content-Type": "application/json"})
  assert st == 200
  text = caplog.text
  assert "Traceback" not in text and TOKEN not in text and "127.0.0.1" not in text
  assert ticket not in text
  assert repr(float(w[0]))[:8] not in text


def test_slow_body_gets_408_and_others_are_served(srv):
  before = state(srv)
  with socket.create_connection(("127.0.0.1", srv.port)) as s:
    s.sendall(b"POST /v1/submit HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"ver")
    assert request(srv, "GET", "/v1/draw")[0] == 200
    s.settimeout(5)
    answer = s.recv(4096)
  assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer
  assert state(srv) == before


def test_connection_cap_and_idle_timeout(start_service):
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), seed=0)
  srv = start_service(svc, limits=http_server.Limits(max_connections=4, max_per_client=4,
                                                     idle_timeout_s=0.5))
  held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
  time.sleep(0.1)
  with socket.create_connection(("127.0.0.1", srv.port)) as extra:
    extra.settimeout(5)
    answer = extra.recv(4096)
  assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
  for s in held:  # slow-header clients: closed after the idle timeout
    s.sendall(b"GET /v1/dr")
  time.sleep(2.0)
  for s in held:
    s.settimeout(5)
    assert s.recv(100) == b""
    s.close()
  assert request(srv, "GET", "/healthz", token=None)[0] == 200


def test_client_reports_quota_wait():
  err = client_lib.DDMLError(429, "quota_exceeded", "x", 3.0)
  assert err.retry_after == 3.0 and "429" in str(err)


@pytest.mark.parametrize("quota", [None, 1.0])
def test_submit_with_next_draw(start_service, quota):
  now = [0.0]
  quotas = None if quota is None else auth.Quotas({"draw": quota}, {"draw": 1}, clock=lambda: now[0])
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), tokens=auth.TokenSet([TOKEN]),
                            quotas=quotas, seed=0)
  srv = start_service(svc)
  rng = np.random.default_rng(3)
  with client_lib.DDMLClient(srv.url, token=TOKEN, insecure=True) as c:
    d = c.draw()  # takes the only draw token when quota is 1
    answer, nxt = c.submit_and_draw(d, honest(SPEC, d.weights, rng))
    assert answer == {"accepted": True, "seq": 1}
    if quota is None:
      assert nxt.weights.shape == (P,) and nxt.version == "1" and nxt.ticket
      assert c.submit_and_draw(nxt, honest(SPEC, nxt.weights, rng))[0]["seq"] == 2
    else:
      assert nxt is None  # over the draw quota: the submit counts, no draw is served


@pytest.mark.parametrize("fault", [store_lib.StoreUnavailable("redis: ConnectionError (simulated)"),
                                   store_lib.StoreLost("redis: flushed (simulated)")],
                         ids=["unavailable", "lost"])
def test_a_stored_submit_whose_next_draw_fails_is_still_acknowledged(start_service, fault):
  """submit?draw=raw: the update is stored, then the store fails the next draw's read. The
  answer acknowledges the update (JSON {"accepted": true, "seq": n}, no draw), like a submit
  over the draw quota. Before: 503 store_unavailable / store_lost ("retry") for a stored
  update, so a caller retrying `update` trained and sent the same records a second time."""
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), tokens=auth.TokenSet([TOKEN]),
                            seed=0)
  srv = start_service(svc)

  async def store_fails(seq):
    raise fault

  with client_lib.DDMLClient(srv.url, token=TOKEN, insecure=True) as c:
    d = c.draw()
    svc.snapshots.at = store_fails
    answer, nxt = c.submit_and_draw(d, honest(SPEC, d.weights, np.random.default_rng(3)))
  assert answer == {"accepted": True, "seq": 1} and nxt is None
  counters = srv.call(svc.store.counters())
  assert counters["seq"] == 1 and counters["accepted"] == 1
