"""Monotone searches shared by calibration, the budget look-ahead and the GDP accountant.

No imports beyond the standard library, so any accounting module can use them.
"""

import math


def largest_integer(ok, start, limit=10**9):
  """The largest n in [start, limit] with ok(n), for ok true up to a point and false after.

  Doubling from `start`, then bisection: O(log n) calls of `ok`.

  Args:
    ok: a monotone predicate of an int (True, then False from some n on).
    start: the first candidate.
    limit: the largest candidate (>= start).

  Returns:
    the int n, or start - 1 when ok(start) is False.
  """
  if not ok(start):
    return start - 1
  lo, hi = start, max(start + 1, 2 * start)
  while hi <= limit and ok(hi):
    lo, hi = hi, 2 * hi
  hi = min(hi, limit + 1)          # hi is never ok, or just past the limit
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if ok(mid) else (lo, mid)
  return lo


def doubling_bracket(ok, start, limit=math.inf):
  """(bad, good) bracketing the boundary of a predicate `ok`, False below some point and True
  above it: tries start > 0, 2 start, 4 start, ... (none above `limit`) until `ok` holds;
  bad is the last failure (0 if none), good None when no value up to `limit` holds."""
  bad, good = 0.0, start
  while not ok(good):
    bad, good = good, 2.0 * good
    if good > limit:
      return bad, None
  return bad, good


def bisect(ok, bad, good, rel_tol=1e-4, geometric=False):
  """The boundary of a monotone predicate between `bad` (ok False) and `good` (ok True).

  Halves the interval (in log scale when `geometric`) until |good - bad| <= rel_tol * |good|
  and returns the last `good`: always a value where `ok` holds (the safe side of a target).

  Args:
    ok: a predicate, False at `bad`, True at `good`, monotone between them.
    bad: the end where `ok` is False (either side of `good`); > 0 when `geometric`.
    good: the end where `ok` is True; > 0 when `geometric`.
    rel_tol: the relative width at which the search stops.
    geometric: bisect at sqrt(bad * good) instead of (bad + good) / 2.

  Returns:
    a float with ok(result) True (`good` itself if the interval is already narrow).
  """
  while abs(good - bad) > rel_tol * abs(good):
    mid = math.sqrt(bad * good) if geometric else 0.5 * (bad + good)
    bad, good = (bad, mid) if ok(mid) else (mid, good)
  return good
