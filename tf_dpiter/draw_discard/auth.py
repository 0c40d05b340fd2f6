"""Client identity and quotas for the Draw and Discard service.

Bearer tokens: `serve --tokens FILE` reads one token per line (blank lines and lines
starting with '#' are skipped) and keeps only their SHA-256 digests. A request carries
`Authorization: Bearer <token>`; the server hashes it and looks the digest up. The
client's identity in quotas, metrics and logs is a short prefix of the digest, never
the token.

Revocation: `TokenSet.reload()` re-reads the token file in place (the server calls it on
SIGHUP); every request is authenticated again, so a removed token is refused from its next
request on, on any connection.

Guessing: `AuthThrottle` keeps a token bucket of failed authentications per address; an
address out of failures is answered 429 without its token being looked at, so guessing
runs at `rate` attempts per second per address at most.

Quotas: a token bucket per identity and per operation (draw, submit): `rate` requests
per second on average, bursts of `burst`. A refused request gets the seconds until its
next token (the service answers 429 with Retry-After).
"""

from __future__ import annotations

import collections
import hashlib
import math
import time

from tf_dpiter.errors import ParameterValueError


def token_digest(token: str) -> str:
  """SHA-256 hex digest of a token.

  Args:
    token: the bearer token.

  Returns:
    64 hex characters.
  """
  return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenSet:
  """The digests of the accepted tokens.

  Args:
    tokens: the plain tokens (only their digests are kept).

  Raises:
    ValueError: for an empty set or a token shorter than 16 characters.
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
    self.path: str | None = None

  @classmethod
  def from_file(cls, path: str) -> "TokenSet":
    """Reads one token per line.

    Args:
      path: the token file.

    Returns:
      A TokenSet.

    Raises:
      OSError: when the file cannot be read.
      ValueError: when it holds no valid token.
    """
    with open(path, encoding="utf-8") as f:
      lines = [ln.strip() for ln in f]
    out = cls([ln for ln in lines if ln and not ln.startswith("#")])
    out.path = path
    return out

  def reload(self) -> int:
    """Re-reads the token file in place (revocation); keeps the old set on any error.

    Returns:
      The number of tokens now accepted.

    Raises:
      ValueError: when the set was not read from a file, or the file holds no valid token.
      OSError: when the file cannot be read.
    """
    if self.path is None:
      raise ParameterValueError("this TokenSet was not read from a file; nothing to reload")
    self._digests = TokenSet.from_file(self.path)._digests
    return len(self._digests)

  def __len__(self) -> int:
    return len(self._digests)

  def identify(self, authorization: str | None) -> tuple[str | None, str]:
    """Identity of an Authorization header value.

    Args:
      authorization: the header value or None.

    Returns:
      (identity, "") when the token is known; (None, "missing_token") or
      (None, "invalid_token") otherwise.
    """
    if not authorization or not authorization.startswith("Bearer "):
      return None, "missing_token"
    digest = token_digest(authorization[7:].strip())
    if digest not in self._digests:
      return None, "invalid_token"
    return digest[:12], ""


class AuthThrottle:
  """Failed authentications per address: a token bucket of `burst`, refilled at `rate`/s.

  Args:
    rate: failures per second allowed on average.
    burst: failures allowed at once.
    max_addresses: addresses remembered (least recently failed forgotten first).
    clock: time source (tests).

  Raises:
    ValueError: for a non-positive rate or a burst < 1.
  """

  def __init__(self, rate: float = 1.0, burst: float = 10.0, max_addresses: int = 100_000,
               clock=time.monotonic):
    if not rate > 0:
      raise ParameterValueError(f"`rate` must be > 0. Received: rate={rate!r}")
    if not burst >= 1:
      raise ParameterValueError(f"`burst` must be >= 1. Received: burst={burst!r}")
    self.rate, self.burst, self._max, self._clock = float(rate), float(burst), max_addresses, clock
    self._levels: collections.OrderedDict = collections.OrderedDict()

  def _level(self, addr: str) -> float:
    level, last = self._levels.get(addr, (self.burst, self._clock()))
    return min(self.burst, level + (self._clock() - last) * self.rate)

  def wait(self, addr: str) -> float:
    """Seconds until `addr` may try a token again (0: now).

    Args:
      addr: the client address.

    Returns:
      Seconds to wait.
    """
    if addr not in self._levels:
      return 0.0
    level = self._level(addr)
    return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

  def failed(self, addr: str) -> None:
    """Records one failed authentication from `addr`.

    Args:
      addr: the client address.
    """
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
    ValueError: for a non-positive rate or burst.
  """

  def __init__(self, rates: dict, burst: dict | None = None, max_identities: int = 100_000,
               clock=time.monotonic, cluster: bool = False):
    self.cluster = bool(cluster)
    self.rates, self.burst = {}, {}
    for op, r in rates.items():
      if r is None:
        continue
      if not r > 0:
        raise ParameterValueError(f"quota rate for {op!r} must be > 0 per second, got {r!r}")
      b = (burst or {}).get(op) or max(1.0, 2.0 * r)
      if not b >= 1:
        raise ParameterValueError(f"quota burst for {op!r} must be >= 1, got {b!r}")
      self.rates[op], self.burst[op] = float(r), float(b)
    self._buckets: collections.OrderedDict = collections.OrderedDict()
    self._max = int(max_identities)
    self._clock = clock

  def take(self, identity: str, op: str) -> float:
    """Takes one request from the bucket.

    Args:
      identity: who asks (token digest prefix or client address).
      op: the operation ("draw", "submit").

    Returns:
      0.0 when allowed, else the seconds until the next request would be allowed.
    """
    rate = self.rates.get(op)
    if rate is None:
      return 0.0
    key = (identity, op)
    now = self._clock()
    level, last = self._buckets.pop(key, (self.burst[op], now))
    level = min(self.burst[op], level + (now - last) * rate)
    if level >= 1.0:
      self._buckets[key] = (level - 1.0, now)
      wait = 0.0
    else:
      self._buckets[key] = (level, now)
      wait = (1.0 - level) / rate
    while len(self._buckets) > self._max:
      self._buckets.popitem(last=False)
    return wait


def retry_after_header(wait_s: float) -> str:
  """Retry-After value (whole seconds, at least 1).

  Args:
    wait_s: seconds to wait.

  Returns:
    The header value.
  """
  return str(max(1, math.ceil(wait_s)))
