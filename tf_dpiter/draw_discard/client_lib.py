"""Python client library for the Draw and Discard HTTP service.

DDMLClient (blocking, stdlib http.client keep-alive) and AsyncDDMLClient (aiohttp).
`update` runs a full round: draw an instance with its spec, Algorithm 1 on the local
records (client.spec_update), submit. Weights travel as base64 float64.
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

  def _request(self, method: str, path: str, body: bytes | None = None) -> dict:
    for attempt in (0, 1):
      if self._conn is None:
        self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
      try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        self._conn.request(method, path, body=body, headers=headers)
        r = self._conn.getresponse()
        data = r.read()
        return _raise_for(r.status, data)
      except (http.client.HTTPException, ConnectionError):
        self._conn.close()
        self._conn = None
        if attempt:
          raise
    raise AssertionError("unreachable")

  def _spec(self, d: dict) -> glm.ModelSpec:
    v = d["version"]
    if v not in self._specs:
      self._specs[v] = glm.ModelSpec.from_dict(d["spec"])
    return self._specs[v]

  def draw(self) -> Drawn:
    d = self._request("GET", "/v1/draw?encoding=b64")
    return Drawn(d["version"], self._spec(d), _weights(d))

  def submit(self, version: str, weights: np.ndarray) -> dict:
    return self._request("POST", "/v1/submit", _submit_body(version, weights))

  def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """Draw -> Algorithm 1 on (records, y) with the served spec -> submit."""
    drawn = self.draw()
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return self.submit(drawn.version, new)

  def model(self) -> np.ndarray:
    return _weights(self._request("GET", "/v1/model?encoding=b64"))

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

  async def _request(self, method: str, path: str, body: bytes | None = None) -> dict:
    headers = {"Content-Type": "application/json"} if body is not None else None
    async with self._session.request(method, self._base + path, data=body,
                                     headers=headers) as r:
      return _raise_for(r.status, await r.read())

  async def draw(self) -> Drawn:
    d = await self._request("GET", "/v1/draw?encoding=b64")
    v = d["version"]
    if v not in self._specs:
      self._specs[v] = glm.ModelSpec.from_dict(d["spec"])
    return Drawn(v, self._specs[v], _weights(d))

  async def submit(self, version: str, weights: np.ndarray) -> dict:
    return await self._request("POST", "/v1/submit", _submit_body(version, weights))

  async def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    drawn = await self.draw()
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return await self.submit(drawn.version, new)

  async def model(self) -> np.ndarray:
    return _weights(await self._request("GET", "/v1/model?encoding=b64"))

  async def metrics(self) -> dict:
    return await self._request("GET", "/v1/metrics")

  async def close(self) -> None:
    if self._own:
      await self._session.close()
