"""The rows handed to the private step are the batch's own, each a function of one record
(tf_dpiter.keras.internals.row_provenance; review R9, session 40, finding 5).

Before the rule, inputs centred on the batch mean one line before the private step were
stated at the clip's sensitivity. Relation/unit of the measurements (noise off, kernel zero,
y = |y| + 1): fit with a train_step override, replace one example (x[0] = +1000 vs -1000 in
every feature), n = B = 10, one shuffled step, C = 1, lr 1: ||w(D) - w(D')|| = 1.600 against
the 0.2 = lr 2C / B allowed (16 C), epsilon 10.7255 stated against 202.4 (dp_accounting RDP
at z / 16); a custom loop, add/remove one example (x[0] = 1000), Poisson q 0.1, C = 1, lr
0.1: 0.0991 against 0.01 (9.9 C), epsilon 2.1330 stated against 87.4. Now refused at the
trace, before any step; per-record transforms keep training (no false refusal).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib
from tests.keras import custom_loop_setup as setup

_TABLE = np.array([0.5, 2.0], "float32")   # public per-class weights
_MEAN = np.array([0.1, -0.2, 0.3], "float32")   # public per-feature constants

_MIXING = {
    "batch_mean": lambda x: x - tf.reduce_mean(x, axis=0, keepdims=True),
    "shuffle": lambda x: tf.random.shuffle(x),
    "first_row": lambda x: x + x[:1],
    "rows_doubled": lambda x: tf.concat([x, x], axis=0)[: tf.shape(x)[0]],
    "transposed": lambda x: tf.transpose(tf.transpose(x) * tf.reduce_max(x, axis=1)),
    "softmax_over_rows": lambda x: x * tf.nn.softmax(x[:, 0])[:, None],
}


def _per_record(x):
  """Per-record transforms: constants, elementwise math, a per-row norm, a reshape keeping
  the rows, a lookup in a public table, the feature count read from the batch's shape (a
  dimension the trace knows: no data under Poisson sampling either)."""
  x = (tf.cast(x, tf.float32) - _MEAN) / tf.cast(tf.shape(x)[-1] - 1, tf.float32)
  x = x / (tf.norm(x, axis=1, keepdims=True) + 1.0) * tf.nn.softmax(x)
  x = tf.reshape(tf.reshape(x, [-1, 3, 1]), [-1, 3])
  return x * tf.gather(_TABLE, tf.cast(x[:, 0] > 0, tf.int32))[:, None]


class Transformed(dp.keras.DPSequential):
  """Transforms each batch's inputs before the library's step."""

  def __init__(self, *args, transform=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._transform = transform

  def train_step(self, data):
    return super().train_step((self._transform(data[0]),) + tuple(data[1:]))


def _fit_data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype("float32")
  x[0] = 1000.0
  return x, (np.abs(rng.normal(size=(40, 1))) + 1).astype("float32")


@pytest.mark.parametrize("mixing", sorted(_MIXING))
def test_an_override_mixing_rows_before_the_step_is_refused(mixing):
  x, y = _fit_data()
  keras.utils.set_random_seed(0)
  model = Transformed([keras.Input((3,)), keras.layers.Dense(1)], transform=_MIXING[mixing])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0), "mse")
  with pytest.raises(dp.errors.PrivacyConfigError, match="combine rows"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("sampling", ["shuffle", "poisson"])
def test_an_override_with_per_record_transforms_trains(sampling):
  x, y = _fit_data()
  keras.utils.set_random_seed(0)
  model = Transformed([keras.Input((3,)), keras.layers.Dense(1)], transform=_per_record)
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling=sampling)
  assert model.privacy_statement(1e-5).steps == 4


def _one_hot_to_the_largest_label(x):
  """A one_hot whose depth is the batch's largest value: one record sets every row's."""
  depth = tf.reduce_max(tf.cast(x[:, 0] > 100.0, tf.int32)) + 1
  return x * tf.reduce_mean(tf.one_hot(tf.zeros_like(x[:, 0], tf.int32), depth), axis=1,
                            keepdims=True)


def test_a_bound_computed_from_the_batch_is_refused():
  """A shape argument from the batch's values (a one_hot's depth: session 41's walk skipped
  shape arguments, so the sequences trimmed to the batch's longest of review R11 passed;
  tests/keras/test_session41_checks_review.py measures that one)."""
  x, y = _fit_data()
  keras.utils.set_random_seed(0)
  model = Transformed([keras.Input((3,)), keras.layers.Dense(1)],
                      transform=_one_hot_to_the_largest_label)
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0), "mse")
  with pytest.raises(dp.errors.PrivacyConfigError, match="computed from the batch's values"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("mixing", ["batch_mean", None])
def test_a_custom_loop_hands_the_step_its_rows(mixing):
  x, y = setup.data()
  x, y = x[:10].copy(), y[:10]
  x[0] = 1000.0
  model = setup.regression_model()
  variables = model.trainable_variables
  opt = setup.dp_sgd(variables)
  loss = setup.record_loss(model)
  transform = _MIXING[mixing] if mixing else (lambda t: (t - 0.5) * 2.0)

  @tf.function
  def step(xb, yb):
    grads = opt.compute_private_gradients(loss, variables, data=(transform(xb), yb))
    opt.apply_private_gradients(grads, variables)

  if mixing:
    with pytest.raises(dp.errors.PrivacyConfigError, match="combine rows"):
      step(x, y)
    assert int(opt.iterations.numpy()) == 0
    return
  step(x, y)
  stated = statement_lib.run_statement(opt, 1e-5)
  assert stated.epsilon == pytest.approx(setup.rdp_epsilon(1), rel=1e-9)


def test_an_override_mixing_rows_is_refused_under_jit_compile():
  """The same refusal with jit_compile=True (Keras' default on a GPU): the override runs in
  the outer train function, whose check traces it alone before any step."""
  x, y = _fit_data()
  keras.utils.set_random_seed(0)
  model = Transformed([keras.Input((3,)), keras.layers.Dense(1)],
                      transform=_MIXING["batch_mean"])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0), "mse",
                jit_compile=True)
  with pytest.raises(dp.errors.PrivacyConfigError, match="combine rows"):
    model.fit(x, y, batch_size=10, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 0
