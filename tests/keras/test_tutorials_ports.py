"""Ports of TF Privacy's tutorials run end to end in quick mode with the default clipping
("auto"): each prints its task metric and epsilon, and epsilon is the ledger's (checked
against dp-accounting composed by hand for the steps taken)."""

import json
import math
import os
import subprocess
import sys

import dp_accounting as dpa
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", script), "--quick",
                         *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def _poisson_epsilon(q, z, steps, delta):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)   # the ledger holds q and z in float32: compare at 1e-6


def test_eager_loop_tutorial():
  """compute_private_gradients + apply_private_gradients in a custom loop (10 classes)."""
  stdout, out = _run("eager_loop_dp.py")
  assert out["steps"] == 3 * 40     # 3 epochs of round(1 / q) = 40 Poisson samples
  assert out["epsilon"] == pytest.approx(_poisson_epsilon(50 / 2000, 1.1, 120, 1e-5), rel=1e-6)
  assert out["test_accuracy"] > 0.5, stdout          # chance: 0.1
  assert "add or remove one example" in stdout


def test_movielens_tutorial():
  """User and movie embeddings (functional DPModel, dict inputs), Poisson fit, RMSE."""
  stdout, out = _run("movielens_dp.py", "--verbose", "0")
  assert out["steps"] == 2 * 30
  assert out["epsilon"] == pytest.approx(_poisson_epsilon(200 / 6000, 0.8, 60, 1e-5), rel=1e-6)
  assert out["test_rmse"] < 0.95 * out["baseline_rmse"], stdout
  assert 0.25 < out["test_accuracy"] <= 1
  # TF Privacy's GDP number is printed beside, labelled as an approximation
  assert 0 < out["epsilon_gdp"] < out["epsilon"]
  assert "an approximation, not an upper bound" in stdout


def test_lstm_language_model_tutorial():
  """Per-token compiled loss on an LSTM (unroll=False) with clipping='auto'."""
  stdout, out = _run("lstm_lm_dp.py", "--verbose", "0")
  assert out["clipping"] == "auto" and out["steps"] == 2 * 20
  assert out["epsilon"] == pytest.approx(_poisson_epsilon(100 / 2000, 1.0, 40, 1e-5), rel=1e-6)
  assert out["test_accuracy"] > 0.2, stdout          # chance: 1/40; the chain's best ~0.6
  assert math.isfinite(out["bayes_accuracy"])
