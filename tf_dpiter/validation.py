"""The argument checks of tf_dpiter, one module for every package.

Each check raises an error of the `tf_dpiter.errors` family naming the parameter and the value,
Keras style ("`x` must be ... Received: x=..."), so that no bad configuration turns into a
silently wrong guarantee: `ParameterTypeError` (a TypeError, also a ValueError) for a value
that is not a number, `PrivacyConfigError` (a ValueError) for a privacy parameter out of range,
`ParameterValueError` (a ValueError) for any other argument out of range. Tensors pass through
unchecked (their value is only known when the graph runs).

Leaf module: it imports only `tf_dpiter.errors` and the standard library (no TensorFlow), so
the accountant and the Draw-and-Discard service use it without paying for TF.

The clip norm S (`check_clip_norm`) is one rule everywhere (queries, optimizers, federated
servers): S > 0, and S = +inf (no clipping) only with noise multiplier z = 0. The Gaussian
mechanism adds N(0, (z S)^2) to a sum of records clipped to norm S (Abadi et al., "Deep
Learning with Differential Privacy", Section 3.1; McMahan et al., "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 2), and the ledger
recovers z = sigma / S from the query: S = 0 makes that 0 / 0, and every clipped record the
zero vector (the model cannot learn), so it is refused rather than accounted.
"""

import math
import numbers
import sys

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

__all__ = ["message", "check_number", "is_integer", "check_integer", "check_optional_integer",
           "check_nonnegative", "check_positive", "check_probability", "check_delta",
           "check_instance", "check_one_of", "check_clip_norm", "check_noise_multiplier"]


def message(name, requirement, value):
  """The Keras-style message "`name` must be requirement. Received: name=value".

  Args:
    name: the parameter's name.
    requirement: what it must be, e.g. "a number > 0".
    value: the value received.

  Returns:
    str.
  """
  return f"`{name}` must be {requirement}. Received: {name}={value!r}"


def _is_tensor(x):
  """True for a TF tensor or variable; never imports TensorFlow (pure callers stay light)."""
  tf = sys.modules.get("tensorflow")
  return tf is not None and (tf.is_tensor(x) or isinstance(x, tf.Variable))


