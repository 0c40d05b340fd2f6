"""summation.rounding_margin against adversarial neighbouring datasets, independently of its
formula: a float32 emulation of the sum's plan in numpy, the move measured in float64.

Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it" (CCS 2022), Secs. 3-5; Higham, "Accuracy
and Stability of Numerical Algorithms", 2nd ed., Sec. 4.2. Relation: add/remove one record r,
either with the rows after r SHIFTED by one (a batch gathered in index order: fit's Poisson
batches) or with r a masked row in its slot; unit: the L2 norm of a record's term (every row
here has norm <= 1 = C'). The plan emulated (IEEE float32, round to nearest, numpy): blocks
of b rows summed sequentially in an order of each coordinate's own (forward, backward or a
random permutation: a matrix product may reduce in any order), the blocks' sums by the
pinned pairwise tree (pad to 2^d, x[:h] + x[h:]), K chunks' sums added one after the other,
then one multiply by a scale (a final rounding). Rows: huge/tiny magnitudes, cancellations,
many equal rows, and the review's row-shift pattern (31 rows of 1, one of 0.5 + 3 w, 31 of
-0.75 w, one of 1; w = 2^-19: after a leading 1 the -0.75 w rows round away, without it to
-w each), whose move under a shift exceeds the slot relation's bound.
"""

import numpy as np
import pytest

from tf_dpiter.dp_query import summation

F32 = np.float32


def _tree(x):
  """The pinned pairwise tree over the leading axis, float32 (zero rows pad to 2^d)."""
  n = max(len(x), 1)
  p = 1 << (n - 1).bit_length()
  x = np.concatenate([x, np.zeros((p - len(x),) + x.shape[1:], F32)]).astype(F32)
  while len(x) > 1:
    h = len(x) // 2
    x = (x[:h] + x[h:]).astype(F32)
  return x[0]


def _blocks(x, block, orders):
  """Each block's rows summed sequentially, coordinate c in the order orders[c] of the
  block's rows (a permutation of range(block)): [blocks, dims] float32."""
  pad = (-len(x)) % block
  x = np.concatenate([x, np.zeros((pad, x.shape[1]), F32)]).reshape(-1, block, x.shape[1])
  out = np.zeros((x.shape[0], x.shape[2]), F32)
  for c, order in enumerate(orders):
    acc = np.zeros(x.shape[0], F32)
    for j in order:
      acc = (acc + x[:, j, c]).astype(F32)
    out[:, c] = acc
  return out


def _plan_sum(x, records, block, orders, scale=None):
  """The plan's float32 sum of rows x [n, dims]: chunks of `records` rows (the last padded
  with zero rows), each in blocks and a tree, the chunks' sums one after the other, then
  times `scale` (None: no final rounding)."""
  acc = None
  for start in range(0, max(len(x), 1), records):
    chunk = x[start:start + records]
    s = _tree(_blocks(chunk, block, orders))
    acc = s if acc is None else (acc + s).astype(F32)
  return acc if scale is None else (acc * F32(scale)).astype(F32)


def _move(x, r, records, block, orders, shifted, scale=None):
  """||S(D) - S(D')|| in float64, D' = D without row r (shifted: the later rows move up
  and a zero row keeps the row count; else r's row zeroed)."""
  if shifted:
    y = np.concatenate([np.delete(x, r, axis=0), np.zeros((1, x.shape[1]), F32)])
  else:
    y = x.copy()
    y[r] = 0.0
  a, b = (_plan_sum(z, records, block, orders, scale).astype(np.float64) for z in (x, y))
  return float(np.linalg.norm(a - b))


def _unit_rows(x):
  """Rows scaled to L2 norm <= 1 in float64 (float32 rounding kept below 1)."""
  x = np.asarray(x, np.float64)
  norms = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1.0)
  x = (x / norms).astype(F32)
  over = np.linalg.norm(x.astype(np.float64), axis=1) > 1.0
  x[over] = (x[over] * F32(1 - 2 ** -23)).astype(F32)
  assert np.all(np.linalg.norm(x.astype(np.float64), axis=1) <= 1.0)
  return x


def _shift_pattern(blocks):
  """The review's row-shift pattern (module docstring) in one coordinate (second: 0), with
  the target row (1) first: D = [1] + patterns."""
  w = F32(2.0 ** -19)
  pattern = np.array([1.0] * 31 + [0.5 + 3 * w] + [-0.75 * w] * 31 + [1.0], F32)
  y = np.concatenate([[F32(1.0)], np.tile(pattern, blocks)])
  return np.stack([y, np.zeros_like(y)], axis=1)


