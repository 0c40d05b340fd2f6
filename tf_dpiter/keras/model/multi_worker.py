"""What `model.fit` needs under tf.distribute.MultiWorkerMirroredStrategy (several processes).

`MultiWorkerFitMixin` builds the model from this worker's first local replica's batch (Keras'
`strategy.reduce("MEAN", batch)` takes one tensor, not a nest) and gives every log a leading
axis of 1, so Keras' axis-0 MEAN is the mean over replicas. Put it first: `class
M(MultiWorkerFitMixin, DPSequential)`. The data side is
`data.indexed_sampling.distributed_poisson_batches`.

Noise: every worker noises the all-reduced clipped sum and Keras averages the workers'
updates, so independent generators would give std z C / sqrt(W) for W workers, not z C.
`fit` therefore copies the chief's generator state to every worker first (`synchronize_noise`):
all draw the same noise, std z C. `secure_mode` (os.urandom, no state) is refused.

Files: only the chief writes the ledger (`LedgerJournal`, `LedgerExport`) and the
`BackupAndRestore` backup. On other workers `fit` drops `LedgerExport`, makes the journal
read-only (loaded from the chief's file at train begin when readable, never appended) and
`BackupAndRestore` restore-only (Keras' callback is not multi-worker aware). The backup
directory must be on a file system every worker reads.

Fault tolerance (Keras' model): a dead worker stalls the collectives, and the whole job is
restarted with the same `BackupAndRestore` directory. Every noised step ever taken is charged,
so after any number of restarts the chief's ledger holds at least the restored optimizer's
iterations and its epsilon is at least that of an uninterrupted run of the same steps.
"""
import inspect
import os

import keras
import tensorflow as tf

from tf_dpiter import ledger as ledger_lib
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.model import fit_sampling
from tf_dpiter.keras.callbacks import ledger as ledger_callbacks
from tf_dpiter.keras.internals.runtime import broadcast_from_chief  # noqa: F401 (re-exported)
from tf_dpiter.keras.internals.runtime import is_chief
from tf_dpiter.keras.internals.runtime import num_workers

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)
_DP_FIT_KWARGS = ("sampling", "population_size", "ledger_journal")   # DPModel.fit's own keywords


def synchronize_noise(strategy, optimizer):
  """Makes the DP optimizer's noise generator on every worker a copy of the chief's
  (`optimizer.synchronize_noise`, which this calls).

  Args:
    strategy: the MultiWorkerMirroredStrategy.
    optimizer: a tf_dpiter DP optimizer.
  """
  optimizer.synchronize_noise(strategy)


class ReadOnlyLedgerJournal(ledger_callbacks.LedgerJournal):
  """A non-chief worker's `LedgerJournal` (same arguments): loads the chief's file on train
  begin when it exists and holds more samples; never creates, appends to or deletes it."""

  def on_train_begin(self, logs=None):
    """Loads the chief's journal into the ledger when the file exists and holds more."""
    if os.path.exists(self.path):
      journal = ledger_lib.LedgerJournal(self.path, key=self.key)
      self.resumed = journal.resume(ledger_callbacks.model_ledger(self.model))

  def on_train_batch_end(self, batch, logs=None):
    """Writes nothing (the chief appends the step)."""

  def on_train_end(self, logs=None):
    """Writes nothing."""


class RestoreOnlyBackup(keras.callbacks.BackupAndRestore):
  """A non-chief worker's copy of the user's `BackupAndRestore` `backup` (its directory and
  settings): restores the chief's backup, never writes one."""

  def __init__(self, backup):
    super().__init__(backup.backup_dir, save_freq=backup.save_freq,
                     double_checkpoint=backup.double_checkpoint,
                     delete_checkpoint=backup.delete_checkpoint)

  def on_epoch_end(self, epoch, logs=None):
    """Writes no backup (the chief does)."""

  def on_train_batch_end(self, batch, logs=None):
    """Writes no backup (the chief does)."""

  def on_train_end(self, logs=None):
    """Deletes nothing (the chief removes the backup when delete_checkpoint is set)."""


