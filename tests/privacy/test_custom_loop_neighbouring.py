"""Custom training loops get fit's protections (issue 12): neighbouring batches through
`compute_private_gradients` under every dtype policy, the float16 overflow counter, the oneDNN
guard and the batch-independence probe.

Relation: add/remove one example (Poisson sampling); the ledger records sensitivity C. Each
case runs the real private step with noise 0 and normalize=False (its output is the clipped
sum) on a batch, then on neighbours with one example removed (mask 0) or with one adversarial
example added, and checks that the change never exceeds the recorded sensitivity."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import routing

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16", "bfloat16"]
CLIP = 0.5
B = 6


@pytest.fixture(params=[pytest.param(p, marks=pytest.mark.slow) if p.endswith("bfloat16") else p
                        for p in POLICIES])
def policy(request):
  keras.config.set_dtype_policy(request.param)
  yield request.param
  keras.config.set_dtype_policy("float32")


def _model():
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                           keras.layers.Dense(3)])


def _losses(model, x, y):
  logits = keras.ops.cast(model(x, training=True), "float32")
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _private_step(opt, model, form):
  """The custom loop's private step as one tf.function: (x, y, mask) -> flat clipped sum."""

  @tf.function
  def step(x, y, mask):
    if form == "data":
      grads = opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]),
                                            model.trainable_variables, data=(x, y), mask=mask,
                                            model=model)
    else:
      grads = opt.compute_private_gradients(lambda: _losses(model, x, y),
                                            model.trainable_variables, mask=mask, model=model)
    assert all(g.dtype == tf.float32 for g in grads)
    return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

  return lambda x, y, mask: np.asarray(step(x, y, mask), np.float64)


def _recorded_sensitivity(opt):
  return max(q["sensitivity"] for q in opt.ledger.to_dict()["runs"][-1]["queries"])


@pytest.mark.parametrize("form", ["data", pytest.param("vector_loss", marks=pytest.mark.slow)])
def test_custom_loop_neighbours_never_exceed_recorded_sensitivity(policy, form):
  keras.utils.set_random_seed(0)
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
  opt.set_sampling(1000, B / 1000, "poisson")
  rng = np.random.RandomState(0)
  x = np.concatenate([rng.randn(B, 4), np.zeros((1, 4))]).astype("float32") * 3
  y = rng.randint(0, 3, B + 1).astype("int32")
  mask = np.r_[np.ones(B), 0.0].astype("float32")
  private_sum = _private_step(opt, model, form)
  base = private_sum(x, y, mask)
  changes = []
  for j in range(B):   # remove example j
    m2 = mask.copy()
    m2[j] = 0.0
    changes.append(np.linalg.norm(private_sum(x, y, m2) - base))
  for scale in (0.1, 10.0, 1e4):   # add an adversarial example (1e4 overflows float16)
    x2 = x.copy()
    x2[B] = rng.randn(4) * scale
    changes.append(np.linalg.norm(private_sum(x2, y, np.ones(B + 1, "float32")) - base))
  recorded = _recorded_sensitivity(opt)
  assert recorded == pytest.approx(CLIP)
  assert max(changes) <= recorded * (1 + 1e-3), (policy, changes)
  assert max(changes) > 0.5 * recorded   # the clip is reached: the check is not vacuous
  if policy != "mixed_float16":
    assert opt.overflowed_records == 0   # no loss scale: nothing is ever zeroed


def test_float16_overflow_is_counted_and_contributes_zero(capfd):
  keras.config.set_dtype_policy("mixed_float16")
  try:
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3, use_bias=False)
    layer.build((None, 4))
    opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
    opt.set_sampling(1000, 0.01, "poisson")
    x = np.ones((3, 4), "float32")
    x[1] = 3e4   # its float16 loss scale product overflows: gradient inf

    def loss_fn(xr):
      return keras.ops.sum(keras.ops.square(keras.ops.cast(layer(xr), "float32")), axis=-1)

    both = opt.compute_private_gradients(loss_fn, layer.trainable_variables, data=x)
    without = opt.compute_private_gradients(loss_fn, layer.trainable_variables, data=x,
                                            mask=np.array([1, 0, 1], "float32"))
    assert opt.overflowed_records == 1   # the masked-out copy of it is zero anyway
    np.testing.assert_allclose(np.asarray(both[0]), np.asarray(without[0]), atol=1e-6)
    assert "overflowed" in capfd.readouterr().err
  finally:
    keras.config.set_dtype_policy("float32")


def test_float16_losses_form_refuses_a_record_that_spoils_the_others_rows():
  """Under a float16 loss scale the losses form (one backward pass over the batch) refuses a
  step with any non-finite per-record row, as in float32: a record whose float16 input
  overflows (1e5 -> inf) while its loss stays finite (tanh saturates) makes every record's
  row NaN (inf x 0), so zeroing the non-finite rows dropped all four records (review: the
  sum moved by 2.13 S where the ledger states S). Noise off, S = 1."""
  keras.config.set_dtype_policy("mixed_float16")
  try:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
    opt.build(model.trainable_variables)
    opt.set_sampling(100, 0.04, "poisson", 4)

    def private_sum(x):
      y = tf.constant([[30.0], [-30.0], [30.0], [0.0]][:len(x)])
      with tf.GradientTape(persistent=True) as tape:
        losses = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32) - y), 1)
      return opt.compute_private_gradients(losses, model.trainable_variables, tape=tape,
                                           model=model)

    good = np.array([[0.5], [-1.0], [2.0]], "float32")
    assert all(np.all(np.isfinite(g)) for g in private_sum(tf.constant(good)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not finite"):
      private_sum(tf.constant(np.concatenate([good, [[1e5]]]).astype("float32")))
  finally:
    keras.config.set_dtype_policy("float32")


class _BatchCentering(keras.layers.Layer):
  def call(self, h):
    return h - keras.ops.mean(h, axis=0, keepdims=True)


def test_vector_loss_form_refuses_a_batch_mixing_model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), _BatchCentering(),
                            keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
  opt.set_sampling(1000, 0.01, "poisson")
  x, y = np.random.RandomState(0).randn(B, 4).astype("float32"), np.zeros(B, "int32")
  with pytest.raises(ValueError, match="batch_centering.*data="):
    opt.compute_private_gradients(lambda: _losses(model, x, y), model.trainable_variables,
                                  model=model)
  # each record run alone: exact, accepted
  opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]), model.trainable_variables,
                                data=(x, y), model=model)


@pytest.mark.slow
def test_onednn_affected_model_through_custom_loop_matches_per_example_loop():
  """EinsumDense through the custom loop with model=: under oneDNN the per-record gradients
  come from a sequential loop (routing.use_vectorized_map); they match a per-example loop."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.EinsumDense("bi,ij->bj", output_shape=5, bias_axes="j"),
                            keras.layers.Activation("tanh"), keras.layers.Dense(3)])
  assert routing.use_vectorized_map(model) == (not routing.onednn_enabled())
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
  opt.set_sampling(1000, 0.01, "poisson")
  rng = np.random.RandomState(1)
  x, y = rng.randn(B, 4).astype("float32") * 3, rng.randint(0, 3, B).astype("int32")
  got = _private_step(opt, model, "data")(x, y, np.ones(B, "float32"))
  ref = 0.0
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_losses(model, x[i:i + 1], y[i:i + 1]))
    g = np.concatenate([np.asarray(t).ravel() for t in tape.gradient(
        loss, model.trainable_variables)])
    ref = ref + g * min(1.0, CLIP / np.linalg.norm(g))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
