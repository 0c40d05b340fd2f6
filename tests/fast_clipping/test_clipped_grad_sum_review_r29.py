"""clipped_grad_sum inside a user's summation.public_plan with `examples_per_record` a tensor
whose value the trace does not know (review R29 of review R27's fix).

Relation: add/remove one example; unit: example (a record of k = 1 example, C = 1); noise 0
(the float32 clipped sum itself is measured). D = B = 4 examples, D' = D plus one example,
added last (no row shifts), both inside `summation.public_plan(R, r, K)`, public and the same
on both datasets, so every record's norm bound must count the plan's r k examples, not B.

Records: review R27's (tests/fast_clipping/test_clipped_grad_sum_plan_review_r27.py, after
review R22's Dense case): D's records nearly cancel (||g|| = 2 C, norm bound about twice it),
so a norm bound that counts one more example lowers all B factors at once; the added record
is clipped to C. A sound step moves the sum by at most 1.0 C.

clipped_grad_sum accepts `examples_per_record` as a scalar integer tensor (a dynamic batch's
k). Inside a tf.function the value of such a tensor is unknown to the trace, so the plan's
r k examples per call (algebra.public_examples) could not be formed: the norm bounds counted
the call's own rows again, the defect review R27 fixed for a static k.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.fast_clipping import clipping

from tests.fast_clipping import test_clipped_grad_sum_plan_review_r27 as r27

C, B = r27.C, r27.B


def _summer(plan, unknown_batch, physical_chunks=False):
  """n -> the clipped sum of the first n examples inside public_plan(*plan), k = 1 passed as
  a tensor argument of a tf.function (its value unknown to the trace), in units of C."""
  model = r27._model()

  def f(a, b, k):
    with summation.public_plan(*plan):
      return clipping.clipped_grad_sum(model, a, b, r27._loss, C, examples_per_record=k,
                                       physical_chunks=physical_chunks)[0]
  sig = ([tf.TensorSpec([None, r27.T, r27.UNITS])] * 2 + [tf.TensorSpec([], tf.int32)]
         if unknown_batch else None)
  f = tf.function(f, input_signature=sig)
  x, y = r27._records()
  return lambda n: np.concatenate([
      np.ravel(np.asarray(g, np.float64))
      for g in f(tf.constant(x[:n]), tf.constant(y[:n]), tf.constant(1, tf.int32))]) / C


@pytest.mark.parametrize("unknown_batch", [False, True], ids=["known_batch", "unknown_batch"])
@pytest.mark.parametrize("physical_chunks", [False, True], ids=["one_call", "physical_chunks"])
def test_records_of_a_size_the_trace_does_not_know_inside_a_plan_are_refused(
    unknown_batch, physical_chunks):
  """public_plan(64, 8, 8): D = 4, D' = 5 examples, both within the plan's 8 records per
  call, k = 1 given as a tensor the trace does not know. Measured (session 51, 11e7c46):
  algebra.public_examples gave None for k unknown, so sum_examples counted the call's own
  rows (4 on D, 5 on D'): ||sum(D') - sum(D)|| = 1.1776732 C (graph; batch known or not,
  physical_chunks True or False; plan (64, 64, 1) the same), where k = 1 as an int gives
  0.9999274 C (review R27's control). The plan's r k cannot be formed without k: refused."""
  summed = _summer((64, 8, 8), unknown_batch, physical_chunks)
  with pytest.raises(PrivacyConfigError, match="examples_per_record"):
    d = summed(B)
    moved = float(np.linalg.norm(summed(B + 1) - d))
    assert moved <= C, moved   # reached only before the fix: 1.1776732 C


def test_records_of_a_size_the_trace_does_not_know_move_the_sum_past_c():
  """The measurement itself, kept as a check on the records: outside the refusal (the same
  tensor k = 1 and records, the plan's r k formed by hand: k = 1 as an int), the sum moves
  by at most C; the tensor-k case above moved it by 1.1776732 C before the fix."""
  model = r27._model()

  @tf.function
  def f(a, b):
    with summation.public_plan(64, 8, 8):
      return clipping.clipped_grad_sum(model, a, b, r27._loss, C, examples_per_record=1,
                                       physical_chunks=False)[0]
  x, y = r27._records()
  s = lambda n: np.concatenate([np.ravel(np.asarray(g, np.float64))
                                for g in f(tf.constant(x[:n]), tf.constant(y[:n]))]) / C
  d = s(B)
  assert 0.1 * B * C < np.linalg.norm(d) <= 0.6 * B * C   # the norm bound is exercised
  moved = float(np.linalg.norm(s(B + 1) - d))
  assert moved <= C, moved


# After a batch past the public row bound under XLA (brief's candidate 2). Relation
# add/remove, unit example: R = 48 is the public bound on a step's rows of set_sampling(64,
# 8 / 64, "poisson") (twice the padded size of the declared sample); a batch of more rows
# cannot be given the plan's shrink, so the step must not update. Graph mode refuses it
# (InvalidArgumentError, an assertion); XLA drops assertions, so the step's sums are made NaN
# (chunking.sum_over_chunks; review of session 44). Measured (session 51, b0f13b1, fit of
# one batch of 60 rows then two of 8, noise off, C = 1, lr 1): fit returned normally with
# loss [nan], the weight NaN, and a second fit of a batch of 8 ran and returned loss [nan]:
# the model is silently spoiled, no error names the bound. A Poisson batch of the declared
# sampling passes R with probability at most 1.5e-10 per step (a grid over n <= 1e7 and
# q in [1e-6, 1]; worst n = 17002, q = 1.26e-4, R = 16; since raised to at most 1e-18:
# tests/ledger/test_public_row_bound_tail.py), so this is rare, but when it happens the user
# must get an error, not NaN weights.

def _fit_past_the_row_bound_then_on(compiled_noise):
  """(the error a fit raised or None, the weight after it, the second fit's error or None);
  compiled_noise: the noise drawn inside the XLA program (the ledger write after it)."""
  import tf_dpiter as dp   # pylint: disable=g-import-not-at-top
  import keras   # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  with pytest.warns(UserWarning):   # noise 0
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping="fast",
                                       normalize=False)
  model.compile(optimizer=opt, loss=lambda yt, yp: tf.reduce_sum(yt * yp, axis=-1),
                jit_compile=True)
  opt.private_step.set_flags(compiled_noise=compiled_noise)
  opt.set_sampling(64, 8 / 64, "poisson")
  assert opt.private_step.sampling.public_row_bound == 48
  rows = np.ones((60, 1), np.float32)
  big = tf.data.Dataset.from_tensor_slices((rows, -rows)).batch(60)
  small = tf.data.Dataset.from_tensor_slices((rows[:8], -rows[:8])).batch(8)
  errors, weights = [], []
  for ds in (big.concatenate(small), small):
    try:
      model.fit(ds, verbose=0)
      errors.append(None)
    except (dp.errors.PrivacyConfigError, tf.errors.InvalidArgumentError) as e:
      errors.append(e)
    weights.append(float(model.get_weights()[0].ravel()[0]))
  return errors[0], weights[0], errors[1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("compiled_noise", [False, True], ids=["noise_outside", "noise_inside"])
def test_under_xla_a_batch_past_the_row_bound_raises_and_keeps_the_weights(compiled_noise):
  """fit under jit_compile=True of a batch of 60 rows (bound 48): an error naming the bound
  (train_step._within_row_bound, outside the XLA core), the weight unchanged (the step
  updates nothing); measured before (b0f13b1): no error, weight NaN, a later fit ran on it."""
  first, weight, second = _fit_past_the_row_bound_then_on(compiled_noise)
  assert first is not None and "at most 48" in str(first), (first, weight)
  assert weight == 0.0, weight   # the failing step applied nothing (the weight starts at 0)
  assert second is None, second   # a batch of 8 within the bound trains on afterwards
