"""The federated server's ledger states the client as its unit (Geyer et al., "Differentially
Private Federated Learning: A Client Level Perspective", Section 2: a record is one client's
model update; fixed-size sampling: replace one client, Poisson: add or remove one client).

Before, its rounds were recorded under the example-level policies fixed_size / poisson, so a
saved ledger's own report said "example" (the server's report named the client). The epsilon
is the same number under both units (the same events); checked against dp-accounting by hand.
"""

import json

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import accounting
from tf_dpiter import federated as F
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.errors import PrivacyConfigError

K, M, Z, DIM, DELTA = 20, 4, 1.1, 5, 1e-5


def _server(sampling, journal=None):
  query = F.make_query("fixed", noise_multiplier=Z, clients_per_round=M, l2_norm_clip=0.5)
  return F.DPServer(query, np.zeros(DIM, np.float32), K, M, sampling=sampling,
                    fixed_delta=DELTA, ledger_journal=journal)


def _rounds(server, n):
  rng = np.random.default_rng(0)
  for t in range(1, n + 1):
    m = server.begin_round(M, Z, t)
    server.apply(rng.normal(size=[m, DIM]).astype(np.float32), np.ones([m], np.float32), m)


@pytest.mark.parametrize("sampling,policy,relation", [
    ("fixed_size", "client_fixed_size", "replace_one"),
    ("poisson", "client_poisson", "add_or_remove_one")])
def test_a_saved_federated_ledger_reports_the_client(tmp_path, sampling, policy, relation):
  server = _server(sampling)
  _rounds(server, 3)
  path = tmp_path / "ledger.json"
  server.ledger.save_json(str(path))
  saved = json.loads(path.read_text())
  assert [r["policy"] for r in saved["runs"]] == [policy]
  report = accounting.privacy_report(path.read_text(), delta=DELTA)
  text = " ".join(report.assumptions)
  assert "client (a record is one client's model update)" in text, text
  assert "one example" not in text and "unit: example" not in text, text
  # the epsilon by hand: dp-accounting, one client's update as the record
  if sampling == "fixed_size":   # replace one: the sum moves by 2 S, the multiplier z / 2
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(K, M, dpa.GaussianDpEvent(Z / 2)), 3)
  else:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(M / K, dpa.GaussianDpEvent(Z)), 3)
  # z as the ledger stores it (float32: 1.1 -> 1.10000002): equal to 1e-6
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)
  assert relation in json.dumps(saved["runs"])


def test_a_journal_of_example_level_rounds_is_refused_naming_the_unit(tmp_path):
  """A journal written by a server before the client-unit policies (its rounds under
  fixed_size, the unit stated: example) is refused, not composed with client rows."""
  server = _server("fixed_size")
  server.begin_round(M, Z, 1)
  events = server.planned_events()
  old = ledger_lib.PrivacyLedger()
  for _ in range(2):   # two rounds as such a server recorded them
    old.record_sample(K, M / K, events, policy="fixed_size", sample_size=M)
  path = tmp_path / "old.journal"
  assert ledger_lib.LedgerJournal(str(path)).append(old) == 2
  with pytest.raises(PrivacyConfigError, match="recorded with the client as the unit"):
    _server("fixed_size", journal=str(path))
