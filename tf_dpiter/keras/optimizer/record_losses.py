"""Per-record losses of a compiled Keras model, for any loss shape (McMahan et al. 2018, Sec. 2).

DP-SGD clips the gradient of each record's loss L_i (a record: one example, or one microbatch
of k examples). Here L_i is defined as what the model's compiled loss (`compile(loss=...,
loss_weights=...)`, mean-reduced as Keras reduces it) gives when evaluated on record i alone,
with the record's sample weights and output masks. This covers:

* per-token losses ([B, T] before reduction, language models, tagging, segmentation): the
  record's loss is its own masked, weighted mean over tokens, never a mean over the batch's
  tokens (which would couple the records);
* multi-output and dict losses, with `loss_weights`;
* sample weights of any rank ([B], [B, T]) and nested per output (dicts).

Both clipping paths use this definition: the vectorized path runs each record alone through
the model and the compiled loss (`record_weights`); the fast path runs the batch through the
model once and evaluates the compiled loss record by record (`compiled_record_losses`, the loss
function vectorized over records, which reads no other record's outputs). Losses added by
layers (`add_loss`, activity regularizers) depend on the record's own forward pass and are
handled by the vectorized path only.
"""

import keras
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.internals import keras_internals


def record_weights(example_mask, sample_weight):
  """Keras sample weights of a record's k examples (a nest like `sample_weight`).

  w = m * k / sum(m) * sample_weight, with m the record's example mask [..., k]: the
  mean-reduced compiled loss over the record's examples then averages its real examples only
  (padding examples of a microbatch, and examples removed by a zero weight, get weight 0).

  Args:
    example_mask: [k] (one record) or [R, k] (records) float 0/1.
    sample_weight: None, or a nest of tensors shaped like example_mask plus any trailing axes.

  Returns:
    a nest of float32 tensors like sample_weight (example_mask's shape when it is None).
  """
  em = tf.cast(example_mask, tf.float32)
  k = tf.cast(tf.shape(em)[-1], tf.float32)
  w = em * (k / tf.maximum(tf.reduce_sum(em, -1, keepdims=True), 1.0))
  if sample_weight is None:
    return w

  def weigh(t):
    t = tf.cast(t, tf.float32)
    extra = len(t.shape) - len(w.shape)
    return tf.reshape(w, tf.concat([tf.shape(w), tf.ones([extra], tf.int32)], 0)) * t

  return tf.nest.map_structure(weigh, sample_weight)


def masked_record_mean(values, example_mask):
  """The mean of each record's values over its real examples: [..., k] -> [...].

  sum_j m_j v_j / max(sum_j m_j, 1), with m the example mask (0 for padding examples);
  a record with no real example gets 0.

  Args:
    values: [..., k] float tensor, one value per example of each record.
    example_mask: [..., k] 0/1 mask.

  Returns:
    [...] means, in values' dtype.
  """
  em = tf.cast(example_mask, values.dtype)
  return tf.reduce_sum(values * em, -1) / tf.maximum(tf.reduce_sum(em, -1), 1.0)


def example_mask_from_weights(sample_weight, batch_size):
  """[B] float 0/1: 1 for examples with a positive weight somewhere (any output, any token).

  Args:
    sample_weight: None (all ones) or a nest of [B, ...] weights.
    batch_size: B, an int or scalar int tensor.

  Returns:
    a [B] float32 tensor.
  """
  if sample_weight is None:
    return tf.ones([batch_size], tf.float32)
  flags = [tf.reduce_any(tf.reshape(tf.cast(t, tf.float32), [batch_size, -1]) > 0, axis=1)
           for t in tf.nest.flatten(sample_weight)]
  any_positive = flags[0]
  for f in flags[1:]:
    any_positive = tf.logical_or(any_positive, f)
  return tf.cast(any_positive, tf.float32)


