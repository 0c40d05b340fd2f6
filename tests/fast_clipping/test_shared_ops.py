"""Fewer ops in the clipped sum's trace (the BERT-base first step): constants, reshapes,
weightings and Gram matrices built once per graph (algebra.const / reshape / once_per_graph),
EinsumDense layers that are a Dense on [B, T, K] taking the Dense rule's forms (rules/dense.py
`_as_dense`), LayerNorm's kept gradients as one block; the sums stay those of per-example
tape gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import dense

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
_T, _H, _D = 6, 3, 4   # positions, heads, head size (model width _H * _D)

# Nightly tier (-m slow): the attention block's bias variants x forms beyond one diagonal; by
# default each bias variant and each form once ([e-False-gram], [None-False-direct],
# [e-True-None]); the Dense rule's folded, frozen and absent bias in the gram and direct forms
# stay by default in test_fast_clipping.py (test_dense_bias_as_weight_of_an_input_one,
# test_registered_layer_exact[dense_nobias-None]).
SLOW_CASES = {
    f"test_attention_projections_sum_equals_per_example_reference[{case}]"
    for case in ("e-False-direct", "e-False-None", "None-False-gram", "None-False-None",
                 "e-True-gram", "e-True-direct")}


def _reference(model, x, y, clip):
  """sum_i min(1, C / ||g_i||) g_i of per-example tape gradients."""
  total = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
  for i in range(x.shape[0]):
    with tf.GradientTape() as tape:
      loss = _LOSS(y[i:i + 1], model(x[i:i + 1]))[0]
    g = [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(t ** 2) for t in g))
    total = [a + t * min(1.0, clip / norm) for a, t in zip(total, g)]
  return total


def _attention_like(blocks=1, out_bias="e", frozen_bias=False):
  """Blocks of query/key/value projections ("abc,cde->abde", bias "de") reading one input, an
  output projection ("abcd,cde->abe") and a LayerNorm."""
  keras.utils.set_random_seed(5)
  x = keras.Input((_T, _H * _D))
  h = x
  for _ in range(blocks):
    proj = [keras.layers.EinsumDense("abc,cde->abde", output_shape=(_T, _H, _D),
                                     bias_axes="de") for _ in range(3)]
    q, k, v = (p(h) for p in proj)
    mixed = q * k + v
    out = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(_T, _H * _D),
                                   bias_axes=out_bias)
    h = keras.layers.LayerNormalization()(h + out(mixed))
    if frozen_bias:
      proj[0].bias.trainable = False
  logits = keras.layers.Dense(2)(keras.layers.Flatten()(h))
  return keras.Model(x, logits)


def _data(b=5):
  rng = np.random.RandomState(0)
  return (rng.normal(size=(b, _T, _H * _D)).astype("float32"), rng.randint(0, 2, b))


@pytest.mark.parametrize("form", ["gram", "direct", None])
@pytest.mark.parametrize("out_bias,frozen_bias", [("e", False), (None, False), ("e", True)])
def test_attention_projections_sum_equals_per_example_reference(out_bias, frozen_bias, form,
                                                                monkeypatch):
  """Every form of the Dense view (Gram norms and the book-keeping product; kept per-record
  gradients, unpacked to the kernel's and bias's shapes), with the bias folded, absent,
  frozen, or (bias_axes "e" of a "de" output) on the einsum rule's own path."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = _attention_like(out_bias=out_bias, frozen_bias=frozen_bias)
  x, y = _data()
  got, _ = tf.function(lambda: fast_clipping.clipped_grad_sum(model, x, y, _LOSS, 0.3))()
  for g, r in zip(got, _reference(model, x, y, 0.3)):
    np.testing.assert_allclose(g.numpy(), r, rtol=2e-4, atol=2e-5)


def test_einsum_dense_view_only_where_it_is_a_dense():
  """`_as_dense` takes projections whose kernel is [contracted, output-only] and whose bias is
  one value per output-only entry; it declines a bias broadcast along an output-only axis, an
  index shared by the input, kernel and output, and a frozen kernel."""
  def view(equation, shape, bias_axes, x_shape, dz_shape, kernel_on=True):
    layer = keras.layers.EinsumDense(equation, output_shape=shape, bias_axes=bias_axes)
    layer.build((None,) + x_shape)
    layer.kernel.trainable = kernel_on
    parsed = dense.kernel_rule_entry(layer, lora=False, einsum=True)[1]
    return dense._as_dense(layer, parsed, tf.zeros((2,) + x_shape),   # pylint: disable=protected-access
                           tf.zeros((2,) + dz_shape))

  on, x3, dz3 = view("abc,cde->abde", (_T, _H, _D), "de", (_T, 12), (_T, _H, _D))
  assert on == (True, True) and x3.shape == (2, _T, 12) and dz3.shape == (2, _T, _H * _D)
  on, x3, _ = view("abcd,cde->abe", (_T, 12), None, (_T, _H, _D), (_T, 12))
  assert on == (True, False) and x3.shape == (2, _T, _H * _D)
  assert view("abc,cde->abde", (_T, _H, _D), "d", (_T, 12), (_T, _H, _D)) is None
  assert view("abc,bcd->abd", (_T, _D), None, (_T, 12), (_T, _D)) is None
  assert view("abc,cde->abde", (_T, _H, _D), "de", (_T, 12), (_T, _H, _D),
              kernel_on=False) is None


