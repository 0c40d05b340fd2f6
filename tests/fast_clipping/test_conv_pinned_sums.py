"""The convolutions' pinned clipped sum (rules/conv.py `_pinned_kept_sum`,
`_pinned_recomputed_sum`): with one example per record every convolution whose per-example
gradient is small enough to keep forms sum_i c_i g_i from per-example gradients in a pinned
order (blocks of rows, the blocks by dp_query/summation.pairwise_sum) and declares it
(algebra.report_pinned), so that the step multiplies its sums by the clip shrink
1 / (1 + eta) (clipping._with_rounding_margin; Casacuberta et al., "Widespread
underestimation of sensitivity in differentially private libraries and how to fix it",
CCS 2022).

Checked: (1) noise off, the step's sums equal the shrink times an independent float64
per-record loop (exact norms, clip, sum), for the kept gradients, the gradients formed again
(a batch over the keep budget, and the folded Gram's norms), in graph mode and under
jit_compile=True, with a batch the trace knows or not, every sum declared pinned; (2) on
adversarial neighbouring batches of multi-position records (the float32 sum of the records'
terms built to round differently with and without the target record: Higham, "Accuracy and
Stability of Numerical Algorithms", Sec. 4.2) one record moves the sum by at most C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget

from . import covers

C = 0.5
# (path, jit, static): every pair of values in the default suite, the rest under `slow`
GRID = [(p, j, s) for p in ("kept", "formed_again", "foldgram") for j in (False, True)
        for s in (True, False)]


def _model():
  keras.utils.set_random_seed(3)
  return keras.Sequential([keras.Input((10, 10, 2)),
                           keras.layers.Conv2D(3, 4, strides=2, padding="same",
                                               activation="tanh"),
                           keras.layers.Conv2D(4, 2, strides=1, padding="valid"),
                           keras.layers.Flatten(), keras.layers.Dense(3)])


def _loss(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _reference(model, x, y, mask, norms):
  """(sum_i min(1, C / n_i) g_i in float64, g_i by a per-record float64 forward pass and n_i
  the step's norm of record i; the exact norms ||g_i||)."""
  ws = [tf.constant(w.numpy(), tf.float64) for w in model.trainable_variables]

  @tf.function
  def grads(xi, yi):   # one record's float64 gradient
    with tf.GradientTape() as tape:
      tape.watch(ws)
      h = tf.tanh(tf.nn.conv2d(xi, ws[0], 2, "SAME") + ws[1])
      h = tf.nn.conv2d(h, ws[2], 1, "VALID") + ws[3]
      logits = tf.reshape(h, [1, -1]) @ ws[4] + ws[5]
      loss = tf.nn.sparse_softmax_cross_entropy_with_logits(yi, logits)[0]
    return tape.gradient(loss, ws)

  total = [np.zeros(w.shape) for w in ws]
  exact = {}
  for i in np.flatnonzero(mask):
    g = [t.numpy() for t in grads(tf.constant(x[i:i + 1], tf.float64), y[i:i + 1])]
    exact[i] = np.sqrt(sum(np.sum(t ** 2) for t in g))
    c = min(1.0, C / float(norms[i]))
    total = [s + c * t for s, t in zip(total, g)]
  return total, exact


def _clipped_sum(model, x, y, mask, jit, static):
  """clipping.clipped_grad_sum(C) of the batch in one tf.function (XLA with `jit`), its batch
  axis known to the trace or not (`static`): (sums, norms)."""
  rows = len(x) if static else None
  spec = [tf.TensorSpec((rows,) + x.shape[1:]), tf.TensorSpec([rows], tf.int32),
          tf.TensorSpec([rows])]

  @tf.function(jit_compile=jit, input_signature=spec)
  def step(x, y, mask):
    return clipping.clipped_grad_sum(model, x, y, _loss, l2_norm_clip=C, mask=mask)

  return step(x, y, mask)


def _spy_plans(monkeypatch):
  """The plans clipping._with_rounding_margin sees, per call: [(variables, pinned)]."""
  seen = []
  original = clipping._with_rounding_margin

  def spy(result, plans, *args, **kwargs):
    seen.append((len(result), len(plans)))
    return original(result, plans, *args, **kwargs)

  monkeypatch.setattr(clipping, "_with_rounding_margin", spy)
  return seen


@pytest.mark.parametrize("path, jit, static", covers.slow_outside(GRID, covers.all_pairs(GRID)))
def test_noise_off_step_is_the_shrunk_float64_per_record_sum(path, jit, static, monkeypatch):
  if path == "formed_again":
    monkeypatch.setattr(budget, "KEEP_BYTES", 1)   # the gradients not kept: formed again
  if path == "foldgram":
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", "foldgram")
  seen = _spy_plans(monkeypatch)
  b = 70   # two blocks of 64 rows, the last padded; chunks of the batch where formed again
  rng = np.random.default_rng(5)
  x = rng.normal(size=(b, 10, 10, 2)).astype(np.float32)
  y = rng.integers(0, 3, b).astype(np.int32)
  mask = np.ones(b, np.float32)
  mask[[4, 66]] = 0.0
  x[4, 0, 0, 0] = np.nan   # a masked record whose input is not finite adds exactly nothing
  model = _model()
  got, norms = _clipped_sum(model, x, y, mask, jit, static)
  want, exact = _reference(model, np.nan_to_num(x), y, mask, norms.numpy())
  # the norms bound the exact ones (taken from the kept gradients: float32-exact; else upper
  # bounds covering the rounding of the record's terms, algebra.with_sum_rounding)
  for i, e in exact.items():
    assert e * (1 - 1e-6) <= norms[i] <= e * (1 + (1e-6 if path == "kept" else 3e-3))
  assert seen and all(n == p == 6 for n, p in seen), seen   # every sum pinned
  shrink = summation.step_shrink(b, block=64, final=1)
  assert 0.999 < shrink < 1.0
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.numpy(), shrink * w, rtol=2e-5, atol=2e-6)


