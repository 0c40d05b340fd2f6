"""Review: a convolution's per-record norm under cancellation. Every patch of an input that
is one pixel vector a (|a| 10 .. 1e6) repeated over the image is the same, and a frozen head
with weights w at output position 0 and -w at position 1 (public weights the guarantee must
hold for) gives those positions opposite output gradients: the exact kernel gradient
(p_0 - p_1) dz_0^T is tiny (one pixel of position 0's patch moved by delta) while its parts
are huge. The folded patch Gram (conv._fold_gram_sqr_norm, sum_{t,s} <p_t, p_s><dz_t, dz_s>)
summed in float32 cancelled to ~0 and one record moved the clipped sum by up to 7e4 C (the
cost-chosen form of a 4x4 kernel at stride 2, and every forced "foldgram" case); the
per-example filter gradients ("filter", "depthwise") with the sum by book-keeping (a kernel
too large to keep: the cost-chosen form of a 3x3x64x32 kernel over 32x32 positions) moved it
by up to 1.6 C (the norm taken of one float32 gradient, the sum of another).

Checked through clipped_grad_sum, graph and XLA: each record alone (its contribution to any
batch's clipped sum) moves the noise-off sum by at most C (within float32 rounding), in the
cost-chosen form and each forced form, with the per-example gradients kept (the sum from them)
and not kept (the sum by book-keeping, a second float32 computation of the gradient), for
Conv2D, Conv1D and records of two examples.
"""

import keras
import numpy as np
import pytest

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry

from .covers import all_pairs
from .covers import assert_covers_pairs_of
from .covers import slow_outside
from .test_gram_cancellation_review import _contributions
from .test_layer_cancellation_review import _assert_within_c
from .test_layer_cancellation_review import _no_kept


def _model(spatial, cin, cout, ksize, stride, use_bias, conv1d=False):
  """Conv -> Flatten -> a frozen head: w at output position 0, -w at position 1, 0 else."""
  keras.utils.set_random_seed(0)
  if conv1d:
    inp = keras.Input((spatial, cin))
    conv = keras.layers.Conv1D(cout, ksize, strides=stride, use_bias=use_bias)
  else:
    inp = keras.Input((spatial, spatial, cin))
    conv = keras.layers.Conv2D(cout, ksize, strides=stride, use_bias=use_bias)
  z = conv(inp)
  head = keras.layers.Dense(1, use_bias=False)
  model = keras.Model(inp, head(keras.layers.Flatten()(z)))
  positions = int(np.prod(z.shape[1:-1]))
  w = np.random.RandomState(1).normal(size=cout).astype("float32")
  kernel = np.zeros((positions, cout), np.float32)
  kernel[0], kernel[1] = w, -w
  head.kernel.assign(kernel.reshape(-1, 1))
  head.trainable = False
  return model


def _records(shape, count=16, seed=2, top=6):
  """Inputs of one pixel vector a (|a| 10 .. 10^top) everywhere, pixel 0's first entry
  moved by delta (1e-3 .. 1: in output position 0's patch only); a label far off."""
  rng = np.random.RandomState(seed)
  xs = []
  for _ in range(count):
    a = rng.normal(size=shape[-1]) * 10.0 ** rng.uniform(1, top)
    x = np.broadcast_to(a, shape).copy()
    x.reshape(-1)[0] += 10.0 ** rng.uniform(-3, 0)
    xs.append(x)
  return np.stack(xs).astype("float32"), np.full((count, 1), 1e4, np.float32)


# (spatial, cin, cout, kernel, stride): the cost rule picks the folded Gram for the second
_SHAPES = [(6, 4, 8, 3, 1), (8, 3, 16, 4, 2), (10, 16, 32, 3, 1)]

# By default all-pairs covers, the rest of each grid marked slow (-m slow): (shape, bias,
# jit) for the cost-chosen form; (check, form, keep, jit) for the three checks of the forced
# forms (test_forced_forms, test_records_of_two_cancelling_across_examples,
# test_cancelling_bias_record): each check in each form, each form kept and not, in graph
# and under XLA.
COST = [(shape, use_bias, jit) for shape in _SHAPES for use_bias in (True, False)
        for jit in (False, True)]
FORMS = [(check, form, keep, jit) for check in ("forced", "across", "bias")
         for form in ([] if check == "forced" else [None]) + ["foldgram", "gram", "direct",
                                                              "depthwise", "filter"]
         for keep in (True, False) for jit in (False, True)]
COST_DEFAULT, FORMS_DEFAULT = all_pairs(COST), all_pairs(FORMS)
# test_conv1d and test_records_of_two: each form once by default, one in graph mode and one
# under XLA (each mode once); test_cost_chosen_large_kernel: graph mode by default (the mode
# whose per-example filter gradients and book-keeping sum the review found 1.08 C apart).
SLOW_CASES = {"test_conv1d[None-True]", "test_conv1d[foldgram-False]",
              "test_records_of_two[None-False]", "test_records_of_two[foldgram-True]",
              "test_cost_chosen_large_kernel[True]"}


def test_default_cases_cover_every_pair():
  assert_covers_pairs_of(COST_DEFAULT, COST)
  assert_covers_pairs_of(FORMS_DEFAULT, FORMS)
  assert len(COST_DEFAULT) <= len(COST) / 2 and len(FORMS_DEFAULT) < 0.4 * len(FORMS)


