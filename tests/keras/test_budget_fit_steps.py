"""from_budget plans the steps a Poisson `fit` really takes (round(n / B) per epoch), so the
ledger's epsilon after fit is <= the target (it overshot when round(n / B) > n / B)."""

import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import budget


def _epsilon(q, z, steps, delta):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)


def test_fit_steps_counts_round_n_over_b_per_epoch():
  # n / B = 53.7: fit takes 54 per epoch, 2,160 in 40 epochs; ceil(40 n / B) = 2,149.
  assert budget.fit_steps(55000, 1024, 40, "poisson") == 2160
  assert math.ceil(40 * 55000 / 1024) == 2149
  # n / B = 2.4: round gives 2 per epoch, fewer than ceil(E n / B); the larger is kept.
  assert budget.fit_steps(120, 50, 3, "poisson") == 8
  assert budget.fit_steps(120, 50, 2.5, "poisson") == math.ceil(2.5 * 120 / 50)


def test_from_budget_epsilon_after_fit_is_within_the_target_and_warns_once_past_it():
  """One calibration (seconds of RDP evaluations) and one model for the whole scenario: the
  calibrated epochs stay within the target without a warning, one more epoch goes past it
  and warns naming both epsilons, once per optimizer."""
  n, b, epochs, target, delta = 110, 20, 3, 2.0, 1e-3   # round(5.5) = 6 > 5.5 per epoch
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype("float32")
  y = rng.integers(0, 2, size=n)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  opt = dp.keras.from_budget(keras.optimizers.SGD(0.1), target, delta, epochs, b, n,
                             l2_norm_clip=1.0)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*calibrated target")   # the calibrated epochs
    model.fit(x, y, batch_size=b, epochs=epochs, verbose=0)
  steps = int(model.optimizer.iterations.numpy())
  assert steps == epochs * round(n / b) == 18 > math.ceil(epochs * n / b)
  z = opt.noise_multiplier
  assert _epsilon(b / n, z, steps, delta) <= target
  eps = dp.accounting.privacy_report(model.ledger, delta=delta).epsilon
  assert eps <= target * (1 + 1e-6)
  with pytest.warns(UserWarning, match=r"past the calibrated target.*epsilon=2\b"):
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*calibrated target")   # once per optimizer
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)
  assert dp.accounting.privacy_report(model.ledger, delta=delta).epsilon > target


def _calibrated_run(n_calibrated, b_calibrated, epochs_calibrated, n, b, steps):
  """The message for a run of `steps` Poisson samples at q = b / n, against a calibration for
  (n_calibrated, b_calibrated, epochs_calibrated) to epsilon = 2 at delta = 1e-3 (the dict
  from_budget keeps, with z = 1.16, about what it calibrates for 20 steps at q = 0.1: the
  calibration itself takes seconds); the ledger is written by the query wrapper itself
  (eagerly, no fit: fast)."""
  from tf_dpiter.keras.model import statement  # pylint: disable=g-import-not-at-top
  z = 1.16
  calib = {"epsilon": 2.0, "delta": 1e-3, "epochs": epochs_calibrated,
           "batch_size": b_calibrated, "population_size": n_calibrated, "sampling": "poisson",
           "steps": budget.fit_steps(n_calibrated, b_calibrated, epochs_calibrated, "poisson"),
           "accountant": "rdp", "noise_multiplier": z}
  ledger = dp.ledger.PrivacyLedger()
  query = dp.ledger.QueryWithLedger(dp.dp_query.GaussianSumQuery(1.0, z), n, b / n,
                                    ledger=ledger, policy="poisson", sample_size=b)
  template = np.zeros(3, np.float32)
  for _ in range(steps):
    query.get_noised_result(query.initial_sample_state(template),
                            query.initial_global_state())
  report = dp.accounting.privacy_report(ledger, delta=1e-3)
  assert report.epsilon > 2.0
  return calib, statement.past_target_message(ledger, calib, report)


def test_fewer_steps_at_a_larger_q_warns_which_way_with_both_numbers():
  # Calibrated for n = 200, B = 20 (q = 0.1), 2 epochs: 20 steps. The run has half the data
  # (n = 100, q = 0.2): 10 steps, FEWER than calibrated, each costing more.
  calib, text = _calibrated_run(200, 20, 2, 100, 20, 10)
  assert calib["steps"] == 20
  assert text.startswith("the run's epsilon went past the calibrated target")
  assert "FEWER private steps than calibrated (10 against 20)" in text
  assert "LARGER sampling probability: q=0.2 with population n=100" in text
  assert "calibrated q=0.1 with n=200" in text
  assert "MORE" not in text and "exceeds epsilon=2," in text


def test_more_steps_than_calibrated_warns_with_both_step_counts():
  calib, text = _calibrated_run(100, 20, 1, 100, 20, 10)
  assert calib["steps"] == 5
  assert "MORE private steps than calibrated: 10 against 5." in text
  assert "FEWER" not in text and "larger q" not in text
