"""Draw tickets: proof that a submitted update starts from an instance this service served.

A ticket is an HMAC-SHA256 (key derived from the servers' shared secret, keys.py) over
scope | identity | BLAKE2b-128(drawn instance) | issue time (ms) | 96-bit nonce, sent as 48
URL-safe base64 characters; `scope` (store kind, key prefix, generation) makes two models
sharing one secret refuse each other's tickets. A submit carries the ticket and h; the
server checks the MAC, the identity and the age (-`max_skew_s` <= age <= `ttl_s` by its
ticket clock), and the store marks the nonce used in the atomic write of the update
(store.replace) for `nonce_ttl_s` = `ttl_s` + `max_skew_s` of monotonic time, the longest a
ticket can stay valid after a use: one accepted update per ticket, also when the servers'
clocks differ by up to `max_skew_s`. The ticket clock (`Tickets.now`) never steps back and
never runs slower than the monotonic clock of the nonce memory, so a wall clock stepped back
or slewed slow cannot keep a ticket valid after its nonce is forgotten. The acceptance tests
run against the served h (no chaining, acceptance.py); the server keeps no record of which
instance was drawn (adversary II learns nothing new).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import struct
import threading
import time

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

_NONCE = 12
_MAC = 16
_LEN = 8 + _NONCE + _MAC  # 36 bytes -> 48 base64 characters
_TEXT_LEN = 4 * _LEN // 3
_TEXT = re.compile(r"[A-Za-z0-9_-]{%d}" % _TEXT_LEN, re.ASCII)


class TicketError(ValueError):
  """A ticket that does not admit the submit: `code` is the JSON error code, `status` HTTP."""

  def __init__(self, status: int, code: str, message: str):
    super().__init__(message)
    self.status, self.code, self.message = status, code, message


def instance_digest(h: np.ndarray) -> bytes:
  """BLAKE2b-128 (16 bytes) of the little-endian float64 bytes of an instance."""
  return hashlib.blake2b(np.ascontiguousarray(h, dtype="<f8").tobytes(), digest_size=16).digest()


class Tickets:
  """Issues and verifies draw tickets.

  Args:
    key: the shared secret (>= 16 bytes).
    ttl_s: a ticket is valid this many seconds after its draw.
    clock: wall-clock time source in seconds (tests).
    scope: the model that issues and accepts the tickets (the store's `scope`: kind, prefix
      and generation); a ticket of another scope is refused.
    max_skew_s: how far (seconds) an issuing server's wall clock may run ahead of the
      verifier's; a ticket stamped further in the future is refused (409 ticket_from_future).
    monotonic: monotonic time source in seconds (tests; None: `time.monotonic`, read at
      each call), the clock of the nonce memory.

  Raises:
    ParameterValueError: for a short key, a non-positive ttl, a negative or infinite
      max_skew_s or a scope holding a NUL.
  """

  def __init__(self, key: bytes, ttl_s: float = 60.0, clock=time.time, scope: str = "",
               max_skew_s: float = 5.0, monotonic=None):
    if len(key) < 16:
      raise ParameterValueError(f"ticket key must be >= 16 bytes, got {len(key)}")
    validation.check_positive("ttl_s", ttl_s, allow_inf=True, error=ParameterValueError)
    if "\0" in scope:
      raise ParameterValueError(f"`scope` must not hold a NUL character. Received: scope={scope!r}")
    validation.check_nonnegative("max_skew_s", max_skew_s, allow_inf=False, error=ParameterValueError)
    self._key, self.ttl_s, self._clock = bytes(key), float(ttl_s), clock
    self.scope, self.max_skew_s = scope, float(max_skew_s)
    self._monotonic, self._last, self._lock = monotonic, None, threading.Lock()

  def now(self) -> float:
    """The ticket clock (seconds): the wall clock, but at least its last reading plus the
    monotonic time since, so that it never steps back and runs at least as fast as the
    monotonic clock. A ticket admitted at ticket time t0 with age a >= -max_skew_s expires
    at ticket time t0 + ttl_s - a, which then comes within ttl_s + max_skew_s monotonic
    seconds: before the nonce memory (`nonce_ttl_s`, monotonic) forgets it."""
    wall = float(self._clock())
    mono = float((self._monotonic or time.monotonic)())
    with self._lock:
      if self._last is not None:
        wall = max(wall, self._last[0] + (mono - self._last[1]))
      self._last = (wall, mono)
    return wall

  @property
  def nonce_ttl_s(self) -> float:
    """How long the store must remember a used nonce (seconds): a ticket admitted at age
    a >= -max_skew_s stays valid ttl_s - a <= ttl_s + max_skew_s after that use."""
    return self.ttl_s + self.max_skew_s

  def _mac(self, identity: str, digest: bytes, head: bytes) -> bytes:
    msg = self.scope.encode() + b"\0" + identity.encode() + b"\0" + digest + head
    return hmac.new(self._key, msg, hashlib.sha256).digest()[:_MAC]

  def issue(self, identity: str, h: np.ndarray) -> str:
    """A ticket (48 URL-safe base64 characters) for instance h drawn by `identity` (the
    token's identity, or the client address without tokens)."""
    head = struct.pack(">Q", int(self.now() * 1000)) + secrets.token_bytes(_NONCE)
    return base64.urlsafe_b64encode(head + self._mac(identity, instance_digest(h), head)).decode()

  def verify(self, ticket: str | None, identity: str, h: np.ndarray) -> str:
    """Checks a ticket (None when missing) against the submitter's identity and the drawn
    instance h sent back; returns the nonce (hex), to be marked used by the store with the
    write.

    Raises:
      TicketError: 400 missing_ticket / bad_ticket (malformed), 403 invalid_ticket (MAC,
        scope, identity or instance mismatch), 409 ticket_expired / ticket_from_future
        (stamped more than max_skew_s ahead of this server's clock).
    """
    if not ticket:
      raise TicketError(400, "missing_ticket", "submit needs the ticket returned by its draw "
                        "(X-DDML-Ticket header or 'ticket' field) and the drawn instance")
    if _TEXT.fullmatch(ticket) is None:  # one spelling per ticket: b64decode would skip junk
      raise TicketError(400, "bad_ticket", f"ticket must be {_TEXT_LEN} URL-safe base64 "
                        "characters (A-Z a-z 0-9 - _)")
    raw = base64.urlsafe_b64decode(ticket)
    head, mac = raw[:8 + _NONCE], raw[8 + _NONCE:]
    if not hmac.compare_digest(mac, self._mac(identity, instance_digest(h), head)):
      raise TicketError(403, "invalid_ticket",
                        "ticket was not issued by this model (store prefix and generation) "
                        "to this token for the drawn instance sent")
    age = self.now() - struct.unpack(">Q", head[:8])[0] / 1000.0
    if age > self.ttl_s:
      raise TicketError(409, "ticket_expired",
                        f"ticket is {age:.0f} s old (limit {self.ttl_s:g} s); draw again")
    if age < -self.max_skew_s:
      raise TicketError(409, "ticket_from_future",
                        f"ticket is stamped {-age:.0f} s ahead of this server's clock (limit "
                        f"{self.max_skew_s:g} s): the servers' clocks differ; draw again")
    return head[8:].hex()
