"""Batch independence, verified rather than assumed (McMahan et al. 2018, Sections 2 and 7).

Per-example clipping bounds one example's influence on the clipped sum by C only if example
i's loss is a function of example i alone: L_i(theta; x_i, y_i). The vectorized path makes
this true by construction; the fast (ghost-norm) path runs the whole batch at once, so a
layer whose output row i depends on row j lets example j move every other example's gradient
(measured: 2.85C for one removed example on a batch-centering `Lambda`).

The probe (`batch_mixing_layers`) runs the model in training mode (dropout seed states
restored between runs) on a batch and on the same batch with its last example replaced, and
names every layer whose output rows for the *other* examples moved while its input rows did
not (subclassed models: the model as a whole). `probe_model` caches the verdict per model and
batch size; the train step probes at the batch sizes it really uses.

It is the second line of defence (the fast path also needs every layer known per example:
per_example). It catches deterministic mixing on the probe inputs in training mode (mixing
only in inference mode does not move the clipped sum). It cannot catch mixing only through
randomness, only on inputs far from the probe's, in the loss function, or below `atol`: a
passing probe is evidence, not proof (`tf_dpiter.auditing.check_sensitivity` measures the
real step).
"""

import contextlib
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals

_PROBE_BATCH = 4
_CACHE_ATTR = "_dp_batch_mixing_verdict"
_PROBED_ATTR = "_dp_batch_mixing_probed"   # the (batch size, real data) probes already run
_LAYERS_ATTR = "_dp_batch_mixing_layers"   # the layers (and flags) the cached verdict saw
PROBE_ROWS_ATTR = "_dp_probe_rows"   # the first rows of fit's array data (DPModelMixin.fit)
PROBE_SECONDS_ATTR = "_dp_probe_seconds"   # wall seconds the probes of a model took in all


def check_no_batch_mixing(model):
  """Refuses a trainable BatchNormalization in `model`, which mixes examples in training mode.

  Raises:
    PrivacyConfigError: naming the layer and the fix.
  """
  norms = trainable_batch_norms(model)
  if norms:
    raise PrivacyConfigError(
        f"layer {norms[0].name!r} is a BatchNormalization in training mode: it mixes the examples "
        "of a batch, so per-example clipping does not bound one example's influence. Freeze it "
        "(layer.trainable = False) or use LayerNormalization/GroupNormalization")


# Constructor values that make a preprocessing layer's state public (not adapted).
_GIVEN_STATE = ("mean", "vocabulary", "bin_boundaries")


def warn_adapted_layers(model):
  """Warns about preprocessing layers of `model` whose state comes from `adapt` (a
  Normalization's mean and variance, a lookup's vocabulary, a Discretization's bins): adapted
  on the private training data, that state is released unclipped and un-noised (a
  Normalization's mean moves by (x - mean) / n with one record), outside the guarantee."""
  adapted = []
  for layer in keras_internals.flatten_layers(model, include_self=False):
    if not callable(getattr(layer, "adapt", None)):
      continue
    config = layer.get_config()
    if not any(config.get(key) is not None for key in _GIVEN_STATE):
      adapted.append(layer.name)
  if adapted:
    warnings.warn(
        f"layers {adapted} hold state set by adapt() (statistics, vocabularies, bins): if it "
        "was adapted on the private training data it is released with the model unclipped "
        "and un-noised, and the privacy guarantee does not cover it. Adapt them on public "
        "data, or give the values (mean=/variance=, vocabulary=, bin_boundaries=) from a "
        "public source", UserWarning, stacklevel=3)


def trainable_batch_norms(model):
  """The trainable BatchNormalization layers of `model` (they mix examples in training)."""
  return [layer for layer in keras_internals.flatten_layers(model, include_self=False)
          if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]


def _rows_moved(a, b, n, atol):
  """True if rows 0..n-2 of a and b differ by more than atol * (1 + max|a|)."""
  a = np.asarray(a, np.float64) if not isinstance(a, np.ndarray) else a.astype(np.float64)
  b = np.asarray(b, np.float64)
  if not a.ndim or a.shape[0] != n:
    return False
  scale = 1.0 + float(np.max(np.abs(a))) if a.size else 1.0
  return not np.allclose(a[:-1], b[:-1], atol=atol * scale, rtol=0)


def _replace_last(x, seed):
  """x with its last example replaced by noise (floats) or other values (integers)."""
  rng = np.random.RandomState(seed)
  x = np.array(x, copy=True)
  if np.issubdtype(x.dtype, np.floating):
    x[-1] = rng.randn(*x.shape[1:]) * (np.std(x) + 1.0)
  elif np.issubdtype(x.dtype, np.integer):
    x[-1] = (x[-1] + 1 + rng.randint(0, 2, size=x.shape[1:])) % max(2, int(np.max(x)) + 1)
  else:
    x[-1] = x[0]
  return x


