"""Exactness of the ghost norms of ReversibleEmbedding and PositionEmbedding
(rules/reversible_embedding.py, rules/keras_hub.py), and the neighbouring-batch
check of the real train step on a small model built from them.

keras.layers.ReversibleEmbedding is Keras' own (keras_hub's is a subclass with the
same call). keras_hub.layers.PositionEmbedding is reproduced here by
`PositionTable` (the same computation, registered with the keras_hub rule), so
these tests need no keras_hub; the ones at the end use the real keras_hub
classes and skip when keras_hub is not importable.

Each exactness case compares the fast clipped sum (book-keeping and two-pass)
with the per-record loop of conftest.py (float64), per example, with a padding
mask and with records of 2 examples; tolerances are float32 round-off.
"""

import keras
from keras import ops
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import keras_hub as hub_rules
from tests.fast_clipping.test_lora_rules import check_exact

L = keras.layers
N, T, V, D = 6, 5, 7, 4       # examples, positions, vocabulary (< T * N: repeats), width


class PositionTable(L.Layer):
  """keras_hub.layers.PositionEmbedding's forward: P[start:start+T] (or P[positions])
  broadcast to the input's shape."""

  def __init__(self, sequence_length, **kwargs):
    super().__init__(**kwargs)
    self.sequence_length = sequence_length

  def build(self, shape):
    self.position_embeddings = self.add_weight(
        shape=(self.sequence_length, shape[-1]), initializer="glorot_uniform",
        name="embeddings")

  def call(self, inputs, start_index=0, positions=None):
    shape = ops.shape(inputs)
    table = ops.convert_to_tensor(self.position_embeddings)
    if positions is None:
      rows = ops.slice(table, (start_index, 0), (shape[-2], shape[-1]))
    else:
      rows = ops.take(table, positions if len(positions.shape) > 1 else positions[None],
                      axis=0)
    return ops.broadcast_to(rows, shape)


registry.register_layer(PositionTable, hub_rules.position_embedding_norm_fn)
# keras_hub's own PositionEmbedding is known to act per example; this stand-in is declared so.
dp.keras.declare_per_example(
    PositionTable, "each example gets the table's rows for its positions, broadcast to its "
    "own shape; no statistic of the batch and no state across calls")


def _head(h):
  return L.Dense(3)(L.Flatten()(h) if len(h.shape) > 2 else h)


def token_model(kind):
  """Models on token ids [N, T] (or ids and positions stacked as [N, 2, T])."""
  keras.utils.set_random_seed(1)
  tok = L.ReversibleEmbedding(V, D, tie_weights=not kind.startswith("untied"),
                              mask_zero=kind == "mask_zero")
  if kind == "positions":
    inp = keras.Input((2, T), dtype="int32")
    h = tok(inp[:, 0])
    h = h + PositionTable(T + 2)(h, positions=inp[:, 1])
    return keras.Model(inp, _head(L.LayerNormalization()(h)))
  inp = keras.Input((T,), dtype="int32")
  h = tok(inp)
  if kind == "mask_zero":       # the mask reaches the pooling: padding is ignored
    return keras.Model(inp, _head(L.GlobalAveragePooling1D()(h)))
  if kind in ("lm", "untied_lm"):   # lookup and output projection (tied: one weight twice)
    h = L.Dense(D, activation="tanh")(h)
    return keras.Model(inp, _head(tok(h, reverse=True)))
  h = h + PositionTable(T + 3)(h, start_index=2 if kind == "start2" else 0)
  if kind == "lora":
    tok.enable_lora(2)
    tok.lora_embeddings_b.assign(np.random.default_rng(0).normal(size=(2, D)))
  return keras.Model(inp, _head(L.LayerNormalization()(h)))


def _ids(kind, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, (N, T))
  if kind == "positions":   # per-example positions with repeats
    ids = np.stack([ids, rng.integers(0, T + 2, (N, T))], axis=1)
  return tf.constant(ids, tf.int32), tf.constant(rng.normal(size=(N, 3)), tf.float32)


KINDS = ["tied", pytest.param("untied", marks=pytest.mark.slow),
         pytest.param("start2", marks=pytest.mark.slow), "positions", "mask_zero", "lm",
         pytest.param("untied_lm", marks=pytest.mark.slow), "lora"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_and_position_embedding_exact(kind, clip_reference):
  model = token_model(kind)
  assert fc.unregistered_layers(model) == []
  x, y = _ids(kind)
  # "untied" without the reverse call leaves reverse_embeddings unused: its sum is 0
  check_exact(clip_reference, model, x, y, variants=("bookkeeping", "two_pass"))


@pytest.mark.parametrize("k,mask", [(1, [1, 1, 0, 1, 0, 1]), (2, [1, 0, 1, 1, 0, 0])])
@pytest.mark.parametrize("kind", [pytest.param("tied", marks=pytest.mark.slow), "positions"])
def test_token_and_position_embedding_records_and_mask_exact(kind, k, mask, clip_reference):
  model = token_model(kind)
  x, y = _ids(kind, seed=1)
  check_exact(clip_reference, model, x, y, k=k, mask=np.asarray(mask, np.float32))


@pytest.mark.parametrize("soft_cap,tied", [(None, True), (2.0, True),
                                           pytest.param(None, False, marks=pytest.mark.slow)])
def test_reverse_projection_exact(soft_cap, tied, clip_reference):
  keras.utils.set_random_seed(1)
  inp = keras.Input((T, D))
  rev = L.ReversibleEmbedding(V, D, tie_weights=tied, logit_soft_cap=soft_cap)
  rev.build()
  model = keras.Model(inp, _head(rev(inp, reverse=True)))
  assert fc.unregistered_layers(model) == []
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(N, T, D)), tf.float32)
  # untied: the embeddings are unused here (their clipped sum is 0 on both variants)
  check_exact(clip_reference, model, x, tf.constant(rng.normal(size=(N, 3)), tf.float32),
              variants=("bookkeeping", "two_pass"))


