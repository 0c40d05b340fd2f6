"""Review: the float32 Gram contraction's rounding count holds under XLA only while its rows
stay a dot.

`algebra.bounded_gram_contraction` (float32 alone) bounds the rounding of sum_{t,s} ga_ts
gb_ts by gamma_{2T+1} sum |ga_ts gb_ts|: T row sums of T products, then a sum of the T rows
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Secs. 3.1 and 4.2). XLA
merges two consecutive reductions into one (measured on TF 2.21 CPU: reduce_sum(reduce_sum(
ga * gb, 2), 1) at T = 128 becomes 32 x 32 reduce-windows, up to 1,024 roundings per product),
which that count does not cover; under XLA the rows must stay the dot
`einsum("bts,bts->bt")`. The compiled function's optimized HLO must hold that [B, T] dot of
the two Grams (batch dims {0, 1}, contracting {2}); a compiler that fuses it fails here.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra


@pytest.mark.parametrize("t", [30, 128])
def test_xla_keeps_the_gram_contraction_rows_a_dot(t):
  rng = np.random.RandomState(0)
  a = tf.constant(rng.normal(size=(4, t, 7)), tf.float32)
  b = tf.constant(rng.normal(size=(4, t, 5)), tf.float32)
  ga, gb = tf.matmul(a, a, transpose_b=True), tf.matmul(b, b, transpose_b=True)

  @tf.autograph.experimental.do_not_convert
  def fn(ga, gb):
    na, nb = tf.sqrt(tf.linalg.diag_part(ga)), tf.sqrt(tf.linalg.diag_part(gb))
    return algebra.bounded_gram_contraction(ga, gb, na, nb, 7, 5)

  hlo = tf.function(fn, jit_compile=True).experimental_get_compiler_ir(ga, gb)(
      stage="optimized_hlo")
  rows = [line for line in hlo.splitlines()
          if f"f32[4,{t}]" in line and " dot(" in line and "lhs_batch_dims={0,1}" in line
          and "lhs_contracting_dims={2}" in line]
  assert rows, hlo
