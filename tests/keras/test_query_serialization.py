"""model.save / keras.models.load_model with a DP optimizer built on a custom dp_query."""

import os
import types

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import dp_query

from tests.keras import dp_keras_helpers as helpers

# Nightly tier (-m slow): the joint-clip Adam query's save/load (the nested
# wrapper and adaptive SGD ones stay: the same round trip then fit).
SLOW_CASES = {
    "test_save_load_custom_query_then_fit[joint_adam]"}

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


def _save_load_fit(path, make_query, make_opt):
  """A 2-step fit of `_seq` with the DP optimizer `make_opt(make_query(model))`, saved to
  `path` and loaded; the loaded model's optimizer config and predictions are read before the
  loaded model fits 2 more steps: a namespace of all of these."""
  x, y = _data()
  model = _seq()
  model(x[:1])
  opt = make_opt(make_query(model))
  model.compile(optimizer=opt, loss=LOSS)
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  model.save(path)
  loaded = keras.models.load_model(path)
  run = types.SimpleNamespace(model=model, opt=opt, loaded=loaded,
                              loaded_config=loaded.optimizer.get_config(),
                              loaded_prediction=loaded.predict(x, verbose=0),
                              prediction=model.predict(x, verbose=0))
  loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)
  return run


def _adaptive_sgd(q):
  return dp.keras.DPKerasSGDOptimizer(dp_query=q, learning_rate=0.1)


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
  """The adaptive-clip SGD's saved run, shared by the two tests that read it."""
  return _save_load_fit(str(tmp_path_factory.mktemp("adaptive") / "m.keras"), _adaptive,
                        _adaptive_sgd)


@pytest.mark.parametrize("make_query,make_opt,n_events", [
    (_nested, lambda q: dp.keras.DPOptimizer(keras.optimizers.RMSprop(1e-3), dp_query=q), 4),
    (None, None, 2),   # the adaptive-clip SGD: `adaptive_run`
    (_joint, lambda q: dp.keras.DPKerasAdamOptimizer(dp_query=q, learning_rate=1e-3), 1),
], ids=["nested_wrapper", "adaptive_sgd", "joint_adam"])
def test_save_load_custom_query_then_fit(tmp_path, request, make_query, make_opt, n_events):
  if make_query is None:
    run = request.getfixturevalue("adaptive_run")
  else:
    run = _save_load_fit(os.path.join(tmp_path, "m.keras"), make_query, make_opt)
  model, opt, loaded = run.model, run.opt, run.loaded
  assert type(loaded.optimizer) is type(opt)
  np.testing.assert_allclose(run.loaded_prediction, run.prediction, rtol=1e-6)
  # Same query; the ledger travels with the model: the 2 saved steps + the 2 new ones.
  assert (dp_query.serialize(loaded.optimizer.dp_query.query)
          == dp_query.serialize(opt.dp_query.query))
  d = loaded.ledger.to_dict()
  assert d["num_samples"] == 4 and len(d["runs"][0]["queries"]) == n_events
  assert int(model.ledger.sample_count.numpy()) == 2


def test_saved_adaptive_clip_resumes(adaptive_run):
  model, loaded = adaptive_run.model, adaptive_run.loaded
  saved_clip = model.optimizer.get_config()["dp_global_state"][0]
  assert saved_clip != pytest.approx(0.1)          # the clip adapted during training
  assert adaptive_run.loaded_config["dp_global_state"][0] == saved_clip
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
