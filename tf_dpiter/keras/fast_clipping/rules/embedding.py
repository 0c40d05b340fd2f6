"""Ghost norm of Embedding.

z_t = E[id_t]; grad E_i = sum_t e_{id_t} dz_t^T, so
||grad E_i||^2 = sum_{t,s} [id_t == id_s] <dz_t, dz_s> (repeated ids add up).
"""

import tensorflow as tf
from keras import ops

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import tables


@registry.float32_watched
@registry.supports_records
def embedding_norm_fn(layer, inputs):
  """Norm function (registry contract) of keras.layers.Embedding.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  if not algebra.plain_layer(layer):
    return None
  ids = inputs
  if ids.dtype not in (tf.int32, tf.int64):
    ids = tf.cast(ids, tf.int32)
  z = tf.gather(layer.embeddings, ids)
  outputs = ops.cast(z, layer.compute_dtype)

  def sqr_norm_fn(dz):
    return tables.same_id_sqr_norm(tables.flat_ids(ids), algebra.to_btk(dz))

  return outputs, z, sqr_norm_fn
