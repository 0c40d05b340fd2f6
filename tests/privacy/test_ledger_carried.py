"""Weights never train on from a ledger that misses their steps.

* A model file carries its ledger in the model's own weights entry, so
  `load_model(path, compile=False)` + `compile` with a fresh DP optimizer, and
  `load_weights` into a new model, continue the ledger (before: an empty ledger, epsilon of
  the new steps only).
* `restore_ledger` refuses another run's ledger (another noise multiplier, clip or policy).
* A journal is resumed only by an optimizer restored at an iteration the journal recorded:
  a fresh optimizer given trained weights and a journal cut to half its lines is refused
  (before: 15 samples charged for 20 released steps).

Relation and unit: add/remove one example (fit's Poisson sampling on arrays). Epsilon is
compared with dp-accounting called by hand on the steps actually released.
"""

import os

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp

S, Z, N, B, DELTA, STEPS = 1.0, 1.0, 64, 16, 1e-5, 4


def _model(z=Z, journal=None):
  model = dp.keras.DPSequential([keras.Input((8,)), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(S, z, learning_rate=0.1, ledger_journal=journal)
  model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 8)).astype("float32"), rng.integers(0, 3, N)


def _fit(model, epochs=1):
  x, y = _data()
  model.fit(x, y, batch_size=B, epochs=epochs, verbose=0)


def _hand_epsilon(steps, z=Z):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(B / N, dpa.GaussianDpEvent(z)),
                                  steps)
  return dpa.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)


def _assert_charged(model, steps):
  assert int(model.ledger.sample_count.numpy()) == steps
  eps = dp.accounting.epsilon(model.ledger, DELTA, accountant="rdp")
  assert eps == pytest.approx(_hand_epsilon(steps), rel=1e-6)


def test_load_model_without_compile_then_a_fresh_optimizer_continues_the_ledger(tmp_path):
  model = _model()
  _fit(model, epochs=3)                                   # 12 steps
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path, compile=False)
  loaded.compile(dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=0.1),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  assert int(loaded.optimizer.iterations.numpy()) == 0
  _fit(loaded)                                            # 4 more
  _assert_charged(loaded, 16)


def test_save_weights_into_a_new_model_continue_the_ledger(tmp_path):
  model = _model()
  _fit(model, epochs=2)
  path = str(tmp_path / "w.weights.h5")
  model.save_weights(path)
  fresh = _model()
  fresh.load_weights(path)
  _fit(fresh)
  _assert_charged(fresh, 12)


def test_restore_ledger_refuses_another_runs_ledger(tmp_path):
  other = _model(z=50.0)
  _fit(other)
  path = str(tmp_path / "other.json")
  other.ledger.save_json(path)
  model = _model()
  with pytest.raises(dp.errors.PrivacyConfigError, match="noise_multiplier=50"):
    model.optimizer.restore_ledger(path)
  assert int(model.optimizer.ledger.sample_count.numpy()) == 0
  mine = _model()
  _fit(mine)
  mine.ledger.save_json(path)
  model.optimizer.restore_ledger(path)                    # the same mechanism: accepted
  assert int(model.ledger.sample_count.numpy()) == STEPS


def test_restore_ledger_refuses_another_sampling_policy(tmp_path):
  shuffled = _model()
  x, y = _data()
  shuffled.fit(x, y, batch_size=B, epochs=1, verbose=0, sampling="shuffle")
  model = _model()
  _fit(model)                                             # declares Poisson
  with pytest.raises(dp.errors.PrivacyConfigError, match="policy 'shuffle'"):
    model.optimizer.restore_ledger(shuffled.ledger)


def test_a_cut_journal_resumed_by_a_fresh_optimizer_is_refused(tmp_path):
  journal = str(tmp_path / "run.journal")
  model = _model(journal=journal)
  _fit(model, epochs=2)                                   # 8 steps, one journal chunk each
  with open(journal) as f:
    lines = f.readlines()
  with open(journal, "w") as f:
    f.writelines(lines[:len(lines) // 2])
  fresh = _model(journal=journal)
  fresh.set_weights(model.get_weights())                  # trained weights, iterations 0
  with pytest.raises(dp.errors.PrivacyConfigError, match="not written at optimizer iterations=0"):
    _fit(fresh)
  assert int(fresh.optimizer.iterations.numpy()) == 0     # no step taken


def test_a_journal_resumed_at_a_recorded_iteration_charges_every_step(tmp_path):
  """The legitimate resume: the model restored at a step the journal recorded (here a save
  after 4 steps, the journal at 8) continues, charging the abandoned steps too."""
  journal = str(tmp_path / "run.journal")
  model = _model(journal=journal)
  _fit(model)
  path = str(tmp_path / "m.keras")
  model.save(path)
  _fit(model)
  restored = keras.models.load_model(path)
  assert os.path.exists(journal)
  _fit(restored)
  _assert_charged(restored, 12)
