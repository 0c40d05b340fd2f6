"""Python client library for the Draw and Discard HTTP service.

DDMLClient (blocking, stdlib http.client) and AsyncDDMLClient (aiohttp). `update` runs a
round: draw with the spec (fetched once per version), Algorithm 1 (client.spec_update),
submit, as raw little-endian float64. `https://` verifies the server (`cafile=`); a `token=`
is refused over `http://` unless `insecure=True`. The privacy floor (`PrivacyFloor`) is
checked on every submit path: a weaker spec raises PrivacyFloorError and nothing is sent.
"""

from __future__ import annotations

import asyncio
import http.client
import select
import ssl
import time
import urllib.parse

import numpy as np

from tf_dpiter.draw_discard import client as client_alg
from tf_dpiter.draw_discard import client_wire as wire
from tf_dpiter.draw_discard import glm
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.draw_discard.client_floor import (  # re-exported: public names
    PAPER_EPSILON, PrivacyFloor, PrivacyFloorError)
from tf_dpiter.draw_discard.client_wire import (  # re-exported: public names
    DDMLError, Drawn, SubmitOutcomeUnknown, client_ssl_context)

__all__ = ["PAPER_EPSILON", "PrivacyFloor", "PrivacyFloorError", "DDMLError", "Drawn",
           "SubmitOutcomeUnknown", "client_ssl_context", "DDMLClient", "AsyncDDMLClient"]

# the answer of a resent submit that found its ticket used: an earlier send stored it
_RESENT = {"accepted": True, "seq": None, "resent": True}


def _ticketed(drawn) -> bool:
  """Whether a submit of `drawn` carries a draw ticket (the server may still not check it)."""
  return isinstance(drawn, Drawn) and bool(drawn.ticket)


def _resend_safe(drawn) -> bool:
  """Whether a submit of `drawn` carries a ticket that its server said it checks (the draw's
  X-DDML-Resend: same_ticket): a resend of it cannot be stored twice."""
  return _ticketed(drawn) and drawn.resend_safe


def _peer_closed(sock) -> bool:
  """Whether an idle keep-alive socket has something to read: the server closed it (or sent
  what nobody asked for); a submit that may not be resent then goes on a new connection."""
  try:
    return bool(select.select([sock], [], [], 0)[0])
  except (OSError, ValueError):  # closed, or not a selectable socket
    return True


class _Settle:
  """What a submit's answers say so far, shared by both clients.

  A 503 outcome_unknown answer means the submit may be stored. Only a server that requires
  tickets ("resend": "same_ticket": it marks a ticket used with its update's write) gets the
  same bytes resent, at most `max_resends` times; a 409 ticket_used answer to a resend means
  an earlier send stored it. Before such an answer, a lost connection is resent once only
  for a Drawn whose draw said tickets are required (`resend_safe`); otherwise (no dedupe: a
  resend could store the update twice) a send that may be stored ends in
  SubmitOutcomeUnknown, never in a resend or a new draw.
  """

  def __init__(self, ticketed: bool, max_resends: int, resend_safe: bool = False):
    self.ticketed, self.max_resends = ticketed, max_resends
    self.resend_safe = ticketed and resend_safe  # the draw said: tickets checked
    self.dedupes = False  # the server said that a resend with this ticket is stored at most once
    self.maybe_stored, self.sends, self.cause, self.cause_error = False, 0, "", None
    self.wait_s = 0.0

  def _may_resend(self, attempt: int) -> bool:
    return attempt < (self.max_resends if self.dedupes else 1)

  def not_sent(self, e: BaseException, attempt: int) -> bool:
    """The connection could not be opened (nothing sent): whether to try again."""
    self.cause, self.cause_error, self.wait_s = f"{type(e).__name__}: {e}", e, 0.5
    return self._may_resend(attempt)

  def lost(self, e: BaseException, attempt: int, timed_out: bool) -> bool:
    """The connection was lost, or timed out, after the request was (maybe) sent: whether
    to resend (only with a ticket the server checks; a timeout only to a server that said in
    an outcome_unknown answer that it dedupes by ticket)."""
    self.maybe_stored, self.cause, self.cause_error = True, f"{type(e).__name__}: {e}", e
    self.wait_s = 0.0 if attempt == 0 else 0.5  # the first: maybe a stale keep-alive
    return (self.dedupes or (self.resend_safe and not timed_out)) and self._may_resend(attempt)

  def answered(self, status: int, data: bytes, retry_after: str | None, attempt: int) -> str:
    """"answer" (the caller decodes or raises it), "stored" (a resend found its ticket
    used), "resend" or "give_up" (raise self.unknown())."""
    if status < 400:
      return "answer"
    code, resend = wire.error_fields(data)
    if self.maybe_stored and status == 409 and code == "ticket_used":
      return "stored"
    if code == wire.OUTCOME_UNKNOWN:
      self.maybe_stored = True
      self.dedupes = self.dedupes or (self.ticketed and resend == "same_ticket")
    if not self.maybe_stored:
      return "answer"  # an error answer of a submit that stored nothing
    self.cause, self.cause_error = f"HTTP {status} {code}", None
    if not (self.dedupes and code in wire.RESEND_AGAIN_CODES and self._may_resend(attempt)):
      return "give_up"
    self.wait_s = wire.resend_wait_s(retry_after)
    return "resend"

  def unknown(self) -> SubmitOutcomeUnknown:
    return SubmitOutcomeUnknown(self.sends, self.cause)


