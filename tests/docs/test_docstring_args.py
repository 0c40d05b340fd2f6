"""Every parameter of the public API has its own `Args:` row, and every `Raises:` entry is true.

The API reference (mkdocstrings, Google style) renders one row per `Args:` entry and drops a
row that names several parameters ("l2_norm_clip, noise_multiplier: ..."), so a parameter
documented only that way had no row on its page. Here every public callable reachable from
the public API (the `__all__` of `tf_dpiter` and of its public sub-packages, as in
tests/core/test_public_api.py; the constructors and public methods of the public classes) is
checked the way the reference reads it, with griffe's Google parser:

* one parameter per `Args:` row: a row names one identifier (`*args` / `**kwargs` allowed);
* every parameter of the signature (but self / cls, and *args / **kwargs unless a row names
  them) has a row, in the function's docstring, or for a constructor in the class' or
  `__init__`'s (a dataclass documents its fields under `Attributes:`);
* no row names a parameter the signature does not have.

A method that overrides a base class' method without a docstring of its own is left to the
base's documentation (the reference shows no docstring-less member).

`Raises:` entries: each names an exception class that resolves (a builtin, one of
`tf_dpiter.errors`, or a name of the function's module), and a function whose own body raises
one of the library's classes (`raise X(...)` of a DPiterError subclass, nested functions
excluded) names that class.
"""

import ast
import builtins
import dataclasses
import functools
import importlib
import inspect
import logging
import re
import textwrap

import pytest

from tf_dpiter import errors
from tests.core.test_public_api import PACKAGES

griffe = pytest.importorskip("griffe", reason='griffe (mkdocstrings\' parser) missing: '
                                              'pip install -e ".[docs]"')
logging.getLogger("griffe").setLevel(logging.ERROR)

_ROW_NAME = re.compile(r"\*{0,2}[A-Za-z_]\w*")
_ARG_KINDS = {"parameters", "other_parameters"}


def _in_package(obj):
  return (getattr(obj, "__module__", None) or "").startswith("tf_dpiter")


def _sections(doc):
  if not doc:
    return []
  return griffe.Docstring(inspect.cleandoc(doc), parser="google",
                          parser_options={"warn_unknown_params": False}).parse()


def _rows(doc, kinds=frozenset(_ARG_KINDS)):
  return [p.name for s in _sections(doc) if s.kind.value in kinds for p in s.value]


@dataclasses.dataclass(frozen=True)
class Item:
  """One public callable: its name, the function whose signature counts, its docstrings."""
  name: str
  function: object
  docs: tuple
  attribute_docs: tuple = ()   # a dataclass' Attributes (the generated __init__'s fields)
  skip_first: bool = True


def _overrides(klass, name):
  return any(name in vars(base) for base in klass.__mro__[1:])


def _function(value):
  if isinstance(value, (staticmethod, classmethod)):
    return value.__func__, not isinstance(value, staticmethod)
  return (value, True) if inspect.isfunction(value) else (None, False)


def _class_items(klass, seen):
  init = next((vars(k)["__init__"] for k in klass.__mro__ if "__init__" in vars(k)), None)
  owner = next((k for k in klass.__mro__ if "__init__" in vars(k)), object)
  generated = dataclasses.is_dataclass(klass) and init is not None and \
      inspect.unwrap(init).__code__.co_filename == "<string>"   # under validation.validates
  if init is not None and (_in_package(owner) or generated):
    docs = (klass.__doc__, init.__doc__ if not generated else None)
    yield Item(f"{klass.__module__}.{klass.__qualname__}", init, docs,
               attribute_docs=(klass.__doc__,) if generated else ())
  for k in klass.__mro__:
    if not _in_package(k):
      continue
    for name, value in vars(k).items():
      func, skip_first = _function(value)
      if name.startswith("_") or func is None:
        continue
      key = f"{func.__module__}.{func.__qualname__}"
      if key in seen:
        continue
      seen.add(key)
      if not func.__doc__ and _overrides(k, name):
        continue   # documented by the base class' method
      yield Item(key, func, (func.__doc__,), skip_first=skip_first)


