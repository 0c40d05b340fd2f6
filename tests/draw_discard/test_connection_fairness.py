"""Connection fairness against many addresses.

Loopback only: the attackers are many source addresses in 127.0.0.0/8 (Linux routes all of
127/8 to lo), one connection each, as in the audit; bounded in count (<= 150 connections)
and time (client timeouts of a few seconds).
"""

import os
import resource
import subprocess
import sys
import time

import numpy as np
import pytest

from tf_dpiter.draw_discard import cli, client_lib, http_server, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError
from tests.draw_discard import loopback
from tests.draw_discard.conftest import connect_from

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
TABLE = 48


def _svc():
  return service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0)


def _hold(port, addrs, http=True):
  """One connection from each address; with http=True each sends one /healthz first."""
  socks = []
  for a in addrs:
    s = connect_from(port, a)
    if http:
      s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
      assert s.recv(65536).startswith(b"HTTP/1.1 200")
    socks.append(s)
  return socks


def _honest(url, src, n, **kw):
  """n honest updates from `src`, a new connection each: how many were accepted."""
  rng, ok = np.random.default_rng(0), 0
  for _ in range(n):
    with loopback.BoundClient(url, src, timeout=5.0, **kw) as c:
      try:
        ok += loopback.honest_submit(c, rng)[0]
      except (client_lib.DDMLError, OSError):
        pass
  return ok


def _full(srv, want=TABLE, timeout=5.0):
  deadline = time.time() + timeout
  while srv.call(_count(srv)) < want and time.time() < deadline:
    time.sleep(0.05)
  return srv.call(_count(srv))


async def _count(srv):
  return srv.svc.connection_guard.count()


def test_addresses_in_four_prefixes_cannot_hold_the_table(start_service):
  srv = start_service(_svc(), limits=http_server.Limits(max_connections=TABLE))
  addrs = [f"127.5.{i % 4}.{1 + i // 4}" for i in range(TABLE)]  # 12 addresses per /24
  socks = _hold(srv.port, addrs)
  try:
    assert _full(srv) == TABLE
    assert _honest(srv.url, "127.6.0.1", 5) == 5  # fair share over prefixes: evicts
  finally:
    for s in socks:
      s.close()


def test_one_address_per_prefix_cannot_hold_the_table(start_service):
  """48 /24s with one idle connection each (a /healthz every 5 s would do, 15 s idle limit):
  the timeout shrinks to min_idle_s = 1 s at a full table and a newcomer evicts the idlest."""
  srv = start_service(_svc(), limits=http_server.Limits(max_connections=TABLE))
  socks = _hold(srv.port, [f"127.7.{i}.1" for i in range(TABLE)])
  try:
    assert _full(srv) == TABLE
    time.sleep(1.2)
    assert _honest(srv.url, "127.6.0.2", 5) == 5
  finally:
    for s in socks:
      s.close()


def test_silent_tls_handshakes_cannot_hold_the_table(start_service, tls_files):
  """48 /24s that never send a ClientHello (the audit's TLS attacker)."""
  ctx = http_server.tls_context(*tls_files)
  srv = start_service(_svc(), ssl_context=ctx, limits=http_server.Limits(max_connections=TABLE))
  socks = _hold(srv.port, [f"127.8.{i}.1" for i in range(TABLE)], http=False)
  try:
    assert _full(srv) == TABLE
    time.sleep(1.2)
    cctx = client_lib.client_ssl_context(tls_files[0])
    assert _honest(srv.url, "127.6.0.3", 3, ssl_context=cctx) == 3
  finally:
    for s in socks:
      s.close()


def test_prefix_cap_and_shrinking_timeout():
  limits = http_server.Limits(max_connections=100, idle_timeout_s=15.0, max_per_prefix=3)
  assert limits.timeout_s(0) == limits.timeout_s(50) == 15.0
  assert limits.timeout_s(75) == pytest.approx(8.0) and limits.timeout_s(100) == 1.0
  guard = http_server.ConnectionGuard(None, limits)
  assert all(guard.admit(f"127.9.0.{i}") is not None for i in range(1, 4))
  assert guard.admit("127.9.0.200") is None  # same /24
  assert guard.admit("127.9.1.1") is not None
  assert guard.admit("2001:db8::1") is not None and guard.admit("2001:db8::2") is not None
  assert guard.admit("2001:db8::ffff:1") is not None and guard.admit("2001:db8::3") is None
  with pytest.raises(ParameterValueError, match="max_per_prefix"):
    http_server.Limits(max_per_prefix=0)
  with pytest.raises(ParameterValueError, match="min_idle_s"):
    http_server.Limits(min_idle_s=0)


_HOLDER = """
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
socks = []
for i in range(int(sys.argv[2])):
  s = socket.socket(); s.bind((f"127.10.{i // 50}.{1 + i % 50}", 0)); s.settimeout(5)
  s.connect(("127.0.0.1", int(sys.argv[1]))); s.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
  socks.append(s)
print("ready", flush=True)
time.sleep(30)
"""


def test_open_file_soft_limit_is_raised_for_max_connections(start_service):
  """A soft limit 50 above the descriptors already open (systemd's default is 1,024 against
  --max-connections 1024): 150 addresses holding a connection each must not starve an
  honest client by EMFILE."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard < 2048:
    pytest.fail(f"this test needs a hard open-file limit >= 2048, got {hard}")
  opened = len(os.listdir("/proc/self/fd"))  # this pytest process's descriptors so far
  resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 50, hard))
  holder, table = None, opened + 200
  try:
    srv = start_service(_svc(), limits=http_server.Limits(max_connections=table))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(srv.port), "150"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    assert _full(srv, 150) == 150  # every accepted socket counted (none dropped by bursts)
    assert _honest(srv.url, "127.6.0.4", 2) == 2
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= table + http_server.FD_RESERVE
  finally:
    if holder is not None:
      holder.kill()
      holder.wait(10)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_max_connections_above_the_hard_limit_is_refused(monkeypatch):
  monkeypatch.setattr(http_server.resource, "getrlimit", lambda _: (1024, 1024))
  with pytest.raises(ParameterValueError, match=r"max_connections=2048.*hard limit|"
                     r"hard limit.*max_connections=2048"):
    http_server.ensure_open_files(2048)
