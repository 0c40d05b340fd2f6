"""LedgerJournal: every appended step comes back after a crash; edits are refused."""

import json
import os

import numpy as np
import pytest

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tests.ledger import forgery


def _steps(led, count, z=1.1, policy="poisson"):
  for _ in range(count):
    led.record_sample(1000.0, 0.05, (dq.GaussianSumEvent(1.0, z),), policy=policy,
                      sample_size=50)


def _journal(tmp_path, appends=(3, 4, 2), key=None):
  led = L.PrivacyLedger()
  j = L.LedgerJournal(os.path.join(tmp_path, "ledger.journal"), key=key)
  for i, n in enumerate(appends):
    _steps(led, n, z=1.0 + i)
    assert j.append(led) == n
  return led, j


def test_resume_restores_every_appended_step(tmp_path):
  led, j = _journal(tmp_path)
  fresh = L.PrivacyLedger()             # a restarted process: empty ledger
  assert L.LedgerJournal(j.path).resume(fresh) == 9
  for a, b in zip(led.get_arrays(), fresh.get_arrays()):
    np.testing.assert_array_equal(a, b)
  assert accounting.epsilon(fresh, 1e-5) == accounting.epsilon(led, 1e-5)


def test_restored_older_ledger_is_topped_up_and_keeps_appending(tmp_path):
  led, j = _journal(tmp_path)
  # a backup of this run taken after its first 3 steps (same rows, same run identity)
  samples, queries = led.get_arrays()
  older = L.PrivacyLedger.from_dict(ledger_file.arrays_to_dict(
      samples[:3], queries[queries[:, 0] < 3], runs=[(led.run_id, 3, 0)]))
  j2 = L.LedgerJournal(j.path)
  j2.resume(older)
  assert int(older.sample_count) == 9    # the 6 steps after the backup stay charged
  _steps(older, 5)                       # the re-run continues
  assert j2.append(older) == 5
  assert int(L.LedgerJournal(j.path).resume(L.PrivacyLedger())) == 14


def test_passes_are_journaled(tmp_path):
  led = L.PrivacyLedger()
  j = L.LedgerJournal(os.path.join(tmp_path, "j"))
  _steps(led, 3, policy="shuffle")
  led.record_passes(2)
  j.append(led)
  fresh = L.PrivacyLedger()
  L.LedgerJournal(j.path).resume(fresh)
  assert int(fresh.passes) == 2


@pytest.mark.parametrize("edit", [
    lambda lines: lines[:1] + lines[2:],                          # a chunk removed
    lambda lines: [lines[1], lines[0]] + lines[2:],               # reordered
    lambda lines: [lines[0].replace('"stddev":1.0', '"stddev":5.0')] + lines[1:],  # edited
])
def test_altered_journal_is_refused(tmp_path, edit):
  _, j = _journal(tmp_path)
  lines = open(j.path).read().splitlines()
  open(j.path, "w").write("\n".join(edit(lines)) + "\n")
  with pytest.raises(ValueError, match="journal"):
    L.LedgerJournal(j.path).resume(L.PrivacyLedger())


def test_torn_last_line_is_dropped_with_a_warning(tmp_path):
  _, j = _journal(tmp_path)
  text = open(j.path).read()
  open(j.path, "w").write(text[:-40])   # a crash in the middle of the last write
  with pytest.warns(RuntimeWarning, match="cut by a crash"):
    assert L.LedgerJournal(j.path).resume(L.PrivacyLedger()) == 7


def test_journal_hmac_key(tmp_path):
  _, j = _journal(tmp_path, key="k1")
  assert all(json.loads(l)["hmac"] for l in open(j.path).read().splitlines())
  assert L.LedgerJournal(j.path, key="k1").resume(L.PrivacyLedger()) == 9
  with pytest.raises(ValueError, match="HMAC"):
    L.LedgerJournal(j.path, key="k2").resume(L.PrivacyLedger())


def _journal_with_iterations(tmp_path, steps=9, key=None):
  """One chunk per step, each carrying the optimizer iteration (as the Keras callback)."""
  led = L.PrivacyLedger()
  j = L.LedgerJournal(os.path.join(tmp_path, "it.journal"), key=key)
  for it in range(1, steps + 1):
    _steps(led, 1)
    assert j.append(led, iterations=it) == 1
  return led, j


