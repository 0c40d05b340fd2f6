"""files.replaced: the path holds the old file or the new one, never a part of either."""

import os
import signal
import subprocess
import sys

import pytest

from tf_dpiter import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, data):
  with open(path, "wb") as f:
    f.write(data)


def _read(path):
  with open(path, "rb") as f:
    return f.read()


def test_the_new_file_replaces_the_old_one_and_no_temporary_file_stays(tmp_path):
  path = tmp_path / "state.keras"
  _write(path, b"old")
  with files.replaced(path, ".keras") as tmp:
    assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".keras")
    assert _read(path) == b"old"          # untouched while the new file is written
    _write(tmp, b"new")
  assert _read(path) == b"new"
  assert os.listdir(tmp_path) == ["state.keras"]


def test_an_error_while_writing_leaves_the_old_file_and_removes_the_temporary_one(tmp_path):
  path = tmp_path / "state.json"
  _write(path, b"old")
  with pytest.raises(RuntimeError, match="disk full"):
    with files.replaced(path) as tmp:
      _write(tmp, b"ne")
      raise RuntimeError("disk full")
  assert _read(path) == b"old"
  assert os.listdir(tmp_path) == ["state.json"]


def test_a_process_killed_while_writing_leaves_the_old_file(tmp_path):
  path = tmp_path / "state.bin"
  _write(path, b"old" * 1000)
  code = ("import os, signal, sys; from tf_dpiter import files\n"
          "with files.replaced(sys.argv[1]) as tmp:\n"
          "  f = open(tmp, 'wb'); f.write(b'half'); f.flush()\n"
          "  os.kill(os.getpid(), signal.SIGKILL)\n")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=ROOT,
                       capture_output=True, timeout=120, check=False)
  assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
  assert _read(path) == b"old" * 1000
  left = [n for n in os.listdir(tmp_path) if n != "state.bin"]
  assert len(left) == 1 and left[0].startswith(".state.bin.")   # hidden, beside it


@pytest.mark.parametrize("path,local", [
    ("model.keras", True), ("/tmp/a/model.keras", True), ("gs://bucket/model.keras", False),
    ("hf://user/model", False), ("/gcs/bucket/model.keras", False), (None, False),
    (3, False)])
def test_is_local_file_path(path, local):
  assert files.is_local_file_path(path) is local
