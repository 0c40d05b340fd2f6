"""Which layers act on each example alone: the fast path's allowlist.

The fast (ghost-norm) path runs the whole batch through the model once, so its clipped sum
bounds one example's influence by C only if example i's loss is a function of example i
alone (McMahan et al. 2018, Section 2). A layer can pass the batch-independence probe and
still mix on other inputs, so `clipping="auto"` takes the fast path only when every layer is
known to act per example:

* exactly (not a subclass of) a Keras layer class whose call acts per example (the layers
  with a ghost-norm rule, per-example parametric layers, parameter-free ones), with no `axis`
  on the batch axis and no trainable BatchNormalization;
* the keras_hub layers of _KERAS_HUB_PER_EXAMPLE, read in keras_hub's source, for a version
  read (_KERAS_HUB_READ) and only when the user imported keras_hub;
* Sequential and functional models (their graphs' elementwise `keras.ops` too); a layer the
  graph does not run (a keras_hub task's preprocessor) is not checked;
* what the user declared with `declare_per_example` (trusted as a whole, sublayers included).

Anything else sends the step to the vectorized path, exact for any model.
"""

import functools
import sys
import threading

import keras

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.internals import keras_internals

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

# keras_hub layers whose `call` was read (keras_hub 0.32.0) and acts on each example alone:
# defining module -> {class name: why}; exactly these classes, for the versions of
# _KERAS_HUB_READ only (sublayers are checked on their own). Shared by all: no reduction, sort
# or statistic over the batch axis, no state across calls reaching the output (generation
# caches are per-example inputs and outputs), per-example masks, dropout through
# keras.layers.Dropout; the serving-only vLLM route is not a training path. Backbones and
# tasks are functional models: walked as containers, graph ops included.
_KERAS_HUB_PER_EXAMPLE = {
    "keras_hub.src.layers.modeling.transformer_encoder": {
        "TransformerEncoder": (
            "BERT's block: self-attention (keras MultiHeadAttention) on x with the mask "
            "merge_padding_and_attention_mask gives: the [B, T] padding mask expanded to "
            "[B, 1, T], or the [B, T, T] attention mask, min of both; residual adds, "
            "LayerNormalization, Dense -> Dense (the activation is the intermediate Dense's, "
            "checked there), Dropout; every op is per example"),
    },
    "keras_hub.src.layers.modeling.transformer_decoder": {
        "TransformerDecoder": (
            "self-attention (CachedMultiHeadAttention) with the per-example padding/attention "
            "mask min the causal mask (compute_causal_mask: a [T, S] pattern broadcast to the "
            "batch), optional cross-attention on the example's own encoder_sequence and its "
            "[B, S] mask, residual adds, LayerNormalization, Dense -> Dense, Dropout; a cache "
            "is an input and output of the call, one row per example"),
    },
    "keras_hub.src.layers.modeling.cached_multi_head_attention": {
        "CachedMultiHeadAttention": (
            "keras MultiHeadAttention with only `call` overridden: the query/key/value "
            "EinsumDense projections, an optional cache [B, 2, S, H, D] updated with "
            "slice_update at [0, index, 0, 0] (each example its own row), then Keras' own "
            "_compute_attention (softmax over the key axis, masked per example) and the "
            "output projection"),
    },
    "keras_hub.src.layers.modeling.position_embedding": {
        "PositionEmbedding": (
            "the table's rows start_index..start_index+T (or P[positions], positions [T] or "
            "[B, T]) broadcast to the input's shape: the output does not depend on the batch"),
    },
    "keras_hub.src.layers.modeling.reversible_embedding": {
        "ReversibleEmbedding": (
            "`class ReversibleEmbedding(keras.layers.ReversibleEmbedding): pass`: Keras' "
            "lookup (or x @ E^T with reverse=True), row by row"),
    },
    "keras_hub.src.layers.modeling.token_and_position_embedding": {
        "TokenAndPositionEmbedding": (
            "keras.layers.ReversibleEmbedding(ids) + PositionEmbedding(of that, start_index or "
            "positions), the token embedding's mask kept: per example"),
    },
    "keras_hub.src.layers.modeling.rotary_embedding": {
        "RotaryEmbedding": (
            "rotates each (position, feature pair) by an angle of the position alone "
            "(arange(T) + start_index, or the given [T] / [B, T] positions) times fixed "
            "inverse frequencies; no weights; its sequence_axis and feature_axis must not be "
            "the batch axis (checked)"),
    },
    "keras_hub.src.models.gemma.rms_normalization": {
        "RMSNormalization": (
            "Gemma's: x / sqrt(mean(x^2 over the last axis) + eps) * (1 + scale), per token"),
    },
    "keras_hub.src.models.gemma.gemma_attention": {
        "CachedGemmaAttention": (
            "EinsumDense q/k/v ('btd,ndh->btnh', 'bsd,kdh->bskh'), RotaryEmbedding, an "
            "optional cache updated per row (slice_update at [0, index, 0, 0]), the "
            "sliding-window band (a [T, S] pattern) and'ed with the per-example mask, logits "
            "einsum 'btkgh,bskh->bkgts' (batch kept), optional tanh soft cap, Keras Softmax "
            "over the key axis, Dropout, 'bkgts,bskh->btkgh', rows with no attended key set "
            "to 0 (all over the key axis), output EinsumDense; on GPU/TPU the fused "
            "ops.dot_product_attention, batched per example"),
    },
    "keras_hub.src.models.gemma.gemma_decoder_block": {
        "GemmaDecoderBlock": (
            "RMSNormalization, the per-example padding mask min a causal [T, S] mask, "
            "CachedGemmaAttention, optional RMSNormalization and Dropout, residual add, "
            "RMSNormalization, two EinsumDense 'btd,df->btf', gelu(x1, approximate=True) * "
            "x2, EinsumDense 'btf,fd->btd', optional RMSNormalization, residual add"),
    },
}
# keras_hub versions whose source the classes above were read in (major.minor).
_KERAS_HUB_READ = ("0.32",)
# keras_hub activation functions read (module -> names): elementwise.
_KERAS_HUB_ACTIVATIONS = {
    "keras_hub.src.utils.keras_utils": (
        "gelu_approximate",   # keras.activations.gelu(x, approximate=True): BERT's
    ),
}
# Layers whose axis attributes are not `axis` (by class name) -> (attribute names, the
# smallest input rank the layer accepts): keras_hub's RotaryEmbedding refuses equal or
# out-of-range sequence and feature axes, so its input has rank >= 2.
_OTHER_AXES = {"RotaryEmbedding": (("sequence_axis", "feature_axis"), 2)}
# The smallest rank of what a layer of _KERAS_HUB_PER_EXAMPLE passes its own sublayers (built
# inside, no graph node gives it): [B, T, D] to the blocks' LayerNormalization(axis=-1),
# [B, K, G, T, S] to CachedGemmaAttention's Softmax(axis=-1); axis=-1 is the batch axis only
# at rank 1.
_KERAS_HUB_SUBLAYER_MIN_RANK = 2

