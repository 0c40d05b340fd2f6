"""The batch-independence probe that runs before the fast path (tf_dpiter.keras.internals.batch_independence)."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.internals import batch_independence

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class CenteredMLP(keras.Model):
  """Subclassed model that subtracts the batch mean of its hidden layer."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.d1, self.d2 = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)

  def call(self, x):
    h = self.d1(x)
    return self.d2(h - keras.ops.mean(h, axis=0, keepdims=True))


def _functional(mixing):
  inp = keras.Input((5,))
  h = keras.layers.Dense(8, activation="tanh", name="hidden")(inp)
  if mixing:
    h = keras.layers.Lambda(lambda t: t - keras.ops.max(t, axis=0), name="batch_max")(h)
  h = keras.layers.Dense(3, name="out")(h)
  return dp.keras.DPModel(inp, h)


@pytest.mark.parametrize("mixing,expected", [(False, ()), (True, ("batch_max",))])
def test_probe_names_the_source_layer_and_caches(mixing, expected):
  keras.utils.set_random_seed(0)
  model = _functional(mixing)
  assert batch_independence.probe_model(model) == expected
  assert getattr(model, "_dp_batch_mixing_verdict") == expected   # cached on the model
  x = np.random.RandomState(0).randn(6, 5).astype("float32")
  assert batch_independence.batch_mixing_layers(model, x) == expected


@pytest.mark.parametrize("clipping,path", [("auto", "vectorized"), ("fast", None)])
def test_subclassed_mixing_model_routed_or_refused(clipping, path):
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(CenteredMLP(name="centered"))
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, clipping=clipping)
  model.compile(optimizer=opt, loss=LOSS)
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 5).astype("float32"), rng.randint(0, 3, 32)
  if path is None:
    with pytest.raises(ValueError, match=r"clipping='fast'.*\['centered'\]"):
      model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  else:
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert opt.resolve_clipping(model) == path
    assert int(model.ledger.sample_count) == 4


@pytest.mark.parametrize("how", ["fit", "train_on_batch"])
def test_lazily_built_model_is_probed_and_keeps_fast_path(how):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  model.compile(optimizer=opt, loss=LOSS)
  rng = np.random.RandomState(0)
  x, y = rng.randn(32, 5).astype("float32"), rng.randint(0, 3, 32)
  if how == "fit":
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  else:
    opt.set_sampling(32, 0.25, "poisson", 8)
    model.train_on_batch(x[:8], y[:8])
  assert batch_independence.probe_model(model) == ()
  assert opt.resolve_clipping(model) == "fast"


def test_probe_needs_two_examples():
  model = _functional(False)
  with pytest.raises(ValueError, match="at least 2 examples"):
    batch_independence.batch_mixing_layers(model, np.zeros((1, 5), "float32"))


class _CenteringInTraining(keras.layers.Layer):
  """Subtracts the batch mean only in training mode (inference mode is the identity)."""

  def call(self, h, training=None):
    return h - keras.ops.mean(h, axis=0, keepdims=True) if training else h


def test_layer_mixing_only_in_training_keeps_fit_off_the_fast_path():
  """fit runs the model with training=True: a layer that mixes only then is found by the
  training-mode probe, clipping='auto' takes the vectorized path (each example alone) and
  one example's effect on the real clipped sum stays within the recorded sensitivity."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                                 _CenteringInTraining(name="centre"), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(0.05, 0.0, learning_rate=0.1)
  model.compile(optimizer=opt, loss=LOSS)
  with pytest.warns(UserWarning, match="centre"):
    verdict = batch_independence.probe_model(model)
  assert verdict == ("centre",)   # the probe runs in training mode and names the source
  x = np.random.RandomState(0).randn(6, 5).astype("float32")
  assert batch_independence.batch_mixing_layers(model, x) == ()   # inference: identity
  assert opt.resolve_clipping(model) == "vectorized"
  rng = np.random.RandomState(0)
  x, y = rng.randn(16, 5).astype("float32"), rng.randint(0, 3, 16)
  report = dp.auditing.check_sensitivity(model, x, y, batch_size=8, num_candidates=8)
  assert report.passed, report


def test_fit_probes_once_per_batch_size_it_uses(monkeypatch):
  """fit probes at the batch size its sampling declares (random inputs, then fit's first
  rows), in training mode, once each: make_train_function probes eagerly and the trace finds
  the verdicts cached; a second fit probes nothing."""
  runs = []
  original = batch_independence.batch_mixing_layers

  def counted(model, x, *args, **kwargs):
    runs.append((len(np.asarray(x)), kwargs.get("training")))
    return original(model, x, *args, **kwargs)

  monkeypatch.setattr(batch_independence, "batch_mixing_layers", counted)
  keras.utils.set_random_seed(0)
  model = _functional(False)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), loss=LOSS)
  rng = np.random.RandomState(0)
  x, y = rng.randn(64, 5).astype("float32"), rng.randint(0, 3, 64)
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert runs == [(16, True), (16, True)]
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert len(runs) == 2


class _DeclaredButMixing(keras.layers.Layer):
  """Declared per example below, but subtracts the batch mean (the probe must catch it)."""

  def call(self, h):
    return h - keras.ops.mean(h, axis=0, keepdims=True)


def test_cached_verdict_is_dropped_when_the_layers_change():
  """A verdict holds for the layers it saw: a layer added to a probed Sequential (here one
  wrongly declared per example) is probed, and so is a change of `trainable` flags."""
  keras.utils.set_random_seed(0)
  dp.keras.declare_per_example(_DeclaredButMixing, "test: a false declaration")
  model = dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(4, name="d1")])
  assert batch_independence.probe_model(model) == ()
  assert batch_independence.probe_model(model) == ()   # cached: the same layers
  model.add(_DeclaredButMixing(name="liar"))
  with pytest.warns(UserWarning, match="liar"):
    assert batch_independence.probe_model(model) == ("liar",)
  model.pop()
  model.layers[0].trainable = False
  assert batch_independence.probe_model(model) == ()   # probed afresh, no mixing left
