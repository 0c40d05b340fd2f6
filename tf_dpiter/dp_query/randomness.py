"""Source of randomness for noise and sampling (McMahan et al. 2018, Section 8).

Noise and sampling come from a counter-based Philox `tf.random.Generator` (Salmon et al.
2011) seeded from operating-system entropy. A fixed seed exists for tests only: with it the
output is reproducible, hence not private, and a warning says so.
"""

import functools
import os
import warnings

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError


class NotPrivateSeedWarning(UserWarning):
  """A DP mechanism was given a fixed seed: its output is reproducible, not private."""


class SecureRandom:
  """Secure mode: every bit from `os.urandom`; `normal` returns (z1 + z2) / sqrt(2) of two
  Box-Muller draws (Mironov, "On Significance of the Least Significant Bits for Differential
  Privacy"). Runs in `tf.numpy_function` (not under XLA)."""

  def words(self, size):
    """`size` (an int or scalar tensor) uniform 64-bit words from os.urandom: int64 [size]."""
    def draw(n):
      return np.frombuffer(os.urandom(8 * int(n)), dtype=np.int64).copy()
    out = tf.numpy_function(draw, [tf.cast(size, tf.int64)], tf.int64, stateful=True)
    return tf.reshape(out, [size])


def make_generator(seed=None, secure=False):
  """The random source of a DP mechanism (McMahan et al. 2018, Section 8).

  Args:
    seed: None: a Philox generator seeded from OS entropy; an int: seeded Philox (tests only:
      warns NotPrivateSeedWarning, the output is reproducible and NOT private).
    secure: return a `SecureRandom` (os.urandom for every bit; no seed allowed).

  Returns:
    a tf.random.Generator (alg="philox"), or a SecureRandom.

  Raises:
    ParameterValueError: a seed with secure=True.
    PrivacyConfigError: no seed while TensorFlow's op determinism is on
      (`tf.config.experimental.enable_op_determinism`), which refuses a generator seeded
      from OS entropy: reproducible noise would not be private.
  """
  if secure:
    if seed is not None:
      raise ParameterValueError(f"secure_mode draws from os.urandom and takes no seed, got seed={seed!r}")
    return SecureRandom()
  if seed is None:
    try:
      return tf.random.Generator.from_non_deterministic_state(alg="philox")
    except RuntimeError as e:
      if "determinism" not in str(e):
        raise
      raise PrivacyConfigError(
          "the DP noise must be drawn from OS entropy, and "
          "tf.config.experimental.enable_op_determinism() is on, under which TensorFlow "
          "refuses such a generator (reproducible noise would not be private). Train without "
          "op determinism, or pass secure_mode=True (every noise bit from os.urandom)") from e
  warnings.warn(
      f"seed={seed!r} given to a DP mechanism: its noise is reproducible and the output "
      "is NOT differentially private. Use a seed for tests only.",
      NotPrivateSeedWarning, stacklevel=3)
  return tf.random.Generator.from_seed(int(seed), alg="philox")


_TWO_PI = 6.283185307179586
_LN2 = 0.6931471805599453
_ALIGN = 16  # float32/uint32 entries per 64 bytes: slices at multiples of it are buffer views


def _static_or_tensor(x):
  """x as a Python int when its value is known while tracing, else the int32 tensor."""
  value = tf.get_static_value(x)
  return int(value) if value is not None else x


def _uint32_words(generator, shape):
  """Uniform uint32 words of `shape` (ints or int32 tensors) from `generator` (a
  tf.random.Generator or a SecureRandom): ceil(count / 2) 64-bit draws, bitcast."""
  if all(isinstance(d, int) for d in shape):   # a static count: no ops to form it
    count = 1
    for d in shape:
      count *= d
  else:
    count = _static_or_tensor(tf.reduce_prod(tf.stack(shape)))
  half = (count + 1) // 2
  if isinstance(generator, SecureRandom):
    bits = generator.words(half)
  else:
    bits = _philox_words(generator, half)
  words = tf.reshape(tf.bitcast(bits, tf.uint32), [-1])
  if not isinstance(count, int) or count % 2:
    words = words[:count]
  return tf.reshape(words, shape)