def _graph_nodes(model):
  """(functional graph, its non-input nodes in topological order), or None (subclassed)."""
  found = keras_internals.functional_graph(model)
  if found is None:
    return None
  graph, by_depth = found
  nodes = [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]
           if not node.is_input]
  return graph, nodes


def batch_mixing_layers(model, x, atol=1e-6, training=False):
  """Names of the layers that make one example's activations depend on another example.

  Each layer's outputs and inputs are compared between x and x with its last example
  replaced; a layer whose output rows for the other examples moved while its input rows did
  not is named. With training=True the model's non-trainable variables (seed-generator
  states, statistics) are restored before each run and after both (`_state_restored`).

  Args:
    model: a keras.Model (functional, Sequential or subclassed), built or buildable on x.
    x: a batch (array, or a list of arrays for several inputs) of at least 2 examples.
    atol: tolerance, relative to 1 + the largest |output| of each layer (16-bit compute
      dtypes are compared at max(atol, 1e-2)).
    training: run the layers in training mode (True) or inference mode (False).

  Returns:
    tuple of layer names in model order (a subclassed model mixing as a whole: its own
    name); empty when no mixing was seen.

  Raises:
    ParameterValueError: x holds fewer than 2 examples.
  """
  xs = [np.asarray(t) for t in tf.nest.flatten(x)]
  n = len(xs[0])
  if n < 2:
    raise ParameterValueError(f"x must hold at least 2 examples to probe batch mixing, got {n}")
  nodes = _graph_nodes(model)
  xs, n = _at_graph_batch(nodes, xs)
  x1 = tf.nest.pack_sequence_as(x, xs)
  x2 = tf.nest.pack_sequence_as(x, [_replace_last(t, 0) for t in xs])
  compute = keras.backend.standardize_dtype(getattr(model, "compute_dtype", "float32"))
  if compute in ("float16", "bfloat16"):
    atol = max(atol, 1e-2)
  if nodes is not None and any(t.shape[0] not in (None, n) for t in nodes[0].inputs):
    nodes = None
  if nodes is None:
    out1, out2 = _two_runs(model, x1, x2, training)
    out1, out2 = tf.nest.flatten(out1), tf.nest.flatten(out2)
    moved = any(_rows_moved(a, b, n, atol) for a, b in zip(out1, out2))
    return (model.name,) if moved else ()
  graph, nodes = nodes
  tensors = [t for node in nodes for t in list(node.output_tensors) + list(node.input_tensors)]
  # the probe takes the graph's own input structure (a nest such as {"a": a, "pair": [b, c]}
  # included), so it reads x as the model does; the flat `graph.inputs` did not match a nest
  ins = getattr(graph, "_inputs_struct", None)
  if ins is None:
    ins = graph.inputs
  if len(tf.nest.flatten(ins)) == 1:   # one input: plain tensors, no one-element lists
    ins = tf.nest.flatten(ins)[0]
    x1, x2 = tf.nest.flatten(x1)[0], tf.nest.flatten(x2)[0]
  out1, out2 = _two_runs(keras.Model(ins, tensors), x1, x2, training)
  mixing, pos = [], 0
  for node in nodes:
    k_out, k_in = len(node.output_tensors), len(node.input_tensors)
    outs_moved = any(_rows_moved(out1[j], out2[j], n, atol) for j in range(pos, pos + k_out))
    ins_moved = any(_rows_moved(out1[j], out2[j], n, atol)
                    for j in range(pos + k_out, pos + k_out + k_in))
    pos += k_out + k_in
    if outs_moved and not ins_moved and node.operation.name not in mixing:
      mixing.append(node.operation.name)
  return tuple(mixing)


def _two_runs(model, x1, x2, training):
  """model(x1) and model(x2) in inference mode, or in training mode from the same state (the
  non-trainable variables the first run wrote are assigned back before the second run)."""
  if not training:
    return model(x1, training=False), model(x2, training=False)
  with _state_restored(model) as restore:
    out1 = model(x1, training=True)   # from the state just read
    restore()
    return out1, model(x2, training=True)


def _address(t):
  """The address of an eager CPU tensor's buffer, or None (another device or dtype)."""
  if not t.dtype.is_numpy_compatible or t.dtype == tf.string or "CPU" not in t.device:
    return None
  return np.asarray(t).ctypes.data


