"""Which layers act on each example alone: the fast path's allowlist.

The fast (ghost-norm) path runs the whole batch through the model once, so its clipped sum
bounds one example's influence by C only if example i's loss is a function of example i
alone (McMahan et al. 2018, Section 2). The batch-independence probe (batch_independence)
tests that on a few inputs, and a layer can pass it while mixing examples on others (only for
batches larger than the probe's, only after some training calls, only on large inputs). So
`clipping="auto"` takes the fast path only when every layer of the model is known to act per
example:

* Keras' own layers whose call acts on each example alone: the layers with a ghost-norm rule
  (fast_clipping/rules, keras_hub's included), other Keras layers with parameters that act
  per example (convolutions, attention, recurrent layers and their cells, per-example
  normalizations), and parameter-free ones (activations, reshapes, dropout, pooling, merges).
  The class must be exactly the Keras class: a subclass may change what `call` does. A layer
  with an `axis` must not act along the batch axis (Softmax(axis=0) mixes), and a
  BatchNormalization must be frozen (inference mode, fixed statistics);
* Sequential and functional models (their graphs' operations too: the elementwise `keras.ops`
  a functional model may apply between layers);
* any layer, layer class or model the user declared with `declare_per_example`, with the
  reason in their own words (a declared layer is trusted as a whole, its sublayers included).

Any other layer (a custom layer, a `Lambda`, a subclassed model's own `call`) sends the step
to the vectorized path, which runs each example alone and is exact for any model.
"""

import functools
import sys
import threading

import keras

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.model import keras_internals

_REASON_ATTR = "_dp_per_example_reason"
_LOCK = threading.Lock()
_DECLARED_CLASSES = {}   # layer class -> the user's reason

# Keras layers (by their public name) whose call acts on each example alone.
_KERAS_PER_EXAMPLE = (
    # with parameters (ghost-norm rules, or per-example gradients inside the fast path)
    "Dense", "EinsumDense", "Embedding", "ReversibleEmbedding", "Conv1D", "Conv2D", "Conv3D",
    "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "DepthwiseConv1D",
    "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D", "LayerNormalization",
    "GroupNormalization", "RMSNormalization", "PReLU", "SimpleRNN", "LSTM", "GRU",
    "SimpleRNNCell", "LSTMCell", "GRUCell", "StackedRNNCells", "RNN", "Bidirectional",
    "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D", "TimeDistributed", "MultiHeadAttention",
    "GroupQueryAttention", "Attention", "AdditiveAttention",
    # parameter-free
    "InputLayer", "Identity", "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Dropout",
    "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianDropout",
    "GaussianNoise", "AlphaDropout", "Flatten", "Reshape", "Permute", "RepeatVector",
    "Cropping1D", "Cropping2D", "Cropping3D", "ZeroPadding1D", "ZeroPadding2D",
    "ZeroPadding3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "MaxPooling1D",
    "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
    "AveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D", "Add",
    "Subtract", "Multiply", "Average", "Maximum", "Minimum", "Concatenate", "Masking",
    "UnitNormalization", "Rescaling", "Normalization", "BatchNormalization",
)

# Elementwise keras.ops a functional graph may hold between its layers (by class name).
_ELEMENTWISE_OPS = frozenset((
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Negative", "Abs", "Absolute",
    "Square", "Sqrt", "Rsqrt", "Exp", "Expm1", "Log", "Log1p", "Tanh", "Sin", "Cos", "Sign",
    "Maximum", "Minimum", "Power", "Clip", "Cast", "Relu", "Relu6", "Sigmoid", "Silu",
    "Gelu", "Softplus", "Elu", "Selu", "LeakyRelu",
))

_CONTAINERS = (keras.Sequential, keras_internals.functional_class())


def declare_per_example(layer_or_class, reason):
  """Declares that a layer (or every layer of a class) acts on each example alone.

  Under `clipping="auto"` the fast (ghost-norm) path is taken only when every layer of the
  model is known to act per example (Keras' own per-example layers) or declared so here;
  any other layer, a custom or `Lambda` layer included, sends the step to the vectorized
  path, which runs each example alone. The declaration is the user's statement, on their
  own responsibility: if the layer makes one example's output depend on another example of
  the batch (a batch statistic, a branch on the batch size, state kept across calls), one
  example can move the clipped sum by more than the clip and the privacy guarantee is void.
  A declared layer is trusted as a whole, its sublayers included. A class declaration covers
  instances of exactly that class (not its subclasses, whose `call` may differ).

  Args:
    layer_or_class: a keras.layers.Layer (a model too), or a Layer subclass.
    reason: a non-empty string, in the user's own words: why the layer's output for an
      example depends on that example alone (kept with the layer or class:
      `declarations(model)` lists them).

  Returns:
    layer_or_class, so that it can wrap a layer where it is built.

  Raises:
    ParameterTypeError: layer_or_class is neither a Layer nor a Layer subclass.
    ParameterValueError: reason is not a non-empty string.
  """
  if not isinstance(reason, str) or not reason.strip():
    raise ParameterValueError(
        "`reason` must be a non-empty string saying, in your own words, why the layer's "
        f"output for an example depends on that example alone. Received: reason={reason!r}")
  if isinstance(layer_or_class, type) and issubclass(layer_or_class, keras.layers.Layer):
    with _LOCK:
      _DECLARED_CLASSES[layer_or_class] = reason.strip()
  elif isinstance(layer_or_class, keras.layers.Layer):
    object.__setattr__(layer_or_class, _REASON_ATTR, reason.strip())
  else:
    raise ParameterTypeError(
        "`layer_or_class` must be a keras.layers.Layer or a Layer subclass. "
        f"Received: layer_or_class={layer_or_class!r}")
  return layer_or_class


