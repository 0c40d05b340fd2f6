"""Serving a DDMLService: TLS, connection accounting (connections.py: aiohttp has no
connection cap nor header timeout, so the listening socket is ours), shutdown; SIGHUP
reloads the token file, SIGINT/SIGTERM stop the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
import signal
import socket
import ssl

from aiohttp import web

from tf_dpiter.draw_discard.connections import ConnectionGuard, Limits
from tf_dpiter.errors import ParameterValueError

log = logging.getLogger(__name__)

__all__ = ["ConnectionGuard", "Limits", "Running", "run", "serve", "tls_context"]

def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
  """A server ssl.SSLContext (TLS 1.2 or newer) of a PEM certificate chain and private key.

  Raises:
    OSError, ssl.SSLError: when the files cannot be read or do not match.
  """
  ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  ctx.load_cert_chain(cert_file, key_file)
  return ctx


@dataclasses.dataclass
class Running:
  """A started server: its runner, listening server, guard and port."""
  runner: web.AppRunner
  sock: socket.socket
  guard: ConnectionGuard
  port: int
  tasks: tuple

  async def stop(self) -> None:
    """Stops listening, closes connections and runs the app's cleanup (closes the store)."""
    for t in self.tasks:
      t.cancel()
    self.sock.close()
    self.guard.close_all()
    await self.runner.cleanup()


_SCRUBBED = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "asyncio")


class ScrubFilter(logging.Filter):
  """Rewrites library log records as one JSON line with no client data.

  aiohttp and asyncio log malformed requests and failed TLS handshakes with tracebacks,
  client addresses and request headers (an over-long Authorization header included). Each
  such record becomes {"event": "<logger>", "level", "error": <exception type>} with no
  arguments, no traceback and no message text.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    fields = {"event": record.name.replace(".", "_"), "level": record.levelname}
    if exc is not None:
      fields["error"] = type(exc).__name__
    record.msg, record.args = json.dumps(fields, sort_keys=True), ()
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def install_log_scrubber() -> None:
  """Adds ScrubFilter to the aiohttp and asyncio loggers (idempotent)."""
  for name in _SCRUBBED:
    logger = logging.getLogger(name)
    if not any(isinstance(f, ScrubFilter) for f in logger.filters):
      logger.addFilter(ScrubFilter())


FD_RESERVE = 64  # descriptors besides connections: listener, loop, store, logs, files


def ensure_open_files(max_connections: int) -> int:
  """Raises the open-file soft limit to max_connections + FD_RESERVE and returns the limit now
  in force, or refuses. Without it, accept() fails with EMFILE before the connection table is
  full, so fair eviction (connections.py) never runs and any few addresses starve the others.

  Raises:
    ParameterValueError: when the hard limit (RLIMIT_NOFILE) is below what
      max_connections needs.
  """
  need = int(max_connections) + FD_RESERVE
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != resource.RLIM_INFINITY and soft < need:
    if hard != resource.RLIM_INFINITY and hard < need:
      raise ParameterValueError(
          f"`max_connections` needs {need} open files ({FD_RESERVE} for the server itself), "
          f"above this process's hard limit RLIMIT_NOFILE = {hard}. Received: "
          f"max_connections={max_connections!r}; use --max-connections <= "
          f"{max(1, hard - FD_RESERVE)} or raise the hard limit (ulimit -Hn, LimitNOFILE=)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info(json.dumps({"event": "open_file_limit_raised", "from": soft, "to": need}))
    soft = need
  return soft


def _listen(host: str, port: int) -> socket.socket:
  family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                     flags=socket.AI_PASSIVE)[0]
  sock = socket.socket(family, kind, proto)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind(addr)
  sock.listen(1024)
  sock.setblocking(False)
  return sock


async def serve(svc, host: str = "127.0.0.1", port: int = 8080,
                ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None) -> Running:
  """Starts serving the DDMLService `svc` on the running loop at host:port (0: any free
  port), TLS or plain HTTP (ssl_context None), under the connection `limits`; returns a
  Running handle (await .stop()).

  Raises:
    OSError: when the address cannot be bound; store errors from the service's startup.
    ParameterValueError: when the open-file limit cannot hold limits.max_connections.
  """
  limits = limits or Limits()
  ensure_open_files(limits.max_connections)
  install_log_scrubber()
  app = svc.make_app()
  runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.idle_timeout_s,
                         handle_signals=False)
  await runner.setup()
  guard = ConnectionGuard(runner.server, limits, svc.metrics, ssl_context)
  svc.connection_guard = guard
  loop = asyncio.get_running_loop()
  sock = _listen(host, port)
  bound = sock.getsockname()[1]
  tasks = (loop.create_task(guard.accept_loop(sock)), loop.create_task(guard.run_sweeper()))
  return Running(runner, sock, guard, bound, tasks)


def run(svc, host: str = "127.0.0.1", port: int = 8080,
        ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None) -> None:
  """Blocking `serve` until SIGINT/SIGTERM (uvloop when installed); SIGHUP reloads tokens."""
  try:  # uvloop, when installed, roughly doubles aiohttp's request rate
    import uvloop  # pylint: disable=g-import-not-at-top
    loop = uvloop.new_event_loop()
  except ImportError:
    loop = asyncio.new_event_loop()
  asyncio.set_event_loop(loop)
  stop = asyncio.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    loop.add_signal_handler(sig, stop.set)
  loop.add_signal_handler(signal.SIGHUP, svc.reload_tokens)

  async def main():
    running = await serve(svc, host, port, ssl_context, limits)
    try:
      await stop.wait()
    finally:
      await running.stop()

  try:
    loop.run_until_complete(main())
  finally:
    loop.close()
