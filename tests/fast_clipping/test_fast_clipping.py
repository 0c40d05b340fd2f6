"""Exactness of fast per-example clipping against an independent loop.

The reference computes each example's gradient with its own tf.GradientTape
on model(x[i:i+1]) and clips it in NumPy (float64 sums). Tolerances are float32
round-off (relative 1e-4 on norms, 1e-4 of the largest entry on gradients):
nothing here is random beyond fixed-seed inputs.
"""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf
import keras

from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry

from .covers import assert_covers_pairs_of
from .covers import slow_outside

L = keras.layers
B = 5
VARIANTS = ("bookkeeping", "two_pass")

# Nightly tier (-m slow; tests/conftest.py marks these ids slow).
SLOW_CASES = {
    # Dense's forced gram/direct forms stay by default on [dense-gram], [dense-direct],
    # [dense_seq-gram], [dense_seq-direct]; a Dense without bias on [dense_nobias-None] and, in
    # the gram/direct forms, test_dense_bias_as_weight_of_an_input_one's frozen-bias cases; the
    # 4-d input on [dense_seq_4d-None].
    "test_registered_layer_exact[dense_nobias-gram]",
    "test_registered_layer_exact[dense_nobias-direct]",
    "test_registered_layer_exact[dense_seq_4d-gram]",
    "test_registered_layer_exact[dense_seq_4d-direct]",
    # Non-convolution layers: each case at one cap by default, each rule (EinsumDense, Dense,
    # LayerNorm) at both caps (kept: [16384-einsum], [16384-einsum_seq], [16384-dense_seq_4d],
    # [16384-layernorm_nocenter], [16384-layernorm_seq]; by book-keeping: [0-einsum_seq_out],
    # [0-dense_seq], [0-layernorm_2axes], [0-layernorm]); every case's exactness at the default
    # cap is also test_registered_layer_exact's.
    "test_per_example_grads_kept_or_summed_by_bookkeeping[16384-einsum_seq_out]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[0-einsum]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[0-einsum_seq]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[0-dense_seq_4d]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[16384-dense_seq]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[16384-layernorm_2axes]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[0-layernorm_nocenter]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[0-layernorm_seq]",
    "test_per_example_grads_kept_or_summed_by_bookkeeping[16384-layernorm]",
    # Convolutions in records: each form once by default, on each of the three convolutions
    # (both ranks) and both record sizes: [conv2d_same_s2-None-3], [conv2d_valid-gram-3],
    # [conv2d_same_s2-filter-3], [conv2d_valid-depthwise-3], [conv1d_same_s2-foldgram-2].
    "test_microbatch_records_exact[conv1d_same_s2-None-2]",
    "test_microbatch_records_exact[conv2d_valid-None-2]",
    "test_microbatch_records_exact[conv2d_same_s2-gram-2]",
    "test_microbatch_records_exact[conv1d_same_s2-gram-3]",
    "test_microbatch_records_exact[conv1d_same_s2-filter-2]",
    "test_microbatch_records_exact[conv2d_valid-filter-2]",
    "test_microbatch_records_exact[conv1d_same_s2-depthwise-3]",
    "test_microbatch_records_exact[conv2d_same_s2-depthwise-2]",
    "test_microbatch_records_exact[conv2d_same_s2-foldgram-3]",
    "test_microbatch_records_exact[conv2d_valid-foldgram-2]",
}


def mse(y_true, y_pred):
  y_pred = tf.reshape(y_pred, [tf.shape(y_pred)[0], -1])
  return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)


def per_example(model, x, y, loss_fn):
  """Each example's gradient under its own tape (float64; zeros for an unused variable)."""
  variables = model.trainable_variables
  out = []
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[i:i + 1], model(x[i:i + 1], training=True))[0]
    out.append([np.asarray(tf.convert_to_tensor(g), np.float64) if g is not None
                else np.zeros(v.shape) for g, v in
                zip(tape.gradient(loss, variables), variables)])
  return out


def reference(model, x, y, loss_fn, clip, mask=None, grads_per_example=None):
  """(sum_i min(1, C / ||g_i||) g_i over unmasked i, [||g_i||], 0 where masked);
  `grads_per_example`: `per_example(...)` when already computed for these weights."""
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  norms = []
  for i, grads in enumerate(grads_per_example or per_example(model, x, y, loss_fn)):
    if mask is not None and mask[i] == 0:
      norms.append(0.0)
      continue
    n = np.sqrt(sum(np.sum(g * g) for g in grads))
    norms.append(n)
    f = min(1.0, clip / n) if n > 0 else 1.0
    total = [t + f * g for t, g in zip(total, grads)]
  return total, np.array(norms)


