"""Attempts to evade the unrecorded-use check through tensors derived from a variable
(clipping.unrecorded_uses, `_escaping_uses`), beyond tests/privacy/test_derived_tensor_uses.py.

A tensor computed from a layer's kernel inside its call is handed to another layer through a
Keras-tracked list attribute, a dict attribute, a chain of tf.identity, a tf.custom_gradient,
or read inside another layer's tf.cond branch: each carries a gradient path no recorded call
produces, so clipping="fast" must refuse naming the variable (and "auto" must route to the
vectorized path, exact). Harmless ones: a tf.stop_gradient of the derived tensor, and a
non-trainable tf.Variable assigned from it and read elsewhere (no gradient flows through
either, in TensorFlow's own per-example gradients too): the fast path may keep them, and its
update must equal the independent loop's.

Relation: add or remove one example; noise 0, normalize=False, learning rate 1 (the update is
the clipped sum); the adversarial example (targets 1000 times larger) removed by a sample
weight 0; the updates on D and D' equal the independent per-example loop (clipped to C), so
they differ by at most C.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError
from tests.privacy import test_unrecorded_variable_use as base


@tf.custom_gradient
def _doubled(w):
  """2 w with its own gradient (2 dy to w; zeros to any variable TensorFlow sees read)."""
  def grad(dy, variables=None):
    return 2.0 * dy, [tf.zeros_like(v) for v in variables or ()]

  return w * 2.0, grad


class _Owner(keras.layers.Layer):
  """tanh(x W) that also leaves W2 = 2 W (in the way `how` says) for another layer."""

  def __init__(self, how, **kwargs):
    super().__init__(**kwargs)
    self.how = how
    self.kept_list = []
    self.kept_dict = {}

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], 4), initializer="glorot_uniform")
    self.shadow = self.add_weight(shape=(input_shape[-1], 4), initializer="zeros",
                                  trainable=False)

  def call(self, x):
    w2 = self.kernel * 2.0
    if self.how == "list":
      self.kept_list.append(w2)
    elif self.how == "dict":
      self.kept_dict["w2"] = w2
    elif self.how == "identity":
      self.kept_list.append(tf.identity(tf.identity(w2)))
    elif self.how == "custom_gradient":
      self.kept_list.append(_doubled(ops.convert_to_tensor(self.kernel)))
    elif self.how == "cond_reader":
      self.kept_list.append(w2)
    elif self.how == "stop_gradient":
      self.kept_list.append(tf.stop_gradient(tf.identity(w2)))
    elif self.how == "variable":
      self.shadow.assign(w2)
    return ops.tanh(ops.matmul(x, self.kernel))

  def kept(self):
    if self.how == "variable":
      return self.shadow
    return self.kept_dict["w2"] if self.how == "dict" else self.kept_list[-1]


class _Reader(keras.layers.Layer):
  """x + x W2 with W2 the owner's kept tensor (inside a tf.cond branch for "cond_reader")."""

  def __init__(self, owner, **kwargs):
    super().__init__(**kwargs)
    self.kept, self.how = owner.kept, owner.how   # a bound method: Keras tracks no layer

  def call(self, x):
    w = self.kept()
    if self.how == "cond_reader":
      return tf.cond(tf.reduce_sum(x) > -1e30, lambda: x + ops.matmul(x, w), lambda: x)
    return x + ops.matmul(x, w)


def _model(how):
  keras.utils.set_random_seed(2)
  inp = keras.Input((4,))
  owner = _Owner(how, name="owner")
  reader = _Reader(owner, name="reader")
  model = dp.keras.DPModel(inp, keras.layers.Dense(3)(reader(owner(inp))))
  for layer in (owner, reader):
    dp.keras.declare_per_example(layer, "each row alone")
  return model, owner.kernel.path


ESCAPES = ["list", "dict", "identity", "custom_gradient", "cond_reader"]
HARMLESS = ["stop_gradient", "variable"]


@pytest.mark.parametrize("how", ESCAPES)
def test_fast_refuses_every_escape(how):
  model, path = _model(how)
  x, y = base._data(model, "float")
  base._compile(model, "fast")
  before = [np.asarray(v) for v in model.trainable_variables]
  with pytest.raises(PrivacyConfigError, match="clipping='fast' cannot clip") as err:
    model.train_on_batch(x, y)
  assert path in str(err.value)
  for v, w in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(np.asarray(v), w)


@pytest.mark.parametrize("how", ["list", "custom_gradient", "cond_reader"])
def test_auto_routes_escapes_to_the_vectorized_path_exactly(how):
  model, _ = _model(how)
  x, y = base._data(model, "float")
  base._compile(model, "auto")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    base._check_exact_and_bounded(model, x, y)
  assert model._dp_traced_clipping == "vectorized"   # pylint: disable=protected-access


@pytest.mark.parametrize("how", HARMLESS)
def test_harmless_uses_stay_exact_on_the_fast_path(how):
  model, _ = _model(how)
  x, y = base._data(model, "float")
  base._compile(model, "fast")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    base._check_exact_and_bounded(model, x, y)
  assert model._dp_traced_clipping == "fast"   # pylint: disable=protected-access
