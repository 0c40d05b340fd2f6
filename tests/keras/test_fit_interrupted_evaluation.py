"""A fit interrupted during its own evaluation (review R8, session 39, finding 4; Ctrl-C in a
notebook lands between test batches; here a callback raising KeyboardInterrupt at
on_test_batch_end stands for it) recorded what the evaluation wrote: the evaluation hold
(`_FitFingerprints._evaluation_begin` .. `_evaluation_end`) is dropped and `settle` records
the weights held at the test-batch hook, after the evaluation's first batch wrote them.

Claim (models._FitFingerprints docstring): "`checker`, last at on_test_begin, holds the
weights, and `recorder`, first at on_test_end, refuses any that moved (the evaluation writes
nothing the run releases ...)"; `settle`: "weights held at a batch hook that nothing moved
are the private steps' output and are recorded". A test-batch hook holds weights the
evaluation (not the private steps) left; on_test_end never runs.

Relation/unit: replace one example (x[0, 0] = 10.0 in D), unit example; shuffle sampling,
n = 40, batch 10, z = 1, C = 1, one epoch, the validation data the training set (as
tests/keras/test_fit_validation_writes.py, R7 finding 5). Measured (session 39): a layer
keeping the largest input it sees in inference holds 10.0 = x[0, 0] after the interrupted fit;
the statement gives epsilon 10.726 (one shuffled pass, dp_accounting RDP of GaussianDpEvent
(0.5) by hand: 10.726) for a model that carries a record's value un-noised (epsilon =
infinity). The same fit not interrupted is refused ("evaluation of the validation data").
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.keras.test_fit_validation_writes import _Calibration as Calibration


class Interrupt(keras.callbacks.Callback):
  """Ctrl-C during the validation pass, after test batch `at`."""

  def __init__(self, at):
    super().__init__()
    self._at = at

  def on_test_batch_end(self, batch, logs=None):
    if batch == self._at:
      raise KeyboardInterrupt


@pytest.mark.parametrize("at", [0, 3])
def test_an_interrupted_evaluations_write_is_never_stated(at):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  y = rng.normal(size=(40, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), Calibration(), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  with pytest.raises(KeyboardInterrupt):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle",
              validation_data=(x, y), callbacks=[Interrupt(at)])
  assert float(model.layers[0].peak.numpy()) == 10.0   # the record's value, written
  with pytest.raises(dp.errors.PrivacyConfigError):
    model.privacy_statement(1e-5)


def test_an_interrupted_evaluation_that_wrote_nothing_keeps_the_run():
  """The same interruption with no inference write: the steps are stated (2 epochs cut in the
  first's evaluation: 4 steps)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype("float32")
  y = rng.normal(size=(40, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  with pytest.raises(KeyboardInterrupt):
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, sampling="shuffle",
              validation_data=(x, y), callbacks=[Interrupt(1)])
  assert model.privacy_statement(1e-5).steps == 4