def _forms(check):
  return slow_outside([c[1:] for c in FORMS if c[0] == check],
                      [c[1:] for c in FORMS_DEFAULT if c[0] == check],
                      ids=lambda c: "-".join(map(str, c)))


@pytest.mark.parametrize("shape,use_bias,jit", slow_outside(
    COST, COST_DEFAULT, ids=lambda c: "x".join(map(str, c[0])) + f"-{c[1]}-{c[2]}"))
def test_cost_chosen_form(shape, use_bias, jit):
  spatial, cin, cout, ksize, stride = shape
  model = _model(spatial, cin, cout, ksize, stride, use_bias)
  x, y = _records((spatial, spatial, cin))
  _assert_within_c(_contributions(model, x, y, jit))


def _forced(monkeypatch, form, keep):
  """The folded-kernel model (_SHAPES[1]) with `form` forced, every per-example gradient
  kept or none; (model, one input's shape)."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  if not keep:
    _no_kept(monkeypatch)
  spatial, cin, cout, ksize, stride = _SHAPES[1]
  return _model(spatial, cin, cout, ksize, stride, True), (spatial, spatial, cin)


@pytest.mark.parametrize("form,keep,jit", _forms("forced"))
def test_forced_forms(form, keep, jit, monkeypatch):
  """keep=False: no per-example gradient is kept, the sum is the book-keeping filter
  gradient of the clip-weighted output gradients (not the gradient the norm was taken of)."""
  model, shape = _forced(monkeypatch, form, keep)
  x, y = _records(shape)
  _assert_within_c(_contributions(model, x, y, jit))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("form", [None, "foldgram"])
def test_conv1d(form, jit, monkeypatch):
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = _model(12, 8, 16, 4, 2, True, conv1d=True)
  x, y = _records((12, 8))
  _assert_within_c(_contributions(model, x, y, jit))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("form", [None, "foldgram"])
def test_records_of_two(form, jit, monkeypatch):
  """Records of 2 examples: the folded Gram over the record's 2 T positions; each
  example on its own cancels as above."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  spatial, cin, cout, ksize, stride = _SHAPES[1]
  model = _model(spatial, cin, cout, ksize, stride, True)
  x, y = _records((spatial, spatial, cin))
  _assert_within_c(_contributions(model, x, y, jit, k=2))


@pytest.mark.parametrize("jit", [False, True])
def test_cost_chosen_large_kernel(jit):
  """A 3x3x64x32 kernel (18,432 entries: no per-example gradient kept) over 32x32 output
  positions (more than a patch's 576 entries): in graph mode the rules take the norm from
  per-example filter gradients and the sum by book-keeping; one record moved the sum by
  1.08 C (the norm of the first float32 gradient, the sum of another)."""
  model = _model(34, 64, 32, 3, 1, True)
  x, y = _records((34, 34, 64), count=8)
  _assert_within_c(_contributions(model, x, y, jit))


def _mirrored_pairs(model, shape, count=8, seed=3, top=4):
  """Records of two examples whose gradients nearly cancel across the examples: example 2
  is example 1 with one entry moved by delta, its label mirrored about the output (output
  gradients of opposite signs)."""
  rng = np.random.RandomState(seed)
  xs, ys = [], []
  for _ in range(count):
    a = (rng.normal(size=shape) * 10.0 ** rng.uniform(1, top)).astype("float32")
    out = float(model(a[None])[0, 0])
    b = a.copy()
    b.reshape(-1)[0] += np.float32(10.0 ** rng.uniform(-3, 0))
    xs += [a, b]
    ys += [[out + 1e4], [out - 1e4]]
  return np.stack(xs).astype("float32"), np.array(ys, np.float32)


@pytest.mark.parametrize("form,keep,jit", _forms("across"))
def test_records_of_two_cancelling_across_examples(form, keep, jit, monkeypatch):
  """The record's gradient is the sum of its examples' (algebra.examples_per_record): the
  norm of that sum, the clipped sum of the same record terms (the kept per-example gradients
  weighted one by one moved it by 1.04 C)."""
  model, shape = _forced(monkeypatch, form, keep)
  x, y = _mirrored_pairs(model, shape)
  _assert_within_c(_contributions(model, x, y, jit, k=2))


@pytest.mark.parametrize("form,keep,jit", _forms("bias"))
def test_cancelling_bias_record(form, keep, jit, monkeypatch):
  """The bias gradient db = sum_t dz_t cancels: the frozen head has w at output position 0,
  -w (1 + 2^-23) at position 1 and w / 1000 times small weights at the others, so that db is
  a sum of huge terms whose float32 value depends on its order; the sum is formed from the
  very db whose norm is taken (conv._bias_sum), so each record moves it by at most C, in every
  form, the kernel gradients kept or not."""
  model, shape = _forced(monkeypatch, form, keep)
  head = model.layers[-1]
  positions = head.kernel.shape[0] // model.layers[1].filters
  w = np.random.RandomState(1).normal(size=model.layers[1].filters).astype("float32")
  weights = np.random.RandomState(4).uniform(-1e-3, 1e-3, (positions, 1)).astype("float32") * w
  weights[0], weights[1] = w, -np.nextafter(w, 2 * w)
  head.kernel.assign(weights.reshape(-1, 1))
  x, y = _records(shape)
  _assert_within_c(_contributions(model, x, y, jit))
