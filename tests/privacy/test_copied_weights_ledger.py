"""Weights copied by value keep their run's ledger, and one run is charged once however many
of its views meet (`keras.optimizer.weight_fingerprints`, `ledger.run_ids`).

Relation and unit: add/remove one example, Poisson sampling q = 16/64, S = 1, z = 1 (noise
on: a released state names its run, since its noise came from OS entropy); a sample is one
noised step. Epsilon is compared with dp-accounting's RDP accountant called by hand at
delta = 1e-5 (McMahan et al. 2018, "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", Section 6: every noised step that touched the released
weights is charged once).

Measured before session 47 (review R17's fix with its "adopt only without a ledger of its
own" rule): a model loaded from run A's file given run C's weights by value charged A's 4
steps and its own, not C's 3 (5 for 8).
"""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
import tf_dpiter.keras  # noqa: F401  (registers the DP classes for load_model)

DELTA = 1e-5


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(64, 8)).astype("float32"),
          rng.normal(size=(64, 3)).astype("float32"))


def _model(z=1.0, journal=None):
  model = dp.keras.DPSequential([keras.Input((8,)), keras.layers.Dense(3)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, z, learning_rate=0.1,
                                             ledger_journal=journal), "mse")
  return model


def _fit(model, steps):
  x, y = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, verbose=0)
  return model


def _samples(model):
  return int(model.optimizer.ledger.sample_count.numpy())


def _by_hand(steps, q=0.25, z=1.0):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  return dpa.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)


def test_a_model_loaded_in_process_continues_its_run_once(tmp_path):
  """Run A, 4 steps, saved and loaded in this process (its weights are A's released state,
  its ledger A's file copy), 1 step more: 5 samples (A's 4 once, not 4 from the file and 4
  adopted from the live run), epsilon = 5 steps by hand."""
  a = _fit(_model(), 4)
  path = str(tmp_path / "a.keras")
  a.save(path)
  loaded = _fit(keras.models.load_model(path), 1)
  assert _samples(loaded) == 5
  assert dp.accounting.epsilon(loaded.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(_by_hand(5), rel=1e-6))


def test_a_fresh_optimizer_resuming_the_journal_of_the_run_it_copied_charges_it_once(tmp_path):
  """Run A, 3 steps with a ledger journal; a fresh model given A's weights by value and A's
  iterations, resuming A's journal, 1 step more: 4 samples (A's 3 adopted from the live
  ledger and read from the journal are one run), epsilon = 4 steps by hand."""
  journal = str(tmp_path / "a.journal")
  a = _fit(_model(journal=journal), 3)
  fresh = _model(journal=journal)
  fresh.build((None, 8))
  fresh.optimizer.build(fresh.trainable_variables)
  fresh.set_weights(a.get_weights())
  fresh.optimizer.iterations.assign(3)
  _fit(fresh, 1)
  assert _samples(fresh) == 4
  assert dp.accounting.epsilon(fresh.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(_by_hand(4), rel=1e-6))


def test_a_copy_is_charged_the_steps_its_values_took_not_the_source_runs_later_ones():
  """Run A's weights copied after its 4th step, A trained 4 steps more, the copy given the
  values of step 4 and 1 step more: 5 samples (A's first 4 and its own), epsilon = 5 steps by
  hand; A's ledger holds 8. (Before, the copy adopted A's ledger as it was at the copy's
  start: 9.)"""
  a = _fit(_model(), 4)
  values = a.get_weights()
  _fit(a, 4)
  assert _samples(a) == 8
  copy = _model()
  copy.set_weights(values)
  _fit(copy, 1)
  assert _samples(copy) == 5
  assert dp.accounting.epsilon(copy.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(_by_hand(5), rel=1e-6))


def test_a_loaded_model_given_another_runs_weights_charges_both_runs(tmp_path):
  """Run A, 4 steps, saved and loaded; run C, 3 steps, live; the loaded model given C's
  weights by value, 1 step more: its weights took C's 3 steps and its own; its ledger
  holds A's 4 (it continues A's ledger), C's 3 and its own: 8 samples."""
  a = _fit(_model(), 4)
  path = str(tmp_path / "a.keras")
  a.save(path)
  c = _fit(_model(), 3)
  loaded = keras.models.load_model(path)
  loaded.set_weights(c.get_weights())
  _fit(loaded, 1)
  assert _samples(loaded) == 8
  ids = {rid for rid, n, _ in loaded.optimizer.ledger.run_table() if n}
  assert c.optimizer.ledger.run_id in ids


def test_a_noiseless_runs_values_name_no_run():
  """A run with z = 0 (not private) registers no released state: two runs of one recipe
  with one seed make the same values (tests/correlated/test_cyclic_grouping_saved), and a
  copy would adopt each, every one a run of its own identity (12 samples for 3 measured).
  A copy of its weights, 1 step more: its own step only."""
  a = _fit(_model(z=0.0), 3)
  copy = _model(z=0.0)
  copy.set_weights(a.get_weights())
  _fit(copy, 1)
  assert _samples(copy) == 1