@pytest.mark.parametrize("key", [None, "k1"])
def test_every_chunk_carries_the_optimizer_iteration(tmp_path, key):
  _, j = _journal_with_iterations(tmp_path, key=key)
  chunks = [json.loads(l) for l in open(j.path).read().splitlines()]
  assert [c["iterations"] for c in chunks] == list(range(1, 10))
  again = L.LedgerJournal(j.path, key=key)
  assert again.resume(L.PrivacyLedger(), iterations=9) == 9
  assert again.iterations == 9 and again.samples == 9


@pytest.mark.parametrize("key", [None, "k1"])
def test_cut_tail_is_refused_against_the_restored_iterations(tmp_path, key):
  # crash after 9 steps; the last 4 lines are deleted; the model was restored at 9 (or 6)
  _, j = _journal_with_iterations(tmp_path, key=key)
  lines = open(j.path).read().splitlines()
  open(j.path, "w").write("\n".join(lines[:-4]) + "\n")
  cut = L.LedgerJournal(j.path, key=key)
  fresh = L.PrivacyLedger()
  for restored in (9, 6):
    with pytest.raises(ValueError, match=r"ends at 5 steps.*iterations=%d" % restored):
      cut.resume(fresh, iterations=restored)
  # without the restored iterations the chain alone cannot tell (a chain proves what it holds)
  assert L.LedgerJournal(j.path, key=key).resume(L.PrivacyLedger()) == 5
  # a model restored at or before the journal's end is fine
  assert L.LedgerJournal(j.path, key=key).resume(L.PrivacyLedger(), iterations=5) == 5


def test_journal_without_iterations_is_checked_by_its_samples(tmp_path):
  _, j = _journal(tmp_path)                       # 9 samples, no "iterations" fields
  j2 = L.LedgerJournal(j.path)
  j2.read()
  assert j2.iterations is None
  j2.check_covers(9)
  with pytest.raises(ValueError, match="ends at 9 steps"):
    j2.check_covers(10)
  L.LedgerJournal(os.path.join(tmp_path, "new.journal")).check_covers(50)  # a new journal


def test_forged_file_without_key_is_accepted_and_the_report_says_so(tmp_path):
  led = L.PrivacyLedger()
  _steps(led, 10)
  path = os.path.join(tmp_path, "ledger.json")
  led.save_json(path)
  forged = forgery.forge_count(json.load(open(path)), 1)
  open(path, "w").write(json.dumps(forged))
  true_eps = accounting.epsilon(led, 1e-5)
  report = accounting.privacy_report(open(path).read(), delta=1e-5)
  assert report.num_samples == 1 and report.epsilon < true_eps   # the documented acceptance
  assert "NOT forgery" in str(report) and "key" in str(report)
  assert "detects accidents, not forgery" in L.PrivacyLedger.save_json.__doc__


def test_forged_file_with_key_is_refused(tmp_path):
  led = L.PrivacyLedger()
  _steps(led, 10)
  path = os.path.join(tmp_path, "ledger.json")
  led.save_json(path, key="secret")
  text = open(path).read()
  report = accounting.privacy_report(text, delta=1e-5, key="secret")
  assert "HMAC-SHA256 under the given key verified" in str(report)
  forged = forgery.forge_count(json.loads(text), 1)                 # digest recomputed, no valid HMAC
  with pytest.raises(ValueError, match="hmac"):
    accounting.privacy_report(json.dumps(forged), delta=1e-5, key="secret")
  forged["hmac"] = json.loads(text)["hmac"]            # the old HMAC kept: does not match
  with pytest.raises(ValueError, match="HMAC does not match"):
    L.PrivacyLedger.load_json(_write(tmp_path, forged), key="secret")


def _write(tmp_path, d):
  path = os.path.join(tmp_path, "forged.json")
  open(path, "w").write(json.dumps(d))
  return path


def test_a_second_writer_appending_at_the_same_instant_is_refused(tmp_path):
  """One writer per journal, also at the same instant: another process holding the append's
  lock (between its check of the file and its fsync) makes this append refuse, the file
  unchanged; once it is gone the append goes on and the chain reads back whole. Before the
  lock, two writers that both found the file as they left it both appended: a forked chain."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  led, j = _journal(tmp_path)
  with open(j.path, "rb") as f:
    before = f.read()
  holder = subprocess.Popen(
      [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'ab'); "
       "fcntl.flock(f.fileno(), fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
       j.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    _steps(led, 2)
    with pytest.raises(PrivacyConfigError, match="being appended to by another writer"):
      j.append(led)
    with open(j.path, "rb") as f:
      assert f.read() == before
  finally:
    holder.communicate("", timeout=60)
  assert j.append(led) == 2
  assert L.LedgerJournal(j.path).resume(L.PrivacyLedger()) == 11
