"""Schedules of the clients per round m_t and the noise multiplier sigma_t (Geyer et al. 2017, §6).

A schedule is a callable of the round, rounds counting from 1.
"""

import math

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError

__all__ = ["RoundSchedule", "as_schedule", "linear_schedule"]


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
    start: the values at rounds 1 and `rounds`.
    end: the values at rounds 1 and `rounds`.
    rounds: an int >= 1.
    integer: round every value to the nearest int.

  Returns:
    fn(t), for `as_schedule` or DPFedAvg's clients_per_round / noise_multiplier.

  Raises:
    ParameterTypeError: rounds is not an int.
    PrivacyConfigError: rounds < 1.
  """
  validation.check_integer("rounds", rounds, 1, error=PrivacyConfigError)

  def fn(t):
    frac = min(max(t - 1, 0), rounds - 1) / max(rounds - 1, 1)
    v = start + (end - start) * frac
    return int(round(v)) if integer else v

  return fn


class RoundSchedule:
  """The clients per round m_t and noise multiplier sigma_t of DP-FedAvg (Geyer et al. 2017, §6):
  `schedule(t)` gives (m_t, sigma_t) for `DPServer.begin_round(m_t, sigma_t, t)`.

  Args:
    clients_per_round: m_t: an int, a sequence or a callable of the round (`as_schedule`,
      integer values).
    noise_multiplier: sigma_t: None (keep the query's own z), a number, a sequence or a
      callable of the round.

  Raises:
    ParameterTypeError: a schedule of the wrong type (as `as_schedule`).
    PrivacyConfigError: a schedule value out of range (as `as_schedule`).
  """

  def __init__(self, clients_per_round, noise_multiplier=None):
    self._clients = as_schedule("clients_per_round", clients_per_round, integer=True)
    self._noise = (None if noise_multiplier is None
                   else as_schedule("noise_multiplier", noise_multiplier))

  def clients_per_round(self, t):
    """m_t, the clients sampled at round t.

    Args:
      t: the round, from 1.

    Returns:
      an int.

    Raises:
      ParameterTypeError: the schedule gives a non-int.
    """
    return self._clients(t)

  def noise_multiplier(self, t):
    """sigma_t, the noise multiplier of round t.

    Args:
      t: the round, from 1.

    Returns:
      a finite float, or None when the query keeps its own.

    Raises:
      PrivacyConfigError: the schedule gives a non-finite value.
    """
    return None if self._noise is None else self._noise(t)

  def __call__(self, t):
    """(m_t, sigma_t or None) of round t."""
    return self.clients_per_round(t), self.noise_multiplier(t)
