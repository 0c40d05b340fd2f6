"""Which per-example clipping path a DP step takes, and why (McMahan et al. 2018, Section 7).

Two paths form the clipped sum sum_i g_i min(1, C / ||g_i||_2) (McMahan et al. 2018, Sec. 2):
* vectorized: per-record gradients under `tf.vectorized_map`, each record run alone (exact for
  any model), in float32 (float64 for float64 variables);
* fast: ghost norms on one pass over the batch (fast_clipping), exact only if example i's
  loss depends on example i alone: taken only when every layer is known to act per example
  (per_example) and the batch-independence probe sees no mixing; float32 arithmetic under
  every dtype policy.

`fast_path_obstacle` says why the fast path cannot be used (None: it can). On oneDNN CPUs the
vectorized per-example gradients of `EinsumDense`/`MultiHeadAttention` come out wrong or
crash (a TensorFlow bug): `use_vectorized_map` sends such models to a sequential loop.
"""

import math

import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.internals import per_example
from tf_dpiter.keras.internals.runtime import ONEDNN_AFFECTED  # noqa: F401  (re-exported)
from tf_dpiter.keras.internals.runtime import model_layers
from tf_dpiter.keras.internals.runtime import in_xla_context  # noqa: F401  (re-exported)
from tf_dpiter.keras.internals.runtime import loss_scale  # noqa: F401  (re-exported)
from tf_dpiter.keras.internals.runtime import onednn_affected_layers
from tf_dpiter.keras.internals.runtime import onednn_enabled  # noqa: F401  (re-exported)
from tf_dpiter.keras.internals.runtime import use_vectorized_map  # noqa: F401  (re-exported)
from tf_dpiter.keras.optimizer import record_losses

def _onednn_in_vectorized_units(model, fast_clipping):
  """oneDNN-affected layers inside the fast path's unregistered (vectorized) units."""
  affected = set(onednn_affected_layers(model))
  if not affected:
    return ()
  units = set(fast_clipping.unregistered_layers(model))
  out = []
  for layer in model_layers(model):
    if layer.name in units:
      out.extend(sub.name for sub in keras_internals.flatten_layers(layer)
                 if sub.name in affected)
  return tuple(out)


def fast_refusal(reason):
  """The error of clipping="fast" where the fast path cannot clip the model exactly.

  Args:
    reason: the obstacle (`fast_path_obstacle`'s sentence).

  Returns:
    a PrivacyConfigError to raise.
  """
  return PrivacyConfigError(
      f"clipping='fast' cannot clip this model exactly: {reason}. Use clipping='auto' or "
      "'vectorized' (each record is clipped alone, exact for it)")


def route_unrecorded(step, fast_clipping, uses):
  """The path of a step whose fast clipped sum found trainable variables used outside their
  layer's recorded calls: "vectorized" under clipping="auto" (with the warning
  `fast_path_obstacle` gives for them); clipping="fast" refuses.

  Args:
    step: the DP optimizer's PrivateStep.
    fast_clipping: the fast_clipping module.
    uses: the uses found (UnrecordedUsesError.uses).

  Returns:
    "vectorized".

  Raises:
    PrivacyConfigError: clipping="fast".
  """
  if step.flags.clipping == "fast":
    raise fast_refusal(fast_clipping.describe_unrecorded(uses))
  fast_clipping.warn_unrecorded(uses)
  return "vectorized"


