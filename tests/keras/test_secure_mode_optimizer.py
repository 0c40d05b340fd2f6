"""DP optimizers in secure mode: the default GaussianSumQuery draws from os.urandom."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_secure_mode_trains_and_round_trips_config():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(3)])
  opt = dp.keras.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
                             secure_mode=True)
  model.compile(optimizer=opt, loss=LOSS)
  rng = np.random.RandomState(0)
  model.fit(rng.randn(32, 5).astype("float32"), rng.randint(0, 3, 32), batch_size=8, epochs=1,
            verbose=0)
  assert int(model.ledger.sample_count) == 4
  assert opt.dp_query.get_config()["query"]["config"]["secure_mode"] is True
  config = opt.get_config()
  assert config["secure_mode"] is True
  assert type(opt).from_config(config).get_config()["secure_mode"] is True


@pytest.mark.parametrize("kwargs", [{"seed": 1}, {"dp_query": "custom"}])
def test_secure_mode_refuses_seed_and_custom_query(kwargs):
  if "dp_query" in kwargs:
    kwargs = {"dp_query": dp.dp_query.GaussianSumQuery(1.0, 1.0)}
    args = (None, None)
  else:
    args = (1.0, 1.0)
  with pytest.raises(ValueError, match="secure_mode"):
    dp.keras.DPKerasSGDOptimizer(*args, secure_mode=True, **kwargs)
