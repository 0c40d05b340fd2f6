"""Review R16 (session 46): the federated server's ledger journal (federated/server_journal.py,
session 45) under restarts an adversary or a crash can produce.

Relation: one client replaced (fixed-size sampling of m_t of K clients, the ledger's policy
fixed_size); the unit is the client. Rule (`server_journal`): every round aggregated is
charged, and a restart continues the ledger or is refused, so epsilon never starts from 0
again for the same clients.
"""

import warnings

import numpy as np
import pytest

from tf_dpiter import federated as F
from tf_dpiter.errors import PrivacyConfigError

K, DIM, M, Z, DELTA = 20, 6, 4, 1.0, 1e-5


def _server(path):
  query = F.make_query("fixed", noise_multiplier=Z, clients_per_round=M, l2_norm_clip=0.5)
  return F.DPServer(query, np.zeros(DIM, np.float32), K, M, fixed_delta=DELTA,
                    ledger_journal=path)


def _rounds(server, rounds):
  """The noised sums of `rounds` rounds of zero updates (the sums are the noise alone)."""
  sums = []
  for t in rounds:
    m = server.begin_round(M, Z, t)
    sums.append(np.asarray(server.aggregate(np.zeros([m, DIM], np.float32),
                                            np.ones([m], np.float32), m)))
  return sums


def test_a_server_resumed_past_a_torn_line_can_be_resumed_again(tmp_path):
  # A crash tore the journal's last line (round 3: its sum never left the server). The
  # restart drops it with a warning and runs rounds 3 and 4; the next restart must resume
  # all four rounds. Before the fix the new chunk was appended after the torn bytes, on
  # their line: the journal then had a line that is not JSON and every later restart was
  # refused (the deployment's ledger lost unless the file is edited by hand). Fixed: the
  # append cuts the torn bytes first (`ledger.journal`).
  path, tally = tmp_path / "server.journal", tmp_path / "server.journal.tally"
  first = _server(path)
  _rounds(first, [1, 2])
  before = tally.read_text()   # the tally is written after the line: a crash inside round 3's
  _rounds(first, [3])          # append leaves it at round 2 (server_journal's tally)
  path.write_text(path.read_text()[:-40])
  tally.write_text(before)
  with pytest.warns(RuntimeWarning, match="cut by a crash"):
    restarted = _server(path)
  assert restarted.resumed_rounds == 2
  _rounds(restarted, [3, 4])
  with warnings.catch_warnings():
    warnings.simplefilter("error")            # nothing torn any more
    again = _server(path)
  assert again.resumed_rounds == int(again.ledger.sample_count) == 4
  assert again.guarantee()[0] == pytest.approx(restarted.guarantee()[0], rel=1e-12)


def test_an_unseeded_server_draws_new_noise_after_a_restart(tmp_path):
  # The default (unseeded) query's noise after a restart is not the first run's noise
  # again: the restarted server's round 3 is compared with every round of the first run.
  path = tmp_path / "server.journal"
  first = _rounds(_server(path), [1, 2])
  again = _rounds(_server(path), [3])[0]
  assert np.all(again != 0)
  for earlier in first:
    assert not np.any(np.isclose(again, earlier, rtol=0, atol=1e-9))


def test_a_second_server_on_one_journal_is_refused_before_its_sum_leaves(tmp_path):
  # Two servers resumed on one journal (a restart while the old process still runs): each
  # ledger holds its own rounds only. Before the fix both released round 3 and each stated
  # the epsilon of 3 rounds while 4 ran; the next restart then refused the journal as
  # "removed, reordered or edited" (two chunks with seq 2). Fixed: an append refuses a file
  # that changed since its journal last read or wrote it (`ledger.journal`).
  path = tmp_path / "server.journal"
  _rounds(_server(path), [1, 2])
  first, second = _server(path), _server(path)
  _rounds(first, [3])
  with pytest.raises(PrivacyConfigError, match="another writer"):
    _rounds(second, [3])
  assert _server(path).resumed_rounds == 3      # the journal holds what was released


def test_two_servers_started_on_a_new_journal_do_not_lose_a_round(tmp_path):
  # Both servers started before either wrote (no file yet). Before the fix the second
  # server's first append re-read the file the first had created, took its round for its
  # own and wrote nothing: its released round 1 was in no chunk, and a restart charged 2 of
  # the 3 rounds run. Fixed: a journal that was read appends without reading again, and
  # refuses the file another writer changed.
  path = tmp_path / "server.journal"
  first, second = _server(path), _server(path)
  _rounds(first, [1])
  try:
    _rounds(second, [1, 2])
  except PrivacyConfigError:
    return                                     # refused before its first sum left
  assert _server(path).resumed_rounds == 3
