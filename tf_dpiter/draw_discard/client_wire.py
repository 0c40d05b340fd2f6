"""Wire format of the Draw and Discard Python clients (blocking and async): raw little-endian
float64 (X-DDML-Version, X-DDML-Ticket; with a ticket the body is the drawn instance then the
update) or JSON with base64 weights; error answers become DDMLError."""

from __future__ import annotations

import base64
import dataclasses
import json
import ssl

import numpy as np

from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError


class DDMLError(RuntimeError):
  """A 4xx/5xx answer: .status, .code (the JSON 'error'), .message, .retry_after (s or None).

  Args:
    status: HTTP status.
    code: the answer's stable error code.
    message: the answer's message.
    retry_after: seconds to wait before retrying (429/503), or None.
  """

  def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
    super().__init__(f"HTTP {status} {code}: {message}")
    self.status, self.code, self.message = status, code, message
    self.retry_after = retry_after


class SubmitOutcomeUnknown(DDMLError):
  """A submit whose outcome stayed unknown (503 outcome_unknown, or the connection lost or
  timed out after a send) and that resends with its ticket did not settle: it may be stored,
  so send neither it nor an update of the same records again (a second update of the same
  data spends its epsilon twice). .status 503, .code "outcome_unknown", .attempts: the sends."""

  def __init__(self, attempts: int, cause: str):
    super().__init__(503, OUTCOME_UNKNOWN,
                     f"the update may be stored: {attempts} send(s) of the same submission "
                     f"did not settle whether the server stored it (last: {cause}); do not send "
                     "it again, nor train on the same records for a new draw")
    self.attempts = attempts


OUTCOME_UNKNOWN = "outcome_unknown"
# answers to a resend that leave an earlier send's outcome unknown and may change
RESEND_AGAIN_CODES = frozenset({OUTCOME_UNKNOWN, "store_unavailable", "too_many_connections"})
MAX_RESEND_WAIT_S = 5.0


def check_max_resends(max_resends) -> int:
  """`max_resends` as an int >= 0 (resends of a submit whose outcome is unknown).

  Raises:
    ParameterValueError: for anything else.
  """
  if isinstance(max_resends, bool) or not isinstance(max_resends, int) or max_resends < 0:
    raise ParameterValueError("`max_resends` must be an integer >= 0 (resends of a submit "
                              f"whose outcome is unknown). Received: max_resends={max_resends!r}")
  return int(max_resends)


def error_fields(body: bytes) -> tuple[str | None, str | None]:
  """(the JSON "error" code, its "resend" field) of an error answer's body, or None each."""
  try:
    d = json.loads(body)
  except ValueError:
    return None, None
  return (d.get("error"), d.get("resend")) if isinstance(d, dict) else (None, None)


def resend_wait_s(retry_after: str | None) -> float:
  """Seconds to wait before resending a submit after an answer: its Retry-After (at most
  MAX_RESEND_WAIT_S), else 0.5."""
  if retry_after and retry_after.isdigit():
    return min(float(retry_after), MAX_RESEND_WAIT_S)
  return 0.5


# on a draw of a server that requires tickets (value "same_ticket"): a resend of its
# submission with its ticket is stored at most once (the service sets it, the clients read it)
RESEND_HEADER = "X-DDML-Resend"


@dataclasses.dataclass
class Drawn:
  """A drawn instance: model version, spec, flat weights, its draw ticket (tickets.py) and
  whether the server said that it requires tickets (`resend_safe`, the draw's X-DDML-Resend:
  same_ticket): only then may a submit of it whose connection dropped be resent."""
  version: str
  spec: glm.ModelSpec
  weights: np.ndarray
  ticket: str | None = None
  resend_safe: bool = False


def resend_safe(header: str | None) -> bool:
  """Whether a draw answer's X-DDML-Resend header says that its submission, resent with its
  ticket, is stored at most once."""
  return header == "same_ticket"


