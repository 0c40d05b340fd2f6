"""Review R16 (session 46) of session 45's validation calls (helper LN: hand-written checks
replaced by `tf_dpiter.validation` calls): did a check get weaker?

Finding 2: a numpy bool passed as a number. The hand-written check of
`StopAtPrivacyBudget(epsilon=...)` took `isinstance(epsilon, (int, float))`, so np.True_ was
refused; `validation.check_positive` refused a Python bool only, so np.True_ was taken as
epsilon = 1.0 (and as any number the validation module's float intervals check: a clip, a
noise multiplier, a lock TTL). Fixed: the validation module refuses numpy's bool as it
refuses Python's.
"""

import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import validation
from tf_dpiter.errors import ParameterTypeError


@pytest.mark.parametrize("flag", [True, np.True_, np.bool_(False)])
def test_a_bool_is_not_a_number(flag):
  with pytest.raises(ParameterTypeError, match="epsilon"):
    dp.keras.callbacks.StopAtPrivacyBudget(epsilon=flag, delta=1e-5)
  for check in (validation.check_positive, validation.check_nonnegative,
                validation.check_probability, validation.check_number):
    with pytest.raises(ParameterTypeError):
      check("x", flag)
  with pytest.raises(ParameterTypeError):
    validation.check_integer("k", flag, 0)
