"""Argument checks shared by queries, the ledger and the accountant.

Each raises ValueError naming the parameter and the value, so that no bad
configuration turns into a silently wrong guarantee.
"""

import math
import numbers
import sys


def _is_tensor(x):
  """True for a TF tensor or variable; never imports TensorFlow (pure callers stay light)."""
  tf = sys.modules.get("tensorflow")
  return tf is not None and (tf.is_tensor(x) or isinstance(x, tf.Variable))


def _is_python_number(x):
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_nonnegative(name, value, allow_inf=True):
  """Checks a Python number is finite (or +inf if allowed) and >= 0; tensors pass through."""
  if _is_tensor(value):
    return value
  if not _is_python_number(value):
    try:
      value = float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{name} must be a number, got {value!r}") from None
  if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
    raise ValueError(f"{name} must be a non-negative{'' if allow_inf else ' finite'} "
                     f"number, got {value!r}")
  return value


def check_positive(name, value, allow_inf=False):
  check_nonnegative(name, value, allow_inf=allow_inf)
  if not _is_tensor(value) and float(value) <= 0:
    raise ValueError(f"{name} must be > 0, got {value!r}")
  return value


def check_probability(name, value, allow_zero=False):
  """q in (0, 1] (or [0, 1] when allow_zero)."""
  if _is_tensor(value):
    return value
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}") from None
  lo_ok = v >= 0 if allow_zero else v > 0
  if math.isnan(v) or not lo_ok or v > 1:
    raise ValueError(f"{name} must be in {'[' if allow_zero else '('}0, 1], got {value!r}")
  return v


def check_delta(name, value):
  """delta in the open interval (0, 1)."""
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number in (0, 1), got {value!r}") from None
  if math.isnan(v) or not 0 < v < 1:
    raise ValueError(f"{name} must be in (0, 1), got {value!r}")
  return v