@functools.lru_cache(maxsize=None)
def public_items(package):
  """The public callables of `package`'s `__all__` (classes: constructor and methods)."""
  module = importlib.import_module(package)
  seen, items = set(), []
  for name in module.__all__:
    obj = getattr(module, name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not _in_package(obj):
      continue
    key = f"{obj.__module__}.{obj.__qualname__}"
    if key in seen:
      continue
    seen.add(key)
    if inspect.isfunction(obj):
      items.append(Item(key, obj, (obj.__doc__,), skip_first=False))
    else:
      items.extend(_class_items(obj, seen))
  return items


def _parameters(item):
  params = list(inspect.signature(item.function).parameters.values())
  if item.skip_first and params and params[0].name in ("self", "cls"):
    params = params[1:]
  return params


def args_problems(item):
  """What the reference would get wrong about `item`'s parameters (empty: nothing)."""
  rows = [r for d in item.docs for r in _rows(d)]
  rows += [r for d in item.attribute_docs for r in _rows(d, frozenset({"attributes"}))]
  params = _parameters(item)
  names = {p.name for p in params}
  variadic = {p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
  problems = [f"row {r!r} names more than one parameter" for r in rows
              if not _ROW_NAME.fullmatch(r)]
  single = [r.lstrip("*") for r in rows if _ROW_NAME.fullmatch(r)]
  problems += [f"row {r!r} repeated" for r in sorted(set(single)) if single.count(r) > 1]
  problems += [f"no Args row for {p!r}" for p in sorted(names - variadic - set(single))]
  problems += [f"row {r!r} is not a parameter" for r in sorted(set(single) - names)]
  return problems


def _all_items():
  return [(package, item) for package in PACKAGES for item in public_items(package)]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_parameter_has_its_own_args_row(package):
  bad = {item.name: args_problems(item) for item in public_items(package)}
  bad = {name: problems for name, problems in bad.items() if problems}
  assert not bad, "\n".join(f"{name}: {'; '.join(p)}" for name, p in sorted(bad.items()))


def test_the_dp_optimizer_page_has_a_row_for_every_dp_argument():
  """The user study's page: DPKerasSGDOptimizer's constructor (DPOptimizerBase.__init__)."""
  from tf_dpiter.keras.optimizer import optimizers  # pylint: disable=g-import-not-at-top
  rows = set(_rows(optimizers.DPOptimizerBase.__init__.__doc__))
  dp_args = [n for n in inspect.signature(optimizers.DPOptimizerBase.__init__).parameters
             if n not in ("self", "args", "kwargs")]
  assert len(dp_args) >= 17
  assert set(dp_args) <= rows, sorted(set(dp_args) - rows)
  assert _ROW_NAME.fullmatch("*args") and all(_ROW_NAME.fullmatch(r) for r in rows)
  assert {"noise_multiplier", "normalize", "seed"} <= rows


def test_the_checker_flags_what_the_reference_drops():
  """The check itself: a multi-name row, a missing row and a stray row are all reported."""
  def f(a, b, c=1, *args, **kwargs):  # pylint: disable=unused-argument
    """Doc.

    Args:
      a, b: two at once.
      d: not a parameter.
    """
  problems = args_problems(Item("f", f, (f.__doc__,), skip_first=False))
  assert "row 'a, b' names more than one parameter" in problems
  assert {"no Args row for 'a'", "no Args row for 'b'", "no Args row for 'c'"} <= set(problems)
  assert "row 'd' is not a parameter" in problems
  assert not any("'args'" in p or "'kwargs'" in p for p in problems)   # variadic: optional

  def g(a, *args, **kwargs):  # pylint: disable=unused-argument
    """Doc.

    Args:
      a: one.
      *args: positional.
      **kwargs: keywords.
    """
  assert args_problems(Item("g", g, (g.__doc__,), skip_first=False)) == []


# ---- Raises ------------------------------------------------------------------------------

def _raises_names(doc):
  return [p.annotation for s in _sections(doc) if s.kind.value == "raises" for p in s.value]


def _resolve(name, module):
  """The object `name` (dotted) denotes for code in `module`, or None."""
  head, *rest = str(name).strip().split(".")
  obj = getattr(module, head, None)
  if obj is None:
    obj = getattr(errors, head, getattr(builtins, head, None))
  for part in rest:
    obj = getattr(obj, part, None)
  return obj


def _own_raised_names(function):
  """Names of the classes the function's own body raises (`raise X(...)` / `raise X`)."""
  try:
    source = textwrap.dedent(inspect.getsource(function))
  except (OSError, TypeError):
    return set()
  tree = ast.parse(source)
  top = tree.body[0]
  names = set()

  def visit(node):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        continue
      if isinstance(child, ast.Raise) and child.exc is not None:
        exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
        names.add(ast.unparse(exc))
      visit(child)
  visit(top)
  return names


def raises_problems(item):
  module = inspect.getmodule(item.function)
  named = [n for d in item.docs for n in _raises_names(d)]
  problems = []
  resolved = set()
  for name in named:
    obj = _resolve(name, module)
    if not (inspect.isclass(obj) and issubclass(obj, BaseException)):
      problems.append(f"Raises names {name!r}, not an exception class")
    else:
      resolved.add(obj)
  for name in sorted(_own_raised_names(item.function)):
    obj = _resolve(name, module)
    if inspect.isclass(obj) and issubclass(obj, errors.DPiterError) and obj not in resolved:
      problems.append(f"raises {obj.__name__} but its Raises section does not name it")
  return problems


@pytest.mark.parametrize("package", PACKAGES)
def test_raises_entries_name_real_classes_and_the_library_classes_raised(package):
  bad = {item.name: raises_problems(item) for item in public_items(package)}
  bad = {name: problems for name, problems in bad.items() if problems}
  assert not bad, "\n".join(f"{name}: {'; '.join(p)}" for name, p in sorted(bad.items()))


def test_the_raises_checker_sees_a_missing_library_class():
  def f(x):
    """Doc.

    Args:
      x: a value.
    Raises:
      ValueError: never true here.
    """
    if x:
      raise errors.PrivacyConfigError(f"`x` ... Received: x={x!r}")
  problems = raises_problems(Item("f", f, (f.__doc__,), skip_first=False))
  assert problems == ["raises PrivacyConfigError but its Raises section does not name it"]


def test_no_raises_entry_in_the_package_names_a_plain_value_or_type_error():
  """The library raises its own family (tf_dpiter/errors.py), so no docstring of the package,
  public or not, says `ValueError:` / `TypeError:` in its Raises section."""
  import os  # pylint: disable=g-import-not-at-top
  import tf_dpiter  # pylint: disable=g-import-not-at-top
  assert _raises_names("Doc.\n\nRaises:\n  ValueError: x.\n") == ["ValueError"]   # the probe
  root = os.path.dirname(tf_dpiter.__file__)
  found = []
  for d, _, files in os.walk(root):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(d, name)
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
          names = _raises_names(ast.get_docstring(node, clean=False) or "")
          found += [f"{os.path.relpath(path, root)}:{getattr(node, 'name', '<module>')}: {n}"
                    for n in names if str(n).split(" ")[0] in ("ValueError", "TypeError")]
  assert not found, found

