"""Python client library for the Draw and Discard HTTP service.

DDMLClient (blocking, stdlib http.client keep-alive) and AsyncDDMLClient (aiohttp).
`update` runs a full round: draw an instance with its spec, Algorithm 1 on the local
records (client.spec_update), submit. Weights travel as raw little-endian float64
(application/octet-stream, version in X-DDML-Version); the spec is fetched once per version.

Transport: `https://` URLs verify the server certificate (`cafile=` for a private CA);
`token=` sends `Authorization: Bearer <token>`.

Privacy floor: the client does not trust the served spec. Before it trains on its
records it checks the spec against its own floor (`PrivacyFloor`): epsilon at most
`max_epsilon` (default the paper's ln 32), noise std at least `min_noise` times the
per-weight sensitivity 2*gamma*clip, a known noise law and (Gaussian) delta at most
`max_delta`. A weaker spec raises PrivacyFloorError and nothing is sent.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import math
import ssl
import urllib.parse

import numpy as np

from tf_dpiter.draw_discard import client as client_alg
from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import privacy

PAPER_EPSILON = math.log(32)


class DDMLError(RuntimeError):
  """A 4xx/5xx answer: .status, .code (the JSON 'error'), .message, .retry_after (s or None)."""

  def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
    super().__init__(f"HTTP {status} {code}: {message}")
    self.status, self.code, self.message = status, code, message
    self.retry_after = retry_after


class PrivacyFloorError(ValueError):
  """The served spec is weaker than the client's privacy floor; nothing was sent."""


@dataclasses.dataclass(frozen=True)
class PrivacyFloor:
  """What a client requires of a served spec before it trains on its records.

  Attributes:
    max_epsilon: largest per-update epsilon accepted; None disables the whole floor
      (explicitly non-private use, e.g. the paper's noiseless experiments).
    min_noise: smallest noise std per weight, in units of the sensitivity 2*gamma*clip
      (Laplace at epsilon has sqrt(2)/epsilon); None: no extra requirement.
    max_delta: largest delta accepted for Gaussian noise.
  """
  max_epsilon: float | None = PAPER_EPSILON
  min_noise: float | None = None
  max_delta: float = 1e-5

  def __post_init__(self):
    if self.max_epsilon is not None and not self.max_epsilon > 0:
      raise ValueError(f"max_epsilon must be > 0 or None, got {self.max_epsilon!r}")
    if self.min_noise is not None and not self.min_noise > 0:
      raise ValueError(f"min_noise must be > 0 or None, got {self.min_noise!r}")
    if not 0 < self.max_delta < 1:
      raise ValueError(f"max_delta must be in (0, 1), got {self.max_delta!r}")

  def check(self, spec: glm.ModelSpec) -> None:
    """Raises PrivacyFloorError if `spec` is weaker than this floor.

    Args:
      spec: the served spec.

    Raises:
      PrivacyFloorError: naming the setting and both values.
    """
    if self.max_epsilon is None:
      return
    if spec.epsilon is None or spec.noise == "none":
      raise PrivacyFloorError(f"served spec has no noise (epsilon={spec.epsilon!r}, "
                              f"noise={spec.noise!r}); client floor max_epsilon={self.max_epsilon:g}")
    if not (isinstance(spec.epsilon, (int, float)) and math.isfinite(spec.epsilon)
            and 0 < spec.epsilon <= self.max_epsilon):
      raise PrivacyFloorError(f"served epsilon={spec.epsilon!r} exceeds the client's "
                              f"max_epsilon={self.max_epsilon:g}")
    if spec.noise == "gaussian" and not spec.delta <= self.max_delta:
      raise PrivacyFloorError(f"served delta={spec.delta!r} exceeds the client's "
                              f"max_delta={self.max_delta:g}")
    if self.min_noise is not None:
      std = privacy.noise_std(spec.noise, spec.gamma, spec.epsilon, spec.clip, spec.delta)
      ratio = std / privacy.sensitivity(spec.gamma, spec.clip)
      if ratio < self.min_noise:
        raise PrivacyFloorError(f"served noise std is {ratio:.4g} x the sensitivity; the "
                                f"client's min_noise is {self.min_noise:g}")


@dataclasses.dataclass
class Drawn:
  """A drawn instance: model version, spec, flat weights and its draw ticket (tickets.py)."""
  version: str
  spec: glm.ModelSpec
  weights: np.ndarray
  ticket: str | None = None


def _submit_request(drawn, weights: np.ndarray) -> tuple[bytes, dict]:
  """Raw body and headers of a submit: with a Drawn that has a ticket, its instance and the
  update (2p doubles) and X-DDML-Ticket; with a version string, the update alone."""
  if isinstance(drawn, Drawn):
    headers = {"Content-Type": "application/octet-stream", "X-DDML-Version": drawn.version}
    if drawn.ticket:
      headers["X-DDML-Ticket"] = drawn.ticket
      return _raw_body(drawn.weights) + _raw_body(weights), headers
    return _raw_body(weights), headers
  return _raw_body(weights), {"Content-Type": "application/octet-stream", "X-DDML-Version": drawn}


