"""The command line as a TF Privacy user types it: --used_microbatching / --noused_microbatching,
--accountant_type, `python -m tf_dpiter.accounting`, and notes where the run's sampling
differs from what the hyperparameters assume."""

import re
import runpy
import sys

import dp_accounting as dpa
import pytest

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.accounting import __main__ as main_lib
from tf_dpiter.accounting import cli

BASE = ["--N=60000", "--batch_size=256", "--noise_multiplier=1.1", "--epochs=3", "--delta=1e-5"]


def _poisson_epsilon():
  """Independently: 2344 Poisson-sampled Gaussian steps by dp-accounting's RDP accountant."""
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(256 / 60000,
                                                                 dpa.GaussianDpEvent(1.1)),
                                      -(-3 * 60000 // 256)))
  return acc.get_epsilon(1e-5)


def _run(capsys, argv, fn=cli.compute_dp_sgd_privacy_main):
  rc = fn(argv)
  out = capsys.readouterr()
  return rc, out.out, out.err


def test_noused_microbatching_prints_the_statement_with_the_poisson_number(capsys):
  rc, out, _ = _run(capsys, BASE + ["--noused_microbatching"])
  assert rc == 0 and "without microbatching" in out
  poisson = float(re.search(r"Epsilon assuming Poisson sampling .*: ([\d.]+)", out).group(1))
  assert poisson == pytest.approx(_poisson_epsilon(), rel=1e-3)   # printed to 4 digits
  rc, same, _ = _run(capsys, BASE + ["--used_microbatching=false"])
  assert rc == 0 and same == out


@pytest.mark.parametrize("flag", [["--used_microbatching"], ["--used_microbatching=true"],
                                  ["--used_microbatching", "yes"]])
def test_used_microbatching_gives_no_poisson_number(capsys, flag):
  rc, out, _ = _run(capsys, BASE + flag)
  assert rc == 0 and ", with microbatching" in out
  assert "Epsilon assuming Poisson sampling (*): not given" in out


def test_accountant_type_is_tf_privacys_spelling(capsys):
  rc, out, _ = _run(capsys, BASE + ["--noused_microbatching", "--accountant_type", "PLD"])
  assert rc == 0 and "PLD accountant" in out
  rc, _, err = _run(capsys, BASE + ["--accountant_type", "PLD", "--accountant", "rdp"])
  assert rc == 2 and "--accountant rdp and --accountant_type PLD disagree" in err


def test_contradictions_are_refused_with_the_flags_named(capsys):
  rc, _, err = _run(capsys, BASE + ["--noused_microbatching", "--num_microbatches", "32"])
  assert rc == 2 and "--noused_microbatching contradicts --num_microbatches 32" in err
  rc, _, err = _run(capsys, BASE + ["--used_microbatching", "--sampling", "poisson"])
  assert rc == 2 and "--sampling poisson is not used by the statement" in err
  with pytest.raises(SystemExit):
    cli.compute_dp_sgd_privacy_main(BASE + ["--used_microbatching=maybe"])
  assert "must be true or false, got 'maybe'" in capsys.readouterr().err


def test_help_offers_only_accountants_that_run(capsys):
  for fn in (cli.compute_dp_sgd_privacy_main, cli.compute_noise_from_budget_main):
    with pytest.raises(SystemExit):
      fn(["--help"])
    assert "prv" not in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.dp_ledger_main(["report", "--help"])
  assert "prv" not in capsys.readouterr().out
  for acc in cli.cli_accountants():   # every accountant offered is accepted
    rc, out, err = _run(capsys, BASE + ["--accountant", acc])
    assert rc == 0, err
  with pytest.raises(SystemExit):
    cli.compute_dp_sgd_privacy_main(BASE + ["--accountant", "prv"])
  assert "invalid choice: 'prv'" in capsys.readouterr().err


def test_poisson_number_comes_with_a_note_on_sampling(capsys):
  rc, out, _ = _run(capsys, BASE)
  assert rc == 0 and f"epsilon = {_poisson_epsilon():.6g}" in out
  assert "note: this epsilon assumes Poisson sampling" in out and "--sampling shuffle" in out
  rc, out, _ = _run(capsys, BASE + ["--sampling", "shuffle"])
  assert rc == 0 and "note: this epsilon assumes Poisson" not in out


def test_ledger_report_says_when_the_run_did_not_sample_by_poisson(tmp_path, capsys):
  led = L.PrivacyLedger()
  for _ in range(20):   # two shuffled passes of 10 batches of 100 of 1000, microbatches of 4
    led.record_sample(1000.0, 0.1, (dq.GaussianSumEvent(1.0, 1.3),), policy="shuffle",
                      sample_size=100, examples_per_record=4)
  led.record_passes(2)
  path = str(tmp_path / "l.json")
  led.save_json(path)
  rc, out, err = _run(capsys, ["report", path, "--delta", "1e-5"], cli.dp_ledger_main)
  assert rc == 0, err
  note = [l for l in out.splitlines() if l.startswith("note: run 1 used shuffle sampling of "
                                                      "microbatches of 4 examples")]
  assert len(note) == 1 and "is not this run's epsilon" in note[0]
  call = note[0].split("compute_dp_sgd_privacy ")[-1].split()
  rc, again, err = _run(capsys, call)
  assert rc == 0, err
  eps = float(again.split("epsilon = ")[1].split()[0])
  assert eps == pytest.approx(accounting.epsilon(led, 1e-5), rel=1e-5)
  # a Poisson ledger gets no note
  led2 = L.PrivacyLedger()
  led2.record_sample(1000.0, 0.01, (dq.GaussianSumEvent(1.0, 1.0),))
  led2.save_json(path)
  rc, out, _ = _run(capsys, ["report", path, "--delta", "1e-5"], cli.dp_ledger_main)
  assert rc == 0 and "note:" not in out


def _module(capsys, monkeypatch, *args):
  """`python -m tf_dpiter.accounting ARGS` in this process: the package's __main__ module run
  as the main module (runpy, what `-m` does after starting the interpreter), its exit status
  taken from the SystemExit its last line raises: (status, stdout, stderr)."""
  monkeypatch.setattr(sys, "argv", ["tf_dpiter.accounting", *args])
  # a fresh interpreter has not imported the module yet (runpy warns when it has)
  monkeypatch.delitem(sys.modules, "tf_dpiter.accounting.__main__", raising=False)
  capsys.readouterr()
  with pytest.raises(SystemExit) as stop:
    runpy.run_module("tf_dpiter.accounting", run_name="__main__", alter_sys=True)
  out = capsys.readouterr()
  return stop.value.code, out.out, out.err


def test_python_dash_m_lists_the_commands_and_runs_them(capsys, monkeypatch):
  rc, out, err = _module(capsys, monkeypatch, "--help")
  assert rc == 0, err
  for name in ("compute_dp_sgd_privacy", "compute_noise_from_budget", "dp_ledger"):
    assert name in out
  rc, out, err = _module(capsys, monkeypatch, "compute_dp_sgd_privacy", *BASE)
  assert rc == 0, err
  assert f"epsilon = {_poisson_epsilon():.6g}" in out
  rc, _, err = _module(capsys, monkeypatch, "nonsense")
  assert rc == 2 and "unknown command 'nonsense'" in err


def test_main_dispatches_in_process(capsys):
  assert main_lib.main(["compute-dp-sgd-privacy"] + BASE) == 0
  assert "epsilon = " in capsys.readouterr().out
  assert main_lib.main([]) == 2
