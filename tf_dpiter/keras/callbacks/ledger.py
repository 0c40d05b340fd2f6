"""Keras callbacks that write the privacy ledger to files: `LedgerExport` (JSON) and
`LedgerJournal` (crash-safe append-only journal, resumed on restart), and `LedgerCoverage`,
which refuses to train a model whose ledger holds fewer samples than the steps its optimizer
took (a model restored without its ledger). Re-exported by `tf_dpiter.keras.callbacks`.

Rule: every noised step ever taken is charged, so a DP model's ledger holds at least one
sample per optimizer iteration; one that holds fewer (e.g. weights restored from a
checkpoint that did not carry the ledger) would report an epsilon below the truth."""

import os

import keras

from tf_dpiter import ledger as ledger_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import saved_ledger


def model_ledger(model):
  """The privacy ledger of a DP model (or of its optimizer); ValueError if it has none.

  Args:
    model: a keras.Model (a tf_dpiter DP model, or one with a DP optimizer).

  Returns:
    The model's `ledger`, else its optimizer's `ledger`.

  Raises:
    PrivacyConfigError: neither the model nor its optimizer has a ledger.
  """
  ledger = getattr(model, "ledger", None)
  if ledger is None:
    ledger = getattr(getattr(model, "optimizer", None), "ledger", None)
  if ledger is None:
    raise PrivacyConfigError("the model has no privacy ledger: train a tf_dpiter DP model")
  return ledger


def model_iterations(model):
  """The optimizer iterations (steps taken) of a compiled model, an int (0 if none)."""
  iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
  return 0 if iterations is None else int(iterations.numpy())


def check_ledger_covers(model, ledger=None):
  """Refuses a model whose optimizer took more steps than its ledger holds samples.

  Args:
    model: a compiled DP keras.Model.
    ledger: its ledger (default: `model_ledger(model)`).

  Returns:
    None.

  Raises:
    PrivacyConfigError: optimizer iterations > ledger samples (the message says how to supply it).
  """
  ledger = model_ledger(model) if ledger is None else ledger
  saved_ledger.check_counts(model_iterations(model), int(ledger.sample_count.numpy()))


class LedgerCoverage(keras.callbacks.Callback):
  """Before the first step of `fit`: `check_ledger_covers` (DPModel.fit adds it).

  The check runs at the first batch, after every on_train_begin (keras.callbacks.
  BackupAndRestore restores the optimizer's iterations there, the journal resumes there).
  """

  def __init__(self):
    super().__init__()
    self._checked = False

  def on_train_begin(self, logs=None):
    """keras.callbacks.Callback.on_train_begin: arms the check."""
    self._checked = False

  def on_train_batch_begin(self, batch, logs=None):
    """keras.callbacks.Callback.on_train_batch_begin: checks once, before the first step."""
    if not self._checked:
      self._checked = True
      check_ledger_covers(self.model)


class LedgerExport(keras.callbacks.Callback):
  """Writes the ledger JSON to `path` at the end of every epoch and of training."""

  def __init__(self, path, every_epoch=True):
    super().__init__()
    if not isinstance(path, str) or not path:
      raise ParameterValueError(f"path must be a non-empty string, got {path!r}")
    self.path = path
    self.every_epoch = every_epoch

  def on_epoch_end(self, epoch, logs=None):
    """keras.callbacks.Callback.on_epoch_end: writes the JSON (if every_epoch)."""
    if self.every_epoch:
      model_ledger(self.model).save_json(self.path)

  def on_train_end(self, logs=None):
    """keras.callbacks.Callback.on_train_end: writes the JSON."""
    model_ledger(self.model).save_json(self.path)


class LedgerJournal(keras.callbacks.Callback):
  """Crash safety: resumes the ledger from an append-only journal and appends every step.

  On train begin the journal (tf_dpiter.ledger.LedgerJournal) is loaded into the model's
  ledger when it holds more samples (a restart after a crash); after every training step
  (execution) and at the end of training the new samples and passes are appended and
  fsynced. Rule: every noised step ever taken is charged, steps re-run after a restore from
  an older backup included, so the ledger's samples >= the restored optimizer's iterations.
  `DPModel.fit` puts this callback first, after the pass sync, so a step is in the journal
  before any other callback can save, log or print its result. Added automatically with
  keras.callbacks.BackupAndRestore (backup_dir/privacy_ledger.journal; Keras deletes the
  backup_dir, journal included, when training ends normally: export the ledger then) or
  with fit(..., ledger_journal=path).

  Every chunk carries the optimizer's iterations at the append. Before the first step (after
  every on_train_begin, so after BackupAndRestore restored the model), a journal that ends
  before the restored model's iterations, keyed or not, is refused (`dp.ledger.LedgerJournal.
  check_covers`): its tail was cut or it is an older copy.

  Args:
    path: the journal file (created on the first append).
    key: optional str/bytes: every chunk also carries an HMAC-SHA256 under this key.

  Raises:
    ParameterValueError: `path` is not a non-empty string; on train begin, a journal that
      was altered or is not a ledger journal; before the first step, one that ends before
      the model's optimizer iterations.
  """

  def __init__(self, path, key=None):
    super().__init__()
    if not isinstance(path, str) or not path:
      raise ParameterValueError(f"path must be a non-empty string, got {path!r}")
    self.path = path
    self.key = key
    self.resumed = 0
    self._journal = None
    self._checked = False

  def on_train_begin(self, logs=None):
    """keras.callbacks.Callback.on_train_begin: opens the journal and resumes the ledger
    from it (`resumed` holds the number of samples read back).

    Args:
      logs: the dict of metric values Keras passes to the callback.
    """
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    self._journal = ledger_lib.LedgerJournal(self.path, key=self.key)
    self.resumed = self._journal.resume(model_ledger(self.model))
    self._checked = False

  def _append(self):
    if self._journal is not None:
      self._journal.append(model_ledger(self.model), iterations=model_iterations(self.model))

  def on_train_batch_begin(self, batch, logs=None):
    """keras.callbacks.Callback.on_train_batch_begin: before the first step, refuses a
    journal that ends before the (restored) model's optimizer iterations.

    Args:
      batch: the index of the batch in the epoch (Keras).
      logs: the dict of metric values Keras passes to the callback.
    """
    if not self._checked and self._journal is not None:
      self._checked = True
      self._journal.check_covers(model_iterations(self.model))

  def on_train_batch_end(self, batch, logs=None):
    """keras.callbacks.Callback.on_train_batch_end: appends the new step to the journal.

    Args:
      batch: the index of the batch in the epoch (Keras).
      logs: the dict of metric values Keras passes to the callback.
    """
    self._append()

  def on_train_end(self, logs=None):
    """keras.callbacks.Callback.on_train_end: appends what is not journaled yet.

    Args:
      logs: the dict of metric values Keras passes to the callback.
    """
    self._append()
