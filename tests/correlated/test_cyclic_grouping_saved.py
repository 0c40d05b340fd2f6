"""The cyclic Poisson grouping of a correlated-noise (BandMF) run is ledger state.

Relation and unit: add or remove one example; the unit is the example. The ledger charges
ceil(T / b) Poisson rounds only while every example keeps its group, i.e. its identity (its
rows' bytes, dtype and shape, or its example_ids), so its participations stay >= b steps
apart (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Theorem 4).
The ledger keeps a digest of the run's identities (`PrivacyLedger.cyclic_grouping`): a fit
after a tf.train.Checkpoint restore, a model.save / load_model or a weights-file reload
(new ledger objects, as in a new process) refuses a regrouping dataset and continues with
the same one once the run's noise state is restored from its private file (no model file
holds it: it is the noise; without it the fit is refused before any step)."""

import functools
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import sampling
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import PrivacyLedger
from tf_dpiter.ledger import ledger_file

B = 2
N = 64
STEPS = 3


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N).astype("int64")


def _model(journal=None):
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.1, noise="band_mf",
                                     num_bands=B, num_steps=4 * STEPS, ledger_journal=journal)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _ds(x, y, steps, seed, **kw):
  return cyclic_poisson_batches(x, y, expected_batch_size=8, num_groups=B,
                                steps_per_epoch=steps, seed=seed, **kw)


def _groups(ds):
  s = sampling.get_sampling_spec(ds).sampler
  return [s.group_of(i) for i in range(N)]


def _min_gap(groups_per_fit, steps_per_fit):
  """The least distance between two global steps at which one example's group is sampled."""
  last, gap, t = [None] * N, math.inf, 0
  for groups, steps in zip(groups_per_fit, steps_per_fit):
    for _ in range(steps):
      for i in range(N):
        if groups[i] == t % B:
          if last[i] is not None:
            gap = min(gap, t - last[i])
          last[i] = t
      t += 1
  return gap


@functools.lru_cache(maxsize=None)
def _first_fit():
  """(model, x, y, ds1): the run's first fit of STEPS steps, taken once per process: the
  tests that call it only read the model (its ledger, noise state and files written from
  it); each restores into, and fits, models of its own."""
  keras.utils.set_random_seed(0)
  x, y = _data()
  model = _model()
  ds1 = _ds(x, y, STEPS, seed=1)   # odd: the next fit starts mid-cycle
  model.fit(ds1, epochs=1, verbose=0)
  return model, x, y, ds1


NO_NOISE_STATE = r"cannot resume from a saved model or checkpoint: its noise state is not saved"


def _check_restored(model, x, y, ds1, noise_file):
  """On a model whose ledger was restored into a new object: a regrouping dataset is refused
  (its premise: some example would be eligible at steps < b apart); the run's own is refused
  until the noise state is restored (`noise_file`), then continues with participations >= b
  apart."""
  assert model.optimizer.ledger.cyclic_grouping == sampling.get_sampling_spec(
      ds1).sampler.grouping
  regrouped = _ds(x, y.astype("int32"), STEPS + 1, seed=2)
  assert _min_gap([_groups(ds1), _groups(regrouped)], [STEPS, STEPS + 1]) < B
  with pytest.raises(PrivacyConfigError, match="grouping"):
    model.fit(regrouped, epochs=1, verbose=0)
  with pytest.raises(PrivacyConfigError, match="grouping"):
    model.fit(_ds(x, y, STEPS, seed=3, example_ids=np.arange(N)), epochs=1, verbose=0)
  assert int(model.optimizer.ledger.sample_count.numpy()) == STEPS   # no step taken
  same = _ds(x.copy(), y.copy(), STEPS + 1, seed=4)
  with pytest.raises(PrivacyConfigError, match=NO_NOISE_STATE):
    model.fit(same, epochs=1, verbose=0)
  assert int(model.optimizer.ledger.sample_count.numpy()) == STEPS   # no step taken
  model.optimizer.private_step.restore_noise_state(noise_file)
  same = _ds(x.copy(), y.copy(), STEPS + 1, seed=4)
  model.fit(same, epochs=1, verbose=0)
  assert int(model.optimizer.ledger.sample_count.numpy()) == 2 * STEPS + 1
  assert _min_gap([_groups(ds1), _groups(same)], [STEPS, STEPS + 1]) >= B


