"""The noise sampler's one-draw API (`randomness.padded_normal`) and the per-leaf noise of
`gaussian_query.add_gaussian_noise`: law N(0, sigma^2) per leaf, no value used twice, every
size and dtype, static and unknown shapes, graph and XLA.

Statistical tolerances come from the sample size: Kolmogorov-Smirnov critical value
1.95 / sqrt(N) (level 0.001), standard deviations within 5 standard errors sigma sqrt(2 / N).
"""

import math

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness

# Nightly tier (-m slow): padded_normal's cases beyond one per mode and per size: the ragged
# size (100,003) stays in eager and XLA, the multiple of 32 (60,000) in a tf.function.
SLOW_CASES = {
    "test_padded_normal_is_normal_with_its_stddev[60000-2.5-eager]",
    "test_padded_normal_is_normal_with_its_stddev[100003-1.0-function]",
    "test_padded_normal_is_normal_with_its_stddev[60000-2.5-xla]"}


def _ks_normal(z, sigma):
  z = np.asarray(z, np.float64).ravel()
  assert stats.kstest(z / sigma, "norm").statistic < 1.95 / math.sqrt(z.size)
  assert abs(z.std() - sigma) < 5 * sigma * math.sqrt(2.0 / z.size)


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("size, sigma", [(100_003, 1.0), (60_000, 2.5)])
def test_padded_normal_is_normal_with_its_stddev(mode, size, sigma):
  gen = tf.random.Generator.from_seed(21, alg="philox")
  fn = lambda: randomness.padded_normal(gen, size, sigma)  # noqa: E731
  if mode != "eager":
    fn = tf.function(fn, jit_compile=(mode == "xla"))
  z = fn().numpy()
  assert z.dtype == np.float32 and z.ndim == 1 and z.size >= size and z.size % 32 == 0
  assert np.all(np.isfinite(z))
  _ks_normal(z, sigma)   # every value of the padded buffer is a normal, not only the first
  assert len(np.unique(z)) > 0.99 * z.size


@pytest.mark.parametrize("shape", [[0], [1], [3], [33], [2, 17]])
def test_normal_small_and_empty_shapes(shape):
  gen = tf.random.Generator.from_seed(2, alg="philox")
  z = tf.function(lambda: randomness.normal(gen, shape))()
  assert z.shape == tuple(shape) and z.dtype == tf.float32
  assert np.all(np.isfinite(z.numpy()))


def test_zero_stddev_gives_zero_noise():
  gen = tf.random.Generator.from_seed(2, alg="philox")
  assert not np.any(randomness.padded_normal(gen, 1000, 0.0).numpy())


def test_normal_with_unknown_shape_in_graph():
  """The shape known only at run time (refinement capacity a tensor): law unchanged."""
  gen = tf.random.Generator.from_seed(8, alg="philox")
  fn = tf.function(lambda x: randomness.normal(gen, tf.shape(x)),
                   input_signature=[tf.TensorSpec([None], tf.float32)])
  z = fn(tf.zeros([200_001])).numpy()
  assert z.shape == (200_001,)
  _ks_normal(z, 1.0)


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_add_gaussian_noise_per_leaf(secure, mode):
  """Leaves of aligned and unaligned sizes and of 16-bit dtypes get their own N(0, sigma^2)
  values (each leaf within tolerance), and no noise value appears in two places."""
  gen = randomness.make_generator(secure=True) if secure else tf.random.Generator.from_seed(
      4, alg="philox")
  shapes = [(300, 64), (7,), (1000, 13), (64,), (20_001,)]
  dtypes = [tf.float32, tf.float32, tf.bfloat16, tf.float16, tf.float32]
  leaves = [tf.zeros(s, d) for s, d in zip(shapes, dtypes)]
  fn = lambda: gaussian_query.add_gaussian_noise(gen, leaves, 3.0)  # noqa: E731
  if mode == "function":
    fn = tf.function(fn)
  out = fn()
  values = []
  for leaf, noised in zip(leaves, out):
    assert noised.shape == leaf.shape and noised.dtype == leaf.dtype
    z = tf.cast(noised, tf.float64).numpy().ravel()
    if z.size >= 1000:
      tol = 5 * 3.0 * math.sqrt(2.0 / z.size) + (0.01 * 3.0 if leaf.dtype != tf.float32 else 0)
      assert abs(z.std() - 3.0) < tol
    if leaf.dtype == tf.float32:
      values.append(z)
  values = np.concatenate(values)
  assert len(np.unique(values)) > 0.999 * values.size


def test_add_gaussian_noise_float64_leaves():
  gen = tf.random.Generator.from_seed(6, alg="philox")
  out = gaussian_query.add_gaussian_noise(gen, [tf.zeros([50_000], tf.float64),
                                                tf.zeros([3], tf.float32)], 0.5)
  assert out[0].dtype == tf.float64 and out[1].dtype == tf.float32
  _ks_normal(out[0].numpy(), 0.5)


