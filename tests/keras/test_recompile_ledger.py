"""Recompiling a DP-trained model with a new DP optimizer keeps every earlier step charged:
the ledger travels with the weights (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 6), as it does through a
weights file. Review R: a recompile (a new learning rate, Adam for fine-tuning) started the
ledger afresh, so epsilon covered only the steps after it (3.442 against 4.224 for 20 steps).

100 examples, batch 10 (q = 0.1), z = 1.0, delta 1e-5; epsilon against dp-accounting by hand."""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _by_hand(steps):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), steps)
  return acc.get_epsilon(1e-5)


def test_recompiles_with_new_dp_optimizers_keep_every_step_charged(tmp_path):
  rng = np.random.RandomState(0)
  x, y = rng.randn(100, 3).astype("float32"), rng.randint(0, 2, 100)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  optimizers = [dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01),
                dp.keras.DPKerasAdamOptimizer(1.0, 1.0, learning_rate=0.01)]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i, opt in enumerate(optimizers):
      model.compile(optimizer=opt, loss=LOSS)
      model.fit(x, y, batch_size=10, epochs=1, verbose=0)
      assert int(model.ledger.sample_count.numpy()) == 10 * (i + 1)
    model.compile(optimizer=optimizers[-1], loss=LOSS)   # the same optimizer again: no change
    assert int(model.ledger.sample_count.numpy()) == 30
    epsilon = dp.accounting.epsilon(model.ledger, 1e-5, accountant="rdp")
    assert abs(epsilon - _by_hand(30)) <= 1e-9 * _by_hand(30), (epsilon, _by_hand(30))
    # a weights file written now carries the 30 steps, not the last optimizer's 10
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    fresh.load_weights(path)
    fresh.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0), loss=LOSS)
    fresh.fit(x, y, batch_size=10, epochs=1, verbose=0)
  assert int(fresh.ledger.sample_count.numpy()) == 40


def test_make_private_after_a_refused_plain_recompile_keeps_the_ledger():
  # Review R (session 33): compile(Adam) on a trained DP model is refused after Keras compiled
  # it; following the message, make_private installed a DP copy with an empty ledger (2
  # samples for 12 steps: epsilon 2.413 instead of 3.619). The copy now adopts the ledger.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype(np.float32)
  y = rng.normal(size=(40, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01), loss="mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)                 # 10 steps, q = 0.1
    with pytest.raises(dp.errors.ParameterValueError, match="make_private"):
      model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)
    model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 12
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 12)
  assert dp.accounting.epsilon(model.ledger, 1e-5) == pytest.approx(acc.get_epsilon(1e-5),
                                                                    rel=1e-6)