def fast_path_obstacle(step, model, fast_clipping, input_specs=None, checked_by_the_step=False,
                       probe=True):
  """Why the fast (ghost-norm) path cannot clip `model` exactly, or None if it can: every
  layer must be known to act on each example alone (per_example), and the batch-independence
  probe then runs as a second line of defence at the step's batch size.

  Args:
    step: the DP optimizer's PrivateStep (its l2_norm_clip, query and sampling decide).
    model: the keras.Model (None: no model, the fast path needs one).
    fast_clipping: the fast_clipping module, or None if it could not be imported.
    input_specs: a nest of tensors/specs with the batch's shapes, for the probe of a model
      without known inputs.
    checked_by_the_step: True from the Keras train step while tracing: the unrecorded-use
      check is left to the traced step's fast clipped sum, whose recorded forward pass
      raises fast_clipping.clipping.UnrecordedUsesError on such a use (before anything is
      formed from it; one trace of the model, not two); the step then calls
      `route_unrecorded`. Called eagerly, the check runs here.
    probe: False: no batch-independence probe here; the caller runs it (`mixing_obstacle`)
      once the model's call is checked for writes from the data.

  Returns:
    None, or a sentence naming the obstacle (layer names, dtype policy, setting).
  """
  loss_obstacle = record_losses.fast_path_obstacle(model)   # compute_loss, layer losses
  if loss_obstacle is not None:
    return loss_obstacle
  if fast_clipping is None:
    return "tf_dpiter.keras.fast_clipping could not be imported"
  if model is None:
    return "no model was given"
  unknown = per_example.undeclared_layers(model)
  if unknown:
    return (f"layers {list(unknown)} are not known to act on each example alone (a custom or "
            "Lambda layer, a subclassed model's call or a graph operation), and the fast path "
            "runs the whole batch through them; if each does, declare it with "
            "dp.keras.declare_per_example(layer, reason)")
  if not step.clips_by_factors:
    return ("the dp_query gives no per-record clip factors (DPQuery.record_clip_factors), "
            "so norms computed on the whole batch cannot be clipped by its rule")
  if step.l2_norm_clip is not None and not math.isfinite(step.l2_norm_clip):
    return f"l2_norm_clip={step.l2_norm_clip!r} is not finite"
  if model.losses:
    return "the model has regularization losses"
  # supports() answers False for what it cannot plan; anything it raises is a bug: fail loudly.
  if not fast_clipping.supports(model):
    return "fast_clipping.supports(model) is False (unbuilt, BatchNormalization or shared variables)"
  blocked = _onednn_in_vectorized_units(model, fast_clipping)
  if blocked:
    return (f"oneDNN is on and layers {list(blocked)} would get per-example gradients from "
            "tf.vectorized_map inside the fast path, which oneDNN gets wrong")
  if any(isinstance(t, (tf.RaggedTensor, tf.SparseTensor, tf.RaggedTensorSpec,
                        tf.SparseTensorSpec)) for t in tf.nest.flatten(input_specs)):
    return ("the batch holds ragged or sparse inputs, and the fast path's per-example pass "
            "reshapes dense rows; pad them to dense rows (with a mask) to take it")
  # a variable read outside its layer's recorded calls (a tied projection): its use would
  # be left out of the clipped sum; "auto" warns once per traced step and routes (a traced
  # Keras step checks its own forward pass instead: checked_by_the_step)
  deferred = checked_by_the_step and not tf.executing_eagerly()
  uses = None if deferred else fast_clipping.unrecorded_variable_uses(model, input_specs)
  if uses:
    if step.flags.clipping == "auto":
      fast_clipping.warn_unrecorded(uses)
    return fast_clipping.describe_unrecorded(uses)
  return mixing_obstacle(step, model, input_specs) if probe else None


def mixing_obstacle(step, model, input_specs=None):
  """The second line of defence of `fast_path_obstacle`: the batch-independence probe, at
  the batch sizes fit really uses, on random inputs and on the first rows of fit's data
  (batch_independence.probe_at_batch_size).

  Args:
    step: the DP optimizer's PrivateStep (its declared sampling).
    model: the keras.Model.
    input_specs: a nest of tensors/specs with the batch's shapes, or None.

  Returns:
    None, or a sentence naming the mixing layers (or why the model could not be probed).
  """
  mixing = batch_independence.probe_at_batch_size(model, input_specs, step)
  if mixing is None:
    return "the model's inputs are unknown, so batch independence could not be probed"
  if mixing:
    return (f"layers {list(mixing)} make one example's activations depend on other examples "
            "of the batch, so per-example clipping on the whole batch does not bound one "
            "example's influence")
  return None
