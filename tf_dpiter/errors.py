"""The exceptions tf_dpiter raises for a bad argument or configuration (imports nothing).

One family, rooted at `DPiterError`, telling a wrong *type* from a wrong *value*:

* `ParameterTypeError` (a `TypeError`, also a `ValueError` for older callers): an argument
  of the wrong kind.
* `ParameterValueError` (a `ValueError`): a refused value of a non-privacy argument.
* `PrivacyConfigError` (a `ParameterValueError`): a value that would make the privacy
  guarantee wrong or meaningless; `BudgetConfigError` narrows it to a run's (epsilon, delta).

Every message names the parameter and its value: "`x` must be ... Received: x=...".
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
