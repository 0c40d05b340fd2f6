"""Default and nightly (`-m slow`) test cases per directory, and a check of `SLOW_CASES`.

The default suite is `python -m pytest -q -n 2` (pytest.ini: `-m "not slow"`); the nightly
tier is `python -m pytest -q -n 2 -m slow`. This tool collects every case once (`-m ""`,
nothing run), counts the cases of each tier per directory and, given a junit xml of an
earlier run (`--xml`), sums their recorded seconds (cases absent from the xml count 0 s
and are counted as unknown); `--cpu DIR` does the same with the CPU seconds a run with
TF_DPITER_TEST_CPU_DIR=DIR recorded (tests/conftest.py: load-independent, unlike the xml's
wall seconds). With `--check` it exits 1 when a module's `SLOW_CASES` set
(see tests/conftest.py) holds an id that names none of that module's cases (a renamed test
would otherwise silently return to the default suite or vanish from the nightly one), or
when a test module outside NIGHTLY_ONLY has no default case (every module stays imported and
exercised by the default suite).

Usage (from the repository root; PATHs are test files or directories, default tests/):
  python tools/suite_tiers.py [--check] [--xml RUN.xml | --cpu DIR] [PATH ...]
"""

import argparse
import collections
import contextlib
import io
import os
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Modules whose every case is nightly, each for its reason (processes, deployments, data).
NIGHTLY_ONLY = {
    "tests/auditing/test_slow_audits.py": "the white-box audit's many trials, MNIST audit",
    "tests/correlated/test_tree_noise_in_saved_model.py":
        "R3's finding-11 case; test_noise_state_not_saved.py's tree cases assert the same",
    "tests/draw_discard/test_benchmarks_slow.py": "the service benchmarks end to end",
    "tests/federated/test_flower_deployment.py": "a Flower deployment of several processes",
    "tests/federated/test_mnist_slow.py": "federated MNIST end to end",
    "tests/keras/test_mirrored_idioms.py":
        "a 2-replica MirroredStrategy process of its own; checkpoint restore, save/load, "
        "BackupAndRestore, band_mf, physical chunks and steps_per_execution under it",
    "tests/keras/test_mirrored_poisson.py": "its default runs are test_distribute.py's jobs",
    "tests/keras/test_multi_worker.py": "2-3 worker processes per run",
    "tests/keras/test_r19_plain_optimizer_on_dp_weights.py":
        "R3's finding-9 case; test_weights_changed_outside.py's plain-optimizer case asserts the "
        "same refusal on the same models and fits",
    "tests/keras/test_xla_compile_once.py":
        "its default run (the fast path) is test_distribute.py's xla_compile job",
}


class _Recorder:
  """pytest plugin: the collected items, after conftest marked the `SLOW_CASES` ones."""

  def __init__(self):
    self.items = []

  def pytest_collection_finish(self, session):
    self.items = list(session.items)


def _xml_seconds(path):
  """{node id: seconds} of a junit xml (classname tests.a.test_b.TestC -> tests/a/test_b.py)."""
  seconds = {}
  for case in ET.parse(path).iter("testcase"):
    parts = case.get("classname", "").split(".")
    module = [p for p in parts if not p[:1].isupper()]
    classes = [p for p in parts if p[:1].isupper()]
    node = "/".join(module) + ".py::" + "::".join(classes + [case.get("name")])
    seconds[node] = float(case.get("time", 0))
  return seconds


def _cpu_seconds(directory):
  """{node id: CPU seconds} of the cpu.*.tsv files a run with TF_DPITER_TEST_CPU_DIR wrote."""
  seconds = collections.Counter()
  for name in sorted(os.listdir(directory)):
    if name.startswith("cpu.") and name.endswith(".tsv"):
      with open(os.path.join(directory, name), encoding="utf-8") as f:
        for line in f:
          node, value = line.rstrip("\n").rsplit("\t", 1)
          seconds[node] += float(value)
  return dict(seconds)


def stale_slow_cases(items):
  """[(module file, id)] of `SLOW_CASES` ids that name none of their module's items."""
  names, modules = collections.defaultdict(set), {}
  for item in items:
    module = getattr(item, "module", None)
    if module is not None:
      names[module.__file__].add(item.name)
      modules[module.__file__] = module
  return [(os.path.relpath(f, ROOT), case) for f, m in sorted(modules.items())
          for case in sorted(getattr(m, "SLOW_CASES", ())) if case not in names[f]]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true")
  timing = parser.add_mutually_exclusive_group()
  timing.add_argument("--xml", help="junit xml of an earlier run: sum its seconds per tier")
  timing.add_argument("--cpu", help="TF_DPITER_TEST_CPU_DIR of an earlier run: sum its CPU "
                                   "seconds per tier")
  parser.add_argument("paths", nargs="*", default=["tests"])
  args = parser.parse_args(argv)
  recorder = _Recorder()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = pytest.main(["--collect-only", "-q", "-m", "", "-p", "no:randomly", *args.paths],
                       plugins=[recorder])
  if code not in (0, 5):
    print(out.getvalue())
    return int(code)
  timed = bool(args.xml or args.cpu)
  seconds = (_xml_seconds(args.xml) if args.xml else _cpu_seconds(args.cpu) if args.cpu
             else {})
  counts = collections.defaultdict(collections.Counter)
  default_modules, all_modules = set(), set()
  for item in recorder.items:
    tier = "slow" if item.get_closest_marker("slow") else "default"
    module = item.nodeid.split("::")[0]
    all_modules.add(module)
    if tier == "default":
      default_modules.add(module)
    row = counts[os.path.dirname(module)]
    row[tier] += 1
    if item.nodeid in seconds:
      row[tier + "_s"] += seconds[item.nodeid]
    elif timed:
      row[tier + "_unknown"] += 1
  total = sum(counts.values(), collections.Counter())
  print(f"{'directory':32s} {'default':>8s} {'slow':>6s}"
        + (f" {'default s':>10s} {'slow s':>8s} {'unknown':>8s}" if timed else ""))
  for directory, row in sorted(counts.items()) + [("total", total)]:
    print(f"{directory:32s} {row['default']:8d} {row['slow']:6d}"
          + (f" {row['default_s']:10.0f} {row['slow_s']:8.0f}"
             f" {row['default_unknown'] + row['slow_unknown']:8d}" if timed else ""))
  if not args.check:
    return 0
  problems = [f"{f}: SLOW_CASES names no case {case!r}"
              for f, case in stale_slow_cases(recorder.items)]
  problems += [f"{m}: no default case" for m in sorted(all_modules - default_modules)
               if m not in NIGHTLY_ONLY]
  for problem in problems:
    print(problem, file=sys.stderr)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