def _weights(d: dict) -> np.ndarray:
  if "weights_b64" in d:
    return np.frombuffer(base64.b64decode(d["weights_b64"]), dtype="<f8").copy()
  return np.asarray(d["weights"], dtype=np.float64)


def _b64(weights: np.ndarray) -> str:
  return base64.b64encode(np.ascontiguousarray(weights, dtype="<f8").tobytes()).decode()


def _submit_body(drawn, weights: np.ndarray) -> bytes:
  if not isinstance(drawn, Drawn):
    return json.dumps({"version": drawn, "weights_b64": _b64(weights)}).encode()
  body = {"version": drawn.version, "weights_b64": _b64(weights)}
  if drawn.ticket:
    body.update(ticket=drawn.ticket, drawn_b64=_b64(drawn.weights))
  return json.dumps(body).encode()


def _raw_body(weights: np.ndarray) -> bytes:
  return np.ascontiguousarray(weights, dtype="<f8").tobytes()


def _checked_weights(data: bytes, spec: glm.ModelSpec) -> np.ndarray:
  if len(data) != 8 * spec.num_weights:
    raise DDMLError(502, "bad_draw", f"drawn instance has {len(data)} bytes; the spec needs "
                    f"{8 * spec.num_weights}")
  w = np.frombuffer(data, dtype="<f8").copy()
  if not np.all(np.isfinite(w)):
    raise DDMLError(502, "bad_draw", "drawn instance holds non-finite weights")
  return w


def _raise_for(status: int, body: bytes, retry_after: str | None = None) -> dict:
  try:
    d = json.loads(body)
  except ValueError:
    d = {"error": "http_error", "message": body[:200].decode(errors="replace")}
  if status >= 400:
    if not isinstance(d, dict):
      d = {"error": "http_error", "message": str(d)[:200]}
    wait = float(retry_after) if retry_after and retry_after.isdigit() else None
    raise DDMLError(status, d.get("error", "http_error"), d.get("message", ""), wait)
  return d


def _headers(token: str | None, extra: dict | None, has_body: bool) -> dict:
  h = {"Content-Type": "application/json"} if has_body else {}
  if token is not None:
    h["Authorization"] = f"Bearer {token}"
  h.update(extra or {})
  return h


def client_ssl_context(cafile: str | None = None) -> ssl.SSLContext:
  """A verifying TLS client context (system CAs, or `cafile` for a private CA).

  Args:
    cafile: PEM file of trusted CA certificates, or None.

  Returns:
    An ssl.SSLContext that checks the certificate and the host name.
  """
  ctx = ssl.create_default_context(cafile=cafile)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  return ctx


