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
