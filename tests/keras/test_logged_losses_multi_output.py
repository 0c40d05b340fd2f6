"""Every number fit logs (loss, per-output losses, unweighted and weighted metrics) equals what
Keras' `model.evaluate` gives on the same records, with the weights frozen (learning rate 0).

Poisson: q = 1 (expected batch = n) puts every record in every sample, so each step's real
examples are exactly the data set, padded with weight-0 rows to a static size. Shuffle: one
pass of n records cut into batches, so an epoch sees every record once. Either way an epoch's
logs are means over the data set, which evaluate computes on the unpadded arrays.

Before the fix the per-output losses (`cls_loss`, `reg_loss`) were updated by the compiled
loss once per record inside the private step, with the batch size as weight, and were not
the epoch means (the total loss was right).
"""

import itertools

import keras
import numpy as np
import pytest

import tf_dpiter as dp

# Nightly tier (-m slow): the subclassed two-output model under XLA (graph stays).
SLOW_CASES = {
    "test_subclassed_multi_output_losses_equal_evaluate[True]"}

N, PAD = 40, 64


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 5)).astype("float32")
  return x, rng.integers(0, 3, N), rng.standard_normal((N, 1)).astype("float32")


def _model(multi, clipping, jit):
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  h = keras.layers.Dense(8, activation="relu")(inp)
  cls = keras.layers.Dense(3, name="cls")(h)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.0, clipping=clipping)
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if multi:
    model = dp.keras.DPModel(inp, [cls, keras.layers.Dense(1, name="reg")(h)])
    model.compile(optimizer=opt, loss=[xent, "mse"], loss_weights=[1.0, 0.5],
                  metrics=[["accuracy"], ["mae"]], weighted_metrics=[["accuracy"], ["mae"]],
                  jit_compile=jit)
  else:
    model = dp.keras.DPModel(inp, cls)
    model.compile(optimizer=opt, loss=xent, metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")],
                  jit_compile=jit)
  return model


def _fit(model, x, y, sampling):
  if sampling == "poisson":
    with pytest.warns(UserWarning):   # seeded sampling is not private (tests only)
      data = dp.data.poisson_batches(x, y, expected_batch_size=N, steps_per_epoch=2,
                                     max_batch_size=PAD, seed=1)
    return model.fit(data, epochs=2, verbose=0).history
  return model.fit(x, y, batch_size=N // 4, sampling="shuffle", epochs=2, verbose=0).history


# Every pair of levels of the four factors, in 5 runs (a covering array of strength 2 over the
# 16 combinations); the other 11 run with -m slow.
_ALL = list(itertools.product([False, True], ["fast", "vectorized"], [False, True],
                              ["poisson", "shuffle"]))
_DEFAULT = [(False, "fast", False, "poisson"), (False, "vectorized", True, "shuffle"),
            (True, "fast", True, "shuffle"), (True, "vectorized", False, "shuffle"),
            (True, "vectorized", True, "poisson")]
_CASES = [pytest.param(*c, marks=() if c in _DEFAULT else pytest.mark.slow) for c in _ALL]


def test_the_default_runs_cover_every_pair_of_levels():
  for i, j in itertools.combinations(range(4), 2):
    assert {(c[i], c[j]) for c in _DEFAULT} == {(c[i], c[j]) for c in _ALL}, (i, j)


@pytest.mark.parametrize("multi,clipping,jit,sampling", _CASES)
def test_every_logged_number_equals_evaluate(multi, clipping, jit, sampling):
  x, y_cls, y_reg = _data()
  y = (y_cls, y_reg) if multi else y_cls
  model = _model(multi, clipping, jit)
  hist = _fit(model, x, y, sampling)
  ev = model.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
  assert ({"loss", "cls_loss", "reg_loss"} if multi else {"loss"}) <= set(hist)
  assert set(hist) == set(ev), (sorted(hist), sorted(ev))
  for key, value in ev.items():
    for epoch in range(2):
      assert hist[key][epoch] == pytest.approx(value, rel=2e-5, abs=1e-6), (key, epoch)
  if multi:   # the total is the weighted sum of the per-output losses it logs
    assert hist["loss"][0] == pytest.approx(hist["cls_loss"][0] + 0.5 * hist["reg_loss"][0],
                                            rel=1e-5)
    _assert_per_output_losses_are_their_own(model, x, y_cls, y_reg, hist)


def _assert_per_output_losses_are_their_own(model, x, y_cls, y_reg, hist):
  """The comparison has teeth: the two outputs' losses differ, and each equals its own loss
  function applied to the frozen model's predictions."""
  pred_cls, pred_reg = model.predict(x, verbose=0)
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  expected_cls = float(np.mean(xent(y_cls, pred_cls)))
  expected_reg = float(np.mean((pred_reg - y_reg) ** 2))
  assert hist["cls_loss"][1] == pytest.approx(expected_cls, rel=1e-5)
  assert hist["reg_loss"][1] == pytest.approx(expected_reg, rel=1e-5)
  assert expected_cls != pytest.approx(expected_reg, rel=1e-2)


class TwoOut(keras.Model):
  """A subclassed two-output model."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(8, activation="relu")
    self.cls, self.reg = keras.layers.Dense(3), keras.layers.Dense(1)

  def call(self, x):
    h = self.hidden(x)
    return self.cls(h), self.reg(h)


@pytest.mark.parametrize("jit", [False, True])
def test_subclassed_multi_output_losses_equal_evaluate(jit):
  x, y_cls, y_reg = _data()
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(TwoOut())
  model.compile(
      optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.0),
      loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
      loss_weights=[1.0, 0.5], jit_compile=jit)
  hist = model.fit(x, (y_cls, y_reg), batch_size=N // 4, sampling="shuffle", epochs=1,
                   verbose=0).history
  ev = model.evaluate(x, (y_cls, y_reg), batch_size=N, verbose=0, return_dict=True)
  per_output = [k for k in ev if k.endswith("_loss")]
  assert len(per_output) == 2, ev
  for key, value in ev.items():
    assert hist[key][0] == pytest.approx(value, rel=2e-5, abs=1e-6), key
