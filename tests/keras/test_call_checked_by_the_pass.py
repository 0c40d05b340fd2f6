"""The model's training-mode call checked by the step's own fast pass refuses what the call's
own trace refuses (issue 42: the first DP step traces the call once, not twice).

Claim (data_writes module docstring): a DP model whose training-mode call writes a variable
from the data, or reads a variable `model.variables` does not list, is refused before its first
step, whatever the entry point; relation add/remove one example (Poisson), unit example. Where
no probe runs the model on real rows before the step is traced (train_on_batch, fit on a
dataset: no rows kept), make_train_function no longer traces the call
(data_writes.refuse_model_writes); the fast pass's own ops are analysed instead (its writes:
refuse_traced_writes; the variables its call reads: refuse_unlisted_reads), before the step's
first execution. The train function's step runs the batch-independence probe (random inputs,
then fit's kept rows) only after its pass checked the call (before, with fit's kept rows the
call's own trace ran first, then the probe).
Pairs: D = 40 examples, D' = D without its first (x[0, 0] = 10.0 in D).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.internals import batch_independence
from tf_dpiter.keras.internals import data_writes

_CLOSURE = tf.Variable(2.0, trainable=False, name="pass_held_in_a_closure")
_SEEN = tf.Variable(0.0, trainable=False, name="pass_largest_input_seen")


class _Scale(keras.layers.Layer):
  """Multiplies its inputs by a tf.Variable attribute or a closure's tf.Variable."""

  def __init__(self, held):
    super().__init__()
    self.held = held
    if held == "attribute":
      self.s = tf.Variable(1.0, trainable=False, name="pass_held_as_an_attribute")

  def call(self, inputs):
    return inputs * (_CLOSURE if self.held == "closure" else self.s)


class _Temperature(keras.layers.Layer):
  """Divides the outputs by a tf.Variable temperature in inference only."""

  def __init__(self):
    super().__init__()
    self.t = tf.Variable(1.0, trainable=False, name="pass_temperature_in_inference")

  def call(self, inputs, training=None):
    return inputs if training else inputs / self.t


class _RunningMean(keras.layers.Layer):
  """Identity keeping a moving mean of its inputs in training mode (a Keras weight)."""

  def build(self, shape):
    self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                name="running_mean")

  def call(self, x, training=None):
    if training:
      self.mean.assign(0.99 * self.mean + 0.01 * tf.reduce_mean(x, axis=0))
    return x


class _Seen(keras.layers.Layer):
  """Identity writing its largest input into a closure's tf.Variable (not a Keras weight)."""

  def call(self, x):
    _SEEN.assign(tf.reduce_max(x))
    return x


class _MixingOnLargeInputs(keras.layers.Layer):
  """Adds the batch's mean to every row when some input exceeds 5 (fit's rows: x[0, 0] =
  10.0; never the probe's random normal inputs): declared per example below, falsely."""

  def call(self, x):
    big = keras.ops.cast(keras.ops.max(x) > 5.0, x.dtype)
    return x + big * keras.ops.mean(x, axis=0, keepdims=True)


# per example (each example's output depends on that example alone): clipping="auto" takes
# the fast path through them, whose own pass then checks the call
for _layer_class in (_Scale, _Temperature, _RunningMean, _Seen, _MixingOnLargeInputs):
  dp.keras.declare_per_example(_layer_class, "acts on each example alone (a test layer)")


def _pair():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  y = rng.normal(size=(40, 1)).astype("float32")
  return (x, y), (x[1:], y[1:])


def _model(layers, clipping="auto", jit_compile=False):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), *layers])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, clipping=clipping)
  model.compile(opt, "mse", jit_compile=jit_compile)
  opt.set_sampling(40, 8 / 40, "poisson", 8)
  return model


def _count_call_traces(monkeypatch, rows=None):
  """The calls of data_writes.refuse_model_writes (the call's own trace), and the order of
  those calls and of the probe's runs, as ["trace", "probe", ...]; a probe on `rows` (fit's
  kept rows, when given) as "rows"."""
  order = []
  traced, probe = data_writes.refuse_model_writes, batch_independence.batch_mixing_layers

  def counted_trace(*args, **kwargs):
    order.append("trace")
    return traced(*args, **kwargs)

  def counted_probe(model, x, *args, **kwargs):
    kept = rows is not None and np.array_equal(np.asarray(x)[:2], rows[:2])
    order.append("rows" if kept else "probe")
    return probe(model, x, *args, **kwargs)

  monkeypatch.setattr(data_writes, "refuse_model_writes", counted_trace)
  monkeypatch.setattr(batch_independence, "batch_mixing_layers", counted_probe)
  return order


@pytest.mark.parametrize("held, name, jit_compile", [
    ("attribute", "pass_held_as_an_attribute", False),
    ("closure", "pass_held_in_a_closure", False),
    ("attribute", "pass_held_as_an_attribute", True)])   # the pass in the XLA function
