"""Ports of TF Privacy's tutorials run end to end in quick mode with the default clipping
("auto"): each prints its task metric and epsilon, and epsilon is the ledger's (checked
against dp-accounting composed by hand for the steps taken). TF Privacy's Keras MNIST
tutorials and its MovieLens tutorial: tests/keras/test_tf_privacy_tutorials.py."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import dp_accounting as dpa
import pytest

from tests.conftest import MNIST_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args):
  """Runs tutorials/<script> as a script in a process of its own: (stdout, its JSON line)."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tutorials", script), "--quick",
                         *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def _run_here(capsys, script, *args):
  """Runs tutorials/<script>'s main(["--quick", *args]) in this process (what the script's
  `__main__` calls; these tutorials set no process-wide state): (stdout, its JSON line)."""
  spec = importlib.util.spec_from_file_location(
      "tutorial_" + script[:-3], os.path.join(ROOT, "tutorials", script))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  capsys.readouterr()
  module.main(["--quick", *args])
  stdout = capsys.readouterr().out
  return stdout, json.loads(stdout.strip().splitlines()[-1])


def _poisson_epsilon(q, z, steps, delta):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)   # the ledger holds q and z in float32: compare at 1e-6


@pytest.mark.slow   # a full tutorial run (120 steps of a custom loop); -m slow
def test_eager_loop_tutorial(capsys):
  """compute_private_gradients + apply_private_gradients in a custom loop (10 classes)."""
  stdout, out = _run_here(capsys, "eager_loop_dp.py")
  assert out["steps"] == 3 * 40     # 3 epochs of round(1 / q) = 40 Poisson samples
  assert out["epsilon"] == pytest.approx(_poisson_epsilon(50 / 2000, 1.1, 120, 1e-5), rel=1e-6)
  assert out["test_accuracy"] > 0.5, stdout          # chance: 0.1
  assert "add or remove one example" in stdout


@pytest.mark.slow   # a full tutorial run; -m slow
def test_lstm_language_model_tutorial():
  """Per-token compiled loss on an LSTM (unroll=False) with clipping='auto'."""
  stdout, out = _run("lstm_lm_dp.py", "--verbose", "0")
  assert out["clipping"] == "auto" and out["steps"] == 2 * 20
  assert out["epsilon"] == pytest.approx(_poisson_epsilon(100 / 2000, 1.0, 40, 1e-5), rel=1e-6)
  assert out["test_accuracy"] > 0.2, stdout          # chance: 1/40; the chain's best ~0.6
  assert math.isfinite(out["bayes_accuracy"])


# ---- TF Privacy's MNIST tutorials and an Opacus user's script (tutorials/mnist_*.py) -------
# Quick mode: the first 2000 training images (500 test), expected batch 100 (q = 0.05). MNIST
# from $TF_DPITER_MNIST or /work/shared/data/mnist.npz; a synthetic keras-layout npz when
# neither exists (the accounting checks do not depend on the images).

MNIST_N, MNIST_B = 2000, 100


@pytest.fixture(scope="module")
def mnist_path(mnist_or_synthetic_path):
  return mnist_or_synthetic_path


@pytest.mark.parametrize("script", [
    "mnist_keras_functional.py",
    pytest.param("mnist_lr.py", marks=pytest.mark.slow)])
def test_mnist_poisson_tutorials(script, mnist_path, capsys):
  """Functional model with TF Privacy's DP model arguments, and logistic regression: Poisson
  samples (q = 0.05), epsilon of the steps taken (TF Privacy's Keras MNIST tutorials and
  MovieLens: tests/keras/test_tf_privacy_tutorials.py)."""
  stdout, out = _run_here(capsys, script, "--data_path", mnist_path)
  epochs = 2 if script == "mnist_lr.py" else 1
  assert (out["sampling"], out["steps"]) == ("poisson", epochs * MNIST_N // MNIST_B)
  assert out["q"] == pytest.approx(MNIST_B / MNIST_N)
  assert out["epsilon"] == pytest.approx(
      _poisson_epsilon(MNIST_B / MNIST_N, 1.1, out["steps"], 1e-5), rel=1e-6)
  assert "NOT this run's" not in stdout and "add or remove one" in stdout
  if script == "mnist_keras_functional.py":   # TF Privacy's call agrees: the run was Poisson
    assert out["epsilon_tf_privacy_call"] == pytest.approx(out["epsilon"], rel=1e-6)
  if script == "mnist_lr.py" and mnist_path == MNIST_PATH:   # real MNIST: chance 0.1
    assert out["test_accuracy"] > 0.4, stdout   # (measured 0.68-0.71 on MNIST; the synthetic
    # set's classes differ by brightness only, which a linear model does not learn in 40 steps:
    # 0.12-0.18, so its run is checked for its sampling and epsilon above only)


@pytest.mark.slow   # a full tutorial run; -m slow
def test_opacus_style_script(mnist_path):
  """make_private_with_epsilon + a train_on_batch loop on Poisson batches: the printed
  epsilon is the ledger's, dp-accounting's for the calibrated z, and within the target."""
  stdout, out = _run("opacus_style_mnist.py", "--data_path", mnist_path)
  assert (out["sampling"], out["steps"]) == ("poisson", 2 * MNIST_N // MNIST_B)
  assert out["epsilon"] == pytest.approx(
      _poisson_epsilon(MNIST_B / MNIST_N, out["noise_multiplier"], out["steps"], 1e-5),
      rel=1e-6)
  assert out["epsilon"] <= out["target_epsilon"] * (1 + 1e-6)
  assert out["epsilon"] > 0.9 * out["target_epsilon"]   # calibrated, not merely bounded
  assert stdout.count("Train Epoch:") == 2
