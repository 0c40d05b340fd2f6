"""Ghost norm of a lookup-table gradient (shared by the LoRA embedding and the
position-embedding rules).

A table T read at rows id_t with a gradient d_t at each read position has the
per-example gradient G_i = sum_t e_{id_t} d_t^T, so

    ||G_i||_F^2 = sum_{t,s} [id_t == id_s] <d_t, d_s>

(repeated rows add up; Lee & Kifer 2021, Sec. 3, for embeddings).
"""

import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra


def same_id_sqr_norm(ids, d):
  """Per-record ||sum_t e_{id_t} d_t^T||^2 for ids [B, T] (int), d [B, T, K].

  Records of k consecutive examples (registry.examples_per_record) merge their
  positions. Returns [B/k] float32.
  """
  d = algebra.regroup_btk(tf.cast(d, tf.float32))
  ids = algebra.regroup_btk(ids[:, :, None])[:, :, 0]
  if algebra.static_dim(ids, 1) == 1:
    return algebra.sqr_sum(d)
  same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), tf.float32)
  return tf.reduce_sum(same * tf.einsum("btk,bsk->bts", d, d), axis=[1, 2])


def flat_ids(ids):
  """ids [B] or [B, d1, ...] -> [B, T] int32 (T = 1 for [B]).

  Args:
    ids: integer ids [B] or [B, d1, ...].

  Returns:
    [B, T] int32.
  """
  if ids.dtype not in (tf.int32, tf.int64):
    ids = tf.cast(ids, tf.int32)
  if ids.shape.rank == 1:
    return ids[:, None]
  return tf.reshape(ids, [tf.shape(ids)[0], algebra.static_positions(ids.shape[1:])])
