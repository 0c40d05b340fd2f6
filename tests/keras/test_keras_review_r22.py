"""Review R22 (session 48): the train step's facts (train_step._TraceFacts, read once per
train function) of a subclassed model holding a layer its training call does not reach, and
the vectorized per-record gradients of a trainable variable the loss does not use.

`TrainStepMixin._dp_trace_facts` waits for every layer to be built (a subclassed model is
built by one forward pass, `_dp_built_facts`); a layer the call does not reach (used only
under a Python flag, or only in inference) stays unbuilt after that pass, so the facts stayed
None and the step failed with "AttributeError: 'NoneType' object has no attribute
'loss_unbuilt'" (measured at 338372d: fit with clipping "vectorized" and "auto", eager and
traced). The step now refuses with the library's error naming the layer and the fix (build
it), and trains once it is built.

Second crash (measured at 338372d, clipping "vectorized" and "auto", graph and eager): a
trainable variable the loss does not read (the spare layer built, or a custom layer's unused
weight) made `gradients.per_record_gradients` fail with "AttributeError: 'str' object has
no attribute '_type_enum'": GradientTape.gradient(unconnected_gradients=ZERO) reads a Keras
3 variable's dtype (a str); keras_internals.gradient_sources hands it the backend variables.
Such a variable's per-record gradient is zero (and its update the noise alone).
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError


class SpareNet(keras.Model):
  """Dense -> Dense, with a spare Dense used only when `use_spare` is set."""

  def __init__(self):
    super().__init__()
    self.d1 = keras.layers.Dense(5, activation="tanh")
    self.spare = keras.layers.Dense(5, name="spare")
    self.use_spare = False
    self.d2 = keras.layers.Dense(3)

  def call(self, x):
    h = self.d1(x)
    if self.use_spare:
      h = self.spare(h)
    return self.d2(h)


def _fit(model, run_eagerly, noise=1.0):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0 where the test reads the update
    opt = dp.keras.DPKerasSGDOptimizer(1.0, noise, learning_rate=0.1, clipping="vectorized")
  model.compile(optimizer=opt, run_eagerly=run_eagerly,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randn(64, 6).astype("float32"), rng.randint(0, 3, 64)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  return model


@pytest.mark.parametrize("run_eagerly", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_layer_the_training_call_does_not_build_is_refused_by_name(run_eagerly):
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(SpareNet())
  with pytest.raises(PrivacyConfigError, match="spare"):
    _fit(model, run_eagerly)


def test_the_model_trains_once_the_layer_is_built():
  keras.utils.set_random_seed(0)
  net = SpareNet()
  net.spare.build((None, 5))
  model = _fit(dp.keras.make_private(net), False)
  assert int(model.ledger.sample_count.numpy()) == 8


class _UnusedWeight(keras.layers.Layer):
  """x @ w, with a second trainable weight its call does not read."""

  def build(self, shape):
    self.w = self.add_weight(shape=(shape[-1], 3), name="w")
    self.unused = self.add_weight(shape=(2,), name="unused")

  def call(self, x):
    return x @ self.w


def test_a_trainable_weight_the_loss_does_not_read_gets_a_zero_gradient():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 _UnusedWeight()])
  unused = model.layers[-1].unused
  before = unused.numpy().copy()
  # noise 0: the unused weight's update is its clipped sum, zero
  _fit(model, False, noise=0.0)
  assert int(model.ledger.sample_count.numpy()) == 8
  np.testing.assert_array_equal(unused.numpy(), before)
