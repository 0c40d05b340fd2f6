"""TF Privacy spellings (tf_dpiter.keras.compat): vectorized optimizer aliases, tuple-unpacking
compute_dp_sgd_privacy, the statement and the GDP accountant of TF Privacy's MovieLens
tutorial."""

import math

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras import compat
from tests.keras import dp_keras_helpers as helpers

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(opt):
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=opt, loss=LOSS)
  return model


@pytest.mark.parametrize("name,base", [
    ("VectorizedDPKerasSGDOptimizer", dp.keras.DPKerasSGDOptimizer),
    ("VectorizedDPKerasAdamOptimizer", dp.keras.DPKerasAdamOptimizer),
    ("VectorizedDPKerasAdagradOptimizer", dp.keras.DPKerasAdagradOptimizer),
])
def test_vectorized_aliases_clip_by_vectorized_map_and_serialize(name, base):
  cls = getattr(compat, name)
  opt = cls(l2_norm_clip=0.5, noise_multiplier=1.1, num_microbatches=2, learning_rate=0.1)
  assert isinstance(opt, base) and opt.clipping == "vectorized"
  assert cls(0.5, 1.1, clipping="fast").clipping == "fast"
  again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(again) is cls and again.get_config() == opt.get_config()


def test_vectorized_sgd_takes_the_same_step_as_the_reference_loop():
  x, y = helpers.small_data(8, seed=3)
  model = _model(compat.VectorizedDPKerasSGDOptimizer(0.3, 0.0, learning_rate=1.0))
  helpers.set_sampling(model, 8)
  ref = helpers.reference_gradient(model, LOSS, x, y, clip=0.3)
  got = helpers.one_step_update(model, x, y)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_compute_dp_sgd_privacy_unpacks_and_states_the_relation():
  eps, order = compat.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
  assert eps == pytest.approx(2.5967, abs=1e-3) and order > 1
  text = compat.compute_dp_sgd_privacy_statement(60000, 256, 60, 1.1, 1e-5,
                                                 used_microbatching=False)
  assert "add/remove-one adjacency, sensitivity C): 2.597" in text


def test_compute_eps_poisson_is_the_gdp_clt_formula():
  from scipy import optimize, stats  # pylint: disable=g-import-not-at-top
  n, b, z, epochs, delta = 800167, 10000, 1.1, 20, 1.0 / 800167
  steps = math.ceil(epochs * n / b)
  mu = b / n * math.sqrt(steps * (math.exp(z ** -2) - 1))
  f = lambda e: (stats.norm.cdf(-e / mu + mu / 2)
                 - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta)
  with pytest.warns(UserWarning, match=r"compute_eps_poisson: epsilon ~ [0-9.]+ .*an "
                    r"approximation .*not an upper bound"):
    eps = compat.compute_eps_poisson(epochs, z, n, b, delta)
  assert eps == pytest.approx(optimize.brentq(f, 0, 100, xtol=1e-12), rel=1e-7)
