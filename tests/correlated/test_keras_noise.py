"""DP optimizers with `noise="iid" | "tree" | "band_mf" | "blt"` (issue 16, Keras).

Relations: add or remove one example under cyclic Poisson sampling (band_mf, blt), replace
one under shuffled passes (tree), as the ledger rows state. Here: the constructor and config,
the refusals (parameter and value named), and that `noise="iid"` is the default DP-SGD.
Resuming from checkpoints is in test_keras_noise_resume.py.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MECHANISMS = {
    "tree": {"restart_every": 4},
    "band_mf": {"num_bands": 2, "num_steps": 8},
    "blt": {"num_steps": 8, "num_buffers": 2, "min_separation": 2},
}


def _data(n=48):
  rng = np.random.RandomState(0)
  return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


def _model(optimizer):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=optimizer, loss=LOSS)
  return model


@pytest.mark.parametrize("cls", [dp.keras.DPKerasSGDOptimizer, dp.keras.DPKerasAdamOptimizer,
                                 dp.keras.make_dp_optimizer_class(keras.optimizers.Lion)])
@pytest.mark.parametrize("noise", sorted(MECHANISMS))
def test_config_round_trips(cls, noise):
  opt = cls(1.0, 1.3, noise=noise, learning_rate=0.05, **MECHANISMS[noise])
  config = opt.get_config()
  assert config["noise"] == noise and all(config[k] == v for k, v in MECHANISMS[noise].items())
  again = cls.from_config(config)
  assert again.get_config() == config
  assert (again.noise, again.noise_params) == (opt.noise, opt.noise_params)
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(restored) is cls and restored.get_config() == config


def test_iid_is_the_default_and_its_config_is_unchanged():
  default = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, name="o")
  explicit = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, noise="iid", learning_rate=0.1, name="o")
  assert default.get_config() == explicit.get_config()
  assert "noise" not in default.get_config() and default.noise == "iid"


def _fit_weights(noise, **params):
  x, y = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # test seeds (not private)
    model = _model(dp.keras.DPKerasSGDOptimizer(1.0, 0.7, seed=5, noise=noise, learning_rate=0.2,
                                                **params))
    model.fit(dp.data.poisson_batches(x, y, expected_batch_size=12, steps_per_epoch=3, seed=2),
              epochs=1, verbose=0)
  return [v.numpy() for v in model.trainable_variables], model.ledger


@pytest.mark.slow
def test_one_band_is_dp_sgd_in_fit():
  """BandMF with b = 1 under Poisson sampling is DP-SGD: same weights, same ledger epsilon."""
  want, want_ledger = _fit_weights("iid")
  got, got_ledger = _fit_weights("band_mf", num_bands=1)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert dp.accounting.epsilon(got_ledger, 1e-5) == pytest.approx(
      dp.accounting.epsilon(want_ledger, 1e-5), rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    ({"noise": "gaussian"}, r"`noise` must be one of .*Received: noise='gaussian'"),
    ({"noise": "iid", "num_bands": 2},
     r"`num_bands` must be left out with noise='iid' .*Received: num_bands=2"),
    ({"noise": "tree"}, r"`restart_every` must be an int >= 1 .*Received: restart_every=None"),
    ({"noise": "tree", "restart_every": 0}, r"`restart_every` must be an int >= 1 .*Received: "
                                            r"restart_every=0"),
    ({"noise": "tree", "restart_every": 4, "num_bands": 2},
     r"`num_bands` must be left out with noise='tree'"),
    ({"noise": "band_mf"}, r"`num_bands` must be an int >= 1 .*Received: num_bands=None"),
    ({"noise": "band_mf", "num_bands": 0, "num_steps": 5}, r"`num_bands` must be .*=0"),
    ({"noise": "band_mf", "num_bands": 3},
     r"`num_steps` must be an int >= 1 with num_bands=3 .*Received: num_steps=None"),
    ({"noise": "band_mf", "num_bands": 2, "num_steps": 4, "band_strategy": "dense"},
     r"`strategy` must be one of .*Received: strategy='dense'"),
    ({"noise": "blt", "num_buffers": 2}, r"`num_steps` must be .*Received: num_steps=None"),
    ({"noise": "blt", "num_steps": 8, "min_separation": 1.5},
     r"`min_separation` must be an int .*Received: min_separation=1.5"),
    ({"noise": "blt", "num_steps": 8, "secure_mode": True},
     r"`secure_mode` must be False with noise='blt' .*Received: secure_mode=True"),
])
def test_bad_settings_are_refused_naming_the_parameter(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, **kwargs)


def test_dp_query_and_noise_are_exclusive():
  query = dp.dp_query.GaussianSumQuery(1.0, 1.0)
  with pytest.raises(ValueError, match=r"noise='band_mf' builds its own query"):
    dp.keras.DPKerasSGDOptimizer(dp_query=query, noise="band_mf", num_bands=1)


def test_from_budget_refuses_correlated_noise():
  with pytest.raises(ValueError, match=r"from_budget calibrates DP-SGD .*noise='tree'"):
    dp.keras.DPKerasSGDOptimizer.from_budget(2.0, 1e-5, 1, 12, 48, l2_norm_clip=1.0,
                                             noise="tree", restart_every=4)


def _cyclic(num_groups, steps=4):
  x, y = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return cyclic_poisson_batches(x, y, expected_batch_size=6, num_groups=num_groups,
                                  steps_per_epoch=steps, seed=1)


@pytest.mark.parametrize("noise,params,data,match", [
    ("band_mf", {"num_bands": 2, "num_steps": 8}, "arrays",
     r"noise='band_mf' with num_bands=2 is accounted only under sampling policy "
     r"'cyclic_poisson' with at least 2 groups .*got policy 'poisson'"),
    ("band_mf", {"num_bands": 3, "num_steps": 8}, "cyclic2",
     r"num_bands=3 .*at least 3 groups .*got policy 'cyclic_poisson', sample_size 2"),
    ("blt", {"num_steps": 8, "min_separation": 3}, "cyclic2",
     r"noise='blt' with min_separation=3 .*at least 3 groups"),
    ("tree", {"restart_every": 4}, "cyclic2",
     r"noise='tree' with restart_every=4 is accounted only under sampling policy 'shuffle'"),
    ("tree", {"restart_every": 3}, "shuffle",
     r"`restart_every` must divide .*a pass (here is ceil\(n / B\) = ceil\(48 / 12\) =|of this "
     r"dataset is) 4 steps .*Received: restart_every=3"),
])
def test_sampling_the_ledger_cannot_account_is_refused_before_any_step(noise, params, data,
                                                                        match):
  model = _model(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, noise=noise, learning_rate=0.1,
                                              **params))
  x, y = _data()
  with pytest.raises(ValueError, match=match):
    if data == "arrays":
      model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    elif data == "shuffle":
      model.fit(x, y, batch_size=12, epochs=1, verbose=0, sampling="shuffle")
    else:
      model.fit(_cyclic(2), epochs=1, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 0
  assert int(model.ledger.sample_count) == 0


def test_custom_loop_with_band_mf_records_banded_rows():
  """compute_private_gradients builds the mechanism on its variables; the sampling declared
  by hand (cyclic_poisson, 2 groups) waits for it; every step is one banded ledger row."""
  x, y = _data()
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, noise="band_mf", num_bands=2, num_steps=4,
                                     learning_rate=0.1)
  opt.set_sampling(48, 12 / 48, "cyclic_poisson", 2)
  assert opt.noise_state() is None                             # waits for the variables
  for t in range(3):
    rows = slice(12 * t, 12 * t + 12)
    grads = opt.compute_private_gradients(
        lambda rec: LOSS(rec[1], model(rec[0])), model.trainable_variables,
        data=(x[rows], y[rows]))
    opt.apply_private_gradients(grads, model.trainable_variables)
  assert int(opt.noise_state().step) == 3 and int(opt.ledger.sample_count) == 3
  [run] = opt.ledger.to_dict()["runs"]
  assert run["policy"] == "cyclic_poisson" and run["queries"][0]["type"] == "banded_gaussian"


def test_fit_on_data_declared_by_hand_waits_for_the_build():
  """set_sampling before the optimizer is built (cyclic_poisson, 2 groups), then fit on a
  plain tf.data.Dataset: the declaration is applied when fit builds the mechanism."""
  x, y = _data()
  model = _model(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, noise="band_mf", num_bands=2,
                                              num_steps=4, learning_rate=0.1))
  model.optimizer.set_sampling(48, 12 / 48, "cyclic_poisson", 2)
  with pytest.raises(ValueError, match=r"noise='band_mf': the mechanism is made when"):
    model.optimizer.dp_query.get_config()
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6).take(4)
  model.fit(ds, epochs=1, verbose=0)
  [run] = model.ledger.to_dict()["runs"]
  assert (run["policy"], run["sample_size"], len(run["queries"])) == ("cyclic_poisson", 2.0, 1)
  assert int(model.ledger.sample_count) == 4