def compiled_record_losses(model, y_true, y_pred, weights):
  """Per-record losses [R] of model's compiled loss, each computed on one record alone.

  Args:
    model: a compiled keras.Model.
    y_true, y_pred: nests of tensors [R, k, ...] (records on the leading axis); the Keras
      masks of y_pred's leaves (`_keras_mask`, [R, k, ...]) are applied record by record.
    weights: nest of per-record sample weights [R, k, ...] (`record_weights` of each record).

  Returns:
    float32 [R]: record i's value of the compiled loss (loss_weights included, no
    distribution scaling, no layer losses).

  Raises:
    ParameterValueError: the model was compiled without a loss.
  """
  compiled = getattr(model, "_compile_loss", None)   # keras.Model internals: see module doc
  if compiled is None:
    raise ParameterValueError("the model was compiled without a loss: compile(loss=...) is needed for "
                              "DP training (the per-record loss is what the compiled loss gives)")
  yp_flat = tf.nest.flatten(y_pred)
  masks = [keras_internals.keras_mask(t) for t in yp_flat]
  others = [tf.nest.flatten(y_true), [m for m in masks if m is not None],
            tf.nest.flatten(weights)]
  sizes = [len(x) for x in others]

  def one(elems):
    yp_f, flat = elems
    yt_f, m_f, w_f = _split(flat, sizes)
    with tf.GradientTape() as tape:
      tape.watch(yp_f)
      yp_id = [tf.identity(t) for t in yp_f]
      it = iter(m_f)
      for t, m in zip(yp_id, masks):
        if m is not None:
          keras_internals.set_keras_mask(t, next(it))
      yt = tf.nest.pack_sequence_as(y_true, yt_f)
      yp = tf.nest.pack_sequence_as(y_pred, yp_id)
      w = tf.nest.pack_sequence_as(weights, w_f)
      # an unreduced loss (reduction=None) gives one value per example: their mean (the
      # weights w already average over the record's real examples)
      loss = tf.reduce_mean(tf.cast(compiled(yt, yp, w), tf.float32))
    grads = tape.gradient(loss, yp_f, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss, grads

  flat_others = [t for group in others for t in group]

  @tf.custom_gradient
  def losses_of(*yp_leaves):
    losses, grads = tf.vectorized_map(one, (list(yp_leaves), flat_others),
                                      fallback_to_while_loop=True)

    def grad(upstream, variables=None):
      # dL_i / dy_pred_i of each record alone, times the upstream gradient of L_i: the
      # backward pass never differentiates through the vectorized map (under XLA a map is
      # a nested function call, whose gradient would make the batch a compile-time constant
      # and recompile the step at every step).
      out = [tf.cast(tf.reshape(upstream, [-1] + [1] * (len(g.shape) - 1)) * tf.cast(
          g, tf.float32), leaf.dtype) for g, leaf in zip(grads, yp_leaves)]
      if variables:
        return out, [None] * len(variables)
      return out

    return losses, grad

  return losses_of(*yp_flat)


def fast_path_obstacle(model):
  """Why the fast path cannot evaluate model's per-record losses, or None if it can.

  The fast path evaluates the compiled loss record by record on the batch's outputs; a
  `compute_loss` override, or a layer loss (activity regularizer), is only seen by the
  vectorized path, which runs each record alone.

  Args:
    model: a keras.Model, or None.

  Returns:
    None, or a sentence naming the obstacle.
  """
  if model is None:
    return None
  if type(model).compute_loss is not keras.Model.compute_loss:
    return f"{type(model).__name__} overrides compute_loss"
  for layer in keras_internals.flatten_layers(model):
    if getattr(layer, "activity_regularizer", None) is not None:
      return (f"layer {layer.name!r} has an activity regularizer (a loss on its activations, "
              "added to each record's loss)")
  return None


def _split(flat, sizes):
  out, pos = [], 0
  for n in sizes:
    out.append(list(flat[pos:pos + n]))
    pos += n
  return out
