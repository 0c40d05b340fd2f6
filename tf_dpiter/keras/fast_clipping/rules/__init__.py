"""Built-in ghost-norm rules, one module per layer family (registry contract in
fast_clipping/registry.py). Importing this package registers them; the keras_hub
rules (rules/keras_hub.py) are registered by its hook on registry.lookup once keras_hub's
modules are imported (keras_hub is not a dependency)."""

import keras

from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import keras_hub  # installs its lookup hook
from tf_dpiter.keras.fast_clipping.rules import lora
from tf_dpiter.keras.fast_clipping.rules import normalization
from tf_dpiter.keras.fast_clipping.rules import recurrent
from tf_dpiter.keras.fast_clipping.rules import reversible_embedding

BUILT_IN = {
    keras.layers.Dense: lora.dense_norm_fn,           # with or without LoRA
    keras.layers.EinsumDense: lora.einsum_dense_norm_fn,
    keras.layers.Embedding: lora.embedding_norm_fn,
    keras.layers.ReversibleEmbedding: reversible_embedding.reversible_embedding_norm_fn,
    keras.layers.Conv1D: conv.conv1d_norm_fn,
    keras.layers.Conv2D: conv.conv2d_norm_fn,
    keras.layers.LayerNormalization: normalization.layer_norm_norm_fn,
    keras.layers.SimpleRNN: recurrent.recurrent_norm_fn,
    keras.layers.LSTM: recurrent.recurrent_norm_fn,
    keras.layers.GRU: recurrent.recurrent_norm_fn,
}

for _cls, _fn in BUILT_IN.items():
  registry.register_layer(_cls, _fn)
