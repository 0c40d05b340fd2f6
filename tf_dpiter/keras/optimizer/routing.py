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
  """The PrivacyConfigError of clipping="fast" where the fast path cannot clip the model exactly
  (`reason`: the obstacle's sentence)."""
  return PrivacyConfigError(
      f"clipping='fast' cannot clip this model exactly: {reason}. Use clipping='auto' or "
      "'vectorized' (each record is clipped alone, exact for it)")


def route_unrecorded(step, fast_clipping, uses):
  """"vectorized" (with the warning `fast_path_obstacle` gives) for a step whose fast clipped sum
  found trainable variables used outside their layer's recorded calls (`uses`).

  Raises:
    PrivacyConfigError: clipping="fast".
  """
  if step.flags.clipping == "fast":
    raise fast_refusal(fast_clipping.describe_unrecorded(uses))
  fast_clipping.warn_unrecorded(uses)
  return "vectorized"


def fast_path_obstacle(step, model, fast_clipping, input_specs=None, checked_by_the_step=False,
                       probe=True):
  """Why the fast (ghost-norm) path cannot clip `model` exactly (a sentence naming the obstacle),
  or None if it can: every layer must be known to act on each example alone (per_example),
  and the batch-independence probe runs as a second line of defence.

  `checked_by_the_step`: True from the Keras train step while tracing: the unrecorded-use
  check is left to the step's fast clipped sum, whose recorded forward pass raises
  UnrecordedUsesError before anything is formed from such a use (one trace, not two).
  `probe`: False leaves the probe to the caller (`mixing_obstacle`), once the model's call is
  checked for writes from the data."""
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
  """The batch-independence probe at the batch sizes fit really uses, on random inputs and on
  fit's first rows: None, or a sentence naming the mixing layers (or why no probe ran)."""
  mixing = batch_independence.probe_at_batch_size(model, input_specs, step)
  if mixing is None:
    return "the model's inputs are unknown, so batch independence could not be probed"
  if mixing:
    return (f"layers {list(mixing)} make one example's activations depend on other examples "
            "of the batch, so per-example clipping on the whole batch does not bound one "
            "example's influence")
  return None
