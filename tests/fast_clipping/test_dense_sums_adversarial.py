"""Adversarial checks of a Dense layer's clipped sum (rules/dense.py `_dense_sums`: the kernel
one K-row matrix product of every position's rows, the bias a reduction of the clip-weighted
output gradient where the output gradient carries the factors, K > N, else the factor product
of the per-example output-gradient sums).

Through clipped_grad_sum on a small model, eagerly traced and under XLA: inputs [B, K],
[B, T, K] and [B, T1, T2, K], K > N and K < N, the bias trained, frozen or absent, the kernel
frozen, the per-record gradients kept or not (book-keeping over chunks of 8, where
`_dense_sums` runs on every rank), records of 2 with masked rows, batches of 1 and 0: the
norms and the clipped sum equal those of an independent float64 loop of per-record tape
gradients. A record whose float16 output overflows (its clip factor 0) adds exactly nothing;
an adversarial record (inputs 10^4 times larger) moves the clipped sum by at most C (the
add/remove-one relation, McMahan et al. 2018, "Learning differentially private recurrent
language models", Sec. 2).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.fast_clipping.rules import dense

from .conftest import per_record_clipped_sum
from .test_fast_clipping import latin_pairs

# Nightly tier (-m slow): one masked-rows and one float16 case per jit stay.
SLOW_CASES = {
    "test_records_of_two_with_masked_rows[3-7-True]",
    "test_records_of_two_with_masked_rows[7-3-False]",
    "test_float16_overflow_record_adds_nothing[positions0-True]",
    "test_float16_overflow_record_adds_nothing[positions1-False]",
    # the neighbour: each input rank and each of K > N, K < N stays by default
    # ([7-3-positions1]: [B, T, K], K > N; [3-7-positions0]: [B, K], K < N)
    "test_adversarial_neighbour_moves_the_sum_by_at_most_c[3-7-positions1]",
    "test_adversarial_neighbour_moves_the_sum_by_at_most_c[7-3-positions0]"}

_L = keras.layers
_LOSS = keras.losses.MeanSquaredError(reduction=None)


def _model(positions, k, n, freeze=None, use_bias=True, dtype=None):
  keras.utils.set_random_seed(3)
  layer = _L.Dense(n, activation="tanh", use_bias=use_bias, dtype=dtype, name="probed")
  x = keras.Input(positions + (k,))
  model = keras.Model(x, _L.Dense(2)(_L.Flatten()(layer(x))))
  if freeze == "kernel":
    layer.kernel.trainable = False
  elif freeze == "bias":
    layer.bias.trainable = False
  return model


def _data(positions, k, b=11, seed=0):
  rng = np.random.RandomState(seed)
  scale = rng.choice([0.1, 1.0, 4.0], (b,) + (1,) * (len(positions) + 1))
  x = (rng.normal(size=(b,) + positions + (k,)) * scale).astype("float32")
  return x, rng.normal(size=(b, 2)).astype("float32")


def _loop(model, x, y, clip, k=1, mask=None, memo=None):
  """(sum_j min(1, C / ||g_j||) g_j, [||g_j||]) in float64, g_j the gradient of record j's
  mean loss over its real rows, each record under its own tape (the shared reference loop;
  `memo` as there)."""
  return per_record_clipped_sum(model, x, y, _LOSS, clip, k=k, mask=mask, memo=memo)


def _fast(model, x, y, clip, k=1, mask=None, jit=False):
  mask = np.ones(x.shape[0], np.float32) if mask is None else mask
  fn = tf.function(lambda x, y, m: clipping.clipped_grad_sum(
      model, x, y, _LOSS, clip, mask=m, examples_per_record=k, physical_chunks=False),
                   jit_compile=jit)
  grads, norms = fn(tf.constant(x), tf.constant(y), tf.constant(mask))
  return [tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy()


def _spy(monkeypatch, chunks):
  """The input shapes of the `_dense_sums` and `_pinned_dense_sums` calls of the layer under
  test ("probed") and of the `_pinned_record_sums` calls (the probed layer is the model's
  only Dense on positions);
  `chunks`: no per-record gradient kept, book-keeping over chunks of 8 examples."""
  if chunks:
    monkeypatch.setattr(budget, "KEEP_BYTES", 0)
    monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
    # `_pinned_record_sums`: one record and one kernel row at a time (its tree of chunks)
    monkeypatch.setattr(dense, "RECORD_BLOCK_BYTES", 1 if chunks is True else chunks)
    monkeypatch.setattr(registry, "MAX_DIRECT_PER_EXAMPLE_ENTRIES", 0)
    monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", 0)
  calls = []

  def spy_on(name):   # `_pinned_dense_sums` too: a [B, K] input's sum in a pinned order
    orig = getattr(dense, name)

    def spy(layer, x, *args, **kwargs):
      if layer.name == "probed":
        calls.append(tuple(x.shape[1:]))
      return orig(layer, x, *args, **kwargs)

    monkeypatch.setattr(dense, name, spy)

  spy_on("_dense_sums")
  spy_on("_pinned_dense_sums")
  # a [B, T.., K] input's sum record by record (no layer argument: the input's shape alone)
  orig = dense._pinned_record_sums

  def spy_records(x, *args, **kwargs):
    calls.append(tuple(x.shape[1:]))
    return orig(x, *args, **kwargs)

  monkeypatch.setattr(dense, "_pinned_record_sums", spy_records)
  return calls


def _assert_equal(got, want):
  (grads, norms), (ref, ref_norms) = got, want
  live = ref_norms > 0
  np.testing.assert_allclose(norms[live], ref_norms[live], rtol=2e-4)
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(g, r, rtol=3e-4, atol=3e-6 * max(1.0, np.max(np.abs(r))))


_VARIANTS = ["both", "frozen_bias", "frozen_kernel", "no_bias"]
_POSITIONS = [(), (5,), (2, 3)]
_KN = [(7, 3), (3, 7)]
# every (variant, positions) pair once, K > N and K < N alternating: all pairs of the three
_SUMS_CASES = latin_pairs(_VARIANTS, _POSITIONS, _KN)


def test_sums_cases_cover_every_pair():
  axes = (_VARIANTS, _POSITIONS, _KN)
  for i, j in ((0, 1), (0, 2), (1, 2)):
    assert {(c[i], c[j]) for c in _SUMS_CASES} == {(a, b) for a in axes[i] for b in axes[j]}


@pytest.mark.parametrize("variant,positions,kn", _SUMS_CASES)
def test_dense_sums_equal_the_loop(variant, positions, kn, monkeypatch):
  (k, n), memo = kn, {}
  model = _model(positions, k, n, freeze=variant.replace("frozen_", "") if "frozen" in variant
                 else None, use_bias=variant != "no_bias")
  x, y = _data(positions, k)
  want_unclipped = _loop(model, x, y, 1e9, memo=memo)
  clip = float(np.median(want_unclipped[1]))
  want = _loop(model, x, y, clip, memo=memo)
  assert np.min(want[1]) < clip < np.max(want[1])
  for chunks, pinned in ((False, False), (True, False), (True, True)):
    with monkeypatch.context() as m:
      m.setattr(dense, "PINNED_RECORD_SUMS", pinned)   # the opt-in record-by-record sums
      calls = _spy(m, chunks)
      got = _fast(model, x, y, clip)
      _assert_equal(got, want)
      # `_dense_sums` formed the sum where the rule keeps no per-record gradient
      if chunks and variant != "frozen_kernel":   # a frozen kernel: the bias kept per record
        assert calls and set(calls) <= {positions + (k,)}, (calls, variant, chunks)


@pytest.mark.parametrize("jit", [False, True])
def test_record_sums_in_blocks_of_kernel_rows_equal_the_loop(jit, monkeypatch):
  """`_pinned_record_sums` in blocks of 5 of the 7 rows of W (no divisor of 7 near 5),
  padded to 10, the 11 records in one chunk (RECORD_BLOCK_BYTES = 4 N 16 5); the bias's sum
  apart."""
  model = _model((5,), 7, 3)
  x, y = _data((5,), 7)
  memo = {}
  clip = float(np.median(_loop(model, x, y, 1e9, memo=memo)[1]))
  monkeypatch.setattr(dense, "PINNED_RECORD_SUMS", True)
  calls = _spy(monkeypatch, chunks=4 * 3 * 16 * 5)
  _assert_equal(_fast(model, x, y, clip, jit=jit), _loop(model, x, y, clip, memo=memo))
  assert set(calls) == {(5, 7)}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k,n", [(7, 3), (3, 7)])
def test_records_of_two_with_masked_rows(k, n, jit, monkeypatch):
  """10 examples in 5 records of 2: record 1 half masked, record 3 with no real example."""
  model = _model((4,), k, n)
  x, y = _data((4,), k, b=10, seed=1)
  mask = np.ones(10, np.float32)
  mask[[2, 6, 7]] = 0.0
  memo = {}
  clip = float(np.median(_loop(model, x, y, 1e9, k=2, mask=mask, memo=memo)[1][[0, 1, 2, 4]]))
  want = _loop(model, x, y, clip, k=2, mask=mask, memo=memo)
  monkeypatch.setattr(dense, "PINNED_RECORD_SUMS", True)   # records of 2 in the pinned sums
  calls = _spy(monkeypatch, chunks=True)
  got = _fast(model, x, y, clip, k=2, mask=mask, jit=jit)
  assert set(calls) == {(4, k)}   # over chunks of 8 examples (4 records)
  assert got[1].shape == (5,) and got[1][3] == 0.0
  _assert_equal(got, want)


@pytest.mark.parametrize("positions", [(), (4,)])
def test_batches_of_one_and_zero(positions, monkeypatch):
  """One example: its gradient clipped. No example (an empty Poisson sample): every sum is
  exactly zero and finite."""
  model = _model(positions, 7, 3)
  x, y = _data(positions, 7, b=1)
  calls = _spy(monkeypatch, chunks=True)
  for clip in (1e-3, 1e3):
    _assert_equal(_fast(model, x, y, clip), _loop(model, x, y, clip))
  assert calls
  grads, norms = _fast(model, x[:0], y[:0], 1.0)
  assert norms.shape == (0,)
  for g, v in zip(grads, model.trainable_variables):
    assert g.shape == tuple(v.shape) and np.all(g == 0.0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("positions", [(), (4,)])
def test_float16_overflow_record_adds_nothing(positions, jit, monkeypatch):
  """A mixed_float16 Dense (K = 7 > N = 3: the output gradient carries the factors and the
  bias is its reduction) whose output overflows float16 for record 2 (inputs 10^5): that
  record's norm is not finite, and the sum equals that of the batch with it masked out."""
  model = _model(positions, 7, 3, dtype="mixed_float16")
  x, y = _data(positions, 7, b=6)
  bad = x.copy()
  bad[2] = 1e5
  calls = _spy(monkeypatch, chunks=True)
  got, norms = _fast(model, bad, y, 0.5, jit=jit)
  assert calls
  assert not np.isfinite(norms[2]) and np.all(np.isfinite(np.delete(norms, 2)))
  mask = np.ones(6, np.float32)
  mask[2] = 0.0
  want, _ = _fast(model, x, y, 0.5, mask=mask, jit=jit)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", [(), (4,)])
@pytest.mark.parametrize("k,n", [(7, 3), (3, 7)])
def test_adversarial_neighbour_moves_the_sum_by_at_most_c(positions, k, n, monkeypatch):
  """D: 10 examples; D' = D plus one example 10^4 times a real one: ||sum(D') - sum(D)|| <= C,
  in the kept and the book-keeping forms."""
  model = _model(positions, k, n)
  x, y = _data(positions, k, b=10)
  extra_x = np.concatenate([x, 1e4 * x[:1]])
  extra_y = np.concatenate([y, 50.0 * np.ones((1, 2), np.float32)])
  clip = 0.2
  for chunks in (False, True):
    with monkeypatch.context() as m:
      _spy(m, chunks)
      d = _fast(model, x, y, clip)[0]
      d2, norms = _fast(model, extra_x, extra_y, clip)
    assert norms[-1] > 10 * clip
    moved = np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(d2, d)))
    assert 0.5 * clip < moved <= clip * (1 + 1e-4), (chunks, moved)
