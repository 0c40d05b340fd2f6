"""Batches for DP training with a stated sampling policy (McMahan et al. 2018, Section 5).

`poisson_batches` draws each step's sample by Poisson sampling (each record joins
independently with probability q = expected_batch_size / n), padded to a static size with a
0/1 mask (Keras' sample_weight) or unpadded. Python draws only the indices, from a Philox
generator seeded from OS entropy (McMahan et al. 2018, Section 8; a fixed seed is for tests
only and warns); TensorFlow gathers the rows ahead of the step. The dataset carries a
`SamplingSpec` (policy, n, q, sample size) that `DPModel.fit` writes into the ledger.
"""

import collections
import math
import secrets
import warnings

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import python_source
from tf_dpiter.dp_query import randomness
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records
# the padded size of a Poisson sample: one definition, the ledger's (it also sets the public
# row bound of a declared sampling, ledger.LedgerSampling.public_row_bound)
from tf_dpiter.ledger.policy_base import default_max_batch_size  # noqa: F401  (re-exported)

POISSON = records.POISSON
SHUFFLE = records.SHUFFLE

SamplingSpec = collections.namedtuple(
    "SamplingSpec", ["policy", "population_size", "selection_probability", "sample_size",
                     "sampler"], defaults=(None,))
SamplingSpec.__doc__ = """Sampling policy of a data pipeline, as the ledger records it.

policy: "poisson" | "shuffle" | "fixed_size" | "full"; population_size: n records;
selection_probability: q; sample_size: batch size (expected batch size for Poisson);
sampler: for "shuffle", the `shuffling.ShuffleSampler` counting the passes (else None).
"""

_SPEC_ATTR = "_tf_dpiter_sampling_spec"

# Steps whose indices the sampler's Python generator hands to tf.data in one call.
INDEX_CHUNK = 16

# tf.data options of the library's pipelines (no default graph rewrites: python_source).
PIPELINE_OPTIONS = python_source.PIPELINE_OPTIONS


# tf.data transforms that keep each step's batch exactly the sample drawn: the declaration is
# carried through them (by class name, as tf.data names its dataset classes).
_KEEPS_SAMPLING = {"_PrefetchDataset": "prefetch", "_OptionsDataset": "with_options",
                   "_AssertCardinalityDataset": "assert_cardinality", "_RepeatDataset": "repeat",
                   "_TakeDataset": "take"}
_WHY_LOST = {
    "map": "a function over whole batches may mix records (e.g. normalizing by the batch "
           "mean), which the per-record sensitivity does not cover; transform each record "
           "alone with dp.data.poisson_batches(..., map_fn=f) / shuffled_batches(..., "
           "map_fn=f) or dp.data.map_records(dataset, f)",
    "cache": "it replays the first pass's batches in every later epoch, so they are no longer "
             "fresh samples (Poisson) or counted passes (shuffle); drop the cache (the "
             "samplers hold the arrays in memory already)",
}
_WHY_LOST_DEFAULT = ("it changes which records form each step's batch, so the batches are no "
                     "longer the samples the ledger would record")


def _transform_name(dataset):
  """`map`, `batch`, `cache`... from tf.data's class name (_ParallelMapDataset -> map)."""
  name = type(dataset).__name__.strip("_")
  name = name[:-len("Dataset")] if name.endswith("Dataset") else name
  name = name[len("Parallel"):] if name.startswith("Parallel") else name
  return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def _find_sampled_ancestor(dataset, depth=0):
  """(spec, transforms from the sampled ancestor up to dataset) or (None, None)."""
  spec = getattr(dataset, _SPEC_ATTR, None)
  if spec is not None:
    return spec, []
  inputs = dataset._inputs() if hasattr(dataset, "_inputs") and depth < 64 else []  # pylint: disable=protected-access
  for parent in inputs:
    found, path = _find_sampled_ancestor(parent, depth + 1)
    if found is not None:
      return found, path + [dataset]
  return None, None


