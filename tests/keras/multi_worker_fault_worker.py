"""One worker of a MultiWorkerMirroredStrategy job with Keras' BackupAndRestore (used by
test_multi_worker_fault): TF_CONFIG comes from the parent.

argv: output JSON path, backup dir (shared by the workers, as BackupAndRestore requires),
files dir, kill_after (this process SIGKILLs itself before its next step once it has
completed that many steps; -1: never).

MultiWorkerFitMixin + DPSequential, fit on distributed_poisson_batches for EPOCHS epochs of
SPE steps; BackupAndRestore saves at every epoch end (its ledger journal is
backup_dir/privacy_ledger.journal); LedgerExport writes files/ledger_<task>.json; every
completed step appends a line to files/steps_<task>.txt (fsync) so the test can count the
noised steps each process took.
"""

import json
import os
import signal
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.data import indexed_records  # noqa: E402
from tf_dpiter.data import indexed_sampling  # noqa: E402
from tf_dpiter.keras import callbacks as dp_callbacks  # noqa: E402
from tf_dpiter.keras.model import multi_worker  # noqa: E402

warnings.simplefilter("ignore")
N, B, Z, C, LR = 400, 40, 1.25, 1.0, 0.5
EPOCHS, SPE = 4, 2                       # 8 global steps when nothing fails


class MultiWorkerDPSequential(multi_worker.MultiWorkerFitMixin, dp.keras.DPSequential):
  pass


class StepLog(keras.callbacks.Callback):
  """Appends one line per completed step; SIGKILLs this process before step `kill_after`."""

  def __init__(self, path, kill_after):
    super().__init__()
    self.path, self.kill_after = path, kill_after
    self.done = 0

  def on_train_batch_begin(self, batch, logs=None):
    if self.done == self.kill_after:
      os.kill(os.getpid(), signal.SIGKILL)

  def on_train_batch_end(self, batch, logs=None):
    self.done += 1
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(f"{batch}\n")
      f.flush()
      os.fsync(f.fileno())


def main():
  out_path, backup_dir, files_dir, kill_after = sys.argv[1:5]
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  task = int(strategy.cluster_resolver.task_id)
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = MultiWorkerDPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(C, Z, learning_rate=LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  data = indexed_sampling.distributed_poisson_batches(
      strategy, indexed_records.ArraySource(x, y), B, EPOCHS * SPE)
  callbacks = [keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False),
               dp_callbacks.LedgerExport(os.path.join(files_dir, f"ledger_{task}.json")),
               StepLog(os.path.join(files_dir, f"steps_{task}.txt"), int(kill_after))]
  history = model.fit(data, epochs=EPOCHS, steps_per_epoch=SPE, callbacks=callbacks, verbose=0)
  out = {"chief": multi_worker.is_chief(strategy), "task": task,
         "epochs_run": len(history.history.get("loss", [])),
         "iterations": int(model.optimizer.iterations.numpy()),
         "samples": int(model.ledger.sample_count.numpy()),
         "epsilon": float(dp.accounting.epsilon(model.ledger, 1e-5)),
         "weights": [float(v) for v in np.concatenate([w.ravel() for w in model.get_weights()])]}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(out, f)


if __name__ == "__main__":
  sys.exit(main())
