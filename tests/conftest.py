"""Shared test configuration: quiet TF logs, the `slow` marker, the MNIST path.

Two tiers: the default suite (`python -m pytest -q -n 2`, pytest.ini's `-m "not slow"`) and
the nightly one (`python -m pytest -q -n 2 -m slow`). A case joins the nightly tier by
`@pytest.mark.slow`, by `pytest.param(..., marks=pytest.mark.slow)`, or by its id (the test's
name with its parameter id, as pytest prints it) in its module's `SLOW_CASES` set, which
`pytest_collection_modifyitems` below marks slow; `python tools/suite_tiers.py --check`
counts both tiers and fails on a `SLOW_CASES` id that names no case.

Suite time: with TF_DPITER_TEST_CPU_DIR=DIR set, each test's CPU seconds (the process's user
and system time and that of the child processes it waited for, from setup to teardown) are
appended to DIR/cpu.<xdist worker or main>.tsv as "node id<TAB>seconds": unlike
`--durations` (wall time, which grows with the machine's load), a figure that other processes
barely move. `python tools/suite_tiers.py --cpu DIR` sums them per tier and directory.

Compile settings: the default tier runs with cheaper compilation (`_fast_compile` below):
LLVM at -O0 in XLA's CPU backend and its fusions emitted by the legacy elemental emitters,
not the MLIR fusion emitters (XLA_FLAGS=`FAST_XLA_FLAGS`, only when XLA_FLAGS is unset), and
Grappler's graph optimizations off
(`tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})`). Most of
the suite's CPU goes into building, optimizing and compiling each case's distinct DP step
programs, which then run a few steps on tiny data, so optimizing them does not pay back; the
assertions compare results against float64 references with tolerances and hold under both
settings. The nightly tier (`-m slow`) keeps TensorFlow's and XLA's defaults, so the
configuration users run is still tested every night; TF_DPITER_TEST_FAST_COMPILE=1 / 0
forces the setting on / off in either tier. The modules in `KEEP_GRAPPLER` run with Grappler
on in every tier: their claims are about what Grappler does to the step (a summation order it
must not reassociate, a noise draw it must not inline). The tests' Python subprocesses get the
same settings: XLA_FLAGS by inheritance, Grappler off through `SUBPROCESS_SITE` (a
`sitecustomize` this file puts on PYTHONPATH, with TF_DPITER_TEST_GRAPPLER=off, in each
process that runs default-tier tests; a subprocess whose environment replaces PYTHONPATH
keeps Grappler on).

Allocator: the default tier's test processes run on jemalloc instead of glibc's malloc
(`_jemalloc` below): the controller puts jemalloc's shared library (found through the dynamic
linker's cache, `ctypes.util.find_library`; Debian's libjemalloc2, which redis-server, a CI
package, depends on) in LD_PRELOAD before xdist starts its workers, so the workers and the
tests' subprocesses start on it; a process that already runs (`-n 0`) keeps its allocator.
Graph construction and function instantiation allocate many small C++ objects: measured -12
to -14 % of the per-test CPU (benchmarks/SUITE_CUTS.md, session 41). Nothing changes when the
library is absent, when LD_PRELOAD is already set, or in the nightly tier;
TF_DPITER_TEST_JEMALLOC=0 / 1 forces it off / on in either tier.

Worker crashes: an xdist worker that dies mid-test (a fatal signal in TensorFlow's C++ code,
or a kill by the kernel's out-of-memory killer) is reported with what it left: pytest's
`faulthandler` prints a fatal signal's Python traceback to the terminal, and each worker
writes, before each test, the test's id and its peak RSS to
TF_DPITER_TEST_CRASH_DIR/worker.<id>.log, whose end the controller prints in a "worker
crashes" section. The crashed test is run once more on a new
worker (pytest-xdist's `pytest_handlecrashitem`), so that a crash of the process, which is not
an assertion, does not hide the verdict of the test's assertions; the run still fails when
the rerun fails or crashes, and the section lists every crash either way.

Worker memory (measured, benchmarks/SUITE_CUTS.md, session 39): an xdist worker's RSS grows
to several GB over the suite, and most of it is not Keras's global state:
`keras.backend.clear_session()` with a full garbage collection after each test module, also
with `gc.freeze()` of the survivors, changed neither a process's peak RSS nor its CPU beyond
the noise, and after each test it cut the peak RSS by 14 % for about 20 % more CPU. So nothing
is released by default; TF_DPITER_TEST_CLEAR_SESSION = "module_freeze" (Keras's state released
and a full collection at the end of each test module, then `gc.freeze()`: the survivors move to
the collector's permanent generation, which later collections no longer scan), "module" (the
same without the freeze) or "test" (after each test) switches it on for measurements.
"""

