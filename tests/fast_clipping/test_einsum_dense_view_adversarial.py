"""Adversarial checks of the clipped sum's shared ops (algebra.const / reshape /
once_per_graph) and of EinsumDense taken as a Dense (rules/dense.py `_as_dense`).

Every EinsumDense equation Keras and KerasHub use (and some that must fall back to the einsum
rule: a position index in the kernel, the input's or the kernel's indices in another order),
with the bias on every axis set, absent or frozen, and a frozen kernel, in every form (the
Gram and direct norms, kept per-record gradients, book-keeping over chunks of the batch under
a tiny memory budget), eagerly traced and under XLA: the per-example norms and the clipped sum
equal those of an independent loop of per-example tape gradients. Layers that read different
tensors of one shape never share a Gram matrix (the memo is keyed by the tensor, not its
shape); layers that read one tensor share it exactly; two models and retraces (new graphs)
reuse nothing of an earlier trace."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.fast_clipping.rules import dense
from .conftest import per_record_clipped_sum
from .covers import assert_covers
from .covers import cover
from .covers import slow_outside

# Nightly tier (-m slow, besides the grids below): the shared-input and
# physical-chunk checks under XLA (graph stays; XLA: test_under_xla), records of two in the
# gram and chunked forms (direct stays).
SLOW_CASES = {
    "test_same_shape_different_inputs_never_share[True]",
    "test_physical_chunks_of_a_shared_input_model[True]",
    "test_records_of_two_examples[gram]",
    "test_records_of_two_examples[chunks]",
    # LayerNorm's axes: trailing ([-1]: gamma and beta broadcast as they are) and not
    # ([axis4] = [1, 3]: reshaped) stay by default; [1], [1, 2], [2, 3] nightly
    "test_layer_norm_on_any_axes[1]",
    "test_layer_norm_on_any_axes[axis2]",
    "test_layer_norm_on_any_axes[axis3]"}

_T, _K, _H, _D, _N = 5, 4, 2, 3, 6
_CLIP = 0.3   # where a test does not take the median norm
_LOSS = keras.losses.MeanSquaredError(reduction=None)

# (equation, output_shape, bias_axes, input_shape, taken as a Dense)
_CASES = [
    ("ab,bc->ac", (_N,), "c", (_K,), False),
    ("ab,bc->ac", (_N,), None, (_K,), False),
    ("abc,cd->abd", (_T, _N), "d", (_T, _K), True),
    ("abc,cd->abd", (_T, _N), None, (_T, _K), True),
    ("abc,cd->abd", (_T, _N), "bd", (_T, _K), False),   # a bias per position
    ("abc,cde->abde", (_T, _H, _D), "de", (_T, _K), True),
    ("abc,cde->abde", (_T, _H, _D), "d", (_T, _K), False),   # bias [H, 1]: broadcast along e
    ("abc,cde->abde", (_T, _H, _D), "e", (_T, _K), False),   # bias [D]: broadcast along d
    ("abc,cde->abde", (_T, _H, _D), None, (_T, _K), True),
    ("abcd,cde->abe", (_T, _N), "e", (_T, _H, _D), True),
    ("abcd,cde->abe", (_T, _N), None, (_T, _H, _D), True),
    ("abcd,de->abce", (_T, _H, _N), "e", (_T, _H, _D), True),   # two position axes
    ("abc,bcd->abd", (_T, _N), "d", (_T, _K), False),   # a position index in the kernel
    ("acb,cd->abd", (_T, _N), "d", (_K, _T), False),    # contracted before the positions
    ("abcd,ced->abe", (_T, _N), "e", (_T, _H, _D), False),   # kernel [c, e, d]
    ("abc,dc->abd", (_T, _N), "d", (_T, _K), False),    # kernel [out, contracted]
]


def _model(equation, out_shape, bias_axes, in_shape, freeze=None):
  keras.utils.set_random_seed(7)
  x = keras.Input(in_shape)
  layer = keras.layers.EinsumDense(equation, output_shape=out_shape, bias_axes=bias_axes,
                                   activation="tanh")
  h = keras.layers.Flatten()(layer(x))
  model = keras.Model(x, keras.layers.Dense(2)(h))
  if freeze == "kernel":
    layer.kernel.trainable = False
  elif freeze == "bias":
    layer.bias.trainable = False
  return model, layer


def _data(in_shape, b=11, seed=0):
  rng = np.random.RandomState(seed)
  x = (rng.normal(size=(b,) + in_shape) * rng.choice([0.2, 1.0, 5.0], (b,) + (1,) * len(in_shape))
       ).astype("float32")
  return x, rng.normal(size=(b, 2)).astype("float32")


def _check(model, x, y, jit=False, k=1, memo=None):
  """clipped_grad_sum (records of k examples) against the per-record loop of conftest's
  per_record_clipped_sum at the clip norm C the median per-record norm: some records clipped,
  some not (`memo`: the loop's gradients, shared by several checks of one model's weights)."""
  memo = {} if memo is None else memo
  _, want_norms = per_record_clipped_sum(model, x, y, _LOSS, 1.0, k=k, memo=memo)
  clip = float(np.median(want_norms))
  want, want_norms = per_record_clipped_sum(model, x, y, _LOSS, clip, k=k, memo=memo)
  xt, yt = tf.nest.map_structure(tf.constant, x), tf.constant(y)   # tensors, as a step has
  got, norms = tf.function(lambda: fast_clipping.clipped_grad_sum(
      model, xt, yt, _LOSS, clip, examples_per_record=k), jit_compile=jit)()
  np.testing.assert_allclose(norms.numpy(), want_norms, rtol=2e-4)
  assert np.min(want_norms) < clip < np.max(want_norms)
  for g, r in zip(got, want):
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), r, rtol=3e-4, atol=_atol(r))


def _atol(r):
  """The absolute tolerance of a clipped sum's entries, scaled with the sum's largest entry:
  the norms are upper bounds (1 + delta) of the exact ones (the Gram and direct forms' bounds
  of their own and the clipped sum's rounding, algebra.with_sum_rounding: delta = gamma_L S /
  ||g||, L <= B T + T + 1 = 61 rows here, up to ~2e-5 on these records), so each clipped
  record's factor, and its part of every entry, moves by a relative delta; an entry near 0
  where records cancel keeps that absolute error of the records' scale, of the order of the
  largest entry (measured 1.1e-5 at max|r| 3.3). 3e-6 the float32 floor."""
  return max(3e-6, 2e-5 * float(np.max(np.abs(r))))


def _force(monkeypatch, form):
  if form == "chunks":   # no per-record gradients kept; book-keeping over chunks of 8
    monkeypatch.setattr(budget, "KEEP_BYTES", 0)
    monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
    monkeypatch.setattr(registry, "MAX_DIRECT_PER_EXAMPLE_ENTRIES", 0)
    monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", 0)
  else:
    monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)


_FORMS = (None, "gram", "direct", "chunks")
# (equation index, form): every equation in every form; by default each equation in one form,
# None, gram, direct, chunks in turn, so that each form meets 4 equations, among them some
# taken as a Dense and some not, biased and not; the rest marked slow (-m slow).
_EQ_GRID = [(i, form) for i in range(len(_CASES)) for form in _FORMS]
_EQ_DEFAULT = [(i, _FORMS[i % 4]) for i in range(len(_CASES))]
_EQ_MEMOS = {}   # equation index -> the loop's gradients (the forms only read the weights)


@functools.lru_cache(maxsize=None)
def _equation_model(i):
  """The model of _CASES[i], built once per module (the tests only read its weights)."""
  return _model(*_CASES[i][:4])


def test_default_forms_meet_every_kind_of_equation():
  for form in _FORMS:
    met = [_CASES[i] for i, f in _EQ_DEFAULT if f == form]
    assert {c[4] for c in met} == {True, False}, form   # taken as a Dense and not
    assert {c[2] is None for c in met} == {True, False}, form   # with a bias and without
  assert {i for i, _ in _EQ_DEFAULT} == set(range(len(_CASES)))


@pytest.mark.parametrize("i, form", slow_outside(
    _EQ_GRID, _EQ_DEFAULT, ids=lambda c: f"{_CASES[c[0]][0]}-{_CASES[c[0]][2]}-{c[1]}"))
def test_every_equation_equals_the_per_example_loop(i, form, monkeypatch):
  equation, _, _, in_shape, as_dense = _CASES[i]
  model, layer = _equation_model(i)
  x, y = _data(in_shape)
  entry = dense.kernel_rule_entry(layer, lora=False, einsum=True)
  view = entry and dense._as_dense(layer, entry[1], tf.constant(x),  # pylint: disable=protected-access
                                   layer(tf.constant(x)))
  assert (view is not None) == as_dense, equation
  _force(monkeypatch, form)
  chunked = []
  over = budget.sum_over_chunks
  monkeypatch.setattr(budget, "sum_over_chunks",
                      lambda fn, tensors, size, *args, **kwargs: chunked.append(size) or over(
                          fn, tensors, size, *args, **kwargs))
  pinned = []   # a Dense view's sum record by record (rules/dense._pinned_record_sums)
  records = dense._pinned_record_sums   # pylint: disable=protected-access
  monkeypatch.setattr(dense, "_pinned_record_sums",
                      lambda *args: pinned.append(args[0].shape) or records(*args))
  _check(model, x, y, memo=_EQ_MEMOS.setdefault(i, {}))
  if form == "chunks":   # no per-record gradient kept: book-keeping over chunks of 8 of the
    # batch of 11 really ran, or (a Dense view) the sum record by record
    assert ((pinned and not chunked) if as_dense and dense.PINNED_RECORD_SUMS else
            8 in chunked), (chunked, pinned)


# (equation index, frozen variable, form): by default each equation once and each frozen
# variable with each form, the rest slow (-m slow).
_FROZEN_EQS = [i for i, c in enumerate(_CASES) if c[0] in ("abc,cde->abde", "abcd,cde->abe")
               and c[2] is not None]
_FROZEN_GRID = [(i, freeze, form) for i in _FROZEN_EQS for freeze in ("kernel", "bias")
                for form in ("gram", "chunks")]
_FROZEN_GROUPS = [(0,), (1, 2)]
_FROZEN_DEFAULT = cover(_FROZEN_GRID, _FROZEN_GROUPS)


def test_frozen_cases_cover_every_equation_variable_and_form():
  assert_covers(_FROZEN_DEFAULT, _FROZEN_GRID, _FROZEN_GROUPS)
  assert len(_FROZEN_DEFAULT) <= len(_FROZEN_GRID) / 3


@pytest.mark.parametrize("i, freeze, form", slow_outside(
    _FROZEN_GRID, _FROZEN_DEFAULT, ids=lambda c: f"{_CASES[c[0]][0]}-{c[1]}-{c[2]}"))
def test_frozen_kernel_or_bias(i, freeze, form, monkeypatch):
  model, _ = _model(*_CASES[i][:4], freeze=freeze)
  x, y = _data(_CASES[i][3])
  _force(monkeypatch, form)
  _check(model, x, y)


@pytest.mark.parametrize("form", ["gram", None])
def test_under_xla(form, monkeypatch):
  _force(monkeypatch, form)
  for equation, out_shape, bias_axes, in_shape, _ in (_CASES[4], _CASES[8], _CASES[10]):
    model, _ = _model(equation, out_shape, bias_axes, in_shape)
    x, y = _data(in_shape, b=8)
    _check(model, x, y, jit=True)


def _two_inputs_model():
  """Two inputs of one shape: projections of x1 (three, sharing its Gram exactly), one of x2
  (the same shape, another tensor: its own Gram), a Dense on x2 and one on a tensor derived
  from x1 of x1's shape (x1 * 2: another tensor again)."""
  keras.utils.set_random_seed(11)
  x1, x2 = keras.Input((_T, _K)), keras.Input((_T, _K))
  proj = lambda: keras.layers.EinsumDense("abc,cde->abde", output_shape=(_T, _H, _D),  # noqa: E731
                                          bias_axes="de")
  q, k, v = proj()(x1), proj()(x1), proj()(x1)
  w = proj()(x2)
  d2 = keras.layers.Dense(_H * _D)(x2)
  d1 = keras.layers.Dense(_H * _D)(keras.layers.Rescaling(2.0)(x1))
  mixed = keras.layers.Reshape((_T, _H * _D))(q * k + v * w)
  h = keras.layers.Flatten()(mixed + d1 * d2)
  return keras.Model([x1, x2], keras.layers.Dense(2)(h))


