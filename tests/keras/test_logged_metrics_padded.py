"""What fit logs on padded Poisson samples equals what Keras' evaluate gives on the same
records (weights frozen: learning rate 0).

q = 1 (expected batch = n) puts every record in every sample, so each step's real examples
are exactly the data set; padding rows (weight 0) are added up to a static size. Before the
fix the unweighted `metrics=["accuracy"]` counted the padding rows (a Keras habit and TF
Privacy's tutorial); the weighted metrics and the loss were right.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp

N, PAD = 50, 96   # 46 padding rows per step


def _data():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((N, 5)).astype("float32")
  y = rng.integers(0, 3, N)
  return x, y


def _model(clipping, jit):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3)])
  model.compile(
      optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.0, clipping=clipping),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")],
      jit_compile=jit)
  return model


# (fast, graph) and (vectorized, XLA) on padded Poisson samples, with an unweighted accuracy,
# a weighted one and the loss against evaluate, are test_logged_losses_multi_output.py's
# default runs (single-output fast graph Poisson; multi-output vectorized XLA Poisson): here
# the other two in the default suite, all four with -m slow. The (fast, XLA) model, its
# weights frozen, then also fits on the arrays (fit(x, y, batch_size=n) under jit pads its
# Poisson samples to a multiple of 8): both fits' logs against one evaluate.
@pytest.mark.parametrize("clipping,jit", [
    ("fast", True), ("vectorized", False),
    pytest.param("fast", False, marks=pytest.mark.slow),
    pytest.param("vectorized", True, marks=pytest.mark.slow)])
def test_padded_poisson_metrics_equal_evaluate(clipping, jit):
  x, y = _data()
  model = _model(clipping, jit)
  with pytest.warns(UserWarning):   # seeded sampling is not private (tests only)
    data = dp.data.poisson_batches(x, y, expected_batch_size=N, steps_per_epoch=3,
                                   max_batch_size=PAD, seed=1)
  hist = model.fit(data, epochs=2, verbose=0)
  ev = model.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
  for epoch in range(2):
    assert hist.history["acc"][epoch] == pytest.approx(ev["acc"], abs=1e-6)
    assert hist.history["wacc"][epoch] == pytest.approx(ev["wacc"], abs=1e-6)
    assert hist.history["loss"][epoch] == pytest.approx(ev["loss"], rel=1e-5)
  # the padding would have shown: the frozen model is not at 1 - 46/96 accuracy by chance
  assert ev["acc"] * N / PAD != pytest.approx(ev["acc"], abs=1e-3)
  if clipping == "fast" and jit:   # on arrays (the former test_fit_on_arrays_under_xla_...)
    before = model.get_weights()
    hist = model.fit(x, y, batch_size=N, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):   # learning rate 0: the same evaluate
      np.testing.assert_array_equal(a, b)
    assert hist.history["acc"][0] == pytest.approx(ev["acc"], abs=1e-6)
    assert hist.history["loss"][0] == pytest.approx(ev["loss"], rel=1e-5)


@pytest.mark.parametrize("clipping", ["fast", "vectorized"])
def test_unreduced_loss_is_logged_as_the_mean_record_loss(clipping):
  """A loss with reduction=None (TF Privacy's idiom) logs the mean per-record loss, as plain
  Keras' evaluate does (it logged ~batch-size times that on the vectorized path)."""
  x, y = _data()
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(3)])
  model.compile(
      optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.0, clipping=clipping),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
  with pytest.warns(UserWarning):
    data = dp.data.poisson_batches(x, y, expected_batch_size=N, steps_per_epoch=2, seed=1)
  hist = model.fit(data, epochs=1, verbose=0)
  per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(
      y, model.predict(x, verbose=0))
  assert hist.history["loss"][0] == pytest.approx(float(np.mean(per_example)), rel=1e-5)
