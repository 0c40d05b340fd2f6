"""DP fit refuses callbacks that act on the un-noised training loss or metrics.

Claim: the model, its step count and its ledger after `DPModel.fit` are (epsilon, delta)-DP,
add/remove one example (Poisson), unit = example; the loss fit logs is computed from the
private batches without noise, for monitoring only. A callback that acts on it (stop, restore
the best weights, lower the learning rate, keep the best checkpoint) is not post-processing of
the noised steps. Pair (review R, session 33): D = 40 examples, D' = D plus one outlier of label
1e4; EarlyStopping(monitor="loss", baseline=50, patience=0) ran D 3 epochs and D' 2, with
certainty (the outlier's squared error alone exceeds 50 whatever the noise). Now refused before
the first step; monitors of the ledger's keys and of held-out validation data are accepted.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp


def _pair():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 2)).astype("float32")
  y = rng.normal(size=(40, 1)).astype("float32")
  x2 = np.concatenate([x, np.zeros((1, 2), "float32")])
  y2 = np.concatenate([y, np.full((1, 1), 1e4, "float32")])
  return (x, y), (x2, y2)


def _model(jit_compile=False):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01), "mse",
                jit_compile=jit_compile)
  return model


REFUSED = [
    lambda: keras.callbacks.EarlyStopping(monitor="loss", baseline=50.0, patience=0),
    lambda: keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True),
    lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss"),
    lambda: keras.callbacks.ModelCheckpoint("/tmp/never.weights.h5", monitor="loss",
                                            save_best_only=True, save_weights_only=True),
]


@pytest.mark.parametrize("make, jit_compile", [(make, False) for make in REFUSED] + [
    (keras.callbacks.TerminateOnNaN, False), (REFUSED[0], True)])
def test_callbacks_acting_on_the_training_loss_are_refused_on_both_datasets(make, jit_compile):
  # TerminateOnNaN (review R's addendum): one record of label inf made the logged loss inf
  # and ended the run after 1 step (3 without it); the record's gradient was clipped to zero.
  # Under XLA (Keras' accelerator default) the refusal is the same: it runs before the trace.
  for x, y in _pair():
    model = _model(jit_compile)
    with pytest.raises(dp.errors.PrivacyConfigError,
                       match=r"callbacks\[0\].*(monitor='loss'|TerminateOnNaN)"):
      model.fit(x, y, batch_size=len(x), epochs=3, verbose=0, callbacks=[make()])
    assert int(model.optimizer.iterations.numpy()) == 0
    assert int(model.ledger.sample_count.numpy()) == 0


def test_a_validation_monitor_needs_validation_data():
  (x, y), _ = _pair()
  model = _model()
  with pytest.raises(dp.errors.PrivacyConfigError, match="no validation data"):
    model.fit(x, y, batch_size=len(x), epochs=2, verbose=0,
              callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss")])


def test_monitors_of_the_ledger_and_of_held_out_data_are_accepted():
  # The pair trains the same number of steps under these monitors (epsilon is a function of
  # the ledger, the held-out loss a function of the noised weights and public data).
  rng = np.random.default_rng(1)
  held_out = (rng.normal(size=(8, 2)).astype("float32"),
              rng.normal(size=(8, 1)).astype("float32"))
  steps = []
  for x, y in _pair():
    model = _model()
    model.fit(x, y, batch_size=len(x), epochs=3, verbose=0, validation_data=held_out,
              callbacks=[dp.keras.PrivacyMeter(1e-5),
                         keras.callbacks.EarlyStopping(monitor="epsilon", mode="max", patience=10),
                         keras.callbacks.EarlyStopping(monitor="val_loss", patience=5),
                         keras.callbacks.ModelCheckpoint("/tmp/unused.weights.h5",
                                                         save_weights_only=True)])
    steps.append(int(model.ledger.sample_count.numpy()))
    assert steps[-1] == int(model.optimizer.iterations.numpy())
  assert steps == [3, 3]


def test_a_training_loss_monitor_inside_a_callback_list_is_refused():
  # review R3 (session 34): a CallbackList (which dispatches every hook to the callbacks it
  # holds) hid EarlyStopping(monitor="loss"): accepted, the run stopped after 2 of 5 epochs
  (x, y), _ = _pair()
  model = _model()
  stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"callbacks\[0\]\.callbacks\[0\].*training metric"):
    model.fit(x, y, batch_size=10, epochs=5, verbose=0,
              callbacks=[keras.callbacks.CallbackList([stop])])
  assert int(model.ledger.sample_count.numpy()) == 0


@pytest.mark.parametrize("name", ["epsilon", "val_mse"])
def test_a_training_metric_named_like_an_allowed_key_is_refused(name):
  # review R3 (session 34): a compiled training metric named "epsilon" (no PrivacyMeter then
  # writes that key) or "val_mse" was monitored as the ledger's key or a held-out metric
  (x, y), _ = _pair()
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse",
                metrics=[keras.metrics.MeanSquaredError(name=name)])
  stop = keras.callbacks.EarlyStopping(monitor=name, mode="min", patience=0, min_delta=1e9)
  with pytest.raises(dp.errors.PrivacyConfigError, match=f"must not be named '{name}'"):
    model.fit(x, y, batch_size=10, epochs=5, verbose=0, callbacks=[stop],
              validation_data=(x[:5], y[:5]))
  assert int(model.ledger.sample_count.numpy()) == 0