import ctypes.util
import gc
import os
import resource
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DIR = os.environ.get("TF_DPITER_TEST_CPU_DIR")
MNIST_PATH = os.environ.get("TF_DPITER_MNIST",
                            os.path.join(REPO_ROOT, "..", "shared", "data", "mnist.npz"))


# LLVM at -O0, and XLA:CPU's legacy elemental emitters for fusions instead of its MLIR
# fusion emitters (cheaper to compile: benchmarks/SUITE_CUTS.md, session 49)
FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# the tests' subprocesses switch Grappler off when they import TensorFlow (its docstring)
SUBPROCESS_SITE = os.path.join(REPO_ROOT, "tests", "subprocess_site")
# test modules whose claims are about Grappler's rewrites: Grappler stays on for them
KEEP_GRAPPLER = frozenset((
    "tests/dp_query/test_noise_draw_not_inlined.py", "tests/dp_query/test_summation.py",
    "tests/fast_clipping/test_conv_pinned_sums.py",
    "tests/fast_clipping/test_cross_record_rounding_review.py",
    "tests/fast_clipping/test_gram_contraction_order_review.py",
    "tests/fast_clipping/test_pinned_block_shift_review.py",
    "tests/fast_clipping/test_pinned_dense_sums.py",
    "tests/fast_clipping/test_pinned_record_sums.py",
    "tests/privacy/test_sum_rounding_review.py", "tests/privacy/test_sum_rounding_shift.py"))
_GRAPPLER_OFF = []   # [applied yet] in a test process of the default tier
CRASH_DIR_ENV = "TF_DPITER_TEST_CRASH_DIR"
_CRASH_LOG = []    # [open file] in an xdist worker: each test's start and the peak RSS
_CRASHES = {}      # in xdist's controller: crashed test id -> [report text per crash]


def _fast_compile(config):
  """Whether this run uses the cheaper compile settings (see the module docstring): in the
  default tier (pytest.ini's `-m "not slow"`), unless TF_DPITER_TEST_FAST_COMPILE says
  otherwise."""
  switch = os.environ.get("TF_DPITER_TEST_FAST_COMPILE")
  if switch in ("0", "1"):
    return switch == "1"
  return (config.getoption("markexpr", "") or "").strip() == "not slow"


def _gc_threshold():
  """TF_DPITER_TEST_GC_THRESHOLD="g0,g1,g2": the cyclic collector's thresholds
  (`gc.set_threshold`) in each test process; unset: 20000,20,20 (the collector took 5-6 % of
  a test process's CPU at Python's own 700,10,10: -3.8 % and -5.9 % CPU on two subsets, peak
  RSS +1.5 % and +2.7 %; benchmarks/SUITE_CUTS.md, session 39); empty: Python's own."""
  value = os.environ.get("TF_DPITER_TEST_GC_THRESHOLD", GC_THRESHOLD)
  if value:
    gc.set_threshold(*(int(v) for v in value.split(",")))


GC_THRESHOLD = "20000,20,20"
JEMALLOC_ENV = "TF_DPITER_TEST_JEMALLOC"


def _jemalloc(config):
  """The library the test processes this one starts should preload (module docstring):
  jemalloc's soname in the default tier (TF_DPITER_TEST_JEMALLOC=1: in any tier), None when
  TF_DPITER_TEST_JEMALLOC=0, LD_PRELOAD is already set (the user's choice stands) or the
  dynamic linker knows no jemalloc."""
  switch = os.environ.get(JEMALLOC_ENV)
  if switch == "0" or os.environ.get("LD_PRELOAD"):
    return None
  if switch != "1" and not _fast_compile(config):
    return None
  return ctypes.util.find_library("jemalloc")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long runs, not part of the default suite")
  _gc_threshold()
  if not hasattr(config, "workerinput"):   # xdist's workers inherit the controller's choice
    preload = _jemalloc(config)
    if preload:
      os.environ["LD_PRELOAD"] = preload
  warnings.filterwarnings("ignore", message=".*NOT differentially private.*")
  if _fast_compile(config):
    # XLA reads XLA_FLAGS at its first compilation, after this hook (no test module is
    # imported yet); xdist workers and the tests' subprocesses inherit it.
    if os.environ.get("XLA_FLAGS", FAST_XLA_FLAGS) == FAST_XLA_FLAGS:
      os.environ["XLA_FLAGS"] = FAST_XLA_FLAGS
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
      # a process that runs tests (not xdist's controller, which would import TF for nothing):
      # Grappler is switched off at its first test, after collection has imported TensorFlow
      # and Keras from the test modules' path (importing TF here, before collection, can
      # import `keras` as tests/keras under Bazel's runner, whose script folder is tests/)
      _GRAPPLER_OFF.append(False)
      # and in the tests' subprocesses (this process's children; not in xdist's workers,
      # started before this hook runs in them)
      os.environ["TF_DPITER_TEST_GRAPPLER"] = "off"
      os.environ["PYTHONPATH"] = os.pathsep.join(
          [SUBPROCESS_SITE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p and p != SUBPROCESS_SITE])
  _open_crash_log(config)


