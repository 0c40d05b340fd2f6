"""Review R21 (session 48) of weights copied by value (`keras.optimizer.weight_fingerprints`,
session 47: a run starting from values another DP run released adopts that run's ledger).

Relation and unit: add/remove one example, Poisson sampling q = 10/100 (the user's batches
declared with `set_sampling`), C = 1, z = 1 (noise from OS entropy: a released state names its
run); a sample is one noised step. Epsilon is compared with dp-accounting's RDP accountant
called by hand at delta = 1e-5 (McMahan et al. 2018, "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 6: every noised step that
touched the released weights is charged once).

Finding (fixed): the values a custom loop's private steps traced in a tf.function leave
(the usual custom loop) were never registered as released, so a model given them by value
(`copy.set_weights(source.get_weights())`) started a fresh ledger: 1 of the 5 steps its
weights took charged (epsilon 2.133 for 2.902 by hand, measured before the fix).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib
from tf_dpiter.keras.optimizer import weight_fingerprints
from tests.keras import custom_loop_setup as loop

DELTA = 1e-5

# Nightly tier (-m slow): the other pairs of (a host check after the source's loop, the copy's
# step traced or eager); the default tier keeps the source unchecked with a traced copy, and
# the load by load_model.
SLOW_CASES = {
    "test_a_copy_of_a_traced_loops_weights_keeps_its_run[no_check-eager_copy]",
    "test_a_copy_of_a_traced_loops_weights_keeps_its_run[statement-traced_copy]",
    "test_a_copy_of_a_traced_loops_weights_keeps_its_run[statement-eager_copy]",
    "test_a_copy_of_a_loaded_dp_models_backbone_keeps_the_files_run[load_weights]"}
# Nightly too: the float16 cast of a whole model's weights (this module's xfail until review
# R28). tests/keras/test_copied_weights_review_r28.py::test_a_cast_or_transposed_copy_keeps_
# its_run[float16] stays by default: the same fix (R28's dtype-invariant keys), a DP fit's
# float32 weights cast to float16 by set_weights into a float16 DP layer, the copy's 1 step
# charged the source's steps too (3 + 1), with more checks (epsilon as dp-accounting by hand,
# the source charged its own 3); and ...::test_a_cast_copy_between_fits_keeps_the_steps_it_saw
# the float16 copy of a DP model's get_weights.
SLOW_CASES |= {"test_a_copy_cast_to_float16_keeps_its_run"}


def _traced_run(steps, check=False):
  """A plain Keras model trained by a custom loop's traced private steps (`steps` of them, on
  the first 10 records); with `check`, the privacy statement (a host check of the weights)
  runs after them. Returns (model, optimizer)."""
  x, y = loop.data()
  model = loop.regression_model()
  opt = loop.dp_sgd(model.trainable_variables)
  step = tf.function(loop.private_step(opt, loop.record_loss(model), model.trainable_variables))
  for _ in range(steps):
    step(x[:10], y[:10])
  if check:
    statement_lib.run_statement(opt, DELTA)
  return model, opt


def _copy_and_step(values, traced):
  """A new plain model given `values` by value, one private step of its own custom loop
  (traced or eager): its optimizer."""
  x, y = loop.data()
  model = loop.regression_model()
  model.set_weights(values)
  opt = loop.dp_sgd(model.trainable_variables)
  step = loop.private_step(opt, loop.record_loss(model), model.trainable_variables)
  (tf.function(step) if traced else step)(x[:10], y[:10])
  return opt


@pytest.mark.parametrize("traced_copy", [True, False], ids=["traced_copy", "eager_copy"])
@pytest.mark.parametrize("check", [False, True], ids=["no_check", "statement"])
def test_a_copy_of_a_traced_loops_weights_keeps_its_run(traced_copy, check):
  """A source run of 4 traced private steps; a copy of its weights by value, 1 step more: 5
  samples (the source's 4 and its own), epsilon = 5 steps by hand. Before the fix: 1."""
  model, opt = _traced_run(4, check=check)
  assert int(opt.ledger.sample_count) == 4
  copy = _copy_and_step(model.get_weights(), traced_copy)
  ledger = copy.ledger
  assert int(ledger.sample_count) == 5, ledger.run_table()
  assert opt.ledger.run_id in {rid for rid, n, _ in ledger.run_table() if n}
  assert dp.accounting.epsilon(ledger, DELTA, accountant="rdp") == pytest.approx(
      loop.rdp_epsilon(5), rel=1e-6)


def test_a_copy_of_a_traced_loops_weights_into_a_dp_fit_keeps_its_run():
  """The same source (4 traced steps), its weights copied into a DP model fit for 1 step on
  arrays (Poisson q = 10/100 declared by the fit): 5 samples."""
  model, opt = _traced_run(4)
  x, y = loop.data()
  copy = dp.keras.DPSequential([keras.Input((loop.D,)), keras.layers.Dense(1)])
  copy.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=loop.LR), "mse")
  copy.set_weights(model.get_weights())
  copy.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
  assert int(copy.optimizer.ledger.sample_count) == 5
  assert opt.ledger.run_id in {rid for rid, n, _ in copy.optimizer.ledger.run_table() if n}


