"""The reference models of the tutorials and benchmarks, defined once.

`mnist_cnn_layers`: the CNN of TF Privacy's MNIST tutorial (conv 16x8x8/2, max-pool 2/1,
conv 32x4x4/2, max-pool 2/1, dense 32, dense 10 logits). `mlp_layers`: 784-512-10.
`transformer_encoder`: Embedding 10k x 128, 2 blocks of MultiHeadAttention + LayerNorm + Dense.
Layers are returned as lists so callers wrap them in `keras.Sequential` or `DPSequential`.
"""

import keras


def mnist_cnn_layers():
  """The layers of TF Privacy's MNIST tutorial CNN (module docstring), 28x28x1 -> 10 logits.

  Returns:
    a list of keras layers, starting with keras.Input((28, 28, 1)).
  """
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
  """The layers of a 784-hidden-10 MLP (ReLU, 10 logits).

  Args:
    hidden: width of the hidden layer.

  Returns:
    a list of keras layers, starting with keras.Input((784,)).
  """
  return [keras.Input((784,)), keras.layers.Dense(hidden, activation="relu"),
          keras.layers.Dense(10)]


def transformer_encoder(vocab_size=10000, seq_len=128, width=128, heads=4, blocks=2,
                        num_classes=2):
  """Functional Transformer encoder classifier (mean-pooled, no position embedding).

  Args:
    vocab_size, seq_len: token ids in [0, vocab_size), sequences of seq_len.
    width, heads, blocks: model width, attention heads per block, encoder blocks.
    num_classes: logits out.

  Returns:
    a keras.Model (int32 [B, seq_len] -> [B, num_classes]).
  """
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