@contextlib.contextmanager
def _state_restored(model):
  """Yields `restore`, which assigns back every non-trainable variable of `model` changed since
  the block began and returns them (also called when the block ends). Reads share the
  variables' buffers (no copy of a frozen backbone); a variable whose read still shares the
  saved buffer was not written and is not compared."""
  variables = model.non_trainable_variables
  state = [tf.convert_to_tensor(v) for v in variables]
  addresses = [_address(t) for t in state]

  def restore():
    written = []
    for v, value, address in zip(variables, state, addresses):
      now = tf.convert_to_tensor(v)
      if address is not None and _address(now) == address:
        continue   # still the saved buffer: not written (a write makes a new one)
      if not bool(tf.reduce_all(tf.equal(now, value))):
        written.append(v)
        v.assign(value)
    return written

  try:
    yield restore
  finally:
    restore()


def _at_graph_batch(nodes, xs):
  """(xs, n): xs resized to the batch size a graph was traced at (a lazily built
  Sequential), else unchanged; n its number of examples."""
  n = len(xs[0])
  fixed = [t.shape[0] for t in nodes[0].inputs if t.shape[0] is not None] if nodes else []
  if fixed and fixed[0] != n and fixed[0] >= 2:
    n = fixed[0]
    xs = [np.resize(t, (n,) + t.shape[1:]) for t in xs]
  return xs, n


def _model_inputs(model):
  """The model's symbolic inputs (functional, built Sequential), else None."""
  if not model.built:
    return None
  inputs = getattr(model, "_inputs_struct", None)
  if inputs is None:
    try:
      inputs = model.inputs
    except (AttributeError, ValueError):
      return None
    if isinstance(inputs, (list, tuple)) and len(inputs) == 1:
      inputs = inputs[0]
  return None if inputs is None or (isinstance(inputs, (list, tuple)) and not inputs) else inputs


def _probe_inputs(model, specs, seed, n=_PROBE_BATCH):
  """Random probe batch of n examples shaped like `specs` (else model.inputs); None if
  unknown."""
  if specs is None:
    inputs = _model_inputs(model)
    if inputs is None:
      return None
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), inputs)
  rng = np.random.RandomState(seed)

  def make(spec):
    shape = tuple(spec.shape)[1:]
    if any(d is None for d in shape):
      raise ParameterValueError(f"cannot probe an input of unknown shape {spec.shape}")
    dtype = tf.as_dtype(spec.dtype)
    if dtype.is_floating:
      return rng.randn(n, *shape).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
      return rng.randint(0, 2, size=(n,) + shape).astype(dtype.as_numpy_dtype)
    raise ParameterValueError(f"cannot probe an input of dtype {dtype.name}")

  try:
    return tf.nest.map_structure(make, specs)
  except ValueError:
    return None


def probe_batch_sizes(input_specs, step=None):
  """The sorted batch sizes (ints >= 2) the model really sees in the step: the traced batch's
  static size and the declared batch size, none above `max_physical_batch_size` (chunks of
  that size are probed too); (4,) when none is known."""
  sizes = set()
  for t in tf.nest.flatten(input_specs) if input_specs is not None else ():
    shape = tf.TensorShape(getattr(t, "shape", None))
    if shape.rank and isinstance(shape[0], int):
      sizes.add(shape[0])
      break
  sampling = getattr(step, "sampling", None)
  if sampling is not None:
    with tf.init_scope():
      sizes.add(int(np.ceil(float(sampling.sample_size))))
  physical = getattr(step, "max_physical_batch_size", None)
  if physical:
    sizes = {min(n, int(physical)) for n in sizes} | {int(physical)}
  sizes = {n for n in sizes if n >= 2}
  return tuple(sorted(sizes)) or (_PROBE_BATCH,)


def _real_probe_inputs(data, n):
  """A probe batch of n examples from real rows `data` (cycled when fewer), or None."""
  flat = [np.asarray(t) for t in tf.nest.flatten(data)]
  if not flat or any(t.ndim == 0 or len(t) == 0 for t in flat):
    return None
  return tf.nest.pack_sequence_as(data, [np.resize(t, (n,) + t.shape[1:]) for t in flat])


