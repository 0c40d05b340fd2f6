"""A batch the user gives (`train_on_batch`, a custom loop) is charged under the sampling the
user declared with `set_sampling`, never under the one model.fit declared for its own sampler
(review R4, session 35, finding 8).

Claim: the statement's epsilon bounds the run, add/remove one example, unit = example.
Case: n = 100 examples in R^2, DPSequential Dense(1), z = 1, S = 1; fit(batch_size=10) for one
epoch (10 Poisson steps, q = 0.1), then one step on x[:10]: a fixed batch holding example 0
with certainty (an un-amplified Gaussian step for it). Before: accepted as a Poisson step of
rate 0.1, epsilon 3.533 at delta 1e-5 stated; dp-accounting by hand (10 Poisson steps and one
unsampled Gaussian step): 5.651. Now refused until the user declares the sampling; after
set_sampling the step is charged as declared.
"""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp

DELTA = 1e-5


def _fitted():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(100, 2)).astype(np.float32)
  y = rng.normal(size=(100, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
  return model, x, y


def _poisson_epsilon(steps):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), steps)
  return acc.get_epsilon(DELTA)


def test_train_on_batch_after_fit_needs_the_users_declaration():
  model, x, y = _fitted()
  samples = int(model.ledger.sample_count)
  w = [v.numpy().copy() for v in model.trainable_variables]
  with pytest.raises(dp.errors.PrivacyConfigError, match="declared by model.fit"):
    model.train_on_batch(x[:10], y[:10])
  assert int(model.ledger.sample_count) == samples
  for a, v in zip(w, model.trainable_variables):
    np.testing.assert_array_equal(a, v.numpy())
  # the user declares how the batches are drawn: charged as declared (a Poisson batch here)
  model.optimizer.set_sampling(100, 0.1, "poisson", 10)
  model.train_on_batch(x[:10], y[:10])
  assert int(model.ledger.sample_count) == samples + 1
  eps = model.privacy_statement(DELTA).epsilon
  assert eps == pytest.approx(_poisson_epsilon(samples + 1), rel=1e-9)


def test_a_custom_loop_after_fit_needs_the_users_declaration():
  model, x, y = _fitted()
  opt = model.optimizer
  loss = lambda r: keras.losses.mean_squared_error(r[1], model(r[0], training=True))
  with pytest.raises(dp.errors.PrivacyConfigError, match="declared by model.fit"):
    opt.compute_private_gradients(loss, model.trainable_variables, data=(x[:10], y[:10]))
  opt.set_sampling(100, 0.1, "poisson", 10)
  grads = opt.compute_private_gradients(loss, model.trainable_variables,
                                        data=(x[:10], y[:10]))
  assert len(grads) == len(model.trainable_variables)
