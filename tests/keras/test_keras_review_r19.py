"""Review R19 (session 47): the train step's facts held once per train function
(train_step._TraceFacts and the checks made once per train function), against a model
changed between two steps of the same train function.

Each case changes the model between `train_on_batch` calls of one compiled model and runs
the real step with noise 0 (SGD, learning rate 1, normalize=False: the weight change is minus
the clipped sum) on add/remove neighbouring batches (a row of sample weight 0 added or
made 1), so the change of the clipped sum is measured against the sensitivity C = 1.

Measured (fast and vectorized paths, eager, noise 0, C = 1, load ~7):
  * a layer frozen between steps: the frozen layer stays put, the worst change 0.99994 <= C
    (before and after freezing);
  * `model.dtype_policy = "mixed_float16"` between steps: the held loss scale follows (1 ->
    128, the key's compute dtype), the worst change 0.99994 <= C;
  * a Sequential rebuilt by pop/add so that its input feeds an Embedding directly: the held
    Embedding inputs follow ({} -> {0: 50}, the key's functional graph) and an id outside the
    vocabulary contributes exactly 0;
  * a batch-mixing layer added by pop/add: clipping="fast" refuses, "auto" routes to the
    vectorized path (worst change 0.577 <= C).
Defect (fixed here): with run_eagerly=True the check that no variable is written from the data
(data_writes.refuse_model_writes) ran once per train function. A Sequential rebuilt by pop/add
with a layer assigning the batch's mean to a non-trainable variable trained un-refused: the
variable held the batch's mean hidden activation, a function of the private batch released
with the weights and no noise, and the ledger charged the step as private (2 samples). A
fresh model with the same layer is refused. A traced step checks its own pass at each trace,
so it refused the rebuilt model at its retrace.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
C = 1.0


class _Leak(keras.layers.Layer):
  """Writes the batch's mean input into a non-trainable variable (a write from the data)."""

  def build(self, shape):
    self.seen = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                name="seen")

  def call(self, x):
    self.seen.assign(keras.ops.mean(x, axis=0))
    return x


class _Half(keras.layers.Layer):
  """Integer ids halved (parameter-free, acts on each example alone)."""

  def call(self, ids):
    return ids // 2


class _BatchSoftmax(keras.layers.Layer):
  """Softmax over the batch axis: every row depends on every other."""

  def call(self, inputs):
    return inputs * keras.ops.softmax(inputs, axis=0) * keras.ops.cast(
        keras.ops.shape(inputs)[0], inputs.dtype)


def _compiled(layers, clipping="fast", noise=0.0):
  model = dp.keras.DPSequential(layers)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0 on purpose: the sum is measured
    opt = dp.keras.DPKerasSGDOptimizer(C, noise, learning_rate=1.0, normalize=False,
                                       clipping=clipping)
  model.compile(optimizer=opt, loss=LOSS, run_eagerly=True)
  opt.set_sampling(64, 8 / 64, "poisson", 8)
  return model


def _mlp(clipping):
  keras.utils.set_random_seed(0)
  d1, d2 = keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)
  return _compiled([keras.Input((6,)), d1, d2], clipping), d2


def _data():
  rng = np.random.RandomState(1)
  return (rng.randn(9, 6) * 3).astype("float32"), rng.randint(0, 3, 9)


def _delta(model, w0, x, y, weights):
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=weights)
  return np.concatenate([(np.asarray(a, np.float64) - b).ravel()
                         for a, b in zip(model.get_weights(), w0)])


def _worst_change(model, x, y):
  """The largest change of the clipped sum when row 8 (a scaled copy of row 0) is added."""
  w0 = [np.array(w) for w in model.get_weights()]
  mask = np.ones(len(x), "float32")
  mask[-1] = 0.0
  base = _delta(model, w0, x, y, mask)
  worst = 0.0
  for scale in (1.0, 10.0, 100.0):
    x2 = x.copy()
    x2[-1] = x[0] * scale
    worst = max(worst, float(np.linalg.norm(
        _delta(model, w0, x2, y, np.ones(len(x), "float32")) - base)))
  model.set_weights(w0)
  return worst


@pytest.mark.parametrize("clipping", ["fast", pytest.param("vectorized",
                                                           marks=pytest.mark.slow)])
def test_an_eager_sequential_rebuilt_with_a_data_write_is_refused(clipping):
  model, last = _mlp(clipping)
  x, y = _data()
  model.train_on_batch(x[:8], y[:8])   # the train function's checks are made
  model.pop()
  model.add(_Leak())
  model.add(last)
  with pytest.raises(PrivacyConfigError, match="from the data"):
    model.train_on_batch(x[:8], y[:8])
  assert not np.any(np.asarray(model.layers[1].seen))   # nothing written
  assert int(model.ledger.sample_count) == 1   # the refused step is not charged


@pytest.mark.parametrize("clipping", ["fast", pytest.param("vectorized",
                                                           marks=pytest.mark.slow)])
def test_a_layer_frozen_between_eager_steps_keeps_the_sensitivity(clipping):
  model, _ = _mlp(clipping)
  x, y = _data()
  assert _worst_change(model, x, y) <= C * (1 + 1e-5)
  model.layers[0].trainable = False
  assert 0.5 * C < _worst_change(model, x, y) <= C * (1 + 1e-5)
  w0 = [np.array(w) for w in model.layers[0].get_weights()]
  model.train_on_batch(x, y)
  for a, b in zip(model.layers[0].get_weights(), w0):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["fast", "vectorized"])
