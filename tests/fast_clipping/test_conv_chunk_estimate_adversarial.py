"""Adversarial checks of the folded patch Gram's chunks at the default memory budget
(rules/conv.py `_fold_gram_temp_bytes`, which sets how many examples one call of the norm
takes: the tutorial CNN's second convolution 256 examples, 128 for records of 2, 63 for
records of 3, with the float32 Gram contraction's temporaries counted).

At batch sizes on both sides of those chunk sizes (one call, two balanced chunks with a
padded tail record), with a static and an unknown batch, under XLA, with records of 2 and 3
examples and masked rows, the per-record norms and the clipped sum equal those of an
independent loop of per-record tape gradients (the norms are upper bounds: one-sided, within
1e-3 above; the clipped sum within 1e-3, its clip factors moving with the norms); a record whose input is not finite adds
exactly nothing in its chunk; and an adversarial record (its pixels scaled 1,000 times) added
to the batch moves the clipped sum by at most C (the add/remove-one neighbouring relation:
McMahan et al. 2018, "Learning differentially private recurrent language models", Sec. 2).
The whole-batch physical chunking (clipping.py) is off so that the convolution's own chunks
run; one case keeps it on.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import example_models
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import conv

# Nightly tier (-m slow): XLA's one call (129 examples); the default suite keeps one call in
# graph mode (256) and XLA over the static slices of the padded batch (257).
SLOW_CASES = {"test_folded_gram_chunks_equal_the_loop[129-1-True-True-False]",
              # records > 1 over chunks stay by default on [130-2-True-False-True], a batch
              # the trace does not know on [264-1-False-False-True]
              "test_folded_gram_chunks_equal_the_loop[66-3-False-False-True]"}

_CLIP = 5.0
_MAX_B = 264


def _loss(y, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


@pytest.fixture(scope="module")
def cnn():
  """The tutorial CNN, its data (264 examples, pixel scales 0.05 to 3 so that norms spread
  around C) and each example's gradient, in float64, by its own tape (one traced
  single-example function, run once per example; the weights never change)."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential(example_models.mnist_cnn_layers())
  rng = np.random.default_rng(0)
  scale = rng.choice([0.05, 0.3, 1.0, 3.0], (_MAX_B, 1, 1, 1))
  x = (rng.random((_MAX_B, 28, 28, 1)) * scale).astype("float32")
  y = rng.integers(0, 10, _MAX_B).astype("int32")

  @tf.function
  def one(xi, yi):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss(yi, model(xi, training=True)))
    return tape.gradient(loss, model.trainable_variables)

  per_example = [[g.numpy().astype(np.float64) for g in one(x[i:i + 1], y[i:i + 1])]
                 for i in range(_MAX_B)]
  return model, x, y, per_example


