"""Console scripts, called as a user would (through their main functions)."""

import os
import shutil
import subprocess
import sys

import pytest

from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.accounting import cli


def test_compute_dp_sgd_privacy_cli(capsys):
  rc = cli.compute_dp_sgd_privacy_main(["--N", "60000", "--batch_size", "256",
                                        "--noise_multiplier", "1.1", "--epochs", "60",
                                        "--delta", "1e-5"])
  out = capsys.readouterr().out
  assert rc == 0 and "epsilon = 2.59666" in out and "Poisson" in out


def test_compute_noise_from_budget_cli(capsys):
  rc = cli.compute_noise_from_budget_main(["--N", "60000", "--batch_size", "256",
                                           "--epsilon", "2.597", "--epochs", "60",
                                           "--delta", "1e-5"])
  out = capsys.readouterr().out
  z = float(out.split("noise_multiplier = ")[1].split()[0])
  assert rc == 0 and z == pytest.approx(1.1, abs=1e-3) and "<= 2.597" in out


def test_dp_ledger_report_cli(tmp_path, capsys):
  led = L.PrivacyLedger()
  for _ in range(10):
    led.record_sample(1000.0, 0.01, (dq.GaussianSumEvent(1.0, 1.0),))
  path = str(tmp_path / "l.json")
  led.save_json(path)
  assert cli.dp_ledger_main(["report", path, "--delta", "1e-5"]) == 0
  assert "-DP over 10 samples" in capsys.readouterr().out


def test_cli_bad_input_is_a_clear_error(tmp_path, capsys):
  rc = cli.compute_dp_sgd_privacy_main(["--N", "60000", "--batch_size", "256",
                                        "--noise_multiplier", "1.1", "--epochs", "60",
                                        "--delta", "2"])
  assert rc == 2 and "delta must be in (0, 1), got 2.0" in capsys.readouterr().err
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2")
  assert cli.dp_ledger_main(["report", str(bad), "--delta", "1e-5"]) == 2
  assert "bad.json" in capsys.readouterr().err


def test_console_script_installed():
  script = os.path.join(os.path.dirname(sys.executable), "compute_dp_sgd_privacy")
  script = script if os.path.exists(script) else shutil.which("compute_dp_sgd_privacy")
  assert script, "console script compute_dp_sgd_privacy is not installed (pip install -e .)"
  out = subprocess.run([script, "--N", "60000", "--batch_size", "150",
                        "--noise_multiplier", "1.3", "--epochs", "15", "--delta", "1e-5"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "epsilon = 0.72422" in out.stdout


@pytest.mark.parametrize("args,expected", [
    (["--sampling", "shuffle", "--num_microbatches", "32"], "replace one example (records are microbatches of 8"),
    (["--sampling", "fixed_size"], "replace one example"),
    (["--sampling", "poisson"], "add or remove one example"),
])
def test_compute_dp_sgd_privacy_cli_states_relation_and_unit(capsys, args, expected):
  rc = cli.compute_dp_sgd_privacy_main(["--N", "60000", "--batch_size", "256",
                                        "--noise_multiplier", "1.1", "--epochs", "2",
                                        "--delta", "1e-5"] + args)
  assert rc == 0 and expected in capsys.readouterr().out


def test_cli_refuses_microbatches_with_poisson(capsys):
  rc = cli.compute_dp_sgd_privacy_main(["--N", "60000", "--batch_size", "256",
                                        "--noise_multiplier", "1.1", "--epochs", "2",
                                        "--delta", "1e-5", "--num_microbatches", "32"])
  assert rc == 2 and "microbatches" in capsys.readouterr().err


def test_dp_ledger_report_refuses_tampered_file_and_checks_key(tmp_path, capsys):
  led = L.PrivacyLedger()
  for _ in range(10):
    led.record_sample(1000.0, 0.01, (dq.GaussianSumEvent(1.0, 1.0),))
  path, key = tmp_path / "l.json", tmp_path / "key"
  key.write_bytes(b"s3cret\n")
  led.save_json(str(path), key=b"s3cret")
  assert cli.dp_ledger_main(["report", str(path), "--delta", "1e-5", "--key-file", str(key)]) == 0
  capsys.readouterr()
  path.write_text(path.read_text().replace('"stddev": 1.0', '"stddev": 9.0'))
  assert cli.dp_ledger_main(["report", str(path), "--delta", "1e-5"]) == 2
  assert "altered" in capsys.readouterr().err


def test_dp_ledger_report_starts_without_tensorflow(tmp_path):
  """`dp_ledger report` and `import tf_dpiter.accounting` never import TensorFlow."""
  code = ("import sys, tf_dpiter.accounting, tf_dpiter.accounting.cli; "
          "print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "False"
