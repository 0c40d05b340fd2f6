"""Exactness of the ghost norms of Keras 3's built-in LoRA (rules/lora.py).

`layer.enable_lora(r)` on Dense, EinsumDense and Embedding freezes the kernel
and trains A and B of W0 + (alpha / r) A B. Each case compares the fast clipped
sum (book-keeping and two-pass) with the per-record loop of conftest.py (each
record's gradient from its own tape, clipped in float64): per-example, with a
padding mask, and with records of 2 examples. B is set to random values
(Keras initializes it to 0, which would make grad A vanish). Tolerances:
float32 round-off, as in test_fast_clipping.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry

# Nightly tier (-m slow): records and mask, each layer once by default ([embedding_seq-2-mask2],
# [einsum_heads-1-mask0], [dense_seq-2-mask2]: records of 1 and 2, both masked); each layer's
# exactness without records stays in test_lora_layer_exact.
SLOW_CASES = {"test_lora_records_and_mask_exact[embedding_seq-1-mask0]",
              "test_lora_records_and_mask_exact[einsum_heads-2-mask2]",
              "test_lora_records_and_mask_exact[dense_seq-1-mask0]"}

L = keras.layers
N = 6


def mse(y_true, y_pred):
  y_pred = tf.reshape(y_pred, [tf.shape(y_pred)[0], -1])
  return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)


def enable_lora(layer, rank=2, alpha=None, train_base=False, seed=0):
  """Keras' enable_lora, then a random B (and optionally W0 trainable again)."""
  layer.enable_lora(rank, lora_alpha=alpha)
  rng = np.random.default_rng(seed)
  for v in layer.trainable_variables:
    if v.path.endswith("_b"):
      v.assign(rng.normal(size=v.shape).astype("float32"))
  if train_base:
    base = layer._kernel if hasattr(layer, "_kernel") else layer._embeddings  # pylint: disable=protected-access
    base.trainable = True


def check_exact(reference, model, x, y, k=1, mask=None, variants=("bookkeeping", "two_pass")):
  """Fast clipped sum == per-record loop (norms and every variable's sum); `reference` is
  conftest's per-record loop (fixture clip_reference)."""
  memo = {}   # each record's loop gradient once for both calls
  _, ref_norms = reference(model, x, y, mse, 1.0, k, mask, memo=memo)
  clip = float(np.median(ref_norms[ref_norms > 0]))   # some records clipped, some not
  ref_grads, ref_norms = reference(model, x, y, mse, clip, k, mask, memo=memo)
  for variant in variants:
    grads, norms = clipping.clipped_grad_sum(
        model, x, y, mse, clip, mask=mask, variant=variant, examples_per_record=k)
    np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
    for g, r, v in zip(grads, ref_grads, model.trainable_variables):
      scale = max(1.0, float(np.max(np.abs(r))))
      np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * scale, rtol=1e-4,
                                 err_msg=f"{variant} {v.path}")


def lora_model(in_shape, make, dtype="float32", **lora_kw):
  """Input -> LoRA layer -> [Flatten] -> Dense(3) (trainable head)."""
  keras.utils.set_random_seed(1)
  inp = keras.Input(in_shape, dtype=dtype)
  layer = make()
  h = layer(inp)
  h = L.Flatten()(h) if len(h.shape) > 2 else h
  model = keras.Model(inp, L.Dense(3)(h))
  enable_lora(layer, **lora_kw)
  return model, layer


CASES = [
    ("dense", (7,), lambda: L.Dense(5, activation="tanh"), {}),
    ("dense_seq", (4, 7), lambda: L.Dense(5, activation="tanh"), {}),
    ("dense_seq_alpha_nobias", (4, 7), lambda: L.Dense(5, use_bias=False),
     {"rank": 3, "alpha": 7}),
    ("dense_seq_base_trainable", (4, 7), lambda: L.Dense(5), {"train_base": True}),
    ("einsum", (7,), lambda: L.EinsumDense("ab,bc->ac", 4, bias_axes="c"), {}),
    ("einsum_heads", (4, 6), lambda: L.EinsumDense("abc,cde->abde", (4, 2, 3),
                                                   bias_axes="de"), {}),
    ("einsum_merge_heads", (4, 2, 3), lambda: L.EinsumDense("abcd,cde->abe", (4, 5),
                                                            bias_axes="e"),
     {"train_base": True}),
    ("embedding_seq", (6,), lambda: L.Embedding(4, 3), {}),    # vocabulary 4 < 6: repeats
    ("embedding_scalar", (), lambda: L.Embedding(5, 3), {"rank": 1}),
    ("embedding_base_trainable", (6,), lambda: L.Embedding(4, 3), {"train_base": True}),
]


