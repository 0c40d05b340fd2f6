"""Asynchronous HTTP JSON service for Draw and Discard (Algorithm 2 over HTTP, aiohttp).

Endpoints (JSON; weights as a JSON list, as base64 of little-endian float64 with
encoding "b64", or as the raw float64 bytes with encoding "raw", which the Python
client uses: the version then travels in the X-DDML-Version header):

  GET  /v1/draw[?encoding=b64|raw] -> {"version", "spec", "weights" | "weights_b64"}
                                   (raw: the bytes; fetch the spec from /v1/spec once)
                                   one instance drawn uniformly (secrets.randbelow).
  POST /v1/submit  {"version", "weights" | "weights_b64"}, or application/octet-stream
                   bytes with X-DDML-Version
                                -> {"accepted": true}; replaces a uniformly random slot.
  GET  /v1/model[?encoding=b64] -> the average of the k instances (prediction model).
  GET  /v1/spec                 -> the model spec.
  GET  /v1/metrics              -> counters (draws, submits, accepted, rejected_spam,
                                   rejected_invalid), k, version, store.
  GET  /healthz

Errors are JSON {"error": code, "message": ...} with a 4xx status and leave the store
untouched: 400 malformed body, 409 wrong model version, 413 oversize body, 422 wrong
shape / non-finite weights / refused by the spam filter (Section III-D4).
The server keeps no per-client state: it never records which instance a client drew
(the guarantees against adversaries II and III rest on it, Section IV), and a client
that never returns holds nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import time

import numpy as np
from aiohttp import web

from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import privacy
from tf_dpiter.draw_discard import server as server_lib
from tf_dpiter.draw_discard import store as store_lib

log = logging.getLogger(__name__)


def _error(status: int, code: str, message: str) -> web.Response:
  return web.json_response({"error": code, "message": message}, status=status)


class DDMLService:
  """State of one server process: the spec, a store and the (cached) spam statistics."""

  def __init__(self, spec: glm.ModelSpec, k: int, store, *, spam_t: float | None = None,
               spam_min_std: float = 1e-9, stats_ttl_s: float = 1.0,
               init_epsilon: float = 1.0, seed: int | None = None, reset: bool = False,
               max_body_bytes: int | None = None):
    if int(k) != k or k < 1:
      raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if spam_t is not None and k < 2:
      raise ValueError(f"the spam filter needs k >= 2, got k={k}")
    self.spec = spec
    self.k = int(k)
    self.store = store
    self.spam = server_lib.SpamFilter(spam_t, spam_min_std) if spam_t is not None else None
    self.stats_ttl_s = float(stats_ttl_s)
    self._stats_time = -1e30
    self.init_epsilon = init_epsilon
    self.seed = seed
    self.reset = reset
    self.p = spec.num_weights
    # base64 of p float64 is 4/3 * 8p bytes; a JSON list of p doubles is < 26 bytes each.
    self.max_body_bytes = int(max_body_bytes or (26 * self.p + 65536))
    self.meta = dict(version=spec.version, k=self.k, num_weights=self.p, spec=spec.to_dict())
    self._spec_json = json.dumps(spec.to_dict()).encode()
    self._version_json = json.dumps(spec.version).encode()
    self.started = time.time()

  def initial_instances(self) -> np.ndarray:
    """N(0, k/2 sigma^2) per weight (Theorem 1), sigma from the spec's noise (init_epsilon if none)."""
    noise = self.spec.noise if self.spec.epsilon is not None else "laplace"
    eps = self.spec.epsilon if self.spec.epsilon is not None else self.init_epsilon
    if noise == "none":
      noise = "laplace"
    var = privacy.noise_std(noise, self.spec.gamma, eps, self.spec.clip, self.spec.delta) ** 2
    std = float(np.sqrt(privacy.init_variance(self.k, var)))
    rng = np.random.default_rng(self.seed)
    return server_lib.initial_instances(self.k, self.p, 0.0, std, rng)

  async def startup(self, app=None) -> None:
    wrote = await self.store.initialize(self.meta, self.initial_instances(), reset=self.reset)
    log.info("store %s: %s", self.store.kind, "initialized" if wrote else "joined")

  async def shutdown(self, app=None) -> None:
    await self.store.close()

  # ---- helpers ----
  def _weights_payload(self, data: bytes, encoding: str) -> bytes:
    if encoding == "b64":
      return b'"encoding":"b64","weights_b64":"' + base64.b64encode(data) + b'"'
    return b'"weights":' + json.dumps(store_lib.decode_weights(data).tolist()).encode()

  async def _refresh_stats(self) -> None:
    now = time.monotonic()
    if now - self._stats_time < self.stats_ttl_s:
      return
    slots = await self.store.all_slots()
    self.spam.fit(np.stack([store_lib.decode_weights(s) for s in slots]))
    self._stats_time = now

  def _parse_weights(self, body: dict) -> np.ndarray | web.Response:
    if "weights_b64" in body:
      raw = body["weights_b64"]
      if not isinstance(raw, str):
        return _error(400, "bad_weights", "weights_b64 must be a base64 string")
      try:
        data = binascii.a2b_base64(raw.encode("ascii"), strict_mode=True)
      except (binascii.Error, ValueError, UnicodeEncodeError):
        return _error(400, "bad_weights", "weights_b64 is not valid base64")
      if len(data) != 8 * self.p:
        return _error(422, "wrong_shape",
                      f"weights_b64 decodes to {len(data)} bytes; expected {8 * self.p} "
                      f"({self.p} little-endian float64)")
      w = store_lib.decode_weights(data)
    elif "weights" in body:
      raw = body["weights"]
      if not isinstance(raw, list):
        return _error(400, "bad_weights", "weights must be a JSON list of numbers")
      try:
        w = np.asarray(raw, dtype=np.float64)
      except (TypeError, ValueError):
        return _error(400, "bad_weights", "weights must be a flat JSON list of numbers")
      if w.shape != (self.p,):
        return _error(422, "wrong_shape", f"weights has shape {list(w.shape)}; expected [{self.p}]")
    else:
      return _error(400, "missing_weights", "body needs 'weights' or 'weights_b64'")
    return w

  # ---- handlers ----
  async def handle_draw(self, request: web.Request) -> web.Response:
    encoding = request.query.get("encoding", "json")
    if encoding not in ("json", "b64", "raw"):
      return _error(400, "bad_encoding", f"encoding must be 'json', 'b64' or 'raw', got {encoding!r}")
    i = secrets.randbelow(self.k)  # unpredictable draw; never stored
    data = await self.store.draw(i)
    if encoding == "raw":
      return web.Response(body=data, content_type="application/octet-stream",
                          headers={"X-DDML-Version": self.spec.version})
    body = (b'{"version":' + self._version_json + b',"spec":' + self._spec_json + b','
            + self._weights_payload(data, encoding) + b'}')
    return web.Response(body=body, content_type="application/json")

  async def handle_submit(self, request: web.Request) -> web.Response:
    try:
      if request.content_length is not None and request.content_length > self.max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes,
                                            actual_size=request.content_length)
      raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
      resp = _error(413, "body_too_large", f"body exceeds {self.max_body_bytes} bytes")
    else:
      # explicit header only: aiohttp reports a missing Content-Type as octet-stream
      ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
      resp = await self._submit(raw, ctype, request.headers.get("X-DDML-Version"))
    if resp is None:
      return web.Response(body=b'{"accepted":true}', content_type="application/json")
    resp, counter = resp if isinstance(resp, tuple) else (resp, "rejected_invalid")
    await self.store.incr("submits")
    await self.store.incr(counter)
    return resp

  async def _submit(self, raw: bytes, content_type: str = "application/json",
                    header_version: str | None = None):
    """Validates and stores; None on success, else the JSON error (store untouched)."""
    if content_type == "application/octet-stream":
      if header_version is None:
        return _error(400, "missing_version", "raw submissions need the X-DDML-Version header")
      if header_version != self.spec.version:
        return _error(409, "wrong_version",
                      f"model version {header_version!r} is not the served {self.spec.version!r}")
      if len(raw) != 8 * self.p:
        return _error(422, "wrong_shape", f"body has {len(raw)} bytes; expected {8 * self.p} "
                      f"({self.p} little-endian float64)")
      return await self._store_checked(store_lib.decode_weights(raw))
    try:
      body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
      return _error(400, "bad_json", "body is not valid JSON")
    if not isinstance(body, dict):
      return _error(400, "bad_json", "body must be a JSON object")
    if "version" not in body:
      return _error(400, "missing_version", "body needs the model 'version' returned by draw")
    if body["version"] != self.spec.version:
      return _error(409, "wrong_version",
                    f"model version {body['version']!r} is not the served {self.spec.version!r}")
    w = self._parse_weights(body)
    if isinstance(w, web.Response):
      return w
    return await self._store_checked(w)

  async def _store_checked(self, w: np.ndarray):
    if not np.all(np.isfinite(w)):
      return _error(422, "non_finite", "weights contain NaN or infinity")
    if self.spam is not None:
      await self._refresh_stats()
      if not self.spam.accepts(w):
        resp = _error(422, "rejected_by_spam_filter",
                      f"a weight lies outside mu +- {self.spam.t} sigma of the k instances")
        return resp, "rejected_spam"
    await self.store.replace(secrets.randbelow(self.k), store_lib.encode_weights(w))
    return None

  async def handle_model(self, request: web.Request) -> web.Response:
    encoding = request.query.get("encoding", "json")
    if encoding not in ("json", "b64", "raw"):
      return _error(400, "bad_encoding", f"encoding must be 'json', 'b64' or 'raw', got {encoding!r}")
    slots = await self.store.all_slots()
    avg = np.mean([store_lib.decode_weights(s) for s in slots], axis=0)
    if encoding == "raw":
      return web.Response(body=store_lib.encode_weights(avg), content_type="application/octet-stream",
                          headers={"X-DDML-Version": self.spec.version})
    body = (b'{"version":' + self._version_json + b',"k":' + str(self.k).encode() + b','
            + self._weights_payload(store_lib.encode_weights(avg), encoding) + b'}')
    return web.Response(body=body, content_type="application/json")

  async def handle_spec(self, request: web.Request) -> web.Response:
    return web.Response(body=self._spec_json, content_type="application/json")

  async def handle_metrics(self, request: web.Request) -> web.Response:
    c = await self.store.counters()
    return web.json_response(dict(c, k=self.k, version=self.spec.version, num_weights=self.p,
                                  store=self.store.kind,
                                  spam_t=self.spam.t if self.spam else None,
                                  uptime_s=time.time() - self.started))

  async def handle_health(self, request: web.Request) -> web.Response:
    return web.json_response({"ok": True})

  def make_app(self) -> web.Application:
    # client_max_size above max_body_bytes: the submit handler answers oversize with JSON.
    app = web.Application(client_max_size=self.max_body_bytes + 1)
    app.router.add_get("/v1/draw", self.handle_draw)
    app.router.add_post("/v1/submit", self.handle_submit)
    app.router.add_get("/v1/model", self.handle_model)
    app.router.add_get("/v1/spec", self.handle_spec)
    app.router.add_get("/v1/metrics", self.handle_metrics)
    app.router.add_get("/healthz", self.handle_health)
    app.on_startup.append(self.startup)
    app.on_cleanup.append(self.shutdown)
    return app


def run(spec: glm.ModelSpec, k: int, store_spec: str = "memory", host: str = "127.0.0.1",
        port: int = 8080, prefix: str = "ddml", **kwargs) -> None:
  """Blocking: serve until interrupted."""
  try:  # uvloop, when installed, roughly doubles aiohttp's request rate
    import uvloop  # pylint: disable=g-import-not-at-top
    loop_factory = uvloop.new_event_loop
  except ImportError:
    loop_factory = None
  import asyncio  # pylint: disable=g-import-not-at-top
  loop = loop_factory() if loop_factory else asyncio.new_event_loop()
  asyncio.set_event_loop(loop)
  svc = DDMLService(spec, k, store_lib.make_store(store_spec, prefix=prefix), **kwargs)
  web.run_app(svc.make_app(), host=host, port=port, access_log=None, print=None, loop=loop)