# Elementwise keras.ops a functional graph may hold between its layers (by class name).
_ELEMENTWISE_OPS = frozenset((
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Negative", "Abs", "Absolute",
    "Square", "Sqrt", "Rsqrt", "Exp", "Expm1", "Log", "Log1p", "Tanh", "Sin", "Cos", "Sign",
    "Maximum", "Minimum", "Power", "Clip", "Cast", "Relu", "Relu6", "Sigmoid", "Silu",
    "Gelu", "Softplus", "Elu", "Selu", "LeakyRelu",
))

_CONTAINERS = (keras.Sequential, keras_internals.functional_class())


def declare_per_example(layer_or_class, reason):
  """Declares that a layer (or every layer of exactly that class) acts on each example alone,
  so that `clipping="auto"` may take the fast (ghost-norm) path through it.

  The declaration is the user's statement, on their own responsibility: if the layer makes
  one example's output depend on another example of the batch (a batch statistic, a branch on
  the batch size, state kept across calls), one example can move the clipped sum by more than
  the clip and the privacy guarantee is void. A declared layer is trusted as a whole, its
  sublayers included; a class declaration does not cover subclasses. The batch-independence
  probe cannot catch a declared layer whose mixing of records depends on the data (a layer
  that mixes records only when some input exceeds a threshold passes a probe of ordinary
  inputs: one outlier then moved `train_on_batch`'s clipped sum by 13.6 C): the declaration
  is the user's claim, and the probe only a second line of defence.

  Args:
    layer_or_class: a keras.layers.Layer (a model too), or a Layer subclass.
    reason: a non-empty string, in the user's own words: why the layer's output for an
      example depends on that example alone.

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


# Sources of more per-example classes, registered by the sub-packages that define them (the
# library's own layers, the ghost-norm rules for keras_hub): this module imports none of them.
_CLASS_SOURCES = []


def add_class_source(source):
  """Registers a source of layer classes known to act per example (the library's own layers and
  keras_hub's classes with a ghost-norm rule, given by the package root so that this lowest
  Keras sub-package imports neither).

  Args:
    source: a callable returning an iterable of classes (None entries are ignored); called
      each time the known classes are read.

  Returns:
    None.

  Raises:
    ParameterTypeError: `source` is not callable.
  """
  if not callable(source):
    raise ParameterTypeError(f"`source` must be callable (returning layer classes). Received: "
                             f"source={source!r}")
  with _LOCK:
    if source not in _CLASS_SOURCES:
      _CLASS_SOURCES.append(source)


def _keras_classes():
  """The Keras layer classes of _KERAS_PER_EXAMPLE present in this Keras, plus the classes
  the registered sources give (`add_class_source`: the library's own layers, the classes
  with a ghost-norm rule of keras_hub whose module the user imported)."""
  classes = {getattr(keras.layers, name, None) for name in _KERAS_PER_EXAMPLE}
  with _LOCK:
    sources = tuple(_CLASS_SOURCES)
  for source in sources:
    classes.update(source())
  classes.update(_keras_hub_classes())
  classes.discard(None)
  return classes


def _keras_hub_classes():
  """The keras_hub classes read (_KERAS_HUB_PER_EXAMPLE) whose module the user imported
  (empty without keras_hub or for a version not read)."""
  found = (getattr(module, name, None)
           for module, names in _keras_hub_read(_KERAS_HUB_PER_EXAMPLE) for name in names)
  return frozenset(cls for cls in found if cls is not None)


def _keras_hub_read(table):
  """[(module, names read)] of the keras_hub modules of `table` the user imported; empty when
  keras_hub is not imported or its version was not read. Never imports keras_hub."""
  version = getattr(sys.modules.get("keras_hub.src.version"), "__version__", None)
  if not isinstance(version, str) or ".".join(version.split(".")[:2]) not in _KERAS_HUB_READ:
    return []
  return [(sys.modules[name], tuple(names)) for name, names in table.items()
          if sys.modules.get(name) is not None]


def _input_rank(layer):
  """The rank of `layer`'s (first) input where a graph fixes it, else None."""
  try:
    inputs = layer.input
  except (AttributeError, ValueError):
    return None
  first = keras.tree.flatten(inputs)[0] if inputs is not None else None
  shape = getattr(first, "shape", None)
  return None if shape is None else len(shape)