def test_a_variable_the_call_reads_outside_model_variables_is_refused_by_the_pass(
    held, name, jit_compile, monkeypatch):
  order = _count_call_traces(monkeypatch)
  for x, y in _pair():
    model = _model([_Scale(held), keras.layers.Dense(1)], jit_compile=jit_compile)
    with pytest.raises(dp.errors.PrivacyConfigError, match=f"the variable '{name}"):
      model.train_on_batch(x[:8], y[:8])
    assert model._dp_traced_clipping == "fast"   # pylint: disable=protected-access
    assert int(model.optimizer.iterations.numpy()) == 0
    assert int(model.ledger.sample_count.numpy()) == 0
  assert order == []   # the pass checked it: no trace of its own, no probe ran the model


def test_a_variable_read_only_in_inference_is_refused_by_the_pass(monkeypatch):
  order = _count_call_traces(monkeypatch)
  (x, y), _ = _pair()
  model = _model([keras.layers.Dense(1), _Temperature()])
  with pytest.raises(dp.errors.PrivacyConfigError, match="pass_temperature_in_inference"):
    model.train_on_batch(x[:8], y[:8])
  assert model._dp_traced_clipping == "fast"   # pylint: disable=protected-access
  assert int(model.optimizer.iterations.numpy()) == 0
  assert "trace" not in order


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_a_write_from_the_data_is_refused_on_both_datasets_without_rows(clipping, monkeypatch):
  order = _count_call_traces(monkeypatch)
  for x, y in _pair():
    layer = _RunningMean(name="pass_tracker")
    model = _model([layer, keras.layers.Dense(1)], clipping)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with pytest.raises(dp.errors.PrivacyConfigError, match="pass_tracker/running_mean"):
        model.train_on_batch(x[:8], y[:8])
    assert np.array_equal(layer.mean.numpy(), np.zeros(3))   # the probe's run restored
    assert model._dp_traced_clipping == clipping.replace("auto", "fast")  # pylint: disable=protected-access
    assert int(model.optimizer.iterations.numpy()) == 0
    assert int(model.ledger.sample_count.numpy()) == 0
  # the vectorized path takes the call's own trace (in the step's trace, before its pass)
  assert ("trace" in order) == (clipping == "vectorized")


def test_with_fit_rows_kept_the_pass_refuses_the_call_before_any_probe_of_them(monkeypatch):
  (x, y), _ = _pair()
  order = _count_call_traces(monkeypatch, rows=x)
  model = _model([_Scale("attribute"), keras.layers.Dense(1)])
  with pytest.raises(dp.errors.PrivacyConfigError, match="pass_held_as_an_attribute"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert order == [], order   # no probe ran the model (on the rows or at all), no trace
  assert int(model.optimizer.iterations.numpy()) == 0


def test_a_write_from_fit_rows_kept_is_refused_before_a_probe_could_write_a_record():
  # the probe runs the call eagerly on the kept rows (x[0, 0] = 10.0): had it run before the
  # pass refused the call, the closure's variable would hold that record's value
  (x, y), _ = _pair()
  _SEEN.assign(0.0)
  model = _model([_Seen(), keras.layers.Dense(1)])
  with pytest.raises(dp.errors.PrivacyConfigError, match="pass_largest_input_seen"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert float(_SEEN.numpy()) == 0.0   # no probe ran the call
  assert int(model.ledger.sample_count.numpy()) == 0


def test_with_fit_rows_kept_the_rows_are_probed_after_the_pass_with_no_call_trace(
    monkeypatch):
  (x, y), _ = _pair()
  order = _count_call_traces(monkeypatch, rows=x)
  model = _model([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert "trace" not in order and "rows" in order, order
  assert order.index("probe") < order.index("rows")
  assert int(model.optimizer.iterations.numpy()) == 4


def test_a_model_the_pass_accepts_trains_with_no_trace_of_its_call(monkeypatch):
  order = _count_call_traces(monkeypatch)
  (x, y), _ = _pair()
  model = _model([keras.layers.Dense(4, activation="relu"), keras.layers.Dropout(0.1),
                  keras.layers.Dense(1)])
  model.train_on_batch(x[:8], y[:8])
  model.train_on_batch(x[8:16], y[8:16])
  assert int(model.optimizer.iterations.numpy()) == 2
  assert int(model.ledger.sample_count.numpy()) == 2
  assert "trace" not in order and "probe" in order


@pytest.mark.parametrize("clipping", ["auto", "fast"])
def test_mixing_seen_only_on_fit_rows_after_the_pass_routes_or_refuses(clipping, monkeypatch):
  # the rows' probe runs after the traced fast pass: "auto" traces the step again on the
  # vectorized path (each example alone), "fast" refuses before any step
  (x, y), _ = _pair()
  order = _count_call_traces(monkeypatch, rows=x)
  model = _model([_MixingOnLargeInputs(name="mixes_on_large"), keras.layers.Dense(1)],
                 clipping)
  with pytest.warns(UserWarning, match="mixes_on_large"):
    if clipping == "fast":
      with pytest.raises(dp.errors.PrivacyConfigError, match=r"clipping='fast'.*mixes_on_large"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
    else:
      model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert order.index("probe") < order.index("rows"), order
  steps = 4 if clipping == "auto" else 0
  assert model._dp_traced_clipping == ("vectorized" if steps else "fast")  # pylint: disable=protected-access
  assert int(model.optimizer.iterations.numpy()) == steps
  assert int(model.ledger.sample_count.numpy()) == steps
