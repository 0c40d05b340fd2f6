"""Automatic clipping with Gaussian noise (Bu, Wang, Zha and Karypis, "Automatic Clipping:
Differentially Private Deep Learning Made Easier and Stronger", Section 4, AUTO-S).

c_i = S / (||g_i||_2 + gamma), gamma > 0, so ||c_i g_i|| < S: L2 sensitivity S under add or
remove one record (unit: an example, or a microbatch), the noise N(0, (z S)^2 I) and event
`GaussianSumEvent(S, z S)` of DP-SGD. A non-finite norm gets c_i = 0.
"""

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import serialization

DEFAULT_STABILITY = 0.01


def automatic_clip_factors(record_norms, l2_norm_clip, stability):
  """c_i = S / (||g_i||_2 + gamma), 0 for a non-finite norm (Bu et al., AUTO-S, Section 4):
  float32 factors shaped like `record_norms`, c_i ||g_i|| < S (S >= 0 finite, gamma > 0)."""
  norms = tf.cast(record_norms, tf.float32)
  factors = tf.cast(l2_norm_clip, tf.float32) / (norms + tf.cast(stability, tf.float32))
  return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))


@serialization.register_query()
class AutomaticClippingSumQuery(gaussian_query.GaussianSumQuery):
  """Sum of records normalized by S / (||g|| + gamma) (AUTO-S), plus N(0, (z S)^2) noise.

  Sensitivity S under add/remove one record; events those of `GaussianSumQuery`.
  """


  def __init__(self, l2_norm_clip, noise_multiplier, stability=DEFAULT_STABILITY, seed=None,
               secure_mode=False):
    """Builds the query from the clip S, the noise multiplier z and gamma.

    Args:
      l2_norm_clip: S > 0, finite: the bound on each normalized record's L2 norm.
      noise_multiplier: z >= 0, finite: the noise stddev is z S on the sum (0: no noise).
      stability: gamma > 0, finite (Bu et al. use 0.01); in gradient-norm units.
      seed: fixes the noise (tests only: the output is then not private).
      secure_mode: noise from os.urandom (`randomness.SecureRandom`).

    Raises:
      ParameterTypeError: a non-numeric argument.
      PrivacyConfigError: S <= 0 or infinite, z < 0 or infinite, gamma <= 0 or infinite.
    """
    clip = validation.check_positive("l2_norm_clip", l2_norm_clip)
    gamma = validation.check_positive("stability", stability)
    self._noise_multiplier = validation.check_nonnegative("noise_multiplier", noise_multiplier,
                                                          allow_inf=False)
    self._stability = gamma
    super().__init__(clip, gaussian_query.gaussian_stddev(clip, noise_multiplier), seed=seed,
                     secure_mode=secure_mode)

  @classmethod
  def from_noise_multiplier(cls, l2_norm_clip, noise_multiplier, seed=None, secure_mode=False,
                            stability=DEFAULT_STABILITY):
    """The query with clip S, noise multiplier z and gamma.

    Args:
      l2_norm_clip: S > 0, finite (as the constructor).
      noise_multiplier: z >= 0, finite: the noise stddev is z S on the sum.
      seed: fixes the noise (tests only: the output is then not private).
      secure_mode: noise from os.urandom (`randomness.SecureRandom`).
      stability: gamma > 0, finite (in gradient-norm units).
    """
    return cls(l2_norm_clip, noise_multiplier, stability, seed=seed, secure_mode=secure_mode)

  @property
  def noise_multiplier(self):
    """z, the noise stddev in units of S."""
    return self._noise_multiplier

  @property
  def stability(self):
    """gamma, the stability constant of S / (||g|| + gamma)."""
    return self._stability

  def get_config(self):
    """DPQuery.get_config: {l2_norm_clip, noise_multiplier, stability, seed, secure_mode}."""
    p = serialization.plain
    return {"l2_norm_clip": p(self._l2_norm_clip), "noise_multiplier": p(self._noise_multiplier),
            "stability": p(self._stability), "seed": p(self._seed),
            "secure_mode": self._secure_mode}

  def preprocess_record(self, params, record):
    """record * S / (||record||_2 + gamma), over the whole nest.

    Args:
      params: S, from `derive_sample_params`.
      record: a nest of float tensors.

    Returns:
      the normalized record (same structure and dtypes), zeros for a non-finite norm.
    """
    norm = dp_query.global_l2_norm(record)
    factor = automatic_clip_factors(norm, params, self._stability)
    return dp_query.scale_record(record, norm, factor)

  def record_clip_factors(self, params, record_norms):
    """c_i = S / (||x_i||_2 + gamma), 0 for a non-finite norm (`automatic_clip_factors`).

    Args:
      params: S, from `derive_sample_params`.
      record_norms: ||x_i||_2, a float tensor.

    Returns:
      float32 factors shaped like `record_norms`.
    """
    return automatic_clip_factors(record_norms, params, self._stability)