def test_a_mixed_precision_switch_between_eager_steps_follows_the_loss_scale(clipping):
  model, _ = _mlp(clipping)
  x, y = _data()
  _worst_change(model, x, y)
  assert model._dp_facts.loss_scale == 1.0   # pylint: disable=protected-access
  model.dtype_policy = "mixed_float16"
  assert 0.5 * C < _worst_change(model, x, y) <= C * (1 + 1e-5)
  assert model._dp_facts.loss_scale == 128.0   # pylint: disable=protected-access


def test_a_sequential_rebuilt_to_feed_an_embedding_guards_its_ids_eagerly():
  keras.utils.set_random_seed(0)
  emb, flat, dense = keras.layers.Embedding(50, 4), keras.layers.Flatten(), keras.layers.Dense(3)
  model = _compiled([keras.Input((3,), dtype="int32"), _Half(), emb, flat, dense], "auto")
  rng = np.random.RandomState(0)
  x = rng.randint(0, 10, (8, 3)).astype("int32")
  y = rng.randint(0, 3, 8)
  model.train_on_batch(x, y)
  assert model._dp_facts.embedding_ids == {}   # pylint: disable=protected-access
  for _ in range(4):
    model.pop()
  for layer in (emb, flat, dense):   # the same variables: the optimizer takes them
    model.add(layer)
  x[0, 0] = 70   # 35 through _Half; outside Embedding(50) fed directly
  w0 = [np.array(w) for w in model.get_weights()]
  with_oov = _delta(model, w0, x, y, np.ones(8, "float32"))
  without = np.ones(8, "float32")
  without[0] = 0.0
  np.testing.assert_array_equal(with_oov, _delta(model, w0, x, y, without))
  assert model._dp_facts.embedding_ids == {0: 50}   # pylint: disable=protected-access


@pytest.mark.parametrize("clipping", ["fast", pytest.param("auto", marks=pytest.mark.slow)])
def test_a_batch_mixing_layer_added_between_eager_steps_is_refused_or_routed(clipping):
  model, last = _mlp(clipping)
  x, y = _data()
  model.train_on_batch(x, y, sample_weight=np.ones(len(x), "float32"))   # routed at 9 rows
  model.pop()
  model.add(_BatchSoftmax(name="batch_softmax"))
  model.add(last)
  if clipping == "fast":
    with pytest.raises(PrivacyConfigError, match="batch_softmax"):
      model.train_on_batch(x, y, sample_weight=np.ones(len(x), "float32"))
    return
  w0 = [np.array(w) for w in model.get_weights()]
  mask = np.ones(len(x), "float32")
  mask[-1] = 0.0
  base = _delta(model, w0, x, y, mask)
  rng = np.random.RandomState(0)
  worst = 0.0
  for i in range(40):   # 1.249 at candidate 23 (scale 10) on the fast path
    x2, y2 = x.copy(), y.copy()
    x2[-1] = rng.randn(6) * (0.3, 1.0, 3.0, 10.0, 30.0)[i % 5]
    y2[-1] = rng.randint(3)
    worst = max(worst, float(np.linalg.norm(
        _delta(model, w0, x2, y2, np.ones(len(x), "float32")) - base)))
  assert model._dp_traced_clipping == "vectorized"   # pylint: disable=protected-access
  assert 0.5 * C < worst <= C * (1 + 1e-5)


class _Net(keras.Model):
  """A subclassed model (built by its first step)."""

  def __init__(self):
    super().__init__()
    self.hidden = keras.layers.Dense(5, activation="tanh")
    self.out = keras.layers.Dense(3)

  def call(self, x):
    return self.out(self.hidden(x))


def test_an_eager_first_step_on_numpy_arrays_builds_the_compiled_loss():
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(_Net())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, normalize=False)
  model.compile(optimizer=opt, loss=LOSS, run_eagerly=True)
  opt.set_sampling(64, 8 / 64, "poisson", 8)
  x, y = _data()
  model.train_on_batch(x, y, sample_weight=np.ones(len(x), "float32"))
  assert int(model.ledger.sample_count) == 1
  assert all(np.isfinite(w).all() for w in model.get_weights())


def test_a_refusal_inside_the_vectorized_trace_is_not_a_fallback():
  """R19's note on keras/optimizer/gradients.py: the vectorized path's fallback caught
  `ValueError`, and the library's refusals are ValueErrors, so a refusal raised while pfor
  traced the per-record loss became "falling back to a sequential loop" (whose eager run
  skips the check). The refusal propagates; nothing warns of a fallback."""
  import tensorflow as tf
  from tf_dpiter.keras.optimizer import gradients

  v = tf.Variable(tf.ones([3]))

  def refusing_loss(rec):
    raise PrivacyConfigError("`layer` writes a variable from the data. Received: layer=leak")

  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)   # a fallback warning fails the test
    with pytest.raises(PrivacyConfigError, match="writes a variable from the data"):
      gradients.per_record_gradients(refusing_loss, [v], tf.ones([4, 3]))

  def record_loss(rec):
    return tf.reduce_sum(v * rec), ()

  grads, losses, _ = gradients.per_record_gradients(record_loss, [v], tf.ones([4, 3]))
  np.testing.assert_array_equal(grads[0].numpy(), np.ones([4, 3]))   # the path still works
  np.testing.assert_array_equal(losses.numpy(), np.full([4], 3.0))
