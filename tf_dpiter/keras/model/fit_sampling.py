"""How `DPModel.fit` samples its batches and declares them to the ledger (McMahan et al. 2018, Section 5).

`fit(x, y, batch_size=B)` on arrays samples by Poisson by default: each record joins each
step independently with probability q = B / N (B the *expected* batch size), round(N / B)
steps per epoch unless `steps_per_epoch` is given; the ledger records policy "poisson" (add
or remove one example; sensitivity S).

The guarantee compares the run on D with the run on D' = D plus or minus one example, both
sampled at the SAME q (dp-accounting's PoissonSampledDpEvent(q, ...)), so q must not be
computed from the private data:

* `fit(..., population_size=N)` declares a public N (the population's size, or a public
  bound on the dataset's): q = B / N, each of the n records given is included with
  probability q whatever n is, and the noised sum is divided by q N = B. The guarantee holds
  for every pair of neighbours: the dataset's size stays private.
* Without it, N = n = len(x) of the run's first Poisson fit, kept for the run
  (`run_population`): the dataset's size is TREATED AS PUBLIC (as TF Privacy's
  `compute_dp_sgd_privacy(n, ...)`); the log line, `model.privacy_statement` and every
  Poisson report say so. Where n is sensitive (small n), declare population_size.

`fit(..., sampling="shuffle")` (the default when num_microbatches M < batch_size makes
microbatches of several examples; M = batch_size samples by Poisson as M = None) cuts a fresh
permutation per pass into disjoint batches of B (`dp.data.shuffled_batches`); the ledger
records policy "shuffle" (replace one example, sensitivity 2S, no amplification: each pass
whose steps were taken costs one mechanism). `population_size` is refused with it.

`validation_split` holds out the arrays' last fraction before sampling, with a warning: the
guarantee covers the training part (add or remove one of its examples); the held-out
examples are not protected, and which ones are held out depends on the arrays' length.
`sample_weight` and `class_weight` weigh each example's loss inside its record before clipping
(weight 0: in no record). Data tf_dpiter does not sample (a plain tf.data.Dataset, a
generator, a PyDataset) is refused unless declared with `optimizer.set_sampling`.
"""

import math
import os
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.ledger import policies as ledger_policies
from tf_dpiter.ledger import records
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.keras.callbacks import privacy as callbacks_lib
from tf_dpiter.data import shuffling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

SAMPLINGS = (None, "poisson", "shuffle")
JOURNAL_NAME = "privacy_ledger.journal"

UNDECLARED_DATA_MESSAGE = (
    "cannot tell how this data is sampled, so the ledger cannot state what the steps cost. "
    "Declare it: pass arrays (fit(x, y, batch_size=B) samples by Poisson; sampling='shuffle' "
    "for shuffled passes), or build the data with dp.data.poisson_batches(x, y, "
    "expected_batch_size=B) or dp.data.shuffled_batches(x, y, batch_size=B); for data you "
    "sample yourself call model.optimizer.set_sampling(population_size, "
    "selection_probability, policy, sample_size) before fit, and with policy 'shuffle' also "
    "model.ledger.record_passes(1) whenever a new permutation starts")


def num_rows(x):
  """The rows of the first array of fit's `x`, or None for a dataset, a PyDataset, or leaves
  without a leading dimension."""
  if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
    return None
  leaves = [a for a in tf.nest.flatten(x) if a is not None]
  if not leaves or not all(hasattr(a, "shape") and len(a.shape) > 0 for a in leaves):
    return None
  return int(leaves[0].shape[0])


def _to_numpy(nest, name):
  """fit's array argument `name` as numpy arrays in the same nest, every list made a tuple (as
  Keras' array adapter: tf.data would stack a list as ONE tensor); a tf.RaggedTensor is kept.

  Raises:
    PrivacyConfigError: a sparse leaf (the samplers and the per-record clipping need dense
      rows).
  """
  if nest is None:
    return None

  def convert(leaf):
    if isinstance(leaf, tf.RaggedTensor):
      return leaf
    array = np.asarray(leaf)
    if array.ndim == 0:   # a sparse leaf: an opaque 0-d object array
      raise PrivacyConfigError(
          f"`{name}` must hold dense or ragged arrays for DP fit: the samplers and the "
          "per-record clipping gather and pad rows. Densify sparse ones "
          f"(`tf.sparse.to_dense`, `.toarray()`). Received: {name} holding a "
          f"{type(leaf).__name__}")
    return array

  return tf.nest.map_structure(convert, keras.tree.lists_to_tuples(nest))