# The compiled Philox draw (`_philox_words`): one XLA-compiled function per process, for one
# size, XLA_BLOCK_WORDS 64-bit words (the words of one draw of gaussian_query.BLOCK_VALUES
# noise values: BERT-base's noise stream is 26 such draws and a tail). Under XLA it takes about
# 0.74x the CPU time of TensorFlow's kernel (2^21 words: 17.5 vs 23.5 ms); it is compiled once
# (0.14 to 0.25 CPU s over the kernel's first draw, 5 processes) and reused by every trace,
# generator, step and fit call. A draw of count
# words, XLA_WORDS_FROM <= count <= XLA_BLOCK_WORDS, takes one whole block and uses its first
# count words (from 3/4 of a block the block costs less than the kernel's draw of count words).
XLA_BLOCK_WORDS = 1 << 21
XLA_WORDS_FROM = 3 << 19

_COMPILED_BLOCKS = {}   # words per block -> the process's compiled draw (one in use)


def _compiled_block():
  """The process's XLA-compiled draw of XLA_BLOCK_WORDS words from a Philox state's handle
  (`_PhiloxState.uniform_full_int`: TensorFlow's key, counter and skip), made once."""
  words = int(XLA_BLOCK_WORDS)
  fn = _COMPILED_BLOCKS.get(words)
  if fn is None:
    def block(handle):
      return _PhiloxState(handle, tf.random.Algorithm.PHILOX.value).uniform_full_int(
          [words], tf.int64)
    fn = _COMPILED_BLOCKS[words] = tf.function(
        block, jit_compile=True, autograph=False,
        input_signature=[tf.TensorSpec([], tf.resource)])
  return fn


def _philox_words(generator, count):
  """`count` uniform 64-bit words from `generator`'s Philox stream.

  In a graph, for a Philox generator outside a distribution strategy and a static count in
  [XLA_WORDS_FROM, XLA_BLOCK_WORDS], the draw is one block of XLA_BLOCK_WORDS words by the
  process's XLA-compiled function (`_compiled_block`), of which the first `count` are returned.
  XLA's Philox-4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3",
  Section 3) takes TensorFlow's key, counter and skip: word j of the block is the j-th 64-bit
  word of Philox(key, c + floor(j / 2)) from the generator's counter c, bit for bit TensorFlow's
  kernel's word j, and the generator's state moves forward by the whole block, as the kernel's
  draw of XLA_BLOCK_WORDS words moves it (tests/dp_query/test_xla_philox_words.py). The words
  count.. of the block are discarded: the next draw starts after the whole block (the counter
  only moves forward), so no word is used twice. Eager calls, other generators (SecureRandom,
  a distribution strategy's, not Philox) and other or dynamic counts take TensorFlow's kernel.
  `count`: an int or int32 scalar tensor; returns int64 [count].
  """
  if (tf.executing_eagerly() or not isinstance(count, int)
      or not XLA_WORDS_FROM <= count <= XLA_BLOCK_WORDS
      or not isinstance(generator, tf.random.Generator)
      or generator.algorithm != tf.random.Algorithm.PHILOX.value
      or getattr(generator, "_distribution_strategy", None) is not None):
    return generator.uniform_full_int([count], dtype=tf.int64)
  words = _compiled_block()(generator.state.handle)
  return words if count == XLA_BLOCK_WORDS else words[:count]


def _bucket(word, bucket_bits):
  """The top `bucket_bits` bits of uint32 words, as float32."""
  if bucket_bits < 32:
    word = tf.bitwise.right_shift(word, tf.constant(32 - bucket_bits, word.dtype))
  return tf.cast(word, tf.float32)


