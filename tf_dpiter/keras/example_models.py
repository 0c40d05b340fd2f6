"""The reference models of the tutorials and benchmarks, defined once.

`mnist_cnn_layers`: the CNN of TF Privacy's MNIST tutorial (conv 16x8x8/2, max-pool 2/1,
conv 32x4x4/2, max-pool 2/1, dense 32, dense 10 logits). `mlp_layers`: 784-512-10.
`transformer_encoder`: Embedding 10k x 128, 2 blocks of MultiHeadAttention + LayerNorm + Dense.
Layers are returned as lists so callers wrap them in `keras.Sequential` or `DPSequential`.
"""

import keras


def mnist_cnn_layers():
  L = keras.layers
  return [keras.Input((28, 28, 1)),
          L.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
          L.MaxPooling2D(2, 1),
          L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
          L.MaxPooling2D(2, 1),
          L.Flatten(),
          L.Dense(32, activation="relu"),
          L.Dense(10)]


def mlp_layers(hidden=512):
  return [keras.Input((784,)), keras.layers.Dense(hidden, activation="relu"),
          keras.layers.Dense(10)]


def transformer_encoder(vocab_size=10000, seq_len=128, width=128, heads=4, blocks=2,
                        num_classes=2):
  """Functional Transformer encoder classifier (mean-pooled, no position embedding)."""
  L = keras.layers
  ids = keras.Input((seq_len,), dtype="int32")
  h = L.Embedding(vocab_size, width)(ids)
  for _ in range(blocks):
    a = L.MultiHeadAttention(num_heads=heads, key_dim=width // heads)(h, h)
    h = L.LayerNormalization()(h + a)
    f = L.Dense(2 * width, activation="relu")(h)
    f = L.Dense(width)(f)
    h = L.LayerNormalization()(h + f)
  out = L.Dense(num_classes)(L.GlobalAveragePooling1D()(h))
  return keras.Model(ids, out)
