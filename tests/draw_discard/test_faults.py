"""Store faults, TLS, the client's privacy floor and the command line's errors."""

import asyncio
import http.client
import json
import logging
import runpy
import ssl
import sys
import time
import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, client_lib, http_server, service
from tf_dpiter.draw_discard import cli, glm, store as store_lib
from tf_dpiter.draw_discard import store_factory

from tests.draw_discard.conftest import honest, http_request

SPEC = cli.dense_spec(33, epsilon=1.0, gamma=0.01)
TOKEN = "alice-token-0123456789abcdef"


def get(port, path, body=None, method="GET"):
  headers = {"Content-Type": "application/octet-stream", "X-DDML-Version": "1"} if body else {}
  status, h, data = http_request(port, method, path, body, headers)
  return status, h.get("Content-Type"), data


def _redis_store(url, prefix=None, **kw):
  return store_factory.make_store(url, prefix or f"t{uuid.uuid4().hex[:8]}", **kw)


def _valid_submit(srv):
  """(raw body, headers) of an honest update of an instance drawn now, with its ticket."""
  st, _, data = get(srv.port, "/v1/draw")
  assert st == 200
  d = json.loads(data)
  w = np.array(d["weights"])
  u = honest(SPEC, w, np.random.default_rng(0))
  return np.r_[w, u].astype("<f8").tobytes(), {"Content-Type": "application/octet-stream",
                                                "X-DDML-Version": "1", "X-DDML-Ticket": d["ticket"]}


def _lost_everywhere(srv, code, submit):
  """Every request that needs the store gets 503 `code` (`submit`: a valid one, _valid_submit);
  a malformed submit still gets its 4xx (validation needs no store)."""
  for method, path, body, headers in (("GET", "/v1/draw", None, None),
                                      ("POST", "/v1/submit") + submit,
                                      ("GET", "/v1/model", None, None),
                                      ("GET", "/healthz", None, None)):
    st, h, data = http_request(srv.port, method, path, body, headers)
    assert st == 503 and h.get("Content-Type").startswith("application/json"), (path, data)
    assert json.loads(data)["error"] == code
  st, _, data = get(srv.port, "/v1/submit", np.zeros(SPEC.num_weights).tobytes(), "POST")
  assert st == 400 and json.loads(data)["error"] == "missing_ticket"
  st, _, text = get(srv.port, "/metrics")
  assert st == 200 and f"ddml_{code}_total" in text.decode()


def test_memory_store_loss_gives_503_and_no_refill(start_service):
  srv = start_service(service.DDMLService(SPEC, 20, store_lib.MemoryStore(), seed=0))
  submit = _valid_submit(srv)
  srv.svc.store.flush()
  _lost_everywhere(srv, "store_lost", submit)
  with pytest.raises(store_lib.StoreLost):
    srv.call(srv.svc.store.snapshot())  # nothing was written back


@pytest.mark.parametrize("fault", ["flushall", "reinitialized"])
def test_redis_store_loss_gives_503_and_no_refill(start_service, redis_url, fault):
  import redis
  store = _redis_store(redis_url)
  srv = start_service(service.DDMLService(SPEC, 20, store, seed=0))
  submit = _valid_submit(srv)
  r = redis.Redis.from_url(redis_url)
  if fault == "flushall":
    r.flushall()
  else:
    r.set(f"{store.prefix}:gen", b"someone-else")
  _lost_everywhere(srv, "store_lost", submit)
  slots = [k for k in r.keys(f"{store.prefix}:slot:*")]
  assert (slots == []) if fault == "flushall" else len(slots) == 20
  r.close()


