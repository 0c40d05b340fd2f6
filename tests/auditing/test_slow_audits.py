"""Long audits (marked slow): the white-box bound reaches half the claim with enough trials,
and the MNIST audit tutorial runs end to end on the real data."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import tf_dpiter.auditing as audit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DELTA = 1e-5
Z_FOR_STEP_EPSILON = {1: 3.7306, 2: 1.9938, 4: 1.0812, 8: 0.6002}   # q = 1, one step, PLD


@pytest.mark.slow
@pytest.mark.parametrize("target", [1, 2, 4, 8])
def test_whitebox_bound_reaches_half_of_claim(target):
  # 2000 in- and ~2000 out-canaries x 200 steps = ~4e5 one-step trials per class.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 8)).astype(np.float32)
  y = rng.integers(0, 3, 256)
  keras.utils.set_random_seed(0)
  base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
  r = audit.run_whitebox_audit(base, x, y, 3, num_canaries=4000,
                               noise_multiplier=Z_FOR_STEP_EPSILON[target],
                               sampling_probability=1.0, steps=200, delta=DELTA,
                               sampling_seed=1, noise_seed=2, ledger_accountant=None)
  claim = r.step_claimed_epsilon()
  print(f"claim {claim:.3f}: bound {r.step_bound.epsilon:.3f} from "
        f"{int(r.included.sum()) * r.steps} member trials")
  assert 0.5 * claim <= r.step_bound.epsilon <= claim


@pytest.mark.slow
def test_audit_mnist_tutorial_quick(mnist_path, tmp_path):
  report = os.path.join(tmp_path, "audit.png")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tutorials", "audit_mnist.py"), "--quick",
       "--data_path", mnist_path, "--report", report],
      capture_output=True, text=True, timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
  dp, nonp = out["DP-SGD"], out["non-private"]
  assert nonp["claimed_epsilon"] == "inf" and 0 < dp["claimed_epsilon"] < 50
  assert dp["whitebox_epsilon_lb"] <= dp["whitebox_claimed_epsilon"]
  assert dp["whitebox_step_epsilon_lb"] <= dp["whitebox_step_claimed_epsilon"]
  assert dp["lira_epsilon_lb"] <= dp["claimed_epsilon"]
  # Without noise the canaries are seen exactly: a bound far above the private run's.
  assert nonp["whitebox_step_epsilon_lb"] > 5.0 > dp["whitebox_step_epsilon_lb"]
  assert 0.0 <= dp["lira_auc"] <= 1.0 and 0.0 <= nonp["lira_auc"] <= 1.0
  assert os.path.getsize(report) > 10000
