"""HTTP service on the memory and Redis stores: draw, submit, model, metrics, validation."""

import base64
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import client_lib, service, store as store_lib
from tf_dpiter.draw_discard import store_factory
from tf_dpiter.draw_discard.cli import dense_spec, known_weights_spec

from tests.draw_discard.conftest import free_port, honest, http_request

SPEC = dense_spec(12, epsilon=1.0, gamma=0.01)


def _store(kind, request):
  if kind == "memory":
    return store_lib.MemoryStore()
  url = request.getfixturevalue("redis_url")
  return store_factory.make_store(url, prefix=f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture(params=["memory", "redis"])
def svc_and_client(request, start_service):
  svc = service.DDMLService(SPEC, 5, _store(request.param, request), seed=0,
                            influence_steps=None)  # many updates from one address
  srv = start_service(svc)
  with client_lib.DDMLClient(srv.url) as c:
    yield srv, c


def _raw(srv, method, path, body=None, headers=None):
  if body is not None and headers is None:
    headers = {"Content-Type": "application/json"}
  status, _, data = http_request(srv.port, method, path, body, headers)
  return status, data


def _slots(srv):
  snap = srv.call(srv.svc.store.snapshot())
  return [r.tobytes() for r in snap.slots]


def test_draw_submit_model_metrics(svc_and_client):
  srv, c = svc_and_client
  d = c.draw()
  assert d.weights.shape == (12,) and d.spec.num_weights == 12 and d.version == "1"
  before = _slots(srv)
  target = honest(SPEC, d.weights, np.random.default_rng(0))
  assert c.submit(d, target) == {"accepted": True, "seq": 1}
  after = _slots(srv)
  changed = [i for i in range(5) if before[i] != after[i]]
  assert len(changed) == 1
  # rebase: the step (target - drawn) lands on one of the instances held at submit time
  base = store_lib.decode_weights(after[changed[0]]) - (target - d.weights)
  assert min(np.abs(base - store_lib.decode_weights(b)).max() for b in before) < 1e-12
  avg = c.model()
  np.testing.assert_allclose(avg, np.mean([store_lib.decode_weights(s) for s in after], axis=0))
  m = c.metrics()
  assert m["draws"] == 1 and m["accepted"] == 1 and m["k"] == 5 and m["rejected_invalid"] == 0


def test_initialization_has_theorem1_variance(svc_and_client):
  srv, c = svc_and_client
  inst = np.stack([store_lib.decode_weights(s) for s in _slots(srv)])
  # k=5 x 12 = 60 N(0, k/2 sigma^2) draws; sample variance within 60% (chi2_59 central 99.9%).
  want = 2.5 * 8 * 0.01**2 / 1.0**2
  assert 0.4 < inst.var() / want < 1.7


def test_json_list_encoding(svc_and_client):
  srv, _ = svc_and_client
  status, data = _raw(srv, "GET", "/v1/draw")
  d = json.loads(data)
  assert status == 200 and len(d["weights"]) == 12 and d["spec"]["family"] == "logistic"
  w = honest(SPEC, np.array(d["weights"]), np.random.default_rng(1))
  status, data = _raw(srv, "POST", "/v1/submit",
                      json.dumps({"version": "1", "weights": w.tolist(), "ticket": d["ticket"],
                                  "drawn": d["weights"]}).encode())
  assert status == 200 and json.loads(data)["accepted"]


def _b64(n):
  return base64.b64encode(np.zeros(n).tobytes()).decode()


BAD_BODIES = [
    (b"not json", 400, "bad_json"),
    (b"[1, 2]", 400, "bad_json"),
    (json.dumps({"weights": [0.0] * 12}).encode(), 400, "missing_version"),
    (json.dumps({"version": "2", "weights": [0.0] * 12}).encode(), 409, "wrong_version"),
    (json.dumps({"version": "1"}).encode(), 400, "missing_weights"),
    (json.dumps({"version": "1", "weights": [0.0] * 11}).encode(), 422, "wrong_shape"),
    (json.dumps({"version": "1", "weights": [[0.0] * 12]}).encode(), 422, "wrong_shape"),
    (json.dumps({"version": "1", "weights": ["a"] * 12}).encode(), 400, "bad_weights"),
    (json.dumps({"version": "1", "weights": [0.0] * 11 + [float("nan")]}).encode(), 422, "non_finite"),
    (b'{"version": "1", "weights": [' + b"0," * 11 + b"Infinity]}", 422, "non_finite"),
    (json.dumps({"version": "1", "weights_b64": _b64(11)}).encode(), 422, "wrong_shape"),
    (json.dumps({"version": "1", "weights_b64": "@@@"}).encode(), 400, "bad_weights"),
    (json.dumps({"version": "1", "weights": [0.0] * 200000}).encode(), 413, "body_too_large"),
]


@pytest.mark.parametrize("body,status,code", BAD_BODIES, ids=[b[2] + str(i) for i, b in enumerate(BAD_BODIES)])
def test_invalid_submissions_are_4xx_json_and_leave_store_untouched(svc_and_client, body, status, code):
  srv, c = svc_and_client
  before = _slots(srv)
  got, data = _raw(srv, "POST", "/v1/submit", body, {"Content-Type": "application/json"})
  assert got == status
  err = json.loads(data)
  assert err["error"] == code and err["message"]
  assert _slots(srv) == before
  m = c.metrics()
  assert m["rejected_invalid"] == 1 and m["accepted"] == 0


RAW_BAD = [
    ({}, np.zeros(12).tobytes(), 400, "missing_version"),
    ({"X-DDML-Version": "7"}, np.zeros(12).tobytes(), 409, "wrong_version"),
    ({"X-DDML-Version": "1"}, np.zeros(13).tobytes(), 422, "wrong_shape"),
    ({"X-DDML-Version": "1"}, np.r_[np.zeros(11), np.inf].tobytes(), 422, "non_finite"),
]


@pytest.mark.parametrize("headers,body,status,code", RAW_BAD, ids=[r[3] for r in RAW_BAD])
def test_invalid_raw_submissions(svc_and_client, headers, body, status, code):
  srv, c = svc_and_client
  before = _slots(srv)
  got, data = _raw(srv, "POST", "/v1/submit", body,
                   dict(headers, **{"Content-Type": "application/octet-stream"}))
  assert got == status and json.loads(data)["error"] == code
  assert _slots(srv) == before and c.metrics()["rejected_invalid"] == 1


def test_b64_json_submit_and_raw_draw(svc_and_client):
  srv, c = svc_and_client
  status, data = _raw(srv, "GET", "/v1/draw?encoding=b64")
  d = json.loads(data)
  w = np.frombuffer(base64.b64decode(d["weights_b64"]), "<f8")
  assert w.shape == (12,) and d["spec"]["version"] == "1"
  drawn = client_lib.Drawn("1", SPEC, w, d["ticket"])
  assert c.submit_json(drawn, honest(SPEC, w, np.random.default_rng(2)))["accepted"]
  status, data = _raw(srv, "GET", "/v1/draw?encoding=xml")
  assert status == 400 and json.loads(data)["error"] == "bad_encoding"


def test_client_raises_ddml_error(svc_and_client):
  _, c = svc_and_client
  with pytest.raises(client_lib.DDMLError) as e:
    c.submit("1", np.zeros(3))
  assert e.value.status == 422 and e.value.code == "wrong_shape"


def test_acceptance_rule_over_http(start_service):
  svc = service.DDMLService(SPEC, 10, store_lib.MemoryStore(), seed=1)
  srv = start_service(svc)
  with client_lib.DDMLClient(srv.url) as c:
    d = c.draw()
    before = _slots(srv)
    bad = honest(SPEC, d.weights, np.random.default_rng(3)); bad[3] += 1.0
    with pytest.raises(client_lib.DDMLError) as e:
      c.submit(d, bad)
    assert e.value.status == 422 and e.value.code == "rejected_update"
    assert _slots(srv) == before
    assert c.submit(d, honest(SPEC, d.weights, np.random.default_rng(4)))["accepted"]
    m = c.metrics()
    assert m["rejected"] == 1 and m["accepted"] == 1
    assert m["acceptance"]["rule"] == "bounded_influence" and m["acceptance"]["alpha"] == 1e-3


def test_client_that_never_returns_blocks_nothing(svc_and_client):
  srv, c = svc_and_client
  # A client draws and vanishes; another opens a connection, sends half a body and stalls.
  c.draw()
  import socket
  stall = socket.create_connection(("127.0.0.1", srv.port))
  stall.sendall(b"POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"ver")
  t0 = time.time()
  rng = np.random.default_rng(5)
  with client_lib.DDMLClient(srv.url) as other:
    for _ in range(20):
      d = other.draw()
      other.submit(d, honest(SPEC, d.weights, rng))
  assert time.time() - t0 < 10
  assert c.metrics()["accepted"] == 20
  stall.close()


def test_client_update_runs_algorithm1(svc_and_client):
  srv, c = svc_and_client
  rng = np.random.default_rng(0)
  for _ in range(5):
    c.update({"x": rng.random((10, 11))}, rng.integers(0, 2, 10), rng=rng)
  assert c.metrics()["accepted"] == 5


def test_concurrent_clients_all_land(svc_and_client):
  srv, c = svc_and_client
  errors, refused = [], []

  def worker(seed):
    rng = np.random.default_rng(seed)
    try:
      with client_lib.DDMLClient(srv.url) as cc:
        for _ in range(25):
          d = cc.draw()
          try:
            cc.submit(d, honest(SPEC, d.weights, rng))
          except client_lib.DDMLError as e:  # the rule's documented false rejections
            (refused if e.code == "rejected_update" else errors).append(e)
    except (client_lib.DDMLError, OSError) as e:
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors and len(refused) <= 2  # bound: alpha = 0.1 % per update
  m = c.metrics()
  assert m["accepted"] == 200 - len(refused) and m["draws"] == 200
  assert m["rejected"] == len(refused) and m["submits"] == 200


def test_redis_store_rejects_mismatched_model(redis_url):
  import asyncio
  prefix = f"t{uuid.uuid4().hex[:8]}"

  def make():
    s = store_factory.make_store(redis_url, prefix)
    s.integrity_key = bytes(32)
    return s

  async def go():
    s1 = make()
    meta = dict(version="1", k=3, num_weights=4, fingerprint="f", history=8)
    assert await s1.initialize(meta, np.zeros((3, 4)))
    s2 = make()
    assert not await s2.initialize(meta, np.ones((3, 4)))  # joins, keeps the first instances
    assert (await s2.snapshot()).slots.sum() == 0 and s2.generation == s1.generation
    for key, value in (("version", "2"), ("fingerprint", "g"), ("history", 9)):
      with pytest.raises(store_lib.StoreMismatch, match=key):
        await make().initialize(dict(meta, **{key: value}),
                                                                 np.zeros((3, 4)))
    await s1.close(); await s2.close()

  asyncio.run(go())


def test_make_store_rejects_unknown():
  with pytest.raises(ValueError, match="store"):
    store_factory.make_store("memcache://x")


def _wait_healthy(port, proc, timeout=60):
  last = None
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-2000:]}")
    try:
      conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
      conn.request("GET", "/healthz")
      r = conn.getresponse()
      last = (r.status, r.read()[:300])
      if r.status == 200:
        return
      time.sleep(0.2)
    except OSError as e:
      last = e
      time.sleep(0.2)
  raise RuntimeError(f"server did not become healthy: {last!r}")


