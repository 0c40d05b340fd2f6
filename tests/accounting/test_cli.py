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
  assert rc == 2 and "`delta` must be a number in (0, 1). Received: delta=2.0" in capsys.readouterr().err
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


def _ledger_file(tmp_path, key=None):
  led = L.PrivacyLedger()
  for q, count in ((0.01, 30), (0.02, 10)):
    for _ in range(count):
      led.record_sample(1000.0, q, (dq.GaussianSumEvent(1.0, 1.1),))
  path = str(tmp_path / "l.json")
  led.save_json(path, key=key)
  return path


def test_counts_accept_float_notation(capsys):
  args = ["--batch_size", "2.56e2", "--noise_multiplier", "1.1", "--epochs", "3",
          "--delta", "1e-5"]
  assert cli.compute_dp_sgd_privacy_main(["--N", "6e4"] + args) == 0
  with_float = capsys.readouterr().out
  assert cli.compute_dp_sgd_privacy_main(["--N", "60000"] + args) == 0
  assert capsys.readouterr().out == with_float and "n=60000 records" in with_float
  with pytest.raises(SystemExit):
    cli.compute_dp_sgd_privacy_main(["--N", "1.5e0"] + args)
  assert "argument --N: must be a whole number, got '1.5e0'" in capsys.readouterr().err


def test_errors_print_plain_numbers(capsys):
  assert cli.plain_numbers("got np.float64(1.5), np.int64(3) and np.float32(nan)") == (
      "got 1.5, 3 and nan")
  for bad in (["--delta", "1.5"], ["--epochs", "0"], ["--noise_multiplier", "-1"]):
    args = {"--N": "1e5", "--batch_size": "256", "--noise_multiplier": "1.1", "--epochs": "3",
            "--delta": "1e-5"}
    args.update(dict([bad]))
    assert cli.compute_dp_sgd_privacy_main([t for kv in args.items() for t in kv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "np." not in err and bad[1] in err


def test_dp_ledger_show_lists_the_runs(tmp_path, capsys):
  path = _ledger_file(tmp_path, key=b"k")
  assert cli.dp_ledger_main(["show", path]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("40 samples in 2 runs, 0 shuffled passes recorded; integrity: sha256 "
                         "digest ok, HMAC present")
  assert out[1].startswith("run 1: steps 1-30 (30), poisson sampling, n = 1000, q = 0.01")
  assert out[1].endswith("add or remove one example")
  assert out[2] == ("    query 1: gaussian clip 1, stddev 1.1, sensitivity 1 "
                    "(noise multiplier 1.1)")
  assert out[3].startswith("run 2: steps 31-40 (10), poisson sampling, n = 1000, q = 0.02")


def test_dp_ledger_plot_writes_the_curve(tmp_path, capsys):
  import dp_accounting as dpa  # pylint: disable=g-import-not-at-top
  path, png = _ledger_file(tmp_path), str(tmp_path / "eps.png")
  assert cli.dp_ledger_main(["plot", path, "--delta", "1e-5", "--out", png, "--points", "4"]) == 0
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  out = capsys.readouterr().out
  acc = dpa.rdp.RdpAccountant()   # independent: the 40 steps composed by hand
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 30))
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1)), 10))
  assert f"to {acc.get_epsilon(1e-5):.4g} (step 40)" in out


@pytest.mark.parametrize("script", ["compute_dp_sgd_privacy", "compute_noise_from_budget",
                                    "dp_ledger"])
def test_help_imports_neither_tensorflow_nor_the_accountant(script):
  """--help answers before any heavy import (TensorFlow, dp-accounting, scipy)."""
  fn = {"compute_dp_sgd_privacy": "compute_dp_sgd_privacy_main",
        "compute_noise_from_budget": "compute_noise_from_budget_main",
        "dp_ledger": "dp_ledger_main"}[script]
  code = ("import sys, io, contextlib\nfrom tf_dpiter.accounting import cli\n"
          "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
          f"  try:\n    cli.{fn}(['--help'])\n  except SystemExit:\n    pass\n"
          "assert 'usage: " + script + "' in out.getvalue()\n"
          "print(sorted(m for m in ('tensorflow', 'dp_accounting', 'scipy') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def test_compute_dp_sgd_privacy_statement_cli(capsys):
  rc = cli.compute_dp_sgd_privacy_main(["--N", "6e4", "--batch_size", "256", "--noise_multiplier",
                                        "1.1", "--epochs", "3", "--delta", "1e-5", "--statement",
                                        "--max_examples_per_user", "2"])
  out = capsys.readouterr().out
  assert rc == 0 and out.startswith("DP-SGD over 60000 examples with 256 examples per step")
  assert "without microbatching, and at most 2 examples per user." in out
  assert "User-level DP (a user is up to 2 examples" in out
