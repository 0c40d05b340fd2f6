"""Python client library for the Draw and Discard HTTP service.

DDMLClient (blocking, stdlib http.client keep-alive) and AsyncDDMLClient (aiohttp).
`update` runs a full round: draw an instance with its spec, Algorithm 1 on the local
records (client.spec_update), submit. Weights travel as raw little-endian float64
(application/octet-stream, version in X-DDML-Version); the spec is fetched once per version.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import urllib.parse

import numpy as np

from tf_dpiter.draw_discard import client as client_alg
from tf_dpiter.draw_discard import glm


class DDMLError(RuntimeError):
  """A 4xx/5xx answer: .status, .code (the JSON 'error'), .message."""

  def __init__(self, status: int, code: str, message: str):
    super().__init__(f"HTTP {status} {code}: {message}")
    self.status, self.code, self.message = status, code, message


@dataclasses.dataclass
class Drawn:
  """A drawn instance: model version, spec and flat weights."""
  version: str
  spec: glm.ModelSpec
  weights: np.ndarray


def _weights(d: dict) -> np.ndarray:
  if "weights_b64" in d:
    return np.frombuffer(base64.b64decode(d["weights_b64"]), dtype="<f8").copy()
  return np.asarray(d["weights"], dtype=np.float64)


def _submit_body(version: str, weights: np.ndarray) -> bytes:
  b64 = base64.b64encode(np.ascontiguousarray(weights, dtype="<f8").tobytes()).decode()
  return json.dumps({"version": version, "weights_b64": b64}).encode()


def _raw_body(weights: np.ndarray) -> bytes:
  return np.ascontiguousarray(weights, dtype="<f8").tobytes()


def _raise_for(status: int, body: bytes) -> dict:
  try:
    d = json.loads(body)
  except ValueError:
    d = {"error": "http_error", "message": body[:200].decode(errors="replace")}
  if status >= 400:
    raise DDMLError(status, d.get("error", "http_error"), d.get("message", ""))
  return d


class DDMLClient:
  """Blocking client. base_url like 'http://127.0.0.1:8080'."""

  def __init__(self, base_url: str, timeout: float = 30.0):
    u = urllib.parse.urlparse(base_url)
    if u.scheme != "http" or not u.hostname:
      raise ValueError(f"base_url must be http://host:port, got {base_url!r}")
    self._host, self._port, self._timeout = u.hostname, u.port or 80, timeout
    self._conn = None
    self._specs: dict[str, glm.ModelSpec] = {}

  def _request(self, method: str, path: str, body: bytes | None = None,
               headers: dict | None = None, raw: bool = False):
    for attempt in (0, 1):
      if self._conn is None:
        self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
      try:
        h = {"Content-Type": "application/json"} if body is not None else {}
        h.update(headers or {})
        self._conn.request(method, path, body=body, headers=h)
        r = self._conn.getresponse()
        data = r.read()
        if raw and r.status < 400:
          return r.getheader("X-DDML-Version"), data
        return _raise_for(r.status, data)
      except (http.client.HTTPException, ConnectionError):
        self._conn.close()
        self._conn = None
        if attempt:
          raise
    raise AssertionError("unreachable")

  def draw(self) -> Drawn:
    version, data = self._request("GET", "/v1/draw?encoding=raw", raw=True)
    if version not in self._specs:
      spec = self.spec()
      self._specs[spec.version] = spec
    return Drawn(version, self._specs.get(version) or self.spec(),
                 np.frombuffer(data, dtype="<f8").copy())

  def submit(self, version: str, weights: np.ndarray) -> dict:
    return self._request("POST", "/v1/submit", _raw_body(weights),
                         {"Content-Type": "application/octet-stream", "X-DDML-Version": version})

  def submit_json(self, version: str, weights: np.ndarray) -> dict:
    """The same as submit, as JSON with base64 weights."""
    return self._request("POST", "/v1/submit", _submit_body(version, weights))

  def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """Draw -> Algorithm 1 on (records, y) with the served spec -> submit."""
    drawn = self.draw()
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return self.submit(drawn.version, new)

  def model(self) -> np.ndarray:
    _, data = self._request("GET", "/v1/model?encoding=raw", raw=True)
    return np.frombuffer(data, dtype="<f8").copy()

  def spec(self) -> glm.ModelSpec:
    return glm.ModelSpec.from_dict(self._request("GET", "/v1/spec"))

  def metrics(self) -> dict:
    return self._request("GET", "/v1/metrics")

  def close(self) -> None:
    if self._conn is not None:
      self._conn.close()
      self._conn = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class AsyncDDMLClient:
  """aiohttp client; share one per event loop (it pools connections)."""

  def __init__(self, base_url: str, session=None, timeout: float = 30.0):
    import aiohttp  # pylint: disable=g-import-not-at-top
    self._base = base_url.rstrip("/")
    self._own = session is None
    self._session = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout))
    self._specs: dict[str, glm.ModelSpec] = {}

  async def _request(self, method: str, path: str, body: bytes | None = None,
                     headers: dict | None = None, raw: bool = False):
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    async with self._session.request(method, self._base + path, data=body, headers=h) as r:
      data = await r.read()
      if raw and r.status < 400:
        return r.headers.get("X-DDML-Version"), data
      return _raise_for(r.status, data)

  async def draw(self) -> Drawn:
    v, data = await self._request("GET", "/v1/draw?encoding=raw", raw=True)
    if v not in self._specs:
      spec = glm.ModelSpec.from_dict(await self._request("GET", "/v1/spec"))
      self._specs[spec.version] = spec
    return Drawn(v, self._specs[v], np.frombuffer(data, dtype="<f8").copy())

  async def submit(self, version: str, weights: np.ndarray) -> dict:
    return await self._request("POST", "/v1/submit", _raw_body(weights),
                               {"Content-Type": "application/octet-stream", "X-DDML-Version": version})

  async def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    drawn = await self.draw()
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return await self.submit(drawn.version, new)

  async def model(self) -> np.ndarray:
    _, data = await self._request("GET", "/v1/model?encoding=raw", raw=True)
    return np.frombuffer(data, dtype="<f8").copy()

  async def metrics(self) -> dict:
    return await self._request("GET", "/v1/metrics")

  async def close(self) -> None:
    if self._own:
      await self._session.close()
