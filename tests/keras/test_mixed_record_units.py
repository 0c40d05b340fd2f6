"""A ledger never composes user-level and example-level steps.

Relation: add or remove one record. A user-level step (dp.data.poisson_user_batches: a record
is all of one user's examples) is recorded at sensitivity S per user; for one EXAMPLE a user's
clipped record moves by up to 2S when one of its examples is removed (measured below with the
real step, noise off), and for one USER an example-level step samples each of the user's
examples on its own (group privacy over k). So a fit of the other unit on the same optimizer
is refused before its first step, and the accountant refuses a ledger that mixes them."""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import PrivacyLedger


def _one_user_step(x, y, users):
  """One user-level step, z = 0, lr = 1, zero init: the weights are -(clipped sum) / (q U)."""
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=1.0), loss="mse")
  ds = dp.data.poisson_user_batches(x, y, users, expected_users_per_batch=len(np.unique(users)),
                                    max_examples_per_user=2, steps_per_epoch=1)
  model.fit(ds, epochs=1, verbose=0)
  return model.get_weights()[0].ravel().astype(np.float64)


def _run_data():
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(60, 2)).astype(np.float32)
  ys = rng.normal(size=(60, 1)).astype(np.float32)
  return xs, ys, np.repeat(np.arange(20), 3)


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01),
                loss="mse")
  return model


def _user_batches(xs, ys, users):
  return dp.data.poisson_user_batches(xs, ys, users, expected_users_per_batch=4,
                                      max_examples_per_user=3)


def test_a_user_level_record_moves_by_2s_for_one_example():
  """The premise: noise off, removing one example of a user who stays moves the clipped sum
  by 2S while the user-level row states S."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    x = np.array([[1, 0], [1, 0], [0, 1]], np.float32)
    y = np.array([[10], [-30], [0]], np.float32)
    u = np.array([0, 0, 1])
    moved = np.linalg.norm(_one_user_step(x, y, u)
                           - _one_user_step(x[[0, 2]], y[[0, 2]], u[[0, 2]]))
  # times q U = 2: the sum's move, S = 1, up to the pinned sum's clip shrink 1 / (1 + eta)
  # (records of k are summed in a pinned order since session 34: eta ~ 1.8e-5 here)
  assert 2.0 / (1.0 + 1e-4) <= moved * 2.0 <= 2.0


@pytest.mark.parametrize("user_first", [True, False])
def test_a_fit_of_the_other_unit_is_refused_before_its_first_step(user_first):
  xs, ys, users = _run_data()
  model = _model()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    first = (lambda: model.fit(_user_batches(xs, ys, users), epochs=1, verbose=0)) if (
        user_first) else (lambda: model.fit(xs, ys, batch_size=6, epochs=1, verbose=0))
    second = (lambda: model.fit(xs, ys, batch_size=6, epochs=1, verbose=0)) if (
        user_first) else (lambda: model.fit(_user_batches(xs, ys, users), epochs=1, verbose=0))
    first()
    steps = int(model.optimizer.ledger.sample_count.numpy())
    weights = model.get_weights()
    with pytest.raises(PrivacyConfigError, match="new optimizer"):
      second()
  assert int(model.optimizer.ledger.sample_count.numpy()) == steps
  for w, r in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(w, r)
  statement = model.privacy_statement(1e-5)
  assert "user + example" not in str(statement)


def test_the_accountant_refuses_a_ledger_of_two_units():
  xs, ys, users = _run_data()
  a, b = _model(), _model()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    a.fit(_user_batches(xs, ys, users), epochs=1, verbose=0)
    b.fit(xs, ys, batch_size=6, epochs=1, verbose=0)
  sa, qa = a.optimizer.ledger.get_arrays()
  sb, qb = b.optimizer.ledger.get_arrays()
  qb = qb.copy()
  qb[:, 0] += sa.shape[0]
  mixed = PrivacyLedger()
  mixed.set_arrays(np.concatenate([sa, sb]), np.concatenate([qa, qb]), 0)
  with pytest.raises(PrivacyConfigError, match="different units"):
    dp.accounting.privacy_report(mixed, delta=1e-5)
