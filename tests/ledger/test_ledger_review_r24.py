"""Review R24 (session 49): the durability of a copied-weights ledger adoption across a crash.

Relation and unit: add/remove one example, Poisson sampling q = 10/100 (fit on N = 100 arrays
at batch_size 10), C = 1, z = 1; a sample is one noised step. Epsilon is compared with
dp-accounting's RDP accountant called by hand at delta = 1e-5. Rule: every noised step that
touched the released weights is charged once, also after a crash and restart (McMahan et al.
2018, "A General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 6; the ledger journal's rule, `ledger.journal`).

The killed run is a process of its own (this file run as a script, SIGKILL, no cleanup): a
source DP model fit 3 steps, its weights copied by value into a new DP model (which adopts the
source's ledger at its first record), fit under BackupAndRestore (save_freq=1: its journal
at backup_dir/privacy_ledger.journal) and killed after its step 2, before any record or
callback that step's end would run after the kill. The restart, in the test's process (the
source's run is not there: nothing can be adopted again), builds the model afresh and fits
under the same BackupAndRestore. Measured: the journal holds the source's 3 samples and the
copy's 2 (5), and the resumed ledger 3 + 6 = 9 at iteration 6 (restored at 2, then the
epoch's 4 steps), the source's run among its identities: the adoption survives the crash
(negative result, no defect).
"""

import os
import signal
import subprocess
import sys

import dp_accounting as dpa
import keras
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
N, BATCH, STEPS, KILL_AT, DELTA = 100, 10, 4, 2, 1e-5


def _by_hand(steps, q=BATCH / N):
  return dpa.rdp.RdpAccountant().compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.0)), steps)).get_epsilon(DELTA)


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, 4)).astype(np.float32),
          rng.normal(size=(N, 1)).astype(np.float32))


def _model(seed):
  import tf_dpiter as dp  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(seed)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(3),
                                 keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  model.build((None, 4))
  return model


class _Kill(keras.callbacks.Callback):
  """SIGKILL right after the copy's step KILL_AT (its journal appended, its backup saved)."""

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) >= KILL_AT:
      os.kill(os.getpid(), signal.SIGKILL)


def _fit_copy(model, work, kill):
  x, y = _data()
  backup = keras.callbacks.BackupAndRestore(os.path.join(work, "backup"), save_freq=1)
  model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, verbose=0,
            callbacks=[backup] + ([_Kill()] if kill else []))
  return model


def first_phase(work):
  """The killed process: the source's 3 steps, the copy's fit killed after its step 2."""
  x, y = _data()
  source = _model(0)
  source.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=3, verbose=0)
  copy = _model(1)
  copy.set_weights(source.get_weights())
  with open(os.path.join(work, "source_run"), "w", encoding="utf-8") as f:
    f.write(source.optimizer.ledger.run_id)
  _fit_copy(copy, work, kill=True)


@pytest.mark.slow   # a process of its own (about 12 s); the default tier: the journal's cover
def test_an_adopted_ledger_survives_a_kill_and_restart(tmp_path):
  """The journal of the killed copy holds 5 samples (the source's 3, the copy's 2), epsilon =
  5 steps by hand; the restarted fit ends at iteration 6 with 9 samples (3 + 6), the source's
  run among them, epsilon = 9 steps by hand."""
  from tf_dpiter import accounting  # pylint: disable=import-outside-toplevel
  from tf_dpiter.ledger import journal  # pylint: disable=import-outside-toplevel
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  first = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
                         check=False)
  assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
  path = os.path.join(tmp_path, "backup", "privacy_ledger.journal")
  samples, queries, passes = journal.LedgerJournal(path).read()
  assert samples.shape[0] == 3 + KILL_AT
  assert accounting.epsilon((samples, queries, passes), DELTA, accountant="rdp") == (
      pytest.approx(_by_hand(3 + KILL_AT), rel=1e-6))
  source_run = (tmp_path / "source_run").read_text(encoding="utf-8")
  resumed = _fit_copy(_model(2), str(tmp_path), kill=False)
  ledger = resumed.optimizer.ledger
  steps = int(resumed.optimizer.iterations.numpy())   # the restored 2 and an epoch's 4
  assert steps == KILL_AT + STEPS
  assert int(ledger.sample_count) == 3 + steps, ledger.run_table()
  assert source_run in {rid for rid, n, _ in ledger.run_table() if n}
  assert accounting.epsilon(ledger, DELTA, accountant="rdp") == pytest.approx(
      _by_hand(3 + steps), rel=1e-6)


def test_the_journal_after_the_copys_first_step_holds_the_adoption(tmp_path):
  """The cover of the kill test in this process: the source's 3 steps, a copy by value fit 2
  steps with fit(ledger_journal=...) (appended and fsynced after each step): the journal
  holds 5 samples (epsilon 5 steps by hand), so a kill after the copy's first step loses no
  adopted sample."""
  from tf_dpiter import accounting  # pylint: disable=import-outside-toplevel
  from tf_dpiter.ledger import journal  # pylint: disable=import-outside-toplevel
  x, y = _data()
  source = _model(0)
  source.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=3, verbose=0)
  copy = _model(1)
  copy.set_weights(source.get_weights())
  path = str(tmp_path / "ledger.journal")
  copy.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=KILL_AT, verbose=0,
           ledger_journal=path)
  samples, queries, passes = journal.LedgerJournal(path).read()
  assert samples.shape[0] == 3 + KILL_AT
  assert accounting.epsilon((samples, queries, passes), DELTA, accountant="rdp") == (
      pytest.approx(_by_hand(3 + KILL_AT), rel=1e-6))


if __name__ == "__main__":
  first_phase(sys.argv[1])
