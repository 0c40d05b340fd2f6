"""Cyclic Poisson (b-min-separation) sampling for correlated-noise training.

Claim: add or remove one example; the unit is the example. Each example is put in one of b
groups by a public hash (BLAKE2b) of *its own identity* (its record's bytes, or a given id),
never by its position or by n, so adding or removing one example moves no other. Step p of
the ledger's cyclic stream Poisson-samples group p mod b with probability q: an example's
participations are at least b steps apart, what amplified banded matrix factorization needs
(Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Section 5 and
Theorem 4; any partition fixed independently of the other examples, so no secret is needed).
The expected batch is q n / b. The ledger records policy "cyclic_poisson" with b as
`sample_size`; the accountant charges ceil(T / b) Poisson-sampled Gaussian steps.

The schedule is ledger state: the next step's position p is the ledger's
`PrivacyLedger.cycle_position`. `DPModel.fit` binds the sampler to its ledger and every new
iterator starts at the position fit read between steps (`snapshot_position`), so steps drawn
ahead and dropped never shift the cycle. Outside `fit`, call `sampler.resume_at(ledger)`.
The grouping is the run's too: a later fit of a correlated-noise run must give every example
the identity it had (the same arrays and dtypes, or the same `example_ids`); fit refuses
identities the run did not have (`check_continuation`). The ledger keeps a digest of the
run's identities (`PrivacyLedger.cyclic_grouping`), so the rule holds across a restore, a
reload and a new process.
`.repeat()` on the dataset is refused.
"""

import hashlib
import threading
import weakref

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger import records

CYCLIC_POISSON = records.CYCLIC_POISSON
_PERSON = b"tfdpiter.cyclic"   # BLAKE2b personalization: the group hash of this module only


def record_identities(x, y=None):
  """Per-example identities, a list of n bytes: BLAKE2b-128 of each example's own x and y
  rows (nests of arrays, n records on the leading axis; y may be None), dtype, shape and
  bytes, so they do not change when other examples are added or removed. Identical records
  share an identity and group, which the claim allows."""
  leaves = [np.ascontiguousarray(np.asarray(a)) for a in tf.nest.flatten((x, y)) if a is not None]
  n = int(leaves[0].shape[0])
  out = []
  for i in range(n):
    h = hashlib.blake2b(digest_size=16, person=b"tfdpiter.record")
    for a in leaves:
      h.update(str((a.dtype.str, a.shape[1:])).encode())
      h.update(_row_bytes(a, i))
    out.append(h.digest())
  return out


def _row_bytes(a, i):
  """The content bytes of row i (object arrays, e.g. Python strings: their repr, since their
  raw bytes would be pointers that differ between processes)."""
  if a.dtype == object:
    row = a[i]
    return repr(row.tolist() if isinstance(row, np.ndarray) else row).encode()
  return np.ascontiguousarray(a[i]).tobytes()


def index_identities(n):
  """Identities (a list of n bytes: the little-endian int64 index) of examples known only by
  an index 0..n-1 (ids that never move)."""
  return [int(i).to_bytes(8, "little", signed=True) for i in range(int(n))]


def identity_digest(identity):
  """BLAKE2b-64 of one bytes identity, an int in [0, 2^64): its group's hash, and the
  fingerprint a run keeps of its examples (`check_continuation`)."""
  digest = hashlib.blake2b(identity, digest_size=8, person=_PERSON).digest()
  return int.from_bytes(digest, "little")


