"""Argument checks shared by queries, the ledger and the accountant.

Each raises an error naming the parameter and the value, so that no bad configuration turns
into a silently wrong guarantee: `tf_dpiter.errors.ParameterTypeError` (a TypeError, also a
ValueError) for a value that is not a number, `tf_dpiter.errors.PrivacyConfigError` (a
ValueError) for a number out of range. Tensors pass through unchecked (their value is only
known when the graph runs). No TensorFlow import.
"""

import math
import numbers
import sys

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError


def _is_tensor(x):
  """True for a TF tensor or variable; never imports TensorFlow (pure callers stay light)."""
  tf = sys.modules.get("tensorflow")
  return tf is not None and (tf.is_tensor(x) or isinstance(x, tf.Variable))


def _is_python_number(x):
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_float(name, value, expected):
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ParameterTypeError(f"{name} must be {expected}, got {value!r}") from None


def check_nonnegative(name, value, allow_inf=True):
  """Checks that `value` is a number >= 0 (finite unless `allow_inf`).

  Args:
    name: the parameter's name, for the message.
    value: a Python or numpy number, or a tensor (passed through unchecked).
    allow_inf: whether +inf is accepted.
  Returns:
    `value` (a float when it was not a Python number, the tensor itself for a tensor).
  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: NaN, negative, or +inf when not allowed.
  """
  if _is_tensor(value):
    return value
  if not _is_python_number(value):
    value = _as_float(name, value, "a number")
  if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
    raise PrivacyConfigError(f"{name} must be a non-negative{'' if allow_inf else ' finite'} "
                             f"number, got {value!r}")
  return value


def check_positive(name, value, allow_inf=False):
  """`check_nonnegative`, and `value` > 0 (finite unless `allow_inf`).

  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: `value` is NaN, <= 0, or +inf when not allowed.
  """
  check_nonnegative(name, value, allow_inf=allow_inf)
  if not _is_tensor(value) and float(value) <= 0:
    raise PrivacyConfigError(f"{name} must be > 0, got {value!r}")
  return value


def check_probability(name, value, allow_zero=False):
  """Checks a probability q in (0, 1] (or [0, 1] when `allow_zero`).

  Returns:
    q as a float (a tensor passes through unchecked).
  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: `value` is outside the interval.
  """
  if _is_tensor(value):
    return value
  v = _as_float(name, value, "a number in (0, 1]")
  lo_ok = v >= 0 if allow_zero else v > 0
  if math.isnan(v) or not lo_ok or v > 1:
    raise PrivacyConfigError(f"{name} must be in {'[' if allow_zero else '('}0, 1], "
                             f"got {value!r}")
  return v


def check_delta(name, value):
  """Checks delta in the open interval (0, 1).

  Returns:
    delta as a float.
  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: `value` is outside (0, 1).
  """
  v = _as_float(name, value, "a number in (0, 1)")
  if math.isnan(v) or not 0 < v < 1:
    raise PrivacyConfigError(f"{name} must be in (0, 1), got {value!r}")
  return v


def check_instance(name, value, types, expected):
  """Checks `isinstance(value, types)`.

  Args:
    name: the parameter's name; value: the argument; types: a type or tuple of types;
    expected: how the message describes the expected type (e.g. "a DPQuery").
  Returns:
    `value`.
  Raises:
    ParameterTypeError: `value` is not an instance of `types`.
  """
  if not isinstance(value, types):
    raise ParameterTypeError(f"{name} must be {expected}, got {value!r} "
                             f"({type(value).__name__})")
  return value