def get_sampling_spec(dataset):
  """The SamplingSpec of a dataset made here (or derived from one through prefetch,
  with_options, assert_cardinality, repeat or take), or None for data not sampled here.

  Args:
    dataset: a tf.data.Dataset, or any object (None is returned for what is not sampled here).

  Returns:
    the SamplingSpec, or None.

  Raises:
    ParameterValueError: a dataset whose schedule is ledger state (cyclic Poisson) repeated
      with .repeat().
    PrivacyConfigError: the dataset derives from a sampled dataset through a transform that
      loses the declaration (map over batches, cache, batch, unbatch, filter, shuffle, ...);
      the message names that transform and the way to keep the declaration.
  """
  spec = getattr(dataset, _SPEC_ATTR, None)
  if spec is not None or not isinstance(dataset, tf.data.Dataset):
    return spec
  spec, path = _find_sampled_ancestor(dataset)
  if spec is None:
    return None
  # unbatch / rebatch are built as map -> _RestructuredDataset -> the transform itself:
  # those two inner datasets are reported as the transform that made them.
  inner = {i - j for i, d in enumerate(path) if type(d).__name__ == "_RestructuredDataset"
           for j in (0, 1)}
  lost = [d for i, d in enumerate(path)
          if i not in inner and type(d).__name__ not in _KEEPS_SAMPLING]
  if not lost:
    if getattr(spec.sampler, "ledger_schedule", False) and any(
        type(d).__name__ == "_RepeatDataset" for d in path):
      raise ParameterValueError(
          f"a {spec.policy!r} dataset cannot be repeated (.repeat()): its schedule is ledger "
          "state, read when each iterator starts, and a repeat restarts it while earlier draws "
          "still wait in the prefetch. Give the dataset enough steps instead (steps_per_epoch "
          "of cyclic_poisson_batches), or fit(..., steps_per_epoch=k) several times")
    return spec
  name = _transform_name(lost[0])
  raise PrivacyConfigError(
      f"this dataset was built by a tf_dpiter sampler (policy {spec.policy!r}, n = "
      f"{int(spec.population_size)}, q = {spec.selection_probability:.4g}) but its sampling "
      f"declaration was lost at .{name}(): {_WHY_LOST.get(name, _WHY_LOST_DEFAULT)}. "
      "prefetch, with_options, assert_cardinality, repeat and take keep the declaration")


def attach_spec(dataset, spec):
  """Attaches a SamplingSpec to a tf.data.Dataset in place (read back by get_sampling_spec)
  and returns the dataset."""
  setattr(dataset, _SPEC_ATTR, spec)
  return dataset


def num_records(x):
  """n (int), the common leading dimension of every array in the nest x.

  Raises:
    ParameterValueError: if x holds no array, or the leading dimensions differ.
  """
  leaves = tf.nest.flatten(x)
  if not leaves:
    raise ParameterValueError(f"`x` must hold at least one array. Received: x={x!r}")
  n = int(np.shape(leaves[0])[0])
  for leaf in leaves:
    if int(np.shape(leaf)[0]) != n:
      raise ParameterValueError(f"all arrays must have the same number of records; got {np.shape(leaf)[0]} and {n}")
  return n


def make_rng(seed, who="poisson_batches", stacklevel=3):
  """A numpy.random.Generator on Philox from 128 bits of OS entropy (seed None: private), or
  from an int seed, which makes sampling reproducible and NOT private and warns
  (randomness.NotPrivateSeedWarning naming `who`, at `stacklevel`: 3 the caller's caller; 4
  behind a `validates` wrapper)."""
  if seed is None:
    return np.random.Generator(np.random.Philox(secrets.randbits(128)))
  warnings.warn(
      f"seed={seed!r} given to {who}: the sampling is reproducible and the "
      "output is NOT differentially private. Use a seed for tests only.",
      randomness.NotPrivateSeedWarning, stacklevel=stacklevel)
  return np.random.Generator(np.random.Philox(int(seed)))