def _adversarial_batch(batch):
  """Inputs [batch, 2, 1, 1] and labels of records whose kernel gradient (a 1x1 convolution,
  no bias, two positions: the second input 0) is the label y exactly; the labels in the
  review's sequential construction (tests/fast_clipping/test_cross_record_rounding_review.py):
  2^K - 1 ones, 1/2, the target 1, then -3/4 w (w = 2^(K - 24)), so that a sequential float32
  sum moves by 1 + (count) w without the target. Returns (x, y, the target's row)."""
  k_exp = int(np.log2(batch)) - 1
  m, w = 2 ** k_exp, 2.0 ** (k_exp - 24)
  y = np.array([1.0] * (m - 1) + [0.5, 1.0] + [-0.75 * w] * (batch - m - 1), np.float32)
  x = np.zeros((batch, 2, 1, 1), np.float32)
  x[:, 0] = 1.0
  return x, y.reshape(-1, 1, 1, 1), m


@pytest.mark.parametrize("jit", [False, True])
def test_one_record_moves_the_conv_sum_by_at_most_c(jit):
  batch = 4096
  x, y, target = _adversarial_batch(batch)
  model = keras.Sequential([keras.Input((2, 1, 1)),
                            keras.layers.Conv2D(1, 1, use_bias=False,
                                                kernel_initializer="ones")])
  loss = lambda y_true, y_pred: tf.reduce_sum(y_true * y_pred, axis=[1, 2, 3])

  @tf.function(jit_compile=jit)
  def step(mask):
    grads, norms = clipping.clipped_grad_sum(model, x, y[:, :1, :, :] * 1.0, loss,
                                             l2_norm_clip=1.0, mask=mask)
    return grads[0], tf.reduce_max(norms)

  mask = np.ones(batch, np.float32)
  s_d, n_d = step(tf.constant(mask))
  mask[target] = 0.0
  s_d2, _ = step(tf.constant(mask))
  assert float(n_d) <= 1.0   # every record unclipped: its term is its y
  moved = abs(float(s_d.numpy().ravel()[0]) - float(s_d2.numpy().ravel()[0]))
  assert 0.99 < moved <= 1.0, moved