def test_redis_outage_gives_503_store_unavailable(start_service, own_redis, caplog):
  url, proc = own_redis
  srv = start_service(service.DDMLService(SPEC, 20, _redis_store(url), seed=0))
  assert get(srv.port, "/healthz")[0] == 200
  submit = _valid_submit(srv)
  proc.terminate()
  proc.wait(10)
  time.sleep(2 * srv.svc.draw_max_age_s)  # the submit reads the store (no cached snapshot)
  caplog.set_level(logging.INFO)
  for _ in range(10):
    _lost_everywhere(srv, "store_unavailable", submit)
  lines = [r for r in caplog.records if "store_unavailable" in r.getMessage()]
  assert len(lines) <= 2  # rate-limited: 40 failing requests, not 40 log lines
  assert "Traceback" not in caplog.text


def test_redis_init_lock_expires(redis_url):
  import redis
  prefix = f"t{uuid.uuid4().hex[:8]}"
  r = redis.Redis.from_url(redis_url)
  r.set(f"{prefix}:init", b"crashed-initializer", px=600)  # a server died holding the lock
  meta = dict(version="1", k=3, num_weights=4, fingerprint="f", history=2)

  async def go():
    s = _redis_store(redis_url, prefix, lock_ttl_s=5.0)
    s.integrity_key = bytes(32)
    wrote = await s.initialize(meta, np.zeros((3, 4)), wait_s=5.0)
    await s.close()
    return wrote

  assert asyncio.run(go())
  r.close()


@pytest.mark.parametrize("change", [dict(gamma=0.02), dict(epsilon=2.0), dict(family="poisson"),
                                    dict(clip=0.5), dict(noise="gaussian")])
def test_join_refuses_a_different_spec(redis_url, change):
  prefix = f"t{uuid.uuid4().hex[:8]}"

  async def go():
    a = service.DDMLService(SPEC, 20, _redis_store(redis_url, prefix), seed=0)
    await a.startup()
    other = cli.dense_spec(33, **dict(dict(epsilon=1.0, gamma=0.01), **change))
    b = service.DDMLService(other, 20, _redis_store(redis_url, prefix), seed=0)
    try:
      with pytest.raises(store_lib.StoreMismatch, match="fingerprint"):
        await b.startup()
    finally:
      await a.shutdown()
      await b.shutdown()

  asyncio.run(go())


def test_tls_with_tokens(start_service, tls_files):
  cert, key = tls_files
  svc = service.DDMLService(SPEC, 20, store_lib.MemoryStore(), tokens=auth.TokenSet([TOKEN]),
                            seed=0)
  srv = start_service(svc, ssl_context=http_server.tls_context(cert, key))
  with client_lib.DDMLClient(srv.url, token=TOKEN, cafile=cert) as c:
    c.update({"x": np.random.default_rng(0).random((5, 32))}, np.ones(5))
    assert c.metrics()["accepted"] == 1
  with pytest.raises(ssl.SSLCertVerificationError):
    client_lib.DDMLClient(srv.url, token=TOKEN).spec()  # unknown CA: refused
  with client_lib.DDMLClient(srv.url, cafile=cert) as c, pytest.raises(client_lib.DDMLError) as e:
    c.spec()
  assert e.value.status == 401
  with pytest.raises((ConnectionError, http.client.HTTPException)):
    client_lib.DDMLClient(f"http://127.0.0.1:{srv.port}").spec()  # plain HTTP to a TLS port


def _served(start_service, spec):
  return start_service(service.DDMLService(spec, 20, store_lib.MemoryStore(), seed=0))


@pytest.mark.parametrize("spec_change,floor,match", [
    (dict(epsilon=None, noise="none"), {}, "no noise"),
    (dict(epsilon=1.0, noise="none"), {}, "no noise"),
    (dict(epsilon=10.0), {}, "max_epsilon"),
    (dict(epsilon=1.0), dict(max_epsilon=0.5), "max_epsilon"),
    (dict(epsilon=1.0), dict(min_noise=2.0), "min_noise"),
    (dict(epsilon=1.0, noise="gaussian", delta=1e-3), {}, "max_delta"),
    # 33 weights at epsilon 1: a record moving every weight costs up to 33 per update
    (dict(epsilon=1.0), dict(max_total_epsilon=32.0), "max_total_epsilon=32"),
])
def test_client_privacy_floor_refuses_weaker_specs(start_service, spec_change, floor, match):
  spec = cli.dense_spec(33, **dict(dict(gamma=0.01), **spec_change))
  srv = _served(start_service, spec)
  with client_lib.DDMLClient(srv.url, **floor) as c:
    with pytest.raises(client_lib.PrivacyFloorError, match=match):
      c.update({"x": np.random.default_rng(0).random((5, 32))}, np.ones(5))
    assert c.metrics()["submits"] == 0