def test_tf_train_checkpoint_carries_the_grouping(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, x, y, ds1 = _first_fit()
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(tmp_path / "ckpt"))
    fresh = _model()
    fresh.build((None, 6))
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.optimizer.ledger   # the ledger object exists before the restore: a new object
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(path).expect_partial()
    assert int(fresh.optimizer.iterations.numpy()) == STEPS
    noise_file = str(tmp_path / "noise.npz")
    model.optimizer.private_step.save_noise_state(noise_file)
    _check_restored(fresh, x, y, ds1, noise_file)


def _through_keras_file(model, tmp_path):
  model.save(tmp_path / "m.keras")
  return keras.models.load_model(tmp_path / "m.keras")


def _through_weights_file(model, tmp_path):
  model.save_weights(tmp_path / "m.weights.h5")
  fresh = _model()
  fresh.build((None, 6))
  fresh.optimizer.build(fresh.trainable_variables)
  fresh.load_weights(tmp_path / "m.weights.h5")
  return fresh


@pytest.mark.parametrize("through", [_through_keras_file, _through_weights_file])
def test_a_saved_file_carries_the_grouping(tmp_path, through):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, x, y, ds1 = _first_fit()
    noise_file = str(tmp_path / "noise.npz")
    model.optimizer.private_step.save_noise_state(noise_file)
    _check_restored(through(model, tmp_path), x, y, ds1, noise_file)


def test_the_ledger_file_carries_the_grouping_signed():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, _, _, ds1 = _first_fit()
  ledger = model.optimizer.ledger
  grouping = sampling.get_sampling_spec(ds1).sampler.grouping
  assert PrivacyLedger.from_json(ledger.to_json()).cyclic_grouping == grouping
  assert PrivacyLedger.from_json(ledger.to_json("k"), key="k").cyclic_grouping == grouping
  d = ledger.to_dict()
  d["cyclic_grouping"] = "sha256:" + "0" * 64
  with pytest.raises(ParameterValueError, match="altered"):
    PrivacyLedger.from_dict(d)


def test_a_ledger_without_a_record_does_not_continue_a_correlated_run():
  """A ledger of an earlier version (its rows, no grouping record) cannot tell a regrouping
  from the run's own grouping: the correlated cyclic run is refused, not guessed."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, x, y, _ = _first_fit()
    d = model.optimizer.ledger.to_dict()
    del d["cyclic_grouping"]
    fresh = _model()
    fresh.optimizer.ledger.merge_arrays(*PrivacyLedger.from_dict(
        ledger_file.sign(d)).state())
    fresh.optimizer.iterations.assign(STEPS)
    assert fresh.optimizer.ledger.cyclic_grouping is None
    with pytest.raises(PrivacyConfigError, match="without a record"):
      fresh.fit(_ds(x, y, STEPS, seed=5), epochs=1, verbose=0)


def test_the_journal_carries_the_grouping(tmp_path):
  """A fresh optimizer resuming the run from its ledger journal (its weights and iterations
  restored by a partial checkpoint) continues with the run's grouping and refuses another."""
  journal = str(tmp_path / "run.journal")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = _model(journal=journal)
    ds1 = _ds(x, y, STEPS, seed=1)
    model.fit(ds1, epochs=1, verbose=0)
    noise_file = str(tmp_path / "noise.npz")
    model.optimizer.private_step.save_noise_state(noise_file)
    fresh = _model(journal=journal)
    fresh.build((None, 6))
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.optimizer.private_step.restore_noise_state(noise_file)
    fresh.set_weights(model.get_weights())
    fresh.optimizer.iterations.assign(STEPS)
    assert fresh.optimizer.ledger.cyclic_grouping is None   # the journal is read by fit
    regrouped = _ds(x, y.astype("int32"), STEPS + 1, seed=2)
    with pytest.raises(PrivacyConfigError, match="grouping"):
      fresh.fit(regrouped, epochs=1, verbose=0)
    assert fresh.optimizer.ledger.cyclic_grouping == sampling.get_sampling_spec(
        ds1).sampler.grouping
    fresh.fit(_ds(x, y, STEPS + 1, seed=4), epochs=1, verbose=0)
    assert int(fresh.optimizer.ledger.sample_count.numpy()) == 2 * STEPS + 1
