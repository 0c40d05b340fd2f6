"""A batch-dependent layer under clipping="auto" is named in a warning: the private step runs
each example alone (vectorized path), so the layer's batch statistic is taken over one example
in training while evaluate uses whole batches."""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp


def _fit(mixing):
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  h = keras.layers.Dense(8, activation="tanh")(inp)
  if mixing:
    h = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True),
                            name="batch_center")(h)
  model = dp.keras.DPModel(inp, keras.layers.Dense(3)(h))
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, clipping="auto")
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 5).astype("float32"), rng.randint(0, 3, 32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
  return opt, model, [str(w.message) for w in caught if "batch" in str(w.message)]


def test_batch_mean_layer_under_auto_is_named_once():
  opt, model, messages = _fit(mixing=True)
  assert opt.resolve_clipping(model) == "vectorized"
  mixing = [m for m in messages if "['batch_center']" in m]
  assert len(mixing) == 1, messages   # probed once per model (cached)
  assert "clipping='auto'" in mixing[0] and "x - mean(x) is 0" in mixing[0]


def test_no_warning_without_a_mixing_layer():
  opt, model, messages = _fit(mixing=False)
  assert opt.resolve_clipping(model) == "fast"
  assert not [m for m in messages if "depend on the other examples" in m]