def poisson_indices(rng, lo, hi, q):
  """Sorted int64 indices of one Poisson(q) sample of the records [lo, hi).

  m ~ Binomial(hi - lo, q), then a uniformly random m-subset (numpy's `Generator.choice`
  without replacement): P(S) = C(n, |S|) q^|S| (1-q)^(n-|S|) / C(n, |S|) = q^|S| (1-q)^(n-|S|)
  for every subset S of the n = hi - lo records, exactly the law of n independent
  Bernoulli(q) trials (McMahan et al. 2018, Section 1, step 1), in O(q n) work instead of n uniforms.
  """
  m = int(rng.binomial(hi - lo, q))
  idx = rng.choice(hi - lo, size=m, replace=False, shuffle=False)
  return np.sort(idx.astype(np.int64)) + lo


# Each of poisson_batches' arguments alone (`validation.check_params`); B <= n is checked with
# the data (`check_poisson_args`), max_batch_size there too ("auto", None or an int >= 1).
POISSON_BATCHES_CONSTRAINTS = {
    "expected_batch_size": validation.Interval(float, 0, None, closed="neither",
                                               error=ParameterValueError),
    "steps_per_epoch": validation.Optional(validation.Integer(min=1)),
    "population_size": validation.Optional(
        validation.Interval(float, 1, None, closed="left", allow_inf=True,
                            error=ParameterValueError)),
    "map_fn": validation.Optional(validation.Callable()),
    "endless": validation.InstanceOf(bool, "True or False"),
}


@validation.validates(POISSON_BATCHES_CONSTRAINTS)
def poisson_batches(x, y=None, expected_batch_size=256, steps_per_epoch=None,
                    max_batch_size="auto", seed=None, sample_weight=None, map_fn=None,
                    population_size=None, endless=False):
  """tf.data.Dataset of Poisson samples: (x_pad, y_pad, mask) per step.

  Each record joins each step independently with probability q = expected_batch_size / N
  (McMahan et al. 2018, Section 1, step 1), N the *declared* population size (default n, the
  records given): q is public, fixed before sampling, so a neighbouring dataset (one record
  more or less) is sampled with the same q. The ledger records policy "poisson" (add or remove
  one example, sensitivity S); the noised sum is divided by q n (Section 1, step 3).

  Args:
    x: array or nest of arrays with n records on the leading axis.
    y: labels (same n), or None.
    expected_batch_size: q n, in (0, n].
    steps_per_epoch: samples per iteration of the dataset; default round(1/q).
    max_batch_size: "auto" pads to `default_max_batch_size(n, q)`; an int pads to that size
      (a larger sample to the next multiple, never truncated); None: unpadded samples (at
      least one row: an empty sample is one row of weight 0).
    seed: tests only: reproducible, hence NOT private (warns). None: OS entropy.
    sample_weight: optional per-record weights [n]: the yielded weight is mask * weight.
    map_fn: optional per-record transform, map_fn(x, y) -> (x, y) (map_fn(x) -> x without
      y), applied to each record alone (`transforms.map_records`), so records cannot mix.
    population_size: N, the public population size q is stated over (q = B / N); None: n.
    endless: True: one iterator never ends and serves every epoch of
      `fit(..., steps_per_epoch=k)`; samples drawn ahead and never used are not charged and
      change nothing (steps are independent).

  Returns:
    A tf.data.Dataset of (x_pad, y_pad, weights) (or (x_pad, weights) if y is None); weights
    float32 [size], 1 for sampled records, 0 for padding.

  Raises:
    ParameterTypeError: a number or a map_fn of the wrong type.
    ParameterValueError: an argument out of range, or arrays of different lengths.
  """
  n = num_records(tuple(a for a in (x, y, sample_weight) if a is not None))
  declared = n if population_size is None else float(population_size)
  q, steps = check_poisson_args(declared, expected_batch_size, steps_per_epoch, max_batch_size)
  pad = default_max_batch_size(n, q) if max_batch_size == "auto" else max_batch_size
  rng = make_rng(seed, stacklevel=4)
  ds = indexed_batches(lambda: poisson_indices(rng, 0, n, q), x, y, steps, pad,
                       SamplingSpec(POISSON, declared, q, float(expected_batch_size)),
                       sample_weight=sample_weight, endless=endless)
  if map_fn is not None:
    ds = attach_spec(map_xy(ds, map_fn, has_y=y is not None, num_weights=1),
                     get_sampling_spec(ds))
  return ds


