"""Balls-in-bins (random allocation) sampling: every example in exactly one step per epoch.

Each epoch of k steps puts every record in one of the k steps uniformly at random,
independently of the others and of the data (Chua et al. 2024, "Balls-and-Bins Sampling for
DP-SGD"; Feldman and Shenfeld 2025, "random allocation"); a step holds a Binomial(n, 1/k)
number of records, padded with a 0/1 mask like `poisson_batches`. The relation is add or
remove one example (sensitivity S). The ledger records policy "balls_in_bins" (sample_size k,
q = 1 / k) and `DPModel.fit` records every epoch one of whose steps was taken as a pass; the
accountant charges one un-amplified step mechanism per epoch started (a proven bound; the
amplification by the secret allocation is not claimed).
"""

import numpy as np

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.data import shuffling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import records

BALLS_IN_BINS = records.BALLS_IN_BINS


class BallsInBinsSampler:
  """Index sampler: one uniform random step of k per record and epoch, counting the epochs.

  Args:
    population_size: n records (an integer >= 1).
    steps_per_epoch: k, the steps (bins) of an epoch: an integer in [1, n].
    seed: tests only (reproducible, NOT private; warns). None: OS entropy.

  Raises:
    ParameterTypeError: a count that is not an integer.
    ParameterValueError: an argument out of range, named.
  """

  def __init__(self, population_size, steps_per_epoch, seed=None):
    n = validation.check_integer("population_size", population_size, 1)
    self._n, self._k = n, validation.check_integer("steps_per_epoch", steps_per_epoch, 1, n)
    self._rng = sampling.make_rng(seed, who="BallsInBinsSampler")
    self._epochs = shuffling.ShuffleSampler(self._k)
    self._epochs.continues_across_iterators = True

  @property
  def steps_per_epoch(self):
    """k, the steps of one epoch."""
    return self._k

  def take_new_passes(self):
    """Epochs started since the last call, an int >= 0 (what a custom loop records as the
    ledger's passes)."""
    return self._epochs.take_new_passes()

  def begin_fit(self):
    """See `shuffling.ShuffleSampler.begin_fit`."""
    self._epochs.begin_fit()

  def passes_ahead(self, steps_taken, count):
    """Epochs not yet charged that the fit's next `count` steps would use (at most)."""
    return self._epochs.passes_ahead(steps_taken, count)

  def take_used_passes(self, steps_taken):
    """Epochs with a step among the fit's first `steps_taken` steps, not yet charged
    (`shuffling.ShuffleSampler.take_used_passes`): what `DPModel.fit` records as passes."""
    return self._epochs.take_used_passes(steps_taken)

  def next_step(self, state):
    """The index array of the next step (a new allocation when the last one is used up);
    `state` is the dataset's dict holding the allocation in progress."""
    if "it" not in state:
      state["it"] = _endless_steps(self)
    idx = next(state["it"])
    self._epochs.step_drawn()
    return idx

  def next_epoch(self):
    """Draws a new allocation and counts one epoch: a list of k sorted int64 index arrays,
    entry j holding the records of step j; every record is in exactly one of them."""
    self._epochs.start_pass()
    step = self._rng.integers(0, self._k, size=self._n)
    order = np.argsort(step, kind="stable")
    bounds = np.searchsorted(step[order], np.arange(self._k + 1))
    return [order[bounds[j]:bounds[j + 1]] for j in range(self._k)]

  def spec(self):
    """The SamplingSpec the ledger records: SamplingSpec("balls_in_bins", n, 1 / k, k,
    sampler=self)."""
    return sampling.SamplingSpec(BALLS_IN_BINS, self._n, 1.0 / self._k, float(self._k), self)

  def max_batch_size(self, num_sd=4.0, multiple=8):
    """A static padded size (int) for one step: mean n / k + num_sd sd of Binomial(n, 1/k),
    rounded up to a multiple of `multiple` (a larger step is padded to its next multiple,
    never truncated)."""
    return sampling.default_max_batch_size(self._n, 1.0 / self._k, num_sd, multiple)


def _endless_steps(sampler):
  """A generator of the index arrays of consecutive allocations' steps."""
  while True:
    yield from sampler.next_epoch()


def balls_in_bins_batches(x, y=None, steps_per_epoch=None, expected_batch_size=None,
                          epochs=1, max_batch_size="auto", seed=None):
  """tf.data.Dataset of balls-in-bins steps, (x_pad, [y_pad,] mask) per step.

  Each iteration yields `epochs` x k steps of consecutive allocations, continuing where the
  previous stopped. Steps drawn but never trained on only leave their records unused.

  Args:
    x: the features: arrays (or nests) with n records on the leading axis.
    y: the labels, arrays (or nests) with n records on the leading axis, or None.
    steps_per_epoch: k, the steps of an epoch (or give `expected_batch_size`).
    expected_batch_size: n / k, used when steps_per_epoch is None.
    epochs: allocations per iteration of the dataset (a positive integer).
    max_batch_size: "auto" (mean + 4 sd, rounded up to 8) or an int; a larger step is padded
      to the next multiple, never truncated.
    seed: tests only (NOT private; warns). None: OS entropy.

  Returns:
    The dataset, carrying SamplingSpec("balls_in_bins", n, 1/k, k) with its sampler.

  Raises:
    ParameterTypeError: a count that is not an integer.
    ParameterValueError: bad or missing arguments, named.
  """
  n = sampling.num_records(x if y is None else (x, y))
  if steps_per_epoch is None:
    if expected_batch_size is None or not 0 < expected_batch_size <= n:
      raise ParameterValueError(f"give steps_per_epoch (an integer in [1, n={n}]) or expected_batch_size "
                                f"in (0, n], got steps_per_epoch=None, expected_batch_size="
                                f"{expected_batch_size!r}")
    steps_per_epoch = max(1, round(n / expected_batch_size))
  validation.check_integer("epochs", epochs, 1)
  sampler = BallsInBinsSampler(n, steps_per_epoch, seed)
  if max_batch_size == "auto":
    max_batch_size = sampler.max_batch_size()
  validation.check_integer("max_batch_size", max_batch_size, 1)
  state = {}

  def next_indices():
    return sampler.next_step(state)

  steps = int(epochs) * sampler.steps_per_epoch
  return sampling.indexed_batches(next_indices, x, y, steps, int(max_batch_size), sampler.spec())