class CyclicPoissonSampler:
  """Index sampler: groups by a hash of each example's identity; Poisson within a turn."""

  def __init__(self, population_size, num_groups, expected_batch_size, seed=None,
               identities=None):
    """Args:
      population_size: n records.
      num_groups: b >= 1, the cycle length (the min separation; >= the strategy's bands).
      expected_batch_size: q n / b, so q = expected_batch_size b / n must be in (0, 1].
      seed: tests only (reproducible Poisson draws, NOT private; warns). None: OS entropy.
      identities: n bytes objects, one per example (`record_identities`); None: the index
        (then the claim needs neighbouring datasets that keep every other example's index).

    Raises:
      ParameterTypeError: a count or `expected_batch_size` that is not a number of its kind.
      ParameterValueError: an argument out of range, named.
    """
    n = validation.check_integer("population_size", population_size, 1)
    b = validation.check_integer("num_groups", num_groups, 1, n)
    batch = validation.Interval(float, 0, n / b, "right", error=ParameterValueError)
    validation.check_params({"expected_batch_size": batch}, {"expected_batch_size": expected_batch_size})
    ids = index_identities(n) if identities is None else list(identities)
    if len(ids) != n:
      raise ParameterValueError(f"identities must hold one id per example (n={n}), got {len(ids)}")
    self._n = n
    self._b = b
    self._q = float(expected_batch_size) * self._b / n
    self._rng = sampling.make_rng(seed, who="CyclicPoissonSampler")
    digests = np.asarray([identity_digest(i) for i in ids], np.uint64)
    self._group_of = (digests % np.uint64(self._b)).astype(np.int64)
    self._fingerprints = np.unique(digests)   # the examples, as `check_continuation` sees them
    self._grouping = "sha256:" + hashlib.sha256(
        b"tfdpiter.cyclic.grouping" + self._fingerprints.astype("<u8").tobytes()).hexdigest()
    self._groups = [np.flatnonzero(self._group_of == g) for g in range(self._b)]
    self._lock = threading.Lock()
    self._step = 0
    self._pending = None
    self._ledger = None
    self._snapshot = None

  # The schedule is ledger state: a dataset of this sampler must not be repeated inside one
  # iterator (`sampling.get_sampling_spec` refuses .repeat()), since a generator restarted by
  # repeat would read the ledger's position while earlier draws still wait in the prefetch.
  ledger_schedule = True

  @property
  def selection_probability(self):
    """q: the probability that a record of the active group joins the step."""
    return self._q

  @property
  def num_groups(self):
    """b, the cycle length (number of groups)."""
    return self._b

  @property
  def fingerprints(self):
    """The sorted distinct `identity_digest`s of the examples (a uint64 numpy array)."""
    return self._fingerprints

  @property
  def grouping(self):
    """The grouping record a ledger keeps of this sampler's examples: "sha256:" + the SHA-256
    of its sorted distinct `fingerprints` (little-endian uint64), a str
    (`PrivacyLedger.cyclic_grouping`)."""
    return self._grouping

  @property
  def step(self):
    """The cycle position of the next draw (the next step samples group step mod b)."""
    return self._step

  def group_of(self, index):
    """The group (0..b-1) of record `index`.

    Args:
      index: int, a record index in [0, n).

    Returns:
      int, the group in [0, b) that the record belongs to.

    Raises:
      ParameterValueError: if `index` is not in [0, n).
    """
    if not 0 <= index < self._n:
      raise ParameterValueError(f"index must be in [0, {self._n}), got {index!r}")
    return int(self._group_of[index])

  def resume_at(self, position):
    """Makes every later iterator of the dataset start at the schedule's position: a bound
    PrivacyLedger's `cycle_position`, read when the iterator's generator starts (`DPModel.fit`
    binds it), or an int for the next iterator.

    Args:
      position: a PrivacyLedger, or an int >= 0.

    Raises:
      ParameterValueError: a negative position.
    """
    with self._lock:
      if hasattr(position, "cycle_position"):
        self._ledger = weakref.ref(position)
        return
      if int(position) < 0:
        raise ParameterValueError(f"position must be >= 0, got {position!r}")
      self._ledger, self._pending = None, int(position)

  def snapshot_position(self, position):
    """Sets (an int) or clears (None) the position the next iterator starts at, read by the
    training thread while no step runs (`DPModel.fit`, before and after every step): a
    generator starts inside the step that pulls from it, when that step's ledger write may
    already have run.

    Args:
      position: an int >= 0, or None (read the bound ledger, outside fit).
    """
    with self._lock:
      self._snapshot = None if position is None else int(position)

  def start_iterator(self):
    """Called by the dataset's generator before its first draw; returns that generator's
    draw function, which starts at the bound ledger's position (else at `resume_at`'s, else
    where the last draw stopped) and keeps its own position, so two iterators alive at once
    (one being dropped) never share a counter."""
    with self._lock:
      ledger = self._ledger() if self._ledger is not None else None
      live = None if ledger is None else int(ledger.cycle_position.numpy())
      if live is not None and self._snapshot is not None and 0 <= live - self._snapshot <= 1:
        start = self._snapshot   # inside fit: the live value may include the running step
      elif live is not None:
        start = live             # outside fit (or a stale snapshot left by a crashed fit)
      elif self._pending is not None:
        start, self._pending = self._pending, None
      else:
        start = self._step
    position = [start]

    def draw():
      p = position[0]
      position[0] = p + 1
      with self._lock:
        self._step = p + 1
      group = self._groups[p % self._b]
      return group[self._rng.random(len(group)) < self._q]

    return draw

  def take_new_passes(self):
    """No passes are counted under cyclic Poisson (each step is charged by the step)."""
    return 0

  def next_indices(self):
    """Sorted indices of the next step's sample (a Poisson sample of the active group)."""
    group = self._groups[self._step % self._b]
    self._step += 1
    return group[self._rng.random(len(group)) < self._q]

  def spec(self):
    """The SamplingSpec the ledger records (sample_size = the cycle length b)."""
    return sampling.SamplingSpec(CYCLIC_POISSON, self._n, self._q, float(self._b), self)

  def max_batch_size(self, num_sd=4.0, multiple=8):
    """A static padded size for the largest group: mean + num_sd sd, rounded up.

    Args:
      num_sd: float, standard deviations of Binomial(m, q) above its mean q m, where m is
        the size of the largest group.
      multiple: int, the size is rounded up to a multiple of this (records).

    Returns:
      int, the padded batch size in records (see `sampling.default_max_batch_size`).
    """
    largest = max(1, max(len(g) for g in self._groups))
    return sampling.default_max_batch_size(largest, min(1.0, self._q), num_sd, multiple)


