"""Ghost norm of keras.layers.ReversibleEmbedding (Keras 3; keras_hub's
ReversibleEmbedding is a subclass with the same `call`, so it inherits the rule).

One call is either the lookup (reverse=False): z_t = E[id_t], the Embedding
rule (or the LoRA embedding rule), or the reverse projection (reverse=True):
logits = h E^T (tied) or h R (untied, R: [D, V]), then an optional soft cap
c tanh(logits / c). The reverse call's per-example gradient is
G_i = sum_t dlogits_t h_t^T (of E, or its transpose for R), a factored product:

    ||G_i||^2 = sum_{t,s} <h_t, h_s><dlogits_t, dlogits_s>    (Gram form, V large)

A tied layer called both ways in one forward pass (a language model whose
output layer is its input embedding, Press & Wolf 2017) has the per-example
gradient G_i^lookup + G_i^reverse, whose norm needs the cross term: the
fast-clipping plan gives a unit called more than once exact per-example
gradients for that layer alone (clipping.vectorized_grads per call, summed
per example before the norm), so the two calls are never normed separately.
"""

import tensorflow as tf
from keras import ops
from keras.src import backend as keras_backend  # set_keras_mask (no public alias)

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import lora


def _untied(layer, res, used, sum_used):
  """An untied layer's call uses one of its two variables: its clipped sum is
  formed by the rule (registry.GhostSums; sum_used(weighted watched grads)), the
  other variable's is 0."""
  outputs, watched, sqr_norm_fn = res

  def sqr_norm_and_sum_fn(dw):
    def sum_fn(weighted):
      return [tf.cast(sum_used(weighted), tf.float32) if v is used else
              tf.zeros(v.shape, tf.float32) for v in layer.trainable_variables]
    return registry.GhostSums(sqr_norm_fn(dw), sum_fn)

  return outputs, watched, sqr_norm_and_sum_fn


def _lookup(layer, inputs):
  """The lookup call: the (LoRA) Embedding rule, plus the padding mask that
  ReversibleEmbedding.call attaches when mask_zero is set."""
  if getattr(layer, "lora_enabled", False) and not layer.tie_weights:
    return None
  res = lora.embedding_norm_fn(layer, inputs)
  if res is None:
    return None
  if layer.mask_zero:
    keras_backend.set_keras_mask(res[0], ops.not_equal(inputs, 0))
  if layer.tie_weights:
    return res
  ids = tf.reshape(tf.cast(inputs, tf.int32), [-1])
  return _untied(layer, res, layer.embeddings, lambda dz: tf.math.unsorted_segment_sum(
      tf.reshape(tf.cast(dz, tf.float32), [-1, layer.output_dim]), ids, layer.input_dim))


def _reverse(layer, h):
  """The reverse projection; declines LoRA and 16-bit reverse_dtype."""
  if getattr(layer, "lora_enabled", False):
    return None
  if layer.reverse_dtype is not None and str(layer.reverse_dtype) != "float32":
    return None   # its float32 recomputation would not be float32
  kernel = ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
  if layer.reverse_dtype is not None:
    h, kernel = ops.cast(h, layer.reverse_dtype), ops.cast(kernel, layer.reverse_dtype)
  logits = ops.matmul(h, kernel)
  outputs = logits
  if layer.logit_soft_cap is not None:
    cap = layer.logit_soft_cap
    outputs = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
  variable = layer.embeddings if layer.tie_weights else layer.reverse_embeddings

  def sqr_norm_fn(dlogits):
    if not algebra.trainable(variable):
      return algebra.zeros(dlogits)
    return algebra.factored_sqr_norm(algebra.to_btk(h), algebra.to_btk(dlogits))[0]

  if layer.tie_weights:
    return outputs, logits, sqr_norm_fn
  return _untied(layer, (outputs, logits, sqr_norm_fn), variable, lambda dl: tf.einsum(
      "btd,btv->dv", tf.cast(algebra.to_btk(h), tf.float32),
      tf.cast(algebra.to_btk(dl), tf.float32)))


@registry.float32_watched
@registry.supports_records
def reversible_embedding_norm_fn(layer, inputs, reverse=False):
  """Norm function (registry contract) of keras.layers.ReversibleEmbedding.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
    reverse: True for the reverse projection (logits), False for the lookup.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  if getattr(layer, "quantization_mode", None) is not None:
    return None
  return _reverse(layer, inputs) if reverse else _lookup(layer, inputs)
