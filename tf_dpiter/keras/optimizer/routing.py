"""Which per-example clipping path a DP step takes, and why (McMahan et al. 2018, Section 7).

Two paths form the clipped sum sum_i g_i min(1, C / ||g_i||_2) (McMahan et al. 2018, Sec. 2):
* vectorized: per-record gradients under `tf.vectorized_map` (each record is run alone, so it
  is exact for any model), clipped and summed in float32 (float64 for float64 variables);
* fast: ghost norms on one pass over the whole batch (fast_clipping), exact only if example
  i's loss depends on example i alone: taken only when every layer is known to act per
  example (per_example) and the batch-independence probe sees no mixing. Its norms, clip
  factors and clipped sum are float32 under every dtype policy (16-bit layers keep their
  16-bit math; fast_clipping forms the
  ghost products and the weight-gradient sums from their activations and backprops cast to
  float32, or gives a layer whose rule cannot do that vectorized per-example gradients).

`fast_path_obstacle` says why the fast path cannot be used (None: it can). The vectorized
path has its own hazard: on CPUs where TensorFlow runs oneDNN kernels, per-example
gradients of `EinsumDense`/`MultiHeadAttention` under `tf.vectorized_map` come out wrong or
crash (TensorFlow's bug), so `use_vectorized_map` sends such models to a sequential
per-record loop (`tf.map_fn`): the same gradients, slower.
"""

import functools
import math
import os

import keras
import tensorflow as tf

from tf_dpiter.keras.model import batch_independence
from tf_dpiter.keras.model import keras_internals
from tf_dpiter.keras.model import per_example
from tf_dpiter.keras.optimizer import record_losses

# Layers whose per-example gradients through tf.vectorized_map are wrong under oneDNN.
ONEDNN_AFFECTED = (keras.layers.EinsumDense, keras.layers.MultiHeadAttention)


@functools.lru_cache(maxsize=None)
def onednn_enabled():
  """True when TensorFlow's oneDNN CPU kernels are on (TF_ENABLE_ONEDNN_OPTS, or TF's default
  for this build and CPU); read once per process, as TensorFlow does."""
  flag = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return flag not in (None, "0", "false", "False")


def in_xla_context():
  """True while a function is being traced for XLA (`tf.function(jit_compile=True)`, or a
  Keras model compiled with `jit_compile=True`): the graph or one of its outer graphs is an
  XLA context. Rules pick XLA-friendly forms there (XLA's CPU grouped convolutions, e.g. a
  batch-as-channels depthwise filter gradient, are orders of magnitude slower than a matmul).

  Returns:
    bool.
  """
  # TensorFlow has no public spelling of this test; tf.vectorized_map makes the same one.
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _layers(model):
  return keras_internals.flatten_layers(model, include_self=False)


def onednn_affected_layers(model):
  """Names of the layers of `model` whose vectorized per-example gradients oneDNN breaks
  (empty when oneDNN is off).

  Args:
    model: a keras.Model, or None.

  Returns:
    a tuple of layer names.
  """
  if model is None or not onednn_enabled():
    return ()
  return tuple(layer.name for layer in _layers(model) if isinstance(layer, ONEDNN_AFFECTED))


def use_vectorized_map(model):
  """False if per-record gradients must come from a sequential loop: a Keras RNN layer with
  unroll=False (pfor cannot vectorize its while_loop) or oneDNN-affected layers.

  Args:
    model: a keras.Model, or None (True).

  Returns:
    bool.
  """
  if model is None:
    return True
  for layer in _layers(model):
    if isinstance(layer, keras.layers.RNN) and not getattr(layer, "unroll", False):
      return False
  return not onednn_affected_layers(model)


def loss_scale(model):
  """Static loss scale for float16 compute (2^7; 1 otherwise). The vectorized path multiplies
  each record's loss by it and divides the float32 per-record gradient by it; the fast path
  scales the summed loss and divides the norms and the sum. Either way a record whose
  gradient is not finite adds zero (a function of that record alone, so the sensitivity
  bound holds). Dynamic scaling would make the scale depend on the data, so it is not used.

  Args:
    model: a keras.Model (its compute_dtype decides).

  Returns:
    the scale, a float.
  """
  dtype = keras.backend.standardize_dtype(getattr(model, "compute_dtype", "float32"))
  return 2.0 ** 7 if dtype == "float16" else 1.0


def _onednn_in_vectorized_units(model, fast_clipping):
  """oneDNN-affected layers inside the fast path's unregistered (vectorized) units."""
  affected = set(onednn_affected_layers(model))
  if not affected:
    return ()
  units = set(fast_clipping.unregistered_layers(model))
  out = []
  for layer in _layers(model):
    if layer.name in units:
      out.extend(sub.name for sub in keras_internals.flatten_layers(layer)
                 if sub.name in affected)
  return tuple(out)


def fast_path_obstacle(step, model, fast_clipping, input_specs=None):
  """Why the fast (ghost-norm) path cannot clip `model` exactly, or None if it can.

  The fast path is taken only when every layer of `model` is known to act on each example
  alone (per_example: Keras' own per-example layers, or layers the user declared with
  `declare_per_example`); the batch-independence probe then runs as a second line of
  defence, at the batch size the step really uses.

  Args:
    step: the DP optimizer's PrivateStep (its l2_norm_clip, query and sampling decide).
    model: the keras.Model (None: no model, the fast path needs one).
    fast_clipping: the fast_clipping module, or None if it could not be imported.
    input_specs: a nest of tensors/specs with the batch's shapes, for the batch-independence
      probe when the model has no known inputs.

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
  # second line of defence: the probe, at the batch size fit really uses, on random inputs
  # and on the first rows of fit's data
  mixing = batch_independence.probe_at_batch_size(model, input_specs, step)
  if mixing is None:
    return "the model's inputs are unknown, so batch independence could not be probed"
  if mixing:
    return (f"layers {list(mixing)} make one example's activations depend on other examples "
            "of the batch, so per-example clipping on the whole batch does not bound one "
            "example's influence")
  return None
