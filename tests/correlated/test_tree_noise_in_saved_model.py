"""Review R3 (session 34), finding 11: a DP-FTRL (noise="tree") model saved with model.save
carries its tree nodes, i.e. the exact cumulative noise in its weights: anyone holding the
.keras file removes the noise.

Claim (private_step docstring: the noise generator is deliberately not saved, "so no restore
can make it draw a noise it drew before"; the mechanism's global state is saved so a run can
continue); the released model is (epsilon, delta)-DP, replace-one (shuffled passes), unit =
example.

Gap: the tree's global state is the noise itself: after t steps the open nodes' values sum to
the prefix noise N_t (residual form, tree_aggregation_query.get_noised_result), and the saved
optimizer variables hold them with the stddev. For SGD, theta_t = theta_0 - lr (sum of
clipped gradients + stddev N_t) / B, so theta_t + lr stddev sum(nodes) / B is noise-free.

Case: n = 40 examples in R^3, labels +-1, a linear loss -y f(x) (its clipped gradients do
not depend on the weights), Dense(1) from zeros, S = 0.5, z = 1, shuffled passes B = 10,
restart_every = 4, one epoch, lr = 1. Measured at 4e2a813: the file's node array (3, 4) and
stddev 0.866; denoised weights equal the z = 0 run's to 1.5e-8, while the released weights
are 0.141 away. Fixed (helper NS): the noise state is in no saved file
(private_step._set_global_state; tests/correlated/test_noise_state_not_saved.py checks every
array of every artifact of tree, band_mf and blt), so the file holds no node array.
"""

import io
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

# Nightly (`-m slow`): by default test_noise_state_not_saved.py asserts the same and more of
# the tree's .keras file (test_every_saved_array_is_independent_of_the_noise[tree]: every
# array but the released weights equal across two noise draws, the release noised;
# test_the_keras_file_cannot_be_denoised: no array equal to the run's nodes, no stddev scalar,
# and the denoising formula applied to the in-memory nodes gives the noise-free weights).
SLOW_CASES = {"test_the_saved_file_does_not_reveal_the_tree_noise"}


def _linear_loss(y_true, y_pred):
  return -tf.reduce_sum(y_true * y_pred, axis=-1)


def _train_and_save(z, path, x, y):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)),
                                 keras.layers.Dense(1, kernel_initializer="zeros")])
  model.compile(dp.keras.DPKerasSGDOptimizer(0.5, z, learning_rate=1.0, noise="tree",
                                             restart_every=4), _linear_loss)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=10, epochs=1, sampling="shuffle", verbose=0)
    model.save(path)
  with zipfile.ZipFile(path) as archive:
    weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
    arrays = {}
    weights.visititems(lambda name, obj: arrays.__setitem__(name, np.asarray(obj[()]))
                       if isinstance(obj, h5py.Dataset) else None)
  return np.concatenate([w.ravel() for w in model.get_weights()]), arrays


def test_the_saved_file_does_not_reveal_the_tree_noise(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  y = rng.choice([-1.0, 1.0], size=(40, 1)).astype(np.float32)
  released, arrays = _train_and_save(1.0, str(tmp_path / "noisy.keras"), x, y)
  noise_free, _ = _train_and_save(0.0, str(tmp_path / "clean.keras"), x, y)
  nodes = [a for k, a in arrays.items() if k.startswith("optimizer/") and a.shape == (3, 4)]
  stddevs = [float(a) for k, a in arrays.items()
             if k.startswith("optimizer/") and a.shape == () and abs(float(a) - 0.5 * 3 ** 0.5) < 1e-6]
  assert np.abs(released - noise_free).max() > 0.01   # the release is noised
  # nothing to denoise with: no (depth, d) node array, no stddev z S sqrt(3) in the file
  assert not nodes and not stddevs, (len(nodes), stddevs)
