"""Ghost norm of LayerNormalization.

y = xhat * gamma + beta; grad gamma_i = sum dy * xhat, grad beta_i = sum dy
(sums over the non-normalized, non-batch axes), formed over chunks of the batch whose
temporaries take at most budget.CHUNK_BYTES (rules/budget.py). Kept per-record gradients are
one [R, gamma's and beta's entries] block (registry.PerExampleBlock): one squared norm and one
product for the clipped sum per layer, not one per variable.
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget


@registry.float32_watched
@registry.supports_records
@registry.watched_from_inputs
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
  # normalized trailing axes: gamma and beta broadcast as they are (no reshape ops)
  suffix = axes == list(range(ndims - len(axes), ndims))

  def shaped(v):
    v = v if suffix and tuple(v.shape) == tuple(bshape[ndims - len(axes):]) else ops.reshape(
        v, bshape)
    return ops.cast(v, xhat.dtype)

  if gamma is not None:
    y = y * shaped(gamma)
  if beta is not None:
    y = y + shaped(beta)
  outputs = ops.cast(y, layer.compute_dtype)
  red = [a for a in range(1, ndims) if a not in axes]
  entries = int(np.prod(bshape))
  trained = [v for v in (gamma, beta) if algebra.trainable(v)]

  def sqr_norm_fn(dy):
    dy = tf.cast(dy, tf.float32)
    if not trained:
      return algebra.zeros(dy)
    # Per-record gradients of gamma and beta (entries each): kept within budget.KEEP_BYTES
    # where the trace knows the batch, and with an unknown batch as the rule always kept
    # them (a few KiB per record); else the clipped sum from the factors (_sums).
    keep = budget.keep_choice(dy, 4 * entries * len(trained),
                              registry.keep_per_example(entries))
    keep = keep if isinstance(keep, bool) else True
    k = algebra.current_examples_per_record()
    size = algebra.static_positions(dy.shape[1:])
    m = (budget.examples_per_chunk(dy, 4 * 3 * size)
         if size != -1 and isinstance(k, int) else None)

    def body(dc, xc):
      # the trained variables' per-record gradients side by side in one [R, n entries] block:
      # one squared norm, and one product for the clipped sum (clipping.bookkeeping_sum), for both
      parts = []
      for v in trained:
        g = dc * tf.cast(xc, tf.float32) if v is gamma else dc
        g = algebra.record_sum(algebra.reduce_sum(g, red) if red else g)
        parts.append(g if g.shape.rank == 2 else algebra.reshape(g, [-1, entries]))
      block = parts[0] if len(parts) == 1 else tf.concat(parts, algebra.const(1))
      if keep:   # handed on unchanged: formed with the other LayerNorms' (algebra.batched_norms)
        return algebra.deferred_sqr_sum(block), block
      return (_with_sum_rounding(algebra.sqr_sum(block), dc, xc, gamma, trained, red, rows),)

    # rows of the clipped sum's reduction per entry (_sums): the batch's positions
    rows = algebra.sum_examples(dy) * (
        int(np.prod([dy.shape[a] for a in red])) if red else 1)
    rec = m // k if m is not None else None
    specs = [tf.TensorSpec([rec], tf.float32)] + (
        [tf.TensorSpec([rec, entries * len(trained)], tf.float32)] if keep else [])
    out = budget.over_chunks(body, (dy, xhat), m, specs)
    if not keep:
      return registry.FactorSums(out[0], lambda c: _sums(layer, trained, dy, xhat, red, c, m))
    # a DeferredNorms only from one call on the batch (algebra.batched_norms): its rows
    rows_of = out[1] if isinstance(out[0], algebra.DeferredNorms) else algebra.leading_rows(
        out[1], out[0])
    return registry.PerExampleBlock(out[0], [rows_of],
                                    lambda sums: _unpack(layer, trained, entries, sums[0]))

  return outputs, y, sqr_norm_fn


def _with_sum_rounding(sq, dy, xhat, gamma, trained, red, rows):
  """Per-record squared norms sq [R] of the gradients of gamma and beta (sums over the
  positions, the axes `red`, of dy xhat and dy) raised to cover their float32 rounding, here
  and in the clipped sum (_sums: c dy formed first, then the products and the batch's sum):
  algebra.with_terms_rounding with S the sum over the record's positions t of ||dy_t xhat_t||
  (gamma) and ||dy_t|| (beta), the norms of its terms. Where equal positions get nearly
  opposite output gradients the float32 norm is mostly rounding, and the sum's other rounding
  moved one record's contribution to 1.10 C.

  Args:
    sq: [R] float32.
    dy: [m, ...] float32 output gradients of a chunk of m examples (R = m / k records).
    xhat: [m, ...] the normalized input.
    gamma: the layer's gamma or None.
    trained: its trainable variables among (gamma, beta).
    red: the position axes.
    rows: the clipped sum's rows per entry (the batch's positions; an int or a float32 scalar).

  Returns:
    [R] float32.
  """
  axes = [a for a in range(1, dy.shape.rank) if a not in red]
  norms = None
  for v in trained:
    t = dy * tf.cast(xhat, tf.float32) if v is gamma else dy
    n = tf.sqrt(algebra.reduce_sum(tf.square(t), axes))
    norms = n if norms is None else norms + n
  s = algebra.record_sum(algebra.reduce_sum(norms, list(range(1, norms.shape.rank)))
                          if norms.shape.rank > 1 else norms)
  k = algebra.current_examples_per_record()
  positions = (int(np.prod([dy.shape[a] for a in red])) if red else 1) * (
      k if isinstance(k, int) else tf.cast(k, tf.float32))
  return algebra.with_terms_rounding(sq, s, positions + rows + 1)


def _unpack(layer, trained, entries, flat):
  """The clipped sum of the block [gamma's entries, beta's entries] (the trained ones, in that
  order) split into one tensor per variable of layer.trainable_variables, of its shape.

  Args:
    layer: the LayerNormalization layer.
    trained: its trainable variables among (gamma, beta), gamma first.
    entries: entries of each variable.
    flat: [entries * len(trained)] float32.

  Returns:
    one float32 tensor per variable of layer.trainable_variables.
  """
  n = len(trained)
  parts = [flat] if n == 1 else tf.split(flat, algebra.const([entries] * n), num=n,
                                         axis=algebra.const(0))
  by_id = {id(v): p if len(v.shape) == 1 else algebra.reshape(p, list(v.shape))
           for v, p in zip(trained, parts)}
  return [by_id[id(v)] for v in layer.trainable_variables]


def _sums(layer, trained, dy, xhat, red, factors, m):
  """sum_i c_i grad gamma_i = sum over the batch and the axes `red` of (c dy) xhat, and
  sum_i c_i grad beta_i of c dy, over chunks of m examples (rules/budget.py); the rows of
  c_i = 0 are exactly 0 in both factors (algebra.weight_rows / drop_rows), so a record whose
  values are not finite adds nothing.

  Args:
    layer: the LayerNormalization layer.
    trained: its trainable variables among (gamma, beta), gamma first.
    dy: [B, ...] float32 gradient at its output.
    xhat: [B, ...] the normalized input.
    red: the non-batch axes gamma and beta are broadcast along.
    factors: [B] float32 clip factors of the examples.
    m: examples per chunk, or None.

  Returns:
    one float32 tensor per variable of layer.trainable_variables.
  """
  gamma = layer.gamma if layer.scale else None
  axes = [0] + list(red)

  def body(dc, xc, cc):
    dw = algebra.weight_rows(dc, cc)
    return [algebra.reshape(algebra.reduce_sum(dw * algebra.drop_rows(xc, cc) if v is gamma
                                               else dw, axes), list(v.shape))
            for v in trained]

  sums = budget.sum_over_chunks(body, (dy, xhat, tf.cast(factors, tf.float32)), m,
                                [v.shape for v in trained])
  by_id = {id(v): s for v, s in zip(trained, sums)}
  return [by_id[id(v)] for v in layer.trainable_variables]
