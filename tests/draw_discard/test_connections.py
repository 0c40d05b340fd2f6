"""Connection accounting: TLS handshakes counted, fair eviction, churn, per-token caps.

Loopback only: several client addresses are 127.0.0.x (Linux routes all of 127/8 to lo).
"""

import socket
import ssl
import time

import pytest

from tf_dpiter.draw_discard import auth, cli, http_server, service
from tf_dpiter.draw_discard import store as store_lib

from tests.draw_discard.conftest import connect_from as _sock

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
TOKEN = "carol-token-0123456789abcdef"


def _svc(**kw):
  return service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, **kw)


def _get(s, path="/v1/spec", token=None, close=False):
  head = f"GET {path} HTTP/1.1\r\nHost: x\r\n"
  head += f"Authorization: Bearer {token}\r\n" if token else ""
  head += "Connection: close\r\n" if close else ""
  s.sendall((head + "\r\n").encode())
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = s.recv(65536)
    if not chunk:
      break
    data += chunk
  return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1") else None


def _closed_by_server(s, wait=3.0):
  s.settimeout(wait)
  try:
    return s.recv(1) == b""
  except (ConnectionResetError, ssl.SSLError):
    return True
  except socket.timeout:
    return False


def _closed_count(socks, expect, timeout=3.0):
  """How many of `socks` the server closed (waits up to `timeout` for `expect` of them)."""
  closed, deadline = set(), time.time() + timeout
  while time.time() < deadline:
    for i, s in enumerate(socks):
      if i not in closed and _closed_by_server(s, 0.01):
        closed.add(i)
    if len(closed) >= expect:
      break
  time.sleep(0.1)
  return len(closed) + sum(_closed_by_server(s, 0.01) for i, s in enumerate(socks)
                           if i not in closed)


def _count(srv):
  return srv.call(_async(srv.svc.connection_guard.count))


async def _async(f, *a):
  return f(*a)


def _settle(srv, want, timeout=5.0):
  deadline = time.time() + timeout
  while _count(srv) != want and time.time() < deadline:
    time.sleep(0.05)
  return _count(srv)


def test_tls_handshakes_count_against_the_address_cap(start_service, tls_files):
  cert, key = tls_files
  srv = start_service(_svc(), ssl_context=http_server.tls_context(cert, key),
                      limits=http_server.Limits(max_connections=64, max_per_client=8,
                                                idle_timeout_s=5.0))
  held = [_sock(srv.port) for _ in range(30)]  # TCP only: no handshake ever starts
  assert _settle(srv, 8) == 8
  assert _closed_count(held, 22) == 22
  ctx = ssl.create_default_context(cafile=cert)  # another address still gets in over TLS
  with ctx.wrap_socket(_sock(srv.port, "127.0.0.2"), server_hostname="127.0.0.1") as t:
    assert _get(t) == 200
  for s in held:
    s.close()


def test_full_table_evicts_the_heaviest_address(start_service):
  srv = start_service(_svc(), limits=http_server.Limits(max_connections=20, max_per_client=20,
                                                        idle_timeout_s=10.0))
  held = [_sock(srv.port, f"127.0.0.{2 + i % 5}") for i in range(20)]  # 5 addresses x 4
  assert _settle(srv, 20) == 20
  newcomers = [_sock(srv.port, f"127.0.1.{n + 1}") for n in range(3)]
  assert [_get(s) for s in newcomers] == [200] * 3  # each evicted one idle connection
  assert _closed_count(held, 3) == 3
  with _sock(srv.port, "127.0.0.2") as s:  # a heavy address cannot evict its peers' share
    assert _get(s) == 503
  for s in held + newcomers:
    s.close()


def test_connect_close_churn_does_not_fill_the_table(start_service):
  srv = start_service(_svc(), limits=http_server.Limits(max_connections=16, max_per_client=8,
                                                        idle_timeout_s=10.0))
  for _ in range(300):  # a churning address: connect and close at once
    _sock(srv.port, "127.0.0.3").close()
  ok = 0
  for _ in range(200):  # honest NAT churn: one request per connection, sequentially
    with _sock(srv.port, "127.0.0.4") as s:
      ok += _get(s, close=True) == 200
  assert ok == 200
  assert _settle(srv, 0) == 0


def test_one_token_is_held_to_max_per_token(start_service):
  srv = start_service(_svc(tokens=auth.TokenSet([TOKEN])),
                      limits=http_server.Limits(max_connections=64, max_per_client=64,
                                                idle_timeout_s=10.0, max_per_token=2))
  conns = [_sock(srv.port, f"127.0.2.{i + 1}") for i in range(3)]
  assert [_get(s, token=TOKEN) for s in conns] == [200, 200, 503]
  conns[0].close()
  time.sleep(0.2)
  with _sock(srv.port, "127.0.2.9") as s:  # a closed one frees its place at once
    assert _get(s, token=TOKEN) == 200
  for s in conns[1:]:
    s.close()


def test_limits_are_checked():
  with pytest.raises(ValueError, match="max_per_token"):
    http_server.Limits(max_per_token=0)
