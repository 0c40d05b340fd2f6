"""Augmentation multiplicity: De, Berrada, Hayes, Smith and Balle, "Unlocking High-Accuracy
Differentially Private Image Classification through Scale" (2022), Section 3.1.

Each example x_i is augmented K times, and its record gradient is the MEAN of the K view
gradients, clipped once:

    g_i = (1/K) sum_k grad loss(f(A_k(x_i)), y_i),     record_i = g_i * c(||g_i||).

The record is still one example (the K views are a function of x_i alone), so the clipped
sum keeps sensitivity S under add/remove one example (2S under replace-one) and the ledger,
the sampling and the accounting are unchanged.

`AugmentationMultiplicity` runs `model` on K stacked views [B, K, ...] in training
(`keras.layers.TimeDistributed`) and `ViewMeanLoss` averages the base loss over views; the
DP step is unchanged. `augment_fn` must act on each example alone (no batch statistics).
`clipping="auto"` takes the vectorized path; `dp.keras.declare_per_example(wrapped, reason)`
allows the fast path (exact, not faster). Metrics see the mean over the K views' outputs
(`view_mean`) and are outside the clipped sum.
"""

import keras
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.optimizer import gradients as grads_lib


@keras.saving.register_keras_serializable(package="tf_dpiter", name="ViewMeanLoss")
class ViewMeanLoss(keras.losses.Loss):
  """Per-example mean over K views of a base loss (labels repeated over the view axis)."""

  def __init__(self, base_loss, output_rank, name="view_mean_loss"):
    """Args:
      base_loss: a Keras loss (instance or name) giving per-element losses.
      output_rank: rank of the wrapped model's own output ([B, C]: 2); a prediction of rank
        output_rank + 1 carries the view axis 1.
      name: the loss name.
    """
    super().__init__(name=name)
    self._base = keras.losses.get(base_loss)
    self._output_rank = int(output_rank)

  def _unreduced(self, y_true, y_pred):
    if isinstance(self._base, keras.losses.Loss):
      return self._base.call(y_true, y_pred)    # per-element, before the Loss' reduction
    return self._base(y_true, y_pred)

  def call(self, y_true, y_pred):
    """Mean over the view axis of base(y_true repeated, y_pred); [B] (or [B, ...])."""
    if len(y_pred.shape) == self._output_rank:     # inference: no view axis
      return self._unreduced(y_true, y_pred)
    k = tf.shape(y_pred)[1]
    y = tf.repeat(tf.expand_dims(y_true, 1), k, axis=1)
    return tf.reduce_mean(self._unreduced(y, y_pred), axis=1)

  def get_config(self):
    """Keras config."""
    return {"base_loss": keras.losses.serialize(self._base), "output_rank": self._output_rank,
            "name": self.name}


class AugmentationMultiplicity(keras.Model):
  """`model` trained on K augmented views of each example (module docstring)."""

  def __init__(self, model, augment_fn, k, **kwargs):
    """Args:
      model: a keras.Model (built: its output rank is read) mapping x [B, ...] -> [B, ...].
      augment_fn: (x [B, ...], view) -> one augmented view [B, ...], per example; `view` is
        the view's index 0..K-1 (a Python int; random augmentations may ignore it).
      k: K >= 1, views per example.
      **kwargs: keras.Model arguments.

    Raises:
      ParameterTypeError: K not an int.
      ParameterValueError: K < 1, augment_fn not callable, model not a built Model.
    """
    validation.check_integer("k", k, 1)   # views per example
    if not callable(augment_fn):
      raise ParameterValueError(f"`augment_fn` must be callable. Received: augment_fn={augment_fn!r}")
    if not isinstance(model, keras.Model) or not model.built:
      raise ParameterValueError("`model` must be a built keras.Model (call it once or give it an Input). "
                                f"Received: model={model!r}")
    super().__init__(**kwargs)
    self.views = keras.layers.TimeDistributed(model)   # the only reference: no shared layer
    self.augment_fn = augment_fn
    self.k = k
    self.output_rank = len(model.output.shape) if hasattr(model, "output") else 2

  @property
  def inner(self):
    """The wrapped model (its weights are the wrapper's)."""
    return self.views.layer

  def build(self, input_shape):
    """Builds the view layer on [B, K, ...]."""
    self.views.build((input_shape[0], self.k) + tuple(input_shape[1:]))
    super().build(input_shape)

  def call(self, x, training=False):
    """Training: outputs [B, K, ...] of the K views; inference: model(x)."""
    if not training:
      return self.inner(x, training=False)
    views = tf.stack([self.augment_fn(x, view) for view in range(self.k)], axis=1)
    return self.views(views, training=True)

  def view_mean(self, y_pred):
    """One prediction per example: the mean over the view axis of training outputs
    [B, K, ...] -> [B, ...]; inference outputs (no view axis) are returned as they are."""
    if len(y_pred.shape) == self.output_rank:
      return y_pred
    return tf.reduce_mean(y_pred, axis=1)

  def compute_metrics(self, x, y, y_pred, sample_weight=None):
    """Keras' compute_metrics on `view_mean(y_pred)`. With sample weights (a padded Poisson
    sample weighs its padding rows 0) the unweighted metrics are weighted by the example mask,
    as the DP train step does for any model: metrics count the real examples only."""
    y_pred = tf.nest.map_structure(self.view_mean, y_pred)
    if sample_weight is None:
      return super().compute_metrics(x, y, y_pred, sample_weight=None)
    mask = grads_lib.example_mask_from_weights(sample_weight, grads_lib.dynamic_batch_size(x))
    keras_internals.update_compiled_metrics(self, y, y_pred, sample_weight, mask)
    return self.get_metrics_result()

  def view_loss(self, base_loss):
    """The loss to compile with: `ViewMeanLoss(base_loss)` for this model's outputs.

    Args:
      base_loss: a Keras loss (instance or name).

    Returns:
      a ViewMeanLoss.
    """
    return ViewMeanLoss(base_loss, self.output_rank)


def augmentation_multiplicity(model, augment_fn, k):
  """A DP model training `model` on K augmented views per example (De et al. 2022, Sec. 3.1).

  Compile it with a DP optimizer and `loss=wrapped.view_loss(base_loss)`; `model` shares its
  weights with the wrapper (evaluate either).

  Args:
    model: a built keras.Model.
    augment_fn: (x [B, ...], view) -> [B, ...], one view per example (`view` in 0..K-1; the
      function may be random and ignore it).
    k: views per example (K >= 1).

  Returns:
    an AugmentationMultiplicity made private (`make_private`).
  """
  from tf_dpiter.keras.model import models  # pylint: disable=g-import-not-at-top
  wrapped = AugmentationMultiplicity(model, augment_fn, k)
  wrapped.build((None,) + tuple(model.input_shape[1:]))
  return models.make_private(wrapped)
