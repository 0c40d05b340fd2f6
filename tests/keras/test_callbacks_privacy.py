"""PrivacyMeter / StopAtPrivacyBudget in fit: budgets exceeded before the first step, logs
seen by every callback whatever the order, and the epsilon-over-steps PNG."""

import csv
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting

# Nightly tier (-m slow): the first-step budget stop with verbose=1 (verbose=0
# stays: the same stop and ledger; the printed line is the meter tests').
SLOW_CASES = {
    "test_budget_exceeded_by_the_first_step_stops_cleanly[1]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5


def _built_model():
  """Built before fit (an Input layer) and compiled with a metric: Keras builds the compiled
  metrics in the first train step only, the case that crashed when no step ran."""
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), loss=LOSS,
                metrics=["accuracy"])
  return model


def _data(n=100, seed=0):
  rng = np.random.RandomState(seed)
  return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


class _LogRecorder(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.epoch_logs = []

  def on_epoch_end(self, epoch, logs=None):
    self.epoch_logs.append(dict(logs))


@pytest.mark.parametrize("verbose", [0, 1])
def test_budget_exceeded_by_the_first_step_stops_cleanly(verbose):
  x, y = _data()
  model = _built_model()
  stop = dp.keras.callbacks.StopAtPrivacyBudget(0.01, DELTA)
  with pytest.warns(UserWarning, match=r"stopping before training: the next step would reach "
                    r"epsilon [0-9.]+ > 0.01 .*no training step was taken"):
    history = model.fit(x, y, batch_size=20, epochs=3, verbose=verbose,
                        callbacks=[stop, dp.keras.PrivacyMeter(DELTA)])
  assert int(model.ledger.sample_count.numpy()) == 0
  assert stop.stopped_at_step == 0
  assert history.history["epsilon"] == [0.0]
  if not verbose:   # the fit below does not depend on the stopped fit's verbosity: run once
    return
  # the model is usable afterwards: a fit within a larger budget trains and reports metrics
  history = model.fit(x, y, batch_size=20, epochs=1, verbose=0,
                      callbacks=[dp.keras.callbacks.StopAtPrivacyBudget(50.0, DELTA)])
  assert int(model.ledger.sample_count.numpy()) == 5
  assert "accuracy" in history.history


@pytest.fixture(scope="module")
def metered_fit(tmp_path_factory):
  """One 2-epoch fit (10 Poisson steps, q = 20 / 100, z = 1) with a CSVLogger and a recorder
  listed before a PrivacyMeter that plots: (model, meter, recorder, CSV path, PNG path). The
  two tests below read it; neither changes it."""
  tmp = tmp_path_factory.mktemp("metered_fit")
  x, y = _data()
  model = _built_model()
  recorder = _LogRecorder()
  csv_path, png_path = tmp / "log.csv", tmp / "eps.png"
  meter = dp.keras.PrivacyMeter(DELTA, plot=str(png_path), plot_points=5)
  model.fit(x, y, batch_size=20, epochs=2, verbose=0,
            callbacks=[keras.callbacks.CSVLogger(str(csv_path)), recorder, meter])
  return model, meter, recorder, csv_path, png_path


def test_privacy_logs_reach_callbacks_listed_before_the_meter(metered_fit):
  _, _, recorder, path, _ = metered_fit
  with open(path) as f:
    rows = list(csv.DictReader(f))
  assert [float(r["delta"]) for r in rows] == [DELTA, DELTA]
  eps_csv = [float(r["epsilon"]) for r in rows]
  eps_seen = [logs["epsilon"] for logs in recorder.epoch_logs]
  assert eps_csv == pytest.approx(eps_seen, rel=1e-12)
  assert 0 < eps_seen[0] < eps_seen[1]
  # independent path: 10 Poisson-sampled Gaussian steps (q = 20/100, z = 1) by dp-accounting
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(1.0)),
                                      10))
  assert eps_seen[1] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_meters_of_an_earlier_fit_do_not_write_logs():
  x, y = _data()
  model = _built_model()
  model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[dp.keras.PrivacyMeter(1e-3)])
  recorder = _LogRecorder()
  model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[recorder])
  assert "epsilon" not in recorder.epoch_logs[0]