def declared_reason(layer):
  """The reason `layer` was declared per example with (its own, else its class's), or None.

  Args:
    layer: a keras.layers.Layer.

  Returns:
    the user's reason (str), or None if neither the layer nor its exact class was declared.
  """
  reason = getattr(layer, _REASON_ATTR, None)
  if reason is not None:
    return reason
  with _LOCK:
    return _DECLARED_CLASSES.get(type(layer))


def _keras_classes():
  """The Keras layer classes of _KERAS_PER_EXAMPLE present in this Keras, plus the classes
  with a ghost-norm rule of keras_hub (those whose module the user imported)."""
  classes = {getattr(keras.layers, name, None) for name in _KERAS_PER_EXAMPLE}
  from tf_dpiter.keras.fast_clipping.rules import keras_hub  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.layers import scattering  # pylint: disable=g-import-not-at-top
  classes.add(scattering.Scattering2D)   # the library's own: fixed filters, per example
  for module_name, rules in keras_hub.RULES.items():
    module = sys.modules.get(module_name)
    if module is not None:
      classes.update(getattr(module, class_name, None) for class_name in rules)
  classes.discard(None)
  return classes


def _input_rank(layer):
  """The rank of `layer`'s (first) input where a graph fixes it, else None."""
  try:
    inputs = layer.input
  except (AttributeError, ValueError):
    return None
  first = keras.tree.flatten(inputs)[0] if inputs is not None else None
  shape = getattr(first, "shape", None)
  return None if shape is None else len(shape)


def _acts_off_batch_axis(layer):
  """False if the layer's `axis` is, or may be, the batch axis 0."""
  if isinstance(layer, keras.layers.BatchNormalization):
    return not layer.trainable   # frozen: the moving statistics, fixed within a step
  if isinstance(layer, (keras.layers.Normalization, keras.layers.Rescaling)):
    return True   # fixed statistics: their axis is the kept one, not a reduced one
  axis = getattr(layer, "axis", None)
  if axis is None:
    return True
  axes = [axis] if isinstance(axis, int) else list(axis)
  if all(a > 0 for a in axes):
    return True
  rank = _input_rank(layer)
  return rank is not None and all((a % rank) != 0 for a in axes)


@functools.lru_cache(maxsize=None)
def _keras_activations():
  """Keras' own activation functions (each acts along the last axis, not the batch's)."""
  names = [n for n in dir(keras.activations)
           if not n.startswith("_") and n not in ("get", "serialize", "deserialize")]
  return frozenset(getattr(keras.activations, n) for n in names)


def _known_keras_layer(layer, keras_classes):
  """Whether `layer` is exactly one of the known Keras classes, off the batch axis, with
  Keras' own activations and its class's own `call` (not one set on the instance)."""
  if type(layer) not in keras_classes or "call" in vars(layer):
    return False
  activations = _keras_activations()
  for attr in ("activation", "recurrent_activation"):
    fn = getattr(layer, attr, None)
    if fn is not None and fn not in activations:
      return False   # a function of the user's: it could mix the batch
  return _acts_off_batch_axis(layer)


def _is_plain_container(layer):
  """A Sequential or functional model whose call is Keras' own (its graph is walked)."""
  return any(isinstance(layer, cls) and type(layer).call is cls.call for cls in _CONTAINERS)


def _graph_operations(model):
  """The non-layer nodes of a functional graph (keras.ops applied to KerasTensors)."""
  found = keras_internals.functional_graph(model)
  if found is None:
    return []
  _, by_depth = found
  return [node for nodes in by_depth.values() for node in nodes
          if not node.is_input and not isinstance(node.operation, keras.layers.Layer)]


def _known_operation(node):
  """Whether a graph operation acts per example: an elementwise op, or an indexing
  `x[:, ...]` that keeps the whole batch axis."""
  name = type(node.operation).__name__
  if name in _ELEMENTWISE_OPS:
    return True
  if name != "GetItem":
    return False
  args = getattr(getattr(node, "arguments", None), "args", ())
  key = args[1] if len(args) > 1 else None
  first = key[0] if isinstance(key, tuple) and key else key
  return first == slice(None, None, None)


def _collect_unknown(layer, keras_classes, out):
  """Appends to `out` the names of the layers and operations under `layer` that are neither
  known nor declared per example."""
  if declared_reason(layer) is not None:
    return
  if _is_plain_container(layer):
    out.extend(node.operation.name for node in _graph_operations(layer)
               if not _known_operation(node))
  elif not _known_keras_layer(layer, keras_classes):
    out.append(layer.name)
    return
  for sub in keras_internals.flatten_layers(layer, include_self=False, recursive=False):
    _collect_unknown(sub, keras_classes, out)


def undeclared_layers(model):
  """Names of the layers (and graph operations) of `model` not known to act per example.

  Args:
    model: a keras.Model (or a layer).

  Returns:
    a tuple of names in model order, each once; empty when every layer is a known
    per-example Keras layer or declared with `declare_per_example`.
  """
  out = []
  _collect_unknown(model, _keras_classes(), out)
  return tuple(dict.fromkeys(out))


def declarations(model):
  """The user's declarations met in `model`: {layer name: reason}.

  Args:
    model: a keras.Model.

  Returns:
    a dict, empty when nothing in the model was declared.
  """
  found = {}
  for layer in keras_internals.flatten_layers(model, include_self=True):
    reason = declared_reason(layer)
    if reason is not None:
      found[layer.name] = reason
  return found
