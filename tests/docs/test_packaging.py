"""Packaging: one version source, a dependency declared only where it is imported, extras."""

import ast
import os
import re
import subprocess
import sys

import tf_dpiter
from . import docs_support as S

if sys.version_info >= (3, 11):
  import tomllib  # pylint: disable=g-import-not-at-top

# Import name of each distribution we may declare.
_IMPORT_NAME = {"tensorflow": "tensorflow", "keras": "keras", "dp-accounting": "dp_accounting",
                "numpy": "numpy", "scipy": "scipy", "absl-py": "absl", "aiohttp": "aiohttp",
                "redis": "redis", "flwr": "flwr", "matplotlib": "matplotlib",
                "tensorflow-probability": "tensorflow_probability", "tf-keras": "tf_keras"}


def _pyproject():
  with open(os.path.join(S.REPO_ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _dist(requirement):
  return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip()


def _imports_of_package():
  """Top-level module names imported anywhere in tf_dpiter (lazy imports included)."""
  names = set()
  root = os.path.dirname(tf_dpiter.__file__)
  for d, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        with open(os.path.join(d, f), encoding="utf-8") as fh:
          tree = ast.parse(fh.read())
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
          elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
  return names


def test_one_version_source():
  project = _pyproject()
  assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tf_dpiter.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", tf_dpiter.__version__)


def test_setup_py_defers_to_pyproject():
  """The top-level setup.py calls setuptools' setup() with no argument (pyproject.toml is the
  one metadata source), and `python setup.py --version` is tf_dpiter.__version__."""
  path = os.path.join(S.REPO_ROOT, "setup.py")
  calls = [node for node in ast.walk(ast.parse(S.read(path)))
           if isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                     getattr(node.func, "id", None)) == "setup"]
  assert len(calls) == 1 and not calls[0].args and not calls[0].keywords
  out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=S.REPO_ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == tf_dpiter.__version__


def test_every_dependency_is_imported_by_the_package():
  project = _pyproject()["project"]
  imported = _imports_of_package()
  declared = [_dist(r) for r in project["dependencies"]]
  for extra, reqs in project["optional-dependencies"].items():
    if extra in ("service", "federated", "flower", "plot", "auditing"):
      declared += [_dist(r) for r in reqs]
  unused = [d for d in declared if _IMPORT_NAME.get(d, d) not in imported]
  assert not unused, f"declared but imported nowhere in tf_dpiter: {unused}"


def test_service_and_federated_deps_are_extras_not_core():
  project = _pyproject()["project"]
  core = {_dist(r) for r in project["dependencies"]}
  assert not core & {"aiohttp", "redis", "flwr", "matplotlib", "tensorflow-probability",
                     "tf-keras"}
  extras = project["optional-dependencies"]
  assert {_dist(r) for r in extras["service"]} == {"aiohttp", "redis"}
  assert {_dist(r) for r in extras["federated"]} == {"flwr"}
  assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= {_dist(r) for r in extras["docs"]}
  test = " ".join(extras["test"])
  assert "pytest" in test and all(x in test for x in ("service", "federated", "docs"))


def test_console_scripts_point_at_callables():
  import importlib  # pylint: disable=g-import-not-at-top
  for name, target in _pyproject()["project"]["scripts"].items():
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func)), name


def test_license_and_changelog():
  text = S.read(os.path.join(S.REPO_ROOT, "LICENSE"))
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert _pyproject()["project"]["license"] == "Apache-2.0"
  assert "## Unreleased" in S.read(os.path.join(S.REPO_ROOT, "CHANGELOG.md"))