def _check_ragged(x, y, policy, pad):
  """Refuses ragged arrays in fit's x and y (after `_to_numpy`) where DP fit cannot take
  them: shuffled passes (policy "shuffle") slice numpy arrays, and padded samples (`pad`:
  jit_compile, several replicas) need one static shape.

  Raises:
    PrivacyConfigError: a ragged leaf with shuffled passes, or with padded samples.
  """
  if not any(isinstance(t, tf.RaggedTensor) for t in tf.nest.flatten((x, y))):
    return
  if policy != "poisson":
    raise PrivacyConfigError(
        "`sampling` must be 'poisson' (the default) for ragged arrays: shuffled passes slice "
        "dense arrays. Pad the rows to one length (`.to_tensor()`, with `mask_zero=True` or a "
        f"Masking layer) to shuffle them. Received: sampling={policy!r}")
  if pad:
    raise PrivacyConfigError(
        "`jit_compile` must be False, and the strategy a single replica, for ragged arrays: "
        "XLA and replica shards need padded samples of one static shape, which ragged rows do "
        "not have. Pad the rows to one length (`.to_tensor()`, with `mask_zero=True` or a "
        "Masking layer), or compile with jit_compile=False. Received: ragged arrays with "
        "padded samples")


def class_weight_to_sample_weight(y, class_weight):
  """Per-example weights [n] from a {class index: weight} dict (Keras' class_weight).

  y: integer labels [n] or [n, 1], or one-hot / probabilities [n, C] (argmax). Classes
  missing from the dict weigh 1. Raises ValueError for other label layouts.
  """
  if not isinstance(class_weight, dict):
    raise ParameterValueError(f"class_weight must be a dict {{class index: weight}}, got {class_weight!r}")
  if y is None or isinstance(y, (dict, list, tuple)):
    raise PrivacyConfigError("class_weight needs a single label array y (one output); pass "
                             "sample_weight instead")
  y = np.asarray(y)
  if y.ndim == 2 and y.shape[1] > 1:
    y = np.argmax(y, axis=1)
  y = np.round(y.reshape(y.shape[0], -1)[:, 0] if y.ndim > 1 else y).astype(np.int64)
  return np.asarray([float(class_weight.get(int(c), 1.0)) for c in y], np.float32)


def pad_for_replicas(dataset, replicas):
  """Each batch of `dataset` padded with zero rows of sample weight 0 up to a multiple of
  `replicas`, so a multi-replica strategy splits it into equal shards.

  Privacy: unchanged. A row of weight 0 is padding: it joins no record of the step, the
  denominator counts real records only, and the sampled records are the same."""
  def pad(*element):
    x, y, w = keras.utils.unpack_x_y_sample_weight(element)
    n = tf.shape(tf.nest.flatten(x)[0])[0]
    extra = (replicas - n % replicas) % replicas
    w = tf.ones([n], tf.float32) if w is None else tf.cast(w, tf.float32)

    def rows(t):
      return tf.concat([t, tf.zeros(tf.concat([[extra], tf.shape(t)[1:]], 0), t.dtype)], 0)

    return (tf.nest.map_structure(rows, x), tf.nest.map_structure(rows, y),
            tf.concat([w, tf.zeros([extra], tf.float32)], 0))

  return dataset.map(pad)


