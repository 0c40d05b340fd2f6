"""Views of one run merge as one run; different runs add (`ledger.run_ids`).

The rule: a run is one identity (the ledger object that recorded its samples, which only
appends). Merging two views of one run (the live ledger, its journal, a file or dict saved at
some step) keeps their union, the longer view when one is a prefix of the other, never their
sum; two views that disagree at a position (different samples) are refused. Different runs
are all charged, even with equal rows. Every noised step that touched the weights is charged
once (McMahan et al. 2018, "A General Approach to Adding Differential Privacy to Iterative
Training Procedures", Section 6).

Relation and unit: add/remove one example (Poisson sampling, q = 0.1 or 0.2 of n = 100,
S = 1, z = 1); a sample is one noised step. The counts are samples; epsilon is compared with
dp-accounting's RDP accountant called by hand at delta = 1e-5.
"""

import itertools
import os

import dp_accounting as dpa
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import run_ids

DELTA = 1e-5


def _steps(led, count, q=0.1):
  for _ in range(count):
    led.record_sample(100.0, q, (dq.GaussianSumEvent(1.0, 1.0),))


def _views(tmp_path, saved_at=3, total=5):
  """A live run of `total` steps, its journal (appended every step) and its file saved at
  step `saved_at`: (live ledger, journal path, file path)."""
  os.makedirs(tmp_path, exist_ok=True)
  live = L.PrivacyLedger()
  journal = L.LedgerJournal(os.path.join(tmp_path, "run.journal"))
  path = os.path.join(tmp_path, "run.json")
  for step in range(1, total + 1):
    _steps(live, 1)
    journal.append(live)
    if step == saved_at:
      live.save_json(path)
  return live, journal.path, path


def _merge(views):
  """A new ledger merging `views` in order (each a live ledger, a journal path or a file)."""
  led = L.PrivacyLedger()
  for view in views:
    if isinstance(view, L.PrivacyLedger):
      led.merge_arrays(*view.state())
    elif view.endswith(".journal"):
      L.LedgerJournal(view).resume(led)
    else:
      led.merge_arrays(*L.PrivacyLedger.load_json(view).state())
  return led


# the default tier keeps the three rotations (each view first once, each pair merged once);
# the nightly tier all six orders
ORDERS = [order if order in ((0, 1, 2), (1, 2, 0), (2, 0, 1)) else
          pytest.param(order, marks=pytest.mark.slow)
          for order in itertools.permutations(range(3))]


@pytest.mark.parametrize("order", ORDERS)
def test_the_live_ledger_its_journal_and_its_file_are_one_run_in_any_order(tmp_path, order):
  """5 steps live and journaled, the file saved at step 3: any merge of the three (and of
  any two: a prefix of the permutation) holds 5 samples, the live ledger's rows, and epsilon
  equals 5 steps by hand."""
  live, journal, path = _views(tmp_path)
  views = [live, journal, path]
  for k in (2, 3):
    led = _merge([views[i] for i in order[:k]])
    expected = 3 if set(order[:k]) == {2} else 5
    assert int(led.sample_count) == expected
  np.testing.assert_array_equal(led.get_arrays()[0], live.get_arrays()[0])
  assert [t[0] for t in led.run_table()] == [live.run_id]
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 5)
  assert dp.accounting.epsilon(led, DELTA) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_a_view_that_went_further_is_kept_whichever_comes_first(tmp_path):
  """The file saved at step 3, the run continued to 7 in a ledger loaded from it (the same
  run's first 3 samples, then its own): file + continuation and continuation + file: 7."""
  live, _, path = _views(tmp_path, saved_at=3, total=3)
  continued = L.PrivacyLedger.load_json(path)
  _steps(continued, 4)
  for views in ([path, continued], [continued, path], [live, continued, path]):
    assert int(_merge(views).sample_count) == 7


