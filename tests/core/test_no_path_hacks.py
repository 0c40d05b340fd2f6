"""Tests, benchmarks and tutorials import the package and their helpers: no `sys.path` edits.

Tests run from the repository root (`pytest`; `tests` is a package, so a helper is imported as
`tests.keras.dp_keras_helpers`), against the installed package (`pip install -e .`) or the
tree given by PYTHONPATH; a worker run as a subprocess gets the same PYTHONPATH from its
caller. Benchmarks are scripts (their own folder is on the path) or `python -m benchmarks.x`.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _path_edits(path):
  """Line numbers of `sys.path.<anything>(...)` calls and `sys.path = ...` assignments."""
  text = path.read_text(encoding="utf-8")
  if "sys" not in text or "path" not in text:   # the pattern below names both: nothing to parse
    return []
  tree = ast.parse(text, filename=str(path))
  out = []
  for node in ast.walk(tree):
    target = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      target = node.func.value
    elif isinstance(node, (ast.Assign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      target = next((t for t in targets if isinstance(t, ast.Attribute)), None)
    if (isinstance(target, ast.Attribute) and target.attr == "path"
        and isinstance(target.value, ast.Name) and target.value.id == "sys"):
      out.append(node.lineno)
  return out


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "tutorials"])
def test_no_sys_path_edits(folder):
  found = {}
  for path in sorted((REPO / folder).rglob("*.py")):
    lines = _path_edits(path)
    if lines:
      found[str(path.relative_to(REPO))] = lines
  assert not found, f"sys.path edits (import as a package instead): {found}"


def test_every_test_folder_is_a_package():
  folders = {p.parent for p in (REPO / "tests").rglob("test_*.py")} | {REPO / "tests"}
  missing = sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").exists())
  assert not missing, f"test folders without __init__.py: {missing}"
