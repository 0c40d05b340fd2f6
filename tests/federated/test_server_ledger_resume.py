"""A federated server's ledger journal (federated/server_journal.py): a restarted server
continues the ledger it wrote (epsilon, budget and round counter), or refuses the journal."""

import json

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import accounting
from tf_dpiter import federated as F
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.federated import flower_rounds

# Nightly tier (-m slow): the server-level fixed_size case (the Flower rounds' test accounts
# fixed_size by hand in the default tier).
SLOW_CASES = {"test_a_restarted_server_continues_its_ledger[fixed_size]"}

K, DIM, DELTA = 20, 6, 1e-5
M = [4, 5, 4, 5, 4]            # m_t of rounds 1..5 (two m: two traces)
Z = [1.0, 1.2, 1.4, 1.1, 0.9]  # z_t of rounds 1..5


def _server(path, sampling="fixed_size", kind="fixed", clip=0.5, population=K, **kw):
  query = F.make_query(kind, noise_multiplier=Z[0], clients_per_round=M[0], l2_norm_clip=clip)
  return F.DPServer(query, np.zeros(DIM, np.float32), population, M[0], sampling=sampling,
                    fixed_delta=DELTA, ledger_journal=path, **kw)


def _run_rounds(server, rounds, rng):
  for t in rounds:
    m = server.begin_round(M[t - 1], Z[t - 1], t)
    server.apply(rng.normal(size=[m, DIM]).astype(np.float32), np.ones([m], np.float32), m)


def _epsilon_by_hand(sampling, rounds):
  """dp-accounting's epsilon of rounds 1..rounds (the unit: one client)."""
  if sampling == "fixed_size":   # replace one client: the sum moves by 2 S, so z / 2
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    for m, z in zip(M[:rounds], Z[:rounds]):
      acc.compose(dpa.SampledWithoutReplacementDpEvent(K, m, dpa.GaussianDpEvent(z / 2)))
  else:
    acc = dpa.rdp.RdpAccountant()
    for m, z in zip(M[:rounds], Z[:rounds]):
      acc.compose(dpa.PoissonSampledDpEvent(m / K, dpa.GaussianDpEvent(z)))
  return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("sampling", ["fixed_size", "poisson"])
def test_a_restarted_server_continues_its_ledger(tmp_path, sampling):
  path = tmp_path / "server.journal"
  rng = np.random.default_rng(0)
  first = _server(path, sampling)
  assert (first.resumed_rounds, first.journal.samples) == (0, 0)
  _run_rounds(first, [1, 2, 3], rng)
  eps3 = first.guarantee()[0]
  del first                                   # the server process ends
  again = _server(path, sampling)
  assert again.resumed_rounds == 3
  assert again.guarantee()[0] == pytest.approx(eps3, rel=1e-12)
  _run_rounds(again, [4, 5], rng)
  expected = _epsilon_by_hand(sampling, 5)
  assert expected > _epsilon_by_hand(sampling, 2) * 1.3   # the first rounds weigh
  assert again.guarantee()[0] == pytest.approx(expected, rel=1e-6)
  assert int(again.ledger.sample_count) == again.journal.samples == 5
  third = _server(path, sampling)             # the journal holds all five rounds
  assert accounting.epsilon(third.ledger, DELTA) == pytest.approx(expected, rel=1e-6)


def test_flower_rounds_continue_the_schedule_after_a_restart(tmp_path, tiny):
  model = tiny[0]
  params = model.init_params(seed=0)
  path = tmp_path / "flower.journal"
  rng = np.random.default_rng(1)

  def deployment():
    query = F.make_query("fixed", noise_multiplier=Z[0], clients_per_round=M[0])
    return flower_rounds.DPRounds(model, query, params, K, M, Z, None, None, DELTA, None,
                                  1.0, 0.0, None, ledger_journal=path)

  def run(dp, server_rounds):
    infos = []
    for r in server_rounds:
      picked = dp.sample(r, list(range(K)))
      replies = [(c, [rng.normal(size=s).astype(np.float32) * 0.1 for s in model.shapes])
                 for c in picked]
      infos.append(dp.aggregate(r, replies, 0))
    return infos

  run(deployment(), [1, 2, 3])
  restarted = deployment()
  infos = run(restarted, [1, 2])              # Flower counts from 1 again
  assert [i["round"] for i in infos] == [4, 5]
  samples, queries = restarted.server.ledger.get_arrays()
  np.testing.assert_array_equal(samples[:, 2], M)    # m_t and z_t of the schedule's rounds 1..5
  np.testing.assert_allclose(queries[:, 3], np.float32(Z) * 1.0, rtol=1e-6)   # sigma = z S
  assert infos[-1]["epsilon"] == pytest.approx(_epsilon_by_hand("fixed_size", 5), rel=1e-6)


