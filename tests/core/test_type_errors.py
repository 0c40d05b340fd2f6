"""A wrong *type* raises TypeError (ParameterTypeError), naming the parameter and the value.

ParameterTypeError is also a ValueError (older callers catch ValueError), so each case also
checks that the message names the parameter and the value it got.
"""

import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import validation


CASES = [
    (lambda: validation.check_nonnegative("l2_norm_clip", "1.0"), "l2_norm_clip.*'1.0'"),
    (lambda: validation.check_nonnegative("l2_norm_clip", True), "l2_norm_clip.*True"),
    (lambda: validation.check_probability("sampling_probability", "0.1"),
     "sampling_probability.*'0.1'"),
    (lambda: validation.check_delta("delta", b"1e-5"), "delta.*b'1e-5'"),
    (lambda: validation.check_integer("steps", 2.5, 1), "`steps` must be an int >= 1. Received: steps=2.5"),
    (lambda: dp.accounting.make_accountant(5), "accountant.*got 5"),
    (lambda: dp.accounting.check_accountant(None), "accountant.*None"),
    (lambda: dp.accounting.calibrate_noise_multiplier(1.0, 1e-5, 0.01, 10.5), "steps.*10.5"),
    (lambda: dp.accounting.lookahead.content_after(None, None, 1.0), "count.*1.0"),
    (lambda: dp.accounting.epsilon(object(), 1e-5), "ledger must be .*got object"),
    (lambda: dp.data.shuffled_batches(np.ones([10, 2]), batch_size=2.0), "batch_size.*2.0"),
    (lambda: dp.data.shuffled_batches(np.ones([10, 2]), batch_size=2, passes="1"),
     "passes.*'1'"),
    (lambda: dp.federated.partition_iid(np.ones([10, 2]), np.zeros(10), 2.0), "num_clients.*2.0"),
    (lambda: dp.federated.RoundSchedule(3, noise_multiplier="1.0"), "noise_multiplier.*'1.0'"),
    (lambda: dp.federated.DPServer(dp.dp_query.NoPrivacySumQuery(), np.zeros(3), 10, 2,
                                   server_momentum="0.9"), "server_momentum.*'0.9'"),
    (lambda: dp.auditing.epsilon_lower_bound([1.0], [0.0], delta="0"), "delta.*'0'"),
    (lambda: dp.auditing.epsilon_lower_bound([1.0], [0.0], 1e-5, num_thresholds=2.0),
     "num_thresholds.*2.0"),
]


@pytest.mark.parametrize("call, match", CASES)
def test_wrong_type_raises_type_error_naming_parameter_and_value(call, match):
  with pytest.raises(TypeError, match=match):
    call()
