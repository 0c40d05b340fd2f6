"""Poisson sampling by index from a random-access source, on one or many workers.

`poisson_batches_from_source` samples a `TFRecordSource` or an `ArraySource` with the law of
`poisson_batches` (McMahan et al. 2018, Section 1, step 1): m ~ Binomial(n, q), then a
uniformly random m-subset, so P(S) = q^|S| (1-q)^(n-|S|) for every subset S, exactly n
independent Bernoulli(q) trials; only the sampled records are read. Padding, weights and the
`SamplingSpec` are those of `poisson_batches`.

Several workers (`num_parts` > 1): part p samples its own contiguous range of the n indices
with independent randomness. Independent trials over disjoint ranges covering [0, n) are
again n independent trials, so the parts' samples at one step form exactly one global
Poisson sample. Every part yields `steps_per_epoch` samples (step t of every part is global
step t); the spec states the global n and q, and the ledger records one sample per global
step (`distributed_poisson_batches`).
"""


import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import python_source
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import policies


def part_range(n, num_parts, part_index):
  """[lo, hi): the contiguous index range of part `part_index` of `num_parts` (sizes differ by
  at most one); ValueError for an out-of-range part."""
  num_parts = validation.check_integer("num_parts", num_parts, 1, n)
  part_index = validation.check_integer("part_index", part_index, 0, num_parts - 1)
  return (n * part_index) // num_parts, (n * (part_index + 1)) // num_parts


poisson_indices = sampling_lib.poisson_indices


def _signature(source):
  specs = [tf.TensorSpec((None,) + tuple(shape), tf.as_dtype(dtype))
           for dtype, shape in source.element_layout]
  return tuple(specs) + (tf.TensorSpec((None,), tf.float32),)


def poisson_batches_from_source(source, expected_batch_size=256, steps_per_epoch=None,
                                max_batch_size="auto", seed=None, parts=(0,), num_parts=1):
  """tf.data.Dataset of Poisson samples read by index: (x_pad, y_pad, weights) per step.

  Args:
    source: a `TFRecordSource` or `ArraySource` (n = source.num_records).
    expected_batch_size: B = q n over the whole source (all parts), in (0, n].
    steps_per_epoch: global steps per iteration; default round(1/q).
    max_batch_size: "auto" pads each part's sample to `default_max_batch_size(n_p, q)` for
      its range of n_p records (a larger one to its share of the step's public row bound,
      `SamplingPolicy.replica_row_bound`(n, q, num_parts), the bound the step checks each
      replica's rows against); an int pads to that size (a larger sample goes to the next
      multiple, never truncated); None: unpadded.
    seed: tests only (reproducible, NOT private; warns). None: OS entropy. Part p uses the
      p-th jump of the Philox stream, so parts are independent.
    parts: the parts this dataset yields, in this order, at every step (one element each).
    num_parts: how many parts the n records are cut into (workers x local replicas).

  Returns:
    A tf.data.Dataset of len(parts) * steps_per_epoch elements (x, y, weights), or (x,
    weights) for a source without labels; weights: float32, 1 for sampled records, 0 for
    padding. With num_parts=1 its SamplingSpec is that of `poisson_batches`.

  Raises:
    ParameterTypeError: a count or part index that is not an integer.
    ParameterValueError: an argument out of range.
  """
  n = int(source.num_records)
  q, steps = sampling_lib.check_poisson_args(n, expected_batch_size, steps_per_epoch, max_batch_size)
  ranges = [part_range(n, num_parts, p) for p in parts]
  if not ranges or len(set(parts)) != len(parts):
    raise ParameterValueError(f"parts must be distinct part indices, got {parts!r}")
  base = sampling_lib.make_rng(seed, who="poisson_batches_from_source")
  rngs = [np.random.Generator(base.bit_generator.jumped(int(p))) for p in parts]
  pads = [sampling_lib.default_max_batch_size(hi - lo, q) if max_batch_size == "auto"
          else max_batch_size for lo, hi in ranges]
  # A part's sample past its padded size goes to the replica's bound R_P of the step's public
  # row bound R (the Poisson policy's replica_row_bound, which the step reads:
  # chunking.public_row_bound), not to twice its own padded size, which can exceed the share
  # (2 (E/P + 4 sqrt(E/P)) > R / P).
  share = (policies.get(sampling_lib.POISSON).replica_row_bound(n, q, num_parts)
           if max_batch_size == "auto" else None)

  def gen():
    for _ in range(steps):
      for rng, (lo, hi), pad in zip(rngs, ranges, pads):
        idx = poisson_indices(rng, lo, hi, q)
        m = idx.shape[0]
        size = sampling_lib.padded_size(m, pad)
        if share is not None and m <= share < size:
          size = share
        arrays = [a for a in source.read(idx) if a is not None]
        mask = np.zeros([size], np.float32)
        mask[:m] = 1.0
        yield tuple(sampling_lib.pad_rows(a, size) for a in arrays) + (mask,)

  ds = python_source.python_dataset(gen, _signature(source))
  ds = ds.apply(tf.data.experimental.assert_cardinality(steps * len(parts))).prefetch(2)
  return sampling_lib.attach_spec(ds, sampling_lib.SamplingSpec(
      sampling_lib.POISSON, n, q, float(expected_batch_size)))


def distributed_poisson_batches(strategy, source, expected_batch_size=256,
                                steps_per_epoch=None, max_batch_size="auto", seed=None):
  """One global Poisson sample per step, shared among the replicas of a tf.distribute strategy.

  The records are cut into `strategy.num_replicas_in_sync` parts; each worker's pipeline
  yields, at every step, one element per local replica (`distribute_datasets_from_function`).
  The union over replicas of one step is one Poisson(q) sample of all n records (module
  docstring); the global SamplingSpec (n, q, B) lets `DPModel.fit` all-reduce the clipped sums
  with one noise draw and one ledger sample per global step.

  Args:
    strategy: a tf.distribute.Strategy (MultiWorkerMirroredStrategy, MirroredStrategy).
    source: as in `poisson_batches_from_source`.
    expected_batch_size: the global B (as in `poisson_batches_from_source`).
    steps_per_epoch: the global steps (as in `poisson_batches_from_source`).
    max_batch_size: as in `poisson_batches_from_source`.
    seed: as in `poisson_batches_from_source`.

  Returns:
    A distributed dataset for `model.fit` (give fit `steps_per_epoch` as well).
  """
  n_rep = int(strategy.num_replicas_in_sync)
  q, steps = sampling_lib.check_poisson_args(int(source.num_records), expected_batch_size,
                                             steps_per_epoch, max_batch_size)

  def dataset_fn(ctx):
    local = n_rep // ctx.num_input_pipelines
    first = ctx.input_pipeline_id * local
    return poisson_batches_from_source(source, expected_batch_size, steps, max_batch_size,
                                       seed, parts=tuple(range(first, first + local)),
                                       num_parts=n_rep)

  dist = strategy.distribute_datasets_from_function(dataset_fn)
  return sampling_lib.attach_spec(dist, sampling_lib.SamplingSpec(
      sampling_lib.POISSON, int(source.num_records), q, float(expected_batch_size)))
