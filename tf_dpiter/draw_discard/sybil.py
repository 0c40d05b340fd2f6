"""Sybils: what k identities cost, per token and per address prefix.

k identities get k influence budgets (influence.py). Without tokens an identity is the
client's address *prefix* (/24 IPv4, /64 IPv6; `budget_key`), so a sybil needs k prefixes.
`NewIdentityShare` caps the share of recent accepted updates from *new* identities (new for
`new_age_s` after their first accepted update): with decayed counts (half-life `window_s`)
T of all accepted updates and N of new identities', a new identity's update is accepted only
if N + 1 <= max(min_new, share (T + 1)), so fresh sybils get at most share / (1 - share)
times the established identities' updates (plus `min_new`), whatever k.

Bound (k identities over T seconds): at most k m (1 + T ln 2 / H) accepted updates (m, H:
InfluenceBudget's max_steps and half-life), each within its envelope
(docs/draw_discard_security.md, section 4).
"""

from __future__ import annotations

import collections
import math
import time

from tf_dpiter import validation
from tf_dpiter.draw_discard.connections import prefix_of
from tf_dpiter.errors import ParameterValueError


def budget_key(identity: str, tokens: bool) -> str:
  """The influence budget's key: the token identity (`tokens` on), or the /24 or /64 prefix
  of the client address `identity` (tokens off)."""
  return identity if tokens else prefix_of(identity)


class NewIdentityShare:
  """Global cap on the share of recent accepted updates from new identities.

  Args:
    share: the cap, in (0, 1).
    window_s: half-life of the decayed counts T and N (seconds).
    new_age_s: an identity is new this long after its first accepted update (seconds).
    min_new: new identities' updates always allowed in the decayed window (cold start).
    max_identities: first-seen times kept (the oldest are dropped: they become new again).
    clock: time source in seconds.

  Raises:
    ParameterValueError: for share outside (0, 1), window_s <= 0, new_age_s < 0,
      min_new < 1 or max_identities < 1.
  """

  def __init__(self, share: float = 0.5, window_s: float = 600.0, new_age_s: float = 3600.0,
               min_new: float = 16.0, max_identities: int = 1_000_000, clock=time.monotonic):
    validation.check_params(
        {"new_identity_share": validation.Interval(float, 0, 1, "neither", False, ParameterValueError),
         "min_new": validation.Interval(float, 1, None, "left", True, ParameterValueError)},
        {"new_identity_share": share, "min_new": min_new})
    validation.check_positive("window_s", window_s, True, ParameterValueError)
    validation.check_nonnegative("new_age_s", new_age_s, True, ParameterValueError)
    validation.check_integer("max_identities", max_identities, 1)
    self.share, self.window_s, self.new_age_s = float(share), float(window_s), float(new_age_s)
    self.min_new, self.max_identities, self.clock = float(min_new), int(max_identities), clock
    self._first: collections.OrderedDict = collections.OrderedDict()
    self.total = self.new = 0.0
    self._t = clock()

  def _decay(self, now: float) -> None:
    f = 2.0 ** (-max(0.0, now - self._t) / self.window_s)
    self.total, self.new, self._t = self.total * f, self.new * f, now

  def is_new(self, key: str, now: float | None = None) -> bool:
    """Whether budget key `key`'s first accepted update is less than new_age_s old at `now`
    (default: the clock), or unknown."""
    first = self._first.get(key)
    return first is None or (self.clock() if now is None else now) - first < self.new_age_s

  def take(self, key: str) -> tuple[float, bool]:
    """Counts one accepted update of budget key `key` if the cap allows it: (0.0,
    counted-as-new) when allowed, else (seconds to wait, False)."""
    now = self.clock()
    self._decay(now)
    new = self.is_new(key, now)
    if new:
      cap = max(self.min_new, self.share * (self.total + 1.0))
      if self.new + 1.0 > cap + 1e-9:
        wait = self.window_s * math.log2(max(1.0 + 1e-9, self.new / max(self.min_new - 1.0, 0.5)))
        return max(wait, 1.0), False
      self.new += 1.0
      if key not in self._first:
        self._first[key] = now
        while len(self._first) > self.max_identities:
          self._first.popitem(last=False)
    self.total += 1.0
    return 0.0, new

  def untake(self, new: bool) -> None:
    """Undoes a `take` whose update was not stored (`new`: the second value it returned)."""
    self.total = max(0.0, self.total - 1.0)
    if new:
      self.new = max(0.0, self.new - 1.0)
