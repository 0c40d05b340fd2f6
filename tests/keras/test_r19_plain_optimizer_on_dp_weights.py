"""Review R3 (session 34), finding 9: a plain Keras optimizer trains a DP model's layer on
the private data; the DP model's ledger and statement are unchanged.

Claim (optimizers.py, "one DP optimizer per trainable variable": every noised step that
touched the released weights is charged, and a variable another live DP optimizer updates is
refused); `privacy_statement` states the DP model's (epsilon, delta), add/remove one example
(Poisson), unit = example.

Gap: the ownership rule exempts plain Keras optimizers ("a GAN's non-DP generator
optimizer"); but a GAN generator's variables are not claimed by the DP optimizer. A plain
model sharing the DP model's encoder (an auxiliary autoencoder head, a natural multi-task
setup) is fit with Adam on the same private records, accepted; its un-noised updates stay in
the encoder, and the DP model keeps training and stating its own ledger.

Measured at 4e2a813 (before the fix): DP fit 10 steps (Poisson q = 0.1, z = 1, S = 1); plain Adam fit of the
autoencoder sharing the encoder, 10 steps, encoder kernel moved by up to 0.096; DP fit 2 more
steps accepted: "This run: (3.619, 1e-05)-DP for one example" for weights with 10 un-noised
updates on the records (infinite epsilon). Fixed (weight_fingerprints): the
next DP fit is refused.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp

# Nightly only (tools/suite_tiers.py NIGHTLY_ONLY): by default,
# test_weights_changed_outside.py::test_a_plain_optimizer_updating_dp_claimed_weights_is_refused
# [False] fits the same DP model and plain autoencoder on the same records and asserts the
# refusal, its message, the refused statement and the ledger.
pytestmark = pytest.mark.slow


def test_a_plain_optimizer_updating_dp_claimed_weights_is_refused():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(100, 4)).astype(np.float32)
  y = rng.normal(size=(100, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)
  encoder = keras.layers.Dense(8, name="encoder")
  inp = keras.Input((4,))
  h = encoder(inp)
  dp_model = dp.keras.DPModel(inp, keras.layers.Dense(1)(h))
  dp_model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  autoencoder = keras.Model(inp, keras.layers.Dense(4)(h))
  autoencoder.compile(keras.optimizers.Adam(0.01), "mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dp_model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    try:
      autoencoder.fit(x, x, batch_size=10, epochs=1, verbose=0)   # un-noised, on the records
      dp_model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=2, verbose=0)
    except dp.errors.PrivacyConfigError:
      return
  raise AssertionError(
      "a plain Adam fit updated the DP model's encoder on the private records and the DP "
      f"model still states: {str(dp_model.privacy_statement(1e-5)).splitlines()[0]}")