def exponential(generator, size, bucket_bits=32, refine_below=256):
  """`size` standard exponential samples E = -ln U (float32), exact in the tail.

  U = 2^-b (k + v), k uniform on [0, 2^b), v uniform on (0, 1): for k >= `refine_below` v is
  1/2; for 1 <= k < refine_below a fresh 32-bit v is drawn; for k = 0, E = b ln 2 + E' (the
  exponential is memoryless) with E' drawn again. No truncation: P(E > t) is exact for all t.
  `generator`: a tf.random.Generator or a SecureRandom; `size` an int or scalar tensor;
  b = `bucket_bits` in [1, 32] (32 in use; smaller values exercise the recursion in tests).

  Raises:
    ParameterValueError: bucket_bits outside [1, 32] or refine_below < 1.
  """
  if not 1 <= int(bucket_bits) <= 32 or int(refine_below) < 1:
    raise ParameterValueError(f"bucket_bits must be in [1, 32] and refine_below >= 1, got "
                              f"{bucket_bits!r}, {refine_below!r}")
  k = _bucket(_uint32_words(generator, [_static_or_tensor(size)]), int(bucket_bits))
  return -_log_uniform(generator, k, int(bucket_bits), int(refine_below))


def exponential64(generator, size):
  """`size` standard exponentials E = -ln U in float64, exact in the tail.

  U = 2^-53 (j + 1/2), j uniform on [0, 2^53) (53 bits of two 32-bit words); j = 0
  (probability 2^-53) restarts memorylessly, E = 53 ln 2 + E' with E' drawn again (a
  tf.while_loop until no j is 0: static shapes, XLA-safe). float64 throughout: float32
  exponentials cast to float64 lie on float32's lattice, and noise on a lattice added to
  float64 values leaves the values' low bits readable (Mironov, "On Significance of the
  Least Significant Bits for Differential Privacy", Section 3). Arguments as `exponential`'s.
  """
  size = _static_or_tensor(size)
  ln2_53 = 53.0 * _LN2

  def draw():
    words = tf.cast(_uint32_words(generator, [2, size]), tf.int64)
    j = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.bitwise.right_shift(words[0], 11), 32),
                              words[1])
    return -tf.math.log((tf.cast(j, tf.float64) + 0.5) * 2.0 ** -53), tf.equal(j, 0)

  e, pending = draw()
  offset = tf.zeros_like(e)

  def body(e, offset, pending):
    offset = tf.where(pending, offset + ln2_53, offset)
    e_next, zero = draw()
    return tf.where(pending, e_next, e), offset, pending & zero

  e, offset, _ = tf.while_loop(lambda e, o, p: tf.reduce_any(p), body, [e, offset, pending])
  return offset + e


def _log_uniform(generator, k, bucket_bits=32, refine_below=256):
  """ln U = -E of `exponential` given its first buckets k (float32): ln(2^-b (k + 1/2)) <= 0,
  the rare k < refine_below redrawn exactly (`_refined`, in a graph through `_shared_refined`).
  """
  size = _static_or_tensor(tf.size(k))
  capacity = _refine_capacity(size, bucket_bits, refine_below)
  log_u = tf.math.log((k + 0.5) * 2.0 ** -bucket_bits)
  refine = _shared_refined(generator, k, size, capacity, bucket_bits, refine_below)
  if refine is None:
    refine = lambda: _refined(generator, log_u, k, capacity, bucket_bits, refine_below)  # noqa: E731
  else:
    refine = functools.partial(refine, log_u)
  return tf.cond(tf.reduce_min(k) < float(refine_below), refine, lambda: log_u)


def _refine_capacity(size, bucket_bits, refine_below):
  """The values `_refined` redraws a round: from the expected number of buckets below
  refine_below, size * refine_below * 2^-b (so one round almost always), at most the size;
  64 (at most the size) when the size is a tensor."""
  if isinstance(size, int):
    return min(size, 64 + int(2 * size * refine_below * 2.0 ** -bucket_bits))
  return tf.minimum(size, 64)