def check(model, x, y, loss_fn=mse, variants=VARIANTS, mask=None):
  grads_per_example = per_example(model, x, y, loss_fn)   # the loop once, for both uses
  _, ref_norms = reference(model, x, y, loss_fn, 1.0, grads_per_example=grads_per_example)
  clip = float(np.median(ref_norms))  # some examples clipped, some not
  ref_grads, ref_norms = reference(model, x, y, loss_fn, clip, mask, grads_per_example)
  for variant in variants:
    grads, norms = clipping.clipped_grad_sum(
        model, x, y, loss_fn, clip, mask=mask, variant=variant)
    assert len(grads) == len(model.trainable_variables)
    np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
    for g, r, v in zip(grads, ref_grads, model.trainable_variables):
      assert tuple(g.shape) == tuple(v.shape), v.path
      scale = max(1.0, float(np.max(np.abs(r))))
      np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * scale, rtol=1e-4,
                                 err_msg=f"{variant} {v.path}")


def data(in_shape, out_dim, seed=0, int_high=None):
  rng = np.random.default_rng(seed)
  if int_high is not None:
    x = tf.constant(rng.integers(0, int_high, (B,) + in_shape), tf.int32)
  else:
    x = tf.constant(rng.normal(size=(B,) + in_shape), tf.float32)
  y = tf.constant(rng.normal(size=(B, out_dim)), tf.float32)
  return x, y


def seq_model(in_shape, layers, out_dim=3, dtype="float32"):
  keras.utils.set_random_seed(1)
  inp = keras.Input(in_shape, dtype=dtype)
  h = inp
  for layer in layers:
    h = layer(h)
  h = L.Flatten()(h) if len(h.shape) > 2 else h
  out = L.Dense(out_dim)(h)
  return keras.Model(inp, out)


# (id, input shape, layer factory); the model is layer -> [Flatten] -> Dense.
LAYER_CASES = [
    ("dense", (7,), lambda: [L.Dense(5, activation="tanh")]),
    ("dense_nobias", (7,), lambda: [L.Dense(5, use_bias=False)]),
    ("dense_seq", (6, 7), lambda: [L.Dense(5, activation="tanh")]),
    ("dense_seq_4d", (3, 2, 7), lambda: [L.Dense(4, activation="relu")]),
    ("einsum", (7,), lambda: [L.EinsumDense("ab,bc->ac", 4, bias_axes="c",
                                            activation="tanh")]),
    ("einsum_seq", (6, 7), lambda: [L.EinsumDense(
        "abc,cde->abde", (6, 2, 3), bias_axes="de")]),
    ("einsum_seq_out", (6, 2, 3), lambda: [L.EinsumDense(
        "abcd,cde->abe", (6, 4), bias_axes="e")]),
    ("conv1d_valid", (9, 3), lambda: [L.Conv1D(4, 3, activation="relu")]),
    ("conv1d_same_s2", (9, 3), lambda: [L.Conv1D(4, 3, strides=2,
                                                 padding="same")]),
    ("conv1d_causal_d2", (9, 3), lambda: [L.Conv1D(4, 3, padding="causal",
                                                   dilation_rate=2)]),
    ("conv2d_same_s2", (8, 8, 2), lambda: [L.Conv2D(3, 3, strides=2,
                                                    padding="same",
                                                    activation="relu")]),
    ("conv2d_valid", (7, 6, 2), lambda: [L.Conv2D(3, (3, 2))]),
    ("conv2d_dilated", (8, 8, 2), lambda: [L.Conv2D(3, 3, dilation_rate=2,
                                                    padding="same")]),
    ("conv2d_nobias_1x1", (5, 5, 2), lambda: [L.Conv2D(3, 1, use_bias=False)]),
    # Strides dividing the kernel: patches by stride-block folding (conv_unfold.py).
    ("conv2d_same_k4s2", (9, 9, 2), lambda: [L.Conv2D(3, 4, strides=2, padding="same",
                                                      activation="relu")]),
    ("conv2d_valid_k4x2s2", (9, 7, 2), lambda: [L.Conv2D(3, (4, 2), strides=2)]),
    ("conv2d_same_s2x1", (8, 7, 2), lambda: [L.Conv2D(3, (4, 3), strides=(2, 1),
                                                      padding="same")]),
    ("conv1d_same_k4s2", (9, 3), lambda: [L.Conv1D(4, 4, strides=2, padding="same")]),
    ("layernorm", (7,), lambda: [L.Dense(5), L.LayerNormalization()]),
    ("layernorm_seq", (6, 7), lambda: [L.Dense(5), L.LayerNormalization()]),
    ("layernorm_2axes", (4, 3, 2), lambda: [L.LayerNormalization(
        axis=(1, 2))]),
    ("layernorm_nocenter", (6, 7), lambda: [L.LayerNormalization(
        center=False)]),
]


