"""Review R20 (session 47) of run identity in merges and the journal after a merge.

Relation and unit: add/remove one example (Poisson sampling, q = 0.1 or 0.2 of n = 100,
S = 1, z = 1); a sample is one noised step. Counts are samples; epsilon is compared with
dp-accounting's RDP accountant called by hand at delta = 1e-5. Rule: every noised step that
touched the released weights is charged once (McMahan et al. 2018, "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 6).
"""

import copy
import os

import dp_accounting as dpa
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import journal as journal_module

DELTA = 1e-5


def _steps(led, count, q=0.1):
  for _ in range(count):
    led.record_sample(100.0, q, (dq.GaussianSumEvent(1.0, 1.0),))


def _by_hand(qs):
  acc = dpa.rdp.RdpAccountant()
  for q in qs:
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)))
  return acc.get_epsilon(DELTA)


def _adopt_another_run_and_step(live, journal):
  """`live` merges another run's ledger (2 steps, q = 0.2; listed first), takes 1 step, and
  `journal` appends it at optimizer iteration 4."""
  other = L.PrivacyLedger()
  _steps(other, 2, q=0.2)
  live.merge_arrays(*other.state())
  _steps(live, 1)
  journal.append(live, iterations=4)


def _resumed(*views):
  """A new ledger merging `views` (journal paths or ledgers) in order."""
  led = L.PrivacyLedger()
  for view in views:
    if isinstance(view, L.PrivacyLedger):
      led.merge_arrays(*view.state())
    else:
      L.LedgerJournal(view).resume(led)
  return led


def test_an_earlier_versions_journal_resumed_then_merged_keeps_the_merged_rows(
    tmp_path, monkeypatch):
  """An earlier version's journal (chunks without a run table: 3 steps, q = 0.1) resumed into
  a new ledger, which adopts another run (2 steps, q = 0.2) and takes 1 step: the journal
  alone holds the 6 samples with their q, and merged with the live ledger stays 6.

  Measured before the fix: the append went by position (the merged rows listed first), so
  the journal held 6 samples all at q = 0.1 under a table naming the adopted run
  (epsilon 3.026 for 3.800), and live + journal was refused (the adopted run's two views
  "disagree")."""
  path = os.path.join(tmp_path, "run.journal")
  with monkeypatch.context() as m:   # what an earlier version wrote: no run table
    m.setattr(journal_module, "TABLE_FIELD", "not_a_run_table")
    old = L.PrivacyLedger()
    _steps(old, 3)
    L.LedgerJournal(path).append(old, iterations=3)
  live = L.PrivacyLedger()
  journal = L.LedgerJournal(path)
  journal.resume(live, iterations=3)
  _adopt_another_run_and_step(live, journal)
  truth = _by_hand([0.1] * 4 + [0.2] * 2)
  assert dp.accounting.epsilon(live, DELTA) == pytest.approx(truth, rel=1e-9)
  alone = _resumed(path)
  assert int(alone.sample_count) == 6
  assert sorted(alone.get_arrays()[0][:, 1]) == [0.1] * 4 + [0.2] * 2
  assert dp.accounting.epsilon(alone, DELTA) == pytest.approx(truth, rel=1e-9)
  assert int(_resumed(live, path).sample_count) == 6
  assert int(_resumed(path, live).sample_count) == 6
  _steps(live, 2)   # later appends continue the journal's views
  journal.append(live, iterations=6)
  assert int(_resumed(path, live).sample_count) == 8


def test_a_fork_from_a_checkpoint_is_charged_besides_the_original_run(tmp_path):
  """Run A: 8 steps journaled, a checkpoint at step 4. A fork restores that checkpoint into
  a new optimizer's ledger and takes 4 steps of its own (equal rows to A's 5..8): its ledger
  is 8 (A's first 4 + its 4); A's journal merged with the fork is 12, not 8 (the fork's steps
  are another identity, never deduplicated as A's)."""
  a = L.PrivacyLedger()
  journal = L.LedgerJournal(os.path.join(tmp_path, "a.journal"))
  for step in range(1, 9):
    _steps(a, 1)
    journal.append(a, iterations=step)
    if step == 4:
      ckpt = tf.train.Checkpoint(ledger=a).save(os.path.join(tmp_path, "ck"))
  fork = L.PrivacyLedger()
  tf.train.Checkpoint(ledger=fork).restore(ckpt)
  _steps(fork, 4)
  assert fork.run_table() == ((a.run_id, 4, 0), (fork.run_id, 4, 0))
  assert dp.accounting.epsilon(fork, DELTA) == pytest.approx(_by_hand([0.1] * 8), rel=1e-9)
  assert int(_resumed(journal.path, fork).sample_count) == 12
  assert int(_resumed(fork, journal.path, a).sample_count) == 12