def _acts_off_batch_axis(layer, min_rank=1):
  """False if the layer's `axis` (or its other axis attributes, _OTHER_AXES) is, or may be,
  the batch axis 0, its input having rank >= min_rank."""
  if isinstance(layer, keras.layers.BatchNormalization):
    return not layer.trainable   # frozen: the moving statistics, fixed within a step
  if isinstance(layer, (keras.layers.Normalization, keras.layers.Rescaling)):
    return True   # fixed statistics: their axis is the kept one, not a reduced one
  attrs, own_min_rank = _OTHER_AXES.get(type(layer).__name__, (("axis",), 1))
  min_rank = max(min_rank, own_min_rank)
  axes = []
  for attr in attrs:
    axis = getattr(layer, attr, None)
    if axis is not None:
      axes.extend([axis] if isinstance(axis, int) else list(axis))
  if all(a > 0 or 0 < -a < min_rank for a in axes):   # -a < min_rank <= rank: a % rank != 0
    return True
  rank = _input_rank(layer)
  return rank is not None and all((a % rank) != 0 for a in axes)


@functools.lru_cache(maxsize=None)
def _keras_activations():
  """Keras' own activation functions (each acts along the last axis, not the batch's)."""
  names = [n for n in dir(keras.activations)
           if not n.startswith("_") and n not in ("get", "serialize", "deserialize")]
  return frozenset(getattr(keras.activations, n) for n in names)


