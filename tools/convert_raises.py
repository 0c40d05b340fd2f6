"""Converts plain `raise ValueError(...)` / `raise TypeError(...)` to the tf_dpiter.errors family.

A mechanical rewrite, message text unchanged:

* `raise TypeError(...)`  -> `raise ParameterTypeError(...)` (a TypeError, also a ValueError);
* `raise ValueError(...)` -> `raise BudgetConfigError(...)` when the message's literal text
  names a budget (target_epsilon, target_delta, budget), else `raise PrivacyConfigError(...)`
  when it names a privacy parameter (clip, noise, epsilon, delta, sampling, microbatch,
  neighbouring relation, ...), else `raise ParameterValueError(...)`. All three subclass
  ValueError, so every `except ValueError` keeps catching them;
* `from tf_dpiter.dp_query import validation` -> `from tf_dpiter import validation`;
* the `from tf_dpiter.errors import <Name>` lines the module now needs are inserted among its
  tf_dpiter imports, one per line, in sorted position.

Raises whose message carries no interpolated value (no `{...}`, no "got"/"Received") are
listed on stderr: their parameter name and value must be added by hand.

Usage (from the repository root):
  python tools/convert_raises.py tf_dpiter/keras            # rewrite in place
  python tools/convert_raises.py --check tf_dpiter/keras    # list only, exit 1 if any left
Paths may be files or directories (every *.py below them). tf_dpiter/errors.py and
tf_dpiter/validation.py are never touched.
"""

import argparse
import ast
import pathlib
import re
import sys

SKIP = ("tf_dpiter/errors.py", "tf_dpiter/validation.py")
BUDGET = re.compile(r"target_epsilon|target_delta|\bbudget", re.I)
PRIVACY = re.compile(
    r"clip|noise|sigma|stddev|epsilon|\bdelta|sampl|probabilit|microbatch|neighbo|relation|"
    r"participation|sensitivity|privacy|private|accountant|\bpolicy|noise_multiplier", re.I)
OLD_VALIDATION = "from tf_dpiter.dp_query import validation"
NEW_VALIDATION = "from tf_dpiter import validation"


def _literal_text(call):
  """The literal string parts of the call's arguments (f-string constants included)."""
  parts = []
  for node in call.args:
    for sub in ast.walk(node):
      if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
        parts.append(sub.value)
  return " ".join(parts)


def _has_value(call):
  """Whether the message interpolates something or says what it got."""
  if not call.args:
    return False
  text = _literal_text(call)
  interpolated = any(isinstance(n, (ast.FormattedValue, ast.Name, ast.Call, ast.BinOp))
                     for arg in call.args for n in ast.walk(arg))
  return interpolated or "got" in text or "Received" in text


def family(builtin, call):
  """The tf_dpiter.errors class replacing `builtin` ("ValueError"/"TypeError") for `call`."""
  if builtin == "TypeError":
    return "ParameterTypeError"
  text = _literal_text(call)
  if BUDGET.search(text):
    return "BudgetConfigError"
  if PRIVACY.search(text):
    return "PrivacyConfigError"
  return "ParameterValueError"


def plain_raises(tree):
  """(raise node, call node, builtin name) for every `raise ValueError(...)`/`TypeError(...)`."""
  out = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id in ("ValueError", "TypeError")):
      out.append((node, node.exc, node.exc.func.id))
  return out


def _imported_errors(tree):
  """{class name: local name} of the top-level imports from tf_dpiter.errors."""
  names = {}
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module == "tf_dpiter.errors":
      names.update({a.name: a.asname or a.name for a in node.names})
  return names


def _realign(lines, call, paren_col, delta):
  """Shifts by `delta` the call's continuation lines that were aligned under its "(" + 1."""
  for j in range(call.lineno, call.end_lineno):
    line = lines[j]
    indent = len(line) - len(line.lstrip(" "))
    if indent == paren_col and line.strip():
      lines[j] = " " * (indent + delta) + line.lstrip(" ")


def _insert_imports(lines, tree, needed):
  """Inserts the import lines `needed` among the module's tf_dpiter imports (sorted)."""
  new = sorted(needed)
  imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  ours = [n for n in imports if isinstance(n, ast.ImportFrom) and n.module
          and n.module.startswith("tf_dpiter") and n.lineno == n.end_lineno]
  for line in new:
    after = [n for n in ours if lines[n.lineno - 1] < line]
    if ours:
      anchor = max(after, key=lambda n: n.lineno).end_lineno if after else ours[0].lineno - 1
    elif imports:
      anchor = max(n.end_lineno for n in imports)
      if not lines[anchor - 1].startswith("from tf_dpiter"):
        line = "\n" + line
    else:
      doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(
          getattr(tree.body[0], "value", None), ast.Constant) else None
      anchor = doc.end_lineno if doc else 0
      line = "\n" + line
    lines.insert(anchor, line)
    tree = ast.parse("".join(lines))
    ours = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("tf_dpiter") and n.lineno == n.end_lineno]
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  return lines


def convert_file(path, write=True):
  """Converts one module. Returns (number converted, [(line, message) needing a value])."""
  source = path.read_text()
  tree = ast.parse(source)
  raises = plain_raises(tree)
  missing = [(r.lineno, _literal_text(c)[:70]) for r, c, _ in raises if not _has_value(c)]
  if not raises and OLD_VALIDATION not in source:
    return 0, missing
  lines = source.splitlines(keepends=True)
  local = _imported_errors(tree)
  private = path.name == "__init__.py"  # a package's namespace: import as _Name
  needed = set()
  for _, call, builtin in sorted(raises, key=lambda t: (-t[1].func.lineno, -t[1].func.col_offset)):
    cls = family(builtin, call)
    if cls not in local:
      local[cls] = "_" + cls if private else cls
      alias = f" as {local[cls]}" if private else ""
      needed.add(f"from tf_dpiter.errors import {cls}{alias}\n")
    new = local[cls]
    i, col = call.func.lineno - 1, call.func.col_offset
    assert lines[i][col:col + len(builtin)] == builtin, (path, i + 1)
    lines[i] = lines[i][:col] + new + lines[i][col + len(builtin):]
    _realign(lines, call, col + len(builtin) + 1, len(new) - len(builtin))
  if any(l.rstrip("\n") == OLD_VALIDATION for l in lines):
    lines = [l for l in lines if l.rstrip("\n") != OLD_VALIDATION]
    needed.add(NEW_VALIDATION + "\n")
  if needed:
    lines = _insert_imports(lines, ast.parse("".join(lines)), needed)
  text = "".join(lines)
  ast.parse(text)  # still valid Python
  if write:
    path.write_text(text)
  return len(raises), missing


def _files(paths):
  for p in map(pathlib.Path, paths):
    for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
      if not any(f.as_posix().endswith(s) for s in SKIP):
        yield f


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("paths", nargs="+", help="files or directories to convert")
  parser.add_argument("--check", action="store_true", help="list only; exit 1 if any is left")
  args = parser.parse_args(argv)
  total = 0
  for f in _files(args.paths):
    n, missing = convert_file(f, write=not args.check)
    total += n
    if n:
      print(f"{f}: {n} raise(s) {'to convert' if args.check else 'converted'}")
    for line, text in missing:
      print(f"{f}:{line}: message names no value: {text!r}", file=sys.stderr)
  print(f"total: {total}")
  return 1 if args.check and total else 0


if __name__ == "__main__":
  sys.exit(main())
