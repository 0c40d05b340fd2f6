"""A DP model's checkpoint survives a crash while the next one is written.

Keras writes `model.save` and `save_weights` files in place (the file is truncated when it is
opened), so before this a process killed while `ModelCheckpoint` or `BackupAndRestore` saved
left neither the earlier checkpoint nor the new one, and the ledger the earlier one carried
was lost with it. The DP model writes the file beside the path and renames it over
(`tf_dpiter.files.replaced`): the path holds the earlier checkpoint, whole, until the new one
is complete. The crash here is a real SIGKILL of the training process, sent from inside
Keras' own saving code after the weights were written and before the file was closed.
"""

import os
import signal
import stat
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras.src.saving import saving_lib

import tf_dpiter.keras  # noqa: F401  registers the DP classes for keras.models.load_model
from tests.privacy import crash_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, BATCH = 64, 16   # 4 Poisson steps an epoch

CHILD = r"""
import os, signal, sys, warnings
warnings.simplefilter("ignore")
import keras, numpy as np
from keras.src.saving import saving_lib
from tests.keras.test_crash_safe_save import model_and_data
path, kind = sys.argv[1], sys.argv[2]
model, x, y = model_and_data()
real, saves = saving_lib._save_state, []

def killed_on_the_second_save(*args, **kwargs):
  real(*args, **kwargs)
  if kwargs.get("inner_path") == "":   # the model's whole state written, the file not closed
    saves.append(1)
    if len(saves) == 2:
      os.kill(os.getpid(), signal.SIGKILL)

saving_lib._save_state = killed_on_the_second_save
checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=kind == "weights")
model.fit(x, y, batch_size=16, epochs=3, callbacks=[checkpoint], verbose=0)
"""


def model_and_data():
  """A small DP model (compiled, built: crash_worker's, the kill -9 test's) and its data."""
  model = crash_worker._model()  # pylint: disable=protected-access
  rng = np.random.RandomState(0)
  return model, rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)


@pytest.mark.parametrize("kind,name", [("model", "ckpt.keras"), ("weights", "ckpt.weights.h5")])
def test_a_kill_while_model_checkpoint_writes_leaves_the_earlier_checkpoint(tmp_path, kind,
                                                                             name):
  path = str(tmp_path / name)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  run = subprocess.run([sys.executable, "-c", CHILD, path, kind], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
  if kind == "model":
    restored = keras.models.load_model(path)
  else:
    restored, _, _ = model_and_data()
    restored.load_weights(path)
  # the first epoch's checkpoint, whole: its weights load and its ledger holds its 4 steps
  assert int(restored.ledger.sample_count.numpy()) == N // BATCH


def test_an_error_while_saving_weights_leaves_the_earlier_file(tmp_path, monkeypatch):
  model, x, y = model_and_data()
  path = str(tmp_path / "latest.weights.h5")   # BackupAndRestore's file
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  model.save_weights(path)
  with open(path, "rb") as f:
    before = f.read()
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  real = saving_lib._save_state

  def failing(*args, **kwargs):
    real(*args, **kwargs)
    if kwargs.get("inner_path") == "":
      raise OSError("No space left on device")

  monkeypatch.setattr(saving_lib, "_save_state", failing)
  with pytest.raises(OSError, match="No space left"):
    model.save_weights(path)
  with open(path, "rb") as f:
    assert f.read() == before
  assert os.listdir(tmp_path) == ["latest.weights.h5"]   # the temporary file removed
  monkeypatch.undo()
  model.save_weights(path)   # the next save replaces it
  restored, _, _ = model_and_data()
  restored.load_weights(path)
  assert int(restored.ledger.sample_count.numpy()) == 2 * N // BATCH


def test_a_saved_file_has_the_permissions_keras_gives_and_overwrite_false_still_asks(
    tmp_path, monkeypatch):
  model, x, y = model_and_data()
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
  plain.save(str(tmp_path / "plain.keras"))
  model.save(str(tmp_path / "dp.keras"))
  mode = lambda name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)  # noqa: E731
  assert mode("dp.keras") == mode("plain.keras")
  asked = []
  monkeypatch.setattr("keras.src.utils.io_utils.ask_to_proceed_with_overwrite",
                      lambda filepath: asked.append(filepath) or False)
  model.save(str(tmp_path / "dp.keras"), overwrite=False)   # Keras asks; "no" keeps the file
  assert asked == [str(tmp_path / "dp.keras")]
  assert sorted(os.listdir(tmp_path)) == ["dp.keras", "plain.keras"]
