"""The service's request middleware: authentication, quotas, JSON errors, metrics, logs.

Every failure is JSON {"error": code, "message": ...}; a server fault (500 internal_error) is
logged with a traceback and an error id, the client gets only the id. Logs are one JSON line
each, hold no client data and are rate-limited.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
import uuid

from aiohttp import web

from tf_dpiter.draw_discard import auth
from tf_dpiter.draw_discard import parsing
from tf_dpiter.draw_discard import store as store_lib

log = logging.getLogger(__name__)

_OPS = {"/v1/draw": "draw", "/v1/submit": "submit", "/v1/model": "draw"}  # model: read = draw
IDENTITY = web.RequestKey("ddml_identity", str)  # token digest prefix, or the client address
_OPEN = ("/healthz",)
# Faults of our own code that must still produce a JSON 500 (RecursionError is a RuntimeError).
_SERVER_FAULTS = (ArithmeticError, LookupError, TypeError, ValueError, RuntimeError, OSError,
                  AttributeError, MemoryError)
_last_logged: dict = {}


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO,
              every_s: float = 0.0, **fields) -> None:
  """Logs one JSON line {"event", **fields} (fields never client data) at `level`; at most
  once per `every_s` seconds per event (0: no limit), suppressed lines counted."""
  now = time.monotonic()
  if every_s > 0:
    last, suppressed = _last_logged.get(event, (-1e30, 0))
    if now - last < every_s:
      _last_logged[event] = (last, suppressed + 1)
      return
    _last_logged[event] = (now, 0)
    if suppressed:
      fields["suppressed"] = suppressed
  logger.log(level, json.dumps(dict(event=event, **fields), sort_keys=True))


def json_error(status: int, code: str, message: str, headers: dict | None = None,
               extra: dict | None = None) -> web.Response:
  """The JSON error web.Response: HTTP `status`, {"error": code, "message": message,
  **extra}, plus extra headers."""
  return web.json_response(dict(extra or {}, error=code, message=message), status=status,
                           headers=headers)


def _http_exception(e: web.HTTPException) -> web.Response:
  codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
  code = codes.get(e.status, "http_error")
  headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
  return json_error(e.status, code, e.reason, headers=headers)


async def _admit(svc, request: web.Request) -> None:
  """Authentication and quotas; raises RequestError when refused."""
  if request.path in _OPEN:
    return
  identity = None
  if svc.tokens is not None:
    addr = request.remote or "?"
    wait = svc.auth_throttle.wait(addr)
    if wait > 0:
      svc.metrics.inc("auth_refused_total", reason="throttled",
                      help_text="requests without a valid token")
      raise parsing.RequestError(429, "auth_throttled", "too many failed authentications from "
                                 "this address; retry later",
                                 headers={"Retry-After": auth.retry_after_header(wait)})
    identity, why = svc.tokens.identify(request.headers.get("Authorization"))
    if identity is None:
      status = 401 if why == "missing_token" else 403
      if why == "invalid_token":  # a revoked token's retries are not guesses
        svc.auth_throttle.failed(addr)
      svc.metrics.inc("auth_refused_total", reason=why, help_text="requests without a valid token")
      raise parsing.RequestError(status, why, "send Authorization: Bearer <token>"
                                 if status == 401 else "token revoked" if why == "revoked_token"
                                 else "token not accepted",
                                 headers={"WWW-Authenticate": 'Bearer realm="ddml"'})
    guard = svc.connection_guard
    if guard is not None and not guard.bind(request.protocol, identity):
      raise parsing.RequestError(503, "too_many_connections",
                                 "this token holds too many connections; reuse one",
                                 headers={"Retry-After": "1", "Connection": "close"})
  op = _OPS.get(request.path)
  identity = identity or (request.remote or "?")
  request[IDENTITY] = identity
  if svc.quotas is not None and op is not None:
    wait = await svc.take_quota(identity, op)
    if wait > 0:
      svc.metrics.inc("quota_refused_total", op=op, help_text="requests over quota (429)")
      raise parsing.RequestError(429, "quota_exceeded", f"{op} quota exceeded; retry later",
                                 headers={"Retry-After": auth.retry_after_header(wait)},
                                 extra={"retry_after_s": round(wait, 3)})


async def _dispatch(svc, request: web.Request, handler) -> web.Response:
  try:
    await _admit(svc, request)
    return await handler(request)
  except parsing.RequestError as e:
    return json_error(e.status, e.code, e.message, e.headers, e.extra)
  except web.HTTPException as e:  # router 404/405, aiohttp's 413
    return _http_exception(e)
  except store_lib.StoreLost as e:
    svc.metrics.inc("store_lost_total", help_text="operations refused: store data lost")
    log_event(log, "store_lost", logging.ERROR, every_s=10.0, detail=str(e))
    return json_error(503, "store_lost", "the model store lost its data or was re-initialized; "
                      "an operator must restart the service", headers={"Retry-After": "30"})
  except store_lib.StoredNotAcknowledged as e:
    svc.metrics.inc("store_unavailable_total", help_text="operations refused: store unreachable")
    log_event(log, "update_not_acknowledged", logging.ERROR, every_s=10.0, detail=str(e))
    return json_error(503, "update_not_acknowledged",
                      "the update is in the store but this server could not record it durably; "
                      "its ticket is used: do not send it again", headers={"Retry-After": "1"})
  except store_lib.WriteOutcomeUnknown as e:
    svc.metrics.inc("store_unavailable_total", help_text="operations refused: store unreachable")
    svc.metrics.inc("outcome_unknown_total",
                    help_text="submits whose store write was sent and its answer lost")
    log_event(log, "submit_outcome_unknown", logging.WARNING, every_s=10.0, detail=str(e))
    if svc.use_tickets:  # the ticket's nonce is marked used with the write: no second one
      return json_error(503, "outcome_unknown",
                        "the store may hold this update (its write was sent, the answer was "
                        "lost): resend the same submission with the same ticket (409 "
                        "ticket_used then means it was stored once); never send these records "
                        "again under a new draw", headers={"Retry-After": "1"},
                        extra={"resend": "same_ticket"})
    return json_error(503, "outcome_unknown",
                      "the store may hold this update (its write was sent, the answer was "
                      "lost) and this server runs without tickets: do not send it again",
                      extra={"resend": "never"})
  except store_lib.StoreUnavailable as e:
    svc.metrics.inc("store_unavailable_total", help_text="operations refused: store unreachable")
    log_event(log, "store_unavailable", logging.WARNING, every_s=10.0, detail=str(e))
    return json_error(503, "store_unavailable", "the model store cannot be reached; retry",
                      headers={"Retry-After": "1"})
  except _SERVER_FAULTS as e:  # one JSON line: type and frames, no message (client data)
    error_id = uuid.uuid4().hex[:12]
    frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
              for f in traceback.extract_tb(e.__traceback__)]
    log.error(json.dumps({"event": "internal_error", "error_id": error_id,
                          "path": request.path, "error": type(e).__name__, "frames": frames}))
    return json_error(500, "internal_error", f"internal error {error_id}")


def make_middleware(svc):
  """The aiohttp middleware of DDMLService `svc` (tokens, quotas, metrics)."""

  @web.middleware
  async def middleware(request: web.Request, handler):
    t0 = time.perf_counter()
    guard = svc.connection_guard
    if guard is not None:
      guard.busy(request.protocol, 1)
    try:
      resp = await _dispatch(svc, request, handler)
    finally:
      if guard is not None:
        guard.busy(request.protocol, -1)
    endpoint = request.path if request.match_info.route.resource is not None else "other"
    svc.metrics.inc("requests_total", endpoint=endpoint, status=resp.status,
                    help_text="HTTP requests")
    svc.metrics.observe("request_seconds", time.perf_counter() - t0, endpoint=endpoint,
                        help_text="request latency")
    if resp.status >= 400:
      svc.metrics.inc("errors_total", status=resp.status, help_text="error answers")
      if resp.status == 408 or resp.headers.get("Connection") == "close":
        resp.force_close()
    return resp

  return middleware
