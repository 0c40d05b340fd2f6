"""The Bazel BUILD file is true: every package module is in `//:tf_dpiter`, every console script
of pyproject.toml has a py_binary whose main calls the same function, every test file has a
py_test, and the workspace needs no download (native rules and the offline stubs of
third_party/). The queries need Bazel (Debian: `apt-get install bazel-bootstrap`); the static
checks run without it."""

import os
import re
import shutil
import subprocess
import tomllib

import pytest

from . import docs_support as S

BAZEL = shutil.which("bazel")


def _text(name):
  return S.read(os.path.join(S.REPO_ROOT, name))


def _query(expr, *flags):
  proc = subprocess.run([BAZEL, "--batch", "query", *flags, expr], cwd=S.REPO_ROOT,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return {l.strip() for l in proc.stdout.splitlines() if l.strip()}


def _files(top, pattern):
  root = os.path.join(S.REPO_ROOT, top)
  return {os.path.relpath(os.path.join(d, f), S.REPO_ROOT).replace(os.sep, "/")
          for d, _, fs in os.walk(root) for f in fs if re.fullmatch(pattern, f)}


def test_workspace_downloads_nothing():
  build, workspace = _text("BUILD"), _text("WORKSPACE")
  assert "load(" not in build, "native rules only: a load() would fetch a rules repository"
  assert "http_archive" not in workspace and "git_repository" not in workspace
  for path in re.findall(r'path = "([^"]+)"', workspace):
    assert os.path.exists(os.path.join(S.REPO_ROOT, path, "WORKSPACE")), path
  # The README's commands put the venv in the checkout: TensorFlow's headers there carry BUILD
  # files that `//...` must not load.
  assert ".venv" in _text(".bazelignore").split()


def test_every_console_script_has_a_binary_calling_the_same_function():
  scripts = tomllib.loads(_text("pyproject.toml"))["project"]["scripts"]
  build = _text("BUILD")
  for script, target in scripts.items():
    name = script.replace("-", "_")
    assert f'"{name}",' in build, f"no py_binary for {script}"
    module, func = target.split(":")
    shim = _text(f"tools/entry_points/{name}.py")
    assert f"from {module} import {func}" in shim and f"sys.exit({func}())" in shim, name


@pytest.mark.skipif(BAZEL is None, reason="bazel not installed: apt-get install bazel-bootstrap")
def test_bazel_targets_cover_every_module_script_and_test():
  # one query (one Bazel start): the library's sources and every py_test and py_binary rule,
  # each line "<kind> //:<name>" ("source file", "py_test rule", "py_binary rule")
  by_kind = {}
  for line in _query('labels(srcs, //:tf_dpiter) + kind("py_(test|binary)", //...)',
                     "--output=label_kind"):
    kind, label = line.rsplit(" ", 1)
    by_kind.setdefault(kind, set()).add(label[len("//:"):])
  assert set(by_kind) == {"source file", "py_test rule", "py_binary rule"}, set(by_kind)
  srcs = by_kind["source file"]
  assert srcs == _files("tf_dpiter", r".*\.py"), "modules missing from //:tf_dpiter"
  tests = by_kind["py_test rule"]
  expected = {f[len("tests/"):-len(".py")].replace("/", "_")
              for f in _files("tests", r"test_.*\.py")}
  assert tests == expected
  binaries = by_kind["py_binary rule"]
  scripts = tomllib.loads(_text("pyproject.toml"))["project"]["scripts"]
  assert {s.replace("-", "_") for s in scripts} | {"mnist_dpsgd_keras"} == binaries
