"""Pieces of the private step's mechanism: the public denominator, the float16 overflow
count, the saved query state (McMahan et al., "A General Approach to Adding Differential
Privacy to Iterative Training Procedures", Section 7).

`private_step.PrivateStep` uses these plain functions: the noised sum is divided by the
batch's denominator (records in the batch; the public expected size q n under Poisson and
truncated Poisson, q n / b under cyclic Poisson: `expected_records`), a record whose
float16 gradient overflowed is zeroed and counted (`count_overflowed`), and a query state
saved in the optimizer config is restored in place of the initial one
(`restore_global_state`).
"""

import sys

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError

def count_overflowed(counter, finite, record_mask):
  """Adds the real records (record_mask > 0) whose gradient was zeroed (finite False) to
  `counter`, printing a warning when there are any. A zeroed record adds 0 to the clipped
  sum (norm 0 <= C): the guarantee holds, but its data was not used.

  Args:
    counter: the int64 tf.Variable of overflowed records.
    finite: [R] bool, whether each record's gradient was finite.
    record_mask: [R] 0/1, the real records.

  Returns:
    a list of control dependencies for the accumulation.
  """
  zeroed = tf.logical_and(tf.logical_not(finite), tf.cast(record_mask, tf.float32) > 0)
  count = tf.reduce_sum(tf.cast(zeroed, tf.int64))

  def warn():
    tf.print("WARNING: tf_dpiter: the float16 gradients of", count, "record(s) overflowed "
             "and were zeroed (they add 0 to the clipped sum; the privacy guarantee holds). "
             "Lower the learning rate or train under mixed_bfloat16/float32; "
             "optimizer.overflowed_records counts them.", output_stream=sys.stderr)
    return tf.constant(True)

  added = counter.assign_add(count)
  with tf.control_dependencies([added]):
    return [tf.cond(count > 0, warn, lambda: tf.constant(False))]


def restore_global_state(saved, flat_init):
  """The saved query state (e.g. an adaptive clip) in place of the initial one, if any.

  Args:
    saved: None, or the config's "dp_global_state" (a list of nested lists).
    flat_init: the query's flattened initial global state (tensors).

  Returns:
    a list of tensors like flat_init.

  Raises:
    ParameterValueError: the saved state does not match the query's (count or shapes).
  """
  if saved is None:
    return flat_init
  if not isinstance(saved, (list, tuple)) or len(saved) != len(flat_init) or any(
      tuple(np.shape(s)) != tuple(t.shape) for s, t in zip(saved, flat_init)):
    raise ParameterValueError(
        "the saved dp_global_state does not match the query's state (expected "
        f"{len(flat_init)} values of shapes {[tuple(t.shape) for t in flat_init]}). "
        f"Received: dp_global_state={saved!r}")
  return [tf.constant(np.asarray(s), dtype=t.dtype) for s, t in zip(saved, flat_init)]
