"""Operations: SIGHUP token reload, guessing throttle, scrubbed logs, exposure checks, clients."""

import asyncio
import json
import logging
import signal
import socket
import time

import pytest

from tf_dpiter.draw_discard import auth, cli, client_lib, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_factory

from tests.draw_discard.conftest import free_port, http_status as _status
from tests.draw_discard.conftest import serve_process, wait_serving

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdefgh"


def test_sighup_reloads_tokens_and_keeps_serving(tmp_path):
  spec_path, tokens = tmp_path / "spec.json", tmp_path / "tokens.txt"
  spec_path.write_text(SPEC.to_json())
  tokens.write_text(f"{ALICE}\n{BOB}\n")
  port = free_port()
  proc = serve_process(spec_path, tokens, port)
  try:
    wait_serving(port, BOB)
    assert _status(port, BOB) == 200
    tokens.write_text(f"{ALICE}\n")  # revoke Bob
    proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 10
    while _status(port, BOB) == 200 and time.time() < deadline:
      time.sleep(0.05)
    assert _status(port, BOB) == 403
    assert _status(port, ALICE) == 200 and proc.poll() is None
  finally:
    proc.terminate()
    proc.wait(20)


def test_token_guessing_is_throttled_per_address(start_service):
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0,
                            tokens=auth.TokenSet([ALICE]))
  svc.auth_throttle = auth.AuthThrottle(rate=1.0, burst=10, clock=lambda: 0.0)  # time frozen
  srv = start_service(svc)
  codes = [_status(srv.port, f"guess-{i:04d}-0123456789abcdef") for i in range(40)]
  assert codes == [403] * 10 + [429] * 30  # burst 10, then nothing until it refills
  assert _status(srv.port, ALICE) == 429  # the address is throttled, whatever it sends
  assert _status(srv.port, ALICE, src="127.0.0.2") == 200  # other addresses are not


def test_logs_hold_no_addresses_tokens_or_tracebacks(start_service, caplog):
  caplog.set_level(logging.DEBUG)
  srv = start_service(service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0,
                                          tokens=auth.TokenSet([ALICE])))
  secret_ish = "S3CRET" + "x" * 20000
  for raw in (b"GARBAGE \x00\x01\r\n\r\n",
              f"GET /v1/spec HTTP/1.1\r\nAuthorization: Bearer {secret_ish}\r\n\r\n".encode(),
              b"GET /v1/spec HTTP/1.1\r\nContent-Length: -1\r\n\r\n"):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
      s.sendall(raw)
      s.recv(4096)
  time.sleep(0.2)
  for rec in caplog.records:
    if rec.name.startswith(("aiohttp", "asyncio", "tf_dpiter")):
      msg = rec.getMessage()
      json.loads(msg)  # one JSON object per record
      assert "127.0.0.1" not in msg and "S3CRET" not in msg, msg
  assert "Traceback" not in caplog.text and "S3CRET" not in caplog.text


def test_cli_refuses_a_public_address_without_tls_or_tokens(tmp_path, capsys):
  spec_path = tmp_path / "spec.json"
  spec_path.write_text(SPEC.to_json())
  assert cli.main(["serve", "--model", str(spec_path), "--host", "0.0.0.0"]) == 2
  assert "--insecure" in capsys.readouterr().err


def test_clients_refuse_tokens_over_plain_http():
  with pytest.raises(ValueError, match="https"):
    client_lib.DDMLClient("http://127.0.0.1:9", token=ALICE)
  with pytest.raises(ValueError, match="https"):
    client_lib.AsyncDDMLClient("http://127.0.0.1:9", token=ALICE)
  client_lib.DDMLClient("http://127.0.0.1:9").close()  # without a token: fine


def test_privacy_floor_on_every_submit_path(start_service):
  noiseless = cli.dense_spec(9, gamma=0.01, epsilon=None, noise="none")
  srv = start_service(service.DDMLService(noiseless, 4, store_lib.MemoryStore(), seed=0))
  with client_lib.DDMLClient(srv.url) as c:
    d = c.draw()  # drawing reveals nothing of the client's data
    w = d.weights + 0.001
    for send in (c.submit, c.submit_and_draw, c.submit_json):
      with pytest.raises(client_lib.PrivacyFloorError):
        send(d, w)
    with pytest.raises(client_lib.PrivacyFloorError):
      c.submit(d.version, w)  # a bare version: the floor checks the served spec

  async def go():
    a = client_lib.AsyncDDMLClient(srv.url)
    try:
      dd = await a.draw()
      with pytest.raises(client_lib.PrivacyFloorError):
        await a.submit(dd, dd.weights)
    finally:
      await a.close()

  asyncio.run(go())
  assert srv.call(srv.svc.store.counters())["submits"] == 0


def test_internal_error_is_one_json_line_without_its_message(start_service, caplog):
  caplog.set_level(logging.DEBUG)
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0)

  async def broken():
    raise RuntimeError("client data 127.0.0.1 S3CRET")

  svc.snapshots.for_draw = broken
  srv = start_service(svc)
  assert _status(srv.port, path="/v1/draw") == 500
  lines = [r.getMessage() for r in caplog.records if "internal_error" in r.getMessage()]
  assert len(lines) == 1 and "\n" not in lines[0]
  entry = json.loads(lines[0])
  assert entry["error"] == "RuntimeError" and entry["frames"]
  assert "S3CRET" not in caplog.text and "Traceback" not in caplog.text


def test_redis_url_password_is_not_in_messages():
  from tf_dpiter.draw_discard import redis_store
  s = redis_store.RedisStore("redis://user:hunter2pw@127.0.0.1:1/0")
  assert "hunter2pw" not in s.url and s.url == "redis://user:***@127.0.0.1:1/0"


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
@pytest.mark.parametrize("name,a,b", [("draw_min_updates", 4, 1),
                                      ("new_identity_share", None, 0.5),
                                      ("new_identity_share", 0.5, 0.25)])
def test_join_check_covers_draw_gate_and_new_identity_share(request, store_kind, name, a, b):
  """Servers of one store must share the draw gate's m and the new-identity cap: a server
  with another value is refused (StoreMismatch naming the setting), one with the same joins."""
  import uuid
  if store_kind == "memory":
    shared = store_lib.MemoryStore()
    make = lambda: shared  # noqa: E731 (one store object, as servers of one process share it)
  else:
    url, prefix = request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:8]}"
    make = lambda: store_factory.make_store(url, prefix)  # noqa: E731
  secret = bytes(range(32))

  def svc(value):
    return service.DDMLService(SPEC, 4, make(), seed=0, secret=secret, **{name: value})

  async def go():
    first, same, other = svc(a), svc(a), svc(b)
    try:
      await first.startup()
      await same.startup()  # the same settings: joins
      with pytest.raises(store_lib.StoreMismatch, match=f"setting {name}="):
        await other.startup()
    finally:
      if store_kind == "redis":
        for s in (first, same, other):
          await s.shutdown()

  asyncio.run(go())