@pytest.mark.parametrize("jit", [False, True])
def test_same_shape_different_inputs_never_share(jit, monkeypatch):
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  model = _two_inputs_model()
  rng = np.random.RandomState(3)
  x1 = rng.normal(size=(8, _T, _K)).astype("float32")
  x2 = (3.0 * rng.normal(size=(8, _T, _K))).astype("float32")
  y = rng.normal(size=(8, 2)).astype("float32")
  _check(model, [x1, x2], y, jit=jit)


def test_two_models_and_retraces_reuse_nothing(monkeypatch):
  """Two models of one architecture (other weights) traced in turn by one Python function,
  then retraced at another batch size, many times (so a dead graph's id may come back): each
  sum is its own model's."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  models = []
  for seed in (1, 2):
    model, _ = _model(*_CASES[4][:4])
    for v in model.trainable_variables:
      v.assign(tf.random.stateless_normal(v.shape, [seed, 0]) * 0.5)
    models.append(model)
  fn = tf.function(lambda m, x, y: fast_clipping.clipped_grad_sum(m, x, y, _LOSS, _CLIP),
                   reduce_retracing=False)
  for b in (8, 9, 8, 10):
    x, y = _data(_CASES[4][3], b=b, seed=b)
    for model in models:
      got, _ = fn(model, x, y)
      want, _ = per_record_clipped_sum(model, x, y, _LOSS, _CLIP)
      for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=3e-4, atol=_atol(r))


@pytest.mark.parametrize("form", ["gram", "direct", "chunks"])
def test_records_of_two_examples(form, monkeypatch):
  """Microbatches (records of k = 2 consecutive examples, the positions of a record merged):
  the shared Gram of a record's input and the Dense view's norms and sum are the record's."""
  _force(monkeypatch, form)
  model = _two_inputs_model()
  rng = np.random.RandomState(5)
  b, k = 12, 2
  x = [rng.normal(size=(b, _T, _K)).astype("float32") for _ in range(2)]
  y = rng.normal(size=(b, 2)).astype("float32")
  _check(model, x, y, k=k)   # a record's gradient: that of its examples' mean loss


