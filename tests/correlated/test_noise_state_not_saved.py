"""No saved artifact of a correlated-noise run holds its noise (review R3, finding 11).

The released model is (epsilon, delta)-DP: replace one example under shuffled passes
(noise="tree"), add or remove one example under cyclic Poisson sampling (band_mf, blt); the
unit is the example. A correlated mechanism's state is the noise itself: the tree's open
nodes sum to the cumulative noise of the released weights (Kairouz et al. 2021, "Practical
and Private (Deep) Learning without Sampling or Shuffling", Section 3), BandMF's history holds
the last b - 1 noise vectors, BLT's buffers decayed sums of past noise. For SGD
theta_t = theta_0 - lr (sum of clipped gradients + stddev sum(nodes)) / B, so a file holding
the nodes and the stddev gives the noise-free weights.

Case: zero inputs and a bias-free Dense(1), so every clipped gradient is 0 and the released
weights are the noise alone (S = 0.5, z = 1, lr = 1). Two runs with unseeded noise: the
released weights differ; every other array that model.save (.keras), save_weights,
tf.train.Checkpoint of the model and optimizer, or a BackupAndRestore backup holds is equal
across the runs (independent of the noise), and so is the optimizer's config. R3's denoising
attack (released + lr stddev sum(nodes) / B) on the .keras file finds no nodes.
"""

import glob
import io
import json
import os
import re
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.data.shuffling import shuffled_batches

N, B, STEPS, CLIP, Z = 40, 10, 4, 0.5, 1.0
MECHANISMS = {
    "tree": {"restart_every": 4},
    "band_mf": {"num_bands": 2, "num_steps": 2 * STEPS},
    "blt": {"num_steps": 2 * STEPS, "num_buffers": 2, "min_separation": 2},
}


def _linear_loss(y_true, y_pred):
  return -tf.reduce_sum(y_true * y_pred, axis=-1)


def _dataset(noise):
  x = np.zeros((N, 3), np.float32)   # zero data: every clipped gradient is 0
  y = np.where(np.arange(N) % 2, 1.0, -1.0).astype(np.float32)[:, None]
  if noise == "tree":
    return shuffled_batches(x, y, batch_size=B, seed=1)   # 4 steps a pass
  return cyclic_poisson_batches(x, y, expected_batch_size=B / 2, num_groups=2,
                                steps_per_epoch=STEPS, seed=1)


def _model(noise):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  model.compile(dp.keras.DPKerasSGDOptimizer(CLIP, Z, learning_rate=1.0, noise=noise,
                                             **MECHANISMS[noise]), _linear_loss)
  return model


def _h5_arrays(source):
  arrays = {}
  with h5py.File(source, "r") as f:
    f.visititems(lambda name, obj: arrays.__setitem__(name, np.asarray(obj[()]))
                 if isinstance(obj, h5py.Dataset) else None)
  return arrays


def _checkpoint_arrays(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {k: np.asarray(reader.get_tensor(k)) for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def _run_and_save(noise, where):
  """One run of one epoch (STEPS steps) with a BackupAndRestore kept, then every artifact;
  returns (released weights, {artifact: {name: array}}, the in-memory noise state)."""
  os.makedirs(where)
  model = _model(noise)
  backup = os.path.join(where, "backup")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(_dataset(noise), epochs=1, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    model.save(os.path.join(where, "m.keras"))
    model.save_weights(os.path.join(where, "m.weights.h5"))
  prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
      os.path.join(where, "ckpt"))
  with zipfile.ZipFile(os.path.join(where, "m.keras")) as archive:
    keras_file = _h5_arrays(io.BytesIO(archive.read("model.weights.h5")))
  backups = {}
  for path in sorted(glob.glob(os.path.join(backup, "**", "*.h5"), recursive=True)):
    backups.update({f"{os.path.basename(path)}/{k}": a for k, a in _h5_arrays(path).items()})
  artifacts = {"model.save": keras_file,
               "save_weights": _h5_arrays(os.path.join(where, "m.weights.h5")),
               "tf.train.Checkpoint": _checkpoint_arrays(prefix),
               "BackupAndRestore": backups}
  config = dict(model.optimizer.get_config())
  config.pop("name")   # Keras numbers the optimizers of a process
  config = _without_run_identity(json.dumps(config, sort_keys=True, default=str))
  return model.get_weights(), artifacts, config, model.optimizer.noise_state()


def _without_run_identity(text):
  """`text` without the ledger's run identity (128 random bits drawn when the ledger is made,
  independent of the data and the noise) and the signature that covers it."""
  text = re.sub(r'\\?"run_ids\\?": \[\[[^]]*\]\]', "RUN_IDS", text)
  return re.sub(r"sha256:[0-9a-f]{64}", "SIGNATURE", text)


def _is_run_identity(name):
  return "run_table" in name or "run_ids" in name


def _is_released(array, weights):
  return any(array.shape == w.shape and np.array_equal(array, w) for w in weights)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """_run_and_save(noise, ...) of the `i`-th run of `noise`, each run made once per module:
  runs(noise, i) -> (released weights, artifacts, config, noise state)."""
  made = {}

  def run(noise, i):
    if (noise, i) not in made:
      where = tmp_path_factory.mktemp(f"{noise}_{i}") / "run"
      made[noise, i] = _run_and_save(noise, str(where))
    return made[noise, i]
  return run


@pytest.mark.parametrize("noise", sorted(MECHANISMS))
def test_every_saved_array_is_independent_of_the_noise(noise, runs):
  released_1, saved_1, config_1, state_1 = runs(noise, 1)
  released_2, saved_2, config_2, _ = runs(noise, 2)
  assert np.abs(released_1[0] - released_2[0]).max() > 1e-3   # the noise differs
  assert max(float(np.abs(np.asarray(a)).max()) for a in state_1 if np.size(a) > 1) > 0
  assert config_1 == config_2 and '"dp_global_state"' not in config_1
  for artifact, arrays in saved_1.items():
    assert arrays, f"{artifact}: nothing was saved"
    assert arrays.keys() == saved_2[artifact].keys(), artifact
    released_here = [k for k, a in arrays.items() if _is_released(a, released_1)]
    assert released_here, f"{artifact}: the model's weights are not in it"
    for name, a in arrays.items():
      if _is_run_identity(name):
        continue
      if name in released_here:
        assert _is_released(saved_2[artifact][name], released_2)
        continue
      np.testing.assert_array_equal(a, saved_2[artifact][name],
                                    err_msg=f"{artifact}: {name} depends on the noise")


def test_the_keras_file_cannot_be_denoised(runs):
  """R3's attack: released + lr stddev sum(nodes) / B from the file's arrays; the file holds
  no (depth, d) node array and no stddev z S sqrt(3) of the tree, so no such array exists.
  The run is the first tree run of the case above (a run of its own asserted the same)."""
  released, saved, _, state = runs("tree", 1)
  nodes = np.asarray(state.nodes)
  stddev = float(state.stddev)
  assert nodes.shape == (3, 3) and np.abs(nodes).max() > 0   # the run's nodes (in memory)
  arrays = [a for a in saved["model.save"].values() if a.dtype.kind == "f"]
  assert not any(a.shape == nodes.shape and np.allclose(a, nodes) for a in arrays)
  assert not any(a.shape == () and np.isclose(float(a), stddev) for a in arrays)
  denoised = released[0][:, 0] + stddev * nodes.sum(axis=0) / B   # what the file would give
  assert np.abs(denoised).max() < 1e-5   # the noise-free weights (zero data): 0
