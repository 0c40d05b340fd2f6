"""Shared builders and an independent per-example reference for the Keras tests."""

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp


def set_sampling(model, n):
  model.optimizer.set_sampling(n, 1.0, "shuffle", n)


def one_step_update(model, x, y, sample_weight=None):
  """Weight change of one private step with SGD(lr=1): -(private gradient)."""
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.train_on_batch(x, y, sample_weight=sample_weight)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


def reference_gradient(model, loss_obj, x, y, clip, num_microbatches=None, reg=True,
                       sample_weight=None):
  """Mean of clipped per-record gradients, computed by an independent Python loop.

  Record j of a batch of B holds examples {i : i mod M == j} (one example if M is None).
  x and y may be nests of arrays (rows on the leading axis); with sample_weight [B], the
  record's loss is loss_obj(y_j, pred_j, sample_weight=w_j).
  """
  leaves = tf.nest.flatten(x)
  b = int(leaves[0].shape[0])
  m = b if num_microbatches is None else num_microbatches
  groups = [list(range(j, b, m)) for j in range(m)]
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for idx in groups:
    xi = tf.nest.map_structure(lambda a: tf.gather(a, idx), x)
    yi = tf.nest.map_structure(lambda a: tf.gather(a, idx), y)
    with tf.GradientTape() as tape:
      pred = model(xi, training=True)
      if sample_weight is None:
        loss = loss_obj(yi, pred)
      else:
        loss = loss_obj(yi, pred, sample_weight=tf.gather(sample_weight, idx))
      if reg and model.losses:
        loss = loss + tf.add_n(model.losses)
    g = tape.gradient(loss, model.trainable_variables,
                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
    g = [tf.convert_to_tensor(t).numpy().astype(np.float64) for t in g]
    norm = np.sqrt(sum(float(np.sum(t * t)) for t in g))
    f = min(1.0, clip / max(norm, 1e-30))
    total = [a + f * t for a, t in zip(total, g)]
  return [t / m for t in total]


def nonprivate_gradient(model, loss_obj, x, y):
  with tf.GradientTape() as tape:
    loss = loss_obj(y, model(x, training=True))
    if model.losses:
      loss = loss + tf.add_n(model.losses)
  return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(
      loss, model.trainable_variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)]


def small_data(n=64, seed=0):
  """n records of 6 features and 3 classes."""
  rng = np.random.RandomState(seed)
  return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


def small_seq():
  """A seeded 6-4-3 DPSequential."""
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"),
                                keras.layers.Dense(3)])


def assert_step_matches_reference(model, loss_obj, x, y, clip, n, sample_weight=None,
                                  reference_data=None, **reference_kwargs):
  """One private step (noise 0, SGD lr=1) of `model` on (x, y), sampled as n records,
  equals the clipped reference gradient of `reference_data` (default (x, y)) to float32
  round-off (rtol 2e-4, atol 2e-6). Returns the step's update."""
  rx, ry = (x, y) if reference_data is None else reference_data
  ref = reference_gradient(model, loss_obj, rx, ry, clip=clip, **reference_kwargs)
  set_sampling(model, n)
  got = one_step_update(model, x, y, sample_weight=sample_weight)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
  return got


def assert_close_up_to_the_shrink(got, ref, rtol=2e-4, atol=2e-6, max_eta=2e-3, err_msg=""):
  """The DP update equals the reference times ONE factor s in [1 / (1 + max_eta), 1] for every
  variable: the clip shrink 1 / (1 + eta) of a sum formed in a pinned order
  (dp_query/summation.rounding_margin; s = 1 where the step charges none), then each
  coordinate within rtol / atol.

  Args:
    got: the update's arrays.
    ref: the reference's arrays (same shapes).
    rtol: per-coordinate relative tolerance after the shrink.
    atol: per-coordinate absolute tolerance after the shrink.
    max_eta: the largest eta accepted.
    err_msg: appended to a failure's message.
  """
  g = np.concatenate([np.ravel(a) for a in got]).astype(np.float64)
  r = np.concatenate([np.ravel(a) for a in ref]).astype(np.float64)
  s = float(g @ r / (r @ r)) if r @ r > 0 else 1.0
  assert 1 / (1 + max_eta) <= s <= 1 + 1e-6, (s, err_msg)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, s * np.asarray(b), rtol=rtol, atol=atol, err_msg=err_msg)
