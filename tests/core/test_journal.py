"""LedgerJournal: every appended step comes back after a crash; edits are refused."""

import json
import os

import numpy as np
import pytest

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L


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
  older = L.PrivacyLedger()             # e.g. restored from a backup taken after 3 steps
  _steps(older, 3, z=1.0)
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
