"""Joint clipping of a group of vectors on different scales (McMahan et al. 2018, Section 2).

Pre-processing s(v; alpha) = (v_1/alpha_1, ..., v_k/alpha_k); the scaled record is clipped
jointly to L2 norm S_g; the sum gets N(0, sigma~_g^2) noise; the output is scaled back by
alpha_j. It is the Gaussian sum query with privacy tuple (S_g, sigma~_g) followed by
post-processing, so the noise on vector j has standard deviation alpha_j * sigma~_g.
"""

import collections

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization


@serialization.register_query()
class JointClipQuery(dp_query.SumAggregationDPQuery):
  """Joint clipping of vectors on different scales (McMahan et al. 2018, Section 2).

  Event: the scaled sum's GaussianSumEvent(S_g, sigma~_g) (module docstring).

  Args:
    scales: a nest of alpha_j > 0 matching the record's structure (down to its leaves).
    l2_norm_clip: S_g, the joint clip of the scaled record.
    stddev: sigma~_g, the noise of the scaled sum (the noise on vector j is alpha_j sigma~_g).
    seed: fixes the noise (tests only: not private).

  Raises:
    PrivacyConfigError: a scale <= 0, or a bad clip or stddev.
  """

  _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev"])

  def __init__(self, scales, l2_norm_clip, stddev, seed=None):
    for a in tf.nest.flatten(scales):
      validation.check_positive("scales", a)
    self._scales = scales
    self._l2_norm_clip = validation.check_clip_norm("l2_norm_clip", l2_norm_clip)
    self._stddev = validation.check_nonnegative("stddev", stddev, allow_inf=False)
    self._seed = seed
    self._generator = randomness.make_generator(seed)

  def get_config(self):
    p = serialization.plain
    return {"scales": serialization.encode_nest(self._scales),
            "l2_norm_clip": p(self._l2_norm_clip), "stddev": p(self._stddev),
            "seed": p(self._seed)}

  @classmethod
  def from_config(cls, config):
    config = dict(config)
    config["scales"] = serialization.decode_nest(config["scales"])
    return cls(**config)

  def initial_global_state(self):
    return self._GlobalState(tf.cast(self._l2_norm_clip, tf.float32),
                             tf.cast(self._stddev, tf.float32))

  # The sample params are the global state's clip (the joint clip S_g), as in the Gaussian sum.
  derive_sample_params = gaussian_query.GaussianSumQuery.derive_sample_params

  def _scale(self, record, inverse):
    return dp_query.map_up_to(
        self._scales,
        lambda a, v: v * tf.cast(a, v.dtype) if inverse else v / tf.cast(a, v.dtype),
        self._scales, record)

  def preprocess_record(self, params, record):
    clipped, _ = dp_query.clip_by_global_l2_norm(self._scale(record, inverse=False), params)
    return clipped

  def get_noised_result(self, sample_state, global_state):
    noised = gaussian_query.add_gaussian_noise(self._generator, sample_state, global_state.stddev)
    result = self._scale(noised, inverse=True)
    return result, global_state, (events_lib.GaussianSumEvent(global_state.l2_norm_clip,
                                                              global_state.stddev),)
