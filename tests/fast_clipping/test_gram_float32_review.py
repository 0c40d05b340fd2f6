"""Review: algebra.gram_sqr_norm in float32 alone (no float64: the same ops on every device).

The Gram form's squared norm sum_{t,s} <a_t, a_s> <b_t, b_s> is an upper bound of the exact
one (algebra.bounded_gram_contraction: the float32 contraction plus a bound of all its
rounding, Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Secs. 3.1 and
4.2). One-sided checks against the float64 norm of the float64 per-record gradient
a^T b formed from the same float32 inputs: never below it (ordinary records and records whose
positions cancel), and on ordinary records at most 1e-3 above it (the norm, not squared).
Graph and XLA (the contraction is formed otherwise under XLA).
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra

from .covers import all_pairs
from .covers import assert_covers_pairs_of
from .covers import slow_outside

# Nightly tier (-m slow): by default every value of each parameter, graph and XLA, at least
# once (a diagonal of the product); the comment of each id group names the cases that stay.
SLOW_CASES = {
    # test_cancelling_records_above: [False-3x128x64x48], [False-4x16x8x6], [True-6x5x3x4]
    # stay by default
    "test_cancelling_records_above[True-3x128x64x48]",
    "test_cancelling_records_above[True-4x16x8x6]",
    "test_cancelling_records_above[False-6x5x3x4]",
}

# (records, T, K, N): small layers, a bias's ones column, and BERT-like positions
SHAPES = [(6, 5, 3, 4), (4, 16, 8, 6), (3, 128, 64, 48)]


def _exact_norms(a, b, with_one):
  a = a.astype(np.float64)
  if with_one:
    a = np.concatenate([a, np.ones(a.shape[:2] + (1,))], axis=2)
  g = np.einsum("btk,btn->bkn", a, b.astype(np.float64))
  return np.sqrt(np.sum(g * g, axis=(1, 2)))


def _returned_norms(a, b, with_one, jit):
  fn = tf.function(lambda a, b: algebra.gram_sqr_norm(a, b, with_one), jit_compile=jit)
  sq = fn(tf.constant(a), tf.constant(b)).numpy().astype(np.float64)
  return np.sqrt(sq)


def _ordinary(shape, seed):
  r, t, k, n = shape
  rng = np.random.RandomState(seed)
  a = np.maximum(rng.normal(size=(r, t, k)), 0).astype(np.float32)   # ReLU inputs
  b = rng.normal(size=(r, t, n)).astype(np.float32)
  return a, b


def _cancelling(shape, seed):
  """Every record: positions in pairs with one input and opposite output gradients (the
  second -(1 + 2^-23) times the first): the exact gradient is nearly 0, its float32 Gram
  contraction mostly rounding."""
  r, t, k, n = shape
  rng = np.random.RandomState(seed)
  a = np.repeat(rng.normal(size=(r, (t + 1) // 2, k)), 2, axis=1)[:, :t].astype(np.float32)
  half = rng.normal(size=(r, (t + 1) // 2, n)).astype(np.float32) * 1e3
  b = np.stack([half, -half * np.float32(1 + 2.0 ** -23)], axis=2).reshape(r, -1, n)[:, :t]
  return a, b.astype(np.float32)


# {shape} x {with_one} x {jit}: by default an all-pairs cover (each shape with and without
# the ones column, each in graph and under XLA), the rest marked slow.
ORDINARY = list(itertools.product(SHAPES, [False, True], [False, True]))
ORDINARY_DEFAULT = all_pairs(ORDINARY)


def test_default_cases_cover_every_pair():
  assert_covers_pairs_of(ORDINARY_DEFAULT, ORDINARY)
  assert len(ORDINARY_DEFAULT) == len(ORDINARY) // 2


@pytest.mark.parametrize("shape,with_one,jit", slow_outside(
    ORDINARY, ORDINARY_DEFAULT, ids=lambda c: "x".join(map(str, c[0])) + f"-{c[1]}-{c[2]}"))
def test_ordinary_records_tight_and_above(shape, with_one, jit):
  a, b = _ordinary(shape, seed=shape[1])
  exact = _exact_norms(a, b, with_one)
  got = _returned_norms(a, b, with_one, jit)
  rel = got / exact - 1
  assert np.all(got >= exact), rel.min()
  assert np.all(rel <= 1e-3), rel.max()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("jit", [False, True])
def test_cancelling_records_above(shape, jit):
  a, b = _cancelling(shape, seed=7 + shape[1])
  exact = _exact_norms(a, b, False)
  got = _returned_norms(a, b, False, jit)
  assert np.all(got >= exact), (got / exact).min()
