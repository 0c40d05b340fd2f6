"""Batches for DP training with a stated sampling policy (seed 002, Section 5).

`poisson_batches` draws each step's sample by Poisson sampling: every record joins the
sample independently with selection probability q = expected_batch_size / n. The sample is
padded to a static size with a 0/1 mask (yielded as Keras' sample_weight) so that XLA sees
one shape. Draws come from a counter-based Philox generator seeded from OS entropy
(seed 002, Section 8); a fixed seed is for tests only and warns.

The dataset carries a `SamplingSpec` (policy, n, q, sample size) that `DPModel.fit`
writes into the optimizer's ledger, so the reported epsilon states its assumption.
"""

import collections
import math
import secrets
import warnings

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import randomness

SamplingSpec = collections.namedtuple(
    "SamplingSpec", ["policy", "population_size", "selection_probability", "sample_size"])
SamplingSpec.__doc__ = """Sampling policy of a data pipeline, as the ledger records it.

policy: "poisson" | "shuffle" | "fixed_size" | "full"; population_size: n records;
selection_probability: q; sample_size: batch size (expected batch size for Poisson).
"""

_SPEC_ATTR = "_tf_dpiter_sampling_spec"


def get_sampling_spec(dataset):
  """The SamplingSpec attached to a dataset made here, or None."""
  return getattr(dataset, _SPEC_ATTR, None)


def _attach(dataset, spec):
  setattr(dataset, _SPEC_ATTR, spec)
  return dataset


def _num_records(x):
  leaves = tf.nest.flatten(x)
  if not leaves:
    raise ValueError("x must hold at least one array")
  n = int(np.shape(leaves[0])[0])
  for leaf in leaves:
    if int(np.shape(leaf)[0]) != n:
      raise ValueError(f"all arrays must have the same number of records; got {np.shape(leaf)[0]} and {n}")
  return n


def default_max_batch_size(population_size, selection_probability, num_sd=4.0, multiple=8):
  """Static padded size: E[|R|] + num_sd * sd(|R|), |R| ~ Binomial(n, q), rounded up to `multiple`.

  A sample larger than this (probability about 3e-5 per step for num_sd=4) is padded to the
  next multiple of it instead: records are never dropped, only XLA retraces once.
  """
  mean = population_size * selection_probability
  sd = math.sqrt(population_size * selection_probability * (1.0 - selection_probability))
  size = int(math.ceil(mean + num_sd * sd))
  size = max(1, int(math.ceil(size / multiple) * multiple))
  return min(size, int(math.ceil(population_size / multiple) * multiple))


def _make_rng(seed):
  if seed is None:
    return np.random.Generator(np.random.Philox(secrets.randbits(128)))
  warnings.warn(
      f"seed={seed!r} given to poisson_batches: the sampling is reproducible and the "
      "output is NOT differentially private. Use a seed for tests only.",
      randomness.NotPrivateSeedWarning, stacklevel=3)
  return np.random.Generator(np.random.Philox(int(seed)))


def poisson_batches(x, y=None, expected_batch_size=256, steps_per_epoch=None,
                    max_batch_size="auto", seed=None):
  """tf.data.Dataset of Poisson samples: (x_pad, y_pad, mask) per step.

  Each record joins each step independently with probability q = expected_batch_size / n
  (seed 002, Section 1, step 1). `steps_per_epoch` defaults to round(1/q) = n / expected
  batch size. `max_batch_size`: "auto" pads to `default_max_batch_size(n, q)`; an int pads
  to that size (a larger sample is padded to the next multiple, never truncated); None
  yields unpadded samples of varying size (no XLA). The mask is float32 [max_batch_size]
  with 1 for sampled records and 0 for padding; Keras passes it as sample_weight.
  """
  n = _num_records(x if y is None else (x, y))
  if not isinstance(expected_batch_size, (int, float, np.integer, np.floating)) or not (
      0 < expected_batch_size <= n):
    raise ValueError(f"expected_batch_size must be in (0, n={n}], got {expected_batch_size!r}")
  q = float(expected_batch_size) / n
  if steps_per_epoch is None:
    steps_per_epoch = max(1, int(round(1.0 / q)))
  if not isinstance(steps_per_epoch, (int, np.integer)) or steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
  if max_batch_size == "auto":
    max_batch_size = default_max_batch_size(n, q)
  elif max_batch_size is not None:
    if not isinstance(max_batch_size, (int, np.integer)) or max_batch_size < 1:
      raise ValueError(f"max_batch_size must be a positive integer, 'auto' or None, got {max_batch_size!r}")
  rng = _make_rng(seed)
  xs = tf.nest.map_structure(np.asarray, x)
  ys = None if y is None else tf.nest.map_structure(np.asarray, y)

  def _pad(a, size):
    out = np.zeros((size,) + a.shape[1:], dtype=a.dtype)
    out[:a.shape[0]] = a
    return out

  def gen():
    for _ in range(steps_per_epoch):
      idx = np.flatnonzero(rng.random(n) < q)
      m = idx.shape[0]
      size = m
      if max_batch_size is not None:
        size = max_batch_size * max(1, int(math.ceil(m / max_batch_size)))
      bx = tf.nest.map_structure(lambda a: _pad(a[idx], size), xs)
      mask = np.zeros([size], np.float32)
      mask[:m] = 1.0
      if ys is None:
        yield bx, mask
      else:
        yield bx, tf.nest.map_structure(lambda a: _pad(a[idx], size), ys), mask

  # The batch dimension is left unknown in the element spec: samples are padded to
  # max_batch_size, so one concrete shape reaches XLA, except for a rare oversize sample
  # (padded to a multiple of it: compiled once more, never truncated).
  def spec(a):
    return tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype))

  mask_spec = tf.TensorSpec((None,), tf.float32)
  if ys is None:
    sig = (tf.nest.map_structure(spec, xs), mask_spec)
  else:
    sig = (tf.nest.map_structure(spec, xs), tf.nest.map_structure(spec, ys), mask_spec)
  ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
  ds = ds.apply(tf.data.experimental.assert_cardinality(steps_per_epoch)).prefetch(2)
  return _attach(ds, SamplingSpec("poisson", n, q, float(expected_batch_size)))


def shuffled_batches(x, y=None, batch_size=256, drop_remainder=False, seed=None):
  """tf.data.Dataset of shuffled disjoint batches, reshuffled every epoch (policy "shuffle").

  The ledger records policy "shuffle" with sample size `batch_size`: no amplification by
  subsampling is claimed for it by a careful accountant (seed 002, Section 5).
  """
  n = _num_records(x if y is None else (x, y))
  if not isinstance(batch_size, (int, np.integer)) or not 1 <= batch_size <= n:
    raise ValueError(f"batch_size must be an integer in [1, n={n}], got {batch_size!r}")
  data = x if y is None else (x, y)
  ds = tf.data.Dataset.from_tensor_slices(data)
  if seed is None:
    seed_ = None
  else:
    seed_ = int(seed)
  ds = ds.shuffle(n, seed=seed_, reshuffle_each_iteration=True)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(2)
  return _attach(ds, SamplingSpec("shuffle", n, batch_size / n, float(batch_size)))
