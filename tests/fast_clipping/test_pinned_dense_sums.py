"""The Dense rule's pinned clipped sum on [B, K] inputs (rules/dense._pinned_dense_sums).

sum_i c_i (x_i dz_i^T, dz_i) formed by algebra.pinned_rows_product (blocks of rows, the blocks
by dp_query/summation.pairwise_sum) must equal the float64 sum of the per-example gradients to
float32 rounding, whichever operand carries the factors, a record with c_i = 0 adding exactly
nothing even where its values are not finite, with a batch the trace knows or not, in graph
mode and under XLA; and both variables' sums must be declared pinned (algebra.sum_plans), so
that clipping._with_rounding_margin charges their rounding margin.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.fast_clipping.rules import dense

# Nightly tier (-m slow): each (jit, static) mode once by default with K < N and K > N both
# ([False-True-3-7], [True-True-3-7], [False-False-7-3]), the other (K, N) of each nightly.
SLOW_CASES = {"test_pinned_dense_sums_match_per_example_gradients[True-True-7-3]",
              "test_pinned_dense_sums_match_per_example_gradients[False-False-3-7]",
              "test_pinned_dense_sums_match_per_example_gradients[False-True-7-3]"}


def _reference(x, dz, c):
  keep = c > 0
  x64, dz64, c64 = (t[keep].astype(np.float64) for t in (x, dz, c))
  return np.einsum("bk,bn,b->kn", x64, dz64, c64), np.einsum("bn,b->n", dz64, c64)


@pytest.mark.parametrize("k, n", [(3, 7), (7, 3)])
@pytest.mark.parametrize("jit, static", [(False, True), (True, True), (False, False)])
def test_pinned_dense_sums_match_per_example_gradients(k, n, jit, static):
  rng = np.random.RandomState(k)
  b = 150   # 19 blocks of 8 rows (static: the blocks' sums small), or 3 of 64, the last padded
  x = rng.randn(b, k).astype("float32")
  dz = rng.randn(b, n).astype("float32")
  c = rng.rand(b).astype("float32")
  c[[2, 77]] = 0.0
  x[2, 0], dz[77, 1] = np.inf, np.nan   # records of factor 0 whose values are not finite
  want_kernel, want_bias = _reference(np.nan_to_num(x), np.nan_to_num(dz), c)
  layer = keras.layers.Dense(n)
  layer.build((None, k))
  spec = [tf.TensorSpec([b if static else None, k]), tf.TensorSpec([b if static else None, n]),
          tf.TensorSpec([b if static else None])]
  plans = {}

  def sums(x, dz, c):
    with algebra.sum_plans() as found:
      out = dense._pinned_dense_sums(layer, x, dz, c, (True, True))
    plans.update(found)
    return out

  kernel, bias = tf.function(sums, jit_compile=jit, input_signature=spec)(x, dz, c)
  np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-5)
  assert set(plans) == {id(layer.kernel), id(layer.bias)}
  assert set(plans.values()) == {8 if static else 64}


def test_pinned_block_grows_where_the_blocks_sums_pass_the_budget():
  assert algebra.pinned_block(4096, 4 * 100, budget.CHUNK_BYTES) == 64
  assert algebra.pinned_block(32, 4 * 100, budget.CHUNK_BYTES) == 32   # one block of the whole batch
  # a 2048 x 2048 kernel (16 MiB) per block: one block's sum over the 8 MiB budget
  assert algebra.pinned_block(4096, 4 * 2048 * 2048, budget.CHUNK_BYTES) == 4096
  assert algebra.pinned_block(None, 4 * 100, budget.CHUNK_BYTES) == 64


def test_pinned_block_shrinks_where_the_blocks_sums_are_small():
  """Blocks of PINNED_LEAST rows where their sums fit in PINNED_SMALL_BYTES (a row's b - 1
  in-block roundings are charged to every row under the shifted relation), up to 64 as the
  blocks' sums grow, the budget's above; never decreasing with the rows (the block of a
  public bound covers every batch within it)."""
  small = dict(small_bytes=algebra.PINNED_SMALL_BYTES)
  assert algebra.pinned_block(8704, 4, budget.CHUNK_BYTES, **small) == 8
  assert algebra.pinned_block(4096, 4 * 320, budget.CHUNK_BYTES, **small) == 8
  assert algebra.pinned_block(640, 4 * 512 * 32, budget.CHUNK_BYTES, **small) == 40
  assert algebra.pinned_block(4096, 4 * 784 * 128, budget.CHUNK_BYTES, **small) == 205
  assert algebra.pinned_block(5, 4, budget.CHUNK_BYTES, **small) == 5
  assert algebra.pinned_block(None, 4, budget.CHUNK_BYTES, **small) == 64
  for row_bytes in (4, 4 * 320, 4 * 512 * 32, 4 * 784 * 128):
    blocks = [algebra.pinned_block(rows, row_bytes, budget.CHUNK_BYTES, **small)
              for rows in range(1, 9000, 7)]
    assert blocks == sorted(blocks)


def test_the_block_of_a_public_plan_is_that_of_its_rows():
  """Inside summation.public_plan the Dense rule's block is that of the plan's rows per chunk,
  the same for a batch of n and n + 1 rows (the clip shrink may not depend on the rows)."""
  from tf_dpiter.dp_query import summation   # pylint: disable=g-import-not-at-top
  layer = keras.layers.Dense(2048)
  layer.build((None, 512))
  seen = []
  for rows in (256, 257):
    x, dz = tf.ones([rows, 512]), tf.ones([rows, 2048])
    with summation.public_plan(640, 640), algebra.sum_plans() as plans:
      dense._pinned_dense_sums(layer, x, dz, tf.ones([rows]), (True, True))
    seen.append(plans[id(layer.kernel)])
  want = algebra.pinned_block(640, 4 * 512 * 2048, budget.CHUNK_BYTES,
                              small_bytes=algebra.PINNED_SMALL_BYTES)
  assert seen == [want, want] and want > 64


@pytest.mark.parametrize("big_first", [True, False])
def test_a_small_sum_after_a_larger_block_runs_in_blocks_of_at_most_that_one(big_first):
  """The MLP's layers (784-512-10, B = 256 rows, inside summation.public_plan(640, 640): the
  add/remove step's plan): the [512, 10] kernel's own block is 13 rows (pinned_block's
  small-bytes rule: 20 leaves); after the [784, 512] kernel reported blocks of 128 it runs in
  blocks of min(PINNED_BLOCK, 128) = 64 (algebra.raised_block). The largest block reported,
  which the step's clip shrink is charged for (clipping._with_rounding_margin), is 128 either
  way, so the shrink is the same value; the sums equal the float64 per-example sums to float32
  rounding. Before any larger block (small layer first) the small block stays 13."""
  from tf_dpiter.dp_query import summation   # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(5)
  b = 256
  big, small = keras.layers.Dense(512), keras.layers.Dense(10)
  big.build((None, 784))
  small.build((None, 512))
  data = {id(big): (rng.randn(b, 784).astype("float32"), rng.randn(b, 512).astype("float32")),
          id(small): (rng.randn(b, 512).astype("float32"), rng.randn(b, 10).astype("float32"))}
  c = rng.rand(b).astype("float32")
  c[3] = 0.0
  order = [big, small] if big_first else [small, big]
  spec = [tf.TensorSpec([None])]
  plans = {}

  def sums(c):
    with summation.public_plan(640, 640), algebra.sum_plans() as found:
      out = [dense._pinned_dense_sums(layer, tf.constant(data[id(layer)][0]),
                                      tf.constant(data[id(layer)][1]), c, (True, True))
             for layer in order]
    plans.update(found)
    return out

  got = tf.function(sums, input_signature=spec)(c)
  for layer, (kernel, bias) in zip(order, got):
    want_kernel, want_bias = _reference(*data[id(layer)], c)
    np.testing.assert_allclose(kernel.numpy(), want_kernel, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(bias.numpy(), want_bias, rtol=1e-5, atol=1e-4)
  small_block = algebra.pinned_block(640, 4 * 512 * 10, budget.CHUNK_BYTES,
                                     small_bytes=algebra.PINNED_SMALL_BYTES)
  big_block = algebra.pinned_block(640, 4 * 784 * 512, budget.CHUNK_BYTES,
                                   small_bytes=algebra.PINNED_SMALL_BYTES)
  assert (small_block, big_block) == (13, 128)
  assert plans[id(big.kernel)] == plans[id(big.bias)] == big_block
  assert plans[id(small.kernel)] == plans[id(small.bias)] == (64 if big_first else 13)
  assert max(plans.values()) == big_block   # the shrink's block: unchanged
