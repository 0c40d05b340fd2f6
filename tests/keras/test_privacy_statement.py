"""model.privacy_statement(delta): the run's epsilon, from its ledger, equals dp-accounting
composed by hand for the steps the run took; when the run's sampling is not what TF
Privacy's compute_dp_sgd_privacy(...) assumes, the statement says so and names both numbers.
"""

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp

N, B, Z, DELTA = 100, 20, 1.1, 1e-3


def _fit(num_microbatches=None, epochs=2):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 4)).astype("float32")
  y = rng.integers(0, 2, N)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(
      optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, num_microbatches=num_microbatches,
                                             learning_rate=0.1),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
  model.fit(x, y, batch_size=B, epochs=epochs, verbose=0)
  return model


def _poisson_by_hand(steps):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(B / N, dpa.GaussianDpEvent(Z)), steps))
  return acc.get_epsilon(DELTA)


def test_poisson_run_statement_equals_dp_accounting_by_hand():
  model = _fit()
  s = model.privacy_statement(DELTA)
  steps = int(model.optimizer.iterations.numpy())
  assert steps == 2 * N // B == s.steps
  assert s.epsilon == pytest.approx(_poisson_by_hand(steps), rel=1e-6)
  assert (s.policy, s.relation, s.unit) == ("poisson", "add or remove one", "example")
  assert s.selection_probability == pytest.approx(B / N)
  assert s.noise_multiplier == pytest.approx(Z, rel=1e-6)
  assert s.epsilon_if_poisson is None
  text = str(s)
  assert f"({s.epsilon:.4g}, {DELTA:.3g})-DP" in text and "NOT this run's" not in text
  # TF Privacy's hyperparameter call agrees here: the run really was Poisson-sampled
  assert dp.accounting.compute_dp_sgd_privacy(N, B, Z, 2, DELTA).epsilon == pytest.approx(
      s.epsilon, rel=1e-6)


def test_microbatched_run_says_the_hyperparameter_epsilon_is_not_its_own():
  """TF Privacy's num_microbatches makes fit cut shuffled passes: each pass is one
  un-amplified Gaussian mechanism of noise multiplier z / 2 (replace one, sensitivity 2C)."""
  model = _fit(num_microbatches=10)
  s = model.privacy_statement(DELTA)
  assert s.policy == "shuffle" and s.relation == "replace one" and s.passes == 2
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(Z / 2), s.passes))
  assert s.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)
  user_number = dp.accounting.compute_dp_sgd_privacy(N, B, Z, 2, DELTA).epsilon
  assert s.epsilon_if_poisson == pytest.approx(user_number, rel=1e-6)
  assert s.epsilon > 2 * user_number   # the number a user would print is far too small
  text = str(s)
  assert "NOT this run's epsilon" in text and "num_microbatches=10" in text
  assert f"{user_number:.4g}" in text and f"{s.epsilon:.4g}" in text
  assert "microbatches of 2 examples" in s.unit


def test_statement_before_any_step_is_refused():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1),
                loss="mse")
  with pytest.raises(ValueError, match="no private step"):
    model.privacy_statement(DELTA)
