"""Schedules of the clients per round m_t and the noise multiplier sigma_t (seed 003, §6).

Raising m_t over training helps (seed 003, Section 6). A schedule is a callable of the round,
rounds counting from 1.
"""

import math

import numpy as np

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError

__all__ = ["as_schedule", "linear_schedule"]


def as_schedule(name, value, integer=False):
  """A callable round -> value (rounds count from 1), checked at every call.

  Args:
    name: the parameter's name, for messages (e.g. "clients_per_round").
    value: a number (constant), a sequence (value[t-1], the last entry held after its end)
      or a callable of the round.
    integer: values must be ints (floats with an integral value are accepted).
  Returns:
    schedule(t) -> an int (integer=True) or a finite float.
  Raises:
    ParameterTypeError: `value` is none of the above (at once), or a scheduled value is not
      an int when `integer` (when called).
    PrivacyConfigError: an empty sequence (at once), a non-finite value (when called).
  """
  if callable(value):
    fn = value
  elif isinstance(value, (list, tuple, np.ndarray)):
    seq = list(value)
    if not seq:
      raise PrivacyConfigError(f"{name} must not be an empty sequence")
    fn = lambda t: seq[min(t, len(seq)) - 1]
  elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    fn = lambda t: value
  else:
    raise ParameterTypeError(f"{name} must be a number, a sequence or a callable, got {value!r}")

  def schedule(t):
    v = fn(t)
    if integer:
      if isinstance(v, float) and v.is_integer():
        v = int(v)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise ParameterTypeError(f"{name} at round {t} must be an int, got {v!r}")
      return int(v)
    v = float(v)
    if not math.isfinite(v):
      raise PrivacyConfigError(f"{name} at round {t} must be finite, got {v!r}")
    return v

  return schedule


def linear_schedule(start, end, rounds, integer=False):
  """`start` at round 1, moving linearly to `end` at round `rounds`, then held.

  Args:
    start, end: the values at rounds 1 and `rounds`.
    rounds: an int >= 1.
    integer: round every value to the nearest int.
  Returns:
    fn(t), for `as_schedule` or DPFedAvg's clients_per_round / noise_multiplier.
  Raises:
    PrivacyConfigError: rounds < 1.
  """
  if rounds < 1:
    raise PrivacyConfigError(f"rounds must be >= 1, got {rounds!r}")

  def fn(t):
    frac = min(max(t - 1, 0), rounds - 1) / max(rounds - 1, 1)
    v = start + (end - start) * frac
    return int(round(v)) if integer else v

  return fn
