"""One exception family and one validation module, used everywhere.

* Every `raise` of a bad argument in tf_dpiter uses the `tf_dpiter.errors` family (a plain
  `raise ValueError(` / `raise TypeError(` is found by parsing every module); a public entry
  point declares its parameters' constraints (`validation.validates`, tested from the tables in
  test_param_constraints.py).
* No `except Exception` (or bare `except:`) fallback anywhere in the package.
* The family keeps `except ValueError` / `except TypeError` working.
* The clip norm S follows one rule in the queries and in the Keras optimizers (S > 0; +inf only
  with noise multiplier 0): the same inputs are refused with the same error class and message.
"""

import ast
import contextlib
import functools
import math
import pathlib

import pytest

import tf_dpiter as dp
from tf_dpiter import errors
from tf_dpiter import validation

ROOT = pathlib.Path(dp.__file__).resolve().parent
# The family and the checks themselves.
FAMILY_MODULES = {"errors.py", "validation.py"}


def _modules():
  return sorted(p for p in ROOT.rglob("*.py"))


def _rel(path):
  return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def _tree(path):
  """The module's AST, parsed once for both walks of this file."""
  return ast.parse(path.read_text(), filename=str(path))


def _plain_raises(path):
  tree = _tree(path)
  return [node.lineno for node in ast.walk(tree)
          if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
          and isinstance(node.exc.func, ast.Name)
          and node.exc.func.id in ("ValueError", "TypeError")]


def test_no_plain_value_or_type_error_outside_the_family():
  found = {}
  for path in _modules():
    rel = _rel(path)
    if rel in FAMILY_MODULES:
      continue
    lines = _plain_raises(path)
    if lines:
      found[rel] = lines
  assert not found, (
      "plain `raise ValueError(`/`raise TypeError(` (declare the parameter's constraint, "
      f"validation.validates, or raise a tf_dpiter.errors class): {found}")


def _broad_handlers(path):
  """Line numbers of `except Exception`, bare `except:`, or `except BaseException` that does
  not re-raise (a cleanup that ends in a bare `raise` is not a fallback)."""
  out = []
  for node in ast.walk(_tree(path)):
    if not isinstance(node, ast.ExceptHandler):
      continue
    types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
    names = {t.id for t in types if isinstance(t, ast.Name)}
    reraises = any(isinstance(n, ast.Raise) and n.exc is None for n in ast.walk(node))
    if node.type is None or "Exception" in names or ("BaseException" in names and not reraises):
      out.append(node.lineno)
  return out


def test_no_broad_exception_fallback():
  found = {_rel(p): lines for p in _modules() if (lines := _broad_handlers(p))}
  assert not found, f"`except Exception` / bare `except:` fallbacks: {found}"


def test_family_is_value_and_type_error_compatible():
  assert issubclass(errors.ParameterTypeError, TypeError)
  assert issubclass(errors.ParameterTypeError, ValueError)
  for cls in (errors.ParameterValueError, errors.PrivacyConfigError, errors.BudgetConfigError):
    assert issubclass(cls, ValueError) and not issubclass(cls, TypeError)
  for cls in (errors.ParameterTypeError, errors.ParameterValueError, errors.PrivacyConfigError,
              errors.BudgetConfigError):
    assert issubclass(cls, errors.DPiterError)
  assert issubclass(errors.PrivacyConfigError, errors.ParameterValueError)
  assert issubclass(errors.BudgetConfigError, errors.PrivacyConfigError)
  with pytest.raises(ValueError):  # an older `except ValueError` still catches it
    dp.dp_query.GaussianSumQuery(-1.0, 1.0)


@pytest.mark.parametrize("call, cls, match", [
    (lambda: validation.check_positive("lr", 0.0), errors.PrivacyConfigError,
     r"^`lr` must be a finite number > 0\. Received: lr=0\.0$"),
    (lambda: validation.check_positive("lr", "x"), errors.ParameterTypeError,
     r"^`lr` must be a finite number > 0\. Received: lr='x'$"),
    (lambda: validation.check_integer("k", 0, 1), errors.ParameterValueError,
     r"^`k` must be an int >= 1\. Received: k=0$"),
    (lambda: validation.check_integer("k", True, 1), errors.ParameterTypeError,
     r"^`k` must be an int >= 1\. Received: k=True$"),
    (lambda: validation.check_params({"m": validation.Optional(validation.Integer(1))},
                                     {"m": 1.5}), errors.ParameterTypeError,
     r"^`m` must be None or an int >= 1\. Received: m=1\.5$"),
    (lambda: validation.check_probability("q", 1.5), errors.PrivacyConfigError,
     r"^`q` must be a number in \(0, 1\]\. Received: q=1\.5$"),
    (lambda: validation.check_probability("q", 0.0), errors.PrivacyConfigError,
     r"^`q` must be a number in \(0, 1\]\. Received: q=0\.0$"),
    (lambda: validation.check_delta("delta", 1.0), errors.PrivacyConfigError,
     r"^`delta` must be a number in \(0, 1\)\. Received: delta=1\.0$"),
    (lambda: validation.check_one_of("mode", "x", ("a", "b")), errors.ParameterValueError,
     r"^`mode` must be one of \('a', 'b'\)\. Received: mode='x'$"),
    (lambda: validation.check_instance("q", 3, str, "a str"), errors.ParameterTypeError,
     r"^`q` must be a str \(got a int\)\. Received: q=3$"),
])
def test_checks_give_keras_style_messages(call, cls, match):
  with pytest.raises(cls, match=match) as info:
    call()
  assert type(info.value) is cls  # pylint: disable=unidiomatic-typecheck


def test_checks_accept_their_domain():
  assert validation.check_positive("x", 2) == 2
  assert validation.check_integer("k", 3, 1) == 3
  assert validation.check_probability("q", 1) == 1.0
  assert validation.check_clip_norm("S", math.inf, noise_multiplier=0.0) == math.inf
  assert validation.check_clip_norm("S", 0.5, noise_multiplier=3.0) == 0.5


def _query_error(clip, z):
  try:
    dp.dp_query.GaussianSumQuery.from_noise_multiplier(clip, z)
  except ValueError as e:  # the family (ParameterTypeError is also a ValueError)
    return type(e), str(e)
  return None


def _optimizer_error(clip, z):
  try:
    dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=z, learning_rate=0.1)
  except ValueError as e:
    return type(e), str(e)
  return None


@pytest.mark.parametrize("clip, z", [
    (0.0, 1.0), (0, 1.0), (-0.5, 1.0), (float("nan"), 1.0), ("1.0", 1.0), (True, 1.0),
    (math.inf, 1.0), (1.0, -1.0), (1.0, math.inf),
])
def test_clip_norm_refused_alike_by_queries_and_optimizers(clip, z):
  """S = 0 is refused by both (the ledger's z = sigma / S would be 0 / 0, and every clipped
  record is zero); so is S < 0, NaN, a non-number, and S = inf with noise (infinite noise)."""
  q = _query_error(clip, z)
  assert q is not None and issubclass(q[0], errors.DPiterError), q
  assert _optimizer_error(clip, z) == q
  assert "l2_norm_clip" in q[1] or "noise_multiplier" in q[1]


@pytest.mark.parametrize("clip, z", [(0.5, 1.0), (math.inf, 0.0), (1e-6, 0.0), (3, 2)])
def test_clip_norm_accepted_alike_by_queries_and_optimizers(clip, z):
  with pytest.warns(UserWarning) if z == 0 else contextlib.nullcontext():
    assert _optimizer_error(clip, z) is None
  assert _query_error(clip, z) is None
