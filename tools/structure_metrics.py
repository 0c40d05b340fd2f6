"""Structure figures of a tf_dpiter checkout: size, import cycles, layering, untested modules.

Prints, for the package tree under a repository root (the current checkout, or an older one
checked out in a git worktree):

* total lines of the package's Python files;
* import cycles among tf_dpiter modules: the strongly connected components of size > 1 of the
  import graph, where an edge a -> b is any `import b` / `from b import ...` in module a, at
  module level or inside a function or class body (a deferred import still makes a depend on
  b), and `importlib.import_module("b")` / `LazyModule("b")` with a literal name;
* the keras sub-package pairs (tf_dpiter/keras/<x>/, one directory each) that import each
  other both ways;
* the imports from tf_dpiter.ledger to tf_dpiter.accounting and to dp_accounting (the ledger
  is the lower layer);
* the modules no test file imports directly, and those no test reaches at all: not through
  the modules a test file imports, their imports in turn, or a lazy table of theirs (a string
  literal naming a module, as `tf_dpiter.dp_query`'s `__getattr__` table).

`from p import x` is an edge to p.x when p.x is a module of the tree, else to p (a name
defined in p). Parent packages are not counted as imported (`import a.b` is an edge to a.b
only), as import-linter and pydeps count them.

Usage (from the repository root):
  python tools/structure_metrics.py [ROOT]        # ROOT holds tf_dpiter/ and tests/ (default .)
  python tools/structure_metrics.py ROOT --json   # the same figures as one JSON object
"""

import argparse
import ast
import json
import pathlib
import sys

PACKAGE = "tf_dpiter"


def module_name(root, path):
  """The dotted module name of a file under `root` (a package's __init__ is the package).

  Args:
    root: the repository root (pathlib.Path).
    path: a .py file below it (pathlib.Path).
  Returns:
    a str, e.g. "tf_dpiter.ledger.records" or "tf_dpiter.ledger".
  """
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _literal_import_calls(tree):
  """Module names passed as a literal to importlib.import_module(...) or LazyModule(...)."""
  names = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call) or not node.args:
      continue
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    arg = node.args[0]
    if called in ("import_module", "LazyModule") and isinstance(arg, ast.Constant) and isinstance(
        arg.value, str):
      names.append(arg.value)
  # the values of a dict literal assigned to a name ending in _LAZY (lazy re-exports)
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
        isinstance(t, ast.Name) and t.id.endswith("_LAZY") for t in node.targets):
      names += [v.value for v in node.value.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)]
  return names