# Dense and Conv choose between the Gram and the direct form (Conv also the
# per-example filter gradient) by cost: test the automatic and forced forms.
FORMS = {"dense": (None, "gram", "direct"),
         "conv": (None, "gram", "direct", "filter", "depthwise", "foldgram")}
CONV_CASES = [c for c in LAYER_CASES if c[0].startswith("conv")]


@functools.lru_cache(maxsize=None)
def conv_traits(case):
  """The traits of a convolution case that select its code paths, read from its layer:
  rank, padding, strides (1, one stride > 1, or mixed), dilated, bias, and folded (a stride
  > 1 that divides the kernel: conv_unfold's stride-block folding)."""
  layer = case[2]()[0]
  strides, kernel = tuple(layer.strides), tuple(layer.kernel_size)
  return {"rank": len(kernel), "padding": layer.padding,
          "strides": "1" if set(strides) == {1} else "s" if len(set(strides)) == 1 else "mixed",
          "dilated": max(layer.dilation_rate) > 1, "bias": layer.use_bias,
          "folded": max(strides) > 1 and all(k % s == 0 for k, s in zip(kernel, strides))}


def trait_pairs(case, level):
  return {(level, trait, value) for trait, value in conv_traits(case).items()}


def cover_traits(cases, levels):
  """(case, level) pairs, greedy and deterministic, such that every level of a test axis
  (a forced form, a cap) meets every value of every trait of `conv_traits` that `cases`
  have: all pairs of {axis} x {each trait} in a few cases, where the full product is
  len(cases) * len(levels). Among equal picks, the case chosen least so far."""
  wanted = set().union(*(trait_pairs(c, v) for c in cases for v in levels))
  chosen = []
  while wanted:
    best = max(((c, v) for c in cases for v in levels), key=lambda cv: (
        len(trait_pairs(*cv) & wanted), -sum(c is cv[0] for c, _ in chosen)))
    wanted -= trait_pairs(*best)
    chosen.append(best)
  return chosen


# Every case in its automatic form (the form the cost model picks for it); the convolutions
# in the forced forms pairwise over their traits (test_conv_form_cover_is_pairwise).
FORM_CASES = [(c, f) for c in LAYER_CASES if not c[0].startswith("conv")
              for f in FORMS.get(c[0].split("_")[0], (None,))]
FORM_CASES += [(c, None) for c in CONV_CASES] + cover_traits(CONV_CASES, FORMS["conv"][1:])


def test_conv_form_cover_is_pairwise():
  """Each forced convolution form runs on every value of every trait (rank, padding, strides,
  dilation, bias, folding) and each convolution case in its automatic form."""
  conv = [(c, f) for c, f in FORM_CASES if c[0].startswith("conv")]
  assert {c[0] for c, f in conv if f is None} == {c[0] for c in CONV_CASES}
  for form in FORMS["conv"][1:]:
    for trait in conv_traits(CONV_CASES[0]):
      assert ({conv_traits(c)[trait] for c, f in conv if f == form} ==
              {conv_traits(c)[trait] for c in CONV_CASES}), (form, trait)
  forced = len(FORMS["conv"]) - 1
  assert len([f for _, f in conv if f is not None]) < len(CONV_CASES) * forced / 2


@pytest.mark.parametrize("case,form", FORM_CASES,
                         ids=[f"{c[0]}-{f}" for c, f in FORM_CASES])
