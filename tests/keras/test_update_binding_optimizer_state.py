"""The optimizer's own variables (momentum slots, learning rate) written from the batch are
refused: traced in the step (update_binding), between steps (weight_fingerprints), and by a
callback during a DP fit (review R7, finding 1).

Claim (weight_fingerprints, update_binding): the ledger's epsilon is stated only for weights
that are a function of its noised steps. Keras' update reads the optimizer's slots and
learning rate: a slot written from the batch's plain gradient reaches the weights un-noised
(R7 measured w(D) - w(D') = 0.9 x record 0's unclipped gradient, 145 noise std apart, with
epsilon 2.133 stated). Now the binding's default deny walks the value of every write to the
optimizer's variables in the traced step, and the digests cover the floating slots.

Relation/unit: add/remove one example (D' = D without record 0), Poisson q = 10 / 100, z = 1,
C = 1; unit = example.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import custom_loop_setup
from tf_dpiter.keras.model import statement as statement_lib

N, D, Q, DELTA = 100, 4, 0.1, 1e-5


def _setup(adam=False):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, D)).astype(np.float32)
  y = rng.normal(size=(10, 1)).astype(np.float32)
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((D,)),
                            keras.layers.Dense(1, kernel_initializer="zeros")])
  opt = (dp.keras.DPKerasAdamOptimizer(1.0, 1.0, learning_rate=0.1) if adam else
         dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, momentum=0.9))
  opt.build(model.trainable_variables)
  opt.set_sampling(N, Q, "poisson", 10)
  variables = model.trainable_variables

  def record_loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))

  def plain_gradients(xb, yb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(xb) - yb))
    return tape.gradient(loss, variables)

  def leak(xb, yb):
    """The batch's plain gradient sum (unclipped, un-noised) into the momentum slots."""
    for slot, g in zip(opt.momentums, plain_gradients(xb, yb)):
      slot.assign(-g)

  def step(xb, yb, write=None):
    if write == "slots":
      leak(xb, yb)
    elif write == "learning_rate":
      opt.learning_rate.assign(tf.reduce_mean(tf.abs(xb)))
    grads = opt.compute_private_gradients(record_loss, variables, data=(xb, yb))
    opt.apply_private_gradients(grads, variables)

  return model, opt, step, leak, (x, y)


@pytest.mark.parametrize("write, written", [("slots", "momentum"),
                                            ("learning_rate", "learning_rate")])
def test_optimizer_variable_written_from_the_batch_in_the_traced_step_is_refused(
    write, written):
  model, opt, step, _, batch = _setup()
  w0 = model.layers[0].kernel.numpy().copy()
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=rf"the value written to '[^']*{written}[^']*' \(a variable the "
                           r"update reads\) from a step argument"):
    tf.function(step)(*batch, write)
  # refused at the trace: nothing ran, nothing was charged
  np.testing.assert_array_equal(model.layers[0].kernel.numpy(), w0)
  assert int(opt.iterations.numpy()) == 0


def test_slot_written_between_eager_steps_is_refused():
  _, opt, step, leak, batch = _setup()
  step(*batch)
  leak(*batch)
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"apply_private_gradients refused: .*momentum"):
    step(*batch)
  assert int(opt.iterations.numpy()) == 1


def test_slot_written_between_traced_steps_is_refused_at_the_statement():
  _, opt, step, leak, batch = _setup()
  traced = tf.function(step)
  traced(*batch)
  leak(*batch)
  traced(*batch)   # a start from slots no private step left
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"privacy_statement refused: .*momentum"):
    statement_lib.run_statement(opt, DELTA)


@pytest.mark.parametrize("adam", [False, True])
def test_the_honest_loops_next_to_them_train_and_state_their_epsilon(adam):
  model, opt, step, _, batch = _setup(adam)
  w0 = model.layers[0].kernel.numpy().copy()
  traced = tf.function(step)
  traced(*batch)
  traced(*batch)
  step(*batch)   # an eager step after traced ones: the slots the traced steps left
  traced(*batch)
  assert np.abs(model.layers[0].kernel.numpy() - w0).max() > 0
  stated = statement_lib.run_statement(opt, DELTA)
  assert stated.steps == 4
  assert stated.epsilon == pytest.approx(custom_loop_setup.rdp_epsilon(4, Q, DELTA), rel=1e-3)


def _fit(callback):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype("float32")
  y = rng.normal(size=(40, 1)).astype("float32")
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, momentum=0.9)
  model.compile(opt, "mse")
  model.fit(x, y, batch_size=10, epochs=2, verbose=0, sampling="shuffle",
            callbacks=[callback(model, opt, x, y)])
  return model


class _Leak(keras.callbacks.Callback):
  def __init__(self, model, opt, x, y):
    super().__init__()
    self._m, self._opt, self._x, self._y = model, opt, x, y

  def on_epoch_end(self, epoch, logs=None):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(self._m(self._x) - self._y))
    for slot, g in zip(self._opt.momentums,
                       tape.gradient(loss, self._m.trainable_variables)):
      slot.assign(-g)   # the training set's plain gradient sum


class _Schedule(keras.callbacks.Callback):
  """A public learning-rate schedule (a function of the epoch): accepted."""

  def __init__(self, model, opt, x, y):
    super().__init__()
    self._opt = opt

  def on_epoch_begin(self, epoch, logs=None):
    self._opt.learning_rate.assign(0.1 / (1 + epoch))


def test_slot_written_by_a_fit_callback_is_refused():
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match=r"fit \(after the callbacks' on_epoch_end\) refused: .*momentum"):
    _fit(_Leak)


def test_a_fit_with_a_public_schedule_callback_trains_and_states_its_epsilon():
  model = _fit(_Schedule)
  assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
  stated = model.privacy_statement(DELTA)
  assert stated.steps == 8
