"""The argument checks of tf_dpiter, one module for every package (pure Python, no TensorFlow).

Each check raises an error of the `tf_dpiter.errors` family naming the parameter and the
value, Keras style ("`x` must be ... Received: x=..."), so that no bad configuration turns
into a silently wrong guarantee; tensors pass through unchecked. A public entry point
declares its parameters' rules as one table {name: Constraint} (`check_params`, the decorator
`validates`); each constraint owns its description, its error classes and the invalid values
a generated test feeds it, so messages and `Raises:` entries follow from the table.

The clip norm S (`check_clip_norm`) is one rule everywhere: S > 0, and S = +inf (no
clipping) only with noise multiplier z = 0. The Gaussian mechanism adds N(0, (z S)^2) to a
sum of records clipped to norm S (Abadi et al., "Deep Learning with Differential Privacy",
Section 3.1; McMahan et al., "A General Approach to Adding Differential Privacy to Iterative
Training Procedures", Section 2) and the ledger recovers z = sigma / S: S = 0 makes that
0 / 0 (and every clipped record zero), so it is refused rather than accounted.
"""

import abc
import functools
import inspect
import math
import numbers
import sys

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

__all__ = ["message", "check_number", "is_integer", "check_integer", "check_nonnegative",
           "check_positive", "check_probability", "check_delta", "check_instance",
           "check_one_of", "check_clip_norm", "Constraint", "Interval", "Integer", "OneOf",
           "InstanceOf", "Callable", "Optional", "Required", "check_params", "validates",
           "ENTRY_POINTS"]


def message(name, requirement, value):
  """The Keras-style message "`name` must be requirement. Received: name=value" (a str)."""
  return f"`{name}` must be {requirement}. Received: {name}={value!r}"


def _is_tensor(x):
  """True for a TF tensor or variable; never imports TensorFlow (pure callers stay light)."""
  tf = sys.modules.get("tensorflow")
  return tf is not None and (tf.is_tensor(x) or isinstance(x, tf.Variable))


def is_integer(value):
  """True for a Python or numpy integer that is not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_bool(value):
  """True for a Python bool, or a value whose dtype is bool: a numpy bool (np.True_ is no
  int: `isinstance` misses it), a numpy bool array (np.array(True)), a TensorFlow bool
  tensor, a Keras bool variable (numpy's and TensorFlow's dtypes are named "bool", Keras'
  is the string)."""
  if isinstance(value, bool):
    return True
  dtype = getattr(value, "dtype", None)
  name = getattr(dtype, "name", dtype)
  return isinstance(name, str) and name == "bool"


def check_number(name, value):
  """float(value) for a number of any range (not a str, bytes or bool).

  Raises:
    ParameterTypeError: `value` is not a number.
  """
  if isinstance(value, (str, bytes)) or _is_bool(value) or not _floats(value):   # float("1")
    raise ParameterTypeError(message(name, "a number", value))
  return float(value)


# The checks below are `check_params` with one constraint: `name` is the parameter's name
# (for the message), `value` the argument; a tensor passes through unchecked where a number
# is asked for. A wrong type raises ParameterTypeError, a value out of range `error`.

def check_integer(name, value, minimum=None, maximum=None, error=ParameterValueError):
  """int(value) for an integer (not a bool) in [minimum, maximum] (None: unbounded).

  Raises:
    ParameterTypeError: not an integer.
    error: out of range.
  """
  check_params({name: Integer(minimum, maximum, error)}, {name: value})
  return int(value)


def check_nonnegative(name, value, allow_inf=True, error=PrivacyConfigError):
  """`value` for a number >= 0 (finite unless `allow_inf`); a float when it was not a Python
  number.

  Raises:
    ParameterTypeError: not a number.
    error: NaN, negative, or +inf when not allowed.
  """
  check_params({name: Interval(float, 0, None, "left", allow_inf, error)}, {name: value})
  plain = isinstance(value, numbers.Real) and not isinstance(value, bool)
  return value if plain or _is_tensor(value) else float(value)


def check_positive(name, value, allow_inf=False, error=PrivacyConfigError):
  """`value` for a number > 0 (finite unless `allow_inf`).

  Raises:
    ParameterTypeError: not a number.
    error: NaN, <= 0, or +inf when not allowed.
  """
  check_params({name: Interval(float, 0, None, "neither", allow_inf, error)}, {name: value})
  return value


def check_probability(name, value, allow_zero=False):
  """float(value) for a probability in (0, 1] ([0, 1] when `allow_zero`).

  Raises:
    ParameterTypeError: not a number.
    PrivacyConfigError: outside the interval.
  """
  check_params({name: Interval(float, 0, 1, "both" if allow_zero else "right")},
               {name: value})
  return value if _is_tensor(value) else float(value)


def check_delta(name, value):
  """float(value) for a delta in the open interval (0, 1).

  Raises:
    ParameterTypeError: not a number.
    PrivacyConfigError: outside (0, 1).
  """
  check_params({name: Interval(float, 0, 1, "neither")}, {name: value})
  return float(value)


def check_instance(name, value, types, expected):
  """`value` when `isinstance(value, types)`; `expected` names the type in the message.

  Raises:
    ParameterTypeError: not an instance of `types`.
  """
  if not isinstance(value, types):
    raise ParameterTypeError(message(name, f"{expected} (got a {type(value).__name__})", value))
  return value


def check_one_of(name, value, choices, error=ParameterValueError):
  """`value` when it is one of `choices` (a tuple).

  Raises:
    error: not in `choices`.
  """
  check_params({name: OneOf(tuple(choices), error)}, {name: value})
  return value


def check_clip_norm(name, value, noise_multiplier=None):
  """`value` for a clip norm S > 0; +inf (no clipping) only without noise (module docstring:
  why S = 0 is refused). `noise_multiplier`: z when known, else None (S = +inf not checked).

  Raises:
    ParameterTypeError: not a number.
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