def test_the_block_of_a_public_plan_is_that_of_its_rows():
  """Inside summation.public_plan a convolution's pinned block is that of the plan's rows per
  chunk, the same for batches of n and n + 1 rows where the budget makes the block grow with
  the rows (before: the batch's rows, so the block and the clip shrink could differ between
  neighbouring datasets)."""
  from tf_dpiter.keras.fast_clipping import algebra   # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.fast_clipping.rules import conv   # pylint: disable=g-import-not-at-top

  class _Form:   # the two fields conv._pinned_block reads: a 1.2 MB block sum per row
    rows, cols = 1, 300_000

  unplanned = [conv._pinned_block(_Form, tf.ones([n])) for n in (4098, 4099)]
  assert unplanned[0] != unplanned[1]   # the budget binds: the block follows the rows
  with summation.public_plan(8704, 8704):
    planned = [conv._pinned_block(_Form, tf.ones([n])) for n in (4098, 4099)]
  want = algebra.pinned_block(8704, 4 * _Form.rows * _Form.cols, budget.CHUNK_BYTES)
  assert planned == [want, want] and want > 64


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradients_not_kept_take_the_folded_gram_norms(jit, monkeypatch):
  """A convolution whose per-example gradients are over the keep budget and whose folded
  Gram costs less than them (rules/conv.py `_fold_gram_cheaper`: few positions, many patch
  entries and channels, as the tutorial CNN's second convolution) takes its norms from the
  folded Gram (`_fold_gram_norms`) and forms the gradients again for the pinned sum: the norms
  bound the exact float64 ones from above, and with noise off the sum is the shrink times
  the float64 per-record clipped sum."""
  from tf_dpiter.keras.fast_clipping.rules import conv   # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(budget, "KEEP_BYTES", 1)   # the gradients not kept: formed again
  called = []
  fold = conv._fold_gram_norms
  monkeypatch.setattr(conv, "_fold_gram_norms", lambda *a: called.append(1) or fold(*a))
  seen = _spy_plans(monkeypatch)
  keras.utils.set_random_seed(4)
  model = keras.Sequential([keras.Input((9, 9, 8)),
                            keras.layers.Conv2D(32, 4, strides=2, padding="valid"),
                            keras.layers.Flatten(), keras.layers.Dense(3)])
  b = 70
  rng = np.random.default_rng(6)
  x = rng.normal(size=(b, 9, 9, 8)).astype(np.float32)
  y = rng.integers(0, 3, b).astype(np.int32)
  mask = np.ones(b, np.float32)
  mask[[5, 67]] = 0.0
  # under XLA a batch the trace does not know keeps its gradients: a static one here
  got, norms = _clipped_sum(model, x, y, mask, jit, static=jit)
  assert called   # the folded Gram's norms
  ws = [tf.constant(w.numpy(), tf.float64) for w in model.trainable_variables]
  want = [np.zeros(w.shape) for w in ws]
  for i in np.flatnonzero(mask):   # float64 per-record gradients, exact norms, clip, sum
    with tf.GradientTape() as tape:
      tape.watch(ws)
      h = tf.nn.conv2d(tf.constant(x[i:i + 1], tf.float64), ws[0], 2, "VALID") + ws[1]
      logits = tf.reshape(h, [1, -1]) @ ws[2] + ws[3]
      loss = tf.nn.sparse_softmax_cross_entropy_with_logits(y[i:i + 1], logits)[0]
    g = [t.numpy() for t in tape.gradient(loss, ws)]
    exact = np.sqrt(sum(np.sum(t ** 2) for t in g))
    assert exact * (1 - 1e-6) <= norms[i] <= exact * (1 + 3e-3)
    want = [s + min(1.0, C / float(norms[i])) * t for s, t in zip(want, g)]
  assert seen and all(n == p == 4 for n, p in seen), seen   # every sum pinned
  shrink = summation.step_shrink(b, block=64, final=1)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.numpy(), shrink * w, rtol=2e-5, atol=2e-6)
