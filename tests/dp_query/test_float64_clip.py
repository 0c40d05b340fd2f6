"""The per-record clip of a float64 record runs in float64 (dp_query module docstring): its
norm and clip factor are float64, so the clipped record's norm is S up to float64 rounding,
where a float32 norm would leave it up to ~1e-7 S above (the federated server's records)."""

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dpq


def test_float64_record_norm_and_clip_are_float64():
  rng = np.random.default_rng(3)
  for _ in range(20):
    x = rng.normal(size=300) * rng.uniform(1, 1e3)
    norm = dpq.global_l2_norm(tf.constant(x))
    assert norm.dtype == tf.float64
    assert abs(float(norm) - np.linalg.norm(x)) <= 1e-14 * np.linalg.norm(x)
    clipped, _ = dpq.clip_by_global_l2_norm(tf.constant(x), 1.0)
    assert clipped.dtype == tf.float64
    assert abs(np.linalg.norm(np.asarray(clipped)) - 1.0) <= 1e-14


def test_float32_records_keep_the_float32_clip():
  x = tf.constant(np.arange(1, 8, dtype=np.float32))
  assert dpq.global_l2_norm(x).dtype == tf.float32
  assert dpq.global_l2_norm({"a": x, "b": tf.cast(x, tf.float64)}).dtype == tf.float64