class _PhiloxState:
  """A Philox generator seen through its state variable's handle: `uniform_full_int` draws the
  generator's own words and advances its state as it would."""

  _COUNTER_WORDS = 2   # Philox: a 128-bit counter (two int64 words) before the key

  def __init__(self, handle, algorithm):
    self.handle, self.algorithm = handle, algorithm

  def uniform_full_int(self, shape, dtype):
    """Uniform integers of `shape` and `dtype` over the whole range (as Generator's)."""
    shape = tf.convert_to_tensor(shape)
    alg = tf.constant(self.algorithm, tf.int32)
    counter_key = tf.raw_ops.RngReadAndSkip(
        resource=self.handle, alg=alg, delta=tf.cast(tf.reduce_prod(shape), tf.uint64))
    counter = tf.bitcast(counter_key[:self._COUNTER_WORDS], tf.uint64)
    key = tf.bitcast(counter_key[self._COUNTER_WORDS:self._COUNTER_WORDS + 1], tf.uint64)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=key, counter=counter,
                                                      alg=alg, dtype=dtype)


_SHARED = {}   # (capacity, bucket_bits, refine_below) -> the shared tf.function


def _shared_refined(generator, k, size, capacity, bucket_bits, refine_below):
  """`_refined` as one `_noinline` function shared by the process's traces (a callable of
  log_u), or None (eager, secure mode, not Philox, a strategy's generator, a dynamic size)."""
  if (tf.executing_eagerly() or not isinstance(generator, tf.random.Generator)
      or generator.algorithm != tf.random.Algorithm.PHILOX.value
      or getattr(generator, "_distribution_strategy", None) is not None
      or not isinstance(size, int) or not isinstance(capacity, int) or k.shape.rank != 1):
    return None
  key = (capacity, int(bucket_bits), int(refine_below))
  fn = _SHARED.get(key)
  if fn is None:
    def call(handle, log_u, buckets):
      state = _PhiloxState(handle, tf.random.Algorithm.PHILOX.value)
      return _refined(state, log_u, buckets, capacity, int(bucket_bits), int(refine_below))
    vector = tf.TensorSpec([None], tf.float32)
    fn = _SHARED[key] = tf.function(
        call, autograph=False, experimental_attributes={"_noinline": True},
        input_signature=[tf.TensorSpec([], tf.resource), vector, vector])
  handle = generator.state.handle
  return lambda log_u: tf.ensure_shape(fn(handle, log_u, k), [size])


def _refined(generator, log_u, k, capacity, bucket_bits, refine_below):
  """log_u with its entries whose bucket k < refine_below replaced by exact draws (-E).

  Static shapes throughout (XLA): up to `capacity` of the smallest k are taken at a time
  (`tf.math.top_k`; `_refine_capacity`), redrawn by `_exact_exponential` and written back."""

  def body(log_u, k):
    neg, where = tf.math.top_k(-k, capacity)
    small = -neg < float(refine_below)
    exact = -_exact_exponential(generator, -neg, small, bucket_bits, refine_below)
    log_u = tf.tensor_scatter_nd_update(log_u, where[:, None],
                                        tf.where(small, exact, tf.gather(log_u, where)))
    k = tf.tensor_scatter_nd_update(k, where[:, None], tf.where(small, float("inf"), -neg))
    return log_u, k

  return tf.while_loop(lambda log_u, k: tf.reduce_min(k) < float(refine_below), body,
                       [log_u, k])[0]


