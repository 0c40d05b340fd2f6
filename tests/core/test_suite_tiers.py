"""tools/suite_tiers.py: a `SLOW_CASES` id that names no case of its module is reported;
tests/conftest.py: the per-test CPU seconds, the default tier's compile settings, in the
test processes and in their Python subprocesses, its allocator, and the measurement switch of
what a test module's end releases."""

import ast
import gc
import importlib.util
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SPEC = importlib.util.spec_from_file_location("suite_tiers",
                                               os.path.join(ROOT, "tools", "suite_tiers.py"))
suite_tiers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(suite_tiers)


def _item(module, name):
  return types.SimpleNamespace(module=module, name=name)


def test_a_stale_slow_case_id_is_reported_and_a_matching_one_is_not():
  module = types.ModuleType("test_fake")
  module.__file__ = os.path.join(ROOT, "tests", "test_fake.py")
  module.SLOW_CASES = {"test_a[1]", "test_renamed[2]"}
  items = [_item(module, "test_a[1]"), _item(module, "test_a[2]"), _item(None, "test_doc")]
  assert suite_tiers.stale_slow_cases(items) == [("tests/test_fake.py", "test_renamed[2]")]


def test_the_nightly_only_modules_exist():
  for path in suite_tiers.NIGHTLY_ONLY:
    assert os.path.exists(os.path.join(ROOT, path)), path


def test_the_modules_that_keep_grappler_exist():
  from tests import conftest  # pylint: disable=g-import-not-at-top
  assert conftest.KEEP_GRAPPLER
  for path in conftest.KEEP_GRAPPLER:
    assert os.path.exists(os.path.join(ROOT, path)), path


def test_cpu_seconds_of_each_test_are_recorded_and_summed(tmp_path, monkeypatch):
  """tests/conftest.py appends "node id<TAB>CPU s" per test under TF_DPITER_TEST_CPU_DIR, and
  suite_tiers sums a node's lines over the workers' files (a rerun adds up), ignoring others."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(conftest, "CPU_DIR", str(tmp_path))
  monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
  hook = conftest.pytest_runtest_protocol(types.SimpleNamespace(nodeid="tests/x.py::t[a]"), None)
  next(hook)
  start = os.times()
  while sum(os.times()[:2]) - sum(start[:2]) < 0.05:   # burn at least 50 ms of CPU
    pass
  try:
    hook.send(None)
  except StopIteration:
    pass
  node, seconds = (tmp_path / "cpu.gw7.tsv").read_text().rstrip("\n").split("\t")
  assert node == "tests/x.py::t[a]" and 0.05 <= float(seconds) < 60
  (tmp_path / "cpu.gw0.tsv").write_text("tests/x.py::t[a]\t1.250\ntests/y.py::u\t2.000\n")
  (tmp_path / "other.txt").write_text("tests/y.py::u\t9\n")
  assert suite_tiers._cpu_seconds(str(tmp_path)) == pytest.approx(   # pylint: disable=protected-access
      {"tests/x.py::t[a]": 1.25 + float(seconds), "tests/y.py::u": 2.0})


def test_the_default_tier_compiles_cheaply_and_the_nightly_tier_as_shipped(monkeypatch,
                                                                           request):
  """tests/conftest.py's compile settings: on for pytest.ini's `-m "not slow"`, off for
  `-m slow` (the nightly tier runs TensorFlow's and XLA's defaults) and for other selections;
  TF_DPITER_TEST_FAST_COMPILE=0/1 overrides. In this process they are applied iff chosen."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def config(markexpr):
    return types.SimpleNamespace(getoption=lambda name, default=None: markexpr)

  monkeypatch.delenv("TF_DPITER_TEST_FAST_COMPILE", raising=False)
  assert [conftest._fast_compile(config(m))   # pylint: disable=protected-access
          for m in ("not slow", "slow", "", None)] == [True, False, False, False]
  monkeypatch.setenv("TF_DPITER_TEST_FAST_COMPILE", "0")
  assert not conftest._fast_compile(config("not slow"))   # pylint: disable=protected-access
  monkeypatch.setenv("TF_DPITER_TEST_FAST_COMPILE", "1")
  assert conftest._fast_compile(config("slow"))   # pylint: disable=protected-access
  monkeypatch.undo()
  here = conftest._fast_compile(request.config)   # pylint: disable=protected-access
  assert tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer",
                                                            False) is here
  if here:
    assert os.environ.get("XLA_FLAGS"), "XLA_FLAGS unset in a fast-compile run"


@pytest.mark.parametrize("grappler", ["off", "on"])
def test_a_tests_subprocess_switches_grappler_off_at_its_tensorflow_import(tmp_path, grappler):
  """tests/subprocess_site's sitecustomize, which Python loads at a subprocess's start: with
  TF_DPITER_TEST_GRAPPLER=off it switches Grappler's meta optimizer off once the process has
  imported `tensorflow` (a stand-in package here: no TensorFlow start-up), not before; with
  "on" it leaves the process alone."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  package = tmp_path / "tensorflow"
  package.mkdir()
  (package / "__init__.py").write_text(
      "import types\ncalls = []\nconfig = types.SimpleNamespace(optimizer=types.SimpleNamespace("
      "set_experimental_options=calls.append))\n")
  code = ("import sys\nbefore = 'tensorflow' in sys.modules\nimport tensorflow\n"
          "print(before, tensorflow.calls)")
  env = dict(os.environ, TF_DPITER_TEST_GRAPPLER=grappler,
             PYTHONPATH=os.pathsep.join([conftest.SUBPROCESS_SITE, str(tmp_path)]))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, check=True).stdout.split(maxsplit=1)
  assert out[0] == "False"
  expected = [{"disable_meta_optimizer": True}] if grappler == "off" else []
  assert ast.literal_eval(out[1]) == expected


def test_the_subprocesses_of_this_run_get_the_setting_of_its_tier(request):
  """A default-tier test process hands TF_DPITER_TEST_GRAPPLER=off and tests/subprocess_site
  (first on PYTHONPATH) to the subprocesses its tests start; in the nightly tier
  tests/conftest.py adds neither."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
  if conftest._fast_compile(request.config):   # pylint: disable=protected-access
    assert os.environ.get("TF_DPITER_TEST_GRAPPLER") == "off"
    assert paths[0] == conftest.SUBPROCESS_SITE
  else:
    assert conftest.SUBPROCESS_SITE not in paths


