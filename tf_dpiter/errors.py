"""The exceptions tf_dpiter raises for bad configuration.

Two families, so that callers can tell a wrong *type* from a wrong *value*:

* `ParameterTypeError` (a `TypeError`): an argument of the wrong kind, e.g. a string where a
  number is needed, or an object that is not a `DPQuery`. It is also a `ValueError`, so code
  written when these checks raised `ValueError` keeps catching them.
* `PrivacyConfigError` (a `ValueError`): a value that would make the privacy guarantee wrong
  or meaningless (a negative or infinite clip, a probability outside (0, 1], a noise
  multiplier of infinity, a budget target that cannot be checked).
  `BudgetConfigError` narrows it to the (epsilon, delta) budget of a run.

Every message names the parameter and the value it got. This module imports nothing.
"""

__all__ = ["ParameterTypeError", "PrivacyConfigError", "BudgetConfigError"]


class ParameterTypeError(TypeError, ValueError):
  """An argument has the wrong type (names the parameter and the type it got).

  Subclasses `TypeError`; also `ValueError` for callers that caught the older `ValueError`.
  """


class PrivacyConfigError(ValueError):
  """A privacy parameter (clip, noise, sampling, relation) has a value that is refused."""


class BudgetConfigError(PrivacyConfigError):
  """A privacy budget (target epsilon / delta, stopping rule) is malformed or inconsistent."""
