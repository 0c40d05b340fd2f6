"""The package's lines at a git revision split by kind: code, docstrings, comments, blank lines.

Issue 41 measures the package in lines (`tools/package_lines.py`); this tool says what kind of
line the growth is. Each Python file under tf_dpiter/ is read with `git show REV:path`
(nothing is checked out). A line is a docstring line when it lies within the first statement
of a module, class or function body that is a string constant (found with `ast`); otherwise
it is blank when empty after stripping, a comment when it starts with `#`, and code else.
The four counts add up to `len(text.splitlines())` summed over the files, the count
`tools/structure_metrics.py` and `tools/package_lines.py` use.

Usage (from the repository root):
  python tools/line_kinds.py [REV ...]        (default: HEAD)
"""

import ast
import subprocess
import sys

KINDS = ("code", "docstring", "comment", "blank")


def _git(*args):
  return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def line_kinds(source):
  """{kind: lines} of one Python source text (module docstring)."""
  lines = source.splitlines()
  kind = ["code"] * len(lines)
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0] if node.body else None
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        kind[first.lineno - 1:first.end_lineno] = ["docstring"] * (first.end_lineno
                                                                    - first.lineno + 1)
  for i, line in enumerate(lines):
    if kind[i] == "code":
      text = line.strip()
      kind[i] = "blank" if not text else "comment" if text.startswith("#") else "code"
  return {k: kind.count(k) for k in KINDS}


def package_line_kinds(rev):
  """{kind: lines} of every tf_dpiter/*.py file at git revision `rev`."""
  total = dict.fromkeys(KINDS, 0)
  for path in _git("ls-tree", "-r", "--name-only", rev, "tf_dpiter").split():
    if path.endswith(".py"):
      for k, n in line_kinds(_git("show", f"{rev}:{path}")).items():
        total[k] += n
  return total


def main(argv):
  for rev in argv or ["HEAD"]:
    counts = package_line_kinds(rev)
    print(rev, " ".join(f"{k} {n:,}" for k, n in counts.items()),
          f"total {sum(counts.values()):,}")


if __name__ == "__main__":
  main(sys.argv[1:])
