"""A tf.data source whose elements a Python generator draws, one generator per iterator.

The contract of `tf.data.Dataset.from_generator`: each new iterator of the dataset (a Keras
epoch, a `repeat`) calls `make_generator()` once and yields that generator's elements in
order, so a sampler's state stays sequential (McMahan et al. 2018, Section 5: the sampling
that the ledger states is the one drawn). It is built from `Dataset.range`, `scan` and
`tf.numpy_function` instead: TensorFlow's GeneratorDataset kernel sets glibc's
`M_TRIM_THRESHOLD` to 128 KB for the whole process, which also freezes glibc's mmap threshold,
so every later buffer above 128 KB (the DP step's temporaries) would be mapped and unmapped on
every step.
"""

import collections
import itertools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from tf_dpiter import validation
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError

# tf.data options of the library's pipelines: no default graph rewrites. They serialize the
# dataset's graph, records included (captured constants), at the first iterator, and they
# inject a prefetch after this source, so the generator would run two elements further ahead
# than from_generator's (a shuffler starts passes earlier).
PIPELINE_OPTIONS = tf.data.Options()
PIPELINE_OPTIONS.experimental_optimization.apply_default_optimizations = False

# Iterators whose generators are kept at once. A Keras fit holds one or two; an iterator
# older than this many newer ones is refused when it asks again (never restarted silently).
MAX_LIVE_ITERATORS = 64


class _Generators:
  """The live generators of one source, keyed by an iterator token (final)."""

  def __init__(self, make_generator, specs):
    self._make = make_generator
    self._specs = specs
    self._live = collections.OrderedDict()
    self._tokens = itertools.count()
    self._lock = threading.Lock()

  def start(self):
    """A new iterator: make its generator; returns its token (int64)."""
    with self._lock:
      token = next(self._tokens)
      self._live[token] = iter(self._make())
      while len(self._live) > MAX_LIVE_ITERATORS:
        self._live.popitem(last=False)
    return np.int64(token)

  def next(self, token):
    """(True, *flat element) of the token's generator, or (False, *empty) once it ends."""
    token = int(token)
    with self._lock:
      gen = self._live.get(token)
    if gen is None:
      raise ParameterValueError(
          f"an iterator of this Python-drawn dataset was left unused while "
          f"{MAX_LIVE_ITERATORS} newer iterators of it started, and its generator was "
          "dropped; iterate at most that many iterators of one dataset at once")
    try:
      element = next(gen)
    except StopIteration:
      with self._lock:
        self._live.pop(token, None)
      return (np.bool_(False),) + tuple(
          np.zeros([d or 0 for d in s.shape], s.dtype.as_numpy_dtype) for s in self._specs)
    return (np.bool_(True),) + _flat_arrays(element, self._specs)

  def step(self, token):
    """(token, *`next(token)`), a new iterator's generator started first when token < 0."""
    token = self.start() if token < 0 else np.int64(token)
    return (token,) + self.next(token)

  def endless_step(self, token):
    """(token, *flat element) as `step` without its flag: a generator declared endless that
    ends is refused (its iterator fails), never read as the end of the dataset."""
    token, ok, *flat = self.step(token)
    if not ok:
      raise ParameterValueError(
          "`make_generator` must return a generator that never ends when endless=True (its "
          "end would otherwise end the dataset unseen); pass endless=False for a generator "
          "that ends. Received: endless=True and a generator that ended")
    return (token, *flat)


def _flat_arrays(element, specs):
  """The generator's element flattened as the signature, as arrays of the specs' dtypes."""
  values = tf.nest.flatten(element)
  if len(values) != len(specs):
    raise ParameterValueError(
        f"the generator yielded {len(values)} arrays where its output_signature has "
        f"{len(specs)}; yield elements structured as output_signature")
  out = []
  for v, s in zip(values, specs):
    a = np.asarray(v, s.dtype.as_numpy_dtype)
    if not s.shape.is_compatible_with(a.shape):
      raise ParameterValueError(
          f"the generator yielded an array of shape {a.shape} where output_signature "
          f"states {s.shape}; yield arrays of the stated shapes")
    out.append(a)
  return tuple(out)


def python_dataset(make_generator, output_signature, endless=False):
  """tf.data.Dataset (unknown cardinality, like from_generator's) of the elements of
  `make_generator()`, a new generator per iterator; make_generator is a callable of no
  arguments (the generator function itself) returning an iterable of elements, each a nest
  of arrays structured as output_signature, a nest of tf.TensorSpec of known rank.
  endless=True (a generator that never ends, as fit's Poisson sampler): the dataset is the
  scan alone, without the end-of-generator flag, its take_while and the map that drops the
  flag (two tf.data functions fewer to trace per dataset and to instantiate per iterator);
  a generator that ends anyway fails its iterator.

  Raises:
    ParameterTypeError: make_generator is not callable, or a signature entry is not a
      tf.TensorSpec of known rank.
  """
  validation.check_params({"make_generator": validation.Callable()},
                          {"make_generator": make_generator})
  specs = tf.nest.flatten(output_signature)
  for s in specs:
    if not isinstance(s, tf.TensorSpec) or s.shape.rank is None:
      raise ParameterTypeError(
          f"`output_signature` must be a nest of tf.TensorSpec of known rank. "
          f"Received: output_signature={output_signature!r}")
  gens = _Generators(make_generator, specs)
  dtypes = ([] if endless else [tf.bool]) + [s.dtype for s in specs]

  def step(token, _):
    # the token is the scan's state: -1 until the iterator's first element starts its generator
    flat = tf.numpy_function(gens.endless_step if endless else gens.step, [token],
                             [tf.int64] + dtypes, stateful=True)
    flat[0].set_shape([])
    for t, s in zip(flat[len(dtypes) - len(specs) + 1:], specs):
      t.set_shape(s.shape)
    if endless:
      return flat[0], tf.nest.pack_sequence_as(output_signature, flat[1:])
    return flat[0], tuple(flat[1:])

  # One scan over a counter, not a flat_map over a start token: a new iterator instantiates
  # three functions and no inner dataset.
  global_graph = tf_ops.get_default_graph()
  before = set(global_graph._functions) if tf.executing_eagerly() else None  # pylint: disable=protected-access
  ds = tf.data.Dataset.range(2 ** 62).scan(tf.constant(-1, tf.int64), step)
  if before is not None:
    # TensorFlow's scan adds its function to the default graph even when executing eagerly
    # (the process-wide global graph, where it would stay, with `gens` and the arrays its
    # generator reads, until the process ends); the dataset holds the function itself.
    for name in set(global_graph._functions) - before:  # pylint: disable=protected-access
      global_graph._remove_function(name)  # pylint: disable=protected-access
  if not endless:
    ds = ds.take_while(lambda ok, *_: ok)
    ds = ds.map(lambda ok, *flat: tf.nest.pack_sequence_as(output_signature, list(flat)))
  return ds.with_options(PIPELINE_OPTIONS)