def _adversarial(rng, n, kind):
  """n rows of two coordinates built to round: see the module docstring."""
  if kind == "huge_tiny":
    big = rng.choice([-1.0, 1.0], (n, 2)) * (1 - rng.rand(n, 2) * 2.0 ** -rng.randint(1, 24, (n, 2)))
    tiny = rng.choice([-1.0, 1.0], (n, 2)) * 2.0 ** -rng.randint(10, 30, (n, 2))
    x = np.where(rng.rand(n, 2) < 0.5, big, tiny)
  elif kind == "cancelling":
    x = np.repeat([[1.0, -1.0], [-1.0, 1.0]], n // 2 + 1, axis=0)[:n] * (
        1 - 2.0 ** -rng.randint(1, 24, (n, 1)))
    x[rng.rand(n) < 0.3] *= 2.0 ** -12
  elif kind == "equal":
    x = np.tile(rng.choice([-1.0, 1.0], 2) * (1 - 2.0 ** -rng.randint(2, 24)), (n, 1))
    x[rng.randint(n)] *= 0.5
  else:   # near powers of two, one sign: every partial sum near a binade's end
    x = (1 - rng.rand(n, 2) * 2.0 ** -rng.randint(10, 24, (n, 2))) * 2.0 ** -rng.randint(0, 3)
  return _unit_rows(x)


def _orders(rng, block, dims=2):
  choice = rng.randint(3)
  if choice == 0:
    return [list(range(block))] * dims
  if choice == 1:
    return [list(range(block))[::-1]] * dims
  return [list(rng.permutation(block)) for _ in range(dims)]


# (records per chunk, chunks, block, final): one row per record in one chunk, blocks of 8
# and 64 under the tree, sequential chunks, a final multiply
PLANS = [(256, 1, 1, 0), (256, 1, 8, 0), (512, 1, 64, 1), (64, 4, 8, 0), (128, 3, 1, 1)]


@pytest.mark.parametrize("records, chunks, block, final", PLANS)
@pytest.mark.parametrize("shifted", [True, False])
def test_the_margin_covers_the_worst_measured_move(records, chunks, block, final, shifted):
  """eta >= the worst measured move / C' - 1 over adversarial pairs (100 per plan), and the
  move stays <= C' (1 + eta), the rows of norm <= C' = 1."""
  rng = np.random.RandomState(records * 7 + chunks * 3 + block + final + shifted)
  eta = summation.rounding_margin(records, chunks=chunks, block=block, final=final,
                                  shifted=shifted)
  scale = F32(1 - 2 ** -20) if final else None
  worst = 0.0
  for trial in range(100):
    kind = ("huge_tiny", "cancelling", "equal", "binade")[trial % 4]
    n = records * chunks - rng.randint(0, 4) if shifted else records * chunks
    x = _adversarial(rng, n, kind)
    r = rng.randint(min(n, 8)) if trial % 2 else rng.randint(n)   # early r: more shifted
    worst = max(worst, _move(x, r, records, block, _orders(rng, block), shifted, scale))
  assert worst - 1.0 <= eta, (worst, eta)


def test_a_shift_of_the_rows_moves_the_sum_past_the_slot_bound():
  """The review's row-shift pattern through blocks of 64 (forward order), 16 blocks: the
  shifted rows move the sum by more than the slot relation's bound allows, within the
  shifted relation's (the one the step's public plan charges)."""
  x = _shift_pattern(16)
  records = len(x) + 63   # one chunk holding every row, padded to a multiple of the block
  order = [list(range(64))] * 2
  moved = _move(x, 0, records, 64, order, shifted=True)
  slot = summation.rounding_margin(records, block=64, shifted=False)
  shifted = summation.rounding_margin(records, block=64, shifted=True)
  assert 1.0 + slot < moved <= 1.0 + shifted, (moved, slot, shifted)
  # in its slot (no shift) the same removal stays within the slot bound
  assert _move(x, 0, records, 64, order, shifted=False) <= 1.0 + slot


@pytest.mark.parametrize("block", [8, 64])
def test_the_shift_pattern_within_the_margin_of_its_blocks(block):
  """Without a margin the shift pattern moves the sum by more than C'; the bound of the
  plan (blocks of 8 or 64, the step's fast path) covers it."""
  x = _shift_pattern(16)
  records = len(x)
  moved = _move(x, 0, records, block, [list(range(block))] * 2, shifted=True)
  assert moved - 1.0 <= summation.rounding_margin(records, block=block)
  if block == 64:
    assert moved > 1.0
