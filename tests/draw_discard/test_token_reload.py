"""SIGHUP while the server starts, partial token files, revoked tokens.

Loopback only; each test is bounded (a few seconds, a few dozen requests).
"""

import asyncio
import os
import signal
import time

import pytest

from tf_dpiter.draw_discard import auth, cli, service
from tf_dpiter.draw_discard import store as store_lib

from tests.draw_discard.conftest import free_port, http_status as _status
from tests.draw_discard.conftest import serve_process, wait_serving

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
TOKENS = [f"token-{i:02d}-0123456789abcdef" for i in range(40)]
ALICE, BOB = TOKENS[0], TOKENS[1]


def _write(path, tokens, age_s=5.0):
  path.write_text("".join(t + "\n" for t in tokens))
  past = time.time() - age_s
  os.utime(path, (past, past))


def _open_fifo_writer(path, deadline):
  """Opens the FIFO for writing once the server is blocked opening it for reading."""
  while time.time() < deadline:
    try:
      return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet
      time.sleep(0.02)
  raise TimeoutError("the server never opened the token file")


def test_sighup_while_the_server_starts_is_kept_for_after_startup(tmp_path):
  """The server is held inside its start-up (reading a FIFO token file) when SIGHUP
  arrives: it must survive and apply the reload once serving."""
  spec_path, path = tmp_path / "spec.json", tmp_path / "tokens.txt"
  spec_path.write_text(SPEC.to_json())
  os.mkfifo(path)
  port = free_port()
  proc = serve_process(spec_path, path, port)
  try:
    fd = _open_fifo_writer(str(path), time.time() + 60)
    proc.send_signal(signal.SIGHUP)  # the server is inside main(), before its event loop
    time.sleep(0.2)
    assert proc.poll() is None, "SIGHUP during start-up killed the server"
    newer = tmp_path / "tokens.new"
    _write(newer, [ALICE])
    os.replace(newer, path)  # what the reload will read: Bob revoked
    os.write(fd, f"{ALICE}\n{BOB}\n".encode())  # what start-up reads
    os.close(fd)
    wait_serving(port, ALICE)
    deadline = time.time() + 10
    while _status(port, BOB) == 200 and time.time() < deadline:
      time.sleep(0.05)
    assert _status(port, BOB) == 403 and _status(port, ALICE) == 200
    assert proc.poll() is None
  finally:
    proc.terminate()
    proc.wait(20)


def test_a_partial_token_file_keeps_the_old_set(tmp_path):
  path = tmp_path / "tokens.txt"
  _write(path, TOKENS)
  ts = auth.TokenSet.from_file(str(path))
  assert len(ts) == 40
  path.write_text("".join(t + "\n" for t in TOKENS[:20]) + TOKENS[20][:18])  # cut mid-token
  past = time.time() - 5
  os.utime(path, (past, past))
  with pytest.raises(ValueError, match="newline"):
    ts.reload()
  _write(path, TOKENS[:20], age_s=0.0)  # cut between lines, still being written
  with pytest.raises(auth.TokenFileUnsettled):
    ts.reload()
  assert len(ts) == 40 and all(ts.identify(f"Bearer {t}")[0] for t in TOKENS)


def test_sighup_during_a_non_atomic_rewrite_reads_the_whole_file(tmp_path):
  """The operator rewrites the file in place; SIGHUP lands after half of it."""
  path = tmp_path / "tokens.txt"
  _write(path, TOKENS)
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0,
                            tokens=auth.TokenSet.from_file(str(path)))

  async def rewrite():
    with open(path, "w", encoding="utf-8") as f:
      f.write("".join(t + "\n" for t in TOKENS[:20]))
      f.flush()
      svc.reload_tokens()  # the SIGHUP
      await asyncio.sleep(0.3)
      f.write("".join(t + "\n" for t in TOKENS[20:]))
    await asyncio.sleep(1.5)  # auth.SETTLE_S (1 s) after the last write, and a margin

  asyncio.run(rewrite())
  accepted = sum(svc.tokens.identify(f"Bearer {t}")[0] is not None for t in TOKENS)
  assert accepted == 40


def test_a_revoked_clients_retries_do_not_throttle_its_address(start_service, tmp_path):
  path = tmp_path / "tokens.txt"
  _write(path, [ALICE, BOB])
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0,
                            tokens=auth.TokenSet.from_file(str(path)))
  svc.auth_throttle = auth.AuthThrottle(rate=1.0, burst=10, clock=lambda: 0.0)  # time frozen
  srv = start_service(svc)
  _write(path, [ALICE])  # revoke Bob

  async def reload():
    svc.reload_tokens()

  srv.call(reload())
  assert [_status(srv.port, BOB) for _ in range(30)] == [403] * 30
  assert _status(srv.port, ALICE) == 200  # same address, not throttled
  guesses = [_status(srv.port, f"guess-{i:04d}-0123456789abcdef") for i in range(11)]
  assert guesses == [403] * 10 + [429]  # guessing is still throttled
