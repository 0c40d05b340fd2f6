"""Review R18 (session 47) of session 46's `validation._is_bool` (review R16 finding 2: a numpy
bool refused as a number, as a Python bool is).

Finding 4: a bool that is not a Python or numpy scalar bool still passed the validation
module's number checks: a 0-d numpy bool array (np.array(True), what np.asarray of a flag
gives) and a TensorFlow bool tensor. `StopAtPrivacyBudget(epsilon=np.array(True))` and
`(epsilon=tf.constant(True))` took epsilon = 1.0 (before session 45 the hand-written
`isinstance(epsilon, (int, float))` refused the array); check_number, check_nonnegative,
check_probability and check_positive passed both (a tensor passes a float interval
unchecked). Fixed: `_is_bool` reads the value's dtype (numpy's and TensorFlow's are named
"bool"), and a float interval refuses a bool tensor (its dtype is known without running it).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.core import test_core_review_r16 as r16
from tf_dpiter import validation

_FLAGS = {"numpy_0d": lambda: np.array(True), "numpy_0d_false": lambda: np.array(False),
          "tf_bool": lambda: tf.constant(True)}


@pytest.mark.parametrize("flag", sorted(_FLAGS))
def test_a_bool_array_or_tensor_is_not_a_number(flag):
  """R16's checks (StopAtPrivacyBudget's epsilon, the number, interval and integer checks)
  on the array or tensor."""
  r16.test_a_bool_is_not_a_number(_FLAGS[flag]())


def test_numbers_as_arrays_and_tensors_still_pass():
  """No behaviour break: 0-d numeric arrays, numpy scalars and float/int tensors pass as
  before."""
  assert validation.check_number("x", np.array(1.5)) == 1.5
  assert validation.check_positive("x", np.float32(0.5)) == np.float32(0.5)
  assert validation.check_nonnegative("x", np.int64(3)) == 3.0
  t = tf.constant(0.25)
  assert validation.check_probability("x", np.float64(0.25)) == 0.25
  assert validation.check_positive("x", t) is t
  assert validation.check_integer("k", np.int32(4), 0) == 4
  assert validation.check_integer("k", tf.constant(4), 0) == 4