@pytest.mark.parametrize("mode", ["xla", "unknown_size"])
def test_exponential_refinement_in_xla_and_with_unknown_size(mode):
  """b = 8 bits, refine_below = 16: 1/16 of the values take the exact refinement (about
  1,250 of 20,000: several rounds of the fixed capacity when the size is unknown, 64 each).
  KS against Exp(1) and the mass beyond 8 ln 2 (the first recursion) within 5 s.e."""
  gen = tf.random.Generator.from_seed(13, alg="philox")
  n = 20_000
  if mode == "xla":
    e = tf.function(lambda: randomness.exponential(gen, n, 8, 16), jit_compile=True)()
  else:
    fn = tf.function(lambda x: randomness.exponential(gen, tf.size(x), 8, 16),
                     input_signature=[tf.TensorSpec([None], tf.float32)])
    e = fn(tf.zeros([n]))
  e = e.numpy().astype(np.float64)
  assert e.shape == (n,) and np.all(e >= 0) and np.all(np.isfinite(e))
  assert stats.kstest(e, "expon").statistic < 1.95 / math.sqrt(n)
  p = 2.0 ** -8
  assert abs(np.mean(e > 8 * math.log(2)) - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_add_gaussian_noise_leaves_of_unknown_size():
  """Leaf sizes known only at run time (one static, one not): each gets its own noise."""
  gen = tf.random.Generator.from_seed(9, alg="philox")
  fn = tf.function(lambda a: gaussian_query.add_gaussian_noise(gen, [a, tf.zeros([5])], 2.0),
                   input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  big, small = fn(tf.zeros([40_000, 3]))
  assert big.shape == (40_000, 3) and small.shape == (5,)
  _ks_normal(big.numpy(), 2.0)
  assert not np.isin(small.numpy(), big.numpy()).any()


def test_op_determinism_is_refused_with_the_librarys_error():
  """TensorFlow refuses an OS-entropy generator under op determinism (a RuntimeError); the DP
  noise's generator says why and what to do, in the library's exception family."""
  from tensorflow.python.framework import config as tf_config   # pylint: disable=g-import-not-at-top
  from tf_dpiter.errors import PrivacyConfigError   # pylint: disable=g-import-not-at-top
  tf_config.enable_op_determinism()
  try:
    with pytest.raises(PrivacyConfigError, match="enable_op_determinism.*secure_mode=True"):
      randomness.make_generator()
    assert isinstance(randomness.make_generator(secure=True), randomness.SecureRandom)
  finally:
    tf_config.disable_op_determinism()
  assert isinstance(randomness.make_generator(), tf.random.Generator)


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_float64_laplace_is_laplace_and_off_the_float32_lattice(mode):
  """laplace_noise(dtype=float64) samples in float64: KS against Laplace(0, b), and under 1 %
  of the values equal to their float32 rounding (float32 noise cast to float64 is 100 %: its
  support is float32's lattice, which leaves a float64 sum's low bits readable, Mironov,
  "On Significance of the Least Significant Bits for Differential Privacy", Section 3)."""
  from tf_dpiter.dp_query import laplace_query  # pylint: disable=g-import-not-at-top
  gen = tf.random.Generator.from_seed(5, alg="philox")
  n, b = 40_000, 0.3

  def draw(dtype):
    fn = lambda: laplace_query.laplace_noise(gen, [n], b, dtype)
    return (tf.function(fn, jit_compile=True)() if mode == "xla" else fn()).numpy()

  x = draw(tf.float64)
  assert x.dtype == np.float64
  assert stats.kstest(x / b, "laplace").statistic < 1.95 / math.sqrt(n)
  on_lattice = lambda v: np.mean(v.astype(np.float32).astype(np.float64) == v)
  assert on_lattice(x) < 0.01
  assert on_lattice(draw(tf.float32).astype(np.float64)) == 1.0   # the float32 width's law


class _ZeroFirst(randomness.SecureRandom):
  """Words 0 on the first call (j = 0 for every value: the 2^-53 event), os.urandom after."""

  def __init__(self):
    self.calls = 0

  def words(self, size):
    self.calls += 1
    return tf.zeros([size], tf.int64) if self.calls == 1 else super().words(size)


def test_float64_exponential_restarts_memorylessly_at_zero_words():
  """j = 0 (U's 53 bits all zero): E = 53 ln 2 + E', E' a fresh draw, never -ln(2^-54)."""
  gen = _ZeroFirst()
  e = randomness.exponential64(gen, 5).numpy()
  assert gen.calls == 2
  assert np.all(e > 53 * math.log(2)) and np.all(e < 53 * math.log(2) + 60)
  assert len(set(e.tolist())) == 5
