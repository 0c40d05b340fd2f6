"""Source of randomness for noise and sampling (seed 002, Section 8).

Noise and sampling come from a counter-based Philox `tf.random.Generator` (Salmon et al.
2011) seeded from operating-system entropy. A fixed seed exists for tests only: with it the
output is reproducible, hence not private, and a warning says so.
"""

import warnings

import tensorflow as tf


class NotPrivateSeedWarning(UserWarning):
  """A DP mechanism was given a fixed seed: its output is reproducible, not private."""


def make_generator(seed=None) -> tf.random.Generator:
  """Returns a Philox generator: OS entropy if `seed` is None, else seeded (tests only)."""
  if seed is None:
    return tf.random.Generator.from_non_deterministic_state(alg="philox")
  warnings.warn(
      f"seed={seed!r} given to a DP mechanism: its noise is reproducible and the output "
      "is NOT differentially private. Use a seed for tests only.",
      NotPrivateSeedWarning, stacklevel=3)
  return tf.random.Generator.from_seed(int(seed), alg="philox")


_TWO_PI = 6.283185307179586


def normal(generator: tf.random.Generator, shape, dtype=tf.float32) -> tf.Tensor:
  """Standard normal samples of `shape` drawn from `generator`.

  float64 uses `generator.normal`. Other float dtypes use the Box-Muller
  transform (Box & Muller 1958) on the generator's raw Philox bits, computed in
  float32: one 64-bit draw gives u1 = (lo + 1/2) 2^-32 in (0, 1) and
  theta = 2 pi hi 2^-32, hence the pair r cos(theta), r sin(theta) with
  r = sqrt(-2 ln u1). This is the transform TF's own normal kernel uses, but
  vectorized: it measured faster than `generator.normal` on CPU (BENCHMARKS.md).
  |z| <= sqrt(2 * 33 ln 2) = 6.76, the tail floor of a 2^-33 uniform.
  """
  dtype = tf.as_dtype(dtype)
  if dtype == tf.float64 or not dtype.is_floating:
    return generator.normal(shape, dtype=dtype)
  shape = tf.convert_to_tensor(shape, tf.int32)
  n = tf.reduce_prod(shape)
  bits = generator.uniform_full_int([(n + 1) // 2], dtype=tf.int64)
  lo = tf.bitwise.bitwise_and(bits, 0xFFFFFFFF)
  hi = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 32), 0xFFFFFFFF)
  u1 = (tf.cast(lo, tf.float32) + 0.5) * (2.0 ** -32)
  theta = tf.cast(hi, tf.float32) * (_TWO_PI * 2.0 ** -32)
  r = tf.sqrt(-2.0 * tf.math.log(u1))
  z = tf.reshape(tf.stack([r * tf.cos(theta), r * tf.sin(theta)]), [-1])[:n]
  return tf.cast(tf.reshape(z, shape), dtype)
