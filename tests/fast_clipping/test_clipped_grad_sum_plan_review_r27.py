"""clipped_grad_sum inside a user's summation.public_plan: a call of more examples than the
plan's records per chunk, and a batch the trace does not know (review R27).

Relation: add/remove one example; unit: example (a record of one example, C = 1); noise 0
(the float32 clipped sum itself is measured). D = B examples, D' = D plus one example, added
last (no row shifts), both inside `summation.public_plan(R, r, K)`: the plan is public, the
same on both datasets, so every record's norm bound and the shrink must not depend on B.

Records (review R22's Dense case, tests/fast_clipping/test_fast_clipping_review_r22.py): a
Dense of 257 -> 257 units on sequences of 130 positions (66,049 kernel entries: never kept, the
norms raised over the book-keeping product's rows, budget.chunk_rows / algebra.sum_examples);
each record of D has two positions of one input and output gradients s and -s (1 - eps), so
that ||g|| = 2 C while gamma_L S ~ ||g|| (L = T + B T + 1 at B = 4): the norm bound is about
twice the norm, and a bound that counts one more example lowers every factor by about T / (2 L).
The added record does not cancel (clipped to C, opposite sign). Such records make a
batch-dependent norm bound visible: D's records are aligned, so a change of their factors
shows B times.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.fast_clipping import clipping

C, U = 1.0, 2.0 ** -24
UNITS, T, B = 257, 130, 4


def _records():
  """x, y of B + 1 examples: B nearly cancelling records, the added one last."""
  length = T + B * T + 1
  x = np.zeros((B + 1, T, UNITS), np.float32)
  x[:, :2, 0] = 1.0
  y = np.zeros((B + 1, T, UNITS), np.float32)
  eps = np.float32(2.0 * length * U)
  s = np.float32(2.0 * C / eps)   # ||g|| = s eps = 2 C, S ~ 2 s
  y[:B, 0, 0], y[:B, 1, 0] = s, -s * (1.0 - eps)
  y[B, :2, 0] = -10.0
  return x, y


def _loss(t, p):
  return tf.reduce_sum(t * p, axis=[1, 2])


def _model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((T, UNITS)), keras.layers.Dense(
      UNITS, use_bias=False, kernel_initializer="zeros")])


def _summer(plan, mode, unknown=False, physical_chunks=False):
  """A function n -> the clipped sum of the first n examples inside public_plan(*plan), in
  units of C (flat float64)."""
  model = _model()

  def f(a, b):
    with summation.public_plan(*plan):
      return clipping.clipped_grad_sum(model, a, b, _loss, C,
                                       physical_chunks=physical_chunks)[0]
  if mode != "eager":
    sig = [tf.TensorSpec([None, T, UNITS])] * 2 if unknown else None
    f = tf.function(f, jit_compile=mode == "xla", input_signature=sig)
  x, y = _records()
  return lambda n: np.concatenate([np.ravel(np.asarray(g, np.float64))
                                   for g in f(tf.constant(x[:n]), tf.constant(y[:n]))]) / C


MODES = ["eager", "graph", pytest.param("xla", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mode", MODES)
def test_a_call_of_more_examples_than_the_plans_records_is_refused(mode):
  """public_plan(64, 4, 16), D = 4 examples in one call, D' = 5 (more than the plan's 4
  records per chunk). Measured (session 50, 04929d9): each record's norm bound
  (algebra.sum_examples) counted max(4, the call's rows): 4 on D, 5 on D', and
  ||sum(D') - sum(D)|| = 1.1815913 C (eager, graph and XLA; plan (64, 1, 64) the same).
  The plan does not describe such a call: it is refused when the trace knows its rows."""
  summed = _summer((64, 4, 16), mode)
  assert np.linalg.norm(summed(B)) > 0.1 * B * C   # D's call (4 examples) is within the plan
  with pytest.raises(PrivacyConfigError, match=r"public_plan\(records=4"):
    summed(B + 1)


@pytest.mark.parametrize("mode", MODES)
def test_calls_within_the_plans_records_move_the_sum_by_at_most_c(mode):
  """Control: public_plan(64, 8, 8), D = 4 and D' = 5 examples, both within the plan's 8
  records per call: every record's norm bound counts 8 on both. Measured (session 50):
  0.9999274 C (eager, graph and XLA), before and after the fix."""
  summed = _summer((64, 8, 8), mode)
  d = summed(B)
  assert 0.1 * B * C < np.linalg.norm(d) <= 0.6 * B * C   # the bound is exercised
  moved = float(np.linalg.norm(summed(B + 1) - d))
  assert moved <= C, moved


def test_physical_chunks_of_a_batch_the_trace_does_not_know_count_a_public_figure():
  """A tf.function of unknown batch (graph: the physical-chunks path; its chunk m is
  measured from the model) inside public_plan(64, 1, 64): the chunks' norm bounds counted
  max(1, min(B, m)) = B (R26's rule), so D' = 5 raised every record's bound over D = 4.
  Measured (session 50, 04929d9): 1.1776732 C (B = 2: 1.1396066 C, B = 6: 1.1962086 C;
  plan (64, 2, 32) the same). Now the count is public, the larger of the plan's records and
  min(its rows bound, m) = 64: 0.9999274 C."""
  summed = _summer((64, 1, 64), "graph", unknown=True, physical_chunks=True)
  d = summed(B)
  assert np.linalg.norm(d) > 0.1 * B * C
  moved = float(np.linalg.norm(summed(B + 1) - d))
  assert moved <= C, moved


def test_a_batch_the_trace_does_not_know_over_the_plans_records_fails_the_call():
  """A tf.function of unknown batch, physical_chunks=False, inside public_plan(64, 4, 16):
  the norm bounds count the plan's 4 examples, right only for a call of at most 4. Before
  (04929d9) a call of 5 ran, its bounds counting 4 rows of a product of 5 (the float32 error
  of that sum against its float64 reference with the same factors was 3.4e-5 C, B = 4, and
  1.4e-3 C at B = 32, well within the margin charged, but the bound did not cover its
  worst case). Now the call fails at run time (an assertion)."""
  summed = _summer((64, 4, 16), "graph", unknown=True)
  assert np.linalg.norm(summed(B)) > 0.1 * B * C
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"public_plan\(records=4"):
    summed(B + 1)


@pytest.mark.slow
def test_under_xla_a_batch_over_the_plans_records_gives_nan_sums():
  """As the test above, under XLA (tf.function(jit_compile=True), unknown batch: one call):
  XLA drops the assertion, so a call of more examples than the plan's records gives NaN
  sums (an update of nothing finite). Before (04929d9): finite sums whose norm bounds
  counted 4 rows of 5 (moved 0.9999582 C, B = 4 vs 5)."""
  summed = _summer((64, 4, 16), "xla", unknown=True)
  assert np.all(np.isfinite(summed(B)))
  assert np.all(np.isnan(summed(B + 1)))


def test_physical_chunks_of_a_batch_over_the_plans_rows_are_refused(monkeypatch):
  """Inside public_plan(20, 20, 1) a batch of 33 examples runs in physical chunks of m = 32
  (review R25's Embedding model under a 64 KiB budget): more rows than the plan's public
  bound R = 20, which the chunks' norm bounds (max(r, min(R, m)) = 20) and the shrink (the
  plan's, and ceil(R / m) = 1 chunk of m) assume. Before (04929d9) it ran unchecked (the
  shrink then charged one chunk where the batch ran as two: found by reading, not measured
  past C); now refused (summation.within_public_rows), as a call of 33 in one call is."""
  from tf_dpiter.keras.fast_clipping.rules import budget   # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(budget, "KEPT_BYTES", 65536)
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
      keras.layers.Dense(16, activation="tanh"), keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(3)])
  x = tf.constant(np.tile(np.arange(12, dtype="int32")[None] * 3 + 1, (33, 1)))
  y = tf.constant(np.full(33, 2))
  assert clipping._physical_chunk(model, x, 1)[0] == 32
  loss = lambda t, p: tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(t, tf.int32), p)
  with summation.public_plan(20, 20, 1):
    with pytest.raises(PrivacyConfigError, match="at most 20"):
      clipping.clipped_grad_sum(model, x, y, loss, C)
  with summation.public_plan(40, 20, 2):   # within the bound: runs
    grads, _ = clipping.clipped_grad_sum(model, x, y, loss, C)
  assert all(np.all(np.isfinite(g)) for g in grads)
