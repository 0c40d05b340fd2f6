"""keras_hub's BERT and Gemma take the fast path under `clipping="auto"`, exactly.

The keras_hub layers they are made of (TransformerEncoder; GemmaDecoderBlock,
CachedGemmaAttention, Gemma's RMSNormalization, RotaryEmbedding) are on the allowlist of
layers known to act per example (tf_dpiter/keras/internals/per_example.py, each read in
keras_hub's source). A BertTextClassifier and a GemmaCausalLM from tiny configs (no
download, no preprocessor), made private in place, route to "fast", and one real
`train_on_batch` step (noise 0, SGD lr 1, normalize=False, Poisson padding masked out) moves
the weights by the clipped sum of an independent per-example loop (each example run alone).
A task's preprocessor (not in its graph) does not decide the path. The allowlist stays
narrow: a subclass, a user's activation, a rotary embedding along the
batch axis and a keras_hub version not read are not known. Skipped without keras_hub
(`pip install -e ".[test]"` installs it).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.keras.internals import per_example

hub = pytest.importorskip("keras_hub", reason="keras_hub is not installed (pip install -e "
                          "'.[test]' installs it)")

V, T, REAL, PAD, CLIP = 11, 5, 5, 1, 0.05
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _bert():
  keras.utils.set_random_seed(1)
  backbone = hub.models.BertBackbone(vocabulary_size=V, num_layers=1, num_heads=2,
                                     hidden_dim=4, intermediate_dim=8,
                                     max_sequence_length=T, dropout=0.0)
  # compile=False: the test compiles it with its own DP optimizer (a task compiled by
  # keras_hub needs make_private(task, l2_norm_clip=..., noise_multiplier=...) instead)
  return hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None,
                                       dropout=0.0, compile=False)


def _gemma():
  keras.utils.set_random_seed(1)
  backbone = hub.models.GemmaBackbone(vocabulary_size=V, num_layers=1, num_query_heads=2,
                                      num_key_value_heads=1, hidden_dim=8,
                                      intermediate_dim=16, head_dim=4)
  return hub.models.GemmaCausalLM(backbone, preprocessor=None, compile=False)


def _decoder():
  """GPT-2's pieces: TokenAndPositionEmbedding (its mask from token 0) -> TransformerDecoder
  (causal self-attention, CachedMultiHeadAttention) -> pooled -> Dense."""
  keras.utils.set_random_seed(1)
  ids = keras.Input((T,), dtype="int32")
  h = hub.layers.TokenAndPositionEmbedding(V, T, 4, mask_zero=True)(ids)
  h = hub.layers.TransformerDecoder(8, 2, normalize_first=True)(h)
  return keras.Model(ids, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


MODELS = {"bert": _bert, "gemma": _gemma, "decoder": _decoder}


def _batch(kind, rng):
  """Inputs and labels: REAL examples and PAD zero rows; the mask 1 on the real ones."""
  b = REAL + PAD
  lengths = rng.randint(2, T + 1, b)
  padding = (np.arange(T)[None] < lengths[:, None]).astype("int32")
  ids = rng.randint(1, V, (b, T)).astype("int32") * padding
  x = {"token_ids": ids, "padding_mask": padding}
  y = rng.randint(0, 3, b).astype("int64")
  if kind == "bert":
    x["segment_ids"] = rng.randint(0, 2, (b, T)).astype("int32")
  elif kind == "gemma":   # next-token labels
    y = np.concatenate([ids[:, 1:], np.zeros((b, 1), "int32")], axis=1).astype("int64")
  else:
    x = ids
  mask = np.r_[np.ones(REAL), np.zeros(PAD)].astype("float32")
  return x, y, mask


@pytest.mark.filterwarnings("ignore:Layer .* does not support masking")
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_keras_hub_model_routes_fast_and_is_exact(kind):
  model = dp.keras.make_private(MODELS[kind]())
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, normalize=False)
  model.compile(optimizer=opt, loss=LOSS)   # clipping="auto", the default
  opt.set_sampling(1000, REAL / 1000, "poisson", REAL + PAD)
  assert per_example.undeclared_layers(model) == ()
  x, y, mask = _batch(kind, np.random.RandomState(0))
  # as the train step asks (its batch gives the probe the sequence length the inputs leave
  # open)
  assert opt.resolve_clipping(model, input_specs=x) == "fast"
  w0 = [np.array(v) for v in model.trainable_variables]
  model.train_on_batch(x, y, sample_weight=mask)
  step = np.concatenate([(a - np.array(v)).ravel()
                         for a, v in zip(w0, model.trainable_variables)])
  for v, w in zip(model.trainable_variables, w0):
    v.assign(w)
  real = tf.nest.map_structure(lambda a: tf.constant(a[:REAL]), x)
  ref = helpers.reference_gradient(model, LOSS, real, tf.constant(y[:REAL]), clip=CLIP)
  ref = REAL * np.concatenate([r.ravel() for r in ref])
  assert np.linalg.norm(ref) > CLIP          # several examples are clipped, some cancel
  np.testing.assert_allclose(step, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_a_tasks_preprocessor_does_not_decide_the_path():
  # the preprocessor is tracked by the task but not in its graph: it makes the batch both
  # paths get (tokenizing in the data pipeline), the model's call never runs it
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat"]
  pre = hub.models.BertTextClassifierPreprocessor(hub.models.BertTokenizer(vocabulary=vocab),
                                                  sequence_length=T)
  model = _bert()
  model.preprocessor = pre
  assert pre in model._flatten_layers()   # pylint: disable=protected-access
  assert per_example.undeclared_layers(model) == ()


def _encoder_model(encoder):
  inp = keras.Input((T, 4))
  return keras.Model(inp, keras.layers.Dense(2)(encoder(inp)))


def test_the_keras_hub_allowlist_is_narrow(monkeypatch):
  ok = _encoder_model(hub.layers.TransformerEncoder(8, 2, name="enc"))
  assert per_example.undeclared_layers(ok) == ()

  class MyEncoder(hub.layers.TransformerEncoder):   # a subclass may change `call`
    pass

  assert per_example.undeclared_layers(_encoder_model(MyEncoder(8, 2, name="enc"))) == (
      "enc",)
  own = _encoder_model(hub.layers.TransformerEncoder(8, 2, activation=lambda t: t, name="enc"))
  assert per_example.undeclared_layers(own) == ("enc",)   # a user's activation
  inp = keras.Input((T, 2, 4))
  rope = hub.layers.RotaryEmbedding(sequence_axis=0, feature_axis=-1, name="rope")
  assert per_example.undeclared_layers(keras.Model(inp, rope(inp))) == ("rope",)
  rope = hub.layers.RotaryEmbedding(sequence_axis=1, feature_axis=-1, name="rope")
  assert per_example.undeclared_layers(keras.Model(inp, rope(inp))) == ()
  # a keras_hub version whose source was not read: its layers are not known
  monkeypatch.setattr(hub.src.version, "__version__", "0.33.0")
  assert per_example.undeclared_layers(ok) == ("enc",)