def _split_validation(a, x, y, sw, opt):
  """Keras' validation_split: the last fraction of the arrays, before any sampling; the run's
  statement then says the guarantee covers the training part only (`validation_note`)."""
  split = a.pop("validation_split", 0.0) or 0.0
  if not split or a.get("validation_data") is not None:
    return x, y, sw
  if not 0.0 < split < 1.0:
    raise ParameterValueError(
        f"`validation_split` must be in [0, 1). Received: validation_split={split!r}")
  n = num_rows(x)
  at = int(math.floor(n * (1.0 - split)))
  if at in (0, n):
    raise ParameterValueError(
        f"`validation_split` must leave at least one training and one validation example out "
        f"of the {n}. Received: validation_split={split!r}")
  _VALIDATION_SPLITS[opt] = (split, n - at, n)
  warnings.warn(
      f"validation_split={split} holds out the last {n - at} of the {n} examples: the privacy "
      f"guarantee covers the {at} training examples (add or remove one of them); the held-out "
      "examples are not protected (their validation metrics are computed without noise), and "
      "which examples are held out moves with the arrays' length. Split the data yourself "
      "and pass validation_data= to fix both parts", UserWarning, stacklevel=5)
  head = lambda t: None if t is None else tf.nest.map_structure(lambda v: v[:at], t)
  tail = lambda t: None if t is None else tf.nest.map_structure(lambda v: v[at:], t)
  val = (tail(x), tail(y)) if sw is None else (tail(x), tail(y), tail(sw))
  a["validation_data"] = val
  return head(x), head(y), head(sw)


def _resolve_sampling(sampling, opt, batch_size):
  """(policy name, reason for the log line) for fit on arrays from fit's `sampling`, the
  optimizer's M and the batch size B. M == B (TF Privacy's default) is per-example clipping
  and samples by Poisson as M=None does; only microbatches of several examples make the
  default shuffled passes, and refuse sampling="poisson".

  Raises:
    PrivacyConfigError: an unknown sampling, or "poisson" with microbatches of several
      examples.
  """
  if sampling not in SAMPLINGS:
    raise PrivacyConfigError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
  m = opt.private_step.num_microbatches
  per_example = m is not None and m == batch_size
  if sampling is None:
    if m is not None and not per_example:
      return "shuffle", f"sampling=None with num_microbatches={m} means shuffled passes"
    return "poisson", "sampling=None on arrays means Poisson sampling" + (
        f"; num_microbatches={m} = batch_size: one example per microbatch, i.e. per-example "
        "clipping" if per_example else "")
  if sampling == "poisson" and m is not None and not per_example:
    raise PrivacyConfigError(
        f"`num_microbatches` must be None or equal to batch_size={batch_size} with "
        f"sampling='poisson' (num_microbatches={m} makes microbatches of several examples, and "
        "under add or remove one example removing one re-deals the others among them). Use "
        f"sampling='shuffle', or num_microbatches=None or {batch_size} (per-example "
        f"clipping). Received: num_microbatches={m}")
  return sampling, f"sampling={sampling!r}"