def spec_of_draw(version: str, spec: glm.ModelSpec) -> glm.ModelSpec:
  """The spec fetched for a drawn instance of `version`, refused (DDMLError 409
  version_changed) when the server moved to another version between the draw and the fetch:
  an instance is never paired with another version's spec (its privacy floor is checked
  against that spec)."""
  if spec.version != version:
    raise DDMLError(409, "version_changed",
                    f"the served model version changed between the draw and the spec fetch "
                    f"(drew version {version!r}, the spec is now {spec.version!r}); draw again")
  return spec


def submit_request(drawn, weights: np.ndarray) -> tuple[bytes, dict]:
  """(raw body bytes, headers) of a submit of the updated instance [p]. `drawn` is a Drawn
  (with a ticket: the body is its instance then the update, 2p doubles, and X-DDML-Ticket is
  set; without: the update alone), or a version string (servers run without tickets)."""
  if isinstance(drawn, Drawn):
    headers = {"Content-Type": "application/octet-stream", "X-DDML-Version": drawn.version}
    if drawn.ticket:
      headers["X-DDML-Ticket"] = drawn.ticket
      return store_lib.encode_weights(drawn.weights) + store_lib.encode_weights(weights), headers
    return store_lib.encode_weights(weights), headers
  return store_lib.encode_weights(weights), {"Content-Type": "application/octet-stream", "X-DDML-Version": drawn}


def _b64(weights: np.ndarray) -> str:
  return base64.b64encode(store_lib.encode_weights(weights)).decode()


def json_submit_body(drawn, weights: np.ndarray) -> bytes:
  """The UTF-8 JSON body of a submit with base64 weights; a Drawn's ticket and instance
  travel as "ticket" and "drawn_b64" (`drawn` may be a version string)."""
  body = {"version": drawn.version if isinstance(drawn, Drawn) else drawn,
          "weights_b64": _b64(weights)}
  if isinstance(drawn, Drawn) and drawn.ticket:
    body.update(ticket=drawn.ticket, drawn_b64=_b64(drawn.weights))
  return json.dumps(body).encode()


def checked_weights(data: bytes, spec: glm.ModelSpec) -> np.ndarray:
  """A [p] float64 copy of a raw little-endian float64 drawn instance, checked to fit the
  served spec (its num_weights p).

  Raises:
    DDMLError: 502 bad_draw when the size is not 8p bytes or a weight is not finite.
  """
  if len(data) != 8 * spec.num_weights:
    raise DDMLError(502, "bad_draw", f"drawn instance has {len(data)} bytes; the spec needs "
                    f"{8 * spec.num_weights}")
  w = store_lib.decode_weights(data).copy()
  if not np.all(np.isfinite(w)):
    raise DDMLError(502, "bad_draw", "drawn instance holds non-finite weights")
  return w


def answer_or_raise(status: int, body: bytes, retry_after: str | None = None) -> dict:
  """The decoded JSON answer of a request with status < 400; a body that is not JSON is
  wrapped as "http_error"; `retry_after` is the Retry-After header (seconds), if any.

  Raises:
    DDMLError: for status >= 400, with the answer's "error" code and "message".
  """
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


def check_token_transport(base_url: str, token: str | None, insecure: bool) -> None:
  """Refuses to send a bearer token over a plain http:// base_url (anyone on the path could
  reuse it) unless `insecure` (tests on loopback).

  Raises:
    ParameterValueError: for a token with an http:// URL and insecure False.
  """
  if token is not None and base_url.lower().startswith("http://") and not insecure:
    raise ParameterValueError("`token` would travel in clear text to an http:// URL; use https:// "
                              f"(or insecure=True on a trusted network). Received: base_url={base_url!r}")


def request_headers(token: str | None, extra: dict | None, has_body: bool) -> dict:
  """The header dict of a request: JSON content type when it has a body, the bearer token
  (None: none), then `extra` headers overriding the defaults."""
  h = {"Content-Type": "application/json"} if has_body else {}
  if token is not None:
    h["Authorization"] = f"Bearer {token}"
  h.update(extra or {})
  return h


def client_ssl_context(cafile: str | None = None) -> ssl.SSLContext:
  """A verifying TLS client ssl.SSLContext (certificate and host name checked) trusting the
  system CAs, or the PEM `cafile` of a private CA."""
  ctx = ssl.create_default_context(cafile=cafile)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  return ctx
