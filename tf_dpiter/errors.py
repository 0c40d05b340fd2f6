"""The exceptions tf_dpiter raises for a bad argument or configuration.

One family, rooted at `DPiterError`, so that callers can catch everything the library refuses
on purpose, and tell a wrong *type* from a wrong *value*:

* `ParameterTypeError` (a `TypeError`): an argument of the wrong kind, e.g. a string where a
  number is needed, or an object that is not a `DPQuery`. It is also a `ValueError`, so code
  written when these checks raised `ValueError` keeps catching them.
* `ParameterValueError` (a `ValueError`): an argument of the right type with a refused value
  (out of range, not one of the accepted choices, inconsistent with another argument, a file
  or a shape that does not match), when the value is not itself a privacy parameter.
* `PrivacyConfigError` (a `ParameterValueError`): a value that would make the privacy
  guarantee wrong or meaningless (a non-positive or NaN clip, a probability outside (0, 1], a
  noise multiplier of infinity, a neighbouring relation or unit that is not supported).
  `BudgetConfigError` narrows it to the (epsilon, delta) budget of a run.

Every message names the parameter and the value it got, Keras style:
"`x` must be ... Received: x=...". `tf_dpiter.validation` holds the shared checks. This module
imports nothing.
"""

__all__ = ["DPiterError", "ParameterTypeError", "ParameterValueError", "PrivacyConfigError",
           "BudgetConfigError"]


class DPiterError(Exception):
  """The base of every exception tf_dpiter raises on purpose for a refused argument."""

  # Exception's own constructor (not ValueError's or TypeError's): TensorFlow's autograph
  # re-raises an error met while tracing a tf.function under its own type only when the type
  # is constructed as Exception is; any other becomes a StagingError, which is neither a
  # ValueError nor a DPiterError, and `except ValueError` around `fit` would miss it.
  __init__ = Exception.__init__


class ParameterTypeError(DPiterError, TypeError, ValueError):
  """An argument has the wrong type (names the parameter and the type it got).

  Subclasses `TypeError`; also `ValueError` for callers that caught the older `ValueError`.
  """


class ParameterValueError(DPiterError, ValueError):
  """An argument has a refused value (range, choice, consistency), not a privacy parameter."""


class PrivacyConfigError(ParameterValueError):
  """A privacy parameter (clip, noise, sampling, relation) has a value that is refused."""


class BudgetConfigError(PrivacyConfigError):
  """A privacy budget (target epsilon / delta, stopping rule) is malformed or inconsistent."""