@pytest.mark.parametrize("axis", [-1, 1, [1, 2], [2, 3], [1, 3]])
def test_layer_norm_on_any_axes(axis):
  """LayerNorm's recorded forward broadcasts gamma and beta as they are on trailing normalized
  axes and reshapes them otherwise: per-example norms and clipped sum of the loop's."""
  keras.utils.set_random_seed(8)
  x = keras.Input((_T, _K, 3))
  h = keras.layers.LayerNormalization(axis=axis)(x)
  model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
  for v in model.layers[1].trainable_variables:   # gamma and beta away from 1 and 0
    v.assign(tf.random.stateless_normal(v.shape, [3, 1]))
  xs, y = _data((_T, _K, 3))
  _check(model, xs, y)


@pytest.mark.parametrize("jit", [False, True])
def test_physical_chunks_of_a_shared_input_model(jit, monkeypatch):
  """The clipped sum over physical chunks of 8 examples (budget.KEPT_BYTES = 1: the forward,
  norms and sum of each chunk in a loop body, with the block of shared ops opened once
  outside it): the same norms and sum as the loop, for a batch of 19 (a ragged last chunk)."""
  monkeypatch.setattr(budget, "KEPT_BYTES", 1)
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  calls, chunked = [], clipping._chunked_grad_sum  # pylint: disable=protected-access
  monkeypatch.setattr(clipping, "_chunked_grad_sum",
                      lambda *a, **kw: calls.append(a[-2]) or chunked(*a, **kw))
  model = _two_inputs_model()
  rng = np.random.RandomState(8)
  x = [rng.normal(size=(19, _T, _K)).astype("float32") for _ in range(2)]
  y = rng.normal(size=(19, 2)).astype("float32")
  _check(model, x, y, jit=jit)
  assert calls == [8], calls


