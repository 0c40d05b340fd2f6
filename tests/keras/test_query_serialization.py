"""model.save / keras.models.load_model with a DP optimizer built on a custom dp_query."""

import os

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import dp_query

from tests.keras import dp_keras_helpers as helpers

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_data = helpers.small_data
_seq = helpers.small_seq


def _nested(model):
  return dp_query.NestedQuery([dp_query.GaussianSumQuery(0.5, 0.4, seed=i)
                               for i, _ in enumerate(model.trainable_variables)])


def _adaptive(model):
  del model
  return dp_query.QuantileAdaptiveClipSumQuery(0.1, 0.5, 0.5, 0.5, 2.0, 32, seed=3)


def _joint(model):
  return dp_query.JointClipQuery([1.0, 0.5, 2.0, 1.0][:len(model.trainable_variables)],
                                 1.0, 0.3, seed=4)


class _Halved(dp_query.GaussianSumQuery):
  pass


@pytest.mark.parametrize("make_query,make_opt,n_events", [
    (_nested, lambda q: dp.keras.DPOptimizer(keras.optimizers.RMSprop(1e-3), dp_query=q), 4),
    (_adaptive, lambda q: dp.keras.DPKerasSGDOptimizer(dp_query=q, learning_rate=0.1), 2),
    (_joint, lambda q: dp.keras.DPKerasAdamOptimizer(dp_query=q, learning_rate=1e-3), 1),
], ids=["nested_wrapper", "adaptive_sgd", "joint_adam"])
def test_save_load_custom_query_then_fit(tmp_path, make_query, make_opt, n_events):
  x, y = _data()
  model = _seq()
  model(x[:1])
  opt = make_opt(make_query(model))
  model.compile(optimizer=opt, loss=LOSS)
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  path = os.path.join(tmp_path, "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert type(loaded.optimizer) is type(opt)
  np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
  loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
  # Same query; the ledger travels with the model: the 2 saved steps + the 2 new ones.
  assert (dp_query.serialize(loaded.optimizer.dp_query.query)
          == dp_query.serialize(opt.dp_query.query))
  d = loaded.ledger.to_dict()
  assert d["num_samples"] == 4 and len(d["runs"][0]["queries"]) == n_events
  assert int(model.ledger.sample_count.numpy()) == 2


def test_saved_adaptive_clip_resumes(tmp_path):
  x, y = _data()
  model = _seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(dp_query=_adaptive(None),
                                                       learning_rate=0.1), loss=LOSS)
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  saved_clip = model.optimizer.get_config()["dp_global_state"][0]
  assert saved_clip != pytest.approx(0.1)          # the clip adapted during training
  path = os.path.join(tmp_path, "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.get_config()["dp_global_state"][0] == saved_clip
  loaded.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
  _, queries = loaded.ledger.get_arrays()
  # First step after loading (after the saved ledger's rows, which travel with the model):
  # clipped (and noised) with the saved clip, not the initial 0.1.
  saved_rows = int(model.ledger.query_count.numpy())
  assert queries.shape[0] > saved_rows
  assert queries[saved_rows, 2] == pytest.approx(saved_clip, rel=1e-6)
  # A fresh optimizer from the config with the state removed starts again from 0.1.
  cfg = model.optimizer.get_config()
  del cfg["dp_global_state"]
  fresh = type(model.optimizer).from_config(cfg)
  fresh.set_sampling(64, 0.5, "shuffle", 32)
  assert fresh.get_config()["dp_global_state"][0] == pytest.approx(0.1)


def test_save_unregistered_custom_query_names_the_class():
  opt = dp.keras.DPKerasSGDOptimizer(dp_query=_Halved(1.0, 0.5), learning_rate=0.1)
  with pytest.raises(ValueError, match="_Halved.*register"):
    opt.get_config()


def test_config_with_bad_state_refused():
  opt = dp.keras.DPKerasSGDOptimizer(dp_query=_adaptive(None), learning_rate=0.1)
  cfg = opt.get_config()
  cfg["dp_global_state"] = [1.0]
  again = type(opt).from_config(cfg)
  with pytest.raises(ValueError, match="dp_global_state"):
    again.set_sampling(64, 0.5, "shuffle", 32)