def imported_names(tree, this_module, is_package):
  """Every module name a file imports (all levels of the file, relative names resolved).

  Args:
    tree: the file's ast.
    this_module: its dotted name.
    is_package: whether the file is a package's __init__.py.
  Returns:
    a list of (target, imported_attr_or_None) pairs: for `from p import x`, (p, x).
  """
  out = []
  base = this_module.split(".") if is_package else this_module.split(".")[:-1]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        stem = base[:len(base) - (node.level - 1)]
        mod = ".".join(stem + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      out += [(mod, a.name) for a in node.names]
  out += [(name, None) for name in _literal_import_calls(tree)]
  return out


def import_graph(root, files):
  """The import graph among the given files' modules, plus each module's external imports.

  Args:
    root: the repository root.
    files: the .py files (pathlib.Path) whose modules are the graph's nodes.
  Returns:
    (edges, external): edges {module: set of modules of the tree}; external {module: set of
    top-level names of other packages it imports}.
  """
  modules = {module_name(root, f): f for f in files}
  edges, external = {}, {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets, others = set(), set()
    for mod, attr in imported_names(tree, name, path.name == "__init__.py"):
      if attr is not None and f"{mod}.{attr}" in modules:
        targets.add(f"{mod}.{attr}")
      elif mod in modules:
        targets.add(mod)
      elif mod:
        others.add(mod)
    targets.discard(name)
    edges[name], external[name] = targets, others
  return edges, external


def strongly_connected(edges):
  """Tarjan's strongly connected components of a graph (iterative).

  Args:
    edges: {node: iterable of nodes}.
  Returns:
    a list of components (sorted lists of nodes).
  """
  index, low, on_stack, stack, comps = {}, {}, set(), [], []
  counter = [0]
  for start in sorted(edges):
    if start in index:
      continue
    work = [(start, iter(sorted(edges.get(start, ()))))]
    index[start] = low[start] = counter[0]
    counter[0] += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, it = work[-1]
      advanced = False
      for nxt in it:
        if nxt not in index:
          index[nxt] = low[nxt] = counter[0]
          counter[0] += 1
          stack.append(nxt)
          on_stack.add(nxt)
          work.append((nxt, iter(sorted(edges.get(nxt, ())))))
          advanced = True
          break
        if nxt in on_stack:
          low[node] = min(low[node], index[nxt])
      if advanced:
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        comp = []
        while True:
          top = stack.pop()
          on_stack.discard(top)
          comp.append(top)
          if top == node:
            break
        comps.append(sorted(comp))
  return comps


def keras_two_way_pairs(edges, root):
  """Pairs of keras sub-packages (directories under tf_dpiter/keras) importing each other.

  Args:
    edges: the import graph.
    root: the repository root.
  Returns:
    a sorted list of (a, b) sub-package names, a < b.
  """
  keras = root / PACKAGE / "keras"
  subs = sorted(p.name for p in keras.iterdir() if p.is_dir() and (p / "__init__.py").exists())

  def sub_of(module):
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == [PACKAGE, "keras"] and parts[2] in subs:
      return parts[2]
    return None

  directed = set()
  for a, targets in edges.items():
    for b in targets:
      sa, sb = sub_of(a), sub_of(b)
      if sa and sb and sa != sb:
        directed.add((sa, sb))
  return sorted((a, b) for a, b in directed if a < b and (b, a) in directed)


def test_imported_modules(root, modules):
  """The package modules some file under tests/ imports directly.

  Args:
    root: the repository root.
    modules: the package's module names.
  Returns:
    a set of module names.
  """
  seen = set()
  names = set(modules)
  for path in sorted((root / "tests").rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for mod, attr in imported_names(tree, module_name(root, path), path.name == "__init__.py"):
      if attr is not None and f"{mod}.{attr}" in names:
        seen.add(f"{mod}.{attr}")
      if mod in names:
        seen.add(mod)
  return seen


def lazy_table_edges(root, files, names):
  """{module: the package modules it names in a string literal} (lazy import tables).

  Args:
    root: the repository root.
    files: the package's Python files.
    names: the package's module names.
  Returns:
    a dict of module name -> set of module names (files under tests/ included: a test may
    import the modules of a list by name).
  """
  out = {}
  for path in files:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    this = module_name(root, path)
    strings = {n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    # a package's __getattr__ table may name its children by their short names
    children = {f"{this}.{v}" for v in strings} if path.name == "__init__.py" else set()
    out[this] = (strings | children) & names
  return out


def reached_modules(edges, lazy, tested):
  """The modules reached from `tested` over import edges and lazy-table names.

  Args:
    edges: {module: modules it imports} (import_graph).
    lazy: {module: modules its string literals name} (lazy_table_edges).
    tested: the modules test files import directly.
  Returns:
    a set of module names.
  """
  seen, stack = set(), list(tested)
  while stack:
    m = stack.pop()
    if m not in seen:
      seen.add(m)
      stack += list(edges.get(m, ())) + list(lazy.get(m, ()))
  return seen


def measure(root):
  """All figures of the checkout at `root` (see the module docstring).

  Args:
    root: the repository root (pathlib.Path) holding tf_dpiter/ and tests/.
  Returns:
    a dict of the figures.
  """
  files = sorted((root / PACKAGE).rglob("*.py"))
  lines = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)
  edges, external = import_graph(root, files)
  cycles = [c for c in strongly_connected(edges) if len(c) > 1]
  ledger = [m for m in edges if m == f"{PACKAGE}.ledger" or m.startswith(f"{PACKAGE}.ledger.")]
  to_accounting = sorted(
      f"{a} -> {b}" for a in ledger for b in edges[a]
      if b == f"{PACKAGE}.accounting" or b.startswith(f"{PACKAGE}.accounting."))
  to_dpa = sorted(f"{a} -> {b}" for a in ledger for b in external[a]
                  if b.split(".")[0] == "dp_accounting")
  tested = test_imported_modules(root, edges)
  untested = sorted(m for m in edges if m not in tested
                    and not m.endswith("__main__"))
  test_strings = lazy_table_edges(root, sorted((root / "tests").rglob("*.py")), set(edges))
  seeds = tested.union(*test_strings.values())
  reached = reached_modules(edges, lazy_table_edges(root, files, set(edges)), seeds)
  unreached = sorted(m for m in edges if m not in reached and not m.endswith("__main__"))
  pairs = keras_two_way_pairs(edges, root)
  return {
      "root": str(root),
      "package_files": len(files),
      "package_lines": lines,
      "import_cycles": len(cycles),
      "modules_in_cycles": sum(len(c) for c in cycles),
      "cycles": cycles,
      "keras_two_way_pairs": len(pairs),
      "keras_pairs": [list(p) for p in pairs],
      "ledger_to_accounting_imports": len(to_accounting),
      "ledger_to_accounting": to_accounting,
      "ledger_to_dp_accounting_imports": len(to_dpa),
      "ledger_to_dp_accounting": to_dpa,
      "modules_not_imported_by_tests": len(untested),
      "untested_modules": untested,
      "modules_not_reached_by_tests": len(unreached),
      "unreached_modules": unreached,
  }


def main(argv=None):
  """Prints the figures of the checkout named on the command line.

  Args:
    argv: the arguments (default sys.argv[1:]).
  Returns:
    0.
  """
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("root", nargs="?", default=".",
                      help="repository root holding tf_dpiter/ and tests/ (default .)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root).resolve()
  if root.name == PACKAGE:
    root = root.parent
  if not (root / PACKAGE).is_dir():
    parser.error(f"`root` must hold a {PACKAGE}/ directory. Received: root={args.root!r}")
  m = measure(root)
  if args.json:
    print(json.dumps(m, indent=1))
    return 0
  print(f"root: {m['root']}")
  print(f"package: {m['package_files']} files, {m['package_lines']} lines")
  print(f"import cycles (SCCs of size > 1, module- and function-level imports): "
        f"{m['import_cycles']} ({m['modules_in_cycles']} modules)")
  for c in m["cycles"]:
    print(f"  [{len(c)}] " + ", ".join(c))
  print(f"two-way keras sub-package pairs: {m['keras_two_way_pairs']}")
  for a, b in m["keras_pairs"]:
    print(f"  {a} <-> {b}")
  print(f"imports tf_dpiter.ledger -> tf_dpiter.accounting: {m['ledger_to_accounting_imports']}")
  for e in m["ledger_to_accounting"]:
    print(f"  {e}")
  print(f"imports tf_dpiter.ledger -> dp_accounting: {m['ledger_to_dp_accounting_imports']}")
  for e in m["ledger_to_dp_accounting"]:
    print(f"  {e}")
  print(f"modules not imported by any test file: {m['modules_not_imported_by_tests']}")
  for u in m["untested_modules"]:
    print(f"  {u}")
  print(f"modules no test reaches (imports, transitively, and lazy tables): "
        f"{m['modules_not_reached_by_tests']}")
  for u in m["unreached_modules"]:
    print(f"  {u}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
