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


def test_from_budget_epsilon_after_fit_is_within_the_target():
  n, b, epochs, target, delta = 110, 20, 3, 2.0, 1e-3   # round(5.5) = 6 > 5.5 per epoch
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype("float32")
  y = rng.integers(0, 2, size=n)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  opt = dp.keras.from_budget(keras.optimizers.SGD(0.1), target, delta, epochs, b, n,
                             l2_norm_clip=1.0)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=b, epochs=epochs, verbose=0)
  steps = int(model.optimizer.iterations.numpy())
  assert steps == epochs * round(n / b) == 18 > math.ceil(epochs * n / b)
  z = opt.noise_multiplier
  assert _epsilon(b / n, z, steps, delta) <= target
  eps = dp.accounting.privacy_report(model.ledger, delta=delta).epsilon
  assert eps <= target * (1 + 1e-6)


def test_training_past_the_calibrated_target_warns_naming_both_epsilons():
  n, b, delta = 100, 20, 1e-3
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, 4)).astype("float32")
  y = rng.integers(0, 2, size=n)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  opt = dp.keras.from_budget(keras.optimizers.SGD(0.1), 2.0, delta, 1, b, n, l2_norm_clip=1.0)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*calibrated target")   # the calibrated epoch
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)
  with pytest.warns(UserWarning, match=r"past the calibrated target.*epsilon=2\b"):
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*calibrated target")   # once per optimizer
    model.fit(x, y, batch_size=b, epochs=1, verbose=0)