class DDMLClient:
  """Blocking client.

  Args:
    base_url: 'http://host:port' or 'https://host:port'.
    timeout: socket timeout in seconds.
    token: bearer token, or None.
    cafile: PEM CA file to verify an https server (default: the system CAs).
    ssl_context: a client SSLContext (overrides cafile).
    max_epsilon, min_noise, max_delta: the client's PrivacyFloor (max_epsilon=None: none).

  Raises:
    ValueError: for a bad URL or floor.
  """

  def __init__(self, base_url: str, timeout: float = 30.0, *, token: str | None = None,
               cafile: str | None = None, ssl_context: ssl.SSLContext | None = None,
               max_epsilon: float | None = PAPER_EPSILON, min_noise: float | None = None,
               max_delta: float = 1e-5):
    u = urllib.parse.urlparse(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
      raise ValueError(f"base_url must be http(s)://host:port, got {base_url!r}")
    self._tls = u.scheme == "https"
    self._ctx = (ssl_context or client_ssl_context(cafile)) if self._tls else None
    self._host, self._port, self._timeout = u.hostname, u.port or (443 if self._tls else 80), timeout
    self._token = token
    self.floor = PrivacyFloor(max_epsilon, min_noise, max_delta)
    self._conn = None
    self._specs: dict[str, glm.ModelSpec] = {}
    self.last_ticket: str | None = None

  def _connect(self):
    if self._tls:
      return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                         context=self._ctx)
    return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

  def _request(self, method: str, path: str, body: bytes | None = None,
               headers: dict | None = None, raw: bool = False):
    for attempt in (0, 1):
      if self._conn is None:
        self._conn = self._connect()
      try:
        self._conn.request(method, path, body=body,
                           headers=_headers(self._token, headers, body is not None))
        r = self._conn.getresponse()
        data = r.read()
        if raw and r.status < 400:
          self.last_ticket = r.getheader("X-DDML-Ticket")
          return r.getheader("X-DDML-Version"), data
        return _raise_for(r.status, data, r.getheader("Retry-After"))
      except (http.client.HTTPException, ConnectionError):
        self._conn.close()
        self._conn = None
        if attempt:
          raise
    raise AssertionError("unreachable")

  def draw(self) -> Drawn:
    """Draws an instance (raw encoding) with its spec (fetched once per version).

    Returns:
      A Drawn.

    Raises:
      DDMLError: for an error answer, or a body that is not the spec's finite weights.
    """
    version, data = self._request("GET", "/v1/draw?encoding=raw", raw=True)
    if version not in self._specs:
      spec = self.spec()
      self._specs[spec.version] = spec
    ticket = self.last_ticket
    spec = self._specs.get(version) or self.spec()
    return Drawn(version, spec, _checked_weights(data, spec), ticket)

  def submit(self, drawn, weights: np.ndarray) -> dict:
    """Submits an update of a drawn instance.

    Args:
      drawn: the Drawn it started from (its ticket and weights travel with the update), or
        a version string (only for servers run without tickets).
      weights: the updated instance.

    Returns:
      {"accepted": True, "seq": n}.

    Raises:
      DDMLError: for an error answer.
    """
    body, headers = _submit_request(drawn, weights)
    return self._request("POST", "/v1/submit", body, headers)

  def submit_and_draw(self, drawn, weights: np.ndarray) -> tuple[dict, Drawn | None]:
    """Submits and receives the next draw in the same answer (POST /v1/submit?draw=raw).

    Args:
      drawn: the Drawn the update started from (or its version, without tickets).
      weights: the updated instance.

    Returns:
      ({"accepted": True, "seq": n}, the next Drawn), or (answer, None) when the server
      gave no draw (draw quota).

    Raises:
      DDMLError: for an error answer.
    """
    if self._conn is None:
      self._conn = self._connect()
    body, headers = _submit_request(drawn, weights)
    self._conn.request("POST", "/v1/submit?draw=raw", body=body,
                       headers=_headers(self._token, headers, True))
    r = self._conn.getresponse()
    data = r.read()
    if r.status >= 400 or r.getheader("Content-Type", "").startswith("application/json"):
      return _raise_for(r.status, data, r.getheader("Retry-After")), None
    v = r.getheader("X-DDML-Version")
    if v not in self._specs:
      self._specs[v] = self.spec()
    spec = self._specs[v]
    return ({"accepted": True, "seq": int(r.getheader("X-DDML-Seq"))},
            Drawn(v, spec, _checked_weights(data, spec), r.getheader("X-DDML-Ticket")))

  def submit_json(self, drawn, weights: np.ndarray) -> dict:
    """The same as submit, as JSON with base64 weights."""
    return self._request("POST", "/v1/submit", _submit_body(drawn, weights))

  def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """Draw -> privacy floor check -> Algorithm 1 on (records, y) -> submit.

    Args:
      records: the client's raw records (featurized by the served spec).
      y: responses.
      rng: noise generator (default: fresh OS entropy).

    Returns:
      The server's answer ({"accepted": true, "seq": n}).

    Raises:
      PrivacyFloorError: when the served spec is weaker than the floor (nothing is sent).
      DDMLError: for an error answer.
    """
    drawn = self.draw()
    self.floor.check(drawn.spec)
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return self.submit(drawn, new)

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

  def __init__(self, base_url: str, session=None, timeout: float = 30.0, *,
               token: str | None = None, cafile: str | None = None,
               max_epsilon: float | None = PAPER_EPSILON, min_noise: float | None = None,
               max_delta: float = 1e-5):
    import aiohttp  # pylint: disable=g-import-not-at-top
    self._base = base_url.rstrip("/")
    self._own = session is None
    connector = None
    if self._base.startswith("https://"):
      connector = aiohttp.TCPConnector(ssl=client_ssl_context(cafile))
    self._session = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), connector=connector)
    self._token = token
    self.floor = PrivacyFloor(max_epsilon, min_noise, max_delta)
    self._specs: dict[str, glm.ModelSpec] = {}
    self.last_ticket: str | None = None

  async def _request(self, method: str, path: str, body: bytes | None = None,
                     headers: dict | None = None, raw: bool = False):
    h = _headers(self._token, headers, body is not None)
    async with self._session.request(method, self._base + path, data=body, headers=h) as r:
      data = await r.read()
      if raw and r.status < 400:
        self.last_ticket = r.headers.get("X-DDML-Ticket")
        return r.headers.get("X-DDML-Version"), data
      return _raise_for(r.status, data, r.headers.get("Retry-After"))

  async def draw(self) -> Drawn:
    v, data = await self._request("GET", "/v1/draw?encoding=raw", raw=True)
    ticket = self.last_ticket
    if v not in self._specs:
      spec = glm.ModelSpec.from_dict(await self._request("GET", "/v1/spec"))
      self._specs[spec.version] = spec
    return Drawn(v, self._specs[v], _checked_weights(data, self._specs[v]), ticket)

  async def submit(self, drawn, weights: np.ndarray) -> dict:
    """As DDMLClient.submit."""
    body, headers = _submit_request(drawn, weights)
    return await self._request("POST", "/v1/submit", body, headers)

  async def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """As DDMLClient.update (checks the privacy floor before training)."""
    drawn = await self.draw()
    self.floor.check(drawn.spec)
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return await self.submit(drawn, new)

  async def model(self) -> np.ndarray:
    _, data = await self._request("GET", "/v1/model?encoding=raw", raw=True)
    return np.frombuffer(data, dtype="<f8").copy()

  async def metrics(self) -> dict:
    return await self._request("GET", "/v1/metrics")

  async def close(self) -> None:
    if self._own:
      await self._session.close()