def test_registered_layer_exact(case, form, monkeypatch):
  _, in_shape, make = case
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = seq_model(in_shape, make())
  assert fc.unregistered_layers(model) == []
  x, y = data(in_shape, 3)
  check(model, x, y)


def latin_pairs(first, second, third):
  """Every (first, second) pair once, with third[(i + j) % len(third)]: as len(third) <=
  len(first), len(second), every (first, third) and (second, third) pair occurs too
  (all-pairs coverage of three axes in len(first) * len(second) cases)."""
  assert len(third) <= min(len(first), len(second))
  return [(a, b, third[(i + j) % len(third)])
          for i, a in enumerate(first) for j, b in enumerate(second)]


def assert_covers_every_pair(cases, axes):
  """Every pair of values of every two axes (cases[k][i] takes its values in axes[i]) occurs
  in some case: an all-pairs cover of the full product."""
  assert_covers_pairs_of(cases, list(itertools.product(*axes)))


@pytest.mark.parametrize("frozen,form,in_shape", latin_pairs(
    [None, "kernel", "bias"], [None, "gram", "direct"], [(7,), (6, 7)]))
def test_dense_bias_as_weight_of_an_input_one(frozen, form, in_shape, monkeypatch):
  """With kernel and bias both trained and a sequence input, the Dense rule takes [W; b] as
  one kernel on [x, 1] (one Gram or per-example product for both); with either frozen, or a
  [B, K] input, it takes them apart. Norms and clipped sums equal the per-example reference
  in every form."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  dense_layer = L.Dense(5, activation="tanh")
  model = seq_model(in_shape, [dense_layer])
  if frozen is not None:
    getattr(dense_layer, frozen).trainable = False
  x, y = data(in_shape, 3)
  check(model, x, y)


CAPS = [0, registry.MAX_PER_EXAMPLE_ENTRIES]
# each case at both caps; the convolutions pairwise over their traits (as the forced forms)
KEEP_CASES = [(c, m) for c in LAYER_CASES if c[0].startswith(("einsum", "layernorm", "dense_seq"))
              for m in CAPS] + cover_traits(CONV_CASES, CAPS)


def test_keep_cover_is_pairwise():
  conv = [(c, m) for c, m in KEEP_CASES if c[0].startswith("conv")]
  for cap in CAPS:
    for trait in conv_traits(CONV_CASES[0]):
      assert ({conv_traits(c)[trait] for c, m in conv if m == cap} ==
              {conv_traits(c)[trait] for c in CONV_CASES}), (cap, trait)
  assert len(conv) < len(CONV_CASES) * len(CAPS) / 2


@pytest.mark.parametrize("case,max_entries", KEEP_CASES,
                         ids=[f"{m}-{c[0]}" for c, m in KEEP_CASES])
def test_per_example_grads_kept_or_summed_by_bookkeeping(case, max_entries,
                                                         monkeypatch):
  """Small layers return their per-example gradients (summed as sum_i c_i g_i);
  with both caps at 0 every layer forms its sum by book-keeping (a vector-Jacobian product
  or the rule's FactorSums)."""
  _, in_shape, make = case
  monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", max_entries)
  monkeypatch.setattr(registry, "MAX_DIRECT_PER_EXAMPLE_ENTRIES", max_entries)
  layers = make()
  model = seq_model(in_shape, layers)
  x, y = data(in_shape, 3)
  layer = layers[-1]
  rec = {}
  orig = registry.lookup(layer)

  def spy(lyr, *args, **kwargs):
    out, watched, fn = orig(lyr, *args, **kwargs)
    if lyr is layer:
      rec["fn"], rec["watched"] = fn, watched
    return out, watched, fn

  monkeypatch.setitem(registry._REGISTRY, type(layer), spy)  # pylint: disable=protected-access
  check(model, x, y, variants=("bookkeeping",))
  res = rec["fn"](tf.ones_like(rec["watched"]))
  kept = isinstance(res, (registry.PerExampleGrads, registry.PerExampleBlock))
  if isinstance(res, registry.FactorSums) and case[0].startswith("conv"):
    # A convolution keeps its per-example gradients (within its memory budget,
    # rules/conv.py) behind its FactorSums.
    kept = bool(res.sum_fn.keeps_per_example)
  assert kept == (max_entries > 0)
  if isinstance(res, registry.PerExampleGrads):
    for g, v in zip(res.grads, layer.trainable_variables):
      assert tuple(g.shape) == (B,) + tuple(v.shape)
  elif isinstance(res, registry.PerExampleBlock):
    rows = np.concatenate([b.numpy() for b in res.blocks], axis=1)
    assert rows.shape[0] == B
    np.testing.assert_allclose(res.sqr_norms.numpy(), np.sum(np.square(rows), axis=1),
                               rtol=1e-5)
    unpacked = res.unpack([b[0] for b in res.blocks])
    for g, v in zip(unpacked, layer.trainable_variables):
      assert tuple(g.shape) == tuple(v.shape)


@pytest.mark.parametrize("ids_shape", [(6,), (1,), (2, 3)])
def test_embedding_exact_with_repeated_ids(ids_shape):
  # Vocabulary 4 < 6 positions: every example repeats some ids.
  model = seq_model(ids_shape, [L.Embedding(4, 3)], dtype="int32")
  x, y = data(ids_shape, 3, int_high=4)
  assert fc.unregistered_layers(model) == []
  check(model, x, y)


def test_embedding_without_sequence_axis():
  keras.utils.set_random_seed(1)
  inp = keras.Input((), dtype="int32")
  out = L.Dense(3)(L.Embedding(4, 3)(inp))
  model = keras.Model(inp, out)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.integers(0, 4, (B,)), tf.int32)
  y = tf.constant(rng.normal(size=(B, 3)), tf.float32)
  check(model, x, y)