def indexed_batches(next_indices, x, y, steps, max_batch_size, spec, sample_weight=None,
                    on_start=None, endless=False):
  """tf.data.Dataset of (x_pad, [y_pad,] weights) for `steps` calls of next_indices() per pass.

  next_indices() (Python, in a generator: the sampler's state stays sequential) returns one
  step's indices; they reach TensorFlow `INDEX_CHUNK` steps at a time, each step still one
  call of next_indices() (the law of a sample does not depend on the chunking). A pass
  started by prefetch is charged only when one of its steps is taken. Samples are padded
  with zero rows (weight 0) to `max_batch_size` (a larger one to its next multiple; None: at
  least one row). on_start(), if given, runs when a generator starts; a function it returns
  draws that generator's steps instead. endless=True: the generator never ends.
  """
  xs = tf.nest.map_structure(_as_tensor, x)
  ys = None if y is None else tf.nest.map_structure(_as_tensor, y)
  ws = None if sample_weight is None else tf.reshape(
      tf.convert_to_tensor(sample_weight, tf.float32), [-1])

  def gen():
    draw = (on_start() if on_start is not None else None) or next_indices
    start = 0
    while endless or start < steps:
      draws = [np.asarray(draw(), np.int64).reshape(-1)
               for _ in range(INDEX_CHUNK if endless else min(INDEX_CHUNK, steps - start))]
      lengths = np.asarray([len(d) for d in draws], np.int64)
      chunk = np.full((len(draws), max(1, int(lengths.max()))), -1, np.int64)
      for row, d in zip(chunk, draws):
        row[:len(d)] = d
      start += len(draws)
      yield chunk, lengths

  def gather(padded, length):
    idx = padded[:length]
    m = tf.shape(idx)[0]
    size = tf.maximum(m, 1) if max_batch_size is None else (
        max_batch_size * tf.maximum(1, (m + max_batch_size - 1) // max_batch_size))
    rows = lambda a: _pad_rows_to(tf.gather(a, idx), size)
    pad = lambda t: _pad_rows_to(t, size)
    weights = pad(tf.ones([m], tf.float32)) if ws is None else rows(ws)
    return tuple(tf.nest.map_structure(rows, t) for t in (xs, ys) if t is not None) + (weights,)

  ds = python_source.python_dataset(gen, (
      tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None], tf.int64)), endless=endless)
  ds = ds.unbatch().map(gather, num_parallel_calls=2, deterministic=True)
  ds = ds.apply(tf.data.experimental.assert_cardinality(
      tf.data.INFINITE_CARDINALITY if endless else steps)).prefetch(2)
  return attach_spec(ds.with_options(PIPELINE_OPTIONS), spec)


def _as_tensor(a):
  """An array as a tensor; a tf.RaggedTensor as it is (its rows are gathered as rows)."""
  return a if isinstance(a, tf.RaggedTensor) else tf.convert_to_tensor(a)


def _pad_rows_to(t, size):
  """t followed by zero rows up to `size` rows (a ragged t: rows of ONE zero element each,
  since a mean over an empty row is 0/0 and NaN times weight 0 is NaN)."""
  if isinstance(t, tf.RaggedTensor):
    return tf.concat([t, _zero_rows(t, size - tf.cast(t.nrows(), tf.int32))], 0)
  return tf.pad(t, [[0, size - tf.shape(t)[0]]] + [[0, 0]] * (t.shape.rank - 1))


def _zero_rows(t, n):
  """n rows shaped like the rows of the ragged t, each holding one zero element."""
  values = t.values
  inner = (_zero_rows(values, n) if isinstance(values, tf.RaggedTensor)
           else tf.zeros(tf.concat([[n], tf.shape(values)[1:]], 0), values.dtype))
  return tf.RaggedTensor.from_row_lengths(inner, tf.ones([n], t.row_splits.dtype))