def _open_crash_log(config):
  """The worker crashes' record (module docstring): xdist's controller makes the folder,
  each worker (which inherits its environment) writes its log there."""
  if hasattr(config, "workerinput"):
    folder = os.environ.get(CRASH_DIR_ENV)
    if folder:
      os.makedirs(folder, exist_ok=True)   # a folder the user named may not exist yet
      name = os.path.join(folder, f"worker.{config.workerinput['workerid']}.log")
      _CRASH_LOG.append(open(name, "a", encoding="utf-8"))  # pylint: disable=consider-using-with
  elif getattr(config.option, "numprocesses", None):
    os.environ.setdefault(CRASH_DIR_ENV, tempfile.mkdtemp(prefix="tf_dpiter_workers_"))


@pytest.hookimpl(optionalhook=True)   # an xdist hook: the plugin may be absent
def pytest_handlecrashitem(crashitem, report, sched):
  """xdist's controller, when a worker died running `crashitem`: the worker's log end into
  the report, and the test run once more on a new worker unless it crashed before."""
  worker = report.node.workerinput["workerid"]
  name = os.path.join(os.environ.get(CRASH_DIR_ENV, ""), f"worker.{worker}.log")
  tail = ""
  if os.path.exists(name):
    with open(name, encoding="utf-8", errors="replace") as f:
      tail = "".join(f.readlines()[-40:])
  tail += ("(a fatal signal's Python traceback, if any, is printed above the worker's "
           "'node down' line; none there means a kill, e.g. SIGKILL from the out-of-memory "
           "killer)\n")
  _CRASHES.setdefault(crashitem, []).append(f"worker {worker} died running {crashitem}; "
                                            f"the end of its log:\n{tail}")
  if len(_CRASHES[crashitem]) == 1:
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report, config):  # pylint: disable=unused-argument
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter):
  if _CRASHES:
    terminalreporter.section("worker crashes")
    for texts in _CRASHES.values():
      for text in texts:
        terminalreporter.write_line(text)


@pytest.hookimpl(tryfirst=True)   # before the `-m` deselection
def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.name in getattr(getattr(item, "module", None), "SLOW_CASES", ()):
      item.add_marker(pytest.mark.slow)


def _cpu_seconds():
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  """Records the test's CPU seconds under TF_DPITER_TEST_CPU_DIR (see the module docstring)."""
  start = _cpu_seconds() if CPU_DIR else None
  if _CRASH_LOG:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    _CRASH_LOG[0].write(f"start {item.nodeid} (peak RSS so far {peak} MB)\n")
    _CRASH_LOG[0].flush()
  keep = False
  if _GRAPPLER_OFF:   # the default tier's compile settings (module docstring)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if not _GRAPPLER_OFF[0]:   # this process's first test
      tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
      _GRAPPLER_OFF[0] = True
    keep = item.nodeid.split("::")[0] in KEEP_GRAPPLER
  if keep:   # Grappler on for this case (new function instantiations read the option)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
    os.environ["TF_DPITER_TEST_GRAPPLER"] = "on"   # and in its subprocesses
  yield
  if keep:
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    os.environ["TF_DPITER_TEST_GRAPPLER"] = "off"
  if start is not None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.makedirs(CPU_DIR, exist_ok=True)
    with open(os.path.join(CPU_DIR, f"cpu.{worker}.tsv"), "a", encoding="utf-8") as f:
      f.write(f"{item.nodeid}\t{_cpu_seconds() - start:.3f}\n")


# When each test process releases Keras's state (module docstring): "none" (the default),
# "module_freeze", "module" or "test", for measurements.
CLEAR_SESSION = os.environ.get("TF_DPITER_TEST_CLEAR_SESSION", "none")


def _clear_keras_session():
  """Keras's global state released, TensorFlow's kernel cache cleared and a full garbage
  collection (`keras.backend.clear_session()`); only the collection in a process that never
  imported Keras."""
  keras = sys.modules.get("keras")
  if keras is not None and hasattr(keras, "backend"):
    keras.backend.clear_session(free_memory=True)
  else:
    gc.collect()


def end_of_module():
  """What each test process does after each test module (module docstring)."""
  if CLEAR_SESSION in ("module", "module_freeze"):
    _clear_keras_session()
  if CLEAR_SESSION == "module_freeze":
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _clear_session_per_module():
  yield
  end_of_module()


@pytest.fixture(autouse=True)
def _clear_session_per_test():
  yield
  if CLEAR_SESSION == "test":
    _clear_keras_session()


@pytest.fixture
def mnist_path():
  if not os.path.exists(MNIST_PATH):
    pytest.skip(f"MNIST not found at {MNIST_PATH} (set TF_DPITER_MNIST)")
  return MNIST_PATH
