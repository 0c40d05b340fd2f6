"""The declared parameter constraints of the public entry points, tested from the tables.

Every entry point decorated with `validation.validates` (validation.ENTRY_POINTS) is called
once with valid arguments, then once per invalid value each of its constraints generates
(a wrong type, a value below or above its interval, NaN or inf where it must be finite, a value
not among its choices, None where it is required), which must raise the declared class with
the one message "`name` must be ... Received: name=value". Its docstring's `Raises:` entries
must name exactly the classes its constraints can raise and the ones its body declares
(`also_raises`).
"""

import inspect
import math
import re

import numpy as np
import pytest

from tf_dpiter import validation
from tf_dpiter.accounting import accountant
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.data import sampling
from tf_dpiter.data import shuffling
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import dp_config
from tf_dpiter.keras.optimizer import noise_mechanisms


def _ledger():
  return dp_sgd.dp_sgd_groups(1000, 10, 1.0, 10)


# Entry point -> valid keyword arguments (the baseline each invalid value replaces one of).
VALID = {
    dp_config.DPConfig: lambda: dict(l2_norm_clip=1.0, noise_multiplier=1.0),
    dp_config.PerformanceFlags: dict,
    noise_mechanisms.Tree: lambda: dict(restart_every=2),
    noise_mechanisms.BandMF: lambda: dict(num_bands=2, num_steps=4),
    noise_mechanisms.BLT: lambda: dict(num_steps=4),
    gaussian_query.GaussianSumQuery: lambda: dict(l2_norm_clip=1.0, stddev=1.0),
    dp_sgd.compute_dp_sgd_privacy: lambda: dict(n=1000, batch_size=10, noise_multiplier=1.0,
                                                epochs=1, delta=1e-5),
    accountant.privacy_report: lambda: dict(ledger=_ledger(), delta=1e-5),
    sampling.poisson_batches: lambda: dict(x=np.zeros((8, 1), np.float32),
                                           expected_batch_size=2),
    shuffling.shuffled_batches: lambda: dict(x=np.zeros((8, 1), np.float32), batch_size=2),
}
# (entry point, parameter) -> changes to the baseline when that parameter is the invalid one.
FOR_PARAMETER = {
    (accountant.privacy_report, "epsilon"): {"delta": None},
}
# The entry points the constraints must cover (the most used ones).
REQUIRED = {"DPConfig", "PerformanceFlags", "Tree", "BandMF", "BLT", "GaussianSumQuery",
            "compute_dp_sgd_privacy", "privacy_report", "poisson_batches", "shuffled_batches"}


def _name(entry):
  return entry.__name__


def _label(value):
  plain = value is None or isinstance(value, (str, int, float))
  return repr(value) if plain else type(value).__name__


def _cases():
  for entry in validation.ENTRY_POINTS:
    for param, constraint in entry._parameter_constraints.items():   # pylint: disable=protected-access
      for value, error in constraint.invalid_values():
        yield pytest.param(entry, param, value, error,
                           id=f"{_name(entry)}-{param}-{_label(value)}-{error.__name__}")


def test_every_entry_point_with_constraints_has_a_baseline():
  names = {_name(e) for e in validation.ENTRY_POINTS}
  assert REQUIRED <= names, REQUIRED - names
  assert set(validation.ENTRY_POINTS) == set(VALID), {_name(e) for e in
                                                      set(validation.ENTRY_POINTS) ^ set(VALID)}


@pytest.mark.parametrize("entry", list(VALID), ids=_name)
def test_constraints_name_real_parameters_and_the_baseline_passes(entry):
  fn = entry.__init__ if isinstance(entry, type) else entry
  params = set(inspect.signature(fn).parameters)
  table = entry._parameter_constraints   # pylint: disable=protected-access
  assert table and set(table) <= params, set(table) - params
  assert entry(**VALID[entry]()) is not None


@pytest.mark.parametrize("entry,param,value,error", list(_cases()))
def test_invalid_value_raises_the_declared_class_naming_it(entry, param, value, error):
  kwargs = VALID[entry]()
  kwargs.update(FOR_PARAMETER.get((entry, param), {}))
  kwargs[param] = value
  with pytest.raises(error) as info:
    entry(**kwargs)
  assert type(info.value) is error   # pylint: disable=unidiomatic-typecheck
  text = str(info.value)
  assert text.startswith(f"`{param}` must be "), text
  assert text.endswith(f"Received: {param}={value!r}"), text


def _documented_raises(entry):
  docs = [entry.__doc__ or ""]
  if isinstance(entry, type):
    docs += [getattr(entry, m).__doc__ or "" for m in ("__init__", "__post_init__")
             if m in vars(entry)]
  names = set()
  for doc in docs:
    for section in re.findall(r"\n\s*Raises:\n((?:\s+.*\n?)+?)(?:\n\s*\n|\Z)", doc + "\n\n"):
      names |= set(re.findall(r"^\s+(\w+Error):", section, re.M))
  return names


@pytest.mark.parametrize("entry", list(VALID), ids=_name)
def test_raises_docstring_names_exactly_the_declared_classes(entry):
  declared = set(entry._also_raises)   # pylint: disable=protected-access
  for constraint in entry._parameter_constraints.values():   # pylint: disable=protected-access
    declared |= constraint.raises()
  assert _documented_raises(entry) == {c.__name__ for c in declared}


def test_check_params_one_message_and_classes():
  table = {"q": validation.Interval(float, 0, 1, closed="right"),
           "k": validation.Optional(validation.Integer(min=1, max=3)),
           "mode": validation.OneOf(("a", "b")),
           "f": validation.Callable(),
           "z": validation.Interval(float, None, None)}
  validation.check_params(table, {"q": 1.0, "k": None, "mode": "a", "f": len, "z": -2.0})
  with pytest.raises(PrivacyConfigError, match=r"^`q` must be a number in \(0, 1\]\. "
                     r"Received: q=0$"):
    validation.check_params(table, {"q": 0})
  with pytest.raises(ParameterTypeError, match=r"`k` must be None or an int >= 1 and <= 3"):
    validation.check_params(table, {"k": 2.0})
  with pytest.raises(ParameterValueError, match=r"Received: k=4$"):
    validation.check_params(table, {"k": 4})
  with pytest.raises(ParameterValueError, match=r"one of \('a', 'b'\)"):
    validation.check_params(table, {"mode": "c"})
  with pytest.raises(ParameterTypeError, match=r"`f` must be a callable"):
    validation.check_params(table, {"f": 3})
  with pytest.raises(PrivacyConfigError, match=r"`z` must be a finite number\."):
    validation.check_params(table, {"z": math.inf})


def test_warnings_of_a_checked_entry_point_point_at_the_callers_line():
  """The `validates` wrapper is one more frame: the warnings still name the user's line."""
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sampling.poisson_batches(np.zeros((8, 1), np.float32), expected_batch_size=2, seed=1)
    shuffling.shuffled_batches(np.zeros((8, 1), np.float32), batch_size=2, seed=1)
    dp_sgd.compute_dp_sgd_privacy(100, 10, 1.0, 1, 0.5)
    accountant.privacy_report(_ledger(), delta=0.5)
  assert len(caught) == 4
  assert {w.filename for w in caught} == {__file__}


def test_constraints_are_final():
  with pytest.raises(ParameterTypeError, match="abstract or final"):
    class Wider(validation.Interval):   # pylint: disable=unused-variable
      pass
