"""Trains a small DP model; killed with SIGKILL at a given step, or resumed (test_crash_resume).
The first phase runs as a script (its process is killed); test_crash_resume calls `main` for
the resume phase in its own process (the restart reads only the files the killed run left).

usage: crash_worker.py MODE PHASE WORKDIR, MODE "backup" (keras BackupAndRestore) or
"checkpoint" (ModelCheckpoint + fit(ledger_journal=...)), PHASE "first" (SIGKILL after step
KILL_AT) or "resume" (restart and finish). The resume phase prints one line
"RESULT {json}" with the optimizer iterations restored and at the end, and the ledger count.
"""

import json
import os
import signal
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402
import tf_dpiter.keras  # noqa: E402,F401  registers the DP classes for keras.models.load_model

N, BATCH, EPOCHS, KILL_AT, SAVE_FREQ = 400, 20, 4, 47, 10   # 20 Poisson steps per epoch


class Kill(keras.callbacks.Callback):
  """SIGKILL (no cleanup, no on_train_end) right after step KILL_AT."""

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) >= KILL_AT:
      os.kill(os.getpid(), signal.SIGKILL)


class Probe(keras.callbacks.Callback):
  """Optimizer iterations when training (re)starts, after any restore."""

  def on_train_begin(self, logs=None):
    self.restored = int(self.model.optimizer.iterations.numpy())


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model(np.zeros([1, 6], "float32"))
  return model


def main(mode, phase, work):
  warnings.simplefilter("ignore")
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)
  ckpt = os.path.join(work, "model.keras")
  probe = Probe()
  extra = [Kill()] if phase == "first" else []
  if mode == "backup":
    model = _model()
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(work, "backup"),
                                                  save_freq=SAVE_FREQ), probe] + extra
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0)
  else:
    model = keras.models.load_model(ckpt) if phase == "resume" else _model()
    callbacks = [keras.callbacks.ModelCheckpoint(ckpt, save_freq=SAVE_FREQ), probe] + extra
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - 1, callbacks=callbacks, verbose=0,
              ledger_journal=os.path.join(work, "ledger.journal"))
  result = {"restored": probe.restored, "iterations": int(model.optimizer.iterations.numpy()),
            "samples": int(model.ledger.sample_count.numpy()),
            "epsilon": dp.accounting.epsilon(model.ledger, 1e-5)}
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main(*sys.argv[1:4])