# ---- Declarative constraints -------------------------------------------------------------
# A public entry point declares its parameters' constraints as one table {name: constraint}
# (a module-level dict, or a class attribute `_parameter_constraints`); `check_params` checks
# it, and `validates` applies it to a function or a class. Each constraint owns what the
# message says ("a finite number > 0"), the error class of a wrong type and of a wrong value,
# and the invalid values a generated test feeds it (tests/core/test_param_constraints.py).

ENTRY_POINTS = []   # what `validates` decorated, in import order (the generated test's list)


class Constraint(abc.ABC):
  """What one parameter must be (abstract; the constraints below are final).

  Attributes:
    error: the ValueError subclass raised for a value of the right type out of range.
  """

  error = ParameterValueError

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if any(base is not Constraint and issubclass(base, Constraint) for base in cls.__bases__):
      raise ParameterTypeError(f"{cls.__name__} subclasses a concrete constraint: constraints "
                               "are abstract or final. Subclass Constraint directly")

  @abc.abstractmethod
  def description(self):
    """What the value must be (str), for the message ("a finite number > 0")."""

  @abc.abstractmethod
  def failure(self, value):
    """The exception class `value` violates the constraint with (ParameterTypeError or
    self.error), or None if it satisfies it."""

  @abc.abstractmethod
  def invalid_values(self):
    """A list of (value, exception class): values the constraint refuses, with the class each
    one raises (for generated tests)."""

  def raises(self):
    """The set of exception classes this constraint can raise."""
    return {cls for _, cls in self.invalid_values()}


class Interval(Constraint):
  """A number (kind float) or an int (kind int), never a bool or a str, in an interval.

  Args:
    kind: float (any real number) or int (an integer).
    low: the lower bound, or None.
    high: the upper bound, or None.
    closed: "both", "left", "right" or "neither": which bounds are included.
    allow_inf: whether +-inf pass (a float interval without the bound that excludes them).
    error: the class raised for a number out of range (PrivacyConfigError for privacy ones).
  A tensor passes unchecked (its value is known only when the graph runs).
  """

  def __init__(self, kind, low, high, closed="both", allow_inf=False, error=PrivacyConfigError):
    self.kind, self.low, self.high, self.closed = kind, low, high, closed
    self.allow_inf, self.error = allow_inf, error

  def description(self):
    lo_in, hi_in = self.closed in ("both", "left"), self.closed in ("both", "right")
    if self.kind is int:
      bounds = ([f">= {self.low if lo_in else self.low + 1}"] if self.low is not None else [])
      bounds += [f"<= {self.high if hi_in else self.high - 1}"] if self.high is not None else []
      return "an int" + (" " + " and ".join(bounds) if bounds else "")
    if self.low is not None and self.high is not None:
      return f"a number in {'[' if lo_in else '('}{self.low}, {self.high}{']' if hi_in else ')'}"
    finite = "" if self.allow_inf else " finite"
    if self.low is not None:
      return f"a{finite} number {'>=' if lo_in else '>'} {self.low}"
    if self.high is not None:
      return f"a{finite} number {'<=' if hi_in else '<'} {self.high}"
    return f"a{finite} number"

  def failure(self, value):
    if _is_tensor(value) and not _is_bool(value):   # a bool tensor's dtype is known statically
      return None
    if (not is_integer(value)) if self.kind is int else (
        isinstance(value, (str, bytes)) or _is_bool(value) or not _floats(value)):
      return ParameterTypeError
    v = float(value)
    lo_in, hi_in = self.closed in ("both", "left"), self.closed in ("both", "right")
    if (math.isnan(v) or (math.isinf(v) and not self.allow_inf)
        or (self.low is not None and (v < self.low if lo_in else v <= self.low))
        or (self.high is not None and (v > self.high if hi_in else v >= self.high))):
      return self.error
    return None

  def invalid_values(self):
    out = [("1", ParameterTypeError), (True, ParameterTypeError)]
    if self.kind is int:
      out.append((1.5, ParameterTypeError))
    step = 1 if self.kind is int else 0.5
    lo_in, hi_in = self.closed in ("both", "left"), self.closed in ("both", "right")
    if self.low is not None:
      out.append(((self.low - step) if lo_in else self.low, self.error))
    if self.high is not None:
      out.append(((self.high + step) if hi_in else self.high, self.error))
    if self.kind is float:
      out.append((math.nan, self.error))
      if not self.allow_inf:
        out.append((math.inf if self.high is None else -math.inf, self.error))
    return out