def worker_callbacks(callbacks, journal, chief):
  """A new list of the callbacks one worker runs (fit's `callbacks`, in order): the chief's
  unchanged; on other workers none writes a ledger or backup file, and the journal fit keeps
  (`journal`, fit_sampling.journal_path) is read only."""
  callbacks = list(callbacks or [])
  if chief:
    return callbacks
  out, has_journal = [], False
  for cb in callbacks:
    if isinstance(cb, ledger_callbacks.LedgerExport):
      continue
    if isinstance(cb, ledger_callbacks.LedgerJournal):
      has_journal = True
      if not isinstance(cb, ReadOnlyLedgerJournal):
        cb = ReadOnlyLedgerJournal(cb.path, key=cb.key)
    elif isinstance(cb, keras.callbacks.BackupAndRestore) and not isinstance(
        cb, RestoreOnlyBackup):
      cb = RestoreOnlyBackup(cb)
    out.append(cb)
  if journal is not None and not has_journal:
    out.insert(0, ReadOnlyLedgerJournal(journal))
  return out


def _check_global_sample(x):
  """Refuses data whose global step is not one sample of the sampling it declares.

  Under several workers Keras gives each worker its share of the rows of its OWN pipeline's
  element: arrays or a single-process dataset (dp.data.poisson_batches, shuffled_batches)
  would have every worker draw its own sample of all n records, and a global step would join
  parts of independent samples (a record can enter one step's sum twice: 2 S where the ledger
  states S; measured: 32 such (record, step) pairs in 100 steps of 2 workers). Only a
  distributed dataset built from one global sample (dp.data.distributed_poisson_batches:
  each worker yields its own part of the shared Poisson sample) is accepted.

  Raises:
    PrivacyConfigError: `x` not a tf.distribute.DistributedDataset declaring its sampling.
  """
  if isinstance(x, tf.distribute.DistributedDataset) and (
      sampling_lib.get_sampling_spec(x) is not None):
    return
  raise PrivacyConfigError(
      "`x` must be a distributed dataset of one global sample under several workers, e.g. "
      "dp.data.distributed_poisson_batches(strategy, source, expected_batch_size=B): from "
      "arrays or a single-process dataset every worker would draw its own sample of all the "
      "records and a step would join them (a record can enter one step twice). Received: x "
      f"of type {type(x).__name__}")


class MultiWorkerFitMixin:
  """`fit` under MultiWorkerMirroredStrategy (module docstring); inert on one worker."""

  def fit(self, *args, **kwargs):
    """DPModel.fit after `synchronize_noise`, with this worker's `worker_callbacks`.

    Args:
      *args, **kwargs: as DPModel.fit (keras.Model.fit plus sampling, population_size,
        ledger_journal).

    Returns:
      The History object of keras.Model.fit.

    Raises:
      ParameterValueError: secure_mode noise under several workers, or as DPModel.fit.
      PrivacyConfigError: under several workers, `x` not a distributed dataset that declares
        its sampling (dp.data.distributed_poisson_batches).
    """
    strategy = self.distribute_strategy
    if num_workers(strategy) > 1:
      dp_kwargs = {k: kwargs.pop(k) for k in _DP_FIT_KWARGS if k in kwargs}
      kwargs = dict(_FIT_SIGNATURE.bind(self, *args, **kwargs).arguments)
      kwargs.pop("self")
      _check_global_sample(kwargs.get("x"))
      synchronize_noise(strategy, self.optimizer)
      callbacks = list(kwargs.get("callbacks") or [])
      path = fit_sampling.journal_path(
          callbacks, dp_kwargs.get("ledger_journal") or self.optimizer.ledger_journal)
      kwargs["callbacks"] = worker_callbacks(callbacks, path, is_chief(strategy))
      args, kwargs = (), {**kwargs, **dp_kwargs}
    return super().fit(*args, **kwargs)

  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if iterator is not None and data_batch is None and num_workers(self.distribute_strategy) > 1:
      for _, _, it in iterator:
        batch = next(it)
        break
      local = self.distribute_strategy.experimental_local_results
      data_batch = keras.tree.map_structure(
          lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v, batch)
      iterator = None
    return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

  def train_step(self, data):
    """The DP train step; under several workers every log gets a leading axis of 1.

    Args:
      data: one replica's batch.

    Returns:
      The logs dict.
    """
    logs = super().train_step(data)
    if num_workers(self.distribute_strategy) == 1:
      return logs
    return keras.tree.map_structure(lambda t: tf.reshape(t, [1]), logs)
