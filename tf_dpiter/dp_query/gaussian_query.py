"""Gaussian sum query (seed 002, Section 1, step 2-3).

Each record is clipped to L2 norm S; the sum gets N(0, sigma^2 I) noise. Privacy tuple
(S, sigma); noise multiplier z = sigma / S.
"""

import collections

import tensorflow as tf

from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization
from tf_dpiter.dp_query import validation


def add_gaussian_noise(generator, structure, stddev):
  """structure + N(0, stddev^2) per coordinate, drawn from `generator`.

  The noise, stddev and the addition are computed in float32 (float64 leaves in float64)
  whatever the leaves' dtype, so a 16-bit sum gets exactly sigma (bfloat16 would apply 1.3 as
  1.296875 and draw from ~3,500 values); the noised result is cast back to the leaf's dtype
  afterwards (post-processing). Leaves of one compute dtype share a single draw.
  """
  leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(structure)]
  by_dtype = {}
  for i, v in enumerate(leaves):
    wide = tf.float64 if v.dtype == tf.float64 else tf.float32
    by_dtype.setdefault(wide, []).append(i)
  out = list(leaves)
  for dtype, idx in by_dtype.items():
    sizes = [tf.size(leaves[i]) for i in idx]
    noise = randomness.normal(generator, [tf.add_n(sizes)], dtype=dtype)
    parts = tf.split(noise, tf.stack(sizes)) if len(idx) > 1 else [noise]
    scale = tf.cast(stddev, dtype)
    for i, part in zip(idx, parts):
      noised = tf.cast(leaves[i], dtype) + tf.reshape(part, tf.shape(leaves[i])) * scale
      out[i] = tf.cast(noised, leaves[i].dtype)
  return tf.nest.pack_sequence_as(structure, out)


@serialization.register_query()
class GaussianSumQuery(dp_query.SumAggregationDPQuery):
  """Sum of records clipped to `l2_norm_clip`, plus N(0, stddev^2) noise per coordinate."""

  _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev"])

  def __init__(self, l2_norm_clip, stddev, seed=None, secure_mode=False):
    """l2_norm_clip S, stddev sigma = z S (sum units), seed (tests only: not private),
    secure_mode (noise from os.urandom, sum of two draws: `randomness.SecureRandom`)."""
    self._l2_norm_clip = validation.check_nonnegative("l2_norm_clip", l2_norm_clip)
    self._stddev = validation.check_nonnegative("stddev", stddev, allow_inf=False)
    self._seed = seed
    self._secure_mode = bool(secure_mode)
    self._generator = randomness.make_generator(seed, secure=self._secure_mode)

  def get_config(self):
    p = serialization.plain
    return {"l2_norm_clip": p(self._l2_norm_clip), "stddev": p(self._stddev),
            "seed": p(self._seed), "secure_mode": self._secure_mode}

  @property
  def l2_norm_clip(self):
    return self._l2_norm_clip

  @property
  def stddev(self):
    return self._stddev

  def make_global_state(self, l2_norm_clip, stddev):
    return self._GlobalState(tf.cast(l2_norm_clip, tf.float32), tf.cast(stddev, tf.float32))

  def initial_global_state(self):
    return self.make_global_state(self._l2_norm_clip, self._stddev)

  def derive_sample_params(self, global_state):
    return global_state.l2_norm_clip

  def preprocess_record(self, params, record):
    clipped, _ = dp_query.clip_by_global_l2_norm(record, params)
    return clipped

  def get_noised_result(self, sample_state, global_state):
    result = add_gaussian_noise(self._generator, sample_state, global_state.stddev)
    event = events_lib.GaussianSumEvent(global_state.l2_norm_clip, global_state.stddev)
    return result, global_state, (event,)

  def derive_metrics(self, global_state):
    return collections.OrderedDict(l2_norm_clip=global_state.l2_norm_clip,
                                   stddev=global_state.stddev)
