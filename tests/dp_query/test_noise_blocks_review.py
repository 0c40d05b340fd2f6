"""Review of `add_gaussian_noise` on leaves that cross draws, with the draw made small
(`BLOCK_VALUES` = 512, and `JOIN_BLOCKS` = 2 where the module has it) so that every way a leaf
is noised is exercised on small tensors: within one draw, across draws joined, across more
draws written in place, aligned and unaligned sizes, 16-bit leaves, in a graph and under XLA.

Each leaf holds values v_i = (i mod 997) + leaf offset, so a noise part added at
the wrong place, a part dropped, duplicated or put back in the wrong order shows as a
residual out - v of at least 1 = 10 sigma (sigma = 0.1). Over 30 runs of one traced step:
the residuals are N(0, sigma^2) (KS and variance); on zero leaves no pair of consecutive
noise values repeats within or across steps (no value of a draw serves twice); lag and step correlations of the
values and their squares vanish.
"""

import math

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_dpiter.dp_query import gaussian_query

# Nightly tier (-m slow): the fresh-values check under XLA (graph stays); the 16-bit
# draws one dtype per mode.
SLOW_CASES = {
    "test_every_leaf_gets_its_own_fresh_normal_values[xla]",
    "test_16_bit_leaves_across_draws[dtype0-xla]",
    "test_16_bit_leaves_across_draws[dtype1-graph]"}

SIGMA = 0.1
BLOCK = 512
# within a draw, across 2 draws (joined), across > 2 draws (in place), unaligned, aligned
_SIZES = [1, 15, 16, 17, 511, 512, 513, 300, 700, 1000, 33, 2049, 5, 1500]


def _leaves(dtype):
  out = []
  base = 0
  period = 997 if dtype == tf.float32 else 61   # 16-bit: values < 64 (spacing <= 1/4)
  for n in _SIZES:
    v = (np.arange(n) % period + base % 3).astype(np.float32)
    base += 1
    shape = [n] if n % 5 else [5, n // 5]
    out.append(v.reshape(shape))
  return [tf.constant(v, dtype) for v in out]


def _noiser(mode, monkeypatch):
  """One traced (or XLA-compiled) noise step over the leaves it is given, with the draw made
  small; the values' and the zero leaves' runs share it (same shapes: one trace, one compile)."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", BLOCK)
  monkeypatch.setattr(gaussian_query, "JOIN_BLOCKS", 2, raising=False)
  gen = tf.random.Generator.from_seed(17, alg="philox")
  fn = lambda leaves: gaussian_query.add_gaussian_noise(gen, leaves, SIGMA)  # noqa: E731
  if mode != "eager":
    fn = tf.function(fn, jit_compile=(mode == "xla"), autograph=False)
  return fn


def _residuals(fn, leaves, steps):
  dtype = leaves[0].dtype
  wants = [np.asarray(v.numpy(), np.float64) for v in leaves]
  out = []
  for _ in range(steps):
    got = fn(leaves)
    assert [g.dtype for g in got] == [dtype] * len(leaves)
    assert [tuple(g.shape) for g in got] == [tuple(v.shape) for v in leaves]
    out.append([np.asarray(g.numpy(), np.float64) - w for g, w in zip(got, wants)])
  return out


def _corr(a, b):
  a, b = a - a.mean(), b - b.mean()
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_every_leaf_gets_its_own_fresh_normal_values(mode, monkeypatch):
  fn = _noiser(mode, monkeypatch)
  values = _leaves(tf.float32)
  steps = _residuals(fn, values, 30)
  flat = [np.concatenate([r.ravel() for r in leaves]) for leaves in steps]
  z = np.concatenate(flat) / SIGMA
  # every residual is noise (a misplaced part would leave a residual >= 1 / sigma = 10)
  assert np.max(np.abs(z)) < 7.0, np.max(np.abs(z))
  n = z.size
  assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(n)
  assert abs(float(np.mean(z * z)) - 1.0) < 5 * math.sqrt(2.0 / n)
  # per leaf (pooled over steps): variance sigma^2
  for j, size in enumerate(_SIZES):
    zj = np.concatenate([leaves[j].ravel() for leaves in steps]) / SIGMA
    assert abs(float(np.mean(zj * zj)) - 1.0) < 6 * math.sqrt(2.0 / zj.size), (size, zj.size)
  # no value of a draw serves twice: no pair of consecutive float32 values repeats (on
  # zero leaves: the noise itself, unrounded; the same traced step, 30 steps further on)
  keys = []
  for noise in _residuals(fn, [tf.zeros_like(v) for v in values], 30):
    for r in noise:
      w = r.ravel().astype(np.float32).view(np.uint32).astype(np.uint64)
      if w.size >= 2:
        keys.append(w[:-1] << np.uint64(32) | w[1:])
  keys = np.concatenate(keys)
  assert np.unique(keys).size == keys.size
  assert fn.experimental_get_tracing_count() == 1   # values and zeros: one traced step
  limit = 5 / math.sqrt(flat[0].size)
  for lag in (1, 16, BLOCK // 2, BLOCK, BLOCK + 1):
    a, b = flat[0][:-lag], flat[0][lag:]
    assert abs(_corr(a, b)) < 5 / math.sqrt(a.size) and abs(_corr(a * a, b * b)) < 5 / math.sqrt(
        a.size), lag
  for s in range(1, 4):
    assert abs(_corr(flat[0], flat[s])) < limit
    assert abs(_corr(flat[0] ** 2, flat[s] ** 2)) < limit


@pytest.mark.parametrize("mode", ["graph", "xla"])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_16_bit_leaves_across_draws(mode, dtype, monkeypatch):
  """16-bit leaves (values < 64: spacing 2^-5 float16, 2^-2 bfloat16): every residual is
  the noise rounded (below 7 sigma plus half a spacing; a misplaced part leaves >= 1);
  float16's residuals have variance sigma^2 (plus the rounding's spacing^2 / 12)."""
  steps = _residuals(_noiser(mode, monkeypatch), _leaves(dtype), 10)
  z = np.concatenate([r.ravel() for leaves in steps for r in leaves])
  half_spacing = 2.0 ** -6 if dtype == tf.float16 else 2.0 ** -3
  assert np.max(np.abs(z)) <= 7 * SIGMA + half_spacing, np.max(np.abs(z))
  if dtype == tf.float16:
    ratio = float(np.mean(z * z)) / SIGMA ** 2
    assert abs(ratio - 1.0) < 5 * math.sqrt(2.0 / z.size) + 0.02, ratio
