"""Noise scale, ledger completeness (XLA included), sampling policies, bad input."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter import accounting

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_update_stddev_is_lr_z_c_over_b():
  # Zero gradients (loss independent of the weights): the update is pure noise,
  # lr * N(0, (z C)^2) / B per coordinate. 20 steps x 5000 coordinates = 1e5 draws: the
  # sample std has relative standard error 1/sqrt(2 * 1e5) = 0.22%; we allow 1.5% (~7 se).
  lr, z, c, b = 0.5, 1.3, 2.0, 16
  # a 1 x 5000 kernel w; the loss is 0 * (w's output): zero gradients, per-example losses
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(5000, use_bias=False,
                                                                  kernel_initializer="zeros")])
  w = model.trainable_variables[0]
  opt = dp.keras.DPKerasSGDOptimizer(c, z, learning_rate=lr, seed=7)
  opt.set_sampling(1000, b / 1000, "shuffle", b)
  x = tf.zeros([b, 1])
  deltas = []
  step = tf.function(lambda: opt.minimize(lambda: 0.0 * tf.reduce_sum(model(x), 1), [w],
                                          model=model))
  for _ in range(20):
    before = w.numpy().copy()
    step()
    deltas.append(w.numpy() - before)
  d = np.concatenate(deltas)
  expected = lr * z * c / b
  assert abs(d.std() / expected - 1.0) < 0.015
  assert abs(d.mean()) < 5 * expected / np.sqrt(d.size)
  assert int(opt.ledger.sample_count.numpy()) == 20


def _mlp():
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"),
                                keras.layers.Dense(3)])


# By default graph at one step per execution; both XLA cases with -m slow. The default suite
# records every step of an XLA fit at steps_per_execution 1 in test_xla_compile_once's fast
# case (ledger samples == iterations == 18, Poisson; run in the default tier as
# test_distribute.py's xla_compile job; vectorized and band_mf nightly) and at 3 in
# tests/ledger/test_rare_branches_fit.py's [True] (Poisson arrays, every step charged,
# epsilon = compute_dp_sgd_privacy by hand); [False-1] here checks the ledger's run record
# (policy, q, population, relation, query).
@pytest.mark.parametrize("jit,spe", [(False, 1), pytest.param(True, 1, marks=pytest.mark.slow),
                                     pytest.param(True, 3, marks=pytest.mark.slow)])
def test_every_step_is_recorded_poisson(jit, spe):
  rng = np.random.RandomState(0)
  x = rng.randn(200, 6).astype("float32")
  y = rng.randint(0, 3, 200)
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=LOSS, jit_compile=jit, steps_per_execution=spe)
  ds = dp.data.poisson_batches(x, y, expected_batch_size=20, steps_per_epoch=7, seed=1)
  model.fit(ds, epochs=2, verbose=0)
  led = model.ledger
  assert int(led.sample_count.numpy()) == 14
  d = led.to_dict()
  assert [r["policy"] for r in d["runs"]] == ["poisson"]
  assert d["runs"][0]["selection_probability"] == pytest.approx(0.1)
  assert d["runs"][0]["population_size"] == 200
  assert d["runs"][0]["relation"] == "add_or_remove_one"
  assert d["runs"][0]["queries"] == [{"type": "gaussian", "l2_norm_clip": 1.0,
                                      "stddev": pytest.approx(1.1), "sensitivity": 1.0}]
  assert accounting.epsilon(led, 1e-5) == pytest.approx(
      accounting.compute_dp_sgd_privacy(200, 20, 1.1, 14 * 20 / 200, 1e-5).epsilon, rel=1e-6)


def _fit_mlp_on_arrays(**fit_kwargs):
  """A 6-feature MLP fit for 2 epochs at batch 16 on 50 fixed-seed records (S = 1, z = 1.1);
  returns (model, its ledger as a dict)."""
  rng = np.random.RandomState(1)
  x = rng.randn(50, 6).astype("float32")
  y = rng.randint(0, 3, 50)
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=LOSS)
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, **fit_kwargs)
  return model, model.ledger.to_dict()


def test_arrays_are_poisson_sampled_by_default():
  # fit(x, y, batch_size=B) on arrays: Poisson samples of expected size B (q = B / n),
  # round(n / B) steps per epoch; sample_weight joins the padding mask.
  model, d = _fit_mlp_on_arrays(sample_weight=np.ones(50))
  assert d["num_samples"] == 2 * round(50 / 16)
  assert [(r["policy"], r["selection_probability"], r["relation"]) for r in d["runs"]] == [
      ("poisson", pytest.approx(16 / 50), "add_or_remove_one")]
  assert accounting.epsilon(model.ledger, 1e-5) == pytest.approx(
      accounting.compute_dp_sgd_privacy(50, 16, 1.1, 6 * 16 / 50, 1e-5).epsilon, rel=1e-6)


def test_shuffled_arrays_record_shuffle_policy_and_passes():
  model, d = _fit_mlp_on_arrays(sampling="shuffle")   # 4 batches per pass
  assert d["num_samples"] == 8 and int(model.ledger.passes.numpy()) == 2
  assert {r["policy"] for r in d["runs"]} == {"shuffle"}
  assert d["runs"][0]["sample_size"] == 16 and d["runs"][0]["relation"] == "replace_one"
  assert d["runs"][0]["queries"][0]["sensitivity"] == 2.0   # replace-one: 2S
  assert "shuffle" in " ".join(accounting.privacy_report(model.ledger, delta=1e-5).assumptions).lower()


def test_unknown_dataset_is_refused():
  ds = tf.data.Dataset.from_tensor_slices((np.zeros([8, 6], "float32"), np.zeros([8], "int32"))).batch(4)
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1), loss=LOSS)
  with pytest.raises(ValueError, match="set_sampling"):
    model.fit(ds, verbose=0)


def test_poisson_uses_expected_batch_size_as_denominator():
  # noise 0, clip inf: the update is sum of gradients / (q n), not / |sample|.
  rng = np.random.RandomState(2)
  x = rng.randn(100, 6).astype("float32")
  y = rng.randint(0, 3, 100)
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(float("inf"), 0.0, learning_rate=1.0), loss=LOSS)
  model.optimizer.set_sampling(100, 0.1, "poisson")
  xb, yb = x[:7], y[:7]
  mask = np.zeros([16], "float32"); mask[:7] = 1
  xp = np.zeros([16, 6], "float32"); xp[:7] = xb
  yp = np.zeros([16], "int64"); yp[:7] = yb
  model(xb)
  with tf.GradientTape() as tape:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")(yb, model(xb))
  ref = [g.numpy() / 10.0 for g in tape.gradient(loss, model.trainable_variables)]
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.train_on_batch(xp, yp, sample_weight=mask)
  for b0, v, r in zip(before, model.trainable_variables, ref):
    np.testing.assert_allclose(b0 - v.numpy(), r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "noise_multiplier"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0), "num_microbatches"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, clipping="ghost"), "clipping"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, max_physical_batch_size=0), "max_physical_batch_size"),
    (dict(l2_norm_clip=None, noise_multiplier=1.0), "l2_norm_clip"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dp.keras.DPKerasSGDOptimizer(**kwargs)


def test_more_microbatches_than_examples():
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, 16), loss=LOSS)
  model.optimizer.set_sampling(100, 0.08, "shuffle", 8)
  with pytest.raises(ValueError, match="num_microbatches=16"):
    model.train_on_batch(np.zeros([8, 6], "float32"), np.zeros([8], "int32"))


def test_scalar_loss_refused():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  x = tf.ones([4, 2])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0)
  opt.set_sampling(10, 0.1)
  with pytest.raises(ValueError, match="scalar loss"):
    opt.minimize(lambda: tf.reduce_sum(model(x)), model.trainable_variables, model=model)


def test_plain_gradients_refused():
  w = tf.Variable([1.0, 2.0])
  opt = dp.keras.DPKerasAdamOptimizer(1.0, 1.0)
  with pytest.raises(ValueError, match="non-private"):
    opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])


def test_non_dp_optimizer_and_batchnorm_refused():
  model = _mlp()
  with pytest.raises(ValueError, match="DP optimizer"):
    model.compile(optimizer="sgd", loss=LOSS)
  bn = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
  with pytest.raises(ValueError, match="BatchNormalization"):
    bn.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0), loss=LOSS)
  bn.layers[1].trainable = False   # frozen: inference mode, allowed
  bn.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0), loss=LOSS)


def test_poisson_with_microbatches_refused():
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, 4)
  with pytest.raises(ValueError, match="num_microbatches"):
    opt.set_sampling(100, 0.1, "poisson")


def test_fit_with_partial_last_batch_smaller_than_microbatches():
  # 50 examples, batch 16, 8 microbatches of 2 (shuffled passes): the last batch holds 2
  # examples (TF Privacy's reshape crash); here its 6 empty microbatches are masked out.
  # (16 microbatches of a batch of 16 would be one example each: Poisson, per example.)
  rng = np.random.RandomState(3)
  x = rng.randn(50, 6).astype("float32")
  y = rng.randint(0, 3, 50)
  model = _mlp()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, 8, learning_rate=0.1), loss=LOSS)
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 4
  assert model.ledger.to_dict()["runs"][0]["policy"] == "shuffle"
  assert all(np.all(np.isfinite(w)) for w in model.get_weights())
  with pytest.raises(ValueError, match="num_microbatches=8"):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