def _exact_exponential(generator, k, pending, bucket_bits, refine_below):
  """E for the buckets k < refine_below where `pending`: E = o + b ln 2 - ln(k + v), v a
  fresh 32-bit uniform, o = b ln 2 per k = 0 met (memoryless restart with a fresh bucket)."""
  b_ln2 = float(bucket_bits) * _LN2
  size = _static_or_tensor(tf.size(k))
  e = tf.zeros_like(k)
  offset = tf.zeros_like(k)

  def body(e, k, offset, pending):
    words = _uint32_words(generator, [2, size])
    v = (tf.cast(words[0], tf.float32) + 0.5) * (2.0 ** -32)
    e = tf.where(pending & (k > 0.0), offset + b_ln2 - tf.math.log(k + v), e)
    zero = pending & tf.equal(k, 0.0)
    offset = tf.where(zero, offset + b_ln2, offset)
    k_next = _bucket(words[1], bucket_bits)
    e = tf.where(zero, offset + b_ln2 - tf.math.log(k_next + 0.5), e)
    k = tf.where(zero, k_next, k)
    return e, k, offset, zero & (k_next < float(refine_below))

  e, _, _, _ = tf.while_loop(lambda e, k, o, p: tf.reduce_any(p), body, [e, k, offset, pending])
  return e


def int64_words(generator, count):
  """`count` (a Python int) uniform 64-bit words from `generator` (a tf.random.Generator or a
  SecureRandom): int64 [count]. The generator's state moves forward past them."""
  if isinstance(generator, SecureRandom):
    return generator.words(count)
  return generator.uniform_full_int([count], dtype=tf.int64)


def normal(generator: tf.random.Generator, shape, dtype=tf.float32) -> tf.Tensor:
  """Standard normal samples of `shape` drawn from `generator`, with no truncation.

  float64 uses `generator.normal`; other dtypes Box-Muller (Box and Muller, "A Note on the
  Generation of Random Normal Deviates") in float32: r cos(theta), r sin(theta), r = sqrt(2 E)
  with E from `exponential` (untruncated tail), theta = 2 pi h 2^-32. `generator`: a
  tf.random.Generator or a SecureRandom; `shape` a list or int32 tensor.
  """
  dtype = tf.as_dtype(dtype)
  if not isinstance(generator, SecureRandom) and (dtype == tf.float64 or not dtype.is_floating):
    return generator.normal(shape, dtype=dtype)
  shape = tf.convert_to_tensor(shape, tf.int32)
  size = _static_or_tensor(tf.reduce_prod(shape))
  return tf.cast(tf.reshape(padded_normal(generator, size)[:size], shape), dtype)


def padded_normal(generator, size, stddev=None):
  """At least `size` float32 N(0, stddev^2) values: Box-Muller on 32-bit words (see `normal`).

  (sigma r cos(theta), sigma r sin(theta)) for m pairs, m = ceil(size / 2) rounded up to a
  multiple of 16 (aligned slices are views); all 2m values are i.i.d. `generator` as in
  `normal`; `size` an int or int32 scalar tensor; `stddev` a number or scalar tensor (None: 1).
  """
  return tf.concat(padded_normal_halves(generator, size, stddev), 0)


def padded_normal_halves(generator, size, stddev=None):
  """`padded_normal(generator, size, stddev)`'s values as its two halves, each float32 [m]
  (2m >= size, m a multiple of 16): value v is halves[0][v] for v < m, else halves[1][v - m]."""
  if isinstance(generator, SecureRandom):
    (c1, s1), (c2, s2) = _box_muller(generator, size), _box_muller(generator, size)
    scale = 0.5 ** 0.5 if stddev is None else tf.cast(stddev, tf.float32) * 0.5 ** 0.5
    return (c1 + c2) * scale, (s1 + s2) * scale
  return _box_muller(generator, size, stddev)


def _box_muller(generator, size, stddev=None):
  """`padded_normal_halves` for one Box-Muller draw from any source (formula in
  `padded_normal`)."""
  pairs = -(-((size + 1) // 2) // _ALIGN) * _ALIGN
  radius_words, angle_words = tf.unstack(_uint32_words(generator, [2, pairs]))
  r = tf.sqrt(_log_uniform(generator, _bucket(radius_words, 32)) * -2.0)
  if stddev is not None:
    r = r * tf.cast(stddev, tf.float32)
  theta = tf.cast(angle_words, tf.float32) * (_TWO_PI * 2.0 ** -32)
  return r * tf.cos(theta), r * tf.sin(theta)
