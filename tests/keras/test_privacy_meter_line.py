"""PrivacyMeter(verbose=1) prints its epsilon line on a line of its own, also under fit's
progress bar (verbose=1), whose line Keras ends only after the user callbacks' on_epoch_end."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp


@pytest.fixture(scope="module")
def model():
  """One compiled model for this module's fits (one train function: fit's verbosity is not
  part of it; the lines tested are the meter's, whatever the ledger holds before)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _fit(model, verbose, capsys):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 3)).astype("float32")
  y = rng.integers(0, 2, 64)
  capsys.readouterr()
  model.fit(x, y, batch_size=16, epochs=2, verbose=verbose,
            callbacks=[dp.keras.PrivacyMeter(1e-3, verbose=1)])
  return capsys.readouterr().out


def _epsilon_lines(out):
  return [line for line in out.split("\n") if "epsilon = " in line]


def test_meter_line_is_its_own_under_the_progress_bar(model, capsys):
  out = _fit(model, 1, capsys)
  lines = _epsilon_lines(out)
  assert len(lines) == 2, out
  for k, line in enumerate(lines, 1):
    assert line.startswith(f"epoch {k}: epsilon = "), repr(line)
  # and after the epoch's bar: the bar's final line precedes each meter line
  assert out.index("epoch 1: epsilon") > out.index("Epoch 1/2")
  assert out.index("epoch 1: epsilon") < out.index("Epoch 2/2")


def test_meter_line_without_a_progress_bar(model, capsys):
  for verbose in (0, 2):
    lines = _epsilon_lines(_fit(model, verbose, capsys))
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"]