def test_position_table_on_rank_4_input(clip_reference):
  keras.utils.set_random_seed(1)
  inp = keras.Input((2, T, D))
  h = inp + PositionTable(T)(inp)
  model = keras.Model(inp, _head(L.Dense(2)(h)))
  assert fc.unregistered_layers(model) == []
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(N, 2, T, D)), tf.float32)
  check_exact(clip_reference, model, x, tf.constant(rng.normal(size=(N, 3)), tf.float32))


# --- neighbouring batches through the real train step -----------------------------------
# Relation: add/remove one example (Poisson); the ledger records sensitivity C. With noise
# 0, SGD lr 1 and normalize=False the weight change of one train_on_batch is the clipped
# sum, so removing or adding one example (mask 0/1, as the Poisson sampler pads) may move
# it by at most C.
CLIP, PAD = 1.0, 1
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dp_model(lora):
  keras.utils.set_random_seed(0)
  inp = keras.Input((T,), dtype="int32")
  tok = L.ReversibleEmbedding(V, D)
  h = tok(inp)
  h = L.LayerNormalization()(h + PositionTable(T)(h))
  mid = L.Dense(D, activation="tanh")
  out = L.Dense(3)(L.GlobalAveragePooling1D()(mid(h)))
  model = dp.keras.DPModel(inp, out)
  if lora:
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
      layer.trainable = layer is mid
    mid.enable_lora(2)
    mid.lora_kernel_b.assign(np.random.RandomState(0).randn(2, D).astype("float32") * 3)
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, clipping="fast",
                                     normalize=False)
  model.compile(optimizer=opt, loss=LOSS)
  opt.set_sampling(1000, 6 / 1000, "poisson", 6 + PAD)
  assert opt.resolve_clipping(model) == "fast" and fc.unregistered_layers(model) == []
  return model


def _step_change(model, w0, x, y, mask):
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=mask)
  return np.concatenate([(a - b).ravel() for a, b in zip(w0, model.get_weights())])


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_train_step_neighbours_within_clip(lora):
  model = _dp_model(lora)
  rng = np.random.RandomState(0)
  b = 6
  x = rng.randint(0, V, (b + PAD, T)).astype("int32")
  y = rng.randint(0, 3, b + PAD)
  mask = np.r_[np.ones(b), np.zeros(PAD)].astype("float32")
  w0 = [np.array(w) for w in model.get_weights()]
  base = _step_change(model, w0, x, y, mask)
  assert np.linalg.norm(base) > CLIP      # several examples are clipped
  changes = []
  for j in range(b):                      # remove one
    m2 = mask.copy()
    m2[j] = 0.0
    changes.append(np.linalg.norm(_step_change(model, w0, x, y, m2) - base))
  for _ in range(4):                      # add one (random or repeated tokens)
    x2, y2, m2 = x.copy(), y.copy(), mask.copy()
    x2[b] = rng.randint(0, V, T) if rng.rand() < 0.5 else np.full(T, rng.randint(V))
    y2[b], m2[b] = rng.randint(3), 1.0
    changes.append(np.linalg.norm(_step_change(model, w0, x2, y2, m2) - base))
  assert max(changes) <= CLIP * (1 + 1e-5), changes
  assert max(changes) > 0.5 * CLIP        # the bound is nearly reached: a real check


# --- keras_hub itself (skipped without it) -----------------------------------------------

def _keras_hub():
  return pytest.importorskip(
      "keras_hub", reason="keras_hub is not installed (not a dependency of tf_dpiter; "
      "pip install -e '.[test]' installs it)")


def test_keras_hub_layers_are_registered_once_imported():
  hub = _keras_hub()
  emb = hub.layers.ReversibleEmbedding(V, D)
  pos = hub.layers.PositionEmbedding(T)
  assert registry.lookup(emb) is not None and registry.lookup(pos) is not None
  assert registry.lookup(pos) is hub_rules.position_embedding_norm_fn


def test_keras_hub_bert_backbone_exact(clip_reference):
  hub = _keras_hub()
  keras.utils.set_random_seed(1)
  backbone = hub.models.BertBackbone(vocabulary_size=V, num_layers=1, num_heads=2,
                                     hidden_dim=D, intermediate_dim=8,
                                     max_sequence_length=T + 2, dropout=0.0)
  inp = keras.Input((3, T), dtype="int32")          # token ids, segment ids, padding mask
  feats = backbone({"token_ids": inp[:, 0], "segment_ids": inp[:, 1],
                    "padding_mask": inp[:, 2]})
  model = keras.Model(inp, L.Dense(3)(feats["pooled_output"]))
  assert fc.unregistered_layers(model) == []
  rng = np.random.default_rng(0)
  ids = rng.integers(1, V, (N, T))
  padding = (np.arange(T)[None] < rng.integers(2, T + 1, (N, 1))).astype(int)
  x = tf.constant(np.stack([ids * padding, rng.integers(0, 2, (N, T)), padding], 1), tf.int32)
  check_exact(clip_reference, model, x, tf.constant(rng.normal(size=(N, 3)), tf.float32))