# ledger -> (the grouping record, the sorted identity digests) of the examples the run this
# process started or continued had: with them a continuation may drop examples, never bring
# one the run did not have; without them (a restored ledger) it must have the run's grouping
_RUN_EXAMPLES = weakref.WeakKeyDictionary()


def check_continuation(ledger, sampler, iterations):
  """Refuses, before the first step of a fit, a cyclic run the PrivacyLedger's claim cannot
  cover. Correlated-noise rows (BandMF, BLT) need participations >= b rows apart in one
  mechanism run: a ledger holding more samples than the optimizer's `iterations` (a
  rolled-back restore), whose last cyclic rows used another b, or whose run did not have one
  of the sampler's example identities (an example under another identity may be in another
  group) is refused; independent noise needs only the count. A continuation must match the
  grouping the run recorded (`PrivacyLedger.set_cyclic_grouping`): any subset of the run's
  examples in the process that holds their digests, else exactly the run's examples (only
  their digest is saved). A run without a record, or with conflicting records, is refused.

  Raises:
    PrivacyConfigError: the continuation is not covered; the message says what to do.
  """
  count = int(ledger.sample_count.numpy())
  row = queries = None
  if count:
    samples, queries = ledger.get_arrays(start=count - 1)
    row = samples[-1]
  if row is None or records.policy_name(row[3]) != CYCLIC_POISSON or not np.isin(
      queries[:, 1], [records.BANDED_GAUSSIAN, records.MATRIX_GAUSSIAN]).any():
    ledger.set_cyclic_grouping(sampler.grouping)   # a new run (or independent noise) starts
    _RUN_EXAMPLES[ledger] = (sampler.grouping, sampler.fingerprints)
    return
  if int(row[2]) != sampler.num_groups:
    raise PrivacyConfigError(
        f"this model's ledger ends with a correlated-noise (BandMF/BLT) run on cyclic Poisson "
        f"with num_groups={int(row[2])}, and this dataset has num_groups={sampler.num_groups}: "
        "changing the cycle mid-run breaks the >= b separation the accounting assumes. Build "
        f"the dataset with num_groups={int(row[2])}, or start a new model and optimizer")
  if count > iterations:
    raise PrivacyConfigError(
        f"this model's ledger holds {count} steps but the optimizer is at iteration "
        f"{iterations}: a restore rolled a correlated-noise (BandMF/BLT) run back, so its "
        "next steps would rerun rows of the same matrix mechanism, which the cyclic Poisson "
        "accounting (Choquette-Choo et al. 2023, Theorem 4) does not cover. Resume from a "
        "checkpoint taken at the ledger's last step (tf.train.Checkpoint or model.save "
        "after fit), or train with noise='iid'")
  recorded = ledger.cyclic_grouping
  if recorded is None or recorded == privacy_ledger.GROUPING_CONFLICT:
    raise PrivacyConfigError(
        "this model's ledger ends with a correlated-noise (BandMF/BLT) run on cyclic Poisson "
        + ("without a record of its examples' grouping (a ledger saved by an earlier version, "
           "or steps recorded outside fit)" if recorded is None else
           "whose grouping records disagree (ledgers of different runs were restored or "
           "merged into it)")
        + ": a continuation that regroups an example could make it eligible at steps closer "
        "than num_groups apart, which the cyclic Poisson accounting (Choquette-Choo et al. "
        "2023, Theorem 4) does not cover. Start a new model and optimizer, or train with "
        "noise='iid'")
  known = _RUN_EXAMPLES.get(ledger)
  if known is not None and known[0] == recorded:   # this process has the run's identities
    new = int(np.count_nonzero(~np.isin(sampler.fingerprints, known[1], assume_unique=True)))
  elif sampler.grouping == recorded:   # a restored ledger: exactly the run's examples
    _RUN_EXAMPLES[ledger] = (recorded, sampler.fingerprints)
    new = 0
  else:
    raise PrivacyConfigError(
        f"this dataset's examples ({sampler.fingerprints.size} identities, grouping "
        f"{sampler.grouping[:19]}...) are not those of the correlated-noise (BandMF/BLT) run "
        f"this model's restored ledger continues (grouping {recorded[:19]}...): an example "
        "is grouped by a hash of its identity (its x and y rows' bytes, dtype and shape, or "
        "its example_ids), so an example given under another identity may change group and "
        "be eligible at steps closer than num_groups apart, which the cyclic Poisson "
        "accounting (Choquette-Choo et al. 2023, Theorem 4) does not cover. After a restore "
        "the ledger knows the run's examples by one digest: pass all of the run's arrays "
        "unchanged (same dtypes) or the same example_ids, or start a new model and optimizer")
  if new:
    raise PrivacyConfigError(
        f"this dataset holds {new} of its {sampler.fingerprints.size} example identities that "
        "the correlated-noise (BandMF/BLT) run this model's ledger continues did not have: an "
        "example is grouped by a hash of its identity (its x and y rows' bytes, dtype and "
        "shape, or its example_ids), so an example given under another identity may change "
        "group and be eligible at steps closer than num_groups apart, which the cyclic "
        "Poisson accounting (Choquette-Choo et al. 2023, Theorem 4) does not cover. Pass the "
        "run's arrays unchanged (same dtypes) or the same example_ids, or start a new model "
        "and optimizer for new examples")


