"""The Gaussian query's noise stream cut into its leaves' pieces (`gaussian_query._stream_pieces`):
one split per half of a draw at the aligned boundaries (views of the draw's buffer), a slice
only for a piece off the alignment, and the leaves get exactly the stream's consecutive values
(the same draws for a seed as a reference that draws the blocks itself)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness


def _halves(m):
  """Two distinct float32 halves [m] (value v of the draw is v itself)."""
  return tf.range(m, dtype=tf.float32), tf.range(m, 2 * m, dtype=tf.float32)


@pytest.mark.parametrize("spans", [
    [(0, 64)],                                  # one piece, the whole first half
    [(0, 16), (16, 48), (48, 80), (80, 128)],   # aligned, one crossing m = 64
    [(0, 32), (32, 35), (35, 64), (64, 101)],   # unaligned pieces, the last draw partial
    [(0, 128)],                                 # one piece across both halves
])
def test_pieces_are_the_draws_consecutive_values(spans):
  """Each (lo, hi) gets values [lo, hi) of the draw, in eager mode and in a traced function."""
  halves = _halves(64)
  want = [np.arange(lo, hi, dtype=np.float32) for lo, hi in spans]
  eager = gaussian_query._stream_pieces(halves, spans)  # pylint: disable=protected-access
  traced = tf.function(lambda: gaussian_query._stream_pieces(halves, spans))()  # pylint: disable=protected-access
  for w, e, t in zip(want, eager, traced):
    np.testing.assert_array_equal(e.numpy(), w)
    np.testing.assert_array_equal(t.numpy(), w)


def test_aligned_pieces_are_views_and_one_split_per_half():
  """Aligned pieces of a 2 x 4 MiB draw allocate nothing (the split's outputs share the draw's
  buffer); the traced cut is one SplitV per half and no Slice."""
  m = 1 << 20
  halves = tuple(tf.identity(h) for h in _halves(m))
  spans = [(0, 4096), (4096, m - 32), (m - 32, m + 32), (m + 32, 2 * m)]
  before = tf.config.experimental.get_memory_info("CPU:0")["current"]
  pieces = gaussian_query._stream_pieces(halves, spans)  # pylint: disable=protected-access
  extra = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
  assert extra <= 4 * 64 + 4096   # the one piece across m is joined (64 values); no other copy
  assert [int(p.shape[0]) for p in pieces] == [hi - lo for lo, hi in spans]
  graph = tf.function(lambda a, b: gaussian_query._stream_pieces((a, b), spans)  # pylint: disable=protected-access
                      ).get_concrete_function(tf.TensorSpec([m]), tf.TensorSpec([m])).graph
  types = [op.type for op in graph.get_operations()]
  assert types.count("SplitV") == 2 and types.count("Slice") == 0
  assert types.count("ConcatV2") == 1


def _reference(seed, shapes, stddev, block):
  """The stream drawn block by block here: leaf i (aligned sizes first) gets values
  [o_i, o_i + size_i) of the consecutive draws' values."""
  gen = tf.random.Generator.from_seed(seed, alg="philox")
  sizes = [int(np.prod(s)) for s in shapes]
  order = sorted(range(len(shapes)), key=lambda i: sizes[i] % 16 != 0)
  total = sum(sizes)
  values = []
  for start in range(0, total, block):
    n = min(block, total - start)
    a, b = randomness.padded_normal_halves(gen, n, stddev)
    values.append(np.concatenate([a.numpy(), b.numpy()])[:n])
  stream = np.concatenate(values)
  out, o = [None] * len(shapes), 0
  for i in order:
    out[i] = stream[o:o + sizes[i]].reshape(shapes[i])
    o += sizes[i]
  return out


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_leaves_get_the_same_draws_as_the_block_by_block_reference(mode, monkeypatch):
  """Leaves of several shapes (2-D, 1-D, one unaligned, one across three draws) noised with
  blocks of 1,024 values equal the reference stream's values for the same seed (eager:
  bitwise; traced: within float32 rounding of the graph's own kernels)."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1024)
  shapes = [(48, 64), (96,), (7,), (16, 8), (640,), (3, 5)]
  leaves = [tf.zeros(s) for s in shapes]
  gen = tf.random.Generator.from_seed(31, alg="philox")
  fn = lambda: gaussian_query.add_gaussian_noise(gen, leaves, 1.7)  # noqa: E731
  out = fn() if mode == "eager" else tf.function(fn, autograph=False)()
  want = _reference(31, shapes, 1.7, 1024)
  for got, w in zip(out, want):
    assert got.shape == w.shape
    if mode == "eager":
      np.testing.assert_array_equal(got.numpy(), w)
    else:
      np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-6)