class DDMLClient:
  """Blocking client.

  A failed request is sent once more; a submit whose outcome is unknown is resent with its
  ticket only to a server that dedupes tickets (`_Settle`). A resend answered 409
  ticket_used returns {"accepted": True, "seq": None, "resent": True}: an earlier send
  stored it, and training again on the same records would spend their epsilon twice. An
  unsettled submit raises SubmitOutcomeUnknown: send neither it nor an update of the same
  records again.

  Args:
    base_url: 'http://host:port' or 'https://host:port'.
    timeout: socket timeout in seconds.
    token: bearer token, or None.
    cafile: PEM CA file to verify an https server (default: the system CAs).
    ssl_context: a client SSLContext (overrides cafile).
    max_epsilon: the PrivacyFloor's largest served epsilon (None: no floor).
    min_noise: the PrivacyFloor's smallest noise std, in sensitivities (None: none).
    max_delta: the PrivacyFloor's largest Gaussian delta.
    max_total_epsilon: the PrivacyFloor's largest weights x epsilon (None: none).
    insecure: allow sending the token over http://.
    max_resends: resends of a ticketed submit whose outcome is unknown (an integer >= 0).

  Raises:
    ParameterValueError: for a bad URL, floor or max_resends, or a token with an http:// URL.
  """

  last_resend_safe = False  # the last raw answer's X-DDML-Resend: same_ticket

  def __init__(self, base_url: str, timeout: float = 30.0, *, token: str | None = None,
               cafile: str | None = None, ssl_context: ssl.SSLContext | None = None,
               max_epsilon: float | None = PAPER_EPSILON, min_noise: float | None = None,
               max_delta: float = 1e-5, insecure: bool = False,
               max_total_epsilon: float | None = None, max_resends: int = 3):
    wire.check_token_transport(base_url, token, insecure)
    self.max_resends = wire.check_max_resends(max_resends)
    u = urllib.parse.urlparse(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
      raise ParameterValueError(f"base_url must be http(s)://host:port, got {base_url!r}")
    self._tls = u.scheme == "https"
    self._ctx = (ssl_context or client_ssl_context(cafile)) if self._tls else None
    self._host, self._port, self._timeout = u.hostname, u.port or (443 if self._tls else 80), timeout
    self._token = token
    self.floor = PrivacyFloor(max_epsilon, min_noise, max_delta, max_total_epsilon)
    self._conn = None
    self._specs: dict[str, glm.ModelSpec] = {}
    self.last_ticket: str | None = None
    self.last_model_seq: int | None = None  # sequence number of the last model() release
    self._seq_header = None

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
                           headers=wire.request_headers(self._token, headers, body is not None))
        r = self._conn.getresponse()
        data = r.read()
        if raw and r.status < 400:
          self.last_ticket = r.getheader("X-DDML-Ticket")
          self.last_resend_safe = wire.resend_safe(r.getheader(wire.RESEND_HEADER))
          self._seq_header = r.getheader("X-DDML-Seq")
          return r.getheader("X-DDML-Version"), data
        return wire.answer_or_raise(r.status, data, r.getheader("Retry-After"))
      except (http.client.HTTPException, ConnectionError):
        self._conn.close()
        self._conn = None
        if attempt:
          raise
    raise AssertionError("unreachable")

  def _submit(self, path: str, body: bytes, headers: dict | None, drawn):
    """(response, body) of a submit's final answer, or None when a resend found its ticket
    used (stored by an earlier send); resends as in `_Settle`.

    Raises:
      SubmitOutcomeUnknown: a send may have been stored and the resends did not settle it.
      ConnectionError, http.client.HTTPException: when no send reached the server.
    """
    st = _Settle(_ticketed(drawn), self.max_resends, _resend_safe(drawn))
    attempt = 0
    while True:
      if attempt and st.wait_s > 0:
        time.sleep(st.wait_s)
      if (not st.resend_safe and self._conn is not None and self._conn.sock is not None
          and _peer_closed(self._conn.sock)):
        self.close()  # a stale keep-alive: nothing sent on it yet
      if self._conn is None:
        self._conn = self._connect()
      try:
        if self._conn.sock is None:
          self._conn.connect()
      except (http.client.HTTPException, ConnectionError) as e:  # nothing sent
        self.close()
        if st.not_sent(e, attempt):
          attempt += 1
          continue
        break
      try:
        st.sends += 1
        self._conn.request("POST", path, body=body,
                           headers=wire.request_headers(self._token, headers, True))
        r = self._conn.getresponse()
        data = r.read()
      except (http.client.HTTPException, ConnectionError, TimeoutError) as e:
        self.close()
        if st.lost(e, attempt, isinstance(e, TimeoutError)):
          attempt += 1
          continue
        break
      step = st.answered(r.status, data, r.getheader("Retry-After"), attempt)
      if step == "answer":
        return r, data
      if step == "stored":
        return None
      if step == "give_up":
        break
      attempt += 1
    if st.maybe_stored:
      raise st.unknown() from st.cause_error
    raise st.cause_error

  def _submit_answer(self, body: bytes, headers: dict | None, drawn) -> dict:
    got = self._submit("/v1/submit", body, headers, drawn)
    if got is None:
      return dict(_RESENT)
    r, data = got
    return wire.answer_or_raise(r.status, data, r.getheader("Retry-After"))

  def draw(self) -> Drawn:
    """A Drawn: an instance (raw encoding) with its spec (fetched once per version).

    Raises:
      DDMLError: for an error answer, a body that is not the spec's finite weights, or a
        served version that changed before its spec was fetched (409 version_changed: draw
        again).
    """
    version, data = self._request("GET", "/v1/draw?encoding=raw", raw=True)
    ticket, resend_safe = self.last_ticket, self.last_resend_safe
    spec = self._spec_of(version)
    return Drawn(version, spec, wire.checked_weights(data, spec), ticket, resend_safe)

  def _spec_of(self, version):
    """The spec of a served version, fetched (GET /v1/spec, JSON) only for a new version
    (`wire.spec_of_draw`: refused when the version moved on meanwhile)."""
    if version not in self._specs:
      self._specs[version] = wire.spec_of_draw(version, self.spec())
    return self._specs[version]

  def submit(self, drawn, weights: np.ndarray) -> dict:
    """Submits an update of a drawn instance.

    Args:
      drawn: the Drawn it started from (its ticket and weights travel with the update), or
        a version string (only for servers run without tickets).
      weights: the updated instance.

    Returns:
      {"accepted": True, "seq": n}; {"accepted": True, "seq": None, "resent": True} when an
      answer was lost and a resend found the ticket used (see the class docstring).

    Raises:
      PrivacyFloorError: when the spec of the draw is weaker than the floor (nothing sent).
      SubmitOutcomeUnknown: the update may be stored and the resends did not settle it: do
        not send it, nor an update of the same records, again.
      DDMLError: for an error answer.
    """
    self._check_floor(drawn)
    body, headers = wire.submit_request(drawn, weights)
    return self._submit_answer(body, headers, drawn)

  def _check_floor(self, drawn) -> None:
    self.floor.check(drawn.spec if isinstance(drawn, Drawn) else self.spec())

  def submit_and_draw(self, drawn, weights: np.ndarray) -> tuple[dict, Drawn | None]:
    """Submits and receives the next draw in the same answer (POST /v1/submit?draw=raw).

    Args:
      drawn: the Drawn the update started from (or its version, without tickets).
      weights: the updated instance.

    Returns:
      ({"accepted": True, "seq": n}, the next Drawn), or (answer, None) when the server
      gave no draw (draw quota) or a resend found the ticket used (as `submit`).

    Raises:
      PrivacyFloorError: when the spec of the draw is weaker than the floor (nothing sent).
      SubmitOutcomeUnknown: as `submit`.
      DDMLError: for an error answer.
    """
    self._check_floor(drawn)
    body, headers = wire.submit_request(drawn, weights)
    got = self._submit("/v1/submit?draw=raw", body, headers, drawn)
    if got is None:
      return dict(_RESENT), None
    r, data = got
    if r.status >= 400 or r.getheader("Content-Type", "").startswith("application/json"):
      return wire.answer_or_raise(r.status, data, r.getheader("Retry-After")), None
    v = r.getheader("X-DDML-Version")
    spec = self._spec_of(v)
    return ({"accepted": True, "seq": int(r.getheader("X-DDML-Seq"))},
            Drawn(v, spec, wire.checked_weights(data, spec), r.getheader("X-DDML-Ticket"),
                  wire.resend_safe(r.getheader(wire.RESEND_HEADER))))

  def submit_json(self, drawn, weights: np.ndarray) -> dict:
    """The same as submit, as JSON with base64 weights.

    Args:
      drawn: the Drawn the update started from (or its version, without tickets).
      weights: the updated instance.

    Returns:
      {"accepted": True, "seq": n}, or as `submit` after a resend.

    Raises:
      PrivacyFloorError: when the spec of the draw is weaker than the floor (nothing sent).
      SubmitOutcomeUnknown: as `submit`.
      DDMLError: for an error answer.
    """
    self._check_floor(drawn)
    return self._submit_answer(wire.json_submit_body(drawn, weights), None, drawn)

  def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """Draw -> privacy floor check -> Algorithm 1 on (records, y) -> submit.

    Args:
      records: the client's raw records (featurized by the served spec).
      y: responses.
      rng: noise generator (default: fresh OS entropy).

    Returns:
      The server's answer ({"accepted": true, "seq": n}), or {"accepted": True, "seq": None,
      "resent": True} when an answer was lost and a resend of the same submission found it
      stored (`submit`). An update whose outcome is unknown is resent with its ticket, never
      drawn and trained again.

    Raises:
      PrivacyFloorError: when the served spec is weaker than the floor (nothing is sent).
      SubmitOutcomeUnknown: the update may be stored: do not call update again with the
        same records (a second update of them spends their epsilon twice).
      DDMLError: for an error answer.
    """
    drawn = self.draw()
    self.floor.check(drawn.spec)
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return self.submit(drawn, new)

  def model(self) -> np.ndarray:
    """The served model, [p] float64: the average of the k instances (GET /v1/model, raw).

    Raises:
      DDMLError: for an error answer.
    """
    _, data = self._request("GET", "/v1/model?encoding=raw", raw=True)
    self.last_model_seq = int(self._seq_header) if self._seq_header else None
    return np.frombuffer(data, dtype="<f8").copy()

  def spec(self) -> glm.ModelSpec:
    """The served glm.ModelSpec (GET /v1/spec).

    Raises:
      DDMLError: for an error answer.
    """
    return glm.ModelSpec.from_dict(self._request("GET", "/v1/spec"))

  def metrics(self) -> dict:
    """The service's counters and settings (GET /v1/metrics): a dict (draws, submits,
    rejected..., k, version, acceptance...).

    Raises:
      DDMLError: for an error answer.
    """
    return self._request("GET", "/v1/metrics")

  def close(self) -> None:
    """Closes the keep-alive connection (the next request opens a new one)."""
    if self._conn is not None:
      self._conn.close()
      self._conn = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class AsyncDDMLClient:
  """aiohttp client; share one per event loop (it pools connections). Submits are resent or
  raised as SubmitOutcomeUnknown as by DDMLClient.

  Args:
    base_url: 'http://host:port' or 'https://host:port'.
    session: an aiohttp.ClientSession to use (not closed by close()), or None for an own one.
    timeout: total request timeout in seconds.
    token: bearer token, or None.
    cafile: PEM CA file to verify an https server (default: the system CAs).
    max_epsilon: the PrivacyFloor's largest served epsilon (None: no floor).
    min_noise: the PrivacyFloor's smallest noise std, in sensitivities (None: none).
    max_delta: the PrivacyFloor's largest Gaussian delta.
    max_total_epsilon: the PrivacyFloor's largest weights x epsilon (None: none).
    insecure: allow sending the token over http://.
    max_resends: resends of a ticketed submit whose outcome is unknown (an integer >= 0).

  Raises:
    ParameterValueError: for a bad floor or max_resends, or a token with an http:// URL.
  """

  last_resend_safe = False  # the last raw answer's X-DDML-Resend: same_ticket

  def __init__(self, base_url: str, session=None, timeout: float = 30.0, *,
               token: str | None = None, cafile: str | None = None,
               max_epsilon: float | None = PAPER_EPSILON, min_noise: float | None = None,
               max_delta: float = 1e-5, insecure: bool = False,
               max_total_epsilon: float | None = None, max_resends: int = 3):
    wire.check_token_transport(base_url, token, insecure)
    self.max_resends = wire.check_max_resends(max_resends)
    import aiohttp  # pylint: disable=g-import-not-at-top
    self._base = base_url.rstrip("/")
    self._own = session is None
    connector = None
    if self._base.startswith("https://"):
      connector = aiohttp.TCPConnector(ssl=client_ssl_context(cafile))
    self._session = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), connector=connector)
    self._token = token
    self.floor = PrivacyFloor(max_epsilon, min_noise, max_delta, max_total_epsilon)
    self._specs: dict[str, glm.ModelSpec] = {}
    self.last_ticket: str | None = None

  async def _request(self, method: str, path: str, body: bytes | None = None,
                     headers: dict | None = None, raw: bool = False):
    h = wire.request_headers(self._token, headers, body is not None)
    async with self._session.request(method, self._base + path, data=body, headers=h) as r:
      data = await r.read()
      if raw and r.status < 400:
        self.last_ticket = r.headers.get("X-DDML-Ticket")
        self.last_resend_safe = wire.resend_safe(r.headers.get(wire.RESEND_HEADER))
        return r.headers.get("X-DDML-Version"), data
      return wire.answer_or_raise(r.status, data, r.headers.get("Retry-After"))

  async def _submit(self, body: bytes, headers: dict, drawn) -> dict:
    """The answer of a submit, resent as in `_Settle`.

    Raises:
      SubmitOutcomeUnknown: a send may have been stored and the resends did not settle it.
      DDMLError: for an error answer of a submit that stored nothing.
      aiohttp.ClientError: when no send reached the server.
    """
    import aiohttp  # pylint: disable=g-import-not-at-top
    st = _Settle(_ticketed(drawn), self.max_resends, _resend_safe(drawn))
    h = wire.request_headers(self._token, headers, True)
    attempt = 0
    while True:
      if attempt and st.wait_s > 0:
        await asyncio.sleep(st.wait_s)
      try:
        st.sends += 1
        async with self._session.request("POST", self._base + "/v1/submit", data=body,
                                         headers=h) as r:
          status, retry_after, data = r.status, r.headers.get("Retry-After"), await r.read()
      except aiohttp.ClientConnectorError as e:  # the connection was not opened: not sent
        st.sends -= 1
        if st.not_sent(e, attempt):
          attempt += 1
          continue
        break
      except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if st.lost(e, attempt, isinstance(e, asyncio.TimeoutError)):
          attempt += 1
          continue
        break
      step = st.answered(status, data, retry_after, attempt)
      if step == "answer":
        return wire.answer_or_raise(status, data, retry_after)
      if step == "stored":
        return dict(_RESENT)
      if step == "give_up":
        break
      attempt += 1
    if st.maybe_stored:
      raise st.unknown() from st.cause_error
    raise st.cause_error

  async def draw(self) -> Drawn:
    """As DDMLClient.draw.

    Raises:
      DDMLError: for an error answer, a body that is not the spec's finite weights, or a
        served version that changed before its spec was fetched (409 version_changed).
    """
    v, data = await self._request("GET", "/v1/draw?encoding=raw", raw=True)
    ticket, resend_safe = self.last_ticket, self.last_resend_safe
    if v not in self._specs:
      self._specs[v] = wire.spec_of_draw(
          v, glm.ModelSpec.from_dict(await self._request("GET", "/v1/spec")))
    return Drawn(v, self._specs[v], wire.checked_weights(data, self._specs[v]), ticket,
                 resend_safe)

  async def submit(self, drawn, weights: np.ndarray) -> dict:
    """As DDMLClient.submit.

    Raises:
      PrivacyFloorError: when the spec of the draw is weaker than the floor (nothing sent).
      SubmitOutcomeUnknown: as DDMLClient.submit.
      DDMLError: for an error answer.
    """
    spec = drawn.spec if isinstance(drawn, Drawn) else glm.ModelSpec.from_dict(
        await self._request("GET", "/v1/spec"))
    self.floor.check(spec)
    body, headers = wire.submit_request(drawn, weights)
    return await self._submit(body, headers, drawn)

  async def update(self, records, y, rng: np.random.Generator | None = None) -> dict:
    """As DDMLClient.update (checks the privacy floor before training; an update whose
    outcome is unknown is resent with its ticket, never drawn and trained again).

    Raises:
      PrivacyFloorError: as DDMLClient.update.
      SubmitOutcomeUnknown: as DDMLClient.update.
      DDMLError: as DDMLClient.update.
    """
    drawn = await self.draw()
    self.floor.check(drawn.spec)
    new = client_alg.spec_update(drawn.spec, drawn.weights, records, y, rng=rng)
    return await self.submit(drawn, new)

  async def model(self) -> np.ndarray:
    """As DDMLClient.model.

    Raises:
      DDMLError: for an error answer.
    """
    _, data = await self._request("GET", "/v1/model?encoding=raw", raw=True)
    return np.frombuffer(data, dtype="<f8").copy()

  async def metrics(self) -> dict:
    """As DDMLClient.metrics.

    Raises:
      DDMLError: for an error answer.
    """
    return await self._request("GET", "/v1/metrics")

  async def close(self) -> None:
    """Closes the session if this client created it."""
    if self._own:
      await self._session.close()