def _floats(value):
  """True when float(value) works (a number, a numpy scalar)."""
  try:
    float(value)
    return True
  except (TypeError, ValueError):
    return False


def Integer(min=None, max=None, error=ParameterValueError):   # pylint: disable=invalid-name,redefined-builtin
  """An int (not a bool) in [min, max]: `Interval(int, min, max, error=error)`.

  Args:
    min: the least value, or None.
    max: the largest value, or None.
    error: the class raised for an int out of range.

  Returns:
    an Interval.
  """
  return Interval(int, min, max, error=error)


class OneOf(Constraint):
  """One of a set of values (compared with ==), e.g. a mode's name.

  Args:
    choices: a tuple of the accepted values, or a function returning it (a registry read
      when the check runs).
    error: the class raised for any other value.
  """

  def __init__(self, choices, error=ParameterValueError):
    self.choices, self.error = choices, error

  def _choices(self):
    return tuple(self.choices() if callable(self.choices) else self.choices)

  def description(self):
    return f"one of {self._choices()!r}"

  def failure(self, value):
    try:
      return None if value in self._choices() else self.error
    except TypeError:   # an unhashable or incomparable value is not one of them
      return self.error

  def invalid_values(self):
    return [("no such choice", self.error)]


class InstanceOf(Constraint):
  """An instance of a type (or a tuple of types); another type raises ParameterTypeError.

  Args:
    types: a type or a tuple of types.
    expected: how the message names them ("a DPQuery").
  """

  def __init__(self, types, expected):
    self.types, self.expected = types, expected

  def description(self):
    return self.expected

  def failure(self, value):
    return None if isinstance(value, self.types) else ParameterTypeError

  def invalid_values(self):
    return [(object(), ParameterTypeError)]


class Callable(Constraint):
  """A callable (a function, or an object with __call__); anything else: ParameterTypeError."""

  def description(self):
    return "a callable"

  def failure(self, value):
    return None if callable(value) else ParameterTypeError

  def invalid_values(self):
    return [(1, ParameterTypeError)]


class Optional(Constraint):   # pylint: disable=invalid-name
  """None, or a value satisfying `inner`.

  Args:
    inner: a Constraint.
    say_none: whether the message says "None or ..." (False when None is allowed only with
      another argument, e.g. the clip with a custom query: the message then states the rule
      of a value alone, the same as where the parameter is required).
  """

  def __init__(self, inner, say_none=True):
    self.inner, self.say_none = inner, say_none
    self.error = inner.error

  def description(self):
    return ("None or " if self.say_none else "") + self.inner.description()

  def failure(self, value):
    return None if value is None else self.inner.failure(value)

  def invalid_values(self):
    return self.inner.invalid_values()


class Required(Constraint):
  """A value satisfying `inner` that has no usable default: None raises `inner.error`.

  Args:
    inner: a Constraint.
    why: what the parameter is, appended to the description ("the horizon").
  """

  def __init__(self, inner, why):
    self.inner, self.why, self.error = inner, why, inner.error

  def description(self):
    return f"{self.inner.description()} ({self.why})"

  def failure(self, value):
    return self.error if value is None else self.inner.failure(value)

  def invalid_values(self):
    return [(None, self.error)] + self.inner.invalid_values()


def check_params(constraints, values):
  """Checks every value against its parameter's constraint, in the table's order.

  Args:
    constraints: {parameter name: Constraint}.
    values: {parameter name: value}; a name missing from it is not checked.

  Raises:
    ParameterTypeError: a value of the wrong type.
    ParameterValueError: (or the constraint's subclass, e.g. PrivacyConfigError) a value of
      the right type out of range. The message is "`name` must be <description>.
      Received: name=<value>".
  """
  for name, constraint in constraints.items():
    if name in values:
      error = constraint.failure(values[name])
      if error is not None:
        raise error(message(name, constraint.description(), values[name]))


def validates(constraints, also_raises=()):
  """Decorator: checks a function's (or a class constructor's) arguments by `constraints`.

  The table is kept as `_parameter_constraints` (and the other classes the body raises, for
  the docstring test, as `_also_raises`), and the entry point joins ENTRY_POINTS.

  Args:
    constraints: {parameter name: Constraint}.
    also_raises: the exception classes the body raises besides the constraints' ones.

  Returns:
    the decorator.
  """
  def decorate(target):
    fn = target.__init__ if isinstance(target, type) else target
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      check_params(constraints, bound.arguments)
      return fn(*args, **kwargs)

    target._parameter_constraints = constraints   # pylint: disable=protected-access
    target._also_raises = tuple(also_raises)   # pylint: disable=protected-access
    ENTRY_POINTS.append(target)
    if isinstance(target, type):
      target.__init__ = checked
      return target
    checked._parameter_constraints = constraints   # pylint: disable=protected-access
    checked._also_raises = tuple(also_raises)   # pylint: disable=protected-access
    ENTRY_POINTS[-1] = checked
    return checked
  return decorate
