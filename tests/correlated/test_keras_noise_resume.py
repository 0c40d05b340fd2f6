"""A correlated-noise run restored from a saved model resumes only through its private
noise-state file, and then exactly.

The mechanism's state (BandMF noise history / tree nodes / BLT buffers) is the noise of the
released weights, so no model file or checkpoint holds it (review R3, finding 11;
test_noise_state_not_saved.py). `model.save` + `load_model`, `tf.train.Checkpoint` and
`keras.callbacks.BackupAndRestore` keep the weights, iterations and ledger; a fit of the
restored run is refused before any step (PrivacyConfigError naming the remedy), unless
`optimizer.private_step.restore_noise_state(path)` restores the state `save_noise_state(path)`
wrote at the same step (a file as secret as the data). For tree, band_mf and blt: T steps
uninterrupted vs T1 steps, save, restore into a fresh model and optimizer, restore the noise
state, T - T1 steps, with the same seeds and the same batches, give the same weights and the
same ledger (samples, passes, epsilon from dp-accounting through the ledger). A noise state
of another step is refused. Relation: replace one (tree, shuffled passes), add/remove one
(band_mf, blt, cyclic Poisson); unit: the example.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import sampling
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.data.shuffling import shuffled_batches
from tf_dpiter.errors import PrivacyConfigError

DELTA = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 4   # per epoch; T1 = 4, T = 8
MECHANISMS = {
    "tree": {"restart_every": 2},
    "band_mf": {"num_bands": 2, "num_steps": 2 * STEPS},
    "blt": {"num_steps": 2 * STEPS, "num_buffers": 2, "min_separation": 2},
}


def _dataset(noise):
  """The same batches for the same call order (the samplers are seeded: tests only)."""
  rng = np.random.RandomState(0)
  x, y = rng.randn(48, 6).astype("float32"), rng.randint(0, 3, 48)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if noise == "tree":
      return shuffled_batches(x, y, batch_size=12, seed=1)          # 4 steps per pass
    return cyclic_poisson_batches(x, y, expected_batch_size=6, num_groups=2,
                                  steps_per_epoch=STEPS, seed=1)


def _skip_epoch(ds):
  """Draws one epoch of `ds` (so its sampler is where the interrupted run left it) without
  reporting its pass to any ledger."""
  for _ in ds:
    pass
  sampler = sampling.get_sampling_spec(ds).sampler
  if hasattr(sampler, "take_new_passes"):
    sampler.take_new_passes()


def _model(noise, journal=None):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = dp.keras.DPKerasAdamOptimizer(1.0, 0.9, seed=7, noise=noise, learning_rate=0.05,
                                        ledger_journal=journal, **MECHANISMS[noise])
  model.compile(optimizer=opt, loss=LOSS)
  return model


def _fit(model, ds, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(ds, verbose=0, **kwargs)


REFUSAL = r"cannot resume from a saved model or checkpoint: its noise state is not saved"


def _snapshot(model):
  """What must match: iterations, weights, optimizer variables (the seeded generator
  included), the mechanism's state, ledger arrays, passes and epsilon."""
  led = model.ledger
  return {"iterations": int(model.optimizer.iterations.numpy()),
          "weights": [v.numpy() for v in model.trainable_variables],
          "optimizer": [np.asarray(v) for v in model.optimizer.variables],
          "noise": [np.asarray(a) for a in model.optimizer.noise_state()],
          "ledger": [a.copy() for a in led.get_arrays()], "passes": int(led.passes),
          "samples": int(led.sample_count), "epsilon": dp.accounting.epsilon(led, DELTA)}


_UNINTERRUPTED = {}


def _uninterrupted(noise, tmp_path):
  """T steps in one run (one fit per epoch, as the resumed runs), computed once per noise."""
  if noise not in _UNINTERRUPTED:
    model = _model(noise, journal=str(tmp_path / "straight.journal"))
    ds = _dataset(noise)
    _fit(model, ds, epochs=1)
    _fit(model, ds, epochs=1)
    _UNINTERRUPTED[noise] = _snapshot(model)
  return _UNINTERRUPTED[noise]


def _assert_same_run(model, want):
  got = _snapshot(model)
  assert got["iterations"] == want["iterations"] == 2 * STEPS
  assert got["samples"] == want["samples"] == 2 * STEPS and got["passes"] == want["passes"]
  for key in ("weights", "optimizer", "noise"):
    assert len(got[key]) == len(want[key])
    for a, b in zip(got[key], want[key]):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  for a, b in zip(got["ledger"], want["ledger"]):
    np.testing.assert_array_equal(a, b)
  assert got["epsilon"] == pytest.approx(want["epsilon"], rel=1e-12)


def _params(default):
  """The noise kinds to run by default (one per save format, every kind once); the rest slow."""
  return [n if n == default else pytest.param(n, marks=pytest.mark.slow)
          for n in sorted(MECHANISMS)]


