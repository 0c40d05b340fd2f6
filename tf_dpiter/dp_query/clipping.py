"""The per-record L2 clip, the one place its arithmetic lives (McMahan et al. 2018, Section 1).

A record x (a nest of tensors read as one concatenated vector) is clipped to L2 norm S by

    pi_S(x) = c * x,   c = min(1, S / ||x||_2)

(McMahan et al. 2018, Sec. 2, flat clipping). Every path that clips does it through this
module: `GaussianSumQuery.preprocess_record` (one record at a time, `clip_by_global_l2_norm`),
and the fast (ghost-norm) path of tf_dpiter.keras, which obtains the norms ||g_i|| of a batch
without the per-record gradients and asks the query for the factors c_i
(`DPQuery.record_clip_factors`, built on `clip_factors`). The correlated-noise queries use
the same functions. Everything here is float32 (float64 records stay float64 only in the
product) and works in graph mode and under XLA. Imports nothing above TensorFlow.
"""

import tensorflow as tf

# ||x|| below this is taken as this: ||x|| = 0 gives factor min(1, S / 1e-30) = 1 (S > 0).
_TINY_NORM = 1e-30


def global_l2_norm(record):
  """||x||_2 of a nest of tensors taken as one concatenated vector (float32).

  Args:
    record: a nest of numeric tensors.

  Returns:
    a scalar float32 tensor.
  """
  leaves = [tf.cast(x, tf.float32) for x in tf.nest.flatten(record)]
  return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(x)) for x in leaves]))


def _raw_factors(norms, l2_norm_clip):
  """min(1, S / max(||x||, 1e-30)) in float32, no special case for a non-finite norm."""
  clip = tf.cast(l2_norm_clip, tf.float32)
  return tf.minimum(1.0, clip / tf.maximum(tf.cast(norms, tf.float32), _TINY_NORM))


def clip_factors(record_norms, l2_norm_clip):
  """The clip factors c_i = min(1, S / ||g_i||_2) of records whose norms are known.

  A record whose norm is not finite (inf or NaN: its gradient overflowed) gets c_i = 0, so
  it adds nothing to a clipped sum: a function of that record alone, which keeps the
  sensitivity bound S. ||g_i|| = 0 gives c_i = 1; S = +inf gives 1 for every finite norm.

  Args:
    record_norms: ||g_i||_2 >= 0, a float tensor of any shape (e.g. [B], one per record).
    l2_norm_clip: S >= 0, a number or scalar tensor.

  Returns:
    a float32 tensor shaped like `record_norms`, each entry in [0, 1].
  """
  norms = tf.cast(record_norms, tf.float32)
  factors = _raw_factors(norms, l2_norm_clip)
  return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))


def clip_by_global_l2_norm(record, l2_norm_clip):
  """pi_S(x) = x * min(1, S / ||x||_2) (McMahan et al. 2018, Section 1), over the whole nest.

  Args:
    record: a nest of float tensors x.
    l2_norm_clip: S >= 0, a number or scalar tensor; S = +inf leaves x unchanged, and
      ||x|| = 0 gives factor 1.

  Returns:
    (clipped_record, norm_before_clipping): the clipped nest (same dtypes) and ||x||_2.
  """
  norm = global_l2_norm(record)
  factor = _raw_factors(norm, l2_norm_clip)
  clipped = tf.nest.map_structure(lambda x: x * tf.cast(factor, x.dtype), record)
  return clipped, norm