def _is_python_number(x):
  """True for a Python or numpy real number that is not a bool."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_float(name, value, expected):
  """float(value), refusing what is not a number: a str or bytes (float("1") would pass), a
  bool, or an object float() rejects (ParameterTypeError naming `name` and the value)."""
  if isinstance(value, (str, bytes, bool)):
    raise ParameterTypeError(message(name, expected, value))
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ParameterTypeError(message(name, expected, value)) from None


def check_number(name, value):
  """Checks that `value` is a number (not a str, bytes or bool), whatever its range.

  Args:
    name: the parameter's name, for the message.
    value: the argument.

  Returns:
    float(value).

  Raises:
    ParameterTypeError: `value` is not a number (a TypeError).
  """
  return _as_float(name, value, "a number")


def is_integer(value):
  """True for a Python or numpy integer that is not a bool.

  Args:
    value: any object.

  Returns:
    bool.
  """
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_integer(name, value, minimum=None, maximum=None, error=ParameterValueError):
  """Checks that `value` is an integer (not a bool) in [minimum, maximum].

  One message for both failures: "`name` must be an int >= minimum[ and <= maximum].
  Received: name=value".

  Args:
    name: the parameter's name, for the message.
    value: the argument.
    minimum, maximum: inclusive bounds, or None for none.
    error: the ValueError subclass raised for an integer out of range (e.g.
      PrivacyConfigError for a privacy parameter).

  Returns:
    int(value).

  Raises:
    ParameterTypeError: `value` is not an integer (a TypeError).
    error: `value` is out of range.
  """
  bounds = [f">= {minimum}"] if minimum is not None else []
  bounds += [f"<= {maximum}"] if maximum is not None else []
  text = message(name, "an int" + (" " + " and ".join(bounds) if bounds else ""), value)
  if not is_integer(value):
    raise ParameterTypeError(text)
  if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
    raise error(text)
  return int(value)


def check_optional_integer(name, value, minimum=1, error=ParameterValueError):
  """`check_integer(name, value, minimum)`, or None passed through (e.g. num_microbatches).

  Args:
    name: the parameter's name; value: None or the argument; minimum: inclusive lower bound;
    error: raised for an integer below `minimum`.

  Returns:
    None or int(value).

  Raises:
    ParameterTypeError: `value` is neither None nor an integer.
    error: `value` < minimum.
  """
  if value is None:
    return None
  text = message(name, f"None or an int >= {minimum}", value)
  if not is_integer(value):
    raise ParameterTypeError(text)
  if value < minimum:
    raise error(text)
  return int(value)


def check_nonnegative(name, value, allow_inf=True, error=PrivacyConfigError):
  """Checks that `value` is a number >= 0 (finite unless `allow_inf`).

  Args:
    name: the parameter's name, for the message.
    value: a Python or numpy number, or a tensor (passed through unchecked).
    allow_inf: whether +inf is accepted.
    error: the ValueError subclass raised for a value out of range.

  Returns:
    `value` (a float when it was not a Python number, the tensor itself for a tensor).

  Raises:
    ParameterTypeError: `value` is not a number.
    error: NaN, negative, or +inf when not allowed.
  """
  if _is_tensor(value):
    return value
  v = _check_above_zero(name, value, allow_inf, error, strict=False)
  return value if _is_python_number(value) else v


def check_positive(name, value, allow_inf=False, error=PrivacyConfigError):
  """Checks that `value` is a number > 0 (finite unless `allow_inf`).

  Args:
    name: the parameter's name, for the message.
    value: a Python or numpy number, or a tensor (passed through unchecked).
    allow_inf: whether +inf is accepted.
    error: the ValueError subclass raised for a value out of range.

  Returns:
    `value`.

  Raises:
    ParameterTypeError: `value` is not a number.
    error: `value` is NaN, <= 0, or +inf when not allowed.
  """
  if _is_tensor(value):
    return value
  _check_above_zero(name, value, allow_inf, error, strict=True)
  return value


def _check_above_zero(name, value, allow_inf, error, strict):
  """`value` as a float, checked > 0 (`strict`) or >= 0, finite unless `allow_inf`."""
  requirement = f"a{'' if allow_inf else ' finite'} number {'>' if strict else '>='} 0"
  v = _as_float(name, value, requirement)
  if math.isnan(v) or (v <= 0 if strict else v < 0) or (math.isinf(v) and not allow_inf):
    raise error(message(name, requirement, value))
  return v


def check_probability(name, value, allow_zero=False):
  """Checks a probability q in (0, 1] (or [0, 1] when `allow_zero`).

  Args:
    name: the parameter's name, for the message.
    value: a number, or a tensor (passed through unchecked).
    allow_zero: whether q = 0 is accepted.

  Returns:
    q as a float (a tensor passes through unchecked).

  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: `value` is outside the interval.
  """
  if _is_tensor(value):
    return value
  requirement = f"a number in {'[' if allow_zero else '('}0, 1]"
  v = _as_float(name, value, requirement)
  lo_ok = v >= 0 if allow_zero else v > 0
  if math.isnan(v) or not lo_ok or v > 1:
    raise PrivacyConfigError(message(name, requirement, value))
  return v


def check_delta(name, value):
  """Checks delta in the open interval (0, 1).

  Args:
    name: the parameter's name, for the message.
    value: a number.

  Returns:
    delta as a float.

  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: `value` is outside (0, 1).
  """
  v = _as_float(name, value, "a number in (0, 1)")
  if math.isnan(v) or not 0 < v < 1:
    raise PrivacyConfigError(message(name, "a number in (0, 1)", value))
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
    raise ParameterTypeError(message(name, f"{expected} (got a {type(value).__name__})", value))
  return value


def check_one_of(name, value, choices, error=ParameterValueError):
  """Checks that `value` is one of `choices`.

  Args:
    name: the parameter's name; value: the argument; choices: a tuple of accepted values;
    error: the ValueError subclass raised otherwise.

  Returns:
    `value`.

  Raises:
    error: `value` is not in `choices`.
  """
  if value not in choices:
    raise error(message(name, f"one of {tuple(choices)!r}", value))
  return value


def check_noise_multiplier(name, value):
  """Checks a noise multiplier z: a finite number >= 0 (0: no noise, not private).

  Args:
    name: the parameter's name; value: a number or a tensor (passed through unchecked).

  Returns:
    `value`.

  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: z < 0, NaN or infinite.
  """
  return check_nonnegative(name, value, allow_inf=False)


def check_clip_norm(name, value, noise_multiplier=None):
  """Checks a clip norm S: a number > 0; +inf (no clipping) only without noise.

  The one rule for S across queries, optimizers and servers (see the module docstring for
  why S = 0 is refused).

  Args:
    name: the parameter's name, for the message.
    value: S, a number or a tensor (passed through unchecked).
    noise_multiplier: z when known (a number), to refuse S = +inf with z > 0 (infinite
      noise z S); None to skip that check.

  Returns:
    `value`.

  Raises:
    ParameterTypeError: `value` is not a number.
    PrivacyConfigError: S <= 0 or NaN, or S = +inf with z > 0.
  """
  if _is_tensor(value):
    return value
  check_positive(name, value, allow_inf=True)
  z = noise_multiplier
  if (z is not None and not _is_tensor(z) and math.isinf(float(value)) and float(z) > 0):
    raise PrivacyConfigError(
        message(name, "finite when the noise multiplier is > 0 (the noise z*S would be "
                "infinite); give a finite clip, or noise_multiplier=0 for no noise", value))
  return value
