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
  """The `ledger` of a DP model, else of its optimizer; PrivacyConfigError when neither has
  one."""
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


def check_ledger_covers(model):
  """Refuses (PrivacyConfigError, saying how to supply the ledger) a compiled DP model whose
  optimizer took more steps than its ledger (`model_ledger`) holds samples."""
  samples = int(model_ledger(model).sample_count.numpy())
  saved_ledger.check_counts(model_iterations(model), samples)


class LedgerCoverage(keras.callbacks.Callback):
  """Runs `check_ledger_covers` at the first batch of `fit`, after every on_train_begin
  (where BackupAndRestore and the journal restore); DPModel.fit adds it."""

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
  ledger when it holds more samples; after every execution and at the end of training the
  new samples and passes are appended and fsynced (module docstring's rule). `DPModel.fit`
  puts it first, so a step is journaled before any other callback sees it, and adds it with
  BackupAndRestore (backup_dir/privacy_ledger.journal, deleted with the backup when training
  ends normally) or fit(..., ledger_journal=path). Every chunk carries the optimizer's
  iterations; before the first step a journal that ends before them is refused
  (`LedgerJournal.check_covers`): its tail was cut or it is an older copy.

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
    if not self._checked and self._journal is not None:
      self._checked = True
      self._journal.check_covers(model_iterations(self.model))

  def on_train_batch_end(self, batch, logs=None):
    self._append()

  def on_train_end(self, logs=None):
    self._append()
