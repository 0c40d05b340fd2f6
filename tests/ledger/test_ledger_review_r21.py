"""Review R21 (session 48) of session 47's run identities (`ledger.run_ids`): copies of a
ledger object and the journal's one-writer check.

Relation and unit: add/remove one example (Poisson sampling, q = 0.1 of n = 100, S = 1,
z = 1); a sample is one noised step. Counts are samples; epsilon is compared with
dp-accounting's RDP accountant called by hand at delta = 1e-5. Rule: every noised step that
touched the released weights is charged once (McMahan et al. 2018, "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 6).

Finding (fixed): `pickle` of a `PrivacyLedger` (a ledger handed to another process, or kept in
a pickled object) kept its run identity, as `copy.deepcopy` did before review R20: the two
branches of the fork appended equal rows under one identity and a merge kept one branch,
8 samples for 12 (epsilon 3.248 for 3.619 by hand), measured before the fix.
"""

import copy
import itertools
import os
import pickle

import dp_accounting as dpa
import pytest

import tf_dpiter as dp
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import PrivacyConfigError

DELTA = 1e-5


def _steps(led, count, q=0.1):
  for _ in range(count):
    led.record_sample(100.0, q, (dq.GaussianSumEvent(1.0, 1.0),))


def _by_hand(steps, q=0.1):
  return dpa.rdp.RdpAccountant().compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)), steps)).get_epsilon(DELTA)


def _merged(*ledgers):
  out = L.PrivacyLedger()
  for led in ledgers:
    out.merge_arrays(*led.state())
  return out


def test_a_pickled_ledger_is_another_run_from_the_copy_on():
  """Ledger A, 4 steps, pickled and unpickled (B); A and B take 4 steps each: B holds A's 4
  under A's identity and its own 4 under a new one, and A merged with B is 12 samples
  (4 + 4 + 4), epsilon = 12 steps by hand, in either order."""
  a = L.PrivacyLedger()
  _steps(a, 4)
  b = pickle.loads(pickle.dumps(a))
  assert b.run_id != a.run_id
  assert b.run_table() == ((a.run_id, 4, 0),)
  _steps(a, 4)
  _steps(b, 4)
  assert b.run_table() == ((a.run_id, 4, 0), (b.run_id, 4, 0))
  for merged in (_merged(a, b), _merged(b, a)):
    assert int(merged.sample_count) == 12
    assert dp.accounting.epsilon(merged, DELTA) == pytest.approx(_by_hand(12), rel=1e-9)


def test_a_shallow_copy_is_the_same_ledger():
  """`copy.copy` of a ledger shares its variables (it was so before the fix): the steps either
  object records are one ledger's, 4 + 4 = 8, each charged once, and the copy keeps the
  identity, so a merge of the two is 8."""
  a = L.PrivacyLedger()
  _steps(a, 4)
  b = copy.copy(a)
  _steps(b, 4)
  assert b.run_id == a.run_id and int(a.sample_count) == 8
  assert int(_merged(a, b).sample_count) == 8


def test_a_second_writer_that_cut_a_torn_line_as_long_as_its_chunk_is_refused(tmp_path):
  """Two writers resumed on one journal whose last line is torn (no line end), as long as the
  chunk the first one appends after cutting it, and ending with the same bytes but the last:
  the file's size is unchanged for the second writer, its last bytes differ (a chunk ends with
  b"\\n", a torn line never does), so the second writer's append is refused and the first
  one's released chunk stays (4 samples)."""
  path = os.path.join(tmp_path, "run.journal")
  base = L.PrivacyLedger()
  _steps(base, 2)
  L.LedgerJournal(path).append(base, iterations=2)
  # the chunk a writer resumed on this file writes after 2 more steps, measured on a scratch copy
  scratch = os.path.join(tmp_path, "scratch.journal")
  with open(path, "rb") as f:
    head = f.read()
  first = L.PrivacyLedger()
  with open(scratch, "wb") as f:
    f.write(head)
  probe = L.LedgerJournal(scratch)
  probe.resume(first, iterations=2)
  _steps(first, 2)
  probe.append(first, iterations=4)
  with open(scratch, "rb") as f:
    chunk = f.read()[len(head):]
  with open(path, "ab") as f:   # a torn line of the chunk's length, without its line end
    f.write(chunk[:-1] + b"x")
  writers = []
  for _ in range(2):
    journal = L.LedgerJournal(path)
    with pytest.warns(RuntimeWarning, match="cut by a crash"):
      led = L.PrivacyLedger()
      journal.resume(led, iterations=2)
    writers.append((journal, led))
  (j1, l1), (j2, l2) = writers
  _steps(l1, 2)
  j1.append(l1, iterations=4)
  assert os.path.getsize(path) == len(head) + len(chunk)
  _steps(l2, 2)
  with pytest.raises(PrivacyConfigError, match="changed since this process last read"):
    j2.append(l2, iterations=4)
  assert int(_merged_journal(path).sample_count) == 4


def _merged_journal(path):
  led = L.PrivacyLedger()
  L.LedgerJournal(path).resume(led)
  return led


def test_views_of_three_runs_merge_to_one_ledger_in_any_order():
  """Three runs (A 4 steps at q = 0.1, B 3 at q = 0.1 with rows equal to A's, C 2 at
  q = 0.2); views taken at several steps (A at 2 and 4, B at 1 and 3, C at 2), and a ledger
  that adopted B's view at 1 and took 2 steps of its own (D): every order of merging the six
  views gives 4 + 3 + 2 + 2 = 11 samples (each run's longest view; B's prefix inside D is not
  charged again), the same run counts and the same epsilon, = 11 steps by hand (every
  73rd of the 720 orders)."""
  a, b, c = L.PrivacyLedger(), L.PrivacyLedger(), L.PrivacyLedger()
  views = []
  for step in range(4):
    _steps(a, 1)
    if step < 3:
      _steps(b, 1)
    if step < 2:
      _steps(c, 1, q=0.2)
    if step in (0, 2):
      views.append(b.state())
    if step in (1, 3):
      views.append(a.state())
  views.append(c.state())
  d = L.PrivacyLedger()
  d.merge_arrays(*views[0])   # B's view at 1 step
  _steps(d, 2)
  views.append(d.state())
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)),
                                      9))
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(1.0)),
                                      2))
  truth = acc.get_epsilon(DELTA)
  counts = {a.run_id: 4, b.run_id: 3, c.run_id: 2, d.run_id: 2}
  for order in list(itertools.permutations(range(len(views))))[::73]:
    out = L.PrivacyLedger()
    for i in order:
      out.merge_arrays(*views[i])
    per_run = {}
    for rid, n, _ in out.run_table():
      per_run[rid] = per_run.get(rid, 0) + n
    assert per_run == counts, order
    assert dp.accounting.epsilon(out, DELTA) == pytest.approx(truth, rel=1e-9)