def _loop_reference(per_example, b, k, mask=None):
  """sum_j min(1, C / ||g_j||) g_j over the records of the first b examples, g_j the gradient
  of record j's mean loss over its real rows (the mean of their gradients: the CNN has no
  batch statistics), [||g_j||] (0 for a record with no real row), and the entrywise
  magnitudes sum_j min(1, C / ||g_j||) |g_j|."""
  mask = np.ones(b) if mask is None else mask
  total = [np.zeros_like(g) for g in per_example[0]]
  mags = [np.zeros_like(g) for g in per_example[0]]
  norms = []
  for j in range(b // k):
    rows = [i for i in range(j * k, j * k + k) if mask[i] > 0]
    if not rows:
      norms.append(0.0)
      continue
    g = [sum(per_example[i][v] for i in rows) / len(rows) for v in range(len(total))]
    n = np.sqrt(sum(np.sum(t * t) for t in g))
    norms.append(n)
    total = [t + min(1.0, _CLIP / n) * gv for t, gv in zip(total, g)]
    mags = [m + min(1.0, _CLIP / n) * np.abs(gv) for m, gv in zip(mags, g)]
  return total, np.array(norms), mags


def _spy_chunks(monkeypatch):
  """The m of each `_over_chunks` call of the folded Gram (examples per chunk, or None)."""
  seen, orig = [], conv._over_chunks   # pylint: disable=protected-access

  def spy(body, x4, dz4, m, k, *args):
    seen.append(m)
    return orig(body, x4, dz4, m, k, *args)

  monkeypatch.setattr(conv, "_over_chunks", spy)
  return seen


def _force_fold_gram(monkeypatch):
  """The folded Gram for the second convolution with one example per record too: there its
  clipped sum is pinned (conv._pinned_applies) and the cost model takes the norms from the
  per-example gradients that sum forms (conv._choose_form's `pinned`); a forced form still
  runs the folded Gram's norms, whose chunks these tests check, with that sum."""
  orig = conv._choose_form   # pylint: disable=protected-access

  def choose(*args, **kwargs):
    kwargs["pinned"] = False
    return orig(*args, **kwargs)

  monkeypatch.setattr(conv, "_choose_form", choose)


def _fast(model, x, y, k, mask=None, jit=False, static=True, physical_chunks=False):
  b = int(x.shape[0])
  sig = [tf.TensorSpec((b if static else None, 28, 28, 1), tf.float32),
         tf.TensorSpec((b if static else None,), tf.int32),
         tf.TensorSpec((b if static else None,), tf.float32)]
  mask = np.ones(b, np.float32) if mask is None else mask

  def step(xb, yb, mb):
    return clipping.clipped_grad_sum(model, xb, yb, _loss, _CLIP, mask=mb,
                                     examples_per_record=k, physical_chunks=physical_chunks)

  grads, norms = tf.function(step, input_signature=sig, jit_compile=jit)(x, y, mask)
  return [tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy()


def _assert_equal_to_loop(cnn, got, b, k, mask=None):
  want, want_norms, mags = _loop_reference(cnn[3], b, k, mask)
  grads, norms = got
  assert norms.shape == (b // k,)
  live = want_norms > 0
  # upper bounds (conv._fold_gram_sqr_norm): the exact norm plus gamma_L sum_t ||a_t|| ||b_t||
  # (float32 rounding of the record's terms), never below the loop's, at most 1e-3 above
  assert np.all(norms[live] >= want_norms[live] * (1 - 1e-6)), norms[live] / want_norms[live]
  assert np.all(norms[live] <= want_norms[live] * (1 + 1e-3)), norms[live] / want_norms[live]
  assert np.min(want_norms[live]) < _CLIP < np.max(want_norms)   # some clipped, some not
  # the clip factors C / norm move with the norms (by at most 1e-3 relative): each entry by at
  # most 1e-3 sum_j c_j |g_j| (entries that cancel across records move more than 1e-3 of
  # themselves), plus float32 rounding
  for g, r, m in zip(grads, want, mags):
    err = np.abs(g - r) - 1e-3 * m - 2e-5 * max(1.0, np.max(np.abs(r)))
    assert np.all(err <= 0), np.max(err)


@pytest.mark.parametrize("b,k,static,jit,chunked", [
    (256, 1, True, False, False),    # the largest one call
    (257, 1, True, False, True),     # two chunks of 129, one padded example
    (264, 1, False, False, True),    # a batch the trace does not know: tf.cond at run time
    (129, 1, True, True, False),     # XLA: one call
    (257, 1, True, True, True),      # XLA: static slices of the padded batch
    (130, 2, True, False, True),     # records of 2: chunks of 66 (33 records), one padded
    (66, 3, False, False, True),     # records of 3: chunks of 33 (11 records)
])
def test_folded_gram_chunks_equal_the_loop(cnn, monkeypatch, b, k, static,
                                           jit, chunked):
  model, x, y, _ = cnn
  seen = _spy_chunks(monkeypatch)
  _force_fold_gram(monkeypatch)
  mask = None
  if k > 1:   # masked rows: one record half real, one record with no real example
    mask = np.ones(b, np.float32)
    mask[[1, k * 5, k * 5 + 1, k * 5 + k - 1]] = 0.0
  got = _fast(model, x[:b], y[:b], k, mask=mask, jit=jit, static=static)
  expected_m = {1: 256, 2: 128, 3: 63}[k]
  # the second convolution's folded Gram ran, with the chunk of the default budget
  assert expected_m in seen, seen
  assert chunked == (b > expected_m)
  _assert_equal_to_loop(cnn, got, b, k, mask)


def test_non_finite_record_in_the_second_chunk_adds_nothing(cnn, monkeypatch):
  """An infinite pixel in example 200 of 257 (the second chunk): its norm is not finite, its
  factor 0, and the sum equals that of the batch with it masked out."""
  model, x, y, _ = cnn
  _spy_chunks(monkeypatch)
  b = 257
  bad = x[:b].copy()
  bad[200, 14, 14, 0] = np.inf
  got, norms = _fast(model, bad, y[:b], 1)
  assert not np.isfinite(norms[200]) and np.all(np.isfinite(np.delete(norms, 200)))
  mask = np.ones(b, np.float32)
  mask[200] = 0.0
  want, _ = _fast(model, x[:b], y[:b], 1, mask=mask)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("physical_chunks", [False, True])
def test_adversarial_neighbour_moves_the_sum_by_at_most_c(cnn, physical_chunks):
  """Dataset D: 256 examples (one call); D' = D plus one example whose pixels are 1,000 times
  a real one's (a huge gradient): 257 examples, two chunks. ||sum(D') - sum(D)|| <= C."""
  model, x, y, _ = cnn
  d = _fast(model, x[:256], y[:256], 1, physical_chunks=physical_chunks)[0]
  extra = x[:257].copy()
  extra[256] = 1000.0 * x[3]
  d2, norms = _fast(model, extra, y[:257], 1, physical_chunks=physical_chunks)
  assert norms[256] > 100 * _CLIP
  moved = np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(d2, d)))
  assert 0.5 * _CLIP < moved <= _CLIP * (1 + 1e-4), moved
