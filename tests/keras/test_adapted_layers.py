"""DP fit warns about preprocessing state set by `adapt` (review R2, session 33).

A Normalization adapted on the training data is released with the model: its mean moves by
(x - mean(D')) / n when one record x is added, un-noised, outside the (epsilon, delta)
statement (add/remove one example). The library cannot tell private from public adapt data,
so it warns; values given to the constructor (public) raise no warning.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp


def _fit(norm):
  model = dp.keras.DPSequential([keras.Input((2,)), norm, keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01), "mse")
  x = np.random.default_rng(0).normal(size=(20, 2)).astype("float32")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, x[:, :1], batch_size=5, epochs=1, verbose=0)
  return [str(w.message) for w in caught if "adapt()" in str(w.message)]


def test_an_adapted_normalization_is_named_in_a_warning():
  norm = keras.layers.Normalization(name="norm")
  norm.adapt(np.random.default_rng(1).normal(size=(20, 2)).astype("float32"))
  messages = _fit(norm)
  assert len(messages) == 1 and "['norm']" in messages[0]


def test_public_values_given_to_the_constructor_raise_no_warning():
  assert _fit(keras.layers.Normalization(mean=[0.0, 0.0], variance=[1.0, 1.0])) == []
