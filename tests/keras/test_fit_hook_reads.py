"""weight_fingerprints._read_all: the read the fingerprints' checks make (ReadVariableOp on a
plain resource variable's handle) returns what the variable's own read returns, sharing its
buffer, so the copy-on-write rule of the module docstring holds for it: a held read keeps
its address until a write, after which the read is at another address; a variable in
copy-on-read mode (after a sparse update) reads copies; a distributed variable is read
through its own read. No privacy figure is computed here.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.keras.optimizer import weight_fingerprints


def _address(tensor):
  return np.asarray(tensor).__array_interface__["data"][0]


def test_the_read_is_the_variables_own_buffer_until_a_write():
  variables = [keras.Variable(np.arange(6, dtype="float32").reshape(2, 3)),
               tf.Variable(np.arange(4, dtype="int64")),
               keras.Variable(np.ones([3], "float16"))]
  held = weight_fingerprints._read_all(variables)  # pylint: disable=protected-access
  for v, t in zip(variables, held):
    own = tf.convert_to_tensor(v.value if isinstance(v, keras.Variable) else v)
    np.testing.assert_array_equal(t.numpy(), own.numpy())
    assert t.dtype == own.dtype and _address(t) == _address(own)
  again = weight_fingerprints._read_all(variables)  # pylint: disable=protected-access
  assert [_address(t) for t in again] == [_address(t) for t in held]
  variables[0].assign(variables[0] + 1.0)   # held: written into a new buffer
  after = weight_fingerprints._read_all(variables)  # pylint: disable=protected-access
  assert _address(after[0]) != _address(held[0])
  np.testing.assert_array_equal(after[0].numpy(), held[0].numpy() + 1.0)
  assert _address(after[1]) == _address(held[1])


def test_a_variable_in_copy_on_read_mode_reads_copies():
  v = tf.Variable(np.zeros([4, 2], "float32"))
  v.scatter_nd_update([[1, 1]], [3.0])
  first, second = (weight_fingerprints._read(v) for _ in range(2))  # pylint: disable=protected-access
  assert _address(first) != _address(second)
  np.testing.assert_array_equal(first.numpy(), second.numpy())
  assert first.numpy()[1, 1] == 3.0


def test_a_step_count_and_a_scalar_read_as_host_integers_and_copies():
  opt = keras.optimizers.SGD(0.1)
  opt.iterations.assign(7)
  assert weight_fingerprints._iterations(opt) == 7  # pylint: disable=protected-access
  scalar = tf.Variable(tf.constant(2.5, tf.bfloat16))
  t = weight_fingerprints._read(scalar)  # pylint: disable=protected-access
  array = weight_fingerprints._host_array(t)  # pylint: disable=protected-access
  assert array.shape == () and float(array) == 2.5
  f32 = weight_fingerprints._read(tf.Variable(1.5))  # pylint: disable=protected-access
  assert _address(weight_fingerprints._host_array(f32)) != _address(f32)  # pylint: disable=protected-access


def test_a_mirrored_variable_is_read_through_its_own_read():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    v = keras.Variable(np.arange(3, dtype="float32"))
  assert isinstance(v.value, tf.distribute.DistributedValues)
  t = weight_fingerprints._read(v)  # pylint: disable=protected-access
  np.testing.assert_array_equal(t.numpy(), np.arange(3, dtype="float32"))
  assert weight_fingerprints.digest(v) == weight_fingerprints.digest(
      tf.constant(np.arange(3, dtype="float32")))
