"""`keras.callbacks.TensorBoard` on a DP fit writes its event files (the [tensorboard] extra,
also in [test], installs it)."""

import glob
import importlib.util
import os

import keras
import pytest

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers

_MISSING = importlib.util.find_spec("tensorboard") is None


@pytest.mark.skipif(_MISSING, reason="tensorboard is not installed: pip install "
                    "'tf_dpiter[tensorboard]' (it is in the [test] extra)")
def test_dp_fit_with_tensorboard_writes_event_files(tmp_path):
  x, y = helpers.small_data()
  model = helpers.small_seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                       learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"])
  logdir = str(tmp_path / "logs")
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y),
            callbacks=[keras.callbacks.TensorBoard(log_dir=logdir)])
  for split in ("train", "validation"):
    files = glob.glob(os.path.join(logdir, split, "events.out.tfevents.*"))
    assert files and all(os.path.getsize(f) > 0 for f in files), split
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(os.path.join(logdir, "train"))
  acc.Reload()
  tags = set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])
  assert {"epoch_loss", "epoch_accuracy"} <= tags, tags
  assert int(model.ledger.sample_count.numpy()) > 0   # it was a DP fit