def test_the_default_tier_starts_its_test_processes_on_jemalloc(monkeypatch, request):
  """tests/conftest.py's `_jemalloc`: the default tier preloads jemalloc's library (also any
  tier with TF_DPITER_TEST_JEMALLOC=1), the nightly tier does not, nor a run with the switch
  at 0 or an LD_PRELOAD already set, nor a machine without the library; an xdist worker
  started with it preloaded runs on it."""
  import ctypes.util  # pylint: disable=g-import-not-at-top
  from tests import conftest  # pylint: disable=g-import-not-at-top

  def config(markexpr):
    return types.SimpleNamespace(getoption=lambda name, default=None: markexpr)

  jemalloc = lambda: conftest._jemalloc(config("not slow"))   # pylint: disable=protected-access  # noqa: E731
  for name in ("TF_DPITER_TEST_JEMALLOC", "TF_DPITER_TEST_FAST_COMPILE", "LD_PRELOAD"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.9")
  assert jemalloc() == "libjemalloc.so.9"
  assert conftest._jemalloc(config("slow")) is None   # pylint: disable=protected-access
  monkeypatch.setenv("TF_DPITER_TEST_JEMALLOC", "1")
  assert conftest._jemalloc(config("slow")) == "libjemalloc.so.9"   # pylint: disable=protected-access
  monkeypatch.setenv("TF_DPITER_TEST_JEMALLOC", "0")
  assert jemalloc() is None
  monkeypatch.delenv("TF_DPITER_TEST_JEMALLOC")
  monkeypatch.setenv("LD_PRELOAD", "libother.so")
  assert jemalloc() is None
  monkeypatch.delenv("LD_PRELOAD")
  monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
  assert jemalloc() is None
  monkeypatch.undo()
  if os.environ.get("PYTEST_XDIST_WORKER") and "jemalloc" in os.environ.get("LD_PRELOAD", ""):
    with open("/proc/self/maps", encoding="utf-8") as f:
      assert "libjemalloc" in f.read()


@pytest.mark.parametrize("mode", ["module_freeze", "none"])
def test_a_module_end_releases_keras_state_and_freezes_the_survivors(monkeypatch, mode):
  """With TF_DPITER_TEST_CLEAR_SESSION=module_freeze, tests/conftest.py's end of a test module
  resets Keras's global state (the automatic layer names start again) and moves every object
  alive then into the collector's permanent generation; "none" (the default) does neither."""
  import keras  # pylint: disable=g-import-not-at-top
  from tests import conftest  # pylint: disable=g-import-not-at-top
  setting = conftest.CLEAR_SESSION
  monkeypatch.setattr(conftest, "CLEAR_SESSION", mode)
  keras.layers.Dense(1, name="placeholder")
  first = keras.layers.Dense(1).name
  alive = [[i] for i in range(1000)]   # 1,001 objects the collector tracks
  frozen = gc.get_freeze_count()
  try:
    conftest.end_of_module()
    later = keras.layers.Dense(1).name
    now_frozen = gc.get_freeze_count()
  finally:
    if mode == "module_freeze" and setting != "module_freeze":
      gc.unfreeze()   # this process runs on as its setting says
  if mode == "module_freeze":
    assert later == "dense" and now_frozen >= frozen + len(alive)
  else:
    assert later != "dense" and later != first and now_frozen == frozen


def test_the_collector_thresholds_follow_the_switch(monkeypatch):
  """TF_DPITER_TEST_GC_THRESHOLD="g0,g1,g2" sets the cyclic collector's thresholds in a test
  process (tests/conftest.py's `_gc_threshold`); unset, conftest.GC_THRESHOLD; empty, they
  stay as they are."""
  from tests import conftest  # pylint: disable=g-import-not-at-top
  before = gc.get_threshold()
  try:
    monkeypatch.delenv("TF_DPITER_TEST_GC_THRESHOLD", raising=False)
    conftest._gc_threshold()   # pylint: disable=protected-access
    assert gc.get_threshold() == tuple(int(v) for v in conftest.GC_THRESHOLD.split(","))
    gc.set_threshold(*before)
    monkeypatch.setenv("TF_DPITER_TEST_GC_THRESHOLD", "")
    conftest._gc_threshold()   # pylint: disable=protected-access
    assert gc.get_threshold() == before
    monkeypatch.setenv("TF_DPITER_TEST_GC_THRESHOLD", "12345,7,9")
    conftest._gc_threshold()   # pylint: disable=protected-access
    assert gc.get_threshold() == (12345, 7, 9)
  finally:
    gc.set_threshold(*before)
