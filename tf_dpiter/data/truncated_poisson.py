"""Truncated Poisson sampling: a Poisson sample capped at a static size B.

Each record joins with probability q; when more than B joined, a uniformly random subset of
B of them is kept (the others are dropped for this step). Every batch then fits one static
shape of B rows, with no oversize retrace and no padding beyond B. The ledger records policy
"truncated_poisson" with B in its `sample_size` column, and the accountant uses
dp-accounting's `TruncatedSubsampledGaussianDpEvent` (PLD accountant; add or remove one
example), which analyses exactly this sampler.
"""

import numpy as np

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import records

TRUNCATED_POISSON = records.TRUNCATED_POISSON


class TruncatedPoissonSampler:
  """Poisson(q) index sampler truncated to at most `max_batch_size` indices per step."""

  def __init__(self, population_size, expected_batch_size, max_batch_size, seed=None):
    """Args:
      population_size: n records.
      expected_batch_size: q n, in (0, n].
      max_batch_size: B, the cap, an integer in [1, n].
      seed: tests only (reproducible, NOT private; warns). None: OS entropy.

    Raises:
      ParameterTypeError: a count or `expected_batch_size` that is not a number of its kind.
      ParameterValueError: an argument out of range, named.
    """
    n = validation.check_integer("population_size", population_size, 1)
    validation.check_params(
        {"expected_batch_size": validation.Interval(float, 0, n, "right", error=ParameterValueError),
         "max_batch_size": validation.Integer(1, n)},
        {"expected_batch_size": expected_batch_size, "max_batch_size": max_batch_size})
    self._n, self._cap = n, int(max_batch_size)
    self._q = float(expected_batch_size) / n
    self._rng = sampling.make_rng(seed, who="TruncatedPoissonSampler")

  @property
  def selection_probability(self):
    """q, the probability that a record joins a sample before the cap."""
    return self._q

  def next_indices(self):
    """Sorted indices of the next sample: Poisson(q), then a uniform subset of at most B."""
    idx = np.flatnonzero(self._rng.random(self._n) < self._q)
    if len(idx) > self._cap:
      idx = np.sort(self._rng.choice(idx, self._cap, replace=False))
    return idx

  def spec(self):
    """The SamplingSpec the ledger records (sample_size = the cap B)."""
    return sampling.SamplingSpec(TRUNCATED_POISSON, self._n, self._q, float(self._cap))


def truncated_poisson_batches(x, y=None, expected_batch_size=256, max_batch_size=None,
                              steps_per_epoch=None, seed=None):
  """tf.data.Dataset of truncated Poisson samples (x_pad, [y_pad,] mask), padded to B.

  Relation: add or remove one example (accounted by TruncatedSubsampledGaussianDpEvent, PLD).

  Args:
    x: the features: arrays (or nests) with n records on the leading axis.
    y: the labels, arrays (or nests) with n records on the leading axis, or None.
    expected_batch_size: q n, in (0, n].
    max_batch_size: B; default `sampling.default_max_batch_size(n, q)` (mean + 4 sd), where
      truncation is rare; a smaller B trades more truncation for less compute.
    steps_per_epoch: steps per iteration of the dataset (default round(n / (q n))).
    seed: tests only (NOT private; warns). None: OS entropy.

  Returns:
    The dataset, carrying SamplingSpec("truncated_poisson", n, q, B).

  Raises:
    ParameterValueError: an argument out of range, named.
  """
  n = sampling.num_records(x if y is None else (x, y))
  if max_batch_size is None:
    max_batch_size = min(n, sampling.default_max_batch_size(n, expected_batch_size / n))
  sampler = TruncatedPoissonSampler(n, expected_batch_size, max_batch_size, seed)
  if steps_per_epoch is None:
    steps_per_epoch = max(1, round(n / expected_batch_size))
  return sampling.indexed_batches(sampler.next_indices, x, y, int(steps_per_epoch),
                                  int(max_batch_size), sampler.spec())
