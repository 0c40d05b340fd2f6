"""Review R (session 29): rollbacks with noise ON on the paths the float32-sum change touched
(the vectorized path's pinned pairwise sum and clip shrink, physical chunks, custom loops,
make_private): a step retaken after `tf.train.Checkpoint.restore`, `load_weights` or
`iterations.assign` draws fresh noise, and the ledger charges every released update.

Large noise (z = 10, S = 0.01) makes an update its noise: two updates at the same counter
with the same noise have correlation 1, independent ones about 1/sqrt(d) (d = 12,000).
tests/privacy/test_rollback_noise.py covers fit on the default (fast) path under XLA.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

S, Z, N, B = 0.01, 10.0, 64, 16


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 300)).astype("float32"), rng.normal(size=(N, 40)).astype("float32")


def _corr(u1, u2):
  a, b = u1.ravel() - u1.mean(), u2.ravel() - u2.mean()
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _keras_path(path):
  """(model, optimizer, one_step()) of a fit-based path."""
  kw = dict(learning_rate=1.0, clipping="vectorized")
  if path == "chunks":
    kw["max_physical_batch_size"] = 4
  if path == "make_private":
    model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(40)])
    model.compile(keras.optimizers.SGD(1.0), keras.losses.MeanSquaredError())
    model = dp.keras.make_private(model, l2_norm_clip=S, noise_multiplier=Z,
                                  clipping="vectorized")
  else:
    model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
    model.compile(dp.keras.DPKerasSGDOptimizer(S, Z, **kw), keras.losses.MeanSquaredError())
  x, y = _data()

  def one_step():
    model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=1, verbose=0)

  return model, model.optimizer, one_step


def _custom_loop():
  model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0)
  opt.set_sampling(N, B / N, "poisson", B)
  x, y = _data()
  x, y = tf.constant(x[:B]), tf.constant(y[:B])

  @tf.function
  def step():
    grads = opt.compute_private_gradients(
        lambda: tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1),
        model.trainable_variables, model=model)
    opt.apply_private_gradients(grads, model.trainable_variables)

  return model, opt, lambda: step()


@pytest.mark.parametrize("path", [pytest.param("chunks", marks=pytest.mark.slow),
                                  pytest.param("make_private", marks=pytest.mark.slow),
                                  "custom_loop"])
def test_a_rolled_back_step_draws_fresh_noise_and_is_charged(path, tmp_path):
  model, opt, one_step = _custom_loop() if path == "custom_loop" else _keras_path(path)
  kernel = model.layers[0].kernel
  one_step()
  released = 1
  for rollback in ("checkpoint", "load_weights", "iterations_assign"):
    start, counter = kernel.numpy().copy(), int(opt.iterations.numpy())
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    saved = ckpt.save(str(tmp_path / f"ck_{rollback}"))
    model.save_weights(str(tmp_path / f"w_{rollback}.weights.h5"))
    one_step()
    first = kernel.numpy() - start
    if rollback == "checkpoint":
      ckpt.restore(saved)
    elif rollback == "load_weights":
      model.load_weights(str(tmp_path / f"w_{rollback}.weights.h5"))
    else:
      kernel.assign(start)
      opt.iterations.assign(counter)
    if not (path == "custom_loop" and rollback == "load_weights"):   # the optimizer is
      assert int(opt.iterations.numpy()) == counter, rollback         # not the model's there
    np.testing.assert_array_equal(kernel.numpy(), start)
    one_step()
    second = kernel.numpy() - start
    released += 2
    assert abs(_corr(first, second)) < 0.1, (path, rollback, _corr(first, second))
    assert int(opt.ledger.sample_count.numpy()) == released, (path, rollback)
