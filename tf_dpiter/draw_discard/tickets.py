"""Draw tickets: proof that a submitted update starts from an instance this service served.

Every draw comes with a ticket, an HMAC-SHA256 (key shared by the servers of one store,
kept in the store's meta) over

    identity | BLAKE2b-128(drawn instance bytes) | issue time (ms) | 96-bit random nonce,

sent to the client as 48 URL-safe base64 characters (X-DDML-Ticket header or the "ticket"
JSON field). A submit carries the ticket and the drawn instance h itself; the server
recomputes the hash of h, checks the MAC, that the ticket was issued to the same identity
(token) and is younger than `ttl_s`. The store then marks the nonce used in the same atomic
operation that writes the update (store.replace), so each ticket admits one accepted update.

Consequences (acceptance.py, influence.py): the acceptance tests are run against the
served instance h, never against a candidate the client chooses, so an attacker cannot
chain its own accepted updates (it can only start from instances the server drew for it,
uniformly at random), and the search over candidates disappears. Privacy: the server keeps
no record of which instance was drawn (the ticket lives with the client; the store only
holds used nonces), so adversary II (a store snapshot) learns nothing new; an observer of
the channel sees h anyway (adversary I).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
import time

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

_NONCE = 12
_MAC = 16
_LEN = 8 + _NONCE + _MAC  # 36 bytes -> 48 base64 characters


class TicketError(ValueError):
  """A ticket that does not admit the submit: `code` is the JSON error code, `status` HTTP."""

  def __init__(self, status: int, code: str, message: str):
    super().__init__(message)
    self.status, self.code, self.message = status, code, message


def instance_digest(h: np.ndarray) -> bytes:
  """BLAKE2b-128 of the little-endian float64 bytes of an instance.

  Args:
    h: the instance.

  Returns:
    16 bytes.
  """
  return hashlib.blake2b(np.ascontiguousarray(h, dtype="<f8").tobytes(), digest_size=16).digest()


class Tickets:
  """Issues and verifies draw tickets.

  Args:
    key: the shared secret (>= 16 bytes).
    ttl_s: a ticket is valid this many seconds after its draw.
    clock: wall-clock time source in seconds (tests).

  Raises:
    ValueError: for a short key or a non-positive ttl.
  """

  def __init__(self, key: bytes, ttl_s: float = 60.0, clock=time.time):
    if len(key) < 16:
      raise ParameterValueError(f"ticket key must be >= 16 bytes, got {len(key)}")
    validation.check_positive("ttl_s", ttl_s, allow_inf=True, error=ParameterValueError)
    self._key, self.ttl_s, self._clock = bytes(key), float(ttl_s), clock

  def _mac(self, identity: str, digest: bytes, head: bytes) -> bytes:
    msg = identity.encode() + b"\0" + digest + head
    return hmac.new(self._key, msg, hashlib.sha256).digest()[:_MAC]

  def issue(self, identity: str, h: np.ndarray) -> str:
    """A ticket for instance h drawn by `identity`.

    Args:
      identity: the token's identity (or client address without tokens).
      h: the served instance.

    Returns:
      48 URL-safe base64 characters.
    """
    head = struct.pack(">Q", int(self._clock() * 1000)) + secrets.token_bytes(_NONCE)
    return base64.urlsafe_b64encode(head + self._mac(identity, instance_digest(h), head)).decode()

  def verify(self, ticket: str | None, identity: str, h: np.ndarray) -> str:
    """Checks a ticket against the submitter and the drawn instance it sent back.

    Args:
      ticket: the ticket string (None when missing).
      identity: the submitter's identity.
      h: the drawn instance sent with the submit.

    Returns:
      The nonce (hex), to be marked used by the store with the write.

    Raises:
      TicketError: 400 missing_ticket / bad_ticket (malformed), 403 invalid_ticket (MAC,
        identity or instance mismatch), 409 ticket_expired.
    """
    if not ticket:
      raise TicketError(400, "missing_ticket", "submit needs the ticket returned by its draw "
                        "(X-DDML-Ticket header or 'ticket' field) and the drawn instance")
    try:
      raw = base64.urlsafe_b64decode(ticket.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as e:
      raise TicketError(400, "bad_ticket", "ticket is not base64") from e
    if len(raw) != _LEN:
      raise TicketError(400, "bad_ticket", f"ticket must decode to {_LEN} bytes")
    head, mac = raw[:8 + _NONCE], raw[8 + _NONCE:]
    if not hmac.compare_digest(mac, self._mac(identity, instance_digest(h), head)):
      raise TicketError(403, "invalid_ticket",
                        "ticket was not issued to this token for the drawn instance sent")
    age = self._clock() - struct.unpack(">Q", head[:8])[0] / 1000.0
    if age > self.ttl_s:
      raise TicketError(409, "ticket_expired",
                        f"ticket is {age:.0f} s old (limit {self.ttl_s:g} s); draw again")
    return head[8:].hex()