def test_client_privacy_floor_accepts_paper_settings(start_service):
  srv = _served(start_service, cli.dense_spec(33, epsilon=float(np.log(32)), gamma=0.01))
  with client_lib.DDMLClient(srv.url, min_noise=0.4, max_total_epsilon=33 * np.log(32)) as c:
    assert c.update({"x": np.random.default_rng(0).random((5, 32))}, np.ones(5))["accepted"]


@pytest.mark.parametrize("argv,match", [
    (["serve", "--model", "/nonexistent/spec.json"], "No such file"),
    (["serve", "--model", "{spec}", "--tokens", "/nonexistent/tokens"], "No such file"),
    (["serve", "--model", "{spec}", "--tls-cert", "{spec}"], "go together"),
    (["serve", "--model", "{spec}", "--store", "memcache://x"], "store must be"),
    (["serve", "--model", "{spec}", "--k", "1"], "`k` must be"),
    (["serve", "--model", "{spec}", "--alpha", "2"], "`alpha` must be"),
    (["serve", "--model", "{bad}"], "error"),
    (["privacy", "--epsilon", "-1", "--k", "20"], "`epsilon` must be"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, match):
  spec_path, bad = tmp_path / "spec.json", tmp_path / "bad.json"
  spec_path.write_text(SPEC.to_json())
  bad.write_text("{not json")
  argv = [a.format(spec=spec_path, bad=bad) for a in argv]
  assert cli.main(argv) == 2   # in process: main returns the exit status
  err = capsys.readouterr().err
  assert "Traceback" not in err and match in err
  assert err.startswith("tf-dpiter-ddml: error:") and err.count("\n") == 1


def test_cli_error_exit_status_of_the_installed_entry_point(tmp_path, capsys, monkeypatch):
  """The module entry point (`python -m tf_dpiter.draw_discard.cli`, what the
  `tf-dpiter-ddml` script runs) turns main's status into the process's exit status: the module
  run as the main module in this process (runpy, what `-m` does), its SystemExit's code."""
  monkeypatch.setattr(sys, "argv", ["tf_dpiter.draw_discard.cli", "serve", "--model",
                                    str(tmp_path / "missing.json")])
  # a fresh interpreter has not imported the module yet (runpy warns when it has)
  monkeypatch.delitem(sys.modules, "tf_dpiter.draw_discard.cli")
  capsys.readouterr()
  with pytest.raises(SystemExit) as stop:
    runpy.run_module("tf_dpiter.draw_discard.cli", run_name="__main__", alter_sys=True)
  err = capsys.readouterr().err
  assert stop.value.code == 2
  assert "Traceback" not in err and "No such file" in err


def test_spec_from_json_refuses_unknown_noise():
  d = json.loads(SPEC.to_json())
  d["noise"] = "off"
  with pytest.raises(ValueError, match="noise"):
    glm.ModelSpec.from_dict(d)


def test_memory_store_warns_that_a_restart_loses_every_update(caplog):
  """The default store keeps the model in the process: a restart silently started a new
  model (all accepted updates gone) with no log line saying so. Now a warning at start-up."""
  import asyncio
  import json
  import logging
  from tf_dpiter.draw_discard import cli, service
  from tf_dpiter.draw_discard import store as store_lib
  caplog.set_level(logging.INFO)
  svc = service.DDMLService(cli.dense_spec(4, epsilon=1.0, gamma=0.01), 3,
                            store_lib.MemoryStore(), seed=0)
  asyncio.run(svc.startup())
  events = [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "tf_dpiter.draw_discard.service_setup"]
  warned = [e for e in events if e["event"] == "memory_store_not_durable"]
  assert len(warned) == 1 and "restart" in warned[0]["detail"]
  assert any(r.levelno == logging.WARNING and "memory_store_not_durable" in r.getMessage()
             for r in caplog.records)
  asyncio.run(svc.shutdown())


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 0.0, -1.0])
def test_ticket_lifetime_must_be_finite(ttl):
  """Before: ticket_ttl_s=inf was accepted; on Redis every submit then failed with
  OverflowError (500: the nonce's PX milliseconds), in memory the nonce table grew forever."""
  from tf_dpiter.draw_discard import cli, service
  from tf_dpiter.draw_discard import store as store_lib
  with pytest.raises(ValueError, match="`ticket_ttl_s` must be a finite number > 0"):
    service.DDMLService(cli.dense_spec(3, epsilon=1.0, gamma=0.01), 3, store_lib.MemoryStore(),
                        ticket_ttl_s=ttl)


