"""Ghost norm of LayerNormalization.

y = xhat * gamma + beta; grad gamma_i = sum dy * xhat, grad beta_i = sum dy
(sums over the non-normalized, non-batch axes).
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry


@registry.float32_watched
@registry.supports_records
def layer_norm_norm_fn(layer, inputs):
  """Norm function (registry contract) of keras.layers.LayerNormalization.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  if getattr(layer, "rms_scaling", False):
    return None
  x = inputs
  ndims = x.shape.rank
  axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
  axes = sorted(a % ndims for a in axes)
  xhat = ops.layer_normalization(x, None, None, axes, layer.epsilon)
  bshape = [1] * ndims
  for a in axes:
    bshape[a] = x.shape[a]
  y = xhat
  gamma = layer.gamma if layer.scale else None
  beta = layer.beta if layer.center else None
  if gamma is not None:
    y = y * ops.cast(ops.reshape(gamma, bshape), xhat.dtype)
  if beta is not None:
    y = y + ops.cast(ops.reshape(beta, bshape), xhat.dtype)
  outputs = ops.cast(y, layer.compute_dtype)
  red = [a for a in range(1, ndims) if a not in axes]
  keep = registry.keep_per_example(int(np.prod(bshape)))

  def sqr_norm_fn(dy):
    dy = tf.cast(dy, tf.float32)
    sq, grads = None, {}
    if algebra.trainable(gamma):
      g = dy * tf.cast(xhat, tf.float32)
      g = registry.record_sum(tf.reduce_sum(g, axis=red) if red else g)
      sq = algebra.add_norms(sq, algebra.sqr_sum(g))
      grads[id(gamma)] = g
    if algebra.trainable(beta):
      g = registry.record_sum(tf.reduce_sum(dy, axis=red) if red else dy)
      sq = algebra.add_norms(sq, algebra.sqr_sum(g))
      grads[id(beta)] = g
    sq = algebra.zeros(dy) if sq is None else sq
    return algebra.result(layer, sq, grads) if keep else sq

  return outputs, y, sqr_norm_fn
