"""update_binding's traced check is default deny (review R6, finding 1): the gradients a
traced custom loop applies may be computed from the noised results of compute_private_gradients,
the updated weights, the optimizer's own variables and scalar constants only. Before, only
listed data sources were refused, and the plain gradient of the batch was applied when the
batch came as an integer constant (uint8 pixels, int labels), a constant inside a nested
function, a file read inside the step, or a variable written eagerly outside the step.

Claim: an update applied by apply_private_gradients is a function of a noised result drawn and
charged in this run and of public values. Relation/unit: add/remove one example, Poisson
q = 0.1 (n = 100, expected batch 10), z = 1, C = 1; unit = example. Measured at b8ec6ae (review
probes): w1 = w0 - 0.1 g of the plain batch gradient exactly (max error 0.0), epsilon 2.133
stated at delta 1e-5 for it.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tests.keras.custom_loop_setup import assert_applied, setup


def _refused(step, variables, match="avoids the noise"):
  """Runs `step`; asserts it is refused with the weights unmoved."""
  w0 = [np.array(v) for v in variables]
  with pytest.raises(dp.errors.PrivacyConfigError, match=match):
    step()
  assert all(np.array_equal(np.array(v), w) for v, w in zip(variables, w0))


def test_a_plain_gradient_of_a_closed_over_uint8_batch_is_refused():
  """uint8 pixels and int labels (MNIST's dtypes) the step closes over, cast inside it."""
  xb, yb, model, opt, record_loss, plain_gradients = setup()
  variables = model.trainable_variables
  x_u8 = np.round(np.abs(xb) * 50).astype(np.uint8)
  y_int = (yb > 0).astype(np.int32)

  @tf.function
  def step():
    x, y = tf.cast(x_u8, tf.float32) / 255.0, tf.cast(y_int, tf.float32)
    opt.compute_private_gradients(record_loss, variables, data=(x, y))   # dropped
    opt.apply_private_gradients(plain_gradients(x, y), variables)

  _refused(step, variables, "shape \\[10, 4\\] and dtype uint8")


def test_a_plain_gradient_of_a_float_batch_inside_a_nested_function_is_refused():
  """The float batch closed over by a nested tf.function (its constants are in the function
  library, not among the step graph's nodes)."""
  xb, yb, model, opt, record_loss, plain_gradients = setup()
  variables = model.trainable_variables

  @tf.function
  def inner():
    return plain_gradients(xb, yb)

  @tf.function
  def step():
    opt.compute_private_gradients(record_loss, variables, data=(xb, yb))   # dropped
    opt.apply_private_gradients(inner(), variables)

  _refused(step, variables, "array constant")


def test_a_plain_gradient_of_a_batch_read_from_a_file_in_the_step_is_refused(tmp_path):
  xb, yb, model, opt, record_loss, plain_gradients = setup()
  variables = model.trainable_variables
  path = str(tmp_path / "x.bin")
  xb.tofile(path)

  @tf.function
  def step():
    x = tf.reshape(tf.io.decode_raw(tf.io.read_file(path), tf.float32), [10, 4])
    opt.compute_private_gradients(record_loss, variables, data=(x, yb))   # dropped
    opt.apply_private_gradients(plain_gradients(x, yb), variables)

  _refused(step, variables, "ReadFile")


def test_a_plain_gradient_buffered_in_variables_outside_the_step_is_refused():
  """A gradient accumulation buffer filled eagerly with plain gradients, read in the step:
  a variable neither updated nor the optimizer's own."""
  xb, yb, model, opt, record_loss, plain_gradients = setup()
  variables = model.trainable_variables
  buffers = [tf.Variable(g) for g in plain_gradients(xb, yb)]

  @tf.function
  def step():
    opt.compute_private_gradients(record_loss, variables, data=(xb, yb))   # dropped
    opt.apply_private_gradients([b.read_value() for b in buffers], variables)

  _refused(step, variables, "neither the updated weights nor the optimizer's own")


def test_post_processing_in_nested_functions_branches_and_shapes_is_applied():
  """Post-processing of the noised result inside a nested tf.function and a tf.cond on the
  optimizer's step counter, with reshapes, transposes, reductions over axes and the
  learning rate: functions of the noised result and public values, applied exactly."""
  xb, yb, model, opt, record_loss, _ = setup()
  variables = model.trainable_variables

  @tf.function
  def shrink(g):
    flat = tf.reshape(tf.transpose(g), [-1])
    norm = tf.sqrt(tf.reduce_sum(tf.square(flat), axis=[0]))
    return g * tf.minimum(1.0, 2.0 / (norm + 1e-6))

  @tf.function
  def step(xb, yb):
    grads = opt.compute_private_gradients(record_loss, variables, data=(xb, yb))
    grads = [shrink(g) for g in grads]
    grads = [tf.cond(opt.iterations >= 0, lambda g=g: g * 0.5, lambda g=g: g) for g in grads]
    grads = [g + 0.01 * tf.cast(opt.learning_rate, g.dtype) * v
             for g, v in zip(grads, variables)]
    opt.apply_private_gradients(grads, variables)
    return grads

  w0 = [np.array(v) for v in variables]
  grads = step(xb, yb)
  assert_applied(variables, w0, grads)
  assert int(opt.ledger.sample_count.numpy()) == 1
