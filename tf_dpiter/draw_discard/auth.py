"""Client identity and quotas for the Draw and Discard service.

Bearer tokens: `serve --tokens FILE` (one per line; blank and '#' lines skipped) keeps only
SHA-256 digests; a client's identity in quotas, metrics and logs is a digest prefix, never
the token. `TokenSet.reload()` (on SIGHUP) re-reads the file all or nothing; a removed token
is refused from its next request (403 revoked_token). `AuthThrottle`: a token bucket of
failed authentications per address (429 without looking at the token; a revoked token's
retries are not counted). `Quotas`: a token bucket per identity and operation (429 with
Retry-After).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import signal
import stat
import threading
import time

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

SETTLE_S = 1.0  # a token file is read only once unchanged for this many seconds
MAX_REVOKED = 100_000  # digests of revoked tokens remembered (oldest forgotten first)
_RATE = validation.Interval(float, 0, None, "neither", True, ParameterValueError)   # per second
_BURST = validation.Interval(float, 1, None, "left", True, ParameterValueError)   # requests
_early_hangups = {"pending": False, "caught": False}


def catch_early_hangups() -> None:
  """Makes SIGHUP set a flag instead of terminating the process (until the loop takes over).

  Does nothing off the main thread or where SIGHUP does not exist.
  """
  if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
    return

  def note(signum, frame):  # pylint: disable=unused-argument
    _early_hangups["pending"] = True

  signal.signal(signal.SIGHUP, note)
  _early_hangups["caught"] = True


def take_early_hangup() -> bool:
  """Whether a SIGHUP arrived since catch_early_hangups() (True once per burst; clears it)."""
  pending, _early_hangups["pending"] = _early_hangups["pending"], False
  return pending


class TokenFileUnsettled(OSError):
  """The token file was modified less than SETTLE_S seconds ago: retry in `wait_s` seconds."""

  def __init__(self, message: str, wait_s: float):
    super().__init__(message)
    self.wait_s = float(wait_s)


def read_token_file(path: str, settle_s: float = SETTLE_S, clock=time.time,
                    whole_lines: bool = True) -> list:
  """The tokens of `path` (one a line; blank and '#' lines skipped), read as one consistent
  whole once the file has been unchanged for settle_s seconds of `clock` (compared with its
  mtime; 0: read now); with `whole_lines`, a last line without its newline (a partial write)
  is refused.

  Raises:
    TokenFileUnsettled: the file was modified less than settle_s seconds ago.
    OSError: the file cannot be read.
    ParameterValueError: the file changed while read, or its last line has no newline.
  """
  with open(path, "rb") as f:
    before = os.fstat(f.fileno())
    age = clock() - before.st_mtime_ns / 1e9
    if age < settle_s:
      raise TokenFileUnsettled(f"token file {path!r} was modified {max(age, 0):.2f} s ago; "
                               f"read once unchanged for {settle_s:g} s", settle_s - age)
    raw = f.read()
    after = os.fstat(f.fileno())
  now = os.stat(path)
  seen = [(st.st_ino, st.st_size, st.st_mtime_ns) for st in (before, after, now)]
  if stat.S_ISREG(before.st_mode) and not seen[0] == seen[1] == seen[2]:
    raise ParameterValueError(f"token file {path!r} changed while it was read; the old "
                              "set is kept (write a new file and rename it over the old one)")
  if whole_lines and raw and not raw.endswith(b"\n"):
    raise ParameterValueError(f"token file {path!r} does not end with a newline (a partial "
                              "write?); the old set is kept")
  lines = [ln.strip() for ln in raw.decode("utf-8").splitlines()]
  return [ln for ln in lines if ln and not ln.startswith("#")]


def token_digest(token: str) -> str:
  """The SHA-256 hex digest (64 characters) of a bearer token."""
  return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenSet:
  """The digests of the accepted tokens.

  Args:
    tokens: the plain tokens (only their digests are kept).

  Raises:
    ParameterValueError: for an empty set or a token shorter than 16 characters.
  """

  def __init__(self, tokens):
    digests = set()
    for i, t in enumerate(tokens):
      if len(t) < 16 or any(c.isspace() for c in t):
        raise ParameterValueError(f"token {i + 1} must be >= 16 characters without spaces, "
                                  f"got one of {len(t)} characters")
      digests.add(token_digest(t))
    if not digests:
      raise ParameterValueError("tokens: no token given")
    self._digests = frozenset(digests)
    self._revoked: collections.OrderedDict = collections.OrderedDict()  # digest -> None
    self.path: str | None = None

  @classmethod
  def from_file(cls, path: str, settle_s: float = 0.0) -> "TokenSet":
    """A TokenSet of `path` (read_token_file: all or nothing); settle_s 0 at start-up reads
    now and accepts a last line without its newline, > 0 (reloads) refuses it.

    Raises:
      TokenFileUnsettled: the file was modified less than settle_s seconds ago.
      OSError: the file cannot be read.
      ParameterValueError: it holds no valid token, changed while read or ends mid-line.
    """
    out = cls(read_token_file(path, settle_s, whole_lines=settle_s > 0))
    out.path = path
    return out

  def reload(self, settle_s: float = SETTLE_S) -> int:
    """Re-reads the token file in place (revocation) once unchanged for settle_s seconds and
    returns the number of tokens now accepted; keeps the old set on any error. Dropped tokens
    are remembered as revoked (at most MAX_REVOKED).

    Raises:
      TokenFileUnsettled: the file is too fresh; call again after its `wait_s`.
      ParameterValueError: the set was not read from a file, or the file holds no valid
        token, changed while read or ends mid-line.
      OSError: the file cannot be read.
    """
    if self.path is None:
      raise ParameterValueError("this TokenSet was not read from a file; nothing to reload")
    new = TokenSet.from_file(self.path, settle_s)._digests
    for digest in self._digests - new:
      self._revoked[digest] = None
    for digest in new:
      self._revoked.pop(digest, None)
    while len(self._revoked) > MAX_REVOKED:
      self._revoked.popitem(last=False)
    self._digests = new
    return len(self._digests)

  def __len__(self) -> int:
    return len(self._digests)

  def identify(self, authorization: str | None) -> tuple[str | None, str]:
    """(identity, "") of an Authorization header value whose token is known; else (None,
    "missing_token"), (None, "revoked_token") for a token a reload removed, or (None,
    "invalid_token")."""
    if not authorization or not authorization.startswith("Bearer "):
      return None, "missing_token"
    digest = token_digest(authorization[7:].strip())
    if digest not in self._digests:
      return None, "revoked_token" if digest in self._revoked else "invalid_token"
    return digest[:12], ""


class AuthThrottle:
  """Failed authentications per address: a token bucket of `burst`, refilled at `rate`/s.

  Args:
    rate: failures per second allowed on average.
    burst: failures allowed at once.
    max_addresses: addresses remembered (least recently failed forgotten first).
    clock: time source (tests).

  Raises:
    ParameterValueError: for a non-positive rate or a burst < 1.
  """

  def __init__(self, rate: float = 1.0, burst: float = 10.0, max_addresses: int = 100_000,
               clock=time.monotonic):
    validation.check_params({"rate": _RATE, "burst": _BURST}, {"rate": rate, "burst": burst})
    self.rate, self.burst, self._max, self._clock = float(rate), float(burst), max_addresses, clock
    self._levels: collections.OrderedDict = collections.OrderedDict()

  def _level(self, addr: str) -> float:
    level, last = self._levels.get(addr, (self.burst, self._clock()))
    return min(self.burst, level + (self._clock() - last) * self.rate)

  def wait(self, addr: str) -> float:
    """Seconds until address `addr` may try a token again (0: now)."""
    if addr not in self._levels:
      return 0.0
    level = self._level(addr)
    return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

  def failed(self, addr: str) -> None:
    """Records one failed authentication from address `addr`."""
    level = self._level(addr)
    self._levels.pop(addr, None)
    self._levels[addr] = (max(0.0, level - 1.0), self._clock())
    while len(self._levels) > self._max:
      self._levels.popitem(last=False)


class Quotas:
  """Token buckets per (identity, operation).

  Args:
    rates: {operation: requests per second}; an operation not named is unlimited.
    burst: {operation: bucket size}; defaults to max(1, 2 * rate).
    max_identities: identities remembered (least recently used are forgotten).
    clock: time source (tests).
    cluster: also enforce the same buckets in the shared store, so that all servers of one
      Redis store together allow `rate` per identity (service.DDMLService checks both).

  Raises:
    ParameterValueError: for a non-positive rate or burst.
  """

  def __init__(self, rates: dict, burst: dict | None = None, max_identities: int = 100_000,
               clock=time.monotonic, cluster: bool = False):
    self.cluster = bool(cluster)
    self.rates, self.burst = {}, {}
    for op, r in rates.items():
      if r is None:
        continue
      b = (burst or {}).get(op) or max(1.0, 2.0 * r)
      validation.check_params({f"rates[{op!r}]": _RATE, f"burst[{op!r}]": _BURST},
                              {f"rates[{op!r}]": r, f"burst[{op!r}]": b})
      self.rates[op], self.burst[op] = float(r), float(b)
    self._buckets: collections.OrderedDict = collections.OrderedDict()
    self._max = int(max_identities)
    self._clock = clock

  def take(self, identity: str, op: str) -> float:
    """Takes one request of operation `op` ("draw", "submit") from the bucket of `identity`
    (token digest prefix or client address): 0.0 when allowed, else the seconds until the
    next request would be."""
    rate = self.rates.get(op)
    if rate is None:
      return 0.0
    key = (identity, op)
    now = self._clock()
    level, last = self._buckets.pop(key, (self.burst[op], now))
    level = min(self.burst[op], level + (now - last) * rate)
    allowed = level >= 1.0
    self._buckets[key] = (level - 1.0 if allowed else level, now)
    while len(self._buckets) > self._max:
      self._buckets.popitem(last=False)
    return 0.0 if allowed else (1.0 - level) / rate


def retry_after_header(wait_s: float) -> str:
  """The Retry-After value of wait_s seconds (whole seconds, at least 1)."""
  return str(max(1, math.ceil(wait_s)))
