"""A noise mechanism defined outside the package, in this file, trains like a built-in one.

`TwoBandToeplitz` is a final `dp.keras.noise.NoiseMechanism`: its parameter (the horizon),
its query (a two-band Toeplitz matrix factorization, Choquette-Choo et al., "Correlated Noise
Provably Beats Independent Noise for Differentially Private Learning", 2023, Section 3), its
sampling requirement (cyclic Poisson with >= 2 groups, from its event) and its ledger event
(a two-band BandedGaussianEvent) are all here; no package file names it. Relation: add or
remove one example under cyclic Poisson sampling, as the ledger's rows state.
"""

import dataclasses
import warnings
from typing import ClassVar

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tests.correlated.test_keras_noise import _data  # pylint: disable=unused-import
from tests.correlated.test_keras_noise import _model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclasses.dataclass(frozen=True)
class TwoBandToeplitz(dp.keras.noise.NoiseMechanism):
  """Two-band Toeplitz BandMF noise over `horizon` steps (a fixture mechanism)."""

  horizon: int = 8
  name: ClassVar[str] = "test_two_band_toeplitz"

  def __post_init__(self):
    if not isinstance(self.horizon, int) or self.horizon < 2:
      raise dp.PrivacyConfigError(f"`horizon` must be an int >= 2. Received: "
                                  f"horizon={self.horizon!r}")

  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    return dp.dp_query.BandMFQuery(l2_norm_clip, noise_multiplier, template, num_bands=2,
                                   num_steps=self.horizon, strategy="toeplitz", seed=seed)

  def requirement_event(self):
    return dp.dp_query.BandedGaussianEvent(1.0, 1.0, 1.0, 2)


def _cyclic(num_groups):
  x, y = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return cyclic_poisson_batches(x, y, expected_batch_size=6, num_groups=num_groups,
                                  steps_per_epoch=4, seed=1)


def test_a_mechanism_defined_here_trains_and_is_accounted():
  mechanism = TwoBandToeplitz(horizon=4)
  model = _model(dp.keras.DPKerasSGDOptimizer(1.0, 1.2, noise=mechanism, learning_rate=0.1))
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit(_cyclic(2), epochs=1, verbose=0)
  assert model.optimizer.noise_mechanism is mechanism
  assert int(model.optimizer.noise_state().step) == 4 and int(model.ledger.sample_count) == 4
  assert any(not np.allclose(a, b.numpy()) for a, b in zip(before, model.trainable_variables))
  [run] = model.ledger.to_dict()["runs"]
  assert run["policy"] == "cyclic_poisson"
  assert {q["type"] for q in run["queries"]} == {"banded_gaussian"}
  eps = dp.accounting.epsilon(model.ledger, 1e-5)
  assert 0 < eps < float("inf")
  # The same steps through the built-in BandMF shorthand (same query) charge the same epsilon.
  builtin = _model(dp.keras.DPKerasSGDOptimizer(1.0, 1.2, noise="band_mf", num_bands=2,
                                                num_steps=4, learning_rate=0.1))
  builtin.fit(_cyclic(2), epochs=1, verbose=0)
  assert eps == pytest.approx(dp.accounting.epsilon(builtin.ledger, 1e-5), rel=1e-12)


def test_its_sampling_requirement_is_enforced_before_any_step():
  model = _model(dp.keras.DPKerasSGDOptimizer(1.0, 1.2, noise=TwoBandToeplitz(),
                                              learning_rate=0.1))
  x, y = _data()
  with pytest.raises(ValueError, match=r"accounted only under sampling policy 'cyclic_poisson'"
                                       r" with at least 2 groups .*got policy 'poisson'"):
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
  assert int(model.ledger.sample_count) == 0


def test_its_config_round_trips_through_the_optimizer():
  opt = dp.keras.DPKerasAdamOptimizer(1.0, 1.2, noise=TwoBandToeplitz(horizon=6),
                                      learning_rate=0.01)
  config = opt.get_config()
  assert config["noise"] == {"class_name": "test_two_band_toeplitz", "config": {"horizon": 6}}
  again = dp.keras.DPKerasAdamOptimizer.from_config(config)
  assert again.noise_mechanism == TwoBandToeplitz(horizon=6) and again.dp_config == opt.dp_config
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert restored.get_config() == config


def test_it_is_validated_frozen_and_final():
  with pytest.raises(dp.PrivacyConfigError, match=r"`horizon` must be .*Received: horizon=1"):
    TwoBandToeplitz(horizon=1)
  mechanism = TwoBandToeplitz()
  with pytest.raises(dataclasses.FrozenInstanceError):
    mechanism.horizon = 3
  with pytest.raises(TypeError, match=r"abstract or final"):
    type("Sub", (TwoBandToeplitz,), {"name": "test_sub"})
  with pytest.raises(ValueError, match=r"`name` must be unique"):
    type("Clash", (dp.keras.noise.NoiseMechanism,), {"name": "blt", "make_query": None})
  # flat keywords belong to the shorthands only
  with pytest.raises(ValueError, match=r"`num_steps` must not be given with noise="):
    dp.keras.DPKerasSGDOptimizer(1.0, 1.0, noise=mechanism, num_steps=4, learning_rate=0.1)