@pytest.mark.parametrize("setting", ["influence_half_life_s", "model_interval_s"])
def test_half_life_and_release_interval_must_be_finite(setting):
  """Before: both took inf; on Redis every submit then failed part-way through the REPLACE
  script (PEXPIRE of an infinite half-life: 'value is not an integer', after the slot, nonce
  and counters were written but before the sequence number moved), and every /v1/model
  raised OverflowError. None already means "no decay"."""
  from tf_dpiter.draw_discard import cli, service
  from tf_dpiter.draw_discard import store as store_lib
  with pytest.raises(ValueError, match="finite"):
    service.DDMLService(cli.dense_spec(3, epsilon=1.0, gamma=0.01), 3, store_lib.MemoryStore(),
                        **{setting: float("inf")})


def test_redis_out_of_memory_is_503_store_unavailable_and_refunds(own_redis):
  """A Redis at maxmemory (noeviction) refuses the scripts before their first write. Before:
  redis-py's OutOfMemoryError reached the middleware as a 500 internal_error for every draw and
  submit. Now StoreRefused (a StoreUnavailable: 503 store_unavailable, Retry-After), nothing
  written, and the submit's budget step refunded (the refusal is certain, unlike a timeout)."""
  import asyncio
  import uuid
  import redis
  from tf_dpiter.draw_discard import cli, parsing, service, store_factory, sybil
  from tf_dpiter.draw_discard import store as store_lib
  from tests.draw_discard.conftest import honest
  url, _ = own_redis
  spec = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
  prefix = f"t{uuid.uuid4().hex[:8]}"
  rng = np.random.default_rng(8)

  async def run():
    svc = service.DDMLService(spec, 4, store_factory.make_store(url, prefix), seed=0,
                              secret=bytes(range(32)), influence_steps=None)
    await svc.startup()
    r = redis.Redis.from_url(url)
    try:
      h, ticket = await svc.draw_for("me")
      slots = [r.get(f"{prefix}:slot:{i}") for i in range(4)]
      r.config_set("maxmemory-policy", "noeviction")
      r.config_set("maxmemory", "1")
      with pytest.raises(store_lib.StoreRefused):
        await svc.store_ticketed("me", parsing.Submission(honest(spec, h, rng), h, ticket))
      with pytest.raises(store_lib.StoreUnavailable):
        await svc.draw_for("me")
      r.config_set("maxmemory", "0")
      assert [r.get(f"{prefix}:slot:{i}") for i in range(4)] == slots
      assert svc.budget.state(sybil.budget_key("me", False))[0] == 0
      # Redis has memory again and the store was never lost: the same ticket now lands
      assert await svc.store_ticketed(
          "me", parsing.Submission(honest(spec, h, rng), h, ticket)) == 1
    finally:
      r.config_set("maxmemory", "0")
      r.close()
      await svc.shutdown()

  asyncio.run(run())
