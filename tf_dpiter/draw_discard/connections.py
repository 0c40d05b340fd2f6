"""Connection accounting for the Draw and Discard service: every socket from accept to close.

The service accepts connections itself (`ConnectionGuard.accept_loop`), so a connection is
counted the moment `accept` returns it, with its address, before any TLS handshake or
request byte, and uncounted the moment it closes (the protocol's `connection_lost`, a
failed or timed-out handshake, or an eviction). Nothing stays counted after it closed, and
a refused socket is never counted.

Limits (Limits):

  * per address: at most `max_per_client` open connections (handshakes included);
  * per token: at most `max_per_token` connections carrying requests of one token (checked
    when a request is authenticated; a connection belongs to the first token it carries);
  * in all: `max_connections`. When the table is full, a new connection from an address
    holding fewer connections than the heaviest address evicts one of the heaviest
    address's connections (an idle one first, else its oldest); otherwise it is refused.
    So no address (nor any set of addresses) can hold the table against an address with
    fewer connections: every address can always reach `max_connections / A` connections
    when A addresses compete (max-min fairness).
  * idle: a connection with no request in progress and none started for `idle_timeout_s`
    seconds is closed; a TLS handshake has the same time limit.

Refused plain-HTTP connections get a JSON 503 before the close; TLS ones are closed (no
HTTP can be spoken before the handshake).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
import ssl
import time

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
  """
  max_connections: int = 1024
  max_per_client: int = 256
  idle_timeout_s: float = 15.0
  max_per_token: int | None = None

  def __post_init__(self):
    if self.max_per_token is None:
      self.max_per_token = self.max_per_client
    for name in ("max_connections", "max_per_client", "max_per_token"):
      v = getattr(self, name)
      if int(v) != v or v < 1:
        raise ParameterValueError(f"`{name}` must be an integer >= 1. Received: {name}={v!r}")
    if not self.idle_timeout_s > 0:
      raise ParameterValueError(f"`idle_timeout_s` must be > 0. Received: "
                                f"idle_timeout_s={self.idle_timeout_s!r}")


class _Conn:
  """One accepted socket: address, token, requests in progress, last activity."""

  __slots__ = ("addr", "identity", "busy", "last", "born", "inner", "transport", "task", "open")

  def __init__(self, addr: str):
    self.addr, self.identity, self.busy = addr, None, 0
    self.last = self.born = time.monotonic()
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
    self._by_token: dict[str, int] = {}
    self._by_inner: dict = {}
    self.open = 0

  # ---- accounting ----
  def count(self, addr: str | None = None) -> int:
    """Open connections, in all or from one address.

    Args:
      addr: an address, or None for all.

    Returns:
      The count.
    """
    return self.open if addr is None else len(self._by_addr.get(addr, ()))

  def _refused(self, reason: str) -> None:
    if self.metrics is not None:
      self.metrics.inc("connections_refused_total", reason=reason, help_text="connections closed")

  def admit(self, addr: str) -> _Conn | None:
    """Counts a new connection from `addr`, evicting fairly when full; None: refuse it.

    Args:
      addr: the peer address.

    Returns:
      The new connection's record, or None when it must be refused.
    """
    mine = len(self._by_addr.get(addr, ()))
    if mine >= self.limits.max_per_client:
      self._refused("too_many_from_client")
      return None
    if self.open >= self.limits.max_connections:
      heavy = max(self._by_addr, key=lambda a: len(self._by_addr[a]))
      if len(self._by_addr[heavy]) <= mine + 1:
        self._refused("too_many_connections")
        return None
      conns = self._by_addr[heavy]
      victim = next((c for c in conns if not c.busy), next(iter(conns)))
      self.evict(victim, "evicted_fair_share")
    conn = _Conn(addr)
    self._by_addr.setdefault(addr, {})[conn] = None
    self.open += 1
    return conn

  def release(self, conn: _Conn) -> None:
    """Uncounts a connection (idempotent).

    Args:
      conn: the connection's record.
    """
    if not conn.open:
      return
    conn.open = False
    self.open -= 1
    conns = self._by_addr.get(conn.addr)
    if conns is not None:
      conns.pop(conn, None)
      if not conns:
        del self._by_addr[conn.addr]
    if conn.identity is not None:
      left = self._by_token.get(conn.identity, 1) - 1
      if left > 0:
        self._by_token[conn.identity] = left
      else:
        self._by_token.pop(conn.identity, None)
    self._by_inner.pop(conn.inner, None)

  def evict(self, conn: _Conn, reason: str) -> None:
    """Closes a connection now (handshake cancelled, or transport aborted) and uncounts it.

    Args:
      conn: the connection's record.
      reason: the metrics label.
    """
    self._refused(reason)
    if conn.transport is not None:
      conn.transport.abort()
    elif conn.task is not None:
      conn.task.cancel()
    self.release(conn)

  # ---- requests (called by the middleware) ----
  def begin(self, proto) -> None:
    """A request started on the connection of server protocol `proto`.

    Args:
      proto: request.protocol.
    """
    conn = self._by_inner.get(proto)
    if conn is not None:
      conn.busy += 1
      conn.last = time.monotonic()

  def end(self, proto) -> None:
    """A request ended on `proto`.

    Args:
      proto: request.protocol.
    """
    conn = self._by_inner.get(proto)
    if conn is not None:
      conn.busy -= 1
      conn.last = time.monotonic()

  def bind(self, proto, identity: str) -> bool:
    """Charges the connection of `proto` to token `identity` (first request only).

    Args:
      proto: request.protocol.
      identity: the token's identity.

    Returns:
      False when the token already holds `max_per_token` connections (refuse the request).
    """
    conn = self._by_inner.get(proto)
    if conn is None or conn.identity == identity:
      return True
    if conn.identity is not None:  # a second token on one connection: counted under the first
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

    kw = {"ssl": self.ssl, "ssl_handshake_timeout": self.limits.idle_timeout_s} if self.ssl else {}
    try:  # the transport owns the socket from here: it closes it on failure (asyncio and
      # uvloop alike); closing it here too could close a reused file descriptor under uvloop
      await loop.connect_accepted_socket(factory, sock, **kw)
    except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError,
            asyncio.CancelledError):
      self.release(conn)
    finally:
      conn.task = None

  async def accept_loop(self, lsock: socket.socket) -> None:
    """Accepts forever (cancel to stop); up to 64 sockets per wake-up.

    Args:
      lsock: the non-blocking listening socket.
    """
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
      for _ in range(64):
        sock.setblocking(False)
        self._start(sock, peer[0])
        try:
          sock, peer = lsock.accept()
        except (BlockingIOError, InterruptedError):
          break
        except OSError:
          break

  def sweep(self) -> int:
    """Closes idle connections; returns how many.

    Returns:
      The number of idle connections closed.
    """
    now, closed = time.monotonic(), 0
    for conns in list(self._by_addr.values()):
      for conn in list(conns):
        if conn.transport is not None and not conn.busy and (
            now - conn.last > self.limits.idle_timeout_s):
          self.evict(conn, "idle")
          closed += 1
    if self.metrics is not None:
      self.metrics.set("open_connections", self.open, help_text="open connections")
    return closed

  async def run_sweeper(self, every_s: float = 0.5) -> None:
    """Sweeps forever (cancel to stop).

    Args:
      every_s: seconds between sweeps.
    """
    while True:
      await asyncio.sleep(every_s)
      self.sweep()

  def close_all(self) -> None:
    """Closes every connection (shutdown)."""
    for conns in list(self._by_addr.values()):
      for conn in list(conns):
        self.evict(conn, "shutdown")