def test_a_torn_per_identity_chunk_is_dropped_and_the_cut_journal_refused(tmp_path):
  """A journaled run (3 steps) adopts another (2 steps, q = 0.2), takes a step, and the chunk
  of that append (per identity) is torn by a crash: the journal alone is the 3 steps before
  it, a model restored at iteration 4 is refused, and the next append after a resume of the
  live ledger's checkpoint writes the 6 samples."""
  path = os.path.join(tmp_path, "run.journal")
  live = L.PrivacyLedger()
  journal = L.LedgerJournal(path)
  _steps(live, 3)
  journal.append(live, iterations=3)
  _adopt_another_run_and_step(live, journal)
  ckpt = tf.train.Checkpoint(ledger=live).save(os.path.join(tmp_path, "ck"))
  os.truncate(path, os.path.getsize(path) - 20)   # the last chunk torn
  with pytest.warns(RuntimeWarning, match="cut by a crash"):
    alone = _resumed(path)
  assert int(alone.sample_count) == 3
  with pytest.warns(RuntimeWarning), pytest.raises(PrivacyConfigError, match="ends at 3"):
    L.LedgerJournal(path).resume(L.PrivacyLedger(), iterations=4)
  restarted = L.PrivacyLedger()
  tf.train.Checkpoint(ledger=restarted).restore(ckpt)
  restarted.reconcile()
  again = L.LedgerJournal(path)
  with pytest.warns(RuntimeWarning):
    again.resume(restarted)
  _steps(restarted, 1)
  again.append(restarted, iterations=5)
  resumed = _resumed(path)
  assert int(resumed.sample_count) == 7
  assert sorted(resumed.get_arrays()[0][:, 1]) == [0.1] * 5 + [0.2] * 2
  assert int(_resumed(path, restarted).sample_count) == 7


def test_a_deep_copy_of_a_ledger_is_another_run_from_the_copy_on():
  """A ledger of 4 steps deep-copied (`copy.deepcopy`: a fork), each branch 4 steps more:
  the branches' weights took 8 steps each, 12 in all; merged, they are charged 12, epsilon
  = 12 steps by hand; the copy names the source's 4 and its own 4.

  Measured before the fix: the copy kept the source's identity (two objects appending under
  one), and the merge kept the longer view of "one run": 8 samples for 12."""
  a = L.PrivacyLedger()
  _steps(a, 4)
  b = copy.deepcopy(a)
  assert b.run_id != a.run_id
  _steps(a, 4)
  _steps(b, 4)
  assert b.run_table() == ((a.run_id, 4, 0), (b.run_id, 4, 0))
  merged = _resumed(a, b)
  assert int(merged.sample_count) == 12
  assert dp.accounting.epsilon(merged, DELTA) == pytest.approx(_by_hand([0.1] * 12), rel=1e-9)
  assert int(_resumed(b, a, b).sample_count) == 12


def test_a_crash_between_a_merge_and_its_append_loses_nothing_at_the_restart(tmp_path):
  """A journaled run (3 steps, q = 0.1) merges another run (2 steps, q = 0.2), a checkpoint is
  saved, and the process dies before the next append. The restart restores the checkpoint
  into a new ledger, resumes the journal, takes 1 step and appends: the journal alone holds
  the 6 samples with their q (epsilon = by hand), with the restart and the dead ledger
  stays 6."""
  path = os.path.join(tmp_path, "run.journal")
  live = L.PrivacyLedger()
  _steps(live, 3)
  L.LedgerJournal(path).append(live, iterations=3)
  other = L.PrivacyLedger()
  _steps(other, 2, q=0.2)
  live.merge_arrays(*other.state())
  ckpt = tf.train.Checkpoint(ledger=live).save(os.path.join(tmp_path, "ck"))
  restarted = L.PrivacyLedger()
  tf.train.Checkpoint(ledger=restarted).restore(ckpt)
  journal = L.LedgerJournal(path)
  journal.resume(restarted, iterations=3)
  _steps(restarted, 1)
  journal.append(restarted, iterations=4)
  alone = _resumed(path)
  assert sorted(alone.get_arrays()[0][:, 1]) == [0.1] * 4 + [0.2] * 2
  assert dp.accounting.epsilon(alone, DELTA) == pytest.approx(
      _by_hand([0.1] * 4 + [0.2] * 2), rel=1e-9)
  assert int(_resumed(path, restarted, live).sample_count) == 6   # the dead ledger: a prefix
