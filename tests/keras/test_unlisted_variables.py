"""A variable the model's training call reads but `model.variables` does not list is refused
before any step (data_writes.refuse_model_writes).

Relation: replace one example, unit example. The weights' checks (weight_fingerprints) record
and check the model's variables only; a tf.Variable held as a Keras 3 layer's attribute, or in
a closure, is not among them. Measured by review R7 (session 38) before the refusal: with
`self.s = tf.Variable(1.0)` scaling a layer's inputs, a DP fit (shuffle, n = 40, batch 10,
z = 1, C = 1), then `s.assign(x[:, 0].max())` (= 10.0, one record's value) between fits: the
statement gave epsilon 10.726 and a second fit 16.513, while the model's outputs were scaled by
that record's value (no finite epsilon holds). Now the first fit is refused, naming the
variable; the same layer with `add_weight` trains, and a write between fits is refused at the
statement (the weights' check).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

_GLOBAL = tf.Variable(2.0, trainable=False, name="held_in_a_closure")


class _Scale(keras.layers.Layer):
  """Multiplies its inputs by a scalar state: a tf.Variable attribute (`weight=False`), a
  closure's tf.Variable ("closure") or a Keras weight (`weight=True`)."""

  def __init__(self, held):
    super().__init__()
    self.held = held
    if held == "weight":
      self.s = self.add_weight(shape=(), initializer="ones", trainable=False, name="s")
    elif held == "attribute":
      self.s = tf.Variable(1.0, trainable=False, name="held_as_an_attribute")

  def call(self, inputs):
    return inputs * (_GLOBAL if self.held == "closure" else self.s)


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).clip(-4.5, 4.5).astype("float32")
  x[0, 0] = 10.0
  return x, rng.normal(size=(40, 1)).astype("float32")


def _model(held):
  keras.utils.set_random_seed(0)
  scale = _Scale(held)
  model = dp.keras.DPSequential([keras.Input((3,)), scale, keras.layers.Dense(1)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  return model, scale


@pytest.mark.parametrize("held, name", [("attribute", "held_as_an_attribute"),
                                        ("closure", "held_in_a_closure")])
def test_a_variable_outside_model_variables_is_refused_before_any_step(held, name):
  x, y = _data()
  model, _ = _model(held)
  with pytest.raises(dp.errors.PrivacyConfigError, match=f"reads the variable '{name}"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 0


def test_the_same_state_as_a_weight_trains_and_its_write_between_fits_is_refused():
  x, y = _data()
  model, scale = _model("weight")
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 4
  scale.s.assign(float(x[:, 0].max()))   # record 0's value, between fits
  with pytest.raises(dp.errors.PrivacyConfigError):
    model.privacy_statement(1e-5)