def _refused(model, ds, **kwargs):
  """A fit of a restored run without its noise state: refused before any step."""
  before = (int(model.optimizer.iterations.numpy()), [w.copy() for w in model.get_weights()])
  with pytest.raises(PrivacyConfigError, match=REFUSAL):
    _fit(model, ds, epochs=1, **kwargs)
  assert int(model.optimizer.iterations.numpy()) == before[0] == STEPS
  assert int(model.ledger.sample_count) == STEPS   # nothing released, nothing charged
  for a, b in zip(model.get_weights(), before[1]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("noise", _params("band_mf"))
def test_model_save_and_load_model_resume_exactly(noise, tmp_path):
  want = _uninterrupted(noise, tmp_path)
  first = _model(noise, journal=str(tmp_path / "resumed.journal"))
  ds = _dataset(noise)
  _fit(first, ds, epochs=1)
  first.save(str(tmp_path / "m.keras"))
  first.optimizer.private_step.save_noise_state(str(tmp_path / "noise.npz"))
  refused = keras.models.load_model(str(tmp_path / "m.keras"))   # journal path in its config
  _refused(refused, _dataset(noise))
  resumed = keras.models.load_model(str(tmp_path / "m.keras"))
  resumed.optimizer.private_step.restore_noise_state(str(tmp_path / "noise.npz"))
  _fit(resumed, ds, epochs=1)
  _assert_same_run(resumed, want)


def test_a_noise_state_of_another_step_is_refused(tmp_path):
  """The state after 2 T1 steps restored into the model saved after T1: refused."""
  first = _model("band_mf")
  ds = _dataset("band_mf")
  _fit(first, ds, epochs=1)
  first.save(str(tmp_path / "m.keras"))
  _fit(first, ds, epochs=1)
  first.optimizer.private_step.save_noise_state(str(tmp_path / "later.npz"))
  resumed = keras.models.load_model(str(tmp_path / "m.keras"))
  resumed.optimizer.private_step.restore_noise_state(str(tmp_path / "later.npz"))
  with pytest.raises(PrivacyConfigError, match=r"holds 4 samples but its noise state drew 8"):
    _fit(resumed, _dataset("band_mf"), epochs=1)
  assert int(resumed.ledger.sample_count) == STEPS
  other = _model("tree")
  other.optimizer.prepare_mechanism(other.trainable_variables)
  with pytest.raises(PrivacyConfigError, match=r"`path` must be a noise state of Tree"):
    other.optimizer.private_step.restore_noise_state(str(tmp_path / "later.npz"))


@pytest.mark.parametrize("noise", _params("tree"))
def test_tf_train_checkpoint_resumes_exactly(noise, tmp_path):
  """tf.train.Checkpoint keeps the optimizer's variables and its ledger's."""
  want = _uninterrupted(noise, tmp_path)
  first = _model(noise)
  ds = _dataset(noise)
  _fit(first, ds, epochs=1)
  path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
      str(tmp_path / "ckpt"))
  first.optimizer.private_step.save_noise_state(str(tmp_path / "noise.npz"))
  for restore_noise in (False, True):
    resumed = _model(noise)
    resumed.optimizer.prepare_mechanism(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        path).assert_existing_objects_matched()
    if not restore_noise:
      _refused(resumed, _dataset(noise))
      continue
    resumed.optimizer.private_step.restore_noise_state(str(tmp_path / "noise.npz"))
    _fit(resumed, ds, epochs=1)
    _assert_same_run(resumed, want)


class _SaveNoiseState(keras.callbacks.Callback):
  """Writes the noise state at each epoch's end, where BackupAndRestore backs up."""

  def __init__(self, path):
    super().__init__()
    self.path = path

  def on_epoch_end(self, epoch, logs=None):
    self.model.optimizer.private_step.save_noise_state(self.path)


class _StopAtEpoch(keras.callbacks.Callback):

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      raise RuntimeError("interrupted")


@pytest.mark.parametrize("noise", _params("blt"))
def test_backup_and_restore_resumes_exactly(noise, tmp_path):
  straight = _model(noise, journal=str(tmp_path / "straight.journal"))
  _fit(straight, _dataset(noise), epochs=2)
  want = _snapshot(straight)
  backup = str(tmp_path / "backup")
  first = _model(noise)
  state = str(tmp_path / "noise.npz")
  with pytest.raises(RuntimeError, match="interrupted"):
    _fit(first, _dataset(noise), epochs=2,
         callbacks=[keras.callbacks.BackupAndRestore(backup), _SaveNoiseState(state),
                    _StopAtEpoch(1)])
  assert os.path.exists(os.path.join(backup, "privacy_ledger.journal"))
  refused = _model(noise)
  ds = _dataset(noise)
  _skip_epoch(ds)
  with pytest.raises(PrivacyConfigError, match=REFUSAL):
    _fit(refused, ds, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)])
  assert int(refused.ledger.sample_count) == STEPS   # the journal's: nothing charged since
  resumed = _model(noise)
  resumed.optimizer.prepare_mechanism(resumed.trainable_variables)
  resumed.optimizer.private_step.restore_noise_state(state)
  ds = _dataset(noise)
  _skip_epoch(ds)
  _fit(resumed, ds, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)])
  _assert_same_run(resumed, want)
