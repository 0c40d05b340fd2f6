"""Kill -9 mid-training and resume: no noised step escapes the ledger (issue 11 item 5).

Rule: every noised step ever taken is charged, steps re-run after a restore included. The
ledger journal is appended after every step, before any other callback can save or print
its result; after the restart the ledger holds every step taken before the kill (counted
from the journal) plus every step of the resumed run, so its sample count is >= the restored
model's optimizer iterations and epsilon never falls below that of those steps.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from tf_dpiter import accounting
from tf_dpiter.ledger import journal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KILL_AT, N, BATCH = 47, 400, 20


def _run(mode, phase, work):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, os.path.join(HERE, "crash_worker.py"), mode, phase,
                         str(work)], capture_output=True, text=True, timeout=300, env=env,
                        cwd=ROOT, check=False)


@pytest.mark.parametrize("mode,journal_name", [
    ("backup", os.path.join("backup", "privacy_ledger.journal")),
    pytest.param("checkpoint", "ledger.journal", marks=pytest.mark.slow)])
def test_sigkill_then_resume_charges_every_step(tmp_path, mode, journal_name):
  first = _run(mode, "first", tmp_path)
  assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
  samples, queries, passes = journal.journal_arrays(os.path.join(tmp_path, journal_name))
  before_kill = samples.shape[0]
  assert before_kill == KILL_AT          # every step taken before the kill is in the journal
  eps_before_kill = accounting.epsilon((samples, queries, passes), 1e-5)

  second = _run(mode, "resume", tmp_path)
  assert second.returncode == 0, second.stderr[-3000:]
  out = json.loads([l for l in second.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
  assert 0 < out["restored"] < KILL_AT   # restored from a backup older than the kill
  assert out["samples"] == before_kill + out["iterations"] - out["restored"]
  assert out["samples"] >= out["iterations"]
  assert out["epsilon"] >= eps_before_kill
  # never below an uninterrupted run of as many steps as the restored model's history
  uninterrupted = accounting.compute_dp_sgd_privacy(
      N, BATCH, 1.1, out["iterations"] * BATCH / N, 1e-5).epsilon
  assert out["epsilon"] >= uninterrupted * (1 - 1e-6)