def test_a_traced_loops_initial_weights_name_no_run():
  """Values the traced steps did not produce (the source's initial weights, recorded at its
  first trace) adopt nothing: a copy of them, 1 step, 1 sample."""
  x, y = loop.data()
  model = loop.regression_model()
  initial = [np.array(w) for w in model.get_weights()]
  opt = loop.dp_sgd(model.trainable_variables)
  step = tf.function(loop.private_step(opt, loop.record_loss(model), model.trainable_variables))
  for _ in range(3):
    step(x[:10], y[:10])
  copy = _copy_and_step(initial, traced=True)
  assert int(copy.ledger.sample_count) == 1


def _dense_model(dtype=None):
  model = dp.keras.DPSequential([keras.Input((loop.D,)), keras.layers.Dense(1, dtype=dtype)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=loop.LR), "mse")
  return model


def _fit(model, steps, callbacks=()):
  x, y = loop.data()
  model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=steps, verbose=0,
            callbacks=list(callbacks))
  return model


def _layer_weights(model):
  return [w for layer in model.layers for w in layer.get_weights()]


@pytest.mark.parametrize("read", [
    pytest.param(lambda model: model.get_weights(), id="model.get_weights"),
    pytest.param(_layer_weights, id="layer.get_weights", marks=pytest.mark.xfail(
        strict=True, reason="review R21 (open, a known issue): a state a DP fit leaves at a "
        "user's train-batch hook is held, not digested; only the DP model's get_weights "
        "registers it (1 sample for 3)"))])
def test_weights_a_batch_callback_copies_keep_their_run(read):
  """A DP fit of 3 steps whose callback copies the weights at each on_train_batch_end (a
  teacher model, a best-so-far copy): the copy after step 2 given to a new DP model, 1 step
  more: 3 samples (2 + 1), epsilon = 3 steps by hand. Measured before the fix: 1 (the fit
  records the weights at a train-batch hook only when a callback moved them,
  `_FitFingerprints._begin`: the states in between were never registered); the DP model's
  `get_weights` now registers the values it hands out. The copy after step 3 (the fit's end
  state, recorded) is charged 4 of 4."""
  snapshots = []

  class Snapshot(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      snapshots.append(read(self.model))

  source = _fit(_dense_model(), 3, [Snapshot()])   # alive: a dead run's ledger is not found
  last = _fit(_copy_into_dense(snapshots[2]), 1)
  assert int(last.optimizer.ledger.sample_count) == 4
  copy = _fit(_copy_into_dense(snapshots[1]), 1)
  assert int(copy.optimizer.ledger.sample_count) == 3
  assert dp.accounting.epsilon(copy.optimizer.ledger, DELTA, accountant="rdp") == (
      pytest.approx(loop.rdp_epsilon(3), rel=1e-6))
  assert int(source.optimizer.ledger.sample_count) == 3


def _copy_into_dense(values, dtype=None):
  model = _dense_model(dtype)
  model.set_weights(values)
  return model


def test_a_copy_cast_to_float16_keeps_its_run():
  """A DP fit of 4 steps, its float32 weights given to a float16 DP model (set_weights
  casts), 1 step: the float16 values are a function of the 4 steps (post-processing), so 5
  samples. Measured: 1 (the cast changes the bits; no released digest matches), a strict
  xfail until review R28, whose order- and dtype-invariant keys of the released states find
  it: 5. A model with a mixed_float16 policy keeps float32 variables (charged 5 of 5 by the
  exact digest)."""
  source = _fit(_dense_model(), 4)
  copy = _fit(_copy_into_dense(source.get_weights(), "float16"), 1)
  assert int(copy.optimizer.ledger.sample_count) == 5


def _backbone_model(head=1):
  model = dp.keras.DPSequential([keras.Input((loop.D,)), keras.layers.Dense(4),
                                 keras.layers.Dense(head)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=loop.LR), "mse")
  return model


@pytest.mark.parametrize("load", ["load_model", "load_weights"])
def test_a_copy_of_a_loaded_dp_models_backbone_keeps_the_files_run(load, tmp_path, monkeypatch):
  """Transfer learning from a file: a DP model trained 4 steps, saved (`model.save` /
  `save_weights`: the file carries its ledger), loaded in a fresh process (here: no live run
  has released anything, `_RELEASED` and `_RELEASED_KEYS` emptied), its first layer's weights
  copied by value into a new DP model with another head, 1 step: 5 samples (the file's 4 and
  its own), epsilon = 5 steps by hand. Measured before the fix: 1 (a load records no released
  state; review R21), both ways of loading; the loaded model itself held the file's 4."""
  source = _fit(_backbone_model(), 4)
  path = str(tmp_path / ("a.keras" if load == "load_model" else "a.weights.h5"))
  (source.save if load == "load_model" else source.save_weights)(path)
  monkeypatch.setattr(weight_fingerprints, "_RELEASED", {})   # another process
  monkeypatch.setattr(weight_fingerprints, "_RELEASED_KEYS", {})
  if load == "load_model":
    loaded = keras.models.load_model(path)
  else:
    loaded = _backbone_model()
    loaded.build((None, loop.D))
    loaded.load_weights(path)
  copy = _backbone_model(head=2)
  copy.build((None, loop.D))
  copy.layers[0].set_weights(loaded.layers[0].get_weights())
  x, y = loop.data()
  copy.fit(x, np.concatenate([y, y], 1), batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
  ledger = copy.optimizer.ledger
  assert int(ledger.sample_count) == 5, ledger.run_table()
  assert dp.accounting.epsilon(ledger, DELTA, accountant="rdp") == pytest.approx(
      loop.rdp_epsilon(5), rel=1e-6)