def arrays_to_dataset(a, opt, sampling, pad=True, population_size=None):
  """Replaces the array arguments of fit (dict `a`, edited) by a sampled dataset.

  Args:
    a: fit's bound arguments (a dict, edited in place: the arrays become the dataset).
    opt: the DP optimizer.
    sampling: fit's `sampling` (None, "poisson" or "shuffle").
    pad: Poisson samples are padded to a static size (XLA needs one shape); False leaves
      them unpadded (no compute on padding rows; the train function takes any batch size).
    population_size: N, the public population size q = B / N is stated over (Poisson only;
      see the module docstring for the relation); None: the run's N, else len(x), which is
      then treated as public.

  Returns:
    (SamplingSpec, reason string for the log line).

  Raises:
    PrivacyConfigError: population_size with shuffled passes, not a number >= 1, or smaller
      than batch_size; other bad fit arguments (named).
  """
  x, y = _to_numpy(a.pop("x"), "x"), _to_numpy(a.pop("y", None), "y")
  if y is None:
    raise PrivacyConfigError("fit on arrays needs y: the DP samplers yield (x, y, weights); for a "
                             "model without targets build dp.data.poisson_batches(x, ...) yourself")
  sw = a.pop("sample_weight", None)
  cw = a.pop("class_weight", None)
  if sw is not None:
    sw = np.asarray(sw, np.float32)
    if sw.size != num_rows(x):
      raise PrivacyConfigError(f"sample_weight must hold one weight per example ({num_rows(x)}), got "
                               f"shape {sw.shape}: per-timestep weights are not supported for DP")
    sw = sw.reshape(-1)
  if cw is not None:
    w = class_weight_to_sample_weight(y, cw)
    sw = w if sw is None else sw * w
  shuffle = a.pop("shuffle", True)
  if shuffle is not True:
    warnings.warn(f"fit(shuffle={shuffle!r}) is ignored: the DP sampler draws the batches "
                  "(sampling='poisson' or 'shuffle')", UserWarning, stacklevel=4)
  x, y, sw = _split_validation(a, x, y, sw, opt)
  n = num_rows(x)
  asked = int(a.pop("batch_size", None) or 32)
  policy, reason = _resolve_sampling(sampling, opt, asked)
  _check_ragged(x, y, policy, pad)
  # a declared N is compared with B (q = B / N <= 1), never with the private n
  declared = _check_declared_population(population_size, policy, asked)
  if declared is None and asked > n:
    warnings.warn(f"batch_size={asked} is larger than the {n} training examples: every step "
                  f"uses every example (batch_size={n}, q = 1: no amplification by sampling, a "
                  "larger epsilon per step). Pass batch_size <= the number of examples to "
                  "sample batches", UserWarning, stacklevel=4)
  b = asked if declared is not None else min(asked, n)
  if isinstance(a.get("validation_data"), (tuple, list)):
    a.setdefault("validation_batch_size", min(b, n))
  steps = a.get("steps_per_epoch")
  if policy == "poisson":
    if declared is None:
      declared, source = run_population(opt, n, b), "run"
      if declared is None:
        declared, source = float(n), "data"
    else:
      source = "declared"
    source = _POPULATION_SOURCE.get(opt, source) if source == "run" else source
    _POPULATION_SOURCE[opt] = source
    reason += "; " + population_reason(source, declared, b)
    # One iterator for the whole fit (endless samples, Keras told the epoch's length): no
    # new iterator, first draw and old iterator's teardown at each epoch's start.
    if steps is None:
      steps = sampling_lib.check_poisson_args(declared, b, None, None)[1]
      a["steps_per_epoch"] = steps
    ds = sampling_lib.poisson_batches(x, y, expected_batch_size=b, steps_per_epoch=steps,
                                      sample_weight=sw, max_batch_size="auto" if pad else None,
                                      population_size=declared, endless=True)
  else:
    ds = shuffling.shuffled_batches(x, y, batch_size=b, sample_weight=sw,
                                    passes=None if steps else 1)
  a["x"] = ds
  a["shuffle"] = False
  return sampling_lib.get_sampling_spec(ds), reason


# optimizer -> where the population size of its run's Poisson fits came from: "declared"
# (fit's population_size) or "data" (len(x) of its first fit: treated as public).
_POPULATION_SOURCE = weakref.WeakKeyDictionary()
_VALIDATION_SPLITS = weakref.WeakKeyDictionary()   # optimizer -> (split, held out, n) of a fit


def _check_declared_population(population_size, policy, batch_size):
  """fit's `population_size` N as a float (None when not declared), refused with shuffled
  passes, when not a finite number >= 1, or below the batch size B."""
  if population_size is None:
    return None
  if policy != "poisson":
    raise PrivacyConfigError(
        f"`population_size` must be None with sampling={policy!r}: it states the public N of "
        "Poisson sampling's q = batch_size / N, and shuffled passes are accounted under "
        "replace one example (n fixed, no amplification by sampling). Received: "
        f"population_size={population_size!r}")
  if isinstance(population_size, bool) or not isinstance(
      population_size, (int, float, np.integer, np.floating)) or not (
          math.isfinite(float(population_size)) and population_size >= 1):
    raise PrivacyConfigError(
        "`population_size` must be a finite number >= 1 (the public population size q = "
        f"batch_size / N is stated over). Received: population_size={population_size!r}")
  if batch_size > population_size:
    raise PrivacyConfigError(
        f"`population_size` must be >= batch_size={batch_size} (q = batch_size / N would "
        f"exceed 1). Received: population_size={population_size!r}")
  return float(population_size)


