"""tools/structure_metrics.py: import cycles (module- and function-level), two-way keras
sub-package pairs, ledger -> accounting imports; and the figures of this checkout."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
  spec = importlib.util.spec_from_file_location("structure_metrics",
                                                ROOT / "tools" / "structure_metrics.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write(root, rel, text):
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_a_small_tree_gives_its_known_figures(tmp_path):
  for pkg in ("tf_dpiter", "tf_dpiter/ledger", "tf_dpiter/accounting", "tf_dpiter/keras",
              "tf_dpiter/keras/model", "tf_dpiter/keras/optimizer", "tests"):
    _write(tmp_path, f"{pkg}/__init__.py", "")
  # a cycle through a function-level import only
  _write(tmp_path, "tf_dpiter/a.py", "from tf_dpiter import b\n")
  _write(tmp_path, "tf_dpiter/b.py", "def f():\n  from tf_dpiter import a\n  return a\n")
  # the ledger importing accounting and dp_accounting (lazily)
  _write(tmp_path, "tf_dpiter/ledger/rows.py",
         "from tf_dpiter.accounting import events\nx = LazyModule('dp_accounting')\n")
  _write(tmp_path, "tf_dpiter/accounting/events.py", "import math\n")
  # two keras sub-packages importing each other (no module cycle)
  _write(tmp_path, "tf_dpiter/keras/model/m1.py", "from tf_dpiter.keras.optimizer import o1\n")
  _write(tmp_path, "tf_dpiter/keras/model/m2.py", "x = 1\n")
  _write(tmp_path, "tf_dpiter/keras/optimizer/o1.py", "import math\n")
  _write(tmp_path, "tf_dpiter/keras/optimizer/o2.py",
         "from tf_dpiter.keras.model import m2\n")
  _write(tmp_path, "tests/test_a.py", "from tf_dpiter import a\nimport tf_dpiter.ledger.rows\n")
  m = _tool().measure(tmp_path)
  assert m["import_cycles"] == 1 and m["cycles"] == [["tf_dpiter.a", "tf_dpiter.b"]]
  assert m["keras_pairs"] == [["model", "optimizer"]]
  assert m["ledger_to_accounting"] == ["tf_dpiter.ledger.rows -> tf_dpiter.accounting.events"]
  assert m["ledger_to_dp_accounting_imports"] == 1
  assert "tf_dpiter.a" not in m["untested_modules"] and "tf_dpiter.b" in m["untested_modules"]
  # b is reached through a, accounting.events through ledger.rows; the keras modules and the
  # empty package modules through nothing
  assert m["unreached_modules"] == [
      "tf_dpiter.accounting", "tf_dpiter.keras", "tf_dpiter.keras.model", "tf_dpiter.keras.model.m1",
      "tf_dpiter.keras.model.m2", "tf_dpiter.keras.optimizer", "tf_dpiter.keras.optimizer.o1",
      "tf_dpiter.keras.optimizer.o2", "tf_dpiter.ledger"]
  assert m["package_lines"] == sum(
      len(p.read_text().splitlines()) for p in (tmp_path / "tf_dpiter").rglob("*.py"))


def test_this_checkout_keeps_its_layering():
  m = _tool().measure(ROOT)
  assert m["ledger_to_accounting_imports"] == 0 and m["ledger_to_dp_accounting_imports"] == 0
  assert m["keras_two_way_pairs"] == 0, m["keras_pairs"]
  assert m["cycles"] == [], m["cycles"]   # none, function-level imports included
  assert m["unreached_modules"] == [], m["unreached_modules"]   # every module some test reaches
