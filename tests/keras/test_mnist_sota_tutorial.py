"""tutorials/mnist_sota.py --quick runs end to end (on a small synthetic keras-layout npz) and
prints the epsilon that dp-accounting gives for the steps it took, composed here by hand.

The runs share one feature cache (--cache_dir, a directory per test module): the synthetic
images are the same in every run, so the scattering features of a split are computed (an XLA
compilation and a pass over the padded batch of 1,000 images) by the first run that needs
them and loaded by the others."""

import importlib.util
import json
import os

import dp_accounting
import numpy as np
import pytest

# Nightly tier (-m slow): the private tuning run (the quick run stays).
SLOW_CASES = {
    "test_private_tuning_charges_the_selection_in_the_printed_epsilon"}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _synthetic_mnist(path):
  rng = np.random.RandomState(0)
  y_tr = rng.randint(0, 10, 700).astype("uint8")
  x_tr = (rng.rand(700, 28, 28) * 60 + y_tr[:, None, None] * 19).astype("uint8")
  y_te = rng.randint(0, 10, 200).astype("uint8")
  x_te = (rng.rand(200, 28, 28) * 60 + y_te[:, None, None] * 19).astype("uint8")
  np.savez(path, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
  """The tutorial's --cache_dir, shared by this module's runs."""
  return str(tmp_path_factory.mktemp("scattering_features"))


def _quick_run(tmp_path, capsys, cache_dir, *flags):
  """Runs `mnist_sota.py --quick` (its main(), in this process: what the script's `__main__`
  calls) on a small synthetic npz, its features cached in `cache_dir`; its last JSON line."""
  path = os.path.join(tmp_path, "mnist_small.npz")
  _synthetic_mnist(path)
  spec = importlib.util.spec_from_file_location(
      "tutorial_mnist_sota", os.path.join(ROOT, "tutorials", "mnist_sota.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  capsys.readouterr()
  module.main(["--quick", "--data_path", path, "--validation_size", "100", "--cache_dir", cache_dir,
               "--ema_decay", "0.9", "--seed", "1", *flags])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_quick_run_prints_the_ledger_epsilon(tmp_path, capsys, feature_cache):
  out = _quick_run(tmp_path, capsys, feature_cache, "--epsilon", "2.5")
  assert out["population"] == 600 and out["epochs"] == 2 and out["eval_on"] == "test"
  assert out["steps"] > 0 and 0.0 <= out["accuracy"] <= 1.0
  # epsilon of `steps` Poisson-sampled Gaussian steps at q = batch / n, composed by hand
  q = out["batch_size"] / out["population"]
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
          out["noise_multiplier"])), out["steps"])
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(event)
  # (the ledger keeps the noise in float32: agreement to float32 precision)
  np.testing.assert_allclose(out["epsilon"], accountant.get_epsilon(out["delta"]), rtol=1e-6)
  # the noise was calibrated to the target for the planned steps (2 epochs of n / B)
  assert out["epsilon"] <= 2.5 * (1 + 1e-6) or out["steps"] > 2 * round(1 / q)


def _by_hand_selection(out):
  """dp-accounting by hand: the best of K ~ TNB(mean, shape) trials, each `steps` Poisson
  Gaussian steps at q = B / n then a Gaussian count of multiplier score_noise."""
  q = out["batch_size"] / out["population"]
  trial = dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(out["noise_multiplier"])), out["steps"]),
      dp_accounting.GaussianDpEvent(out["score_noise"])])
  with_selection = dp_accounting.rdp.RdpAccountant()
  with_selection.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(
      trial, out["tuning_mean"], out["tuning_shape"]))
  one_trial = dp_accounting.rdp.RdpAccountant()
  one_trial.compose(trial)
  return with_selection.get_epsilon(out["delta"]), one_trial.get_epsilon(out["delta"])


def test_private_tuning_charges_the_selection_in_the_printed_epsilon(tmp_path, capsys,
                                                                    feature_cache):
  out = _quick_run(tmp_path, capsys, feature_cache, "--epsilon", "3", "--private_tuning",
                   "--tuning_learning_rates", "0.5,2", "--tuning_mean", "2",
                   "--tuning_seed", "1", "--report_trials")
  assert out["private_tuning"] and out["eval_on"] == "test" and out["validation_size"] == 100
  assert out["trials"] == 2 and len(out["trial_scores"]) == 2   # K drawn with --tuning_seed 1
  assert out["selected_learning_rate"] in (0.5, 2.0) and out["learning_rate"] == pytest.approx(
      out["selected_learning_rate"])
  # the released trial is the one with the best noisy score
  assert out["noisy_validation_accuracy"] == max(
      t["noisy_validation_accuracy"] for t in out["trial_scores"])
  assert out["steps"] == 2 * round(out["population"] / out["batch_size"])
  expected, one_trial = _by_hand_selection(out)
  np.testing.assert_allclose(out["epsilon"], expected, rtol=1e-6)
  np.testing.assert_allclose(out["trial_epsilon"], one_trial, rtol=1e-6)
  # the training noise was calibrated so that the selection meets the target
  assert out["epsilon"] <= 3.0 * (1 + 1e-6) and out["epsilon"] > 2.9
  assert out["trial_epsilon"] < out["epsilon"]