def cyclic_poisson_batches(x, y=None, expected_batch_size=256, num_groups=1,
                           steps_per_epoch=None, max_batch_size="auto", seed=None,
                           example_ids=None):
  """tf.data.Dataset of cyclic Poisson samples, (x_pad, [y_pad,] mask) per step.

  Args:
    x: the features: arrays (or nests) with n records on the leading axis.
    y: the labels, arrays (or nests) with n records on the leading axis, or None.
    expected_batch_size: q n / b.
    num_groups: b (the cycle length).
    steps_per_epoch: steps per iteration of the dataset (default b round(n / (b B)), i.e.
      about one pass over the data in whole cycles).
    max_batch_size: "auto", an int, as in `sampling.poisson_batches`.
    seed: tests only (NOT private). None: OS entropy.
    example_ids: optional [n] ids (ints or strings) that name each example across datasets;
      None: the example's own bytes (`record_identities`). The group is a hash of the id.

  Returns:
    The dataset, carrying a SamplingSpec("cyclic_poisson", n, q, b) whose `sampler` is the
    CyclicPoissonSampler (`sampling.get_sampling_spec`).
  """
  n = sampling.num_records(x if y is None else (x, y))
  if example_ids is None:
    ids = record_identities(x, y)
  else:
    ids = [str(i).encode() if not isinstance(i, bytes) else i for i in np.asarray(
        example_ids, dtype=object).reshape(-1).tolist()]
  sampler = CyclicPoissonSampler(n, num_groups, expected_batch_size, seed, identities=ids)
  if steps_per_epoch is None:
    steps_per_epoch = num_groups * max(1, round(n / (num_groups * expected_batch_size)))
  if max_batch_size == "auto":
    max_batch_size = sampler.max_batch_size()
  return sampling.indexed_batches(sampler.next_indices, x, y, int(steps_per_epoch),
                                  int(max_batch_size), sampler.spec(),
                                  on_start=sampler.start_iterator)