def test_privacy_meter_plot_writes_a_png_of_the_ledger_curve(metered_fit):
  model, meter, _, _, path = metered_fit
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert meter.epoch_steps == [5, 10]
  curve = accounting.epsilon_curve(model.ledger, DELTA, num_points=5)
  assert curve.steps == (2, 4, 6, 8, 10)
  assert curve.epsilon[-1] == pytest.approx(meter.epsilon, rel=1e-12)


def test_privacy_meter_refuses_bad_arguments():
  with pytest.raises(ValueError, match="accountant`? must be one of"):
    dp.keras.PrivacyMeter(DELTA, accountant="moments")
  with pytest.raises(ValueError, match="accountant='prv' is not available"):
    dp.keras.PrivacyMeter(DELTA, accountant="prv")
  with pytest.raises(ValueError, match="plot must be None or a PNG file path"):
    dp.keras.PrivacyMeter(DELTA, plot=3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dp.keras.PrivacyMeter(DELTA, accountant="gdp")


# --- issue 38, finding 7: GDP is an approximation; stopping and calibration refuse it ---

_GDP_REFUSED = r"`accountant` must be 'pld' or 'rdp' .*accountant='gdp'.*Received: accountant='gdp'"


def test_stop_at_privacy_budget_refuses_gdp():
  """Before: StopAtPrivacyBudget(4, accountant="gdp") let a run reach a true epsilon of 7.78."""
  with pytest.raises(dp.errors.BudgetConfigError, match=_GDP_REFUSED):
    dp.keras.callbacks.StopAtPrivacyBudget(4.0, DELTA, accountant="gdp")
  assert dp.keras.callbacks.StopAtPrivacyBudget(4.0, DELTA, accountant="pld").accountant == "pld"


def test_from_budget_and_make_private_with_epsilon_refuse_gdp():
  args = dict(epsilon=4.0, delta=1e-6, epochs=3, batch_size=10000, population_size=800167,
              l2_norm_clip=1.0, accountant="gdp")
  with pytest.raises(dp.errors.BudgetConfigError, match=_GDP_REFUSED):
    dp.keras.from_budget(keras.optimizers.SGD(0.1), **args)
  with pytest.raises(dp.errors.BudgetConfigError, match=_GDP_REFUSED):
    dp.keras.make_private_with_epsilon(keras.Sequential([keras.layers.Dense(1)]),
                                       keras.optimizers.SGD(0.1), **args)
  with pytest.raises(dp.errors.BudgetConfigError, match=_GDP_REFUSED):
    dp.keras.DPKerasSGDOptimizer.from_budget(4.0, 1e-6, 3, 10000, 800167, l2_norm_clip=1.0,
                                             accountant="gdp")


def test_privacy_meter_marks_gdp_as_approximate_in_its_line(capsys):
  import math  # pylint: disable=g-import-not-at-top
  from scipy import optimize, stats  # pylint: disable=g-import-not-at-top
  x, y = _data()
  model = _built_model()
  recorder = _LogRecorder()
  meter = dp.keras.PrivacyMeter(DELTA, accountant="gdp", verbose=1)
  model.fit(x, y, batch_size=20, epochs=2, verbose=0, callbacks=[recorder, meter])
  logs = recorder.epoch_logs[-1]
  # never under the key a budget reads as a bound
  assert "epsilon" not in logs and "epsilon_gdp_approximate" in logs
  steps = int(model.ledger.sample_count.numpy())
  q = float(model.optimizer.dp_query.selection_probability)
  mu = q * math.sqrt(steps * math.expm1(1.0))             # z = 1 (Bu et al. CLT), by hand
  f = lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)
  by_hand = optimize.brentq(lambda e: f(e) - DELTA, 0, 100, xtol=1e-12)
  assert logs["epsilon_gdp_approximate"] == pytest.approx(by_hand, rel=1e-6)
  out = capsys.readouterr().out
  line = [s for s in out.splitlines() if s.startswith("epoch 2:")][0]
  assert f"{logs['epsilon_gdp_approximate']:.4g}" in line and "approximate" in line
  statement = str(model.privacy_statement(DELTA, accountant="gdp")).splitlines()[0]
  assert "approximate" in statement and f"{by_hand:.4g}" in statement
