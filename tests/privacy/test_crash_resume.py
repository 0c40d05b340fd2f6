"""Kill -9 mid-training and resume: no noised step escapes the ledger (issue 11 item 5).

Rule: every noised step ever taken is charged, steps re-run after a restore included. The
ledger journal is appended after every step, before any other callback can save or print
its result; after the restart the ledger holds every step taken before the kill (counted
from the journal) plus every step of the resumed run, so its sample count is >= the restored
model's optimizer iterations and epsilon never falls below that of those steps.
The killed run is a process of its own (crash_worker.py, SIGKILL); the resume runs
crash_worker.main in the test's process: it reads only the files the killed run left (the
backup or checkpoint and the journal), as a restarted process would.
"""

import os
import signal
import subprocess
import sys
import warnings

import pytest

from tests.privacy import crash_worker
from tf_dpiter import accounting
from tf_dpiter.ledger import journal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KILL_AT, N, BATCH = 47, 400, 20


def _run_killed(mode, work):
  """crash_worker's first phase in a process of its own, killed after step KILL_AT."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, os.path.join(HERE, "crash_worker.py"), mode, "first",
                         str(work)], capture_output=True, text=True, timeout=300, env=env,
                        cwd=ROOT, check=False)


def _resume(mode, work):
  """crash_worker's resume phase, in this process: its result dict."""
  with warnings.catch_warnings():
    return crash_worker.main(mode, "resume", str(work))


@pytest.mark.parametrize("mode,journal_name", [
    ("backup", os.path.join("backup", "privacy_ledger.journal")),
    pytest.param("checkpoint", "ledger.journal", marks=pytest.mark.slow)])
def test_sigkill_then_resume_charges_every_step(tmp_path, mode, journal_name):
  first = _run_killed(mode, tmp_path)
  assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
  samples, queries, passes = journal.LedgerJournal(os.path.join(tmp_path, journal_name)).read()
  before_kill = samples.shape[0]
  assert before_kill == KILL_AT          # every step taken before the kill is in the journal
  eps_before_kill = accounting.epsilon((samples, queries, passes), 1e-5)

  out = _resume(mode, tmp_path)
  assert 0 < out["restored"] < KILL_AT   # restored from a backup older than the kill
  assert out["samples"] == before_kill + out["iterations"] - out["restored"]
  assert out["samples"] >= out["iterations"]
  assert out["epsilon"] >= eps_before_kill
  # never below an uninterrupted run of as many steps as the restored model's history
  uninterrupted = accounting.compute_dp_sgd_privacy(
      N, BATCH, 1.1, out["iterations"] * BATCH / N, 1e-5).epsilon
  assert out["epsilon"] >= uninterrupted * (1 - 1e-6)