def population_reason(source, population, batch_size):
  """The log line's words on where q's population size N came from: `source` "declared"
  (fit's population_size), "data" (len(x), treated as public) or "run" (the run's ledger)."""
  if source == "declared":
    return (f"q = {batch_size:g} / {population:g} over the declared population_size "
            f"N = {population:g}, public: the dataset's size stays private")
  if source == "run":
    return (f"q = {batch_size:g} / {population:g} over the population size N = "
            f"{population:g} this run's ledger recorded (kept for the run)")
  return (f"q = {batch_size:g} / {population:g} with n = {population:g} taken from the data "
          "and treated as PUBLIC (neighbours are sampled at this same q); pass "
          "population_size=N, a public bound, if the dataset's size is private")


def population_note(optimizer):
  """The statement's sentence on where the Poisson q of `optimizer`'s fits on arrays came
  from, or None (no such fit: the Poisson report's own note states the assumption)."""
  source = _POPULATION_SOURCE.get(optimizer) if optimizer is not None else None
  if source == "data":
    return ("fit's Poisson q = batch_size / n took n = len(x) from the training data "
            "(population_size not given): the dataset's size is treated as public, and the "
            "guarantee compares neighbouring datasets sampled at that same q. Pass "
            "fit(..., population_size=N) with a public N for a guarantee that keeps the size "
            "private.")
  if source == "declared":
    return ("fit's Poisson q = batch_size / N over the declared, public population_size N: "
            "the guarantee holds for every pair of neighbouring datasets, whatever their "
            "sizes.")
  return None


def validation_note(optimizer):
  """The statement's sentence on a fit with `validation_split` (its last one), or None: the
  guarantee covers the training part only (the held-out rows' metrics are computed without
  noise, and which rows are held out moves with the arrays' length)."""
  held = _VALIDATION_SPLITS.get(optimizer) if optimizer is not None else None
  if held is None:
    return None
  split, out, n = held
  return (f"fit(validation_split={split:g}) held out the last {out} of the {n} examples: the "
          "guarantee covers the training examples only (add or remove one of them); the held-"
          "out examples' validation metrics are computed without noise and are not "
          "protected, and which examples are held out moves with the arrays' length. Split "
          "the data yourself and pass validation_data= to fix both parts.")


def run_population(optimizer, n, batch_size):
  """The population size q is stated over in this run: the one the run's ledger recorded for its
  Poisson samples (q = B / N is fixed once per run, independently of the data a later fit is
  given), else None (the first fit: N = n of its arrays). Refuses B > N."""
  led = optimizer.private_step.existing_ledger
  count = 0 if led is None else int(led.sample_count.numpy())
  if count == 0:
    return None
  row = led.get_arrays(start=count - 1)[0][-1]
  if records.policy_name(row[3]) != records.POISSON:
    return None
  declared = float(row[0])
  if batch_size > declared:
    raise PrivacyConfigError(
        f"batch_size={batch_size} is more than the population size N={declared:g} this run's "
        "q = B / N was stated over (its ledger's Poisson samples): q would exceed 1. Use "
        "batch_size <= N, or a new optimizer for a new run")
  if declared != n:
    warnings.warn(
        f"this run's Poisson rate is stated over N={declared:g} records (its ledger), and these "
        f"arrays hold {n}: q stays {batch_size}/{declared:g} (fixed independently of the data); "
        "the expected batch is q x (records given)", UserWarning, stacklevel=4)
  return declared