def test_multi_head_attention_through_dense_parts():
  keras.utils.set_random_seed(1)
  inp = keras.Input((5, 8))
  h = L.MultiHeadAttention(2, 4)(inp, inp)
  h = L.LayerNormalization()(h + inp)
  out = L.Dense(3)(L.Flatten()(h))
  model = keras.Model(inp, out)
  assert fc.unregistered_layers(model) == []
  x, y = data((5, 8), 3)
  check(model, x, y)


class ScaleShift(L.Layer):
  """y = x * w + c, unregistered layer with its own weights."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")
    self.c = self.add_weight(shape=(input_shape[-1],), initializer="zeros")

  def call(self, x):
    return tf.sin(x) * self.w + self.c


class MyDense(L.Dense):
  """Subclass that changes the forward: must not inherit Dense's norm."""

  def call(self, inputs, training=None):
    return super().call(inputs * inputs)


def test_mixed_model_exact():
  keras.utils.set_random_seed(1)
  inp = keras.Input((6, 4))
  h = L.Dense(5, activation="tanh")(inp)
  h = ScaleShift()(h)                      # unregistered, own weights
  h = L.Conv1D(4, 3, padding="same")(h)
  h = L.PReLU()(h)                         # unregistered keras layer
  h = L.TimeDistributed(L.Dense(3))(h)     # unregistered wrapper
  h = MyDense(4)(h)                        # Dense subclass, new forward
  h = L.LayerNormalization()(h)
  out = L.Dense(2)(L.Flatten()(h))
  model = keras.Model(inp, out)
  unreg = fc.unregistered_layers(model)
  assert len(unreg) == 4 and any("time_distributed" in n for n in unreg), unreg
  x, y = data((6, 4), 2)
  check(model, x, y)


def test_shared_layer_called_twice_exact():
  keras.utils.set_random_seed(1)
  inp = keras.Input((4,))
  shared = L.Dense(4, activation="tanh")
  out = L.Dense(2)(shared(shared(inp)))
  model = keras.Model(inp, out)
  x, y = data((4,), 2)
  check(model, x, y)


