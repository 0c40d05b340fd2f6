"""tools/package_lines.py: the package's lines at two revisions of a tiny git repository,
split into files added for a feature, files added to restructure, and unclassified files."""

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
  spec = importlib.util.spec_from_file_location("package_lines",
                                                ROOT / "tools" / "package_lines.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _git(repo, *args):
  return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                        text=True).stdout.strip()


def _commit(repo, files, message):
  """Writes {path: text} (None deletes the file), commits, returns the commit hash."""
  for rel, text in files.items():
    path = repo / rel
    if text is None:
      path.unlink()
      continue
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  _git(repo, "add", "-A", ".")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
  return _git(repo, "rev-parse", "HEAD")


def _lines(text):
  return len(text.splitlines())


def _repo(tmp_path):
  _git(tmp_path, "init", "-q")
  return tmp_path


def test_growth_splits_into_feature_restructure_and_unclassified(tmp_path):
  tool = _tool()
  repo = _repo(tmp_path)
  core = "".join(f"def f{i}():\n  return {i}\n" for i in range(12))
  helper = "x = 1\ny = 2\n"
  base = _commit(repo, {"tf_dpiter/__init__.py": "", "tf_dpiter/core.py": core,
                        "tf_dpiter/helper.py": helper, "README.md": "not counted\n" * 50},
                 "base")
  feature = "def new_feature():\n  return 1\n\n\ndef more():\n  return 2\n"
  moved = "def g():\n  return 3\n"
  core_now = core + "\n# grew inside an existing file\n"
  extra = "z = 3\n"
  now = _commit(repo, {"tf_dpiter/feature.py": feature, "tf_dpiter/sub/moved.py": moved,
                       "tf_dpiter/extra.py": extra, "tf_dpiter/core.py": core_now,
                       "tf_dpiter/helper.py": None, "tf_dpiter/notes.txt": "a\nb\n"}, "now")
  m = tool.measure(repo, base, now, features={"tf_dpiter/feature.py": (now, "a feature")},
                   structure={"tf_dpiter/sub/moved.py": (now, "moved")})
  base_lines = _lines(core) + _lines(helper)
  now_lines = _lines(feature) + _lines(moved) + _lines(extra) + _lines(core_now)
  assert (m["base_lines"], m["base_files"]) == (base_lines, 3)
  assert (m["now_lines"], m["now_files"]) == (now_lines, 5)
  assert m["feature_files"] == {"tf_dpiter/feature.py": _lines(feature)}
  assert m["structure_files"] == {"tf_dpiter/sub/moved.py": _lines(moved)}
  assert m["unclassified_files"] == {"tf_dpiter/extra.py": _lines(extra)}
  assert m["feature_lines"] == _lines(feature)
  assert m["equal_feature_lines"] == now_lines - _lines(feature)
  assert m["other_growth"] == m["equal_feature_lines"] - base_lines
  assert abs(m["change"] - (now_lines - _lines(feature) - base_lines) / base_lines) < 1e-12


def test_a_renamed_file_is_not_added(tmp_path):
  tool = _tool()
  repo = _repo(tmp_path)
  body = "".join(f"value_{i} = {i}\n" for i in range(30))
  base = _commit(repo, {"tf_dpiter/__init__.py": "", "tf_dpiter/old_place.py": body}, "base")
  now = _commit(repo, {"tf_dpiter/old_place.py": None, "tf_dpiter/pkg/new_place.py": body},
                "move")
  assert tool.added_files(repo, base, now) == []
  m = tool.measure(repo, base, now, features={"tf_dpiter/pkg/new_place.py": (now, "x")},
                   structure={})
  assert m["feature_lines"] == 0 and m["equal_feature_lines"] == m["base_lines"]
  assert m["not_added"] == ["tf_dpiter/pkg/new_place.py"]


def test_main_prints_the_figures(tmp_path, capsys):
  tool = _tool()
  repo = _repo(tmp_path)
  base = _commit(repo, {"tf_dpiter/__init__.py": "a = 1\n"}, "base")
  now = _commit(repo, {"tf_dpiter/b.py": "b = 2\nc = 3\n"}, "now")
  assert tool.main(["--repo", str(repo), "--base", base, "--now", now]) == 0
  out = capsys.readouterr().out
  assert "lines at equal features: 3 against 1" in out
  assert "tf_dpiter/b.py  (unclassified" in out


def test_the_tables_name_files_this_checkout_added_since_the_base():
  """Every file of the tables exists at HEAD (a table entry cannot outlive its file)."""
  tool = _tool()
  have = set(_git(ROOT, "ls-tree", "-r", "--name-only", "HEAD", "--", "tf_dpiter").split("\n"))
  named = set(tool.FEATURE_FILES) | set(tool.STRUCTURE_FILES)
  assert named <= have, sorted(named - have)
  assert not set(tool.FEATURE_FILES) & set(tool.STRUCTURE_FILES)
