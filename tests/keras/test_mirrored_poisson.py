"""The default Poisson `fit(x, y, batch_size=B)` under MirroredStrategy on 2 logical CPUs, with
and without XLA: every run finishes, one ledger sample per step, finite weights.

Poisson samples have a random size; unpadded, an odd size split into unequal replica shards
and the step crashed (AddN shape mismatch) in 5 of 6 runs. Under a multi-replica strategy fit
pads every sample to a static size that is a multiple of 8 (padding rows carry weight 0), and
under XLA the query's sample params are read outside the compiled clipped sum (no replica
reads a variable on another device).

The default suite runs 2 (one with XLA, one without); the 10 runs are `-m slow`.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("runs", [2, pytest.param(10, marks=pytest.mark.slow)])
def test_mirrored_poisson_fit_runs(runs):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "mirrored_poisson_worker.py"),
                         str(runs)], capture_output=True, text=True, timeout=900, env=env,
                        cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
             if line.startswith("RESULT ")]
  assert len(results) == runs
  assert sorted({r["jit"] for r in results}) == [False, True]
  for r in results:
    assert r["iterations"] == 16
    assert r["samples"] == r["iterations"], r
    assert r["finite"], r