def test_dpfedavg_resumes_the_round_counter_and_the_budget(tmp_path, tiny):
  model, x, y = tiny
  path = tmp_path / "sim.journal"
  _run_rounds(_server(path), [1, 2, 3], np.random.default_rng(2))
  fd = F.partition_iid(x, y, K, examples_per_client=20, seed=0)
  query = F.make_query("fixed", noise_multiplier=Z[0], clients_per_round=M[0], l2_norm_clip=0.5)
  # a budget the resumed rounds leave no room in: the look-ahead stops before round 4
  alg = F.DPFedAvg(model, fd, query, clients_per_round=M, noise_multiplier=Z, fixed_delta=DELTA,
                   max_epsilon=_epsilon_by_hand("fixed_size", 3) * 1.01, ledger_journal=path,
                   diagnostics=False)
  assert alg.round_index == 3
  rep = alg.run(2)
  assert rep.stopped_reason.startswith("privacy budget: round 4 would raise epsilon")
  assert (alg.round_index, len(alg.rounds), int(alg.ledger.sample_count)) == (3, 0, 3)


@pytest.mark.parametrize("change, match", [
    ({"sampling": "poisson"}, "`sampling` must be 'client_fixed_size'"),
    ({"population": K + 1}, "`population_size`"),
    ({"clip": 0.7}, "`l2_norm_clip` of the query"),
    ({"kind": "quantile"}, "`query` must report"),
])
def test_another_recipe_is_refused(tmp_path, change, match):
  path = tmp_path / "server.journal"
  _run_rounds(_server(path), [1, 2], np.random.default_rng(3))
  with pytest.raises(PrivacyConfigError, match=match):
    _server(path, **change)


def test_an_adaptive_clip_is_not_compared(tmp_path):
  path = tmp_path / "server.journal"
  _run_rounds(_server(path, kind="quantile", clip=0.5), [1, 2], np.random.default_rng(4))
  assert _server(path, kind="quantile", clip=0.5).resumed_rounds == 2   # S_t adapted


def _journal_lines(path):
  return path.read_text().splitlines(keepends=True)


def test_an_altered_journal_is_refused(tmp_path):
  path = tmp_path / "server.journal"
  _run_rounds(_server(path), [1, 2, 3], np.random.default_rng(5))
  lines = _journal_lines(path)
  assert len(lines) == 3
  path.write_text(lines[0] + lines[2])                     # a round removed
  with pytest.raises(ParameterValueError, match="removed, reordered or edited"):
    _server(path)
  chunk = json.loads(lines[1])
  chunk["seq"] = 7                                         # a chunk edited
  path.write_text(lines[0] + json.dumps(chunk) + "\n" + lines[2])
  with pytest.raises(ParameterValueError, match="digest"):
    _server(path)
  path.write_text("not a journal\n")
  with pytest.raises(ParameterValueError, match="not JSON"):
    _server(path)
  with pytest.raises(ParameterValueError, match="`ledger_journal` must be a file path"):
    _server("")


def test_a_line_torn_by_a_crash_is_dropped_with_a_warning(tmp_path):
  # The append is fsynced before the round's sum leaves the server, and the tally is written
  # after the line: a crash that tore the last line left the tally at the rounds before it.
  path, tally = tmp_path / "server.journal", tmp_path / "server.journal.tally"
  server, rng = _server(path), np.random.default_rng(6)
  _run_rounds(server, [1, 2], rng)
  before = tally.read_text()
  _run_rounds(server, [3], rng)
  text = path.read_text()
  path.write_text(text[:-40])
  with pytest.raises(PrivacyConfigError, match="holds 2 chunks but its tally .* counts 3"):
    _server(path)                # the tally saw the line whole: a cut after the fact
  tally.write_text(before)       # what a crash inside the third append leaves
  with pytest.warns(RuntimeWarning, match="cut by a crash"):
    server = _server(path)
  assert server.resumed_rounds == 2


def test_rounds_cut_from_the_end_or_an_older_copy_are_refused(tmp_path):
  """Whole rounds cut from the journal's end leave a valid chain: its tally (the count of
  chunks and the last digest, outside the journal) tells them from rounds never run. Before
  the tally a restart resumed the 2 rounds left and charged 2 of 4."""
  path, tally = tmp_path / "server.journal", tmp_path / "server.journal.tally"
  server, rng = _server(path), np.random.default_rng(8)
  _run_rounds(server, [1, 2], rng)
  two = path.read_text()
  _run_rounds(server, [3, 4], rng)
  lines = _journal_lines(path)
  assert json.loads(tally.read_text())["chunks"] == 4
  path.write_text("".join(lines[:2]))                       # rounds 3 and 4 cut
  with pytest.raises(PrivacyConfigError, match="holds 2 chunks but its tally .* counts 4"):
    _server(path)
  path.unlink()                                             # the journal removed whole
  with pytest.raises(PrivacyConfigError, match="holds 0 chunks .* remove both files"):
    _server(path)
  path.write_text("".join(lines))                          # restored: resumes all four
  assert _server(path).resumed_rounds == 4
  tally.write_text(json.dumps({"chunks": 2, "digest": "0" * 64}))   # another journal's tally
  path.write_text(two)
  with pytest.raises(PrivacyConfigError, match="ends with another chunk than its tally"):
    _server(path)


def test_without_a_journal_nothing_is_written_or_resumed(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  server = _server(None)
  _run_rounds(server, [1, 2], np.random.default_rng(7))
  assert (server.journal, server.resumed_rounds, list(tmp_path.iterdir())) == (None, 0, [])
  assert int(_server(None).ledger.sample_count) == 0      # as before: a new server, a new ledger
