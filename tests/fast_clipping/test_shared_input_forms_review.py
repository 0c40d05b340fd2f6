"""Review of the Dense / EinsumDense norm forms where layers share one input (the Gram matrix
of the input is built once and shared, `algebra.once_per_graph`): a Dense with its bias (the
Gram of [x, 1]), a Dense without bias and an EinsumDense with a bias read the same x, so a
memo that served one layer's Gram matrix to another (with or without the ones column) would
give wrong norms.

Through clipped_grad_sum, traced and under XLA, with the form chosen by the cost rule (no
override) at shapes on both sides of T (K + N) < K N (K counted with the ones column), and
with the Gram and direct forms forced: the norms and the clipped sum equal the independent
float64 per-record loop (tests/fast_clipping/conftest.py). A record with an infinite input
(its factor 0) adds nothing: the sum is finite and equals the others'; a 1e30 input either
is clipped as the loop clips it or (a float32 overflow in the form) adds nothing. A neighbour with a huge record moves the sum by at most C.
"""

import itertools

import keras
import numpy as np
import pytest

from tf_dpiter.keras.fast_clipping import registry

from .conftest import per_record_clipped_sum
from .covers import assert_covers
from .covers import cover
from .covers import slow_outside
from .test_dense_sums_adversarial import _LOSS
from .test_dense_sums_adversarial import _assert_equal
from .test_dense_sums_adversarial import _fast

# Nightly tier (-m slow, besides the grids below): records of two masked, the gram
# form in graph and the direct form under XLA (the other two stay).
SLOW_CASES = {
    "test_records_of_two_masked_on_shared_input[False-gram]",
    "test_records_of_two_masked_on_shared_input[True-direct]"}

_L = keras.layers


def _model(t, k, n):
  keras.utils.set_random_seed(11)
  x = keras.Input((t, k))
  with_bias = _L.Dense(n, activation="tanh", name="with_bias")(x)
  no_bias = _L.Dense(n + 1, use_bias=False, activation="tanh", name="no_bias")(x)
  einsum = _L.EinsumDense("abc,cd->abd", (t, n), bias_axes="d", activation="tanh",
                          name="einsum")(x)
  h = _L.Concatenate()([_L.Flatten()(with_bias), _L.Flatten()(no_bias), _L.Flatten()(einsum)])
  return keras.Model(x, _L.Dense(2)(h))


def _data(b, t, k, seed=0):
  rng = np.random.RandomState(seed)
  scale = rng.choice([0.1, 1.0, 4.0], (b, 1, 1))
  x = (rng.normal(size=(b, t, k)) * scale + 0.2).astype("float32")
  return x, rng.normal(size=(b, 2)).astype("float32")


# (T, K, N): Gram cheaper for every layer, direct cheaper, and the boundary where counting
# the bias's input 1 in K flips the choice (T = 4, N = 8: K = 7 direct either way, K = 8 Gram
# only with the ones column counted)
_SHAPES = [(3, 9, 9), (12, 3, 2), (4, 7, 8), (4, 8, 8)]


_FORMS = [None, "gram", "direct"]
# {shape} x {form} x {jit} and {bad value} x {form} x {jit}: by default each shape (bad value)
# once and each form in graph and under XLA (6 cases each; test_the_cases_cover_every_shape_
# form_and_mode checks it); the rest of each product (an all-pairs cover among them) runs
# with -m slow.
_BAD_VALUES = [np.inf, 1e30, -np.inf]
_SHAPE_GRID = list(itertools.product(_SHAPES, _FORMS, [False, True]))
_BAD_GRID = list(itertools.product(_BAD_VALUES, _FORMS, [False, True]))
_GROUPS = [(0,), (1, 2)]
_SHAPE_CASES = cover(_SHAPE_GRID, _GROUPS)
_BAD_CASES = cover(_BAD_GRID, _GROUPS)


