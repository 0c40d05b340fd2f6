"""Status endpoints of the Draw and Discard service (spec, counters, Prometheus, health): they
reveal no instance."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from tf_dpiter.draw_discard import auth
from tf_dpiter.draw_discard import parsing
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import web_errors

HEALTH_READ_S = 1.0
log = logging.getLogger(__name__)


class StatusEndpoints:
  """The read-only status handlers of DDMLService (a base class of it).

  They read the service's attributes `spec`, `spec_json` (the spec's JSON bytes), `store`,
  `metrics`, `k`, `p`, `history`, `rule` and `started` (time.time() at construction).
  """

  async def handle_spec(self, request: web.Request) -> web.Response:
    """GET /v1/spec: the spec JSON."""
    return web.Response(body=self.spec_json, content_type=parsing.JSON_TYPE)

  async def handle_metrics_json(self, request: web.Request) -> web.Response:
    """GET /v1/metrics: a JSON object of the store's counters (all servers) and this server's
    settings."""
    c = await self.store.counters()
    return web.json_response(dict(c, k=self.k, version=self.spec.version, num_weights=self.p,
                                  store=self.store.kind, history=self.history,
                                  acceptance=self.rule.describe(),
                                  uptime_s=time.time() - self.started))

  async def handle_prometheus(self, request: web.Request) -> web.Response:
    """GET /metrics: this process's metrics in the Prometheus text format (text/plain)."""
    self.metrics.set("uptime_seconds", time.time() - self.started, help_text="process uptime")
    return web.Response(text=self.metrics.render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})

  def reload_tokens(self) -> None:
    """SIGHUP: re-reads the token file (revocation); on error keeps the old set and logs.

    A file modified less than auth.SETTLE_S seconds ago is read once it has settled (one
    retry scheduled on the running loop).
    """
    if self.tokens is None or self.tokens.path is None:
      web_errors.log_event(log, "tokens_reload_skipped", detail="no token file")
      return
    try:
      n = self.tokens.reload()
    except auth.TokenFileUnsettled as e:
      try:
        loop = asyncio.get_running_loop()
      except RuntimeError:  # called outside the server's loop: nothing to retry on
        web_errors.log_event(log, "tokens_reload_failed", logging.ERROR, detail=str(e))
        return
      if not getattr(self, "_reload_scheduled", False):
        self._reload_scheduled = True
        loop.call_later(e.wait_s + 0.05, self._reload_settled)
      web_errors.log_event(log, "tokens_reload_deferred", wait_s=round(e.wait_s, 3))
      return
    except (OSError, ValueError) as e:
      web_errors.log_event(log, "tokens_reload_failed", logging.ERROR, error=type(e).__name__,
                           detail=str(e))
      return
    web_errors.log_event(log, "tokens_reloaded", tokens=n)

  def _reload_settled(self) -> None:
    self._reload_scheduled = False
    self.reload_tokens()

  async def handle_health(self, request: web.Request) -> web.Response:
    """GET /healthz: {"ok": true, "store", "seq"}, 200 only when the store holds this server's
    model, intact (store errors become 503 in the middleware). Checks the generation and the
    rollback mark on every call, and at most once per `HEALTH_READ_S` seconds the k slots and
    history through the integrity check (store_mac.py) and their shape."""
    seq = await self.store.touch()
    now = time.monotonic()
    if now - getattr(self, "_health_read", -1e30) > HEALTH_READ_S:
      snap = await self.store.snapshot()
      if snap.slots.shape != (self.k, self.p):
        raise store_lib.StoreCorrupt(f"store slots have shape {snap.slots.shape}, expected "
                                     f"{(self.k, self.p)}")
      self._health_read = now
    return web.json_response({"ok": True, "store": self.store.kind, "seq": seq})