class Hadamard(L.Layer):
  """y = x * w (w: [d]); registered by the test with its own norm function."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

  def call(self, x):
    return x * self.w


def hadamard_norm_fn(layer, x):
  y = x * layer.w

  def sqr_norm_fn(dy):  # grad w_i = sum over non-feature axes of dy * x
    g = tf.reshape(dy * x, [tf.shape(x)[0], -1, x.shape[-1]])
    return tf.reduce_sum(tf.square(tf.reduce_sum(g, axis=1)), axis=1)

  return y, y, sqr_norm_fn


def test_register_user_layer():
  fc.register_layer(Hadamard, hadamard_norm_fn)
  model = seq_model((6, 3), [Hadamard(), L.Dense(4, activation="tanh")])
  assert fc.unregistered_layers(model) == []
  x, y = data((6, 3), 3)
  check(model, x, y)


def test_sequential_cnn_in_jit_compiled_function_with_mask():
  keras.utils.set_random_seed(1)
  model = keras.Sequential([
      keras.Input((10, 10, 1)),
      L.Conv2D(4, 4, strides=2, padding="same", activation="relu"),
      L.MaxPool2D(2, 1),
      L.Conv2D(3, 2, activation="relu"),
      L.PReLU(),
      L.Flatten(),
      L.Dense(5, activation="relu"),
      L.Dense(3),
  ])
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(B, 10, 10, 1)), tf.float32)
  y = tf.constant(rng.integers(0, 3, (B,)), tf.int32)

  def xent(yt, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(yt, logits)

  mask = np.array([1, 0, 1, 1, 0], np.float32)
  ref_grads, ref_norms = reference(model, x, y, xent, 0.5, mask)
  fn = tf.function(
      lambda x, y, m: fc.clipped_grad_sum(model, x, y, xent, 0.5, mask=m),
      jit_compile=True)
  grads, norms = fn(x, y, tf.constant(mask))
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
  assert norms.numpy()[1] == 0 and norms.numpy()[4] == 0
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g.numpy(), r, atol=1e-5, rtol=1e-4)


def test_clipped_sum_bounded_by_clip_times_batch():
  model = seq_model((7,), [L.Dense(5)])
  x, y = data((7,), 3)
  y = y * 100.0  # large gradients: every example is clipped
  grads, norms = fc.clipped_grad_sum(model, x, y, mse, 0.1)
  assert np.all(norms.numpy() > 0.1)
  total = np.sqrt(sum(float(tf.reduce_sum(g * g)) for g in grads))
  assert total <= 0.1 * B * (1 + 1e-5)


def test_supports():
  assert fc.supports(seq_model((7,), [L.Dense(5)]))
  bn = seq_model((7,), [L.Dense(5), L.BatchNormalization()])
  assert not fc.supports(bn)
  with pytest.raises(ValueError, match="BatchNormalization"):
    fc.clipped_grad_sum(bn, *data((7,), 3), mse, 1.0)
  unbuilt = keras.Sequential([L.Dense(3)])
  assert not fc.supports(unbuilt)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_clip_raises(bad):
  model = seq_model((7,), [L.Dense(5)])
  with pytest.raises(ValueError, match="l2_norm_clip"):
    fc.clipped_grad_sum(model, *data((7,), 3), mse, bad)


def test_loss_scale_held_by_the_caller_gives_the_same_sum():
  # the Keras train step hands the clipped sum the static loss scale it holds; the loss is
  # multiplied by it and the norms and the sum divided by it
  model = seq_model((7,), [L.Dense(5)])
  x, y = data((7,), 3)
  want, want_norms = fc.clipped_grad_sum(model, x, y, mse, 0.5)
  for scale in (1.0, 128.0):
    got, norms = fc.clipped_grad_sum(model, x, y, mse, 0.5, loss_scale=scale)
    np.testing.assert_allclose(norms.numpy(), want_norms.numpy(), rtol=1e-5)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)
  for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
    with pytest.raises(ValueError, match="`loss_scale` must be None or a finite float > 0"):
      fc.clipped_grad_sum(model, x, y, mse, 0.5, loss_scale=bad)


def test_bad_loss_shape_raises():
  model = seq_model((7,), [L.Dense(5)])
  with pytest.raises(ValueError, match="per_example_loss_fn"):
    fc.clipped_grad_sum(model, *data((7,), 3),
                        lambda yt, yp: tf.reduce_sum(mse(yt, yp)), 1.0)


def test_register_layer_validates():
  with pytest.raises(ValueError, match="layer_class"):
    fc.register_layer(int, hadamard_norm_fn)
  with pytest.raises(ValueError, match="norm_fn"):
    fc.register_layer(Hadamard, 3)


def test_unregistered_layer_with_dropout_is_refused():
  model = seq_model((6, 3), [L.GRU(4, dropout=0.5)])
  assert not fc.supports(model)
  with pytest.raises(ValueError, match="dropout"):
    fc.clipped_grad_sum(model, *data((6, 3), 3), mse, 1.0)


def test_registered_layers_with_dropout_layer_between():
  # Dropout as its own layer is fine: the forward runs once.
  keras.utils.set_random_seed(1)
  inp = keras.Input((5, 8))
  h = L.MultiHeadAttention(2, 4, dropout=0.3)(inp, inp)
  h = L.Dropout(0.5)(h)
  out = L.Dense(3)(L.Flatten()(h))
  model = keras.Model(inp, out)
  assert fc.supports(model) and fc.unregistered_layers(model) == []
  grads, norms = fc.clipped_grad_sum(model, *data((5, 8), 3), mse, 0.1)
  total = np.sqrt(sum(float(tf.reduce_sum(g * g)) for g in grads))
  assert total <= 0.1 * B * (1 + 1e-5) and norms.shape == (B,)


@pytest.mark.slow
def test_mirrored_strategy_sum_of_replicas_equals_single_device():
  # Needs a fresh process (two logical CPU devices are set before TF starts).
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = os.path.join(os.path.dirname(__file__), "mirrored_check.py")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  res = subprocess.run([sys.executable, script], capture_output=True,
                       text=True, timeout=900, check=False, env=env)
  last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
  assert res.returncode == 0 and last.startswith("OK"), (last, res.stderr[-2000:])


# ---------------------------------------------------------------------------
# Records of several examples (microbatches).


def check_records(reference_records, model, x, y, k, loss_fn=mse, mask=None):
  """reference_records: the per-record loop of conftest (fixture clip_reference)."""
  _, ref_norms = reference_records(model, x, y, loss_fn, 1.0, k, mask)
  clip = float(np.median(ref_norms[ref_norms > 0]))
  ref_grads, ref_norms = reference_records(model, x, y, loss_fn, clip, k, mask)
  for variant in VARIANTS:
    grads, norms = clipping.clipped_grad_sum(
        model, x, y, loss_fn, clip, mask=mask, variant=variant,
        examples_per_record=k)
    np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
    for g, r, v in zip(grads, ref_grads, model.trainable_variables):
      scale = max(1.0, float(np.max(np.abs(r))))
      np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * scale, rtol=1e-4,
                                 err_msg=f"{variant} {v.path}")


RECORD_CASES = [c for c in LAYER_CASES if c[0] in (
    "dense", "dense_seq", "einsum_seq", "conv1d_same_s2", "conv2d_same_s2",
    "conv2d_valid", "layernorm_seq")]


# The convolutions' forms x records of 2 and 3, pairwise (with the nightly tier; by default
# each form once, SLOW_CASES); the forms filter, depthwise and foldgram are the convolutions'
# alone (a Dense or EinsumDense takes its automatic form under them), so the other layers run
# the two forms they distinguish with both record sizes.
MICROBATCH_CASES = latin_pairs([c for c in RECORD_CASES if c[0].startswith("conv")],
                               [None, "gram", "filter", "depthwise", "foldgram"], [2, 3])
# The other layers: {layer} x {None, gram} x {2, 3}, by default pairwise (latin_pairs: each
# layer in both forms and at both record sizes), the rest of the product marked slow.
_OTHER_RECORD_GRID = [(c, f, k) for c in RECORD_CASES if not c[0].startswith("conv")
                      for f in (None, "gram") for k in (2, 3)]
_OTHER_RECORD_DEFAULT = latin_pairs([c for c in RECORD_CASES if not c[0].startswith("conv")],
                                    [None, "gram"], [2, 3])


def test_microbatch_cover_is_pairwise():
  assert_covers_pairs_of(_OTHER_RECORD_DEFAULT, _OTHER_RECORD_GRID)
  assert len(_OTHER_RECORD_DEFAULT) == len(_OTHER_RECORD_GRID) // 2


@pytest.mark.parametrize("case,form,k", [pytest.param(*c, id=f"{c[0][0]}-{c[1]}-{c[2]}")
                                         for c in MICROBATCH_CASES] + slow_outside(
    _OTHER_RECORD_GRID, _OTHER_RECORD_DEFAULT, ids=lambda c: f"{c[0][0]}-{c[1]}-{c[2]}"))
def test_microbatch_records_exact(case, form, k, monkeypatch, clip_reference):
  _, in_shape, make = case
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = seq_model(in_shape, make())
  rng = np.random.default_rng(3)
  x = tf.constant(rng.normal(size=(6,) + in_shape), tf.float32)
  y = tf.constant(rng.normal(size=(6, 3)), tf.float32)
  check_records(clip_reference, model, x, y, k)


@pytest.mark.parametrize("ids_shape", [(), (4,)])
def test_microbatch_embedding_exact(ids_shape, clip_reference):
  keras.utils.set_random_seed(1)
  inp = keras.Input(ids_shape, dtype="int32")
  h = L.Embedding(4, 3)(inp)
  h = L.Flatten()(h) if ids_shape else h
  model = keras.Model(inp, L.Dense(3)(h))
  rng = np.random.default_rng(0)
  x = tf.constant(rng.integers(0, 4, (6,) + ids_shape), tf.int32)
  y = tf.constant(rng.normal(size=(6, 3)), tf.float32)
  check_records(clip_reference, model, x, y, 2)


def test_microbatch_mixed_model_with_mask_exact(clip_reference):
  """Unregistered layers (vectorized) and a user norm function without
  microbatch support (vectorized under records) alongside ghost layers."""
  registry.register_layer(Hadamard, hadamard_norm_fn)
  keras.utils.set_random_seed(1)
  inp = keras.Input((6, 4))
  h = L.Dense(5, activation="tanh")(inp)
  h = ScaleShift()(h)
  h = Hadamard()(h)
  h = L.Conv1D(4, 3, padding="same")(h)
  out = L.Dense(2)(L.Flatten()(h))
  model = keras.Model(inp, out)
  rng = np.random.default_rng(4)
  x = tf.constant(rng.normal(size=(6, 6, 4)), tf.float32)
  y = tf.constant(rng.normal(size=(6, 2)), tf.float32)
  mask = np.array([1, 0, 1, 1, 0, 0], np.float32)  # last record is empty
  check_records(clip_reference, model, x, y, 3, mask=mask)
  check_records(clip_reference, model, x, y, 2, mask=mask)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_examples_per_record_raises(bad):
  model = seq_model((3,), [L.Dense(2)])
  x, y = data((3,), 3)
  with pytest.raises(ValueError, match="examples_per_record"):
    fc.clipped_grad_sum(model, x, y, mse, 1.0, examples_per_record=bad)


def test_batch_not_multiple_of_record_size_raises():
  model = seq_model((3,), [L.Dense(2)])
  x, y = data((3,), 3)  # B = 5
  with pytest.raises(ValueError, match="examples_per_record=2"):
    fc.clipped_grad_sum(model, x, y, mse, 1.0, examples_per_record=2)


def test_return_outputs_are_the_training_forward():
  model = seq_model((3,), [L.Dense(2, activation="tanh")])
  x, y = data((3,), 3)
  _, norms, outputs, losses = fc.clipped_grad_sum(model, x, y, mse, 1.0,
                                                  return_outputs=True)
  np.testing.assert_allclose(outputs.numpy(), model(x).numpy(), rtol=1e-6)
  np.testing.assert_allclose(losses.numpy(), mse(y, model(x)).numpy(), rtol=1e-6)
  assert norms.shape == (B,)


def test_clip_factors_fn_gives_the_queries_clipping():
  """The factors of a DPQuery (record_clip_factors) clip as l2_norm_clip does; a query that
  clips at S / 2 gives the sum at S / 2."""
  from tf_dpiter import dp_query  # pylint: disable=g-import-not-at-top
  model = seq_model((7,), [L.Dense(5)])
  x, y = data((7,), 3)
  query = dp_query.GaussianSumQuery(0.2, 0.0)
  want, want_norms = fc.clipped_grad_sum(model, x, y, mse, 0.1)
  got, norms = fc.clipped_grad_sum(
      model, x, y, mse, clip_factors_fn=lambda n: query.record_clip_factors(0.1, n))
  np.testing.assert_array_equal(norms, want_norms)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("kwargs,error", [
    ({}, ValueError), ({"l2_norm_clip": 1.0, "clip_factors_fn": lambda n: n}, ValueError),
    ({"clip_factors_fn": 1.0}, TypeError)], ids=["neither", "both", "not_callable"])
def test_clip_factors_fn_or_clip_required(kwargs, error):
  model = seq_model((7,), [L.Dense(5)])
  with pytest.raises(error, match="clip_factors_fn"):
    fc.clipped_grad_sum(model, *data((7,), 3), mse, **kwargs)
