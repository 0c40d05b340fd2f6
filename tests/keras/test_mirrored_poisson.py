"""The default Poisson `fit(x, y, batch_size=B)` under MirroredStrategy on 2 logical CPUs, with
and without XLA: every run finishes, one ledger sample per step, finite weights.

Poisson samples have a random size; unpadded, an odd size split into unequal replica shards
and the step crashed (AddN shape mismatch) in 5 of 6 runs. Under a multi-replica strategy fit
pads every sample to a static size that is a multiple of 8 (padding rows carry weight 0), and
under XLA the query's sample params are read outside the compiled clipped sum (no replica
reads a variable on another device).

The default suite's 2 runs (one with XLA, one without) run in the MirroredStrategy process
that test_distribute.py shares among its jobs, checked by `check_runs`; the 10 runs are
`-m slow`.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def check_runs(lines, runs):
  """The worker's RESULT lines (`lines`, its stdout) show `runs` fits that all finished: one
  ledger sample per step, finite weights, with and without XLA."""
  results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
  assert len(results) == runs, lines
  assert sorted({r["jit"] for r in results}) == [False, True]
  for r in results:
    assert r["iterations"] == 16
    assert r["samples"] == r["iterations"], r
    assert r["finite"], r


@pytest.mark.slow
def test_mirrored_poisson_fit_runs():
  runs = 10
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "mirrored_poisson_worker.py"),
                         str(runs)], capture_output=True, text=True, timeout=900, env=env,
                        cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  check_runs(proc.stdout.splitlines(), runs)
