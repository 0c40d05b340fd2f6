"""Laplace sum query for local DP (Dwork & Roth, Section 3.3).

Records are clipped to L1 norm C; the sum gets Laplace(0, b) noise per coordinate.
Pure epsilon = C / b; the dp-accounting noise multiplier is b / C.
"""

import collections

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization


def clip_by_l1_norm(record, l1_norm_clip):
  """x * min(1, C / ||x||_1), the L1 norm taken over the whole nest.

  Args:
    record: a nest of tensors.
    l1_norm_clip: C > 0.

  Returns:
    the clipped nest.
  """
  leaves = tf.nest.flatten(record)
  norm = tf.add_n([tf.reduce_sum(tf.abs(tf.cast(x, tf.float32))) for x in leaves])
  factor = tf.minimum(1.0, tf.cast(l1_norm_clip, tf.float32) / tf.maximum(norm, 1e-30))
  return tf.nest.map_structure(lambda x: x * tf.cast(factor, x.dtype), record)


def laplace_noise(generator, shape, scale, dtype=tf.float32):
  """Laplace(0, scale) samples of `shape`: b (E1 - E2), E1, E2 independent standard exponentials.

  The exponentials come from `randomness.exponential` (float32) or, for a float64 `dtype`,
  `randomness.exponential64`: sampled in the output's width (float32 noise cast to float64
  would lie on float32's lattice and leave a float64 sum's low bits readable: Mironov, "On
  Significance of the Least Significant Bits for Differential Privacy", Section 3). Exact in
  the tail: |noise| unbounded, as pure epsilon requires.

  Args:
    generator: a tf.random.Generator.
    shape: the output shape.
    scale: b >= 0.
    dtype: the output dtype (float64: sampled in float64; any other: in float32, then cast).

  Returns:
    a tensor of `shape` and `dtype`.
  """
  shape = tf.convert_to_tensor(shape, tf.int32)
  n = tf.reduce_prod(shape)
  if tf.as_dtype(dtype) == tf.float64:
    e = randomness.exponential64(generator, 2 * n)
  else:
    e = randomness.exponential(generator, 2 * n)
  noise = (e[:n] - e[n:]) * tf.cast(scale, e.dtype)
  return tf.cast(tf.reshape(noise, shape), dtype)


@serialization.register_query()
class LaplaceSumQuery(dp_query.SumAggregationDPQuery):
  """Sum of records clipped to L1 norm C, plus Laplace(0, b) per coordinate.

  Pure epsilon = C / b per sample (Dwork and Roth, "The Algorithmic Foundations of
  Differential Privacy", Theorem 3.6); event LaplaceSumEvent(C, b).

  Args:
    l1_norm_clip: C > 0, finite.
    scale: b > 0, finite.
    seed: fixes the noise (tests only: not private).

  Raises:
    PrivacyConfigError: C or b not positive and finite.
  """

  _GlobalState = collections.namedtuple("_GlobalState", ["l1_norm_clip", "scale"])

  def __init__(self, l1_norm_clip, scale, seed=None):
    validation.check_positive("l1_norm_clip", l1_norm_clip, allow_inf=False)
    validation.check_positive("scale", scale, allow_inf=False)
    self._l1_norm_clip = l1_norm_clip
    self._scale = scale
    self._seed = seed
    self._generator = randomness.make_generator(seed)

  def get_config(self):
    p = serialization.plain
    return {"l1_norm_clip": p(self._l1_norm_clip), "scale": p(self._scale), "seed": p(self._seed)}

  def initial_global_state(self):
    return self._GlobalState(tf.cast(self._l1_norm_clip, tf.float32),
                             tf.cast(self._scale, tf.float32))

  def derive_sample_params(self, global_state):
    return global_state.l1_norm_clip

  def preprocess_record(self, params, record):
    return clip_by_l1_norm(record, params)

  def get_noised_result(self, sample_state, global_state):
    def _add(v):
      # Noise and sum in float32 (float64 stays float64), cast back afterwards.
      v = tf.convert_to_tensor(v)
      wide = tf.float64 if v.dtype == tf.float64 else tf.float32
      noised = tf.cast(v, wide) + laplace_noise(self._generator, tf.shape(v),
                                                global_state.scale, wide)
      return tf.cast(noised, v.dtype)
    result = tf.nest.map_structure(_add, sample_state)
    return result, global_state, (events_lib.LaplaceSumEvent(global_state.l1_norm_clip,
                                                             global_state.scale),)
