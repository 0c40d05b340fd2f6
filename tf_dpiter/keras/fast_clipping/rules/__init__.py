"""Built-in ghost-norm rules, one module per layer family (registry contract in
fast_clipping/registry.py). Importing this package registers them."""

import keras

from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import dense
from tf_dpiter.keras.fast_clipping.rules import embedding
from tf_dpiter.keras.fast_clipping.rules import normalization
from tf_dpiter.keras.fast_clipping.rules import recurrent

BUILT_IN = {
    keras.layers.Dense: dense.dense_norm_fn,
    keras.layers.EinsumDense: dense.einsum_dense_norm_fn,
    keras.layers.Embedding: embedding.embedding_norm_fn,
    keras.layers.Conv1D: conv.conv1d_norm_fn,
    keras.layers.Conv2D: conv.conv2d_norm_fn,
    keras.layers.LayerNormalization: normalization.layer_norm_norm_fn,
    keras.layers.SimpleRNN: recurrent.recurrent_norm_fn,
    keras.layers.LSTM: recurrent.recurrent_norm_fn,
    keras.layers.GRU: recurrent.recurrent_norm_fn,
}

for _cls, _fn in BUILT_IN.items():
  registry.register_layer(_cls, _fn)
