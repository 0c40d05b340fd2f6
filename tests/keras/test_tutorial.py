"""The MNIST tutorial runs end to end (on a small synthetic keras-layout npz) and ends with
its JSON summary line."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_dpiter.keras.optimizer import routing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_tutorial(capsys, monkeypatch, argv):
  """The tutorial's standard output for `argv`: its main() in this process when this process
  runs oneDNN as the tutorial sets it (TF_ENABLE_ONEDNN_OPTS=1, read once per process; the
  printed lines are what is tested, not the process), else the script in a subprocess."""
  script = os.path.join(ROOT, "tutorials", "mnist_dpsgd_keras.py")
  if routing.onednn_enabled():
    # the script sets these with os.environ.setdefault: this process gets its own back after
    # the test (monkeypatch restores a variable it set, or removes one that was absent)
    for name in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL"):
      absent = name not in os.environ
      monkeypatch.setenv(name, os.environ.get(name, ""))
      if absent:
        monkeypatch.delenv(name)
    spec = importlib.util.spec_from_file_location("tutorial_mnist_dpsgd_keras", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    module.main(argv)
    return capsys.readouterr().out
  proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize("sampling,decay", [("poisson", "constant"),
                                           pytest.param("shuffle", "cosine", marks=pytest.mark.slow)])
def test_tutorial_quick_on_small_data(tmp_path, capsys, monkeypatch, sampling, decay):
  rng = np.random.RandomState(0)
  path = os.path.join(tmp_path, "mnist_small.npz")
  # 320 training examples: 5 Poisson steps of 64 an epoch (the tutorial's check_sensitivity
  # reads the first 64)
  y_tr = rng.randint(0, 10, 320).astype("uint8")
  x_tr = (rng.rand(320, 28, 28) * 60 + y_tr[:, None, None] * 19).astype("uint8")
  y_te = rng.randint(0, 10, 200).astype("uint8")
  x_te = (rng.rand(200, 28, 28) * 60 + y_te[:, None, None] * 19).astype("uint8")
  np.savez(path, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
  stdout = _run_tutorial(capsys, monkeypatch, [
      "--quick", "--data_path", path, "--batch_size", "64", "--verbose", "0",
      "--sampling", sampling, "--decay", decay,
      "--ledger_path", os.path.join(tmp_path, "ledger.json")])
  out = json.loads(stdout.strip().splitlines()[-1])
  assert set(out) >= {"test_accuracy", "epsilon", "delta", "epochs", "seconds"}
  assert out["epochs"] == 2 and out["delta"] == 1e-5 and out["sampling"] == sampling
  assert out["decay"] == decay
  assert 0 < out["epsilon"] < 100 and 0 <= out["test_accuracy"] <= 1
  # --quick prints check_sensitivity's verdict on the tutorial CNN before training
  verdict = [l for l in stdout.splitlines() if "[check_sensitivity" in l]
  assert len(verdict) == 1 and verdict[0].startswith("OK: measured sensitivity"), stdout
  with open(os.path.join(tmp_path, "ledger.json")) as f:
    assert json.load(f)["num_samples"] == out["steps"] > 0