def test_memo_never_hands_out_another_graphs_tensor():
  """One shared_ops block open across 18 traces of short-lived functions (as the
  physical-chunk probe traces inside a clipped sum's block), their graphs dropped as they go
  (so a new graph may get a dead one's id), branch graphs of tf.cond and a loop body: every
  tensor const / once_per_graph / reshape hands out is of the graph being traced, and its
  value is the one asked for. (Six rounds: in 30 rounds, as before, no graph id came back
  here, with or without gc.collect() between rounds, so more rounds add nothing.)"""
  wrong = []

  def probe(x):
    for t in (algebra.const([2, 3]), algebra.reshape(x, [2, 3]),
              algebra.once_per_graph("sq", x, tf.square)):
      if t.graph is not tf.compat.v1.get_default_graph():
        wrong.append(t)
    return algebra.reduce_sum(algebra.reshape(x, [2, 3]), [1]) + tf.reduce_sum(
        algebra.once_per_graph("sq", x, tf.square))

  with algebra.shared_ops():
    for i in range(6):
      x = tf.constant(np.arange(6.0, dtype=np.float32) + i)
      want = np.arange(6.0).reshape(2, 3).sum(1) + i * 3 + np.sum((np.arange(6.0) + i) ** 2)
      got = tf.function(probe)(x)   # a new function each time: its graph dropped after
      np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
      branched = tf.function(lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: probe(x),
                                                lambda: probe(-x)))(x)
      np.testing.assert_allclose(branched.numpy(), want, rtol=1e-6)
      looped = tf.function(lambda x: tf.while_loop(
          lambda j, _: j < 2, lambda j, acc: (j + 1, probe(x)), [0, tf.zeros([2])])[1])(x)
      np.testing.assert_allclose(looped.numpy(), want, rtol=1e-6)
  assert not wrong


@pytest.mark.parametrize("k", [1, 2])
def test_embedding_same_id_gram_with_repeated_ids(k):
  """An Embedding whose examples repeat ids (the same-id Gram form, ids [B, T] taken as they
  are), records of k examples: norms and clipped sum of the loop's."""
  keras.utils.set_random_seed(12)
  ids = keras.Input((_T,), dtype="int32")
  h = keras.layers.Embedding(5, _K)(ids)
  model = keras.Model(ids, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
  rng = np.random.RandomState(k)
  x = rng.randint(0, 3, size=(8, _T)).astype("int32")   # 3 of 5 ids: many repeats
  y = rng.normal(size=(8, 2)).astype("float32")
  _check(model, x, y, k=k)