def test_the_cases_cover_every_shape_form_and_mode():
  assert_covers(_SHAPE_CASES, _SHAPE_GRID, _GROUPS)
  assert_covers(_BAD_CASES, _BAD_GRID, _GROUPS)
  assert len(_SHAPE_CASES) == len(_BAD_CASES) == 6


@pytest.mark.parametrize("shape,form,jit", slow_outside(_SHAPE_GRID, _SHAPE_CASES))
def test_shared_input_layers_equal_the_loop(shape, form, jit, monkeypatch):
  t, k, n = shape
  if form is not None:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = _model(t, k, n)
  x, y = _data(9, t, k)
  memo = {}
  clip = float(np.median(per_record_clipped_sum(model, x, y, _LOSS, 1e9, memo=memo)[1]))
  want = per_record_clipped_sum(model, x, y, _LOSS, clip, memo=memo)
  assert np.min(want[1]) < clip < np.max(want[1])
  _assert_equal(_fast(model, x, y, clip, jit=jit), want)


@pytest.mark.parametrize("form", ["gram", "direct"])
@pytest.mark.parametrize("jit", [False, True])
def test_records_of_two_masked_on_shared_input(form, jit, monkeypatch):
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  t, k, n = 4, 8, 8
  model = _model(t, k, n)
  x, y = _data(8, t, k, seed=3)
  mask = np.ones(8, np.float32)
  mask[[0, 6, 7]] = 0.0   # record 0 half masked, record 3 none real
  clip = float(np.median(per_record_clipped_sum(model, x, y, _LOSS, 1e9, k=2, mask=mask)[1]))
  want = per_record_clipped_sum(model, x, y, _LOSS, clip, k=2, mask=mask)
  got = _fast(model, x, y, clip, k=2, mask=mask, jit=jit)
  assert got[1][3] == 0.0
  _assert_equal(got, want)


@pytest.mark.parametrize("bad_value,form,jit", slow_outside(_BAD_GRID, _BAD_CASES))
def test_a_non_finite_record_adds_nothing(bad_value, form, jit, monkeypatch):
  if form is not None:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  t, k, n = 4, 8, 8
  model = _model(t, k, n)
  x, y = _data(6, t, k, seed=5)
  bad = x.copy()
  bad[2, 1, 3] = bad_value
  got, norms = _fast(model, bad, y, 0.5, jit=jit)
  assert np.all(np.isfinite(np.delete(norms, 2)))
  if np.isfinite(norms[2]):
    # 1e30 into tanh: the layer saturates, that token's output gradient is exactly 0 and
    # the record's true gradient is finite: then it is clipped like any other (the loop
    # agrees); a form whose float32 intermediates overflow (the Gram form's <x_t, x_t>)
    # may instead call the norm non-finite and drop the record (below): both are sound
    assert bad_value == 1e30, norms
    want = per_record_clipped_sum(model, bad, y, _LOSS, 0.5)
    assert np.isfinite(want[1][2])
    _assert_equal((got, norms), want)
    return
  keep = [i for i in range(6) if i != 2]
  want, _ = per_record_clipped_sum(model, x[keep], y[keep], _LOSS, 0.5)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=5e-4, atol=5e-6 * max(1.0, np.max(np.abs(w))))


@pytest.mark.parametrize("form", [None, "gram", "direct"])
def test_adversarial_neighbour_moves_the_sum_by_at_most_c(form, monkeypatch):
  if form is not None:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  t, k, n = 4, 8, 8
  model = _model(t, k, n)
  x, y = _data(10, t, k, seed=6)
  clip = 0.3
  x2 = np.concatenate([x, 1e3 * x[:1]])
  y2 = np.concatenate([y, 30.0 * np.ones((1, 2), np.float32)])
  d = _fast(model, x, y, clip)[0]
  d2, norms = _fast(model, x2, y2, clip)
  assert np.isfinite(norms[-1]) and norms[-1] > 10 * clip
  moved = np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2) for a, b in zip(d2, d)))
  assert 0.5 * clip < moved <= clip * (1 + 1e-4), moved
