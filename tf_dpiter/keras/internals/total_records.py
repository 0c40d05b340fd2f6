"""A private step that no record's value can stop: out-of-range ids and labels contribute zero.

The private step's output (the weights, how many steps ran, whether the run ended, the error
text) is (epsilon, delta)-DP, add/remove one example, unit = example (Dwork and Roth, "The
Algorithmic Foundations of Differential Privacy", Definition 2.4, applied to the whole run's
outcome). An op that raises on one record's value (an Embedding's gather of an id outside
[0, input_dim), sparse softmax cross-entropy of a label outside [0, classes)) stops the run on
D and not on D' = D without that record, with probability q per step: a release outside the
guarantee. So within the private training step only (evaluate and predict keep Keras'
behaviour):

* `guard_embedding_ids`: for each Embedding fed directly by a model input, an example with
  an id outside [0, input_dim) (or a non-finite float id) is masked (its example weight 0:
  it contributes zero, as a padding row) and its ids are replaced by 0 so the gather cannot
  raise. The test reads the example alone: the mask is a function of that example.
* `sparse_labels_guarded`: while the private step's compiled loss runs, Keras' sparse
  categorical cross-entropy (the class, the function, or the string) replaces a label
  outside [0, classes) (classes = y_pred's static last dimension; `ignore_class` kept) by 0
  and multiplies that example's loss by 0: the example contributes zero.

Known limits: an Embedding reached through another layer (a StringLookup, a Lambda, a
subclassed model's call) and other ops that raise on a value are not guarded; validate such
inputs on a public schema before fit.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals

_SPARSE_CE = keras.losses.sparse_categorical_crossentropy


def _in_range(ids, upper):
  """Elementwise: the id Keras takes from `ids` (an integer, or a float truncated toward
  zero as its int32 cast does) is in [0, upper); False for NaN.

  Compared exactly whatever the dtype: `upper` is never cast into a type it does not fit
  (a uint8 id against 256 classes: every id is below it; cast, 256 would wrap to 0)."""
  if ids.dtype.is_integer:
    below = (tf.ones_like(ids, tf.bool) if upper > ids.dtype.max
             else ids < tf.constant(upper, ids.dtype))
    if ids.dtype.is_unsigned:
      return below
    return tf.logical_and(ids >= tf.zeros([], ids.dtype), below)
  wide = tf.float64 if ids.dtype == tf.float64 or upper > 2 ** 24 else tf.float32
  ids = tf.cast(ids, wide)   # exact: a float16 / bfloat16 / float32 value widens exactly
  return tf.logical_and(ids > tf.constant(-1.0, wide), ids < tf.constant(upper, wide))


def _per_example(ok):
  """[B, ...] bool -> [B]: every entry of the example is True."""
  if ok.shape.rank is None or ok.shape.rank <= 1:
    return ok
  return tf.reduce_all(ok, axis=list(range(1, ok.shape.rank)))


def embedding_inputs(model):
  """The model's flat input positions that feed an Embedding directly, with the smallest
  input_dim among the Embeddings each feeds: {position: input_dim}; {} for a model without
  a functional graph (subclassed) or without such an Embedding.

  Args:
    model: a keras.Model.

  Returns:
    dict {int: int}.
  """
  graph = keras_internals.functional_graph(model)
  if graph is None:
    return {}
  functional, by_depth = graph
  inputs = tf.nest.flatten(getattr(functional, "inputs", None) or [])
  found = {}
  for nodes in by_depth.values():
    for node in nodes:
      layer = getattr(node, "operation", None)
      if not isinstance(layer, keras.layers.Embedding):
        continue
      for tensor in tf.nest.flatten(getattr(node, "input_tensors", []) or []):
        for pos, source in enumerate(inputs):
          if tensor is source:
            found[pos] = min(found.get(pos, layer.input_dim), int(layer.input_dim))
  return found


def guard_embedding_ids(model, x, found=None):
  """x with the ids of out-of-range examples replaced by 0, and the examples' validity.

  Args:
    model: the DP keras.Model.
    x: the batch's inputs (a nest of [B, ...] tensors, as the model takes them).
    found: `embedding_inputs(model)`, when the caller holds it (the train step reads it once
      per train function); None: read here.

  Returns:
    (x, valid): `valid` float32 [B], 1 for an example whose ids feeding an Embedding directly
    are all in [0, input_dim), 0 else; None (x unchanged) when no input feeds an Embedding.

  Raises:
    PrivacyConfigError: x has fewer inputs than the model's positions that feed an
      Embedding (the ids could not be found, so not checked).
  """
  if found is None:
    found = embedding_inputs(model)
  if not found:
    return x, None
  keys = _input_keys(model, x)
  flat = x if keys is not None else tf.nest.flatten(x)
  if keys is None:
    keys = list(range(len(flat)))
    if max(found) >= len(flat):
      raise PrivacyConfigError(
          f"The batch must match the inputs of the model {model.name!r} (a list, a tuple or "
          "a dict keyed by the inputs' names), so that the ids of each Embedding fed by an "
          f"input can be checked against its vocabulary. Received: {len(flat)} input "
          f"tensor(s) for the model's input positions {sorted(found)}")
  flat = dict(flat) if isinstance(flat, dict) else flat
  valid = None
  for pos, input_dim in sorted(found.items()):
    ids = flat[keys[pos]]
    if isinstance(ids, np.ndarray):   # an eager step (train_on_batch) is handed the arrays
      ids = tf.convert_to_tensor(ids)
    if not isinstance(ids, tf.Tensor) or not (ids.dtype.is_integer or ids.dtype.is_floating):
      continue
    ok = _in_range(ids, input_dim)
    flat[keys[pos]] = tf.where(ok, ids, tf.zeros_like(ids))
    example_ok = _per_example(ok)
    valid = example_ok if valid is None else tf.logical_and(valid, example_ok)
  if valid is None:
    return x, None
  if isinstance(flat, dict):
    return flat, tf.cast(valid, tf.float32)
  return tf.nest.pack_sequence_as(x, flat), tf.cast(valid, tf.float32)


def _input_keys(model, x):
  """For a dict batch given to a model built on a list of inputs (Keras maps it by the
  inputs' names): the batch's key of each input position; None otherwise (the batch's
  flattened leaves are in the inputs' order)."""
  graph = keras_internals.functional_graph(model)
  if not isinstance(x, dict) or graph is None:
    return None
  struct = keras_internals.functional_inputs_struct(graph[0])
  if isinstance(struct, dict):
    return None
  names = [getattr(t, "name", None) for t in tf.nest.flatten(graph[0].inputs)]
  return names if all(name in x for name in names) else None


def _guarded_sparse_ce(fn):
  """`fn` (Keras' sparse categorical cross-entropy, per example) with out-of-range labels
  replaced by 0 and their examples' losses multiplied by 0."""

  def guarded(y_true, y_pred, **kwargs):
    y_pred = tf.convert_to_tensor(y_pred)
    classes = y_pred.shape[-1] if y_pred.shape.rank else None
    if classes is None:
      return fn(y_true, y_pred, **kwargs)
    y_true = tf.convert_to_tensor(y_true)
    ok = _in_range(y_true, classes)
    ignore = kwargs.get("ignore_class")
    if ignore is not None:
      ok = tf.logical_or(ok, tf.equal(y_true, tf.cast(ignore, y_true.dtype)))
    losses = fn(tf.where(ok, y_true, tf.zeros_like(y_true)), y_pred, **kwargs)
    example_ok = tf.cast(_per_example(ok), losses.dtype)
    if losses.shape.rank is not None and losses.shape.rank > 1:
      example_ok = tf.reshape(example_ok, [-1] + [1] * (losses.shape.rank - 1))
    return losses * example_ok

  return guarded


@contextlib.contextmanager
def sparse_labels_guarded(model, y, y_pred, sample_weight):
  """Within the block, the compiled loss's sparse categorical cross-entropies guard their
  labels (module docstring). An unbuilt compiled loss is first built from these tensors'
  shapes (as Keras builds it on its first call).

  Args:
    model: the DP keras.Model.
    y, y_pred, sample_weight: what the compiled loss is about to be called with.
  """
  compiled = getattr(model, "_compile_loss", None)
  if compiled is None:
    yield
    return
  if not compiled.built:
    keras_internals.build_compile_loss(model, y, y_pred, sample_weight)
  swapped = []
  for entry in getattr(compiled, "_flat_losses", None) or ():
    loss = entry.loss
    fn = getattr(loss, "fn", None)
    if isinstance(loss, keras.losses.Loss) and fn is _SPARSE_CE:   # a LossFunctionWrapper
      swapped.append((loss, fn))
      loss.fn = _guarded_sparse_ce(fn)
  try:
    yield
  finally:
    for loss, fn in swapped:
      loss.fn = fn
