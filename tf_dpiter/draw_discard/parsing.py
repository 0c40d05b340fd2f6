"""Strict parsing of Draw and Discard submissions.

JSON `{"version", "weights": [numbers] | "weights_b64"}` (exactly one weights field), or
`application/octet-stream` little-endian float64 with X-DDML-Version; with tickets also
`"ticket"` and `"drawn"` / `"drawn_b64"` (raw: X-DDML-Ticket and 2p doubles, drawn then
update). No other keys; JSON weights must be numbers. Every refusal is a RequestError with
the HTTP status and a stable error code.
"""

from __future__ import annotations

import binascii
import dataclasses
import json

import numpy as np

JSON_TYPE = "application/json"
RAW_TYPE = "application/octet-stream"
_FIELDS = ("weights", "weights_b64")
_DRAWN = ("drawn", "drawn_b64")


@dataclasses.dataclass(frozen=True)
class Submission:
  """A parsed submit: the update, and (with tickets) the drawn instance and the ticket."""
  weights: np.ndarray
  drawn: np.ndarray | None = None
  ticket: str | None = None


class RequestError(Exception):
  """A client error: status, code (stable identifier), message, extra headers.

  Args:
    status: HTTP status (4xx or 503).
    code: the JSON "error" value.
    message: a human-readable explanation (never echoes client data).
    headers: extra response headers (e.g. Retry-After).
    extra: more JSON fields of the answer.
  """

  def __init__(self, status: int, code: str, message: str, headers: dict | None = None,
               extra: dict | None = None):
    super().__init__(f"{status} {code}: {message}")
    self.status, self.code, self.message = status, code, message
    self.headers = headers or {}
    self.extra = extra or {}


def _loads(raw: bytes):
  try:   # NaN/Infinity literals become non-finite floats, refused later
    return json.loads(raw, parse_int=float, parse_constant=float)
  except RecursionError as e:
    raise RequestError(400, "bad_json", "body nests too deeply") from e
  except (ValueError, UnicodeDecodeError) as e:
    raise RequestError(400, "bad_json", "body is not valid JSON") from e


def _check_version(version, served: str) -> None:
  if not isinstance(version, str):
    raise RequestError(400, "bad_version", "'version' must be a string")
  if version != served:
    raise RequestError(409, "wrong_version",
                       f"model version {version[:40]!r} is not the served {served!r}")


def _from_list(raw, p: int, name: str = "weights") -> np.ndarray:
  if not isinstance(raw, list):
    raise RequestError(400, "bad_weights", f"'{name}' must be a JSON list of numbers")
  if len(raw) != p:
    raise RequestError(422, "wrong_shape", f"'{name}' has {len(raw)} entries; expected {p}")
  if not all(type(v) is float for v in raw):  # ints were parsed as floats; bools stay bool
    raise RequestError(400, "bad_weights",
                       f"'{name}' must hold numbers only (no strings, booleans, null or lists)")
  return np.asarray(raw, dtype=np.float64)


def _from_b64(raw, p: int, name: str = "weights_b64") -> np.ndarray:
  if not isinstance(raw, str):
    raise RequestError(400, "bad_weights", f"'{name}' must be a base64 string")
  try:
    data = binascii.a2b_base64(raw.encode("ascii"), strict_mode=True)
  except (binascii.Error, ValueError, UnicodeEncodeError) as e:
    raise RequestError(400, "bad_weights", f"'{name}' is not valid base64") from e
  if len(data) != 8 * p:
    raise RequestError(422, "wrong_shape", f"'{name}' decodes to {len(data)} bytes; "
                       f"expected {8 * p} ({p} little-endian float64)")
  return np.frombuffer(data, dtype="<f8").astype(np.float64)


def _one_of(body: dict, names: tuple, p: int, required: bool):
  fields = [f for f in names if f in body]
  if not fields:
    if required:
      raise RequestError(400, f"missing_{names[0]}", f"body needs '{names[0]}' or '{names[1]}'")
    return None
  if len(fields) > 1:
    raise RequestError(400, f"ambiguous_{names[0]}",
                       f"give exactly one of '{names[0]}', '{names[1]}'")
  return (_from_list if fields[0] == names[0] else _from_b64)(body[fields[0]], p, fields[0])


def parse_json_submission(raw: bytes, served_version: str, p: int) -> Submission:
  """The Submission of a JSON request body for a server serving `served_version` with p
  weights (weights possibly non-finite: the acceptance rule refuses those).

  Raises:
    RequestError: 400 malformed, 409 wrong version, 422 wrong shape.
  """
  body = _loads(raw)
  if not isinstance(body, dict):
    raise RequestError(400, "bad_json", "body must be a JSON object")
  if "version" not in body:
    raise RequestError(400, "missing_version", "body needs the model 'version' returned by draw")
  unknown = sorted(set(body) - {"version", "ticket", *_FIELDS, *_DRAWN})
  if unknown:
    raise RequestError(400, "unknown_field",
                       f"unknown keys {[u[:40] for u in unknown[:5]]}; allowed: version, "
                       "weights or weights_b64, ticket, drawn or drawn_b64")
  if not any(f in body for f in _FIELDS):
    raise RequestError(400, "missing_weights", "body needs 'weights' or 'weights_b64'")
  ticket = body.get("ticket")
  if ticket is not None and not isinstance(ticket, str):
    raise RequestError(400, "bad_ticket", "'ticket' must be a string")
  _check_version(body["version"], served_version)
  w = _one_of(body, _FIELDS, p, True)
  return Submission(w, _one_of(body, _DRAWN, p, False), ticket)


def parse_raw_submission(raw: bytes, header_version: str | None, served_version: str,
                         p: int, ticket: str | None = None) -> Submission:
  """The Submission of an application/octet-stream body (little-endian float64: p doubles,
  or with a ticket 2p, the drawn instance then the update), given the X-DDML-Version and
  X-DDML-Ticket headers (or None) and the served version.

  Raises:
    RequestError: 400 missing version, 409 wrong version, 422 wrong shape.
  """
  if header_version is None:
    raise RequestError(400, "missing_version", "raw submissions need the X-DDML-Version header")
  _check_version(header_version, served_version)
  n = 2 * p if ticket else p
  if len(raw) != 8 * n:
    raise RequestError(422, "wrong_shape", f"body has {len(raw)} bytes; expected {8 * n} "
                       f"({n} little-endian float64)")
  v = np.frombuffer(raw, dtype="<f8").astype(np.float64)
  return Submission(v[p:], v[:p], ticket) if ticket else Submission(v)


def content_type(header: str | None) -> str:
  """JSON_TYPE or RAW_TYPE: the checked media type of a Content-Type header value.

  Raises:
    RequestError: 415 for a missing or other media type.
  """
  media = (header or "").split(";")[0].strip().lower()
  if media not in (JSON_TYPE, RAW_TYPE):
    raise RequestError(415, "unsupported_media_type",
                       f"Content-Type must be {JSON_TYPE} or {RAW_TYPE}")
  return media
