"""The per-output losses a DP model logs (`logs["<output>_loss"]`) are Keras' epoch means.

On a multi-output model Keras' compiled loss keeps one `Mean` per output, updated each time
the compiled loss is evaluated. The private step evaluates it once per record, so those
updates would average per-record values with wrong weights and count a padded Poisson
sample's padding rows. The step therefore evaluates it with the trackers `silenced`, and
`update` adds each output's loss over the batch's real examples once: with per-example loss
l_o(i), sample weight w_i (1 by default) and example mask m_i (0 on padding rows),

    L_o = sum_i m_i w_i l_o(i) / n,     n = sum_i m_i,

with weight n, so the epoch's value is what `model.evaluate` logs on the same records. From
the compiled loss' value: "sum_over_batch_size" divides by B, padding included, so
L_o = value * B / n; an unreduced loss (`reduction=None`) is summed and divided by n times
the values per example.
"""

import contextlib

import keras
import tensorflow as tf

from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.optimizer import gradients as grads_lib


class _Capture:
  """Stands in for a per-output loss metric: keeps the values the compiled loss gives it."""

  def __init__(self):
    self.value = None

  def update_state(self, value, sample_weight=None):
    del sample_weight
    self.value = value


def needs_build(model):
  """True if `model`'s compiled loss is not built and the model may have several outputs
  (then `build` builds it: its per-output trackers do not exist before)."""
  return keras_internals.compile_loss_unbuilt(model) and _may_have_several_outputs(model)


def build(model, data):
  """Builds the unbuilt compiled loss of a model that may have several outputs from the
  shapes of the batch `data` (x, y[, sample_weight]) and of the outputs on it, so its
  per-output trackers exist before the step."""
  if needs_build(model):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    # a forward pass for the outputs' shapes (unused ops: pruned from the step), under a
    # name scope (a model named "_x" is no valid root scope)
    with tf.name_scope("dp_output_shapes"):
      y_pred = model(x, training=False) if keras_internals.call_has_training_arg(model) else (
          model(x))
    keras_internals.build_compile_loss(model, y, y_pred, sample_weight)


@contextlib.contextmanager
def silenced(model, trackers):
  """Within the block the compiled loss of `model` updates none of its per-output loss
  `trackers` (`keras_internals.output_loss_trackers`; `build` them first)."""
  if not trackers:
    yield
    return
  with keras_internals.output_loss_trackers_swapped(model, [None] * len(trackers)):
    yield


def _may_have_several_outputs(model):
  """False for a functional or Sequential model with one output (no per-output tracker)."""
  graph = keras_internals.functional_graph(model)
  if graph is None:
    return True
  return len(tf.nest.flatten(graph[0].outputs)) > 1


def _real_mean(value, b, n):
  """The output's loss over the real examples (module docstring), from the compiled loss's
  value on the whole batch (scalar: mean over B rows; [B, ...]: unreduced)."""
  value = tf.cast(keras_internals.unscale_loss_for_distribution(value), tf.float32)
  b = tf.cast(b, tf.float32)
  if value.shape.rank == 0:
    return value * b / tf.maximum(n, 1.0)
  per_example = tf.cast(tf.size(value), tf.float32) / tf.maximum(b, 1.0)
  return tf.reduce_sum(value) / tf.maximum(n * per_example, 1.0)


def update(model, trackers, y, y_pred, sample_weight):
  """Adds this batch's per-output losses over its real examples (sample weights 0 on padding
  rows) to `model`'s per-output loss `trackers` (none for one output: nothing is done)."""
  if not trackers:
    return
  captures = [_Capture() for _ in trackers]
  with keras_internals.output_loss_trackers_swapped(model, captures):
    keras_internals.call_compile_loss(model, y, y_pred, sample_weight)
  b = grads_lib.dynamic_batch_size(y_pred)
  n = tf.reduce_sum(grads_lib.example_mask_from_weights(sample_weight, b))
  for tracker, capture in zip(trackers, captures):
    if capture.value is not None:
      tracker.update_state(_real_mean(capture.value, b, n), sample_weight=n)
