"""Review R (session 31): one record whose gradient is not finite (a NaN or infinite feature, an
infinite or NaN sample weight) must not change what the step releases by more than C.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Sec. 2: each record's contribution is clipped to norm <= C, so adding or
removing one record moves the clipped sum by at most C, whatever the record holds. The clip
factor of a non-finite norm is 0 (dp_query.clip_factors), but 0 times a NaN or infinite
gradient is NaN: unless the record's gradient itself is zeroed, the whole sum, the noised sum
(noise + NaN = NaN) and every weight become NaN on D' = D + r and stay finite on D, which tells
D from D' with certainty (no epsilon covers it).

Relation: add/remove one example (Poisson, declared with `set_sampling`). The model is a
bias-free Dense(1) from zero weights, x = 1, loss y * output, y = 10 (each example's gradient
10: clipped to C), SGD lr 1, noise 0, normalize=False: w0 - w1 is the step's clipped sum.
D: 16 examples; D' = D + r, r with the non-finite entry. Independent float64 value: D's clipped
sum is 16 C, and r may add any term of norm <= C, so the two updates are finite and at most C
apart.

Measured at 86d7223 (train_on_batch, noise off): the vectorized path gives NaN weights on D'
for a NaN or infinite feature and an infinite sample weight, in a graph and under XLA (a NaN
sample weight: NaN in a graph, finite under XLA), and so does a custom loop
(compute_private_gradients, losses form, in a graph) and the DEFAULT clipping ("auto") of a
model with a custom layer (routed to the vectorized path); the fast path (ghost norms) stays
finite and within C. Fix: zero a record's gradient where
it is not finite before the clip multiplies it (chunking.unscale_records does it for float16
loss scaling only), e.g. tf.where(finite, g * factor, 0) in the vectorized clip.

Since (session 31): dp_query.scale_record zeroes a record of non-finite norm in the query's clip
(clip_by_global_l2_norm, automatic clipping): the vectorized path passes in a graph and under
XLA. The custom loop's vector (losses) form, where r's NaN reaches every record's jacobian row
through the batch's backward (0 x NaN) and all records would be zeroed (16 C), refuses the step.
Since (session 36, review R4 finding 9): refusing is itself a release (whether the run goes on
depends on r); that form now runs a non-finite batch record by record and r contributes zero.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

C, B, Y = 1.0, 16, 10.0
_SLOW = pytest.mark.slow

def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _rows(kind):
  """(x, y, sample weights) of D' = the 16 examples of D plus r, r's entry non-finite."""
  x = np.ones((B + 1, 1), np.float32)
  y = np.full((B + 1, 1), Y, np.float32)
  w = np.ones(B + 1, np.float32)
  bad = {"x_nan": np.nan, "x_inf": np.inf, "w_inf": np.inf, "w_nan": np.nan}[kind]
  (x[:, 0] if kind.startswith("x") else w)[B] = bad
  return x, y, w


def _optimizer(clipping):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: the no-noise warning
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping=clipping,
                                       normalize=False)
  opt.set_sampling(1 << 20, B / (1 << 20), "poisson", B)
  return opt


def _model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((1,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])


def _train_on_batch(clipping, jit, rows):
  """w0 - w1 (float64) of one train_on_batch step of a DP model on `rows`."""
  inner = _model()
  model = dp.keras.DPSequential(inner.layers)
  model.compile(optimizer=_optimizer(clipping), loss=_loss, jit_compile=jit)
  x, y, w = rows
  model.train_on_batch(x, y, sample_weight=w)
  return -model.get_weights()[0].astype(np.float64).ravel()


def _custom_loop(rows):
  """w0 - w1 of one custom-loop step (compute_private_gradients, losses form) in a graph."""
  model = _model()
  opt = _optimizer("vectorized")

  @tf.function
  def step(x, y, w):
    grads = opt.compute_private_gradients(
        lambda: _loss(y, model(x, training=True)) * w, model.trainable_variables, model=model)
    return tf.reshape(grads[0], [-1])

  return np.asarray(step(*rows), np.float64)


def _move(run, kind):
  x, y, w = _rows(kind)
  s_d = run((x[:B], y[:B], w[:B]))
  s_d2 = run((x, y, w))
  exact = float(np.sum(np.clip(Y * x[:B, 0].astype(np.float64), -C, C)))   # D: 16 C
  assert exact == B * C
  assert abs(float(s_d[0]) - exact) <= 1e-3 * exact, (s_d, exact)   # D's step as expected
  assert np.all(np.isfinite(s_d2)), f"the step on D' released {s_d2}"
  moved = float(np.linalg.norm(s_d2 - s_d))
  assert moved <= C, moved


# By default one case per path and per jit mode: [vectorized-True-w_inf] and
# [fast-False-x_nan] (x_nan in graph mode on the vectorized path: -m slow).
@pytest.mark.parametrize("clipping, jit, kind", [
    pytest.param("vectorized", False, "x_nan", marks=_SLOW),
    pytest.param("vectorized", True, "w_inf"),
    pytest.param("vectorized", False, "x_inf", marks=_SLOW),
    pytest.param("vectorized", False, "w_inf", marks=_SLOW),
    pytest.param("vectorized", False, "w_nan", marks=_SLOW),
    pytest.param("vectorized", True, "x_nan", marks=_SLOW),
    pytest.param("vectorized", True, "x_inf", marks=_SLOW),
    pytest.param("vectorized", True, "w_nan", marks=_SLOW),   # finite under XLA
    ("fast", False, "x_nan"),
    pytest.param("fast", True, "w_inf", marks=_SLOW),
    pytest.param("fast", False, "x_inf", marks=_SLOW),
    pytest.param("fast", False, "w_inf", marks=_SLOW),
    pytest.param("fast", False, "w_nan", marks=_SLOW),
    pytest.param("fast", True, "x_nan", marks=_SLOW),
    pytest.param("fast", True, "x_inf", marks=_SLOW),
    pytest.param("fast", True, "w_nan", marks=_SLOW),
])
def test_a_non_finite_record_moves_train_on_batch_by_at_most_C(clipping, jit, kind):
  _move(lambda rows: _train_on_batch(clipping, jit, rows), kind)


@pytest.mark.parametrize("kind", ["x_nan", pytest.param("w_inf", marks=_SLOW)])
def test_a_non_finite_record_in_the_custom_loops_losses_form_contributes_zero(kind):
  """The losses form differentiates the batch at once: r's NaN reaches every record's
  jacobian row (0 x NaN), so zeroing non-finite rows would drop all 16 (a move of 16 C).
  Refusing the step instead would let r decide whether the run goes on (review R4, finding
  9): the batch is run again record by record, r's own gradient is clipped to zero and D''s
  step is D's (a move of 0 <= C)."""
  _move(_custom_loop, kind)
  x, y, w = _rows(kind)
  np.testing.assert_allclose(_custom_loop((x, y, w)), _custom_loop((x[:B], y[:B], w[:B])),
                             rtol=1e-6)


