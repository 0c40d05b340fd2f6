"""Warnings (and one refusal) where a user is about to mislead themselves: each message names
the parameter, its value and what to do."""

import re
import warnings

import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.errors import BudgetConfigError


def _no_warning(fn):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return fn()


# ---- noise_multiplier = 0 at optimizer construction --------------------------------------

def test_noise_zero_optimizer_warns_with_value_and_remedy():
  with pytest.warns(UserWarning, match=r"noise_multiplier=0\.0: .*NOT differentially private"
                    r".*Use noise_multiplier > 0"):
    opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0,
                                       learning_rate=0.1)
  assert opt.noise_multiplier == 0.0   # a warning, not a refusal: tests train with noise 0


def test_noisy_optimizer_does_not_warn():
  _no_warning(lambda: dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                   learning_rate=0.1))


def test_noise_zero_ledger_really_reports_infinite_epsilon():
  """The warning says the ledger reports epsilon = inf: check that it does."""
  led = ledger_lib.PrivacyLedger()
  led.record_sample(1000.0, 0.01, (dq.GaussianSumEvent(1.0, 0.0),))
  assert accounting.privacy_report(led, delta=1e-5).epsilon == np.inf


# ---- delta >= 1/n in the report path ----------------------------------------------------

def test_report_with_delta_at_least_one_over_n_warns():
  led = ledger_lib.PrivacyLedger()
  for _ in range(5):
    led.record_sample(100.0, 0.1, (dq.GaussianSumEvent(1.0, 1.0),))
  with pytest.warns(UserWarning, match=r"delta=0\.02 is >= 1/n = 1/100 = 0\.01 .*Use delta "
                    r"well below 1/n"):
    report = accounting.privacy_report(led, delta=0.02)
  assert np.isfinite(report.epsilon)   # still reported: the warning does not change it
  _no_warning(lambda: accounting.privacy_report(led, delta=1e-3))


def test_statement_with_large_delta_warns():
  with pytest.warns(UserWarning, match=r"delta=0\.001 is >= 1/n = 1/1000"):
    accounting.compute_dp_sgd_privacy_statement(1000, 10, 1, 1.0, 1e-3,
                                                used_microbatching=False)
  _no_warning(lambda: accounting.compute_dp_sgd_privacy_statement(
      1000, 10, 1, 1.0, 9e-4, used_microbatching=False))


def test_cli_prints_the_delta_warning_once(capsys):
  from tf_dpiter.accounting import cli  # pylint: disable=g-import-not-at-top
  argv = ["--N", "1000", "--batch_size", "10", "--noise_multiplier", "1", "--epochs", "1",
          "--delta", "0.002"]
  for extra in ([], ["--noused_microbatching"]):
    assert cli.compute_dp_sgd_privacy_main(argv + extra) == 0
    err = capsys.readouterr().err
    assert err.count("warning: delta=0.002 is >= 1/n = 1/1000") == 1, err
  assert cli.compute_dp_sgd_privacy_main(argv[:-1] + ["1e-4"]) == 0
  assert "warning" not in capsys.readouterr().err


def test_calibration_without_a_population_does_not_warn():
  """calibrate_noise_multiplier(q, steps) uses a placeholder n: no delta warning."""
  _no_warning(lambda: accounting.calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100))


# ---- from_budget / make_private_with_epsilon --------------------------------------------

def test_from_budget_refuses_batch_larger_than_population():
  with pytest.raises(BudgetConfigError, match=re.escape(
      "batch_size=512 is larger than population_size=100")) as e:
    dp.keras.DPKerasSGDOptimizer.from_budget(1.0, 1e-5, 2, 512, 100, l2_norm_clip=1.0,
                                             learning_rate=0.1)
  assert "Use batch_size <= population_size" in str(e.value)


def test_from_budget_warns_once_for_large_delta():
  with pytest.warns(UserWarning, match=r"delta=0\.01 is >= 1/n = 1/100") as rec:
    opt = dp.keras.DPKerasSGDOptimizer.from_budget(3.0, 1e-2, 1, 10, 100, l2_norm_clip=1.0,
                                                   learning_rate=0.1)
  assert sum("1/n" in str(w.message) for w in rec) == 1
  assert opt.noise_multiplier > 0


def test_fit_with_a_batch_larger_than_the_data_warns_naming_both():
  import keras  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(0).random((20, 4)).astype("float32")
  y = np.arange(20) % 2
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with pytest.warns(UserWarning, match=r"batch_size=50 is larger than the 20 training examples"):
    model.fit(x, y, batch_size=50, epochs=1, verbose=0)
  assert model.optimizer.dp_query.get_config()["selection_probability"] == 1.0