def _known_activations():
  """Keras' own activation functions, and keras_hub's read ones (_KERAS_HUB_ACTIVATIONS)."""
  found = [getattr(module, name, None)
           for module, names in _keras_hub_read(_KERAS_HUB_ACTIVATIONS) for name in names]
  return _keras_activations().union(fn for fn in found if fn is not None)


def _known_keras_layer(layer, keras_classes, min_rank=1):
  """Whether `layer` is exactly one of the known Keras classes, off the batch axis (its input
  of rank >= min_rank), with Keras' own activations and its class's own `call` (not one set
  on the instance)."""
  if type(layer) not in keras_classes or "call" in vars(layer):
    return False
  activations = _known_activations()
  for attr in ("activation", "recurrent_activation"):
    fn = getattr(layer, attr, None)
    if fn is not None and fn not in activations:
      return False   # a function of the user's: it could mix the batch
  return _acts_off_batch_axis(layer, min_rank)


def _is_plain_container(layer):
  """A Sequential or functional model whose call is Keras' own (its graph is walked)."""
  return any(isinstance(layer, cls) and type(layer).call is cls.call for cls in _CONTAINERS)


def _graph_parts(found):
  """(the non-layer nodes: keras.ops on KerasTensors, the ids of the layers the call runs) of
  a functional graph (`found`: `functional_graph`), or ([], None) without a graph (then every
  sublayer is checked). A tracked layer the graph does not run (a keras_hub preprocessor)
  does not decide the clipping path."""
  if found is None:
    return [], None
  nodes = [node for nodes in found[1].values() for node in nodes]
  return ([node for node in nodes
           if not node.is_input and not isinstance(node.operation, keras.layers.Layer)],
          {id(node.operation) for node in nodes})


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


def _collect_unknown(layer, keras_classes, hub_classes, children, out, min_rank=1):
  """Appends to `out` the names of the layers and operations under `layer` that are neither
  known nor declared per example (children: `keras_internals.layer_children` of the model;
  min_rank: the smallest rank of `layer`'s input, where its parent fixes it)."""
  if declared_reason(layer) is not None:
    return
  in_graph = None
  if _is_plain_container(layer):
    operations, in_graph = _graph_parts(keras_internals.functional_graph(layer))
    out.extend(node.operation.name for node in operations if not _known_operation(node))
  elif not _known_keras_layer(layer, keras_classes, min_rank):
    out.append(layer.name)
    return
  sub_rank = _KERAS_HUB_SUBLAYER_MIN_RANK if type(layer) in hub_classes else 1
  for sub in children[id(layer)]:
    if in_graph is not None and id(sub) not in in_graph:
      continue   # tracked but never run by the model's call (a keras_hub task's preprocessor)
    _collect_unknown(sub, keras_classes, hub_classes, children, out, sub_rank)


def undeclared_layers(model):
  """Names of the layers (and graph operations) of `model` not known to act per example.

  Args:
    model: a keras.Model (or a layer).

  Returns:
    a tuple of names in model order, each once; empty when every layer is a known
    per-example Keras layer or declared with `declare_per_example`.
  """
  out = []
  _collect_unknown(model, _keras_classes(), _keras_hub_classes(),
                   keras_internals.layer_children(model), out)
  return tuple(dict.fromkeys(out))

