"""A DP fit a callback interrupts at a batch hook (models._FitFingerprints.settle).

Relation: add/remove one example, unit example (shuffle sampling, n = 40, batch 10, z = 1,
C = 1). The weights held around the user's batch callbacks are the private steps' output
when no callback moved them: the fit's steps are then charged and stated (the next fit goes
on); a callback that wrote the weights and raised leaves values no private step produced,
refused at every later check. Before the settle rule (session 38) the interrupted run's
weights were refused too once the traced-subset check (review R7) compared every recorded
variable with its records.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp


class _Stop(Exception):
  pass


class _RaiseAtBatch(keras.callbacks.Callback):
  """Raises at the end of batch `at`, after adding `write` to the first kernel."""

  def __init__(self, at, write):
    super().__init__()
    self.at, self.write = at, write

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.at:
      if self.write:
        kernel = self.model.layers[0].kernel
        kernel.assign(kernel + self.write)
      raise _Stop()


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  return model


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(40, 3)).astype("float32"),
          rng.normal(size=(40, 1)).astype("float32"))


@pytest.mark.parametrize("write", [0.0, 0.5])
def test_an_interrupted_fit_keeps_its_steps_unless_the_callback_wrote(write):
  x, y = _data()
  model = _model()
  with pytest.raises(_Stop):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle",
              callbacks=[_RaiseAtBatch(1, write)])
  if write:
    with pytest.raises(dp.errors.PrivacyConfigError, match="changed outside its DP optimizer"):
      model.privacy_statement(1e-5)
    return
  assert model.privacy_statement(1e-5).steps == 2
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert model.privacy_statement(1e-5).steps == 6
