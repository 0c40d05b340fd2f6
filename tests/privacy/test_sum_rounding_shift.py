"""The step's float32 clipped sum when removing a record SHIFTS the rows after it, through the
real step (train_on_batch), noise off, against float64.

Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it" (CCS 2022), Secs. 3-5; Higham, "Accuracy
and Stability of Numerical Algorithms", 2nd ed., Sec. 4.2. Relation: add/remove one example
under Poisson sampling (population N public, q = 1: the step's public row bound 2 N), the
target first, so every later row shifts by one; unit: the L2 norm of a record's clipped
gradient, C = 1. Model: bias-free Dense(1) from zero weights, x = 1, loss y * output, SGD
lr 1, noise 0, normalize=False: w0 - w1 is the step's float32 sum; |y| <= C (clip factor 1).

Rows (D' = patterns, D = [C] + D'): an 8-row pattern 1, 1, 1, 0.5 + 3 w, -0.75 w (3 times),
1 with w = 2^-22 (the float32 spacing in [2, 4)), built against blocks of 8 rows summed in
order (the fast path's pinned Dense blocks where the blocks' sums are small,
algebra.pinned_block): in D each block starts with the previous pattern's last 1, its
partial sum passes 4 before the -0.75 w rows, which round away (spacing 2 w); in D' they
round to -w each. The float64 sums differ by exactly C; the step's float32 sums may differ
by more without the clip shrink of its plan (summation.rounding_margin, shifted relation).
"""


import numpy as np
import pytest
import tensorflow as tf

from tests.privacy import neighbours
from tf_dpiter.dp_query import summation

C = 1.0
W = np.float32(2.0 ** -22)
_SLOW = pytest.mark.slow


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _rows(batch, with_target):
  pattern = np.array([1.0] * 3 + [0.5 + 3 * W] + [-0.75 * W] * 3 + [1.0], np.float32)
  others = np.tile(pattern, (batch - 1) // 8 + 1)[:batch - 1]
  y = np.concatenate([[np.float32(C)], others]) if with_target else others
  return np.ones((len(y), 1), np.float32), y[:, None].astype(np.float32)


def _step_sum(batch, jit, clipping, with_target):
  model = neighbours.zero_dense1(C, jit, clipping, _loss)
  model.optimizer.set_sampling(batch, 1.0, "poisson", batch)
  model.train_on_batch(*_rows(batch, with_target))
  return -model.get_weights()[0].astype(np.float64).ravel()


# default: the fast path in a graph at 2048 and the vectorized path at 512 (about 16 CPU s);
# B = 4096 and XLA slow
CASES = [
    (2048, False, "fast"), (512, False, "vectorized"),
    pytest.param(4096, False, "fast", marks=_SLOW),
    pytest.param(4096, True, "fast", marks=_SLOW),
    pytest.param(4096, False, "vectorized", marks=_SLOW),
    pytest.param(4096, True, "vectorized", marks=_SLOW),
    pytest.param(512, True, "fast", marks=_SLOW)]


def _moved(batch, jit, clipping):
  y_d, y_d2 = (_rows(batch, t)[1].astype(np.float64).ravel() for t in (True, False))
  assert np.sum(y_d) - np.sum(y_d2) == C   # the float64 sums' move
  s_d, s_d2 = (_step_sum(batch, jit, clipping, t) for t in (True, False))
  for got, want in ((s_d, np.sum(y_d)), (s_d2, np.sum(y_d2))):
    assert abs(got[0] / want - 1.0) < 0.2, (got, want)   # the sums, up to the clip shrink
  return float(np.linalg.norm(s_d - s_d2))


@pytest.mark.parametrize("batch, jit, clipping", CASES)
def test_a_shifting_removal_moves_the_sum_by_at_most_c(batch, jit, clipping):
  """Measured at 2026-11-30 (graph): fast 0.99194 C at 2048, 0.98315 C at 4096 (XLA
  0.87634 C: its padded plan's chunks); vectorized 0.99878 C at 512."""
  moved = _moved(batch, jit, clipping)
  assert moved <= C, moved
  # in a graph the move is C times the shrink of the public plan (2 * batch rows, blocks of
  # 8 on the fast path) up to the rows' own roundings
  eta = summation.rounding_margin(2 * batch, block=8, final=1, products=4)
  assert moved > (C / (1 + eta) * (1 - 1e-3) if not jit else 0.8 * C), (moved, eta)


@_SLOW
def test_without_the_shrink_the_rows_move_the_fast_sum_past_c(monkeypatch):
  """The rows are adversarial for the real step: with the clip shrink made 1 the fast path's
  float32 sum moves by 1.00048828125 C at 4096 (measured 2026-11-30)."""
  real = summation.public_shrink

  def no_shrink(*args, **kwargs):
    real(*args, **kwargs)   # the rows' check kept
    return 1.0

  monkeypatch.setattr(summation, "public_shrink", no_shrink)
  assert _moved(4096, False, "fast") > C
