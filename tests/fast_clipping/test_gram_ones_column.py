"""The Gram form of a Dense layer's norm with its bias folded in as the weight of an input 1
(algebra.gram_sqr_norm with_one: the Gram matrix of [x, 1] is that of x plus 1, no
[B, T, K + 1] copy of x).

Through clipped_grad_sum on small models (a Dense and an EinsumDense on [B, T, K] inputs, the
Gram form forced), traced and under XLA: the norms and the clipped sum equal those of an
independent float64 loop of per-record tape gradients (tests/fast_clipping/conftest.py); a
record with an infinite input gets clip factor 0 and the sum equals that of the batch with it
masked out, finite; records of 2 with masked rows; a batch of one. The traced norms build no
concatenation of x with a column of ones.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry

from .conftest import per_record_clipped_sum
from .covers import all_pairs
from .covers import assert_covers_pairs_of
from .covers import slow_outside
# the fast path through clipped_grad_sum (traced or XLA) and the loop's tolerances
from .test_dense_sums_adversarial import _LOSS
from .test_dense_sums_adversarial import _assert_equal
from .test_dense_sums_adversarial import _fast

_L = keras.layers


def _model(kind, t=6, k=5, n=4):
  keras.utils.set_random_seed(7)
  x = keras.Input((t, k))
  if kind == "dense":
    probed = _L.Dense(n, activation="tanh", name="probed")
  else:   # a Dense in EinsumDense form (BERT's attention projections)
    probed = _L.EinsumDense("abc,cde->abde", (t, 2, n // 2), bias_axes="de",
                            activation="tanh", name="probed")
  h = _L.Flatten()(probed(x))
  return keras.Model(x, _L.Dense(2)(h))


def _data(b, t=6, k=5, seed=0):
  rng = np.random.RandomState(seed)
  scale = rng.choice([0.1, 1.0, 4.0], (b, 1, 1))
  x = (rng.normal(size=(b, t, k)) * scale + 0.3).astype("float32")
  return x, rng.normal(size=(b, 2)).astype("float32")


@pytest.fixture
def gram(monkeypatch):
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")


# (check, layer, jit): by default an all-pairs cover (each check on each layer, each layer and
# each check in graph and under XLA), the rest marked slow
GRID = [(check, kind, jit) for check in ("exact", "records_of_two", "infinite")
        for kind in ("dense", "einsum") for jit in (False, True)]
DEFAULT = all_pairs(GRID)


def test_default_cases_cover_every_pair():
  assert_covers_pairs_of(DEFAULT, GRID)
  assert len(DEFAULT) == 6


def _params(check):
  return slow_outside([c[1:] for c in GRID if c[0] == check],
                      [c[1:] for c in DEFAULT if c[0] == check])


@pytest.mark.parametrize("kind,jit", _params("exact"))
def test_gram_with_bias_equals_the_loop(kind, jit, gram):
  model = _model(kind)
  x, y = _data(9)
  clip = float(np.median(per_record_clipped_sum(model, x, y, _LOSS, 1e9)[1]))
  want = per_record_clipped_sum(model, x, y, _LOSS, clip)
  assert np.min(want[1]) < clip < np.max(want[1])
  _assert_equal(_fast(model, x, y, clip, jit=jit), want)


@pytest.mark.parametrize("kind,jit", _params("records_of_two"))
def test_records_of_two_with_masked_rows(kind, jit, gram):
  model = _model(kind)
  x, y = _data(8, seed=1)
  mask = np.ones(8, np.float32)
  mask[[1, 4, 5]] = 0.0   # record 0 half masked, record 2 no real example
  clip = float(np.median(per_record_clipped_sum(model, x, y, _LOSS, 1e9, k=2, mask=mask)[1]))
  want = per_record_clipped_sum(model, x, y, _LOSS, clip, k=2, mask=mask)
  got = _fast(model, x, y, clip, k=2, mask=mask, jit=jit)
  assert got[1][2] == 0.0
  _assert_equal(got, want)


@pytest.mark.parametrize("kind,jit", _params("infinite"))
def test_infinite_input_record_adds_nothing(kind, jit, gram):
  """Record 3's input holds inf (and one of its positions a huge value): its norm is not
  finite, its clip factor 0, and the sum is finite and equals the others' sum."""
  model = _model(kind)
  x, y = _data(6, seed=2)
  bad = x.copy()
  bad[3, 2, 1] = np.inf
  bad[3, 0] = 3e38
  got, norms = _fast(model, bad, y, 0.5, jit=jit)
  assert not np.isfinite(norms[3]) and np.all(np.isfinite(np.delete(norms, 3)))
  keep = [i for i in range(6) if i != 3]
  want = per_record_clipped_sum(model, x[keep], y[keep], _LOSS, 0.5)
  for g, w in zip(got, want[0]):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=3e-4, atol=3e-6 * max(1.0, np.max(np.abs(w))))


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_batch_of_one(kind, gram):
  model = _model(kind)
  x, y = _data(1, seed=3)
  for clip in (1e-3, 1e3):
    _assert_equal(_fast(model, x, y, clip), per_record_clipped_sum(model, x, y, _LOSS, clip))


def test_norms_concatenate_no_ones_column(gram):
  """The traced norms hold no ConcatV2 of x ([B, T, K]) with ones ([B, T, 1])."""
  model = _model("dense")
  x, y = _data(4)
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, _LOSS, 1.0,
                                                          physical_chunks=False))
  graph = fn.get_concrete_function(tf.constant(x), tf.constant(y)).graph
  concats = [op for op in graph.get_operations() if op.type == "ConcatV2" and
             op.outputs[0].shape.rank == 3 and op.outputs[0].shape[-1] == 6]
  assert not concats, [op.name for op in concats]


def test_gram_sqr_norm_with_one_is_the_gram_of_the_ones_column():
  """Direct check of the identity on adversarial values: [B, T, K] inputs with zeros and
  large entries, against float64 ||[x, 1]^T b||^2."""
  rng = np.random.RandomState(4)
  a = rng.normal(size=(3, 7, 5)).astype("float32")
  a[1] = 0.0
  a[2, 3] = 1e3
  b = rng.normal(size=(3, 7, 4)).astype("float32")
  got = algebra.gram_sqr_norm(tf.constant(a), tf.constant(b), with_one=True).numpy()
  a1 = np.concatenate([a, np.ones((3, 7, 1), np.float32)], -1).astype(np.float64)
  g = np.einsum("btk,btn->bkn", a1, b.astype(np.float64))
  want = np.sum(g * g, axis=(1, 2))
  np.testing.assert_allclose(got, want, rtol=1e-4)
  # an upper bound (review R: gram_sqr_norm adds its rounding bound, so that a cancelling
  # sum never gives a clip factor too large), above by at most twice that bound
  spread = np.sum(np.linalg.norm(a1, axis=2) * np.linalg.norm(b.astype(np.float64), axis=2), 1)
  bound = 1.25 * (6 + 1 + 4 + 1) * 2.0 ** -24 * spread ** 2   # its bound is at most this
  assert np.all(got >= want * (1 - 1e-6)), (got, want)
  assert np.all(got <= want + 2 * bound + 1e-6 * want), (got, want, bound)