def _data(in_shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  if dtype == "int32":
    x = tf.constant(rng.integers(0, 4, (N,) + in_shape), tf.int32)
  else:
    x = tf.constant(rng.normal(size=(N,) + in_shape), tf.float32)
  return x, tf.constant(rng.normal(size=(N, 3)), tf.float32)


# None: the direct form at these sizes; the Gram form in the slow suite.
@pytest.mark.parametrize("form", [None, pytest.param("gram", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lora_layer_exact(case, form, monkeypatch, clip_reference):
  name, in_shape, make, kw = case
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  dtype = "int32" if name.startswith("embedding") else "float32"
  model, layer = lora_model(in_shape, make, dtype, **kw)
  assert layer.lora_enabled and fc.unregistered_layers(model) == []
  trainable = {v.path.split("/")[-1] for v in layer.trainable_variables}
  assert {"lora_kernel_a", "lora_kernel_b"} <= trainable or \
         {"lora_embeddings_a", "lora_embeddings_b"} <= trainable
  x, y = _data(in_shape, dtype)
  check_exact(clip_reference, model, x, y)


@pytest.mark.parametrize("k,mask", [(1, [1, 0, 1, 1, 0, 1]),
                                    pytest.param(2, None, marks=pytest.mark.slow),
                                    (2, [1, 0, 0, 0, 1, 1])])
@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[7]], ids=lambda c: c[0])
def test_lora_records_and_mask_exact(case, k, mask, clip_reference):
  name, in_shape, make, kw = case
  dtype = "int32" if name.startswith("embedding") else "float32"
  model, _ = lora_model(in_shape, make, dtype, **kw)
  x, y = _data(in_shape, dtype, seed=2)
  check_exact(clip_reference, model, x, y, k=k,
              mask=None if mask is None else np.asarray(mask, np.float32))


def test_lora_only_adapters_trainable_in_attention_block(clip_reference):
  """LoRA on the query/value EinsumDense of a MultiHeadAttention, everything
  else frozen except the head (the usual LoRA fine-tuning set-up)."""
  keras.utils.set_random_seed(1)
  inp = keras.Input((4, 6))
  mha = L.MultiHeadAttention(2, 3)
  h = L.LayerNormalization()(inp + mha(inp, inp))
  head = L.Dense(3)
  model = keras.Model(inp, head(L.Flatten()(h)))
  for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
    if not list(layer._flatten_layers(include_self=False)):  # pylint: disable=protected-access
      layer.trainable = False        # leaf layers only: the parents stay trainable
  head.trainable = True
  for sub in (mha.query_dense, mha.value_dense):
    sub.trainable = True
    enable_lora(sub, rank=2)
  assert fc.unregistered_layers(model) == []
  assert len(model.trainable_variables) == 2 + 2 * 3    # head + (A, B, bias) x 2
  x, y = _data((4, 6), "float32", seed=4)
  check_exact(clip_reference, model, x, y)


@pytest.fixture
def mixed_bfloat16():
  keras.config.set_dtype_policy("mixed_bfloat16")
  yield
  keras.config.set_dtype_policy("float32")


def test_lora_under_mixed_bfloat16_keeps_the_fast_path(mixed_bfloat16):  # pylint: disable=redefined-outer-name,unused-argument
  """16-bit compute: the LoRA rules' float32 recomputation serves the clipped sum
  (registry.float32_watched); the norms match a per-example loop through the same
  16-bit model to bfloat16 round-off (4 * 2^-8 relative, as test_dtype_policies_fast)."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((4,), dtype="int32")
  layers = [L.Embedding(9, 6), L.Dense(5), L.EinsumDense("abc,cd->abd", (4, 3), bias_axes="d")]
  h = inp
  for layer in layers:
    h = layer(h)
  model = keras.Model(inp, L.Dense(2)(L.Flatten()(h)))
  for layer in layers:
    enable_lora(layer)
  assert fc.unregistered_layers(model) == []
  rng = np.random.default_rng(0)
  x = tf.constant(rng.integers(0, 9, (N, 4)), tf.int32)
  y = tf.constant(rng.normal(size=(N, 2)), tf.float32)
  loss = lambda a, b: mse(a, tf.cast(b, tf.float32))
  grads, norms = fc.clipped_grad_sum(model, x, y, loss, 1.0)
  assert all(g.dtype == tf.float32 for g in grads)
  ref = []
  for i in range(N):
    with tf.GradientTape() as tape:
      li = loss(y[i:i + 1], model(x[i:i + 1], training=True))[0]
    ref.append(np.sqrt(sum(np.sum(np.square(np.asarray(tf.cast(g, tf.float32))))
                           for g in tape.gradient(li, model.trainable_variables))))
  np.testing.assert_allclose(norms.numpy(), ref, rtol=4 * 2.0 ** -8)
