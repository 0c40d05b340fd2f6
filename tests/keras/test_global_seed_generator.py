"""Keras' global SeedGenerator (`keras.random.*` with seed=None) inside a DP model's call.

Claim: the model `DPModel.fit` releases is (epsilon, delta)-DP, add/remove one example
(Poisson), unit = example. The global SeedGenerator's state is not one of the model's variables
(Keras neither lists, saves nor restores it), but it holds a counter that the random ops
advance and no record's value: the unlisted-variable check accepts it, as the recipes guide's
augmentation-multiplicity example needs (refused before: "reads ... seed_generator_state,
which is not one of the model's variables"). A write from the data into that state in the
step is still refused, as any write from the data.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.random import seed_generator

import tf_dpiter as dp


def _fit(write_from_data):
  inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])

  def augment(x, view):  # pylint: disable=unused-argument
    out = x + 0.01 * keras.random.normal(keras.ops.shape(x))   # the global SeedGenerator
    if write_from_data:
      state = seed_generator.global_seed_generator().state
      state.assign(tf.cast(tf.reduce_sum(x) * 1000.0, "int64") * tf.ones([2], "int64"))
    return out

  model = dp.keras.augmentation_multiplicity(inner, augment, k=2)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                       learning_rate=0.1),
                loss=model.view_loss(keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True)))
  x = np.random.default_rng(1).normal(size=(32, 8)).astype("float32")
  y = (x[:, 0] > 0).astype("int64")
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  return model


def test_the_global_seed_generator_is_accepted_as_a_counter():
  model = _fit(write_from_data=False)
  state = seed_generator.global_seed_generator().state
  assert id(state.handle) not in {id(v.handle) for v in model.variables}   # unlisted, accepted
  assert int(model.ledger.sample_count.numpy()) == 2   # both steps charged
  assert np.isfinite(model.privacy_statement(1e-5).epsilon)


def test_a_write_from_the_data_into_the_global_seed_state_is_refused():
  with pytest.raises(dp.errors.PrivacyConfigError, match="written from the data.*seed_generator_state"):
    _fit(write_from_data=True)