class _Scale(keras.layers.Layer):
  """x * s elementwise (a custom layer with no fast-path rule: clipping="auto" routes the
  model to the vectorized path)."""

  def build(self, shape):
    self.s = self.add_weight(shape=(shape[-1],), initializer="ones")

  def call(self, x):
    return x * self.s


def _auto_with_custom_layer(rows):
  """w0 - w1 over all weights of one train_on_batch step, default clipping ("auto"), a model
  with a custom layer (its gradient is 0 here: the kernel starts at 0)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((1,)), _Scale(), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, normalize=False)
  opt.set_sampling(1 << 20, B / (1 << 20), "poisson", B)
  model.compile(optimizer=opt, loss=_loss)
  before = np.concatenate([w.astype(np.float64).ravel() for w in model.get_weights()])
  x, y, w = rows
  model.train_on_batch(x, y, sample_weight=w)
  after = np.concatenate([w.astype(np.float64).ravel() for w in model.get_weights()])
  return (before - after)[::-1]   # the kernel's coordinate first


@pytest.mark.parametrize("kind", [pytest.param("x_nan", marks=_SLOW)])
def test_a_non_finite_record_moves_the_default_clipping_of_a_custom_layer_by_at_most_C(kind):
  """clipping="auto" (the default) on a model with a custom layer: 86d7223, NaN on D'."""
  _move(_auto_with_custom_layer, kind)
