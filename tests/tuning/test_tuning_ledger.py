"""A private selection recorded in the ledger file: saved, loaded, verified and accounted.

Relation: the trial's (add or remove one example here). The selection record says the
trial's samples were the best of K trials, K ~ truncated negative binomial / Poisson; the
accountant composes dp-accounting's RepeatAndSelectDpEvent over the trial, compared here
with dp-accounting called by hand.
"""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import tuning
from tf_dpiter.accounting import accountant
from tf_dpiter.accounting import cli
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec
from tf_dpiter.ledger import selection


def _trial(z=1.1, steps=100, q=0.01):
  samples = np.array([[1000, q, 10, rec.policy_code(rec.POISSON), 1, 1]] * steps, float)
  queries = np.array([[i, rec.GAUSSIAN, 1.0, z, 1.0] for i in range(steps)], float)
  return samples, queries


def _by_hand(mean, shape, z=1.1, steps=100, q=0.01, after=None):
  acc = dpa.rdp.RdpAccountant()
  trial = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  acc.compose(dpa.dp_event.RepeatAndSelectDpEvent(trial, mean, shape))
  if after is not None:
    acc.compose(after)
  return acc.get_epsilon(1e-5)


@pytest.mark.parametrize("mean,shape", [(5.0, 1.0), (10.0, 0.5), (3.0, math.inf)])
def test_selection_survives_save_and_load_and_gives_the_tuned_epsilon(tmp_path, mean, shape):
  d = tuning.selection_ledger(_trial(), mean, shape, trials=4, key="k")
  assert d["version"] == 3 and d["selection"]["trials"] == 4 and d["num_samples"] == 100
  path = tmp_path / "ledger.json"
  path.write_text(json.dumps(d))
  loaded = json.loads(path.read_text())
  report = accountant.privacy_report(loaded, delta=1e-5, key="k")
  assert report.epsilon == pytest.approx(_by_hand(mean, shape), rel=1e-9)
  assert report.num_samples == 100
  assert any("best of K trials" in a and "Papernot and Steinke" in a for a in report.assumptions)
  assert report.epsilon > accountant.privacy_report(_trial(), delta=1e-5).epsilon
  runs, passes = ledger_file.dict_to_runs(loaded, key="k")      # round trip keeps the record
  assert ledger_file.runs_to_dict(runs, passes, key="k") == d


def test_samples_after_the_selection_compose_with_it():
  runs = selection.with_selection(rec.run_length_encode(*rec.validate_arrays(*_trial())),
                                  5.0, 1.0, 2)
  after = rec.run_length_encode(*rec.validate_arrays(*_trial(z=2.0, steps=30)))
  d = ledger_file.runs_to_dict(runs + after)
  assert d["selection"]["after_samples"] == 100 and d["num_samples"] == 130
  expected = _by_hand(5.0, 1.0, after=dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2.0)), 30))
  assert accountant.epsilon(d, 1e-5) == pytest.approx(expected, rel=1e-9)


def test_random_search_report_carries_the_selected_ledger():
  search = tuning.RandomSearch(4.0, shape=1.0, seed=3)
  _, _, _, report = search.run(lambda rng: {"lr": float(rng.uniform())},
                               lambda p: (p["lr"], None, _trial()), 1e-5)
  assert report.ledger["selection"]["mean"] == 4.0
  assert accountant.epsilon(report.ledger, 1e-5) == report.epsilon
  assert report.epsilon == pytest.approx(_by_hand(4.0, 1.0), rel=1e-9)


def test_tampering_and_unsupported_uses_are_refused():
  d = tuning.selection_ledger(_trial(), 5.0, 1.0, trials=2)
  altered = json.loads(json.dumps(d))
  altered["selection"]["mean"] = 1.0                  # a smaller mean: a smaller epsilon
  with pytest.raises(ValueError, match="altered"):
    accountant.privacy_report(altered, delta=1e-5)
  dropped = {k: v for k, v in d.items() if k != "selection"}
  with pytest.raises(ValueError, match="needs a 'selection'"):
    accountant.privacy_report(ledger_file.sign(dropped), delta=1e-5)
  for other in ("pld", "gdp"):
    with pytest.raises(ValueError, match="RDP accountant only"):
      accountant.privacy_report(d, delta=1e-5, accountant=other)
  with pytest.raises(ValueError, match="selected twice"):
    tuning.selection_ledger(d, 5.0, 1.0, trials=2)
  with pytest.raises(ValueError, match="mean"):
    tuning.selection_ledger(_trial(), 0.5, 1.0, trials=2)


def test_version_2_files_still_load_and_dp_ledger_reports_the_selection(tmp_path, capsys):
  plain = ledger_file.arrays_to_dict(*_trial())
  assert plain["version"] == 2 and "selection" not in plain
  assert accountant.epsilon(plain, 1e-5) == pytest.approx(
      accountant.privacy_report(_trial(), delta=1e-5).epsilon)
  path = tmp_path / "tuned.json"
  path.write_text(json.dumps(tuning.selection_ledger(_trial(), 5.0, 1.0, trials=3)))
  cli.dp_ledger_main(["report", str(path), "--delta", "1e-5"])
  out = capsys.readouterr().out
  assert f"{_by_hand(5.0, 1.0):.4g}" in out and "best of K trials" in out


def test_a_loaded_selection_ledger_keeps_its_record_through_training_and_the_journal(tmp_path):
  from tf_dpiter.ledger import journal as journal_lib  # pylint: disable=g-import-not-at-top
  from tf_dpiter.ledger import privacy_ledger  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import events  # pylint: disable=g-import-not-at-top
  d = tuning.selection_ledger(_trial(steps=20), 5.0, 1.0, trials=2)
  led = privacy_ledger.PrivacyLedger.from_dict(d)
  again = led.to_dict()   # the run table (`ledger.run_ids`) is the only field added
  assert [n for _, n, _ in again.pop("run_ids")] == [d["num_samples"] + 1]   # + the marker
  assert ledger_file.sign(again) == d
  journal = journal_lib.LedgerJournal(tmp_path / "j.journal")
  journal.append(led)
  for _ in range(3):   # the selected model trained further: composed after the selection
    led.record_sample(1000, 0.01, (events.GaussianSumEvent(1.0, 2.0),))
  journal.append(led)
  samples, queries, passes = journal_lib.LedgerJournal(tmp_path / "j.journal").read()
  expected = _by_hand(5.0, 1.0, steps=20, after=dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2.0)), 3))
  assert accountant.epsilon((samples, queries, passes), 1e-5) == pytest.approx(expected, rel=1e-9)
  assert accountant.epsilon(led, 1e-5) == pytest.approx(expected, rel=1e-9)