def probe_model(model, input_specs=None, seed=0, batch_size=None, data=None):
  """Cached batch-independence verdict of `model`: the tuple of mixing layers' names.

  Runs `batch_mixing_layers` (eagerly, in training mode) on a probe batch of `batch_size`
  examples, random and shaped like `input_specs` (default: the model's inputs) or the real
  rows `data`. Each (batch size, random or real) is probed once per model and verdicts add up
  while the model's layers and `trainable` flags stay the same (`_layers_key`). A model whose
  inputs are unknown, or that cannot run yet, is unprobed: None, not cached. The probes' wall
  seconds add up in the model's attribute `PROBE_SECONDS_ATTR`.

  Args:
    model: a built keras.Model.
    input_specs: optional nest of tf.TensorSpec / tensors giving the input shapes.
    seed: seed of the random probe batch.
    batch_size: examples in the probe batch (None: 4); at least 2.
    data: optional nest of real example rows (arrays with a leading batch axis).

  Returns:
    tuple of layer names (empty: no mixing seen), or None if the model could not be probed.
  """
  n = max(2, int(batch_size or _PROBE_BATCH))
  layers = _layers_key(model)
  if getattr(model, _LAYERS_ATTR, None) != layers:   # other layers or flags: probe afresh
    object.__setattr__(model, _CACHE_ATTR, None)
    object.__setattr__(model, _PROBED_ATTR, frozenset())
    object.__setattr__(model, _LAYERS_ATTR, layers)
  cached = getattr(model, _CACHE_ATTR, None)
  key = (n, data is not None)
  if cached or (cached is not None and key in getattr(model, _PROBED_ATTR, ())):
    return cached
  if data is not None:
    x = _real_probe_inputs(data, n)
  else:
    if input_specs is not None:
      input_specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), input_specs)
    x = _probe_inputs(model, input_specs, seed, n)
  if x is None:
    return cached
  started = time.perf_counter()
  try:
    with tf.init_scope():
      verdict = batch_mixing_layers(model, x, training=True)
  except (tf.errors.OpError, ValueError, TypeError):
    # e.g. variables created in the trace that is running (a model built lazily by the
    # first train step) cannot be read yet: unprobed, and not cached
    return cached
  finally:
    object.__setattr__(model, PROBE_SECONDS_ATTR, getattr(model, PROBE_SECONDS_ATTR, 0.0)
                       + time.perf_counter() - started)
  object.__setattr__(model, _CACHE_ATTR, verdict)
  object.__setattr__(model, _PROBED_ATTR, getattr(model, _PROBED_ATTR, frozenset()) | {key})
  if verdict:
    warn_batch_mixing(verdict)
  return verdict


def _layers_key(model):
  """What a cached verdict of `model` holds for: its layers (by identity, nested ones too)
  and their `trainable` flags (a frozen BatchNormalization runs in inference mode)."""
  return tuple((id(layer), bool(layer.trainable))
               for layer in keras_internals.flatten_layers(model, include_self=False))


def keep_probe_rows(model, x, max_rows=512):
  """Keeps on `model` a copy of the first `max_rows` rows of fit's array data `x`, for the probe
  (`probe_at_batch_size`); does nothing when x is not a nest of arrays."""
  leaves = tf.nest.flatten(x)
  if not leaves or not all(getattr(t, "shape", None) is not None and len(t.shape) > 0
                           for t in leaves):
    return
  arrays = tf.nest.map_structure(np.asarray, x)
  if any(a.ndim == 0 for a in tf.nest.flatten(arrays)):
    return   # a ragged or sparse leaf: no dense rows to keep (fit refuses it, fit_sampling)
  rows = tf.nest.map_structure(lambda a: np.array(a[:max_rows]), arrays)
  object.__setattr__(model, PROBE_ROWS_ATTR, rows)


def probe_at_batch_size(model, input_specs, step=None):
  """`probe_model` at the batch sizes the step really uses (`probe_batch_sizes`): on random
  inputs, then on fit's kept rows (`keep_probe_rows`); None if unprobed."""
  rows = getattr(model, PROBE_ROWS_ATTR, None)
  verdict = None
  for n in probe_batch_sizes(input_specs, step):
    verdict = probe_model(model, input_specs, batch_size=n)
    if rows is not None and verdict is not None and not verdict:
      verdict = probe_model(model, input_specs, batch_size=n, data=rows)
    if verdict is None or verdict:
      return verdict
  return verdict


def warn_batch_mixing(layers, stacklevel=4):
  """Warns that `layers` mix the examples of a batch, and what clipping="auto" does then.

  The vectorized path runs each record alone: a layer computing a batch statistic computes it
  over one example in training, while evaluate and predict run whole batches, so the model
  trained is not the one evaluated. Per-example clipping stays exact (the privacy holds)."""
  warnings.warn(
      f"layers {list(layers)} make one example's activations depend on the other examples "
      "of the batch. Under clipping='auto' the private step runs each example alone "
      "(vectorized path, so that clipping bounds each example's influence): in training "
      f"{list(layers)} see a batch of one example (a batch mean is the example itself, and "
      "x - mean(x) is 0), while evaluate and predict run them on whole batches. Replace them "
      "by per-example layers (LayerNormalization, a statistic fixed beforehand from public "
      "data), or pass clipping='vectorized' if training on single examples is what you mean",
      UserWarning, stacklevel=stacklevel)