def test_two_server_processes_share_one_redis_store(redis_url, tmp_path):
  spec_path = tmp_path / "spec.json"
  spec = known_weights_spec()
  spec_path.write_text(spec.to_json())
  prefix = f"t{uuid.uuid4().hex[:8]}"
  ports = [free_port(), free_port()]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.getcwd(),
             DDML_SECRET=os.urandom(32).hex())
  procs = [subprocess.Popen([sys.executable, "-m", "tf_dpiter.draw_discard.cli", "serve", "--k", "7",
                             "--model", str(spec_path), "--store", redis_url, "--prefix", prefix,
                             "--port", str(p), "--model-interval", "0", "--draw-quota", "none",
                             "--influence-steps", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env) for p in ports]
  try:
    for p, proc in zip(ports, procs):
      _wait_healthy(p, proc)
    a = client_lib.DDMLClient(f"http://127.0.0.1:{ports[0]}", max_epsilon=None)  # noiseless spec
    b = client_lib.DDMLClient(f"http://127.0.0.1:{ports[1]}", max_epsilon=None)
    avg0 = a.model()
    np.testing.assert_array_equal(avg0, b.model())  # one initialization, shared
    rng = np.random.default_rng(0)
    rows = [{"B": 1, "E1": "B", "E2": "c", "D": 1.0, "I": 2}] * 5
    for i in range(30):
      (a if i % 2 else b).update(rows, np.ones(5), rng=rng)
    ma, mb = a.metrics(), b.metrics()
    assert ma["accepted"] == mb["accepted"] == 30 and ma["draws"] == 30
    np.testing.assert_array_equal(a.model(), b.model())
    assert not np.array_equal(a.model(), avg0)
    with pytest.raises(client_lib.DDMLError) as e:
      b.submit("0", np.zeros(33))
    assert e.value.status == 409
    a.close(); b.close()
  finally:
    for proc in procs:
      proc.terminate()
    for proc in procs:
      proc.wait(20)


def test_async_client_roundtrip(svc_and_client):
  import asyncio
  srv, c = svc_and_client

  async def go():
    ac = client_lib.AsyncDDMLClient(srv.url)
    try:
      rng = np.random.default_rng(1)
      await asyncio.gather(*[ac.update({"x": rng.random((4, 11))}, np.ones(4), rng=rng)
                             for _ in range(10)])
      avg = await ac.model()
      with pytest.raises(client_lib.DDMLError):
        await ac.submit("nope", np.zeros(12))
      return avg
    finally:
      await ac.close()

  avg = asyncio.run(go())
  assert avg.shape == (12,) and c.metrics()["accepted"] == 10
