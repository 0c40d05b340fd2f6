"""A weight written from the batch before `compute_private_gradients` and put back before
`apply_private_gradients`, in the same traced step, is refused at the trace (review R7,
finding 6).

Claim (update_binding.unbound_source, question 3): no variable the noised results are
computed from (a weight the loss reads) is written from the data in the same traced step.
Otherwise every record's clipped gradient is evaluated at weights that are a function of the
whole batch: one record moves all B clipped gradients (R7 measured, noise off,
||sum(D) - sum(D')|| = 11.49 C with the shift, 1.000 without; 2.133 stated against 111.1 by
hand).

Relation/unit: add/remove one example (D' = D without record 0, whose features are 5.0),
Poisson q = 10 / 100, z = 1, C = 1; unit = example.
"""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.model import statement as statement_lib

N, D, Q, DELTA = 100, 4, 0.1, 1e-5


def _setup(body=False):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, D)).astype(np.float32)
  y = rng.normal(size=(10, 1)).astype(np.float32)
  x[0] = 5.0
  keras.utils.set_random_seed(1)
  # body: a Dense(8) body whose bias is shifted, the step updating the head only
  model = keras.Sequential([keras.Input((D,))] + [keras.layers.Dense(8)] * body
                           + [keras.layers.Dense(1)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0)
  opt.build(model.trainable_variables)
  opt.set_sampling(N, Q, "poisson", 10)
  variables = model.trainable_variables[2:] if body else model.trainable_variables
  shifted = model.trainable_variables[1]

  def record_loss(rec):
    xr, yr = rec
    return tf.reduce_mean(tf.square(model(xr) - yr))

  def step(xb, yb, shift):
    delta = shift(xb)
    shifted.assign_add(tf.fill(shifted.shape, delta))
    grads = opt.compute_private_gradients(record_loss, variables, data=(xb, yb))
    shifted.assign_sub(tf.fill(shifted.shape, delta))   # put back before the update
    opt.apply_private_gradients(grads, variables)

  return model, opt, step, (x, y)


@pytest.mark.parametrize("body, refusal", [
    # an updated weight: the value written to it is walked (default deny)
    (False, r"the value written to '[^']*dense[_0-9]*/bias' \(a variable the update reads\) "
            r"from a step argument or captured tensor 'xb'"),
    # a weight the step does not update, read by the loss: the data flow
    (True, r"the variable '[^']*dense[_0-9]*/bias' written from the step's inputs .* "
           r"the clipping bound no longer bounds one record's effect"),
])
def test_weight_shifted_from_the_batch_around_the_private_gradients_is_refused(body, refusal):
  model, opt, step, batch = _setup(body)
  w0 = [v.numpy().copy() for v in model.trainable_variables]
  with pytest.raises(dp.errors.PrivacyConfigError, match=refusal):
    # a function of the batch: +100 if its largest feature exceeds 4, else -100
    tf.function(step)(*batch, lambda xb: tf.where(tf.reduce_max(xb) > 4.0, 100.0, -100.0))
  for v, w in zip(model.trainable_variables, w0):   # refused at the trace: nothing ran
    np.testing.assert_array_equal(v.numpy(), w)
  assert int(opt.iterations.numpy()) == 0


def test_a_shift_of_public_values_next_to_it_trains_and_states_its_epsilon():
  model, opt, step, batch = _setup()
  w0 = model.trainable_variables[0].numpy().copy()
  traced = tf.function(step)
  # public: not a function of the batch. Zero, so that the weight put back is the weight
  # (b + s - s rounds to another float32 than b for most s; the weights' check then rightly
  # refuses the traced update's start as a value no private step produced)
  traced(*batch, lambda xb: tf.constant(0.0))
  traced(*batch, lambda xb: tf.constant(0.0))
  assert np.abs(model.trainable_variables[0].numpy() - w0).max() > 0
  stated = statement_lib.run_statement(opt, DELTA)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(1.0)), 2))
  assert stated.steps == 2
  assert stated.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-3)
