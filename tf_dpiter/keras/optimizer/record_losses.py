"""Per-record losses of a compiled Keras model, for any loss shape (McMahan et al. 2018, Sec. 2).

DP-SGD clips the gradient of each record's loss L_i, defined here as the model's compiled
loss (mean-reduced as Keras does, with `loss_weights`) evaluated on record i alone, with its
sample weights and output masks: per-token losses are the record's own masked mean (never a
mean over the batch's tokens, which would couple records), multi-output and dict losses and
sample weights of any rank included. The vectorized path runs each record alone through the
model; the fast path evaluates the compiled loss record by record (`compiled_record_losses`).
Layer losses (`add_loss`, activity regularizers) are handled by the vectorized path only.
"""

import keras
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import total_records


def compiled_record_losses(model, y_true, y_pred, weights):
  """Per-record losses [R] of model's compiled loss, each computed on one record alone.

  Args:
    model: a compiled keras.Model.
    y_true, y_pred: nests of tensors [R, k, ...] (records on the leading axis); the Keras
      masks of y_pred's leaves (`_keras_mask`, [R, k, ...]) are applied record by record.
    weights: nest of per-record sample weights [R, k, ...] (`gradients.record_weights` of
      each record).

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
      # a label outside a sparse cross-entropy's classes: that example's loss 0, no abort
      with total_records.sparse_labels_guarded(model, yt, yp, w):
        loss = tf.reduce_mean(tf.cast(compiled(yt, yp, w), tf.float32))
    grads = tape.gradient(loss, yp_f, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss, grads

  flat_others = [t for group in others for t in group]

  @tf.custom_gradient
  def losses_of(*yp_leaves):
    # `grad` below is the map's whole gradient, so no tape records the map: its inputs are
    # cut from the tapes (under XLA the map is a nested tf.function, whose call under a
    # recording tape would trace its symbolic gradient, never used)
    losses, grads = tf.vectorized_map(one, (_unrecorded(yp_leaves), _unrecorded(flat_others)),
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

  # the step graph, not TensorFlow's registry, holds the gradient function
  return keras_internals.graph_owned_gradients(losses_of, *yp_flat)


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


def _unrecorded(leaves):
  """The list of `leaves` with each dense tf.Tensor through tf.stop_gradient (values
  unchanged, unseen by any gradient tape); other leaves (None, composite tensors) as given."""
  return [tf.stop_gradient(t) if isinstance(t, tf.Tensor) else t for t in leaves]


def _split(flat, sizes):
  out, pos = [], 0
  for n in sizes:
    out.append(list(flat[pos:pos + n]))
    pos += n
  return out
