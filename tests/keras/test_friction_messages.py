"""Messages a user met in the user study (issue 40): each names the parameter and its value,
and warnings fire only for the user's own configuration.

* `set_sampling(n, q, "poisson", None)`: a refused `sample_size`, named with its value, not a
  raw TypeError from deep inside the ledger;
* `auditing.check_sensitivity` builds a noise-free copy of the optimizer on purpose: the
  "noise_multiplier=0 ... NOT differentially private" warning is for the user's optimizer
  only (the tutorial's `--quick` run printed it from this probe).
The calibration-mismatch warning (which way the run left its calibration, both numbers) is
tested in test_budget_fit_steps.py.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity


def _optimizer(**kwargs):
  return dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                      learning_rate=0.1, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"num_microbatches": 4}])
def test_set_sampling_with_sample_size_none_names_the_parameter_and_value(kwargs):
  opt = _optimizer(**kwargs)
  policy = "poisson" if not kwargs else "shuffle"
  with pytest.raises(dp.ParameterTypeError,
                     match=r"`sample_size` must be a finite number >= 0, the batch size.*"
                           r"Received: sample_size=None"):
    opt.set_sampling(60000, 256 / 60000, policy, None)
  assert opt.sampling_policy is None   # nothing was declared


@pytest.mark.parametrize("bad,error", [("256", dp.ParameterTypeError),
                                       (-1, dp.PrivacyConfigError),
                                       (float("inf"), dp.PrivacyConfigError)])
def test_set_sampling_refuses_a_bad_sample_size_by_name(bad, error):
  with pytest.raises(error, match=rf"Received: sample_size={bad!r}"):
    _optimizer().set_sampling(60000, 256 / 60000, "poisson", bad)


def test_set_sampling_still_accepts_the_batch_size_or_zero_under_poisson():
  opt = _optimizer()
  assert opt.set_sampling(60000, 256 / 60000, "poisson", 0) is True
  opt.set_sampling(60000, 256 / 60000, "poisson", 256)
  assert opt.sampling_policy == "poisson"
  assert float(opt.dp_query.sample_size.numpy()) == 256.0


def test_the_ledger_query_names_sample_size_too():
  query = dp.dp_query.GaussianSumQuery(1.0, 1.0)
  with pytest.raises(dp.ParameterTypeError, match="Received: sample_size=None"):
    dp.ledger.QueryWithLedger(query, 100, 0.1, sample_size=None)


def _no_noise_warnings(caught):
  return [str(w.message) for w in caught if "NOT differentially private" in str(w.message)]


def test_check_sensitivity_does_not_warn_about_its_own_noise_free_probe():
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x, y = rng.randn(16, 5).astype("float32"), rng.randint(0, 3, 16)
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(3)])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.compile(optimizer=_optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = sensitivity.check_sensitivity(model, x, y, num_candidates=3)
  assert report.passed
  assert model.optimizer.noise_multiplier == 1.1
  assert _no_noise_warnings(caught) == []


def test_a_users_own_noise_free_optimizer_still_warns_with_its_value():
  with pytest.warns(UserWarning, match=r"noise_multiplier=0\.0: this DP optimizer adds no "
                                       r"noise, so its training is NOT differentially private"):
    dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1)
