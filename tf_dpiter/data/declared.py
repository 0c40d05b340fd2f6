"""A user's own shuffled tf.data pipeline, declared to the ledger and counting its passes.

`Dataset.from_tensor_slices((x, y)).shuffle(n).batch(B)` visits every record at most once
per pass: the premise of the "shuffle" policy (McMahan et al. 2018, "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 5): every pass started
is charged one un-amplified Gaussian mechanism under replace-one adjacency (sensitivity 2S).
`declare_shuffled(dataset, population_size, batch_size)` makes the dataset count its passes on
a `ShuffleSampler` (a pass starts at each iteration's first batch and every `steps_per_pass`
batches after it) and carry the "shuffle" SamplingSpec `DPModel.fit` reads. Custom loops:
`optimizer.ledger.record_passes(spec.sampler.take_new_passes())` after their steps.

The user is responsible for what the declaration asserts: within a pass each record appears
at most once (`.repeat()` before `.shuffle()`, sampling with replacement or duplicating
augmentation break it), and a batch holds at most `batch_size` records. The pass length is
checked: an iteration that ends after a number of batches that is not a multiple of
steps_per_pass (a `.filter`, a `.take`, an undeclared drop_remainder) makes the next
iteration's first batch fail with a PrivacyConfigError (`ShuffleSampler.start_iteration`),
before any step takes it: under noise="tree" that pass would start inside a tree.
"""

import math

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.data import shuffling
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError


def _check_batch_axis(dataset, batch_size):
  """Refuses batches whose static size exceeds batch_size (the ledger's sample size)."""
  for spec in tf.nest.flatten(dataset.element_spec):
    dims = getattr(spec, "shape", None)
    if dims is not None and dims.rank and dims[0] is not None and dims[0] > batch_size:
      raise PrivacyConfigError(
          f"the dataset's batches hold {dims[0]} records, more than the declared "
          f"`batch_size`. Received: batch_size={batch_size}; declare the batch size the "
          "pipeline's .batch(...) uses")


def declare_shuffled(dataset, population_size, batch_size, steps_per_pass=None):
  """`dataset` (the user's shuffled, batched pipeline) declared as shuffled passes.

  Args:
    dataset: a tf.data.Dataset of batches (x, y[, sample_weight]) that visits each of the
      `population_size` records at most once per pass (module docstring).
    population_size: n, the records in the data set.
    batch_size: B, the records per batch (the last batch of a pass may be smaller).
    steps_per_pass: batches in one pass; default ceil(n / B) (floor(n / B) if the pipeline
      batches with drop_remainder=True, fewer if it filters records: pass it then). Every
      iteration must yield a multiple of it, else its next iteration is refused (module
      docstring).

  Returns:
    a tf.data.Dataset with the same elements, counting its passes on a ShuffleSampler and
    carrying a SamplingSpec with policy "shuffle", q = B / n (`dp.data.get_sampling_spec`).

  Raises:
    ParameterTypeError: `dataset` is not a tf.data.Dataset, or a count is not an integer.
    PrivacyConfigError: population_size < 1, batch_size outside [1, population_size],
      steps_per_pass < 1, or static batches larger than batch_size; when iterated (wrapped by
      tf.data in a tf.errors.InvalidArgumentError, raised as it is by `DPModel.fit`), an
      iteration started after one whose number of batches was not a multiple of
      steps_per_pass.
    ParameterValueError: the dataset already carries a sampling declaration.
  """
  if not isinstance(dataset, tf.data.Dataset):
    raise ParameterTypeError(
        f"`dataset` must be a tf.data.Dataset. Received: dataset={dataset!r}")
  validation.check_integer("population_size", population_size, 1, error=PrivacyConfigError)
  validation.check_integer("batch_size", batch_size, 1, int(population_size), PrivacyConfigError)
  if steps_per_pass is None:
    steps_per_pass = int(math.ceil(population_size / batch_size))
  validation.check_integer("steps_per_pass", steps_per_pass, 1, error=PrivacyConfigError)
  if sampling.get_sampling_spec(dataset) is not None:
    raise PrivacyConfigError("`dataset` already carries a sampling declaration (it was made by a "
                             "tf_dpiter sampler); pass it to fit as it is")
  _check_batch_axis(dataset, int(batch_size))
  sampler = shuffling.ShuffleSampler(int(steps_per_pass))
  per = int(steps_per_pass)

  def count(index):
    if int(index) == 0:
      sampler.start_iteration()   # refuses a pass after one of another length (this fit's)
    if int(index) % per == 0:
      sampler.start_pass()
    sampler.step_drawn()
    return np.int64(0)

  def counted(index, element):
    tick = tf.numpy_function(count, [index], tf.int64, stateful=True)
    with tf.control_dependencies([tick]):
      return tf.nest.map_structure(tf.identity, element)

  # enumerate restarts at 0 with every iterator: a new iteration starts a new pass
  ds = dataset.enumerate().map(counted).prefetch(2)
  spec = sampling.SamplingSpec(sampling.SHUFFLE, int(population_size),
                               batch_size / population_size, float(batch_size), sampler)
  return sampling.attach_spec(ds, spec)
