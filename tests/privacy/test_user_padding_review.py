"""Review R (session 31): user-level Poisson batches (dp.data.poisson_user_batches) pad with
copies of the arrays' FIRST example, so one user's data reaches other users' records.

McMahan et al., "Learning Differentially Private Recurrent Language Models" (ICLR 2018),
Sec. 2, and McMahan et al., "A General Approach to Adding Differential Privacy to Iterative
Training Procedures" (2018), Table 1: a record is all of one user's data, clipped to C, so
adding or removing one user moves the clipped sum by at most C. user_sampling pads a user
with fewer than k examples (and the empty users of a padded step) with rows `take = 0`: the
arrays' first example, weight 0. A weight-0 row adds nothing only while it is finite: when
the first example holds a NaN (or makes an infinite loss), 0 x NaN makes the records of the
users padded with it non-finite, and the step drops them (clip factor 0). Their contribution
then depends on another user's data, whether or not that user is sampled.

Relation: add/remove one user (policy user_poisson, sensitivity C per user), q = 1 (every user
in the one step, expected_users_per_batch = U). A bias-free Dense(1) from zero weights, x = 1,
loss y * output, y = 10 (every user's record clipped to C), SGD lr 1, noise 0,
normalize=False: w0 - w1 is the clipped sum. D: user 0 with one example whose x is NaN (the
arrays' first row), users 1-4 with 2 examples, users 5-7 with 1 (k = 2: padded). D' = D
without user 0. Independent float64 value: users 1-7 add C each on both (7 C); user 0 adds at
most C on D, so the sums are at most C apart.

Measured at 86d7223 (fit on the dataset, noise off): the fast path gives 4 C on D (users 5-7
dropped with user 0) and 7 C on D': a move of 3 C, in a graph and under XLA; the vectorized
path gives NaN on D (tests/privacy/test_nonfinite_records_review.py). Fix: pad with zero rows
(as poisson_batches does, sampling._pad_rows_to), not with copies of a real example, and zero
a non-finite record's gradient before its clip factor multiplies it.

Fixed since (session 31): padding rows are zero rows (user_sampling._rows_or_zeros), as
poisson_batches pads; 86d7223 copied x[0]: user 0's NaN first example padded users 5-7, D 4 C,
D' 7 C, a move of 3 C (fast path, graph and XLA).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

C, Y, K = 1.0, 10.0, 2
_SLOW = pytest.mark.slow


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _users(with_user0):
  uid = ([0] if with_user0 else []) + [1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7]
  x = np.ones((len(uid), 1), np.float32)
  if with_user0:
    x[0, 0] = np.nan
  return x, np.full((len(uid), 1), Y, np.float32), np.asarray(uid)


def _step_sum(clipping, jit, with_user0):
  keras.utils.set_random_seed(0)
  x, y, uid = _users(with_user0)
  users = len(set(uid.tolist()))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0
    ds = dp.data.poisson_user_batches(x, y, uid, expected_users_per_batch=users,
                                      max_examples_per_user=K, steps_per_epoch=1)
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping=clipping,
                                       normalize=False)
  model = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  model.compile(optimizer=opt, loss=_loss, jit_compile=jit)
  model.fit(ds, epochs=1, verbose=0)
  assert int(model.ledger.sample_count) == 1
  return -model.get_weights()[0].astype(np.float64).ravel()


@pytest.mark.parametrize("clipping, jit", [
    pytest.param("fast", False),
    pytest.param("fast", True, marks=_SLOW)])
def test_one_users_data_moves_the_user_level_sum_by_at_most_C(clipping, jit):
  s_d, s_d2 = _step_sum(clipping, jit, True), _step_sum(clipping, jit, False)
  exact = 7 * C   # users 1-7, each clipped to C, on both datasets
  assert abs(float(s_d2[0]) - exact) <= 1e-3 * exact, s_d2
  assert np.all(np.isfinite(s_d)), s_d
  assert float(np.linalg.norm(s_d - s_d2)) <= C, (s_d, s_d2)