def test_two_runs_with_equal_rows_are_both_charged(tmp_path):
  """Two runs of one recipe (5 and 5 steps, equal rows), each with its journal: 10 samples,
  merged in either order and with either run's journal merged again."""
  a, journal_a, _ = _views(tmp_path / "a")
  b, journal_b, _ = _views(tmp_path / "b")
  assert int(_merge([a, b]).sample_count) == 10
  assert int(_merge([journal_b, a, journal_a, b]).sample_count) == 10


def test_two_views_of_one_run_that_disagree_are_refused():
  """A dict naming the run's identity whose second sample differs (q = 0.2 for 0.1): one
  run's ledger only appends, so one view was altered; neither the sum nor either one is
  right, and the merge is refused (the ledger is left as it was)."""
  live = L.PrivacyLedger()
  _steps(live, 3)
  samples, queries = live.get_arrays()
  samples = samples.copy()
  samples[1, 1] = 0.2
  forged = ledger_file.arrays_to_dict(samples, queries, runs=[(live.run_id, 3, 0)])
  with pytest.raises(PrivacyConfigError, match=f"run {live.run_id}.*sample 1"):
    live.merge_arrays(*ledger_file.dict_to_state(forged))
  assert int(live.sample_count) == 3


def test_the_journal_keeps_the_run_views_after_a_merge_into_the_journaled_ledger(tmp_path):
  """A journaled run (3 steps, q = 0.1) adopts another run's ledger (2 steps, q = 0.2) and
  takes 1 step more: the journal resumed alone holds the 6 samples the ledger does, their q
  included (2 at 0.2), and merged with the live ledger stays 6.

  Before, the merge put the adopted rows first and the journal appended by position: it
  held 6 samples at q = 0.1 (the adopted q = 0.2 rows lost: an optimistic epsilon), and
  live + journal counted 8."""
  live = L.PrivacyLedger()
  journal = L.LedgerJournal(os.path.join(tmp_path, "run.journal"))
  _steps(live, 3)
  journal.append(live)
  other = L.PrivacyLedger()
  _steps(other, 2, q=0.2)
  live.merge_arrays(*other.state())
  _steps(live, 1)
  journal.append(live)
  resumed = _merge([journal.path])
  assert int(resumed.sample_count) == 6
  assert sorted(resumed.get_arrays()[0][:, 1]) == sorted(live.get_arrays()[0][:, 1])
  assert dp.accounting.epsilon(resumed, DELTA) == dp.accounting.epsilon(live, DELTA)
  assert int(_merge([live, journal.path]).sample_count) == 6
  assert int(_merge([journal.path, live]).sample_count) == 6
  _steps(live, 2)   # appends after the merge continue the journal's views
  journal.append(live)
  assert int(_merge([journal.path, live]).sample_count) == 8
  assert {t[0] for t in _merge([journal.path]).run_table()} == {live.run_id, other.run_id}


def test_the_run_table_of_a_merge_covers_each_identity_once():
  """The merged table lists each identity once per segment and covers the rows
  (`run_ids.check_table`)."""
  a, b = L.PrivacyLedger(), L.PrivacyLedger()
  _steps(a, 2)
  _steps(b, 3, q=0.2)
  led = _merge([a, b, a, b])
  table = led.run_table()
  assert run_ids.check_table(table, 5, 0) == table
  assert sorted(t[0] for t in table) == sorted([a.run_id, b.run_id])


def test_a_ledger_as_it_was_is_found_again_by_identity_after_merges():
  """`run_ids.earlier`: run A's table after 3 steps; A then merged run B (listed first) and
  took 2 steps: A as it was holds A's first 3 samples (q = 0.1), not B's (q = 0.2)."""
  a, b = L.PrivacyLedger(), L.PrivacyLedger()
  _steps(a, 3)
  then = a.run_table()
  _steps(b, 2, q=0.2)
  a.merge_arrays(*b.state())
  _steps(a, 2)
  state = a.state()
  samples, _, passes, table = run_ids.earlier((*state[:3], state[4]), then)
  assert table == ((a.run_id, 3, 0),) and passes == 0
  np.testing.assert_array_equal(samples[:, 1], [0.1] * 3)
