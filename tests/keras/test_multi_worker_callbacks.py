"""Only the chief writes ledger and backup files (tf_dpiter.keras.model.multi_worker.worker_callbacks),
checked in one process: the callbacks a non-chief worker runs read the chief's journal and
backup and write nothing. The multi-process runs are in test_multi_worker (slow)."""

import os

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras import callbacks as dp_callbacks
from tf_dpiter.keras.model import multi_worker

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model():
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=LOSS)
  return model


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(64, 4).astype("float32"), rng.randint(0, 3, 64)


def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, names in os.walk(root) for f in names)


def test_chief_keeps_its_callbacks(tmp_path):
  cbs = [keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
         dp_callbacks.LedgerExport(str(tmp_path / "l.json"))]
  assert multi_worker.worker_callbacks(cbs, str(tmp_path / "j"), chief=True) == cbs


@pytest.mark.parametrize("explicit_journal", [False, True])
def test_non_chief_callbacks_write_no_ledger_or_backup(tmp_path, explicit_journal):
  journal = str(tmp_path / "backup" / "privacy_ledger.journal")
  other = keras.callbacks.History()
  cbs = [keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1),
         dp_callbacks.LedgerExport(str(tmp_path / "ledger.json")), other]
  if explicit_journal:
    cbs.insert(1, dp_callbacks.LedgerJournal(journal, key="k"))
  out = multi_worker.worker_callbacks(cbs, journal, chief=False)
  kinds = [type(c) for c in out]
  assert kinds == ([multi_worker.RestoreOnlyBackup, multi_worker.ReadOnlyLedgerJournal, type(other)]
                   if explicit_journal else
                   [multi_worker.ReadOnlyLedgerJournal, multi_worker.RestoreOnlyBackup,
                    type(other)])
  ro = next(c for c in out if isinstance(c, multi_worker.ReadOnlyLedgerJournal))
  assert (ro.path, ro.key) == (journal, "k" if explicit_journal else None)
  backup = out[kinds.index(multi_worker.RestoreOnlyBackup)]
  assert (backup.backup_dir, backup.save_freq) == (str(tmp_path / "backup"), 1)
  x, y = _data()
  model = _model()
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=out)
  assert int(model.ledger.sample_count.numpy()) == 8
  assert _files(tmp_path) == []                  # no journal, export or backup written


def test_non_chief_reads_the_chiefs_journal_and_backup(tmp_path):
  x, y = _data()
  backup = str(tmp_path / "backup")
  chief = _model()
  chief.fit(x, y, batch_size=16, epochs=2, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
  before = {p: (tmp_path / p).read_bytes() for p in _files(tmp_path)}
  assert "backup/privacy_ledger.journal" in before
  journal = os.path.join(backup, "privacy_ledger.journal")
  cbs = multi_worker.worker_callbacks(
      [keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)], journal, chief=False)
  worker = _model()
  hist = worker.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=cbs)
  assert len(hist.history["loss"]) == 1          # restored after the chief's 2 epochs
  # the chief's 8 samples, then this worker's 4 steps (charged in memory, never written)
  assert int(worker.ledger.sample_count.numpy()) == 12
  assert {p: (tmp_path / p).read_bytes() for p in _files(tmp_path)} == before


def test_dp_fit_keywords_are_taken_out_before_keras_fit_signature():
  """Under several workers `MultiWorkerFitMixin.fit` binds the rest of its keywords to
  keras.Model.fit's signature, so every keyword DPModel.fit adds must be set aside first:
  a keyword missing there (population_size was) fails the bind with a TypeError."""
  import inspect

  from tf_dpiter.keras.model import models
  own = {name for name, p in inspect.signature(models.DPModelMixin.fit).parameters.items()
         if p.kind == p.KEYWORD_ONLY}
  assert own and own == set(multi_worker._DP_FIT_KWARGS), (own, multi_worker._DP_FIT_KWARGS)