def check_poisson_args(n, expected_batch_size, steps_per_epoch, max_batch_size):
  """(q, steps_per_epoch), float q = B / n and int steps, of a Poisson sampler of n records
  with expected batch size B in (0, n], steps_per_epoch a positive int or None (max(1,
  round(1 / q))) and max_batch_size a positive int, "auto" or None.

  Raises:
    ParameterValueError: if an argument is out of range or of the wrong type.
  """
  if isinstance(expected_batch_size, bool) or not isinstance(
      expected_batch_size, (int, float, np.integer, np.floating)) or not (
          0 < expected_batch_size <= n):
    raise ParameterValueError(validation.message("expected_batch_size", f"a number in (0, n={n}]",
                                                 expected_batch_size))
  q = float(expected_batch_size) / n
  steps = max(1, int(round(1.0 / q))) if steps_per_epoch is None else steps_per_epoch
  validation.check_integer("steps_per_epoch", steps, 1)
  if max_batch_size != "auto" and max_batch_size is not None and (
      isinstance(max_batch_size, bool) or not isinstance(max_batch_size, (int, np.integer))
      or max_batch_size < 1):
    raise ParameterValueError(validation.message("max_batch_size", "an int >= 1, 'auto' or None",
                                                 max_batch_size))
  return q, int(steps)


def batch_signature(xs, ys=None):
  """output_signature of (x, [y,] weights) batches of the numpy nests xs, ys (batch dimension
  unknown; weights float32 [batch])."""
  def spec(a):
    return tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype))

  parts = [tf.nest.map_structure(spec, xs)]
  if ys is not None:
    parts.append(tf.nest.map_structure(spec, ys))
  return tuple(parts) + (tf.TensorSpec((None,), tf.float32),)


def padded_size(num_sampled, max_batch_size):
  """Rows a sample of `num_sampled` records is padded to: max_batch_size, or its next
  multiple for a larger sample (never truncated); num_sampled itself when None."""
  if max_batch_size is None:
    return num_sampled
  return max_batch_size * max(1, int(math.ceil(num_sampled / max_batch_size)))


def pad_rows(a, size):
  """Numpy array `a` (at most `size` rows on the leading axis) followed by zero rows up to
  `size` rows: shape (size,) + a.shape[1:], a's dtype."""
  out = np.zeros((size,) + a.shape[1:], dtype=a.dtype)
  out[:a.shape[0]] = a
  return out


def per_record(fn, components):
  """The stacked outputs of fn applied to each record of `components` (a tuple of batched
  nests) alone (leading batch axis removed)."""
  return tf.vectorized_map(lambda rec: fn(*rec), tuple(components),
                           fallback_to_while_loop=True)


def map_xy(dataset, map_fn, has_y, num_weights, num_parallel_calls=tf.data.AUTOTUNE):
  """The sampled `dataset` with map_fn(x, y) -> (x, y) (or map_fn(x) -> x without y,
  has_y False) applied to each record, the SamplingSpec kept; the last `num_weights`
  components (weights, the Poisson mask) pass through unchanged (num_parallel_calls: for
  `Dataset.map`).

  Raises:
    ParameterTypeError: map_fn is not callable.
  """
  validation.check_params({"map_fn": validation.Callable()}, {"map_fn": map_fn})
  spec = get_sampling_spec(dataset)

  def per_batch(*components):
    k = len(components) - num_weights
    data, weights = components[:k], components[k:]
    if has_y:
      out = per_record(lambda x, y: tuple(map_fn(x, y)), data)
    else:
      out = per_record(lambda x: (map_fn(x),), (data[0] if k == 1 else tuple(data),))
    out = tuple(out) + tuple(weights)
    return out if len(out) > 1 else out[0]

  mapped = dataset.map(per_batch, num_parallel_calls=num_parallel_calls)
  return attach_spec(mapped, spec)
