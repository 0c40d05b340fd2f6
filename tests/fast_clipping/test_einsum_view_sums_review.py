"""Review of an EinsumDense taken as a Dense (rules/dense.py `_as_dense`) for its clipped sum
as well as its norms: multi-axis kernels and biases reshaped to the variable's shape, K < N,
K = N (the factors then on the output gradient) and K > N, the per-record gradients kept and
book-keeping over chunks of the batch (a tiny memory budget), graph and XLA.

A record with an infinite or NaN input (its norm not finite, its clip factor 0) adds exactly
nothing: the sum is finite and equals that of the batch without it (a factor 0 multiplied
into a non-finite row gives NaN; it must be dropped, not multiplied). A mixed_float16 layer
whose output overflows for one record: the same. Reference: conftest's float64 per-record
loop on the other records.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget

from .conftest import per_record_clipped_sum
from .covers import all_pairs
from .covers import assert_covers_pairs_of
from .covers import slow_outside

# Nightly (tests/conftest.py marks these ids slow); benchmarks/SUITE_CUTS.md names what
# asserts the same by default.
# float16 overflow: [True-chunks] and [False-None] stay by default (each mode, each form)
SLOW_CASES = {"test_float16_overflow_record_adds_nothing[True-None]",
              "test_float16_overflow_record_adds_nothing[False-chunks]"}

_LOSS = keras.losses.MeanSquaredError(reduction=None)
_T = 4

# (equation, output_shape, bias_axes, input_shape): K vs N = prod of output-only axes
_CASES = [
    ("abc,cde->abde", (_T, 2, 3), "de", (_T, 6)),      # K = N = 6
    ("abc,cde->abde", (_T, 2, 5), "de", (_T, 4)),      # K = 4 < N = 10
    ("abcd,cde->abe", (_T, 3), "e", (_T, 2, 4)),       # K = 8 > N = 3
    ("abcd,de->abce", (_T, 2, 5), "e", (_T, 2, 5)),    # two position axes, K = N = 5
    ("abc,cde->abde", (_T, 2, 3), None, (_T, 6)),      # no bias, K = N
]


def _model(equation, out_shape, bias_axes, in_shape, dtype=None):
  keras.utils.set_random_seed(5)
  x = keras.Input(in_shape)
  layer = keras.layers.EinsumDense(equation, output_shape=out_shape, bias_axes=bias_axes,
                                   activation="tanh", dtype=dtype)
  h = keras.layers.Flatten()(layer(x))
  return keras.Model(x, keras.layers.Dense(2)(h))


def _data(in_shape, b=7, seed=0):
  rng = np.random.RandomState(seed)
  x = (rng.normal(size=(b,) + in_shape) * rng.choice([0.2, 1.0, 5.0], (b,) + (1,) * len(in_shape))
       ).astype("float32")
  return x, rng.normal(size=(b, 2)).astype("float32")


def _force(monkeypatch, form):
  if form == "chunks":
    monkeypatch.setattr(budget, "KEEP_BYTES", 0)
    monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
    monkeypatch.setattr(registry, "MAX_DIRECT_PER_EXAMPLE_ENTRIES", 0)
    monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", 0)
  elif form is not None:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)


def _fast(model, x, y, clip, jit):
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, _LOSS, clip,
                                                          physical_chunks=False),
                   jit_compile=jit)
  grads, norms = fn(tf.constant(x), tf.constant(y))
  return [tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy()


# {case} x {jit} x {form} x {bad value}: by default an all-pairs cover (every pair of the four
# axes meets: 15 of the 60 cases, each case in each form), the rest marked slow.
_NON_FINITE_GRID = list(itertools.product(_CASES, [False, True], [None, "gram", "chunks"],
                                          [np.inf, np.nan]))
_NON_FINITE = all_pairs(_NON_FINITE_GRID)


def test_non_finite_cases_cover_every_pair():
  assert_covers_pairs_of(_NON_FINITE, _NON_FINITE_GRID)
  assert len(_NON_FINITE) == 15


@pytest.mark.parametrize("case,jit,form,bad", slow_outside(_NON_FINITE_GRID, _NON_FINITE))
def test_non_finite_record_adds_nothing(case, jit, form, bad, monkeypatch):
  _force(monkeypatch, form)
  model = _model(*case)
  x, y = _data(case[3])
  xb = x.copy()
  xb[3].reshape(-1)[5] = bad
  got, norms = _fast(model, xb, y, 0.4, jit)
  assert not np.isfinite(norms[3]), norms
  assert np.all(np.isfinite(np.delete(norms, 3)))
  keep = [i for i in range(len(x)) if i != 3]
  want, want_norms = per_record_clipped_sum(model, x[keep], y[keep], _LOSS, 0.4)
  np.testing.assert_allclose(np.delete(norms, 3), want_norms, rtol=3e-4)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=5e-4, atol=5e-6 * max(1.0, np.max(np.abs(w))))


# A pairwise cover of {graph, XLA} x {None, chunks} by default (each form in graph, the
# chunks form under XLA); the fourth cell, XLA in the cost-chosen form, with -m slow.
@pytest.mark.parametrize("form", [None, "chunks"])
@pytest.mark.parametrize("jit", [False, True])
def test_float16_overflow_record_adds_nothing(jit, form, monkeypatch):
  """mixed_float16 EinsumDense (K = N): record 2's inputs 1e5 overflow its float16 output;
  the sum equals the batch's with record 2 masked out, finite."""
  _force(monkeypatch, form)
  case = _CASES[0]
  model = _model(*case, dtype="mixed_float16")
  x, y = _data(case[3], b=6)
  bad = x.copy()
  bad[2] = 1e5
  got, norms = _fast(model, bad, y, 0.5, jit)
  assert not np.isfinite(norms[2]) and np.all(np.isfinite(np.delete(norms, 2)))
  mask = np.ones(6, np.float32)
  mask[2] = 0.0
  fn = tf.function(lambda x, y, m: clipping.clipped_grad_sum(
      model, x, y, _LOSS, 0.5, mask=m, physical_chunks=False), jit_compile=jit)
  want, _ = fn(tf.constant(x), tf.constant(y), tf.constant(mask))
  for g, w in zip(got, want):
    w = tf.convert_to_tensor(w).numpy()
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