def describe(spec, reason, meter=None):
  """The fit's log line: the sampling `spec` the ledger records, why (`reason`, shown in
  brackets), and which accountant gives epsilon (the fit's PrivacyMeter `meter`, or none)."""
  what = ledger_policies.get(spec.policy).describe(
      spec.population_size, spec.selection_probability, spec.sample_size)
  acc = ("no PrivacyMeter: epsilon from dp.accounting.epsilon(model.ledger, delta)"
         if meter is None else f"epsilon by the {meter.accountant.upper()} accountant "
         f"(dp-accounting) from the ledger, PrivacyMeter delta = {meter.delta:g}")
  return f"tf_dpiter DP-SGD: {what} [{reason}]; {acc}"


# model -> the SamplingSync of its fit in progress (StopAtPrivacyBudget asks it what the next
# steps start: `passes_ahead`).
_ACTIVE = weakref.WeakKeyDictionary()


def passes_ahead(model, count):
  """The passes (shuffle) / epochs (balls in bins) not yet charged that the next `count`
  steps of the model's fit in progress would use (an int >= 0), or None when no sampler of
  the fit counts them (outside fit, other policies)."""
  sync = _ACTIVE.get(model)
  if sync is None or not sync._begun or not hasattr(sync.sampler, "passes_ahead"):  # pylint: disable=protected-access
    return None
  taken = int(model.ledger.sample_count.numpy()) - sync._first_sample  # pylint: disable=protected-access
  return sync.sampler.passes_ahead(taken, count)


class SamplingSync(keras.callbacks.Callback):
  """Internal, the fit's first callback: moves the passes the fit's steps used into the
  ledger, starts a ledger-owned schedule where the ledger says, prints the log line, and has
  the fit's PrivacyMeters write their epoch logs, so every later callback sees the passes
  and epsilon. A pass (shuffle) or epoch (balls in bins) is charged when one of its steps is
  taken: one only a prefetch started costs nothing.
  """

  def __init__(self, sampler, line):
    super().__init__()
    self.sampler = sampler
    self.line = line
    self._begun = False
    self._first_sample = 0

  def _begin(self):
    """Once per fit, after the journal and BackupAndRestore restored (on_train_begin, after
    this callback) and before the first iterator draws: the fit's first step is the next
    one drawn, and a ledger-owned schedule (cyclic Poisson) starts at the ledger's position."""
    if self._begun or self.sampler is None:
      return
    self._begun = True
    _ACTIVE[self.model] = self
    _settle_open_fits(self.model.ledger)   # fits of this ledger whose `close` never ran
    self._first_sample = int(self.model.ledger.sample_count.numpy())
    if hasattr(self.sampler, "begin_fit"):
      self.sampler.begin_fit()
    if hasattr(self.sampler, "take_used_passes"):
      _OPEN_FITS[self.sampler] = (weakref.ref(self.model.ledger), self._first_sample)
    check_tree_pass(self.model.optimizer, self.sampler)
    if hasattr(self.sampler, "resume_at"):
      from tf_dpiter.data import cyclic_poisson  # pylint: disable=g-import-not-at-top
      cyclic_poisson.check_continuation(self.model.ledger, self.sampler,
                                        int(self.model.optimizer.iterations.numpy()))
      self.sampler.resume_at(self.model.ledger)
    self._snapshot()

  def _snapshot(self):
    """Hands a ledger-owned schedule the position of the next step, read here between steps
    (`CyclicPoissonSampler.snapshot_position`): an iterator's generator starts inside the step
    that pulls its first batch, racing that step's own ledger write."""
    if self._begun and hasattr(self.sampler, "snapshot_position"):
      self.sampler.snapshot_position(int(self.model.ledger.cycle_position.numpy()))

  def _sync(self):
    if self.sampler is None:
      return
    if hasattr(self.sampler, "take_used_passes"):
      if not self._begun:
        return
      taken = int(self.model.ledger.sample_count.numpy()) - self._first_sample
      new = self.sampler.take_used_passes(taken)
    else:
      new = self.sampler.take_new_passes()
    if new:
      self.model.ledger.record_passes(new)

  def on_train_begin(self, logs=None):
    """Starts the fit's privacy logs and prints the sampling line (Keras callback hook)."""
    self._begun = False
    callbacks_lib.begin_fit(self.model, passes_ahead=passes_ahead)
    if self.line:
      print(self.line)

  def on_epoch_begin(self, epoch, logs=None):
    """Begins the fit's sampling bookkeeping (first epoch only; see `_begin`)."""
    self._begin()

  def on_train_batch_begin(self, batch, logs=None):
    """Same as on_epoch_begin, for a fit whose epoch hook did not run first."""
    self._begin()
    self._snapshot()

  def on_train_batch_end(self, batch, logs=None):
    """Records in the ledger the passes this batch's steps used."""
    self._sync()
    self._snapshot()

  def on_epoch_end(self, epoch, logs=None):
    """Records new passes, then writes epsilon and delta into the epoch's logs."""
    self._sync()
    callbacks_lib.write_privacy_logs(self.model, epoch, logs)

  def on_train_end(self, logs=None):
    """Records the passes used since the last batch (`close`)."""
    self.close()

  def close(self):
    """Ends the fit's bookkeeping, whatever ended the fit (idempotent): records the passes its
    steps used and unbinds the fit. `DPModel.fit` calls it in a `finally`, since Keras calls no
    on_train_end when a step raises while the steps before it were applied and charged; should
    it never run, the next fit on the same ledger charges them first (`_settle_open_fits`)."""
    if self._begun:
      self._sync()
      _OPEN_FITS.pop(self.sampler, None)
    if hasattr(self.sampler, "snapshot_position"):
      self.sampler.snapshot_position(None)
    self._begun = False
    if self.model is not None:   # None: Keras raised before it gave the callbacks their model
      _ACTIVE.pop(self.model, None)


