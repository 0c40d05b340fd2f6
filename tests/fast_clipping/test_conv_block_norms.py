"""rules/conv.py's squared norms from block Euclidean norms (`_block_norms_sqr_sums`, one-row
per-example forms outside XLA): at least (1 - u)^(H + 1) times the exact float64 sum of the
float32 rows' squares with H the depth it notes (the clip margin's premise,
algebra.note_norm_depth), close to it from above too, and its square roots correctly
rounded on single-entry blocks (the noted roundings cover 2 units in the last place)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import conv

U = 2.0 ** -24


@pytest.mark.parametrize("scale", ["normal", "wide", "cancel"])
def test_block_norms_lower_bound_the_exact_sum(scale):
  rng = np.random.default_rng(3)
  g = rng.normal(size=(33, 8192))
  if scale == "wide":
    g *= 10.0 ** rng.uniform(-20, 15, size=g.shape)
  if scale == "cancel":   # one large entry per row, the rest tiny
    g *= 1e-6
    g[:, 5] = 1e3
  g = g.astype(np.float32)
  with algebra.norm_depths() as record:
    got = tf.function(lambda t: conv._block_norms_sqr_sums(t))(tf.constant(g)).numpy()
  depth = max(record["sums"])
  assert depth == summation.square_sum_depth(8192) + conv._BLOCK_NORM_ROUNDINGS
  exact = np.sum(np.square(g.astype(np.float64)), axis=1)
  assert np.all(got >= exact * (1 - U) ** (depth + 1))
  np.testing.assert_allclose(got, exact, rtol=1e-5)


def test_block_norm_square_roots_are_correctly_rounded():
  """A block with one nonzero entry x: its norm is the float32 square root of fl(x^2)."""
  rng = np.random.default_rng(4)
  x = (rng.uniform(0.5, 2.0, size=20000) * 2.0 ** rng.integers(-40, 40, size=20000))
  x = x.astype(np.float32)
  rows = np.zeros((x.size, 64), np.float32)
  rows[:, 7] = x
  got = tf.math.reduce_euclidean_norm(tf.constant(rows), axis=1).numpy()
  want = np.sqrt(np.square(x, dtype=np.float32), dtype=np.float32)
  np.testing.assert_array_equal(got, want)


def test_one_row_forms_fuse_outside_xla_only():
  assert conv._fuses_squares(1, 8192)
  assert not conv._fuses_squares(64, 16)      # the depthwise form's rows
  assert not conv._fuses_squares(1, 64)       # one block: the einsum of pinned_row_sums
  assert not conv._fuses_squares(1, 100)      # not whole blocks
  assert not conv._fuses_squares(1, None)

  @tf.function(jit_compile=True)
  def under_xla(t):
    assert not conv._fuses_squares(1, 8192)
    return t

  under_xla(tf.zeros([1]))
