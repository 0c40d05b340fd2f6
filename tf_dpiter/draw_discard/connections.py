"""Connection accounting for the Draw and Discard service: every socket from accept to close.

A connection is counted when `accept` returns it (before any TLS handshake or request byte)
and uncounted when it closes; a refused socket is never counted. Limits (`Limits`): per
address, per address prefix (/24 IPv4, /64 IPv6, `prefix_of`), per token (the first token a
connection carries) and in all; a full table evicts (max-min fairness over prefixes, then
addresses, then the connection idle longest for at least `min_idle_s`) before it refuses a
newcomer; the idle and handshake timeout shrinks from `idle_timeout_s` to `min_idle_s` as
the table fills. The order and its guarantees: docs/draw_discard_security.md, section 2.
Refused plain-HTTP connections get a JSON 503 before the close; TLS ones are closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import ipaddress
import logging
import socket
import ssl
import time

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

log = logging.getLogger(__name__)

_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s")
_REFUSAL_BODY = b'{"error":"too_many_connections","message":"connection limit reached; retry"}'
REFUSAL = _REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY)


@dataclasses.dataclass
class Limits:
  """Connection limits.

  Attributes:
    max_connections: open connections in all.
    max_per_client: open connections from one address.
    idle_timeout_s: a connection with no request in progress for this long is closed.
    max_per_token: connections carrying one token's requests (default max_per_client).
    max_per_prefix: open connections from one /24 (IPv4) or /64 (IPv6) prefix (default
      max(2 max_per_client, max_connections // 4)).
    min_idle_s: the idle and handshake timeout when the table is full (seconds; at most
      idle_timeout_s is used).
  """
  max_connections: int = 1024
  max_per_client: int = 256
  idle_timeout_s: float = 15.0
  max_per_token: int | None = None
  max_per_prefix: int | None = None
  min_idle_s: float = 1.0

  def __post_init__(self):
    if self.max_per_token is None:
      self.max_per_token = self.max_per_client
    if self.max_per_prefix is None:
      self.max_per_prefix = max(2 * self.max_per_client, self.max_connections // 4)
    counts = ("max_connections", "max_per_client", "max_per_token", "max_per_prefix")
    seconds = validation.Interval(float, 0, None, "neither", True, ParameterValueError)
    validation.check_params({**dict.fromkeys(counts, validation.Integer(1)),
                             "idle_timeout_s": seconds, "min_idle_s": seconds}, vars(self))

  def timeout_s(self, open_count: int) -> float:
    """The idle and handshake timeout (seconds) with `open_count` connections open."""
    floor = min(self.min_idle_s, self.idle_timeout_s)
    free = max(0.0, 1.0 - open_count / self.max_connections)
    return floor + (self.idle_timeout_s - floor) * min(1.0, 2.0 * free)


@functools.lru_cache(maxsize=65536)
def prefix_of(addr: str) -> str:
  """The /24 (IPv4, IPv4-mapped IPv6 included) or /64 (IPv6) network of a peer address as
  accept() returns it, in CIDR notation (the address itself when it is not an IP address)."""
  try:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
  except ValueError:
    return addr
  if ip.version == 6 and ip.ipv4_mapped is not None:
    ip = ip.ipv4_mapped
  return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))


class _Conn:
  """One accepted socket: address, token, requests in progress, last activity."""

  __slots__ = ("addr", "prefix", "identity", "busy", "last", "inner", "transport", "task",
               "open")

  def __init__(self, addr: str):
    self.addr, self.prefix, self.identity, self.busy = addr, prefix_of(addr), None, 0
    self.last = time.monotonic()
    self.inner = self.transport = self.task = None
    self.open = True


class _Proxy(asyncio.Protocol):
  """Forwards to the server's protocol and uncounts the connection when it closes."""

  def __init__(self, guard: "ConnectionGuard", conn: _Conn, inner):
    self._guard, self._conn, self._inner = guard, conn, inner

  def connection_made(self, transport):
    self._conn.transport = transport
    self._inner.connection_made(transport)

  def data_received(self, data):
    self._inner.data_received(data)

  def eof_received(self):
    return self._inner.eof_received()

  def pause_writing(self):
    self._inner.pause_writing()

  def resume_writing(self):
    self._inner.resume_writing()

  def connection_lost(self, exc):
    self._guard.release(self._conn)
    self._inner.connection_lost(exc)


class ConnectionGuard:
  """Accepts, counts and evicts connections for an aiohttp web.Server.

  Args:
    server: the runner's web.Server (a protocol factory).
    limits: the Limits.
    metrics: a metrics.Registry or None.
    ssl_context: TLS context, or None for plain HTTP.
  """

  def __init__(self, server, limits: Limits, metrics=None,
               ssl_context: ssl.SSLContext | None = None):
    self.server, self.limits, self.metrics, self.ssl = server, limits, metrics, ssl_context
    self._by_addr: dict[str, dict[_Conn, None]] = {}
    self._by_prefix: dict[str, dict[str, None]] = {}  # prefix -> its addresses
    self._prefix_open: dict[str, int] = {}
    self._by_token: dict[str, int] = {}
    self._by_inner: dict = {}
    self.open = 0

  # ---- accounting ----
  def count(self, addr: str | None = None) -> int:
    """Open connections, in all (addr None) or from one address."""
    return self.open if addr is None else len(self._by_addr.get(addr, ()))

  def _refused(self, reason: str) -> None:
    if self.metrics is not None:
      self.metrics.inc("connections_refused_total", reason=reason, help_text="connections closed")

  def admit(self, addr: str) -> _Conn | None:
    """Counts a new connection from `addr`, evicting fairly when full, and returns its record;
    None: refuse it."""
    mine_addr = len(self._by_addr.get(addr, ()))
    if mine_addr >= self.limits.max_per_client:
      self._refused("too_many_from_client")
      return None
    prefix = prefix_of(addr)
    mine = self._prefix_open.get(prefix, 0)
    if mine >= self.limits.max_per_prefix:
      self._refused("too_many_from_prefix")
      return None
    if self.open >= self.limits.max_connections:
      victim, reason = self._victim(mine, mine_addr)
      if victim is None:
        self._refused("too_many_connections")
        return None
      self.evict(victim, reason)
    conn = _Conn(addr)
    self._by_addr.setdefault(addr, {})[conn] = None
    self._by_prefix.setdefault(prefix, {})[addr] = None
    self._prefix_open[prefix] = mine + 1
    self.open += 1
    return conn

  def _victim(self, mine: int, mine_addr: int) -> tuple[_Conn | None, str]:
    """(connection or None, metrics label): the connection a newcomer may evict from a full
    table (module docstring), given the open connections of its prefix (mine) and address."""
    heavy = max(self._prefix_open, key=self._prefix_open.__getitem__)
    if self._prefix_open[heavy] > mine + 1:  # fair share over prefixes
      addr = max(self._by_prefix[heavy], key=lambda a: len(self._by_addr[a]))
    else:  # then over addresses (neighbours in one prefix)
      addr = max(self._by_addr, key=lambda a: len(self._by_addr[a]))
    conns = self._by_addr[addr]
    if self._prefix_open[heavy] > mine + 1 or len(conns) > mine_addr + 1:
      return next((c for c in conns if not c.busy), next(iter(conns))), "evicted_fair_share"
    now, best, idle = time.monotonic(), None, min(self.limits.min_idle_s,
                                                   self.limits.idle_timeout_s)
    for conns in self._by_addr.values():
      for c in conns:
        if not c.busy and now - c.last >= idle and self._prefix_open[c.prefix] > mine:
          best, idle = c, now - c.last
    return best, "evicted_idle"

  def release(self, conn: _Conn) -> None:
    """Uncounts a connection's record (idempotent)."""
    if not conn.open:
      return
    conn.open = False
    self.open -= 1
    conns = self._by_addr.get(conn.addr)
    if conns is not None:
      conns.pop(conn, None)
      if not conns:
        del self._by_addr[conn.addr]
        self._by_prefix.get(conn.prefix, {}).pop(conn.addr, None)
    if not _decrement(self._prefix_open, conn.prefix):
      self._by_prefix.pop(conn.prefix, None)
    if conn.identity is not None:
      _decrement(self._by_token, conn.identity)
    self._by_inner.pop(conn.inner, None)

  def evict(self, conn: _Conn, reason: str) -> None:
    """Closes a connection now (handshake cancelled, or transport aborted) and uncounts it;
    `reason` is the metrics label."""
    self._refused(reason)
    if conn.transport is not None:
      conn.transport.abort()
    elif conn.task is not None:
      conn.task.cancel()
    self.release(conn)

  # ---- requests (called by the middleware) ----
  def busy(self, proto, delta: int) -> None:
    """A request started (delta 1) or ended (-1) on the connection of server protocol
    `proto` (request.protocol)."""
    conn = self._by_inner.get(proto)
    if conn is not None:
      conn.busy += delta
      conn.last = time.monotonic()

  def bind(self, proto, identity: str) -> bool:
    """Charges the connection of `proto` (request.protocol) to token `identity` (first request
    only); False when the token already holds `max_per_token` connections (refuse the
    request)."""
    conn = self._by_inner.get(proto)
    if conn is None or conn.identity is not None:  # a later token: counted under the first
      return True
    if self._by_token.get(identity, 0) >= self.limits.max_per_token:
      self._refused("too_many_for_token")
      return False
    conn.identity = identity
    self._by_token[identity] = self._by_token.get(identity, 0) + 1
    return True

  # ---- accepting ----
  def _refuse_socket(self, sock: socket.socket) -> None:
    if self.ssl is None:
      try:
        sock.send(REFUSAL)
      except OSError:
        pass
    sock.close()

  def _start(self, sock: socket.socket, addr: str) -> None:
    conn = self.admit(addr)
    if conn is None:
      self._refuse_socket(sock)
      return
    conn.task = asyncio.get_running_loop().create_task(self._connect(conn, sock))

  async def _connect(self, conn: _Conn, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()

    def factory():
      inner = self.server()
      conn.inner = inner
      self._by_inner[inner] = conn
      return _Proxy(self, conn, inner)

    kw = ({"ssl": self.ssl, "ssl_handshake_timeout": self.limits.timeout_s(self.open)}
          if self.ssl else {})
    try:  # the transport owns the socket from here: it closes it on failure (asyncio and
      # uvloop alike); closing it here too could close a reused file descriptor under uvloop
      await loop.connect_accepted_socket(factory, sock, **kw)
    except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError,
            asyncio.CancelledError):
      self.release(conn)
    finally:
      conn.task = None

  async def accept_loop(self, lsock: socket.socket) -> None:
    """Accepts on the non-blocking listening socket forever (cancel to stop); up to 64 sockets
    per wake-up."""
    loop = asyncio.get_running_loop()
    while True:
      try:
        sock, peer = await loop.sock_accept(lsock)
      except OSError as e:  # EMFILE and friends: back off, keep serving open connections
        if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                           errno.ECONNABORTED):
          raise
        self._refused("accept_failed")
        await asyncio.sleep(0.05)
        continue
      for i in range(64):  # the accepted socket is always started
        sock.setblocking(False)
        self._start(sock, peer[0])
        if i == 63:
          break
        try:
          sock, peer = lsock.accept()
        except OSError:  # BlockingIOError (nothing pending), EMFILE: back to the awaited accept
          break

  def sweep(self) -> int:
    """Closes connections idle (or in their TLS handshake) for longer than `timeout_s`; returns
    how many."""
    now, closed = time.monotonic(), 0
    limit = self.limits.timeout_s(self.open)
    for conns in list(self._by_addr.values()):
      for conn in list(conns):
        if not conn.busy and now - conn.last > limit and (
            conn.transport is not None or conn.task is not None):
          self.evict(conn, "idle" if conn.transport is not None else "handshake_timeout")
          closed += 1
    if self.metrics is not None:
      self.metrics.set("open_connections", self.open, help_text="open connections")
    return closed

  async def run_sweeper(self, every_s: float = 0.5) -> None:
    """Sweeps every `every_s` seconds forever (cancel to stop)."""
    while True:
      await asyncio.sleep(every_s)
      self.sweep()

  def close_all(self) -> None:
    """Closes every connection (shutdown)."""
    for conns in list(self._by_addr.values()):
      for conn in list(conns):
        self.evict(conn, "shutdown")


def _decrement(counts: dict, key) -> bool:
  """Lowers counts[key] by one, dropping it at zero; whether it is still there."""
  left = counts.get(key, 1) - 1
  if left > 0:
    counts[key] = left
  else:
    counts.pop(key, None)
  return left > 0