# sampler (shuffle, balls in bins) -> (weak ref to the ledger, its sample count when the fit
# began) of a fit in progress: the steps taken since are the ledger's samples beyond it.
_OPEN_FITS = weakref.WeakKeyDictionary()


def _settle_open_fits(ledger):
  """Charges into `ledger` the passes used by the steps of every fit on it that never closed
  (`SamplingSync.close`): a fit's steps are the ledger's samples since it began (a later
  unclosed fit's steps counted too: a pass a sampler only prefetched may then be charged,
  the safe side)."""
  for sampler, (ref, first) in list(_OPEN_FITS.items()):
    if ref() is ledger:
      del _OPEN_FITS[sampler]
      new = sampler.take_used_passes(int(ledger.sample_count.numpy()) - first)
      if new:
        ledger.record_passes(new)


def check_tree_pass(optimizer, sampler):
  """Refuses tree aggregation whose trees would span two shuffled passes of the real length.

  The ledger charges one tree per shuffled pass, so `restart_every` must divide the steps of
  a pass as the sampler really makes it: floor(n / B) with drop_remainder, ceil(n / B)
  without (Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or
  Shuffling", Appendix D: one participation per tree).
  """
  if getattr(optimizer, "noise", "iid") != "tree":
    return
  per_pass = getattr(sampler, "steps_per_pass", None)
  r = optimizer.private_step.noise_params.get("restart_every")
  if per_pass and r and per_pass % r:
    raise PrivacyConfigError(
        f"noise='tree' with restart_every={r}: the ledger charges one tree per shuffled pass, "
        f"and a pass of this dataset is {per_pass} steps (drop_remainder drops the last, "
        f"smaller batch), which restart_every must divide: use restart_every={per_pass} (or a "
        "divisor), or drop_remainder=False if ceil(n / B) is a multiple of restart_every")


def journal_path(callbacks, ledger_journal):
  """The journal file fit keeps (a str, or None): fit's `ledger_journal` (a non-empty path,
  else refused), else JOURNAL_NAME in the backup_dir of the first BackupAndRestore among
  `callbacks`."""
  if ledger_journal is not None:
    if not isinstance(ledger_journal, (str, os.PathLike)) or not os.fspath(ledger_journal):
      raise ParameterValueError(f"ledger_journal must be a file path, got {ledger_journal!r}")
    return os.fspath(ledger_journal)
  for cb in callbacks:
    if isinstance(cb, keras.callbacks.BackupAndRestore):
      return os.path.join(cb.backup_dir, JOURNAL_NAME)
  return None