def _norms_and_sum_ops(model, b=4):
  x, y = _data(b)
  graph = tf.function(lambda: fast_clipping.clipped_grad_sum(
      model, x, y, _LOSS, 1.0)[0]).get_concrete_function().graph
  return [op for op in graph.get_operations()
          if op.name.split("/")[0] in ("norms", "clipped_sum")]


def test_constants_do_not_grow_with_depth():
  """The axes, shapes and sizes the rules read are one Const per value in the graph: 1 and 4
  blocks have as many Const ops in the norms and the clipped sum."""
  counts = [sum(op.type == "Const" for op in _norms_and_sum_ops(_attention_like(blocks)))
            for blocks in (1, 4)]
  assert counts[0] == counts[1], counts


def test_projections_of_one_input_share_its_gram_matrix(monkeypatch):
  """Query, key and value read the same input: one [T, T] Gram of it (with its column of
  ones) per block, not one per projection; the output projection and the head have their
  own."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "gram")
  ops = _norms_and_sum_ops(_attention_like(blocks=2))
  equations = [op.get_attr("equation").decode() for op in ops if op.type == "Einsum"]
  # per block: the Grams of the inputs (one shared by the 3 projections, the output
  # projection's) and of the 4 projections' output gradients; Dense(2) on [B, K] has none
  assert equations.count("btk,bsk->bts") == 2 * 2, equations
  assert equations.count("btn,bsn->bts") == 2 * 4, equations


def test_layer_norm_keeps_one_block():
  """Gamma's and beta's per-record gradients side by side in one [R, 2 entries] block whose
  squared row norms are the norms; its unpacked sums have the variables' shapes."""
  layer = keras.layers.LayerNormalization()
  layer.build((None, _T, 5))
  x = tf.random.stateless_normal([3, _T, 5], seed=[1, 2])
  dy = tf.random.stateless_normal([3, _T, 5], seed=[3, 4])
  _, _, fn = registry.lookup(layer)(layer, x)
  res = fn(dy)
  assert isinstance(res, registry.PerExampleBlock) and len(res.blocks) == 1
  block = res.blocks[0].numpy()
  assert block.shape == (3, 10)
  np.testing.assert_allclose(res.sqr_norms, np.sum(block ** 2, axis=1), rtol=1e-5)
  np.testing.assert_allclose(block[:, 5:], np.sum(dy.numpy(), axis=1), rtol=1e-5, atol=1e-6)
  sums = res.unpack([tf.constant(np.arange(10.0, dtype=np.float32))])
  assert [tuple(s.shape) for s in sums] == [(5,), (5,)]
  np.testing.assert_array_equal(sums[1], np.arange(5.0, 10.0))


def test_const_once_per_graph_and_compile_time_constant_in_branches():
  """algebra.const: one tensor per value within a shared_ops block in a graph, built afresh
  in a tf.cond branch's graph (so XLA reads the axes of a reduction there as compile-time
  constants) and eagerly; outside a block one per call."""
  def f(x, flag):
    with algebra.shared_ops():
      a, b = algebra.const([1, 2]), algebra.const([1, 2])
      same = a is b
      y = tf.cond(flag, lambda: algebra.reduce_sum(x, [1, 2]),
                  lambda: algebra.reduce_sum(2.0 * x, [1, 2]))
    return y, same

  x = tf.reshape(tf.range(24.0), [2, 3, 4])
  seen = {}

  def traced(x, flag):
    y, seen["same"] = f(x, flag)
    return y

  run = tf.function(traced, jit_compile=True)
  np.testing.assert_allclose(run(x, tf.constant(False)), 2.0 * np.sum(x.numpy(), (1, 2)))
  assert seen["same"]
  np.testing.assert_allclose(f(x, tf.constant(True))[0], np.sum(x.numpy(), (1, 2)))
  @tf.function
  def outside():
    seen["outside"] = algebra.const(3) is algebra.const(3)
    return algebra.const(3)

  assert outside() == 3 and seen["outside"] is False
