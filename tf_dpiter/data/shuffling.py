"""Shuffled passes whose count the ledger charges (McMahan et al. 2018, Section 5, third policy).

`shuffled_batches` draws, for every pass, a fresh uniformly random permutation of the n
records (Philox seeded from OS entropy, Section 8) cut into disjoint batches. No
amplification is claimed: every pass started, complete or partial, is charged one
un-amplified Gaussian mechanism under replace-one adjacency (n is public), so a clipped sum
has sensitivity 2S (Appendix A).

The generator (a prefetched tf.data thread) writes no TF variable: its `ShuffleSampler`
counts the steps drawn and where passes start, and `DPModel.fit` records in the ledger
(`record_passes`) every pass one of whose steps the optimizer took. Custom loops:
`optimizer.set_sampling(n, b / n, "shuffle", b)` and `ledger.record_passes(1)` per
permutation.
"""

import math
import threading

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import python_source
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError


class ShuffleSampler:
  """Counts the shuffled passes (permutations) a `shuffled_batches` dataset started, and the
  steps it drew, so that `DPModel.fit` charges the passes its steps used (not the ones a
  prefetch started and the fit dropped).

  Thread-safe: the tf.data thread counts, the training thread takes the passes.

  Args:
    steps_per_pass: the steps of one pass (floor(n / B) with drop_remainder), or None.
  """

  def __init__(self, steps_per_pass=None):
    self._lock = threading.Lock()
    self._started = 0
    self._taken = 0
    self.steps_per_pass = steps_per_pass
    self._drawn = 0          # steps drawn (yielded) so far, in order
    self._starts = []        # the step index (in drawing order) at which each pass starts
    self._charged = set()    # passes already charged by `take_used_passes`
    self._base = 0           # the first step index of the current fit
    # False: every new iterator starts a new pass (shuffled_batches); True: passes continue
    # across iterators (a balls-in-bins allocation in progress).
    self.continues_across_iterators = False
    self._iteration = None   # where the current iteration of a declared pipeline started
    self.refusal = None      # the PrivacyConfigError of the last iteration refused, or None

  @property
  def passes_started(self):
    """Passes (permutations) started since this sampler was made (int)."""
    with self._lock:
      return self._started

  def start_pass(self):
    """Counts one more pass; called by the generator before its first batch."""
    with self._lock:
      self._started += 1
      self._starts.append(self._drawn)

  def start_iteration(self):
    """Begins a new iteration of a declared pipeline (`declare_shuffled`), whose first batch
    starts a new pass; refuses it when the previous iteration drawn in this fit ended after
    a number of batches that is not a multiple of `steps_per_pass`.

    Why: the ledger charges one mechanism per pass, and DP-FTRL one tree per pass with R
    dividing steps_per_pass (Kairouz et al. 2021, Section 3 and Appendix D: each example at
    most once per tree). An iteration of L batches, L not a multiple of steps_per_pass
    (a `.filter`, a `.take`, an undeclared drop_remainder), would start the next pass inside
    a tree. The refused pass is neither counted nor drawn, so its step is never taken,
    charged or noised. A new fit inside a tree is refused by the mechanism's `check_boundary`.
    Raises:
      PrivacyConfigError: the previous iteration's length is not a multiple of steps_per_pass
        (also kept in `refusal`, for the caller that sees TensorFlow's wrapped error).
    """
    with self._lock:
      per, prev = self.steps_per_pass, self._iteration
      if per and prev is not None and prev >= self._base:
        had = self._drawn - prev
        if had % per:
          if had < per:
            what = (f"a pass of the declared pipeline had {had} batches, not the declared "
                    f"{per}: pass steps_per_pass={had} to declare_shuffled if every pass of "
                    "the pipeline has that many batches")
          else:
            what = (f"an iteration of the declared pipeline yielded {had} batches, not a "
                    f"multiple of the declared steps_per_pass (its last pass had {had % per} "
                    "batches, not the declared "
                    f"{per}): pass the batches of one pass of the pipeline as steps_per_pass "
                    "to declare_shuffled")
          self.refusal = PrivacyConfigError(
              f"{what} (a .filter, .take or drop_remainder changes them), or make every pass "
              "steps_per_pass batches long. The ledger charges one mechanism per pass of "
              "steps_per_pass steps (noise='tree': one tree, its restart period dividing "
              "steps_per_pass); a pass of another length puts the next pass's first steps "
              f"in a tree with this one's last. Received: steps_per_pass={per}")
          raise self.refusal
      self._iteration = self._drawn

  def step_drawn(self):
    """Counts one step drawn (a batch handed to tf.data); called by the generator."""
    with self._lock:
      self._drawn += 1

  def take_new_passes(self):
    """Passes started since the last call; they are then marked as recorded.

    Returns:
      an int >= 0 (what a custom loop moves into the ledger with `record_passes`).
    """
    with self._lock:
      new = self._started - self._taken
      self._taken = self._started
      return new

  def begin_fit(self):
    """Marks the next step drawn as the first step of a fit (`take_used_passes` counts from
    there): the steps drawn before were trained on or dropped with their iterator."""
    with self._lock:
      self._base = self._drawn

  def passes_ahead(self, steps_taken, count):
    """The passes not yet charged that the fit's next `count` steps would use (at most).

    Args:
      steps_taken: int, the steps the optimizer took in this fit.
      count: int >= 1, the steps planned.

    Returns:
      an int >= 0: the pass in progress costs nothing more while it has steps left; each
      further steps_per_pass steps start a new pass (without steps_per_pass: one per step).
    """
    per = self.steps_per_pass
    if not per:
      return int(count)
    with self._lock:
      p = self._base + int(steps_taken)
      known = [(i, s) for i, s in enumerate(self._starts) if s <= p]
      if known and (steps_taken > 0 or self.continues_across_iterators):
        i, cur = known[-1]
        if p < cur + per:
          left = cur + per - p
          first = 0 if i in self._charged else 1
          return first + max(0, -(-(int(count) - left) // per))
    return -(-int(count) // per)

  def take_used_passes(self, steps_taken):
    """Passes with a step among the first `steps_taken` steps of this fit, not yet charged.

    Steps are consumed in drawing order within a fit: a pass is used when one of its steps
    is among the drawing indices [base, base + steps_taken).

    Args:
      steps_taken: int >= 0, the steps the optimizer took in this fit.

    Returns:
      an int >= 0 (what `DPModel.fit` records with `ledger.record_passes`).
    """
    with self._lock:
      self._taken = self._started
      end = self._base + int(steps_taken)
      new = 0
      for i, start in enumerate(self._starts):
        nxt = self._starts[i + 1] if i + 1 < len(self._starts) else float("inf")
        if i not in self._charged and start < end and nxt > self._base and nxt > start:
          self._charged.add(i)
          new += 1
      return new


# Each of shuffled_batches' arguments alone (`validation.check_params`); b <= n is checked
# with the data.
SHUFFLED_BATCHES_CONSTRAINTS = {
    "batch_size": validation.Integer(min=1, error=PrivacyConfigError),
    "passes": validation.Optional(validation.Integer(min=1, error=PrivacyConfigError)),
    "map_fn": validation.Optional(validation.Callable()),
}


def steps_per_pass(n, batch_size, drop_remainder=False):
  """Batches (steps) in one shuffled pass over n records.

  Args:
    n: records in the data set (int >= 1).
    batch_size: b, records per batch (int >= 1).
    drop_remainder: whether the last, smaller batch of a pass is dropped.

  Returns:
    floor(n / b) with drop_remainder, else ceil(n / b) (an int).
  """
  return n // batch_size if drop_remainder else int(math.ceil(n / batch_size))


@validation.validates(SHUFFLED_BATCHES_CONSTRAINTS, also_raises=(ParameterValueError,))
def shuffled_batches(x, y=None, batch_size=256, drop_remainder=False, seed=None,
                     sample_weight=None, passes=1, map_fn=None):
  """tf.data.Dataset of disjoint batches of a fresh random permutation per pass.

  Each iteration makes `passes` passes (None: endless), each a new permutation yielding its
  ceil(n / batch_size) batches (the last smaller unless drop_remainder). The dataset carries a
  SamplingSpec "shuffle" whose `sampler` counts the passes (module docstring).

  Args:
    x: array or nest of arrays with n records on the leading axis.
    y: labels (same n), or None.
    batch_size: b, records per batch (1 <= b <= n).
    drop_remainder: drop the last, smaller batch of each pass.
    seed: tests only: reproducible, hence NOT private (warns). None: OS entropy.
    sample_weight: optional per-record weights [n], yielded as Keras' sample_weight.
    passes: passes per iteration of the dataset (1: one pass per Keras epoch), or None.
    map_fn: optional per-record transform (see sampling.poisson_batches).

  Returns:
    A tf.data.Dataset of (x, y[, sample_weight]) batches (x alone if y is None).

  Raises:
    ParameterTypeError: batch_size or passes is not an integer, map_fn is not callable.
    PrivacyConfigError: batch_size outside [1, n] or passes < 1.
    ParameterValueError: arrays of different lengths.
  """
  data = tuple(a for a in (x, y, sample_weight) if a is not None)
  n = sampling.num_records(data)
  if batch_size > n:   # b alone: SHUFFLED_BATCHES_CONSTRAINTS
    raise PrivacyConfigError(validation.message("batch_size", f"an int in [1, n={n}]",
                                                batch_size))
  rng = sampling.make_rng(seed, "shuffled_batches", stacklevel=4)
  arrays = tf.nest.map_structure(np.asarray, data)
  per_pass = steps_per_pass(n, int(batch_size), drop_remainder)
  sampler = ShuffleSampler(per_pass)
  gen = _permutation_batches(arrays, n, int(batch_size), per_pass, passes, rng, sampler)
  sig = tf.nest.map_structure(
      lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), arrays)
  ds = python_source.python_dataset(gen, sig if len(sig) > 1 else sig[0], endless=passes is None)
  if passes is not None:
    ds = ds.apply(tf.data.experimental.assert_cardinality(per_pass * passes))
  spec = sampling.SamplingSpec(sampling.SHUFFLE, n, batch_size / n, float(batch_size), sampler)
  if map_fn is not None:
    ds = sampling.map_xy(sampling.attach_spec(ds, spec), map_fn, has_y=y is not None,
                         num_weights=int(sample_weight is not None))
  return sampling.attach_spec(ds.prefetch(2), spec)


def _permutation_batches(arrays, n, batch_size, per_pass, passes, rng, sampler):
  """The generator function of `shuffled_batches`: per pass, count it on `sampler`, draw a
  permutation of the n records and yield its `per_pass` consecutive slices of `batch_size`."""

  def gen():
    done = 0
    while passes is None or done < passes:
      sampler.start_pass()
      perm = rng.permutation(n)
      for i in range(per_pass):
        idx = perm[i * batch_size:(i + 1) * batch_size]
        batch = tf.nest.map_structure(lambda a, idx=idx: a[idx], arrays)
        sampler.step_drawn()
        yield batch if len(batch) > 1 else batch[0]
      done += 1

  return gen
